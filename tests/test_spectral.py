"""SpectralDiagnostics: the effective rank of any run's weight matrices, logged while it trains."""

from __future__ import annotations

import pytest
import torch

from lowrank_lit.callbacks import SpectralDiagnostics
from lowrank_lit.linalg import entropy_rank, stable_rank
from tests.helpers import quiet_trainer
from tests.tolerances import F32


def test_effective_and_stable_rank_pinned():
    assert entropy_rank(torch.tensor([3.0, 0.0, 0.0])) == pytest.approx(1.0)
    assert entropy_rank(torch.ones(4)) == pytest.approx(4.0)
    assert entropy_rank(torch.tensor([2.0, 1.0, 1.0])) == pytest.approx(2.0 ** 1.5, rel=F32)  # p = .5 .25 .25
    assert entropy_rank(torch.zeros(3)) == 0.0
    assert stable_rank(torch.tensor([2.0, 1.0])) == pytest.approx(1.25)


@pytest.mark.e2e
def test_spectral_diagnostics_logs_every_n_steps_and_sees_a_rank_one_weight():
    import lightning.pytorch as pl
    from torch import nn

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 12)
            self.b = nn.Linear(12, 4)  # smaller side 4 < min_dim: not measured by default
            with torch.no_grad():
                self.a.weight.copy_(torch.outer(torch.randn(12), torch.randn(16)))  # rank one

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.b(torch.relu(self.a(x))), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16), torch.randint(0, 4, (64,))),
                                       batch_size=8)
    cb = SpectralDiagnostics(every_n_steps=3, min_dim=8)
    quiet_trainer(max_steps=7, callbacks=[cb]).fit(Net(), data)
    assert [h["step"] for h in cb.history] == [3.0, 6.0, 7.0]  # every 3 optimizer steps, and at the end
    first = cb.history[0]
    assert set(first) == {"step", "spectral/a/erank", "spectral/a/stable_rank"}
    assert first["spectral/a/erank"] < 1.1 and first["spectral/a/stable_rank"] < 1.01  # still (almost) rank one
    with pytest.raises(ValueError, match="every_n_steps=0"):
        SpectralDiagnostics(every_n_steps=0)
    with pytest.raises(ValueError, match="match no parameter"):
        SpectralDiagnostics(targets=["nope.*"]).matrices(Net())
