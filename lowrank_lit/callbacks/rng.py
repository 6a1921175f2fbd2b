"""Store the random number generator states in every checkpoint so a resumed run continues exactly."""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["RNGStateCheckpoint"]


class RNGStateCheckpoint(Callback):
    """Save the torch/numpy/python RNG states with each checkpoint and restore them on resume.

    Lightning checkpoints hold weights, optimizer and loop state but not the global RNG states;
    without them a resumed run reshuffles and redraws dropout masks differently from an
    uninterrupted one. With this callback (added to every ``lowrank`` run), resuming from a
    checkpoint written at an epoch boundary gives bit-identical weights on the CPU with
    ``trainer.deterministic=true``.
    """

    KEY = "lowrank_rng_states"

    def state_dict(self) -> dict[str, Any]:
        return {}

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        checkpoint[self.KEY] = _collect_rng_states(include_cuda=False)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(self.KEY)
        if states is not None:
            _set_rng_states(states)
