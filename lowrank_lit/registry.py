"""Method registry behind ``lowrank list``.

Each paper's module registers its public component once, naming the function of the same module that
turns its runs into a result table (``lowrank summarize <slug>``)::

    @register_method("q3r", kind="Callback", paper="Q3R: quadratic reweighted rank regularizer", summary="compare")
    class Q3R(Callback): ...

A study that spans several methods registers its summary the same way, in its own module (``lowrank summarize
<name>``)::

    @register_study("peft_suite")
    def summary(roots, out=None): ...

The registry only records metadata; it never imports heavy libraries. ``lowrank list`` and ``lowrank summarize``
read the checked-in index ``lowrank_lit/index.json`` (:func:`scan_methods`, :func:`scan_studies`: no torch, no
Lightning, no source text), which ``python -m lowrank_lit.registry`` writes from what importing every module of the
package registers (:func:`write_index`); a test fails, naming that command, when the two differ. :func:`load_all`
imports the modules the index names, so that their decorators run.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["MethodInfo", "register_method", "registered_methods", "get_method", "load_all", "scan_methods", "KINDS",
           "INDEX", "write_index", "import_dotted", "register_study", "registered_studies", "scan_studies"]

#: Kinds a registered component may have (what a user imports it as), each with the base class it has
#: (``tests/test_contract.py`` checks every registered class against it, and one behaviour per kind):
#:
#: * ``LightningModule``: a training scheme or model (``lightning.pytorch.LightningModule``);
#: * ``Callback``: a regularizer or post-training step attached to any run (``lightning.pytorch.Callback``);
#: * ``Optimizer``: a ``torch.optim.Optimizer``;
#: * ``Loss``: an ``nn.Module`` returning a differentiable scalar;
#: * ``Layer``: an ``nn.Module`` inserted into a model (prompts, adapters);
#: * ``TTAMethod``: a test-time adaptation rule (:class:`lowrank_lit.tta.base.TTAMethod`);
#: * ``Analysis``: a ``LightningModule`` that evaluates and trains nothing (run by ``lowrank test``).
KINDS = ("LightningModule", "Callback", "Optimizer", "Loss", "Layer", "TTAMethod", "Analysis")

_SLUG_RE = re.compile(r"^[a-z][a-z0-9_]*$")
T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class MethodInfo:
    """What ``lowrank list`` shows about one method.

    Attributes:
        slug: short snake_case name; configs live in ``configs/<slug>/``.
        kind: one of :data:`KINDS`.
        paper: paper title.
        target: dotted import path of the registered object.
        summary: dotted path of the method's summary function ``fn(roots, out=None, **options) -> markdown``
            (``lowrank summarize <slug>``), or None.
        bench: dotted path of the method's cost benchmark ``fn(ctx: BenchContext) -> list[BenchRow]``
            (``lowrank bench <slug>``, :mod:`lowrank_lit.bench`), or None.
    """

    slug: str
    kind: str
    paper: str
    target: str
    summary: str | None = None
    bench: str | None = None

    def configs(self, root: Path | None = None) -> list[str]:
        """Config files of this method, relative to the project root (sorted)."""
        root = root or project_root()
        folder = root / "configs" / self.slug
        return sorted(str(p.relative_to(root)) for p in folder.glob("*.yaml")) if folder.is_dir() else []


_REGISTRY: dict[str, MethodInfo] = {}


def register_method(slug: str, kind: str, paper: str, summary: str | None = None,
                    bench: str | None = None) -> Callable[[T], T]:
    """Class/function decorator that registers a method component under ``slug``.

    Args:
        slug: snake_case method name, e.g. ``"q3r"``; must match ``configs/<slug>/``.
        kind: what the component is, one of :data:`KINDS`.
        paper: the paper title.
        summary: name of the function in the same module that summarizes the method's runs
            (``fn(roots, out=None, **options) -> markdown``; its docstring's first line is its help). Default: None.
        bench: name of the function in the same module that measures the method's cost against its baseline
            (``fn(ctx) -> list[BenchRow]``, see :mod:`lowrank_lit.bench`). Default: None.

    Raises:
        ValueError: if ``slug`` is not snake_case, ``kind`` is unknown, or ``slug`` is already
            registered to a different object.
    """
    if not _SLUG_RE.match(slug):
        raise ValueError(f"register_method: slug={slug!r} must be snake_case ([a-z][a-z0-9_]*)")
    if kind not in KINDS:
        raise ValueError(f"register_method: kind={kind!r} is not one of {', '.join(KINDS)}")

    def decorator(obj: T) -> T:
        _record(_REGISTRY, slug, kind, paper, f"{obj.__module__}.{obj.__qualname__}",
                f"{obj.__module__}.{summary}" if summary else None, f"{obj.__module__}.{bench}" if bench else None)
        return obj

    return decorator


#: the registered studies: name -> dotted path of the summary function
_STUDIES: dict[str, str] = {}


def register_study(name: str) -> Callable[[F], F]:
    """Function decorator that registers a study's summary (``fn(roots, out=None, **options) -> markdown``, its
    docstring's first line is its help) under ``name``: ``lowrank summarize <name>`` runs it. One call, in the study's
    own module, is all a new study needs (then ``python -m lowrank_lit.registry`` rewrites the index).

    Raises:
        ValueError: ``name`` is not snake_case, or is a study or method registered to another function.
    """
    if not _SLUG_RE.match(name):
        raise ValueError(f"register_study: name={name!r} must be snake_case ([a-z][a-z0-9_]*)")

    def decorator(fn: F) -> F:
        target = f"{fn.__module__}.{fn.__qualname__}"
        if _STUDIES.get(name, target) != target or name in _REGISTRY:
            raise ValueError(f"register_study: {name!r} is already registered to "
                             f"{_STUDIES.get(name) or _REGISTRY[name].target}")
        _STUDIES[name] = target
        return fn

    return decorator


def registered_studies() -> dict[str, str]:
    """The registered studies, name -> dotted path of the summary, sorted by name."""
    return dict(sorted(_STUDIES.items()))


def _record(table: dict[str, MethodInfo], slug: str, kind: str, paper: str, target: str,
            summary: str | None = None, bench: str | None = None) -> None:
    """Enter one registration into ``table`` (registering the same object again is a no-op).

    Raises:
        ValueError: ``slug`` is already registered to another object (one registered component per method).
    """
    old = table.get(slug)
    if old is not None and old.target != target:
        raise ValueError(f"register_method: slug {slug!r} is already registered to {old.target}")
    table[slug] = MethodInfo(slug, kind, paper, target, summary, bench)


def project_root() -> Path:
    """The checkout holding ``configs/`` (the package's parent), else the working directory."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "configs").is_dir() else Path.cwd()


def load_all(slugs: Iterable[str] | None = None) -> None:
    """Import every module that registers a method (found by :func:`scan_methods`), so their decorators run.

    Args:
        slugs: import only the modules of these methods. Default: all.
    """
    wanted = None if slugs is None else set(slugs)
    modules = {info.target.rpartition(".")[0] for info in scan_methods() if wanted is None or info.slug in wanted}
    for module in sorted(modules):
        importlib.import_module(module)


def import_dotted(path: str) -> Any:
    """The object a dotted path names: ``"torch.optim.AdamW"`` -> the class (its module is imported); how a
    registration's ``target``, ``summary`` and ``bench`` and a config's ``class_path`` are resolved."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def registered_methods() -> list[MethodInfo]:
    """All registered methods, sorted by slug (call :func:`load_all` first for the full list)."""
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def get_method(slug: str) -> MethodInfo:
    """Look up one method by slug; the error lists the known slugs."""
    try:
        return _REGISTRY[slug]
    except KeyError:
        raise KeyError(f"unknown method {slug!r}; registered: {', '.join(sorted(_REGISTRY)) or '(none)'}") from None


#: the checked-in index of the registrations, methods and studies (``python -m lowrank_lit.registry`` writes it)
INDEX = Path(__file__).resolve().parent / "index.json"


def _read_index(index: Path | None) -> dict[str, Any]:
    path = index or INDEX
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no index of the registrations; write it with python -m lowrank_lit.registry")
    return dict(json.loads(path.read_text()))


def scan_methods(index: Path | None = None) -> list[MethodInfo]:
    """The registered methods, read from the checked-in index (:data:`INDEX`) without importing any module.

    Raises:
        FileNotFoundError: no index (write it: ``python -m lowrank_lit.registry``).
    """
    return [MethodInfo(**row) for row in _read_index(index)["methods"]]


def scan_studies(index: Path | None = None) -> dict[str, str]:
    """The registered studies (name -> dotted path of the summary), read from the checked-in index (:data:`INDEX`)
    without importing any module."""
    return dict(_read_index(index)["studies"])


def import_every_module() -> list[MethodInfo]:
    """Import every module of the package (so that every ``register_method`` and ``register_study`` runs) and return
    the methods (:func:`registered_studies` has the studies)."""
    for info in pkgutil.walk_packages([str(Path(__file__).resolve().parent)], "lowrank_lit."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    return registered_methods()


def write_index(index: Path | None = None) -> Path:
    """Write :data:`INDEX` from what importing every module registers."""
    path = index or INDEX
    rows = [dataclasses.asdict(info) for info in import_every_module()]
    path.write_text(json.dumps({"methods": rows, "studies": registered_studies()}, indent=1) + "\n")
    return path


if __name__ == "__main__":  # run as a script this file is __main__; the decorators fill the imported module's table
    _imported = importlib.import_module("lowrank_lit.registry")
    print(f"wrote {_imported.write_index()} ({len(_imported.scan_methods())} methods, "
          f"{len(_imported.scan_studies())} studies)", file=sys.stderr)
