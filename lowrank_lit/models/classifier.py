"""The supervised image-classification baseline every method is compared against.

``ImageClassifier`` wraps any backbone ``nn.Module`` (given by ``class_path`` in a config) with a
cross-entropy loss, torchmetrics accuracy, and the optimizer/scheduler named in the config.
Methods that only change the loss, the optimizer or add a callback reuse it unchanged.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lowrank_lit.optim import WarmupCosineLR, matrix_param_groups
from lowrank_lit.registry import register_method
from lowrank_lit.sharding import Shardable

__all__ = ["ImageClassifier"]

_INTERVALS = ("epoch", "step")
_GROUPS = ("all", "matrices")


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@register_method("baseline", kind="LightningModule", paper="Supervised baseline (backbone + cross-entropy)")
class ImageClassifier(Shardable, pl.LightningModule):
    """Backbone + cross-entropy, logging ``{train,val,test}/{loss,acc}``.

    Args:
        backbone: any module mapping a batch ``x`` to logits ``(B, num_classes)``.
        num_classes: number of classes. Default: 10.
        optimizer: optimizer factory ``params -> Optimizer`` (a ``class_path`` in YAML). Default: AdamW(lr=1e-3).
        lr_scheduler: optional scheduler factory ``optimizer -> LRScheduler``. Default: None.
        scheduler_interval: when the scheduler steps, ``epoch`` or ``step``. Default: ``epoch``.
        label_smoothing: cross-entropy label smoothing in [0, 1). Default: 0.0.
        compile: wrap the backbone with ``torch.compile``. Default: False.
        param_groups: ``all`` (one group) or ``matrices``: the weight matrices and the rest in two groups
            (:func:`lowrank_lit.optim.matrix_param_groups`), which LowRankAdam and NanoAdam need (they compress the
            matrices only); torch optimizers treat the two groups alike. Default: ``all``.
        dense_params: with ``param_groups: matrices``, name patterns of matrices kept in the dense group (e.g. the
            output layer ``backbone.net.4.*``). Default: none.
    """

    def __init__(
        self,
        backbone: nn.Module,
        num_classes: int = 10,
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        scheduler_interval: str = "epoch",
        label_smoothing: float = 0.0,
        compile: bool = False,
        param_groups: str = "all",
        dense_params: list[str] | None = None,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"ImageClassifier: num_classes={num_classes}; allowed: an integer >= 2")
        if scheduler_interval not in _INTERVALS:
            raise ValueError(f"ImageClassifier: scheduler_interval={scheduler_interval!r}; allowed: epoch, step")
        if param_groups not in _GROUPS:
            raise ValueError(f"ImageClassifier: param_groups={param_groups!r}; allowed: {', '.join(_GROUPS)}")
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"ImageClassifier: label_smoothing={label_smoothing!r}; allowed: a float in [0, 1)")
        # the resolved run config is logged once by the CLI; logger=False avoids a flat duplicate
        self.save_hyperparameters(ignore=["backbone", "optimizer", "lr_scheduler"], logger=False)
        self.backbone = torch.compile(backbone) if compile else backbone
        self.num_classes = num_classes
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.scheduler_interval = scheduler_interval
        self.label_smoothing = label_smoothing
        self.param_groups = param_groups
        self.dense_params = list(dense_params or [])
        self.train_acc = MulticlassAccuracy(num_classes, average="micro")
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)  # (B, ...) -> (B, num_classes)

    def loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Cross-entropy; subclasses (or methods) override this to change the objective."""
        return F.cross_entropy(logits, y, label_smoothing=self.label_smoothing)

    def _shared_step(self, batch: tuple[torch.Tensor, torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = self.loss(logits, y)
        metric = getattr(self, f"{stage}_acc")
        metric(logits, y)
        on_step = stage == "train"
        self.log(f"{stage}/loss", loss, on_step=on_step, on_epoch=True, prog_bar=True, sync_dist=True)
        self.log(f"{stage}/acc", metric, on_step=False, on_epoch=True, prog_bar=stage != "train")
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self._shared_step(batch, "train")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._shared_step(batch, "test")

    def predict_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=-1)  # (B,)

    def configure_optimizers(self) -> Any:
        if self.param_groups == "matrices":
            optimizer = self.optimizer_factory(matrix_param_groups(self, dense=self.dense_params))
        else:
            optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        if isinstance(scheduler, WarmupCosineLR) and scheduler.total_steps is None:
            steps = self.trainer.estimated_stepping_batches
            if self.scheduler_interval == "epoch":
                steps = self.trainer.max_epochs
            scheduler.set_total_steps(int(steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval}}
