"""The baselines every method is compared against reach their documented accuracy (slow)."""

from __future__ import annotations

import pytest

from tests.helpers import CONFIGS


def _fit_and_test(config, run_root):
    from lowrank_lit.launch.lightning_cli import LowrankCLI

    cli = LowrankCLI(args=["fit", "--config", str(config), "--run_root", str(run_root),
                           "--trainer.enable_progress_bar=false"])
    return float(cli.trainer.callback_metrics["test/acc"])


@pytest.mark.slow
def test_mlp_digits_reaches_95_percent(run_root):
    assert _fit_and_test(CONFIGS / "baseline" / "mlp_digits.yaml", run_root) >= 0.95


@pytest.mark.slow
def test_vit_tiny_digits_reaches_90_percent(run_root):
    assert _fit_and_test(CONFIGS / "baseline" / "vit_tiny_digits.yaml", run_root) >= 0.90
