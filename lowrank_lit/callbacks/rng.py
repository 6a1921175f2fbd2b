"""Store the random number generator states in every checkpoint so a resumed run continues exactly."""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

__all__ = ["RNGStateCheckpoint", "gather_per_rank"]


def gather_per_rank(trainer: Trainer, state: Any) -> list[Any]:
    """Every rank's ``state`` (a list indexed by global rank; ``[state]`` in a single process).

    For ``on_save_checkpoint``: ``trainer.save_checkpoint`` runs on every rank (rank 0 writes), so a
    per-rank state (random generators) is gathered there and each rank takes its own back on resume.
    """
    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, state)
        return gathered
    return [state]


class RNGStateCheckpoint(Callback):
    """Save the torch/numpy/python RNG states with each checkpoint and restore them on resume.

    Lightning checkpoints hold weights, optimizer and loop state but not the global RNG states;
    without them a resumed run reshuffles and redraws dropout masks differently from an
    uninterrupted one. With this callback (added to every ``lowrank`` run), resuming from a
    checkpoint written at an epoch boundary gives bit-identical weights on the CPU with
    ``trainer.deterministic=true``.

    Under DDP every rank's states are gathered into the checkpoint (``per_rank``) and each rank gets
    its own back on resume (with the same world size; otherwise rank 0's states, with a warning).
    """

    KEY = "lowrank_rng_states"

    def state_dict(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def collect() -> dict[str, Any]:
        """The global RNG states as tensors and plain Python values (loadable with ``weights_only=True``)."""
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        states: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "python": random.getstate(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states["cuda"] = torch.cuda.get_rng_state_all()
        return states

    @staticmethod
    def restore(states: dict[str, Any]) -> None:
        """Set the global RNG states saved by :meth:`collect`."""
        torch.set_rng_state(states["torch"])
        name, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
        version, internal, gauss_next = states["python"]
        random.setstate((version, tuple(internal), gauss_next))
        if "cuda" in states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(states["cuda"])

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        states = self.collect()
        if trainer.world_size > 1:
            states = {**states, "per_rank": gather_per_rank(trainer, states)}
        checkpoint[self.KEY] = states

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get(self.KEY)
        if states is None:
            return
        per_rank = states.get("per_rank")
        if per_rank is not None and len(per_rank) == trainer.world_size:
            states = per_rank[trainer.global_rank]
        elif per_rank is not None or trainer.world_size > 1:
            warnings.warn(f"RNGStateCheckpoint: the checkpoint holds random states of {len(per_rank or [0])} rank(s), "
                          f"this run has {trainer.world_size}; every rank continues from rank 0's states", stacklevel=2)
        self.restore(states)
