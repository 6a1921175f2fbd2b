import os

import pytest

# never reach a hub or the W&B server from tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

#: tiers that run only when ``-m`` names them: ``pytest -m slow``, ``-m rehearsal``, ``-m gpu``
OPT_IN = ("slow", "gpu", "rehearsal")


def pytest_configure(config):
    """Under pytest-xdist (``-n auto``), each worker gets its share of the cores as torch threads, for itself and the
    runs it starts, so two workers do not run four threads on two cores."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ.setdefault("OMP_NUM_THREADS", threads)
        os.environ.setdefault("MKL_NUM_THREADS", threads)
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """Leave out the opt-in tiers unless ``-m`` names them (``-m "not e2e"`` is the unit tier, not the unit tier plus
    the slow tests)."""
    expr = config.getoption("markexpr") or ""
    dropped = [i for i in items if any(i.get_closest_marker(m) is not None and m not in expr for m in OPT_IN)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        gone = set(map(id, dropped))
        items[:] = [i for i in items if id(i) not in gone]


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
