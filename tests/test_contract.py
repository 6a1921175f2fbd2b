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
    """The method's main test file: ``tests/methods/test_<slug>.py`` or ``tests/methods/<slug>/test_<slug>.py``
    (the baseline, not a paper's method: ``tests/test_baseline.py``)."""
    methods = ROOT / "tests" / "methods"
    candidates = (methods / f"test_{slug}.py", methods / slug / f"test_{slug}.py", ROOT / "tests" / f"test_{slug}.py")
    return next((p for p in candidates if p.is_file()), None)


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


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.slug)
def test_method_tests_live_in_one_place(method):
    """One home per method: a file ``tests/methods/test_<slug>.py`` or a folder ``tests/methods/<slug>/``, not both,
    and no test module elsewhere imports the method's module at its top (cross-cutting tests import inside a test)."""
    import ast

    slug = method.slug
    methods = ROOT / "tests" / "methods"
    assert not ((methods / f"test_{slug}.py").is_file() and (methods / slug).is_dir()), f"{slug}: a file and a folder"
    home = methods / slug if (methods / slug).is_dir() else _test_file(slug)
    strays = []
    for path in (ROOT / "tests").rglob("test_*.py"):
        if path == home or home in path.parents:
            continue
        for node in ast.parse(path.read_text()).body:  # module level only
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in getattr(node, "names", [])] \
                if isinstance(node, ast.Import) else []
            if any(n == f"lowrank_lit.methods.{slug}" or n.startswith(f"lowrank_lit.methods.{slug}.") for n in names):
                strays.append(path.relative_to(ROOT).as_posix())
    assert not strays, f"{slug}: tests outside {home.relative_to(ROOT)}: {strays}"


def test_summarize_cli_errors_name_the_choices(capsys):
    from lowrank_lit.cli import main

    assert main(["summarize", "nosuch", "runs"]) == 2
    err = capsys.readouterr().err
    assert "'nosuch' is not a registered method" in err and "q3r" in err and "strank" in err
