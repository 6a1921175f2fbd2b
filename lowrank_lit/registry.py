"""Method registry behind ``lowrank list``.

Each paper's module registers its public component once::

    @register_method("q3r", kind="Callback", paper="Q3R: quadratic reweighted rank regularizer")
    class Q3R(Callback): ...

The registry only records metadata; it never imports heavy libraries. ``lowrank list`` imports
every module under :mod:`lowrank_lit.methods` (and the baseline) so that their decorators run.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

__all__ = ["MethodInfo", "register_method", "registered_methods", "get_method", "load_all", "KINDS"]

#: Kinds a registered component may have (what a user imports it as).
KINDS = ("LightningModule", "Callback", "Optimizer", "Loss", "Module", "DataModule", "Analysis", "Sampler")

_SLUG_RE = re.compile(r"^[a-z][a-z0-9_]*$")
T = TypeVar("T")


@dataclass(frozen=True)
class MethodInfo:
    """What ``lowrank list`` shows about one method.

    Attributes:
        slug: short snake_case name; configs live in ``configs/<slug>/``.
        kind: one of :data:`KINDS`.
        paper: paper title.
        target: dotted import path of the registered object.
        components: further public objects of the method (dotted paths).
    """

    slug: str
    kind: str
    paper: str
    target: str
    components: tuple[str, ...] = field(default=())

    def configs(self, root: Path | None = None) -> list[str]:
        """Config files of this method, relative to the project root (sorted)."""
        root = root or project_root()
        folder = root / "configs" / self.slug
        return sorted(str(p.relative_to(root)) for p in folder.glob("*.yaml")) if folder.is_dir() else []


_REGISTRY: dict[str, MethodInfo] = {}


def register_method(slug: str, kind: str, paper: str) -> Callable[[T], T]:
    """Class/function decorator that registers a method component under ``slug``.

    Args:
        slug: snake_case method name, e.g. ``"q3r"``; must match ``configs/<slug>/``.
        kind: what the component is, one of :data:`KINDS`.
        paper: the paper title.

    Raises:
        ValueError: if ``slug`` is not snake_case, ``kind`` is unknown, or ``slug`` is already
            registered to a different object.
    """
    if not _SLUG_RE.match(slug):
        raise ValueError(f"register_method: slug={slug!r} must be snake_case ([a-z][a-z0-9_]*)")
    if kind not in KINDS:
        raise ValueError(f"register_method: kind={kind!r} is not one of {', '.join(KINDS)}")

    def decorator(obj: T) -> T:
        target = f"{obj.__module__}.{obj.__qualname__}"
        old = _REGISTRY.get(slug)
        if old is not None and old.target != target:
            if old.kind == kind and old.paper == paper:
                # a second component of the same method (e.g. a loss and its module)
                _REGISTRY[slug] = MethodInfo(slug, kind, paper, old.target, (*old.components, target))
                return obj
            raise ValueError(f"register_method: slug {slug!r} is already registered to {old.target}")
        _REGISTRY[slug] = MethodInfo(slug, kind, paper, target)
        return obj

    return decorator


def project_root() -> Path:
    """The checkout holding ``configs/`` (the package's parent), else the working directory."""
    here = Path(__file__).resolve().parent.parent
    return here if (here / "configs").is_dir() else Path.cwd()


def load_all() -> None:
    """Import every method module (and the baseline) so their registrations run."""
    importlib.import_module("lowrank_lit.models.classifier")
    import lowrank_lit.methods as methods_pkg

    for mod in pkgutil.iter_modules(methods_pkg.__path__):
        importlib.import_module(f"lowrank_lit.methods.{mod.name}")


def registered_methods() -> list[MethodInfo]:
    """All registered methods, sorted by slug (call :func:`load_all` first for the full list)."""
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def get_method(slug: str) -> MethodInfo:
    """Look up one method by slug; the error lists the known slugs."""
    try:
        return _REGISTRY[slug]
    except KeyError:
        raise KeyError(f"unknown method {slug!r}; registered: {', '.join(sorted(_REGISTRY)) or '(none)'}") from None
