"""The README stays true: method table from the registry, Quickstart commands, CI reads them."""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers import ROOT

README = (ROOT / "README.md").read_text()


def _block_after(marker: str) -> str:
    m = re.search(rf"<!-- {marker} -->\s*```bash\n(.*?)\n```", README, re.S)
    assert m, f"no ```bash block after <!-- {marker} -->"
    return m.group(1).strip()


def test_method_table_matches_registry():
    from lowrank_lit.cli import methods_markdown

    table = README.split("<!-- methods:begin -->\n")[1].split("<!-- methods:end -->")[0]
    assert table == methods_markdown(), "README method table is stale: run `lowrank list --markdown`"


def test_method_pages_list_matches_registry():
    from lowrank_lit.cli import method_pages_markdown

    pages = README.split("<!-- pages:begin -->\n")[1].split("<!-- pages:end -->")[0]
    assert pages == method_pages_markdown(), "README method pages are stale: run `lowrank list --pages`"


def test_quickstart_has_two_single_line_commands():
    main, test = _block_after("quickstart:main"), _block_after("quickstart:test")
    for cmd in (main, test):
        assert "\n" not in cmd and 'pip install -e ".[dev]"' in cmd
    # the first thing a newcomer runs: a method against its baseline, about a minute on 2 cores
    runs = re.findall(r"lowrank fit --config (\S+)", main)
    assert runs == ["configs/q3r/mlp_digits.yaml", "configs/q3r/mlp_digits_adamw.yaml"]
    assert all((ROOT / r).is_file() for r in runs)
    assert "lowrank fit --config configs/baseline/vit_tiny_digits.yaml" in README  # the next example
    assert "pytest" in test


@pytest.mark.e2e
def test_ci_runs_the_readme_test_command():
    script = ROOT / ".ci" / "run"
    awk = re.search(r"cmd=\$\((awk .*?README\.md)\)", script.read_text())
    assert awk, ".ci/run no longer extracts the README command"
    out = subprocess.run(["bash", "-c", awk.group(1)], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == _block_after("quickstart:test")


def test_the_index_is_what_importing_every_module_registers():
    """`lowrank list` reads the checked-in index; it must say what importing every module of the package registers
    (a registration anywhere, with computed arguments too, is found by importing, never by reading source text)."""
    from lowrank_lit import registry

    indexed = registry.scan_methods()
    assert indexed == registry.import_every_module(), "the index is stale: python -m lowrank_lit.registry"
    assert registry.scan_studies() == registry.registered_studies(), "the index is stale: python -m lowrank_lit.registry"
    assert len(indexed) == 20 and indexed[0].slug == "baseline"
