"""Benchmark scripts keep their output in a run folder (``runs/benchmarks/<script>/<time>/``), never in docs/."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT

SCRIPTS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if p.name != "timing.py")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_every_benchmark_records_its_output(script):
    text = script.read_text()
    assert "with recorded(__file__):" in text, f"{script.name}: run main() inside `with recorded(__file__):`"
    assert not re.search(r"[\"']docs/", text), f"{script.name} writes to a docs/ path (only --write-docs may)"


@pytest.mark.e2e
def test_a_benchmark_run_lands_in_its_folder(tmp_path):
    env = {**os.environ, "LOWRANK_RUN_ROOT": str(tmp_path / "runs"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "glvq_layouts.py"), "--out", "128", "--in", "256",
                           "--repeats", "2"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (folder,) = (tmp_path / "runs" / "benchmarks" / "glvq_layouts").iterdir()
    assert (folder / "output.md").read_text() == proc.stdout and proc.stdout.strip()
    assert (folder / "command.txt").read_text().startswith("python ")
