import os

import pytest

# never reach a hub or the W&B server from tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")


@pytest.fixture
def run_root(tmp_path):
    """A fresh runs/ folder per test."""
    return tmp_path / "runs"


@pytest.fixture(autouse=True)
def _isolate_env(monkeypatch):
    """Each test starts without an inherited run directory or SLURM job."""
    for key in list(os.environ):
        if key.startswith("SLURM_") or key in ("LOWRANK_RUN_DIR", "LOCAL_RANK"):
            monkeypatch.delenv(key, raising=False)


@pytest.fixture(autouse=True)
def _restore_rank_zero():
    """A Trainer built in-process for a non-zero rank (SLURM environment tests) sets Lightning's global
    ``rank_zero_only.rank``; put it back so later in-process runs still log and save."""
    yield
    import sys

    module = sys.modules.get("lightning_utilities.core.rank_zero")
    if module is not None:
        module.rank_zero_only.rank = 0


@pytest.fixture
def checked_figures(monkeypatch):
    """Every figure saved while the test runs, checked by ``tests.helpers.figure_problems``: ``{path: problems}``."""
    from matplotlib.figure import Figure

    from tests.helpers import figure_problems

    seen: dict[str, list[str]] = {}
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        seen[str(fname)] = figure_problems(self)
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return seen
