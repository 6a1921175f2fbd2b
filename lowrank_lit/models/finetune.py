"""Sequential fine-tuning on split digits: pretrain a body + source head, fine-tune on new classes.

The setup of NanoAdam's CPU experiment (paper 12, method card section 4), usable with any optimizer:
an MLP body (64 -> 256 -> 256 -> 128, ReLU) and a source head are pretrained on digits 0-4 with
AdamW (at the start of ``fit``, with its own seeded loop), the source head is frozen, and body + a
new target head are fine-tuned on digits 5-9 with the configured optimizer. Test reports
``test/target_acc`` (target head on 5-9), ``test/source_acc`` (frozen source head on 0-4:
forgetting) and ``test/drift`` (L2 distance of the body from its pretrained weights).

The optimizer receives :func:`lowrank_lit.optim.matrix_param_groups`: the body's weight matrices
(``nano=True``) and the biases + target head (``nano=False``, dense).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.optim import matrix_param_groups
from lowrank_lit.sharding import Shardable

__all__ = ["SplitClassFinetune"]


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


class SplitClassFinetune(Shardable, pl.LightningModule):
    """Pretrain on the source classes, then fine-tune body + new head on the target classes.

    Needs :class:`lowrank_lit.data.digits.DigitsSplitDataModule` (or any datamodule with
    ``source_train_dataloader()`` and test loaders ``[target, source]``).

    Args:
        optimizer: fine-tuning optimizer factory (receives the two param groups). Default: AdamW(lr=1e-2).
        in_features: input size. Default: 64.
        hidden: body widths. Default: [256, 256, 128] (card).
        num_source: source classes. Default: 5.
        num_target: target classes. Default: 5.
        pretrain_epochs: epochs of source pretraining. Default: 40 (card).
        pretrain_lr: AdamW lr of the pretraining. Default: 1e-3 (card).
        pretrain_batch_size: batch of the pretraining. Default: 64 (card). Its own argument, not the data module's
            per-process batch, so one process, DDP and sharded runs (each process pretrains the whole model alike)
            and ``lowrank export`` start from the same pretrained model.
    """

    def __init__(
        self,
        optimizer: OptimizerCallable = _default_optimizer,
        in_features: int = 64,
        hidden: list[int] | None = None,
        num_source: int = 5,
        num_target: int = 5,
        pretrain_epochs: int = 40,
        pretrain_lr: LearningRate = 1e-3,
        pretrain_batch_size: int = 64,
    ) -> None:
        super().__init__()
        hidden = [256, 256, 128] if hidden is None else list(hidden)
        if pretrain_epochs < 0 or pretrain_lr <= 0:
            raise ValueError(f"SplitClassFinetune: pretrain_epochs={pretrain_epochs}, pretrain_lr={pretrain_lr}; allowed: >= 0 and > 0")
        if pretrain_batch_size < 1:
            raise ValueError(f"SplitClassFinetune: pretrain_batch_size={pretrain_batch_size}; allowed: an integer >= 1")
        self.save_hyperparameters(ignore=["optimizer"], logger=False)
        layers: list[nn.Module] = []
        width = in_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.body = nn.Sequential(*layers)
        self.head_src = nn.Linear(width, num_source)
        self.head_tgt = nn.Linear(width, num_target)
        self.optimizer_factory = optimizer
        self.register_buffer("pretrained", torch.tensor(False))
        self.register_buffer("theta_pre", torch.zeros(sum(p.numel() for p in self.body.parameters())))
        self.target_acc = MulticlassAccuracy(num_target, average="micro")
        self.source_acc = MulticlassAccuracy(num_source, average="micro")

    def body_vector(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.body.parameters()])

    def drift(self) -> float:
        """``||theta_body - theta_pre||_2``."""
        return float((self.body_vector() - self.theta_pre).norm())

    def pretrain(self, loader: Any) -> float:
        """Train body + source head on ``loader`` with AdamW; returns the last epoch's mean loss."""
        params = list(self.body.parameters()) + list(self.head_src.parameters())
        opt = torch.optim.AdamW(params, lr=self.hparams.pretrain_lr)
        last = float("nan")
        with torch.enable_grad():
            for _ in range(self.hparams.pretrain_epochs):
                total, n = 0.0, 0
                for x, y in loader:
                    x, y = x.to(self.device), y.to(self.device)
                    loss = F.cross_entropy(self.head_src(self.body(x)), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    total, n = total + float(loss.detach()) * len(y), n + len(y)
                last = total / max(n, 1)
        return last

    def prepare_base(self, datamodule: Any) -> float | None:
        """Pretrain on the source classes once (a no-op when done, e.g. in a resumed run) and keep the pretrained
        body as the reference ``theta_pre``; the batch order is seeded from ``torch.initial_seed()``, so the same
        ``seed_everything`` gives the same pretrained model. ``lowrank export`` / ``lowrank load`` call it too: the
        pretrained model is the base a fine-tuning artifact is relative to.

        Returns:
            the last pretraining epoch's mean loss, or None when already pretrained.
        """
        if bool(self.pretrained):
            return None
        if datamodule is None or not hasattr(datamodule, "setup"):
            raise ValueError("SplitClassFinetune.prepare_base: needs the data module (DigitsSplitDataModule) to pretrain")
        datamodule.setup("fit")  # idempotent
        gen = torch.Generator().manual_seed(int(torch.initial_seed()) % 2**63)
        loss = self.pretrain(datamodule.source_train_dataloader(generator=gen, batch_size=self.hparams.pretrain_batch_size))
        self.theta_pre.copy_(self.body_vector())
        self.pretrained.fill_(True)
        return loss

    def configure_model(self) -> None:
        if self.trainer.state.fn == "fit":
            # before the strategy wraps the model: each process pretrains the whole model alike (seeded), and the
            # source head is frozen before DDP registers its parameters or FSDP shards them (the pretraining loop
            # runs outside the training steps that gather sharded weights). A resumed run pretrains again (seeded,
            # so the same base) and then restores its checkpoint over it; a checkpoint that leaves out the frozen
            # source head (callbacks/trained_only.yaml) finds the same head it recorded
            loss = self.prepare_base(self.trainer.datamodule)
            if loss is not None:
                self.print(f"pretrained on the source classes: final loss {loss:.4f}")
            self.head_src.requires_grad_(False)
        super().configure_model()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.head_tgt(self.body(x)), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        x, y = batch
        z = self.body(x)
        if dataloader_idx == 0:
            self.target_acc(self.head_tgt(z), y)
            self.log("test/target_acc", self.target_acc, add_dataloader_idx=False)
        else:
            self.source_acc(self.head_src(z), y)
            self.log("test/source_acc", self.source_acc, add_dataloader_idx=False)

    def on_test_epoch_end(self) -> None:
        self.log("test/drift", self.drift())

    def configure_optimizers(self) -> Any:
        groups = matrix_param_groups(self, dense=("head_tgt.*",))
        frozen = {id(p) for p in self.head_src.parameters()}
        groups = [{**g, "params": [p for p in g["params"] if id(p) not in frozen]} for g in groups]
        return self.optimizer_factory([g for g in groups if g["params"]])
