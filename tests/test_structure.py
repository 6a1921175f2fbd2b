"""The package's imports point one way: the CLI on top, launchers below, methods below them, shared code at the bottom.

Every ``import lowrank_lit...`` in every module (function-level imports included) is an arrow; the
graph must have no cycle, shared modules (nn, models, data, linalg, tta, optim, callbacks, report,
registry, loggers, checkpoint) must not import a method, and nothing but the entry point imports the CLI.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

PACKAGE = ROOT / "lowrank_lit"
SHARED = ("nn", "models", "data", "linalg", "argtypes", "tta", "optim", "callbacks", "report", "registry", "loggers", "envs", "checkpoint",
          "studies")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """``module -> {lowrank_lit modules it imports}``, resolved to modules that exist (not to names)."""
    modules = {_module_name(p): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                if t.startswith("lowrank_lit"):
                    while t not in modules and "." in t:  # `from x import name`: the module is x
                        t = t.rsplit(".", 1)[0]
                    if t in modules and t != name:
                        deps.add(t)
                        break
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _is_package_init(name: str) -> bool:
    return (ROOT / Path(*name.split(".")) / "__init__.py").is_file()


def test_no_import_cycles():
    graph = import_graph()
    # a package __init__ that re-exports its own submodules is not a cycle with them
    pruned = {m: {d for d in deps if not (_is_package_init(m) and d.startswith(m + "."))} for m, deps in graph.items()}
    assert find_cycle(pruned) is None, " -> ".join(find_cycle(pruned) or [])


def test_shared_modules_do_not_import_methods():
    bad = [(m, d) for m, deps in import_graph().items() for d in deps
           if m.split(".")[1] in SHARED and d.startswith("lowrank_lit.methods")]
    assert bad == []


def test_only_the_entry_point_imports_the_cli():
    users = sorted(m for m, deps in import_graph().items() if "lowrank_lit.cli" in deps)
    assert users == ["lowrank_lit.__main__"]


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "lowrank_lit"


def test_every_package_is_in_the_package_order():
    from lowrank_lit import LAYERS

    packages = {_package(m) for m in import_graph()} - {"lowrank_lit"}
    assert packages == set(LAYERS), sorted(packages ^ set(LAYERS))


def test_imports_go_down_the_package_order():
    """Package level: no module imports from a package above its own in ``lowrank_lit.LAYERS`` (so no package
    cycle such as tta -> data -> models -> tta can form, even when every module-level edge looks harmless)."""
    from lowrank_lit import LAYERS

    rank = {p: i for i, p in enumerate(LAYERS)}
    upward = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps
                    if _package(m) != "lowrank_lit" and _package(d) != _package(m)
                    and rank[_package(d)] <= rank[_package(m)])
    assert not upward, upward


def test_only_the_run_api_reads_the_trainer_root_dir():
    """Where a run writes is asked of ``report.run_directory`` / ``artifact_path``; launch/ sets it."""
    offenders = [f"{path.relative_to(ROOT)}:{i}" for path in sorted(PACKAGE.rglob("*.py"))
                 if "launch" not in path.relative_to(PACKAGE).parts and path.name != "report.py"
                 for i, line in enumerate(path.read_text().splitlines(), 1) if "default_root_dir" in line]
    assert not offenders, offenders


def test_no_method_imports_another_method():
    """One file per paper: shared pieces live below methods (nn, models, data, studies, ...), never in a method."""
    bad = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps
                 if m.startswith("lowrank_lit.methods.") and d.startswith("lowrank_lit.methods.")
                 and d != "lowrank_lit.methods" and d.split(".")[2] != m.split(".")[2])
    assert not bad, bad


def import_strings(source: str) -> list[tuple[int, str]]:
    """``(line, dotted path)`` of every string literal that names a lowrank_lit module or object by import path
    (``"lowrank_lit.x.y"`` or ``"lowrank_lit.x.y:f"``), the way configs, registrations and command tables do."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value.split(":", 1)[0]
            # a prefix ("lowrank_lit.methods.") matches class paths in run configs; it imports nothing
            if text.startswith("lowrank_lit.") and not text.endswith(".") and not any(c in text for c in " /\n"):
                out.append((node.lineno, text))
    return sorted(out)


def test_import_strings_go_down_the_package_order():
    """A dotted path in a string is an import made later (a registration, a table of commands): it may not point
    up the package order either, or the layering holds only for the imports the other tests can see."""
    from lowrank_lit import LAYERS

    rank = {p: i for i, p in enumerate(LAYERS)}
    modules = set(import_graph())
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = _package(_module_name(path))
        for line, text in import_strings(path.read_text()):
            target = text
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            there = _package(target)
            if here != "lowrank_lit" and there not in ("lowrank_lit", here) and rank[there] <= rank[here]:
                upward.append(f"{path.relative_to(ROOT)}:{line}: {text!r}")
    assert not upward, upward


def test_import_string_finder_finds_them():
    src = 'X = {"a": "lowrank_lit.studies.peft_suite.summary"}\ny = "lowrank_lit.cli:main"\nz = "see lowrank_lit docs"\n'
    src += 'w = "lowrank_lit.methods."'
    assert import_strings(src) == [(1, "lowrank_lit.studies.peft_suite.summary"), (2, "lowrank_lit.cli")]


def test_the_design_page_names_every_package():
    import re

    from lowrank_lit import LAYERS

    text = (ROOT / "DESIGN.md").read_text()
    block = text[text.index("```\n__main__"):]
    block = block[: block.index("```", 3)]
    named = {n for line in block.splitlines()[1:] for n in re.findall(r"[a-z_]+", line[:20])}
    assert set(LAYERS) <= named, sorted(set(LAYERS) - named)


def test_the_exporter_names_no_method_and_no_layer():
    """launch/export.py asks the layers (``to_peft``, ``unwrap``) and callbacks (``factorize``) what they are, through
    the protocol of lowrank_lit.nn.export: it imports no method and no layer class, so a new one needs no edit there."""
    tree = ast.parse((PACKAGE / "launch" / "export.py").read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lowrank_lit."):
            if node.module.startswith("lowrank_lit.methods"):
                bad.append(node.module)
            elif node.module.startswith("lowrank_lit.nn") and node.module != "lowrank_lit.nn.export":
                bad += [f"{node.module}.{a.name}" for a in node.names if a.name[:1].isupper()]
    assert not bad, bad
