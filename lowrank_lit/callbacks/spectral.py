"""Spectral diagnostics of any run: the effective rank of its weight matrices, logged while it trains.

Compose it with ``--config callbacks/spectral.yaml`` (or ``--trainer.callbacks+=lowrank_lit.callbacks.SpectralDiagnostics``):
beside any run, Q3R's pull towards low rank, GaLore's projected updates or a fine-tune's drift show up as
``spectral/<layer>/erank`` (and ``stable_rank``) curves.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lowrank_lit.linalg import entropy_rank, stable_rank
from lowrank_lit.nn.targets import match_names

__all__ = ["SpectralDiagnostics"]


class SpectralDiagnostics(Callback):
    """Every ``every_n_steps`` optimizer steps (and at the end of training), the singular values of each selected
    weight matrix give ``spectral/<name>/erank`` (:func:`lowrank_lit.linalg.entropy_rank`: 1 for one direction, the
    width for a flat spectrum) and ``spectral/<name>/stable_rank`` (``||W||_F^2 / ||W||_2^2``).

    Args:
        targets: name patterns of the weight parameters (``"*.weight"`` style, :func:`lowrank_lit.nn.targets.match_names`);
            None: every 2-D weight of an ``nn.Linear`` whose smaller side is at least ``min_dim``. Default: None.
        every_n_steps: optimizer steps between measurements. Default: 100.
        min_dim: smallest matrix side measured when ``targets`` is None. Default: 8.
    """

    def __init__(self, targets: list[str] | None = None, every_n_steps: int = 100, min_dim: int = 8) -> None:
        if every_n_steps < 1:
            raise ValueError(f"SpectralDiagnostics: every_n_steps={every_n_steps}; allowed: an integer >= 1")
        if min_dim < 1:
            raise ValueError(f"SpectralDiagnostics: min_dim={min_dim}; allowed: an integer >= 1")
        self.targets, self.every_n_steps, self.min_dim = targets, every_n_steps, min_dim
        self._last = -1
        self.history: list[dict[str, float]] = []

    def matrices(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """The weight matrices measured, by parameter name."""
        if self.targets is not None:
            params = dict(module.named_parameters())
            names = match_names(list(params), self.targets)
            if not names:
                raise ValueError(f"SpectralDiagnostics: targets={self.targets} match no parameter; some names: "
                                 f"{list(params)[:8]}")
            return {n: params[n] for n in names if params[n].ndim == 2}
        return {f"{name}.weight": m.weight for name, m in module.named_modules()
                if isinstance(m, nn.Linear) and min(m.weight.shape) >= self.min_dim}

    def measure(self, module: nn.Module) -> dict[str, float]:
        """``{"spectral/<name>/erank": ..., "spectral/<name>/stable_rank": ...}`` for every measured matrix."""
        out = {}
        for name, W in self.matrices(module).items():
            sigma = torch.linalg.svdvals(W.detach().float())
            key = name.removesuffix(".weight")
            out[f"spectral/{key}/erank"] = entropy_rank(sigma)
            out[f"spectral/{key}/stable_rank"] = stable_rank(sigma)
        return out

    def _log(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.global_step == self._last:
            return
        self._last = trainer.global_step
        values = self.measure(pl_module)
        self.history.append({"step": float(trainer.global_step), **values})
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._log(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._log(trainer, pl_module)
