"""Every registered method lands whole: configs, a sweep, a docs page with results and commands, tests, a slow must-show.

Parametrized over the registry (as timm's registry drives its tests), so a new method that registers
itself is checked without anyone adding it here.
"""

from __future__ import annotations

import re

import pytest
import yaml

from lowrank_lit import registry
from tests.helpers import ROOT

METHODS = registry.scan_methods()
_NUMBER_CELL = re.compile(r"\|\s*[*+-]*\d")


def _page(slug: str):
    return next((p for p in (ROOT / "docs" / "methods" / f"{slug}.md", ROOT / "docs" / f"{slug}.md") if p.is_file()), None)


def _test_file(slug: str):
    return next((p for p in (ROOT / "tests" / "methods" / f"test_{slug}.py", ROOT / "tests" / f"test_{slug}.py") if p.is_file()), None)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.slug)
def test_method_has_configs_and_a_sweep(method):
    configs = method.configs()
    assert configs, f"no configs/{method.slug}/*.yaml"
    sweeps = []
    for path in sorted((ROOT / "sweeps").glob("*.yaml")):
        command = " ".join(str(c) for c in (yaml.safe_load(path.read_text()) or {}).get("command", []))
        if f"configs/{method.slug}/" in command:
            sweeps.append(path.name)
    assert sweeps, f"no sweeps/*.yaml runs a configs/{method.slug}/ config"


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.slug)
def test_method_has_a_docs_page_with_results_and_commands(method):
    page = _page(method.slug)
    assert page is not None, f"no docs/methods/{method.slug}.md"
    text = page.read_text()
    table_rows = [ln for ln in text.splitlines() if ln.startswith("|") and _NUMBER_CELL.search(ln)]
    assert table_rows, f"{page.name}: no results table (a markdown row with a number)"
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert any("lowrank " in b for b in blocks), f"{page.name}: no ```bash block with a lowrank command"
    for slug in re.findall(r"lowrank summarize (\w+)", text):
        from lowrank_lit.report import get_summary

        get_summary(slug)  # every summarize command in the docs resolves


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.slug)
def test_method_has_tests_and_a_slow_must_show(method):
    path = _test_file(method.slug)
    assert path is not None, f"no tests/methods/test_{method.slug}.py"
    assert "@pytest.mark.slow" in path.read_text(), f"{path.name}: no @pytest.mark.slow must-show test"


def test_summarize_cli_errors_name_the_choices(capsys):
    from lowrank_lit.cli import main

    assert main(["summarize", "nosuch", "runs"]) == 2
    err = capsys.readouterr().err
    assert "'nosuch' is not a registered method" in err and "q3r" in err and "strank" in err
