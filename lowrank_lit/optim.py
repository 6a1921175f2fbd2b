"""Learning-rate schedules shared by the baseline and the methods."""

from __future__ import annotations

import fnmatch
import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

__all__ = ["WarmupCosineLR", "matrix_param_groups"]


class WarmupCosineLR(LRScheduler):
    """Linear warm-up to the optimizer's lr, then cosine decay to ``min_lr_ratio * lr``; stepped per optimizer step.

    ``total_steps=None`` means "the whole run": :class:`~lowrank_lit.models.classifier.ImageClassifier`
    calls :meth:`set_total_steps` with ``trainer.estimated_stepping_batches``, so the schedule follows
    ``trainer.max_epochs`` without editing the config.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: optimizer steps of the whole schedule. Default: None (set by the module).
        warmup_fraction: fraction of ``total_steps`` spent warming up, in [0, 1). Default: 0.1.
        min_lr_ratio: final lr as a fraction of the peak, in [0, 1]. Default: 0.0.
        last_epoch: index of the last step (for resuming). Default: -1.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int | None = None,
        warmup_fraction: float = 0.1,
        min_lr_ratio: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"WarmupCosineLR: total_steps={total_steps}; allowed: an integer >= 1 or None")
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError(f"WarmupCosineLR: warmup_fraction={warmup_fraction}; allowed: a float in [0, 1)")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"WarmupCosineLR: min_lr_ratio={min_lr_ratio}; allowed: a float in [0, 1]")
        self.total_steps = total_steps
        self.warmup_fraction = warmup_fraction
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """Multiplier of the peak lr at optimizer step ``step`` (1.0 while ``total_steps`` is unknown)."""
        if self.total_steps is None:
            return 1.0
        warmup = max(1, round(self.warmup_fraction * self.total_steps)) if self.warmup_fraction > 0 else 0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:
        f = self.factor(self.last_epoch)
        return [base * f for base in self.base_lrs]

    def set_total_steps(self, total_steps: int) -> None:
        """Fix the schedule length and move the current lr onto the new schedule."""
        if total_steps < 1:
            raise ValueError(f"WarmupCosineLR: total_steps={total_steps}; allowed: an integer >= 1")
        self.total_steps = int(total_steps)
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


def matrix_param_groups(module: nn.Module, dense: tuple[str, ...] | list[str] = ()) -> list[dict]:
    """Split trainable parameters into the weight matrices a memory-lean optimizer compresses and the rest.

    Returns up to two param groups: the 2-D weights whose names match none of the ``dense`` patterns
    (fnmatch, e.g. ``"*embed*"``, ``"head_tgt.*"``), tagged ``nano=True, lowrank=True``; and every other
    trainable parameter (biases, norms, embeddings, heads), tagged ``nano=False, lowrank=False``.
    NanoAdam and LowRankAdam read these flags; torch optimizers ignore them. Empty groups are dropped.
    """
    matrices, rest = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        is_dense = p.ndim != 2 or any(fnmatch.fnmatch(name, pat) for pat in dense)
        (rest if is_dense else matrices).append(p)
    groups = [{"params": matrices, "nano": True, "lowrank": True}, {"params": rest, "nano": False, "lowrank": False}]
    return [g for g in groups if g["params"]]
