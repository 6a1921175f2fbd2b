"""Find layers by name pattern and swap them: the one targeting path for every method.

Regularizers (Q3R), quantizers (GLVQ), optimizers' parameter groups and adapter/prompt injection
all select layers the same way::

    match_modules(model, ["backbone.net.0", "blocks.*.attn.qkv[3]"])

* patterns are shell-style (``fnmatch``), matched **case-sensitively** against the names of
  ``model.named_modules()`` (the same on every OS);
* a trailing ``[n]`` splits the matched module's weight rows into ``n`` equal slices (a fused
  ``qkv`` projection is three matrices); :attr:`ModuleMatch.rows` gives them;
* a pattern that matches nothing is an error that names every such pattern and shows some names.

:func:`replace_module` puts a new module where an old one was (``"blocks.0.attn.qkv"`` -> the new
layer) and returns the old one; :func:`match_names` applies the same patterns to any names (e.g.
parameter names).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from torch import nn

__all__ = ["ModuleMatch", "match_modules", "match_names", "module_copy", "replace_module", "split_pattern"]

_SLICES_RE = re.compile(r"^(?P<pattern>.+)\[(?P<n>\d+)\]$")


def split_pattern(pattern: str) -> tuple[str, int]:
    """``"blocks.*.qkv[3]"`` -> ``("blocks.*.qkv", 3)``; a pattern without ``[n]`` -> ``(pattern, 1)``.

    Raises:
        ValueError: ``n`` < 1, or an empty pattern.
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern={pattern!r}; allowed: a non-empty module-name pattern, optionally ending in [n]")
    m = _SLICES_RE.match(pattern)
    base, n = (m.group("pattern"), int(m.group("n"))) if m else (pattern, 1)
    if n < 1:
        raise ValueError(f"pattern {pattern!r}: the number of row slices must be >= 1")
    return base, n


def match_names(names: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """The ``names`` (in their order) that match any of ``patterns`` (fnmatch, case-sensitive)."""
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


@dataclass(frozen=True)
class ModuleMatch:
    """One module selected by a pattern.

    Attributes:
        name: the module's name in the model (``named_modules``).
        module: the module.
        pattern: the pattern that selected it (without ``[n]``).
        slices: ``n`` of a ``[n]`` pattern (1 otherwise).
    """

    name: str
    module: nn.Module
    pattern: str
    slices: int = 1

    def rows(self, n_rows: int) -> list[slice]:
        """The ``slices`` equal row ranges of a weight with ``n_rows`` rows.

        Raises:
            ValueError: the rows do not split evenly.
        """
        if n_rows % self.slices:
            raise ValueError(f"{self.name!r}: {n_rows} rows do not split into {self.slices} equal slices")
        step = n_rows // self.slices
        return [slice(k * step, (k + 1) * step) for k in range(self.slices)]


def match_modules(model: nn.Module, patterns: Sequence[str], owner: str = "targets") -> list[ModuleMatch]:
    """Modules of ``model`` whose names match ``patterns``; in pattern order, then model order.

    A module matched by two patterns appears twice (callers that split rows check for overlaps).

    Args:
        model: the model to search.
        patterns: module-name patterns, each optionally ending in ``[n]`` (row slices).
        owner: what the patterns configure, for the error message (e.g. ``"Q3R: targets"``).

    Raises:
        ValueError: ``patterns`` is a string or empty, a pattern is malformed, or some patterns match
            no module (all of them are named).
    """
    if isinstance(patterns, str) or not patterns:
        raise ValueError(f"{owner}={patterns!r}; allowed: a non-empty list of module-name patterns")
    names = [n for n, _ in model.named_modules() if n]
    modules = dict(model.named_modules())
    found: list[ModuleMatch] = []
    unmatched: list[str] = []
    for pattern in patterns:
        base, n = split_pattern(pattern)
        hits = [name for name in names if fnmatch.fnmatchcase(name, base)]
        if not hits:
            unmatched.append(pattern)
        found += [ModuleMatch(name, modules[name], base, n) for name in hits]
    if unmatched:
        shown = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "")
        which = "pattern matches" if len(unmatched) == 1 else "patterns match"
        raise ValueError(f"{owner}: {which} no module: {', '.join(map(repr, unmatched))} (module names: {shown})")
    return found


def replace_module(model: nn.Module, name: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at ``name`` inside ``model`` (``"a.b.c"``) and return the module it replaces.

    Raises:
        ValueError: ``name`` is empty (the model itself) or not a submodule of ``model``.
    """
    if not name:
        raise ValueError("replace_module: name='' is the model itself; allowed: the name of a submodule")
    parent_name, _, child = name.rpartition(".")
    try:
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, child)
    except AttributeError:
        raise ValueError(f"replace_module: {name!r} is not a submodule of {type(model).__name__}") from None
    if not isinstance(old, nn.Module):
        raise ValueError(f"replace_module: {name!r} is a {type(old).__name__}, not a module")
    setattr(parent, child, new)
    return old


def module_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` that does not copy the Lightning ``Trainer`` it is attached to (the copy has none).

    ``copy.deepcopy`` of a ``LightningModule`` follows ``module._trainer``: the whole trainer (loggers, data loaders,
    callbacks) is copied, and under DDP the process group holds thread locks, which cannot be copied at all. Every
    submodule's trainer reference is left out the same way. For what evaluates a changed copy of a trained model
    (truncated, quantized) after ``fit``. A sharded module (FSDP2) is copied whole and unsharded on every rank
    (:func:`lowrank_lit.sharding.unsharded_copy`).
    """
    import copy

    memo: dict[int, object] = {}
    for sub in module.modules():
        trainer = sub.__dict__.get("_trainer")
        if trainer is not None:
            memo[id(trainer)] = None
    if any(type(m).__name__.startswith("FSDP") for m in module.modules()):
        from lowrank_lit.sharding import unsharded_copy

        return unsharded_copy(module, memo)  # sharded (FSDP2): a plain copy with whole weights
    return copy.deepcopy(module, memo)
