"""The run seed (the bottom of the package: every data module, model and method may ask for it)."""

from __future__ import annotations

import os

__all__ = ["run_seed"]


def run_seed(seed: int | None = None) -> int:
    """``seed``, or the run seed that ``seed_everything`` exported (``PL_GLOBAL_SEED``; 0 if none) when it is None."""
    return int(seed) if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
