"""Which tests belong to the end-to-end tier (``-m e2e``), read from their source.

A test is end to end when it (or a fixture or module-level helper it uses, followed through the file and
``tests/helpers.py``) starts the CLI (``run_cli``, ``fitted_checkpoint``, ``lowrank_lit.cli.main`` or a verb's
``main``), a subprocess or another process (``subprocess``, ``multiprocessing``, ``torch.multiprocessing.spawn``),
a sweep or a matrix, builds a run from a config (``build_from_config``, a grid's ``check_cells``), or runs a
Lightning ``Trainer`` (``.fit(``, and ``.test(`` / ``.validate(`` / ``.predict(`` of a trainer: a static reading
cannot count steps, so every loop is counted). ``tests/test_tiers.py`` asserts that each such test carries the ``e2e`` marker, so the unit tier
(``pytest -m "not e2e"``) stays fast as tests are added.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

#: names whose call starts a run, a process or a fit
E2E_CALLS = frozenset({
    "run_cli", "fitted_checkpoint", "run_sweep", "run_matrix", "main", "fit", "spawn", "Popen", "run", "check_call",
    "check_output", "Process", "start_processes", "_run_cells",
})
#: functions that start or build a run whatever they are called through
_BUILDERS = frozenset({"run_cli", "fitted_checkpoint", "run_sweep", "run_matrix", "_run_cells", "build_from_config",
                       "check_cells"})
#: modules whose attribute calls count (``subprocess.run``; ``x.run`` of anything else does not)
_PROCESS_MODULES = frozenset({"subprocess", "mp", "multiprocessing", "torch.multiprocessing", "verbs", "cli", "sweep",
                              "matrix"})


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _starts_something(call: ast.Call, imported: dict[str, str]) -> bool:
    """Whether one call starts the CLI, a process, a sweep or a fit."""
    func = call.func
    if isinstance(func, ast.Attribute):
        if func.attr == "fit" or (func.attr in ("test", "validate", "predict")
                                  and "trainer" in ast.unparse(func.value).lower()):
            return True
        owner = _dotted(func.value)
        return func.attr in E2E_CALLS and (owner in _PROCESS_MODULES or imported.get(owner, "").startswith(
            ("subprocess", "multiprocessing", "torch.multiprocessing", "lowrank_lit.cli", "lowrank_lit.launch")))
    if isinstance(func, ast.Name):
        origin = imported.get(func.id, "")
        if func.id in _BUILDERS:
            return True
        if origin.startswith(("subprocess", "multiprocessing", "torch.multiprocessing")):
            return True
        return origin.startswith(("lowrank_lit.cli.", "lowrank_lit.launch.")) and origin.rsplit(".", 1)[1] in E2E_CALLS
    return False


@dataclass
class Candidate:
    name: str
    line: int
    marked: bool


def _imports(tree: ast.Module) -> dict[str, str]:
    """``local name -> dotted origin`` of every import in the file (function-level ones too)."""
    names: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    return names


def _has_mark(decorators: list[ast.expr], *names: str) -> bool:
    return any(f"mark.{name}" in ast.unparse(d) for d in decorators for name in names)


#: tiers outside the default run (``pytest -m slow``, ``-m rehearsal``, ``-m gpu``): they need no ``e2e``
OUTSIDE = ("slow", "rehearsal", "gpu")


def _functions(tree: ast.Module) -> dict[str, ast.AST]:
    """Module-level functions, the methods of module-level classes and module-level assignments (a table of
    lambdas that each run something), by name."""
    found: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    found[target.id] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found.setdefault(item.name, item)
    return found


@functools.cache
def _helper_starters() -> set[str]:
    """Helpers of tests/helpers.py that start something themselves."""
    path = Path(__file__).with_name("helpers.py")
    tree = ast.parse(path.read_text())
    return _starting(tree, _functions(tree), _imports(tree), set())


def _starting(tree: ast.Module, functions: dict[str, ast.AST], imported: dict[str, str],
              outside: set[str]) -> set[str]:
    """Names of the file's functions that start something, directly or through another function of the file (or a
    name in ``outside``); a function's parameters count as uses of the fixtures of those names."""
    direct = {name for name, fn in functions.items()
              if any(isinstance(n, ast.Call) and _starts_something(n, imported) for n in ast.walk(fn))}
    uses = {name: {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
            | ({a.arg for a in fn.args.args} if isinstance(fn, ast.FunctionDef) else set())
            for name, fn in functions.items()}
    starting = set(direct)
    changed = True
    while changed:
        changed = False
        for name, used in uses.items():
            if name not in starting and used & (starting | outside):
                starting.add(name)
                changed = True
    return starting


def e2e_candidates(path: Path) -> tuple[list[Candidate], bool]:
    """The tests of a file that start something (with whether each carries ``e2e``), and whether the whole file is
    marked (``pytestmark`` names ``e2e``)."""
    tree = ast.parse(path.read_text())
    marks = " ".join(ast.unparse(n.value) for n in tree.body
                     if isinstance(n, ast.Assign) and any(_dotted(t) == "pytestmark" for t in n.targets))
    file_marked = "mark.e2e" in marks
    if any(f"mark.{name}" in marks for name in OUTSIDE):
        return [], True
    functions = _functions(tree)
    starting = _starting(tree, functions, _imports(tree), _helper_starters())
    out = []
    for node in tree.body:
        candidates = [node] if isinstance(node, ast.FunctionDef) else (
            [i for i in node.body if isinstance(i, ast.FunctionDef)] if isinstance(node, ast.ClassDef) else [])
        class_marks = node.decorator_list if isinstance(node, ast.ClassDef) else []
        for fn in candidates:
            if fn.name.startswith("test") and fn.name in starting and not _has_mark(fn.decorator_list + class_marks, *OUTSIDE):
                out.append(Candidate(fn.name, fn.lineno, _has_mark(fn.decorator_list + class_marks, "e2e")))
    return out, file_marked
