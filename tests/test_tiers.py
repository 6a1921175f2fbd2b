"""The e2e tier is declared: a test that starts a process, the CLI, a run built from a config or a Trainer's loop
carries ``@pytest.mark.e2e`` (or an opt-in tier's marker); tests/conftest.py guards those entry points while a
unit-tier test runs (its fixtures included), so an unmarked one fails naming what it reached."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest

from tests import conftest


@pytest.fixture
def reached(request):
    """Takes what this (unit-tier) test reached so far off the record, so the deliberate reaches below do not fail
    it."""
    return lambda: conftest.TIER_VIOLATIONS.pop(request.node.nodeid, [])


def test_a_unit_test_that_starts_a_process_or_the_cli_is_stopped_naming_it(reached):
    import lowrank_lit.cli
    import lowrank_lit.launch.build

    with pytest.raises(RuntimeError, match=r"test_tiers.py::.* starts a subprocess but is not marked e2e"):
        subprocess.run([sys.executable, "-c", "pass"], check=True)
    with pytest.raises(RuntimeError, match="starts a process but"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(RuntimeError, match=r"starts the CLI \(lowrank_lit.cli.main\)"):
        lowrank_lit.cli.main(["list"])
    with pytest.raises(RuntimeError, match="starts a run built from a config"):
        lowrank_lit.launch.build.build_from_config("configs/baseline/mlp_digits.yaml")
    assert reached() == ["a subprocess", "a process", "the CLI (lowrank_lit.cli.main)", "a run built from a config"]
    assert subprocess.run(["uname"], capture_output=True).returncode == 0  # a library's probe of the machine runs
    assert reached() == []


def test_a_trainer_loop_in_a_unit_test_is_stopped(reached):
    from lightning.pytorch import Trainer

    conftest._install_tier_guards()  # Lightning is imported by now
    with pytest.raises(RuntimeError, match=r"starts Trainer.fit but"):
        Trainer(logger=False, enable_checkpointing=False).fit(None)
    assert reached() == ["Trainer.fit"]


def test_a_unit_test_that_swallows_the_error_still_fails(reached):
    """The guard records what was reached, so ``except Exception`` in the code under test hides nothing."""
    try:
        subprocess.run(["true"])
    except Exception:
        pass
    assert reached() == ["a subprocess"]  # tests/conftest.py's pytest_runtest_call fails a test with a record


@pytest.mark.e2e
def test_an_e2e_test_may_start_a_process():
    assert subprocess.run([sys.executable, "-c", "print(2)"], capture_output=True, text=True).stdout == "2\n"
