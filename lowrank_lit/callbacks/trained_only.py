"""Checkpoints that hold only what trains: long runs on big frozen bases write megabytes, not the base again.

Compose it with ``--config callbacks/trained_only.yaml`` (or ``--trainer.callbacks+=lowrank_lit.callbacks.TrainedOnly``).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lowrank_lit.artifacts import tensor_digest
from lowrank_lit.sharding import full_tensor

__all__ = ["TrainedOnly"]


class TrainedOnly(Callback):
    """Leave the frozen parameters (``requires_grad=False`` when the checkpoint is written) out of every checkpoint.

    The checkpoint records each omitted tensor's digest (``frozen_omitted``). Loading it (a resume, or ``lowrank
    test --ckpt_path``) keeps the frozen weights the config builds and then checks them against the digests: a
    base that differs (another pretrained file, another seed of a random-init part) stops the run with one line
    naming the first differing tensor, instead of training on a silently different model. The model is loaded
    with ``strict_loading = False`` so that the omitted keys may be missing; any other missing key is an error.
    Optimizer state and buffers are kept as usual.
    """

    def __init__(self) -> None:
        self._digests: dict[str, str] = {}  # frozen tensors do not change: hashed once

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        pl_module.strict_loading = False

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        state = checkpoint["state_dict"]
        omitted = {}
        for name, p in pl_module.named_parameters():
            if not p.requires_grad and name in state:
                if name not in self._digests:
                    self._digests[name] = tensor_digest(state[name])
                omitted[name] = self._digests[name]
                del state[name]
        checkpoint["frozen_omitted"] = omitted

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        omitted: dict[str, str] = checkpoint.get("frozen_omitted") or {}
        own = pl_module.state_dict()
        saved = checkpoint.get("state_dict")  # a sharded strategy has loaded it into the shards already
        missing = sorted(set(own) - set(saved) - set(omitted)) if saved is not None else []
        if missing:
            raise ValueError(f"TrainedOnly: the checkpoint lacks {missing[0]!r}, which it did not leave out on purpose")
        for name in sorted(omitted):  # the same order on every rank: a sharded weight is gathered whole
            if name not in own or tensor_digest(full_tensor(own[name])) != omitted[name]:
                raise ValueError(f"TrainedOnly: frozen weight {name!r} differs from the one the checkpoint was trained "
                                 "on (another base model, pretrained file or seed); the run stops here")

