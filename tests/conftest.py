import os
import sys

import pytest

# never reach a hub or the W&B server from tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

#: tiers that run only when ``-m`` names them: ``pytest -m slow``, ``-m rehearsal``, ``-m gpu``
OPT_IN = ("slow", "gpu", "rehearsal")


# ----------------------------------------------------------------------------------------- the declared e2e tier
#: the node id of the running test when it is in the unit tier (no ``e2e`` marker and no opt-in tier), else None
_UNIT_TEST: list[str | None] = [None]
#: what each unit-tier test reached that only e2e tests may: node id -> the entry points
TIER_VIOLATIONS: dict[str, list[str]] = {}


#: programs libraries run to probe the machine (``ctypes.util.find_library`` runs ``ldconfig -p``): not a run
_PROBES = frozenset({"ldconfig", "uname", "lscpu", "nvidia-smi", "gcc", "cc", "ld", "objdump", "git"})


def _is_probe(name, args, kwargs):
    """Whether a ``Popen`` call runs one of :data:`_PROBES`."""
    if name != "__init__":
        return False
    argv = kwargs.get("args", args[1] if len(args) > 1 else None)
    first = argv if isinstance(argv, str | bytes | os.PathLike) else (argv[0] if argv else "")
    return os.path.basename(os.fsdecode(first).split()[0] if first else "") in _PROBES


def _guard(owner, name, what):
    """Wrap ``owner.name`` so that a unit-tier test reaching it is recorded and stopped."""
    original = getattr(owner, name)
    if getattr(original, "_tier_guard", False):
        return

    def guarded(*args, **kwargs):
        test = _UNIT_TEST[0]
        if test is not None and not _is_probe(name, args, kwargs):
            TIER_VIOLATIONS.setdefault(test, []).append(what)
            raise RuntimeError(f"{test} starts {what} but is not marked e2e; add @pytest.mark.e2e")
        return original(*args, **kwargs)

    guarded._tier_guard = True
    guarded.__wrapped__ = original
    setattr(owner, name, guarded)


def _install_tier_guards():
    """The entry points only an ``e2e`` test may reach: a process (``subprocess``, ``multiprocessing``, hence
    torch's spawn and DDP), the CLI, a run built from a config, and a Trainer's loops. Lightning's loops are guarded
    once Lightning is imported (a unit test that imports it is guarded from its next test on, and this hook runs
    before every test)."""
    import multiprocessing.process
    import subprocess

    _guard(subprocess.Popen, "__init__", "a subprocess")
    _guard(multiprocessing.process.BaseProcess, "start", "a process")
    import lowrank_lit.cli
    import lowrank_lit.launch.build

    _guard(lowrank_lit.cli, "main", "the CLI (lowrank_lit.cli.main)")
    _guard(lowrank_lit.launch.build, "build_from_config", "a run built from a config")
    if "lightning.pytorch" in sys.modules:
        from lightning.pytorch import Trainer

        for loop in ("fit", "validate", "test", "predict"):
            _guard(Trainer, loop, f"Trainer.{loop}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Run a unit-tier test (fixtures included) with the e2e entry points guarded: reaching one fails the test
    naming it (tests/test_tiers.py checks the guard). The tier is declared by the marker, never inferred."""
    _install_tier_guards()
    in_unit = item.get_closest_marker("e2e") is None and not any(item.get_closest_marker(m) for m in OPT_IN)
    _UNIT_TEST[0] = item.nodeid if in_unit else None
    try:
        yield
    finally:
        _UNIT_TEST[0] = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """A unit-tier test that caught the guard's error still fails."""
    outcome = yield
    reached = TIER_VIOLATIONS.get(item.nodeid)
    if reached and outcome.excinfo is None:
        pytest.fail(f"{item.nodeid} starts {', '.join(sorted(set(reached)))} but is not marked e2e; add "
                    "@pytest.mark.e2e", pytrace=False)


def pytest_configure(config):
    """Guard the e2e entry points before the test modules are imported (:func:`_install_tier_guards`). Under
    pytest-xdist (``-n auto``), each worker gets its share of the cores as torch threads, for itself and the runs it
    starts, so two workers do not run four threads on two cores."""
    _install_tier_guards()
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
