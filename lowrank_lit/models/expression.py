"""Predicting per-spot gene expression from features, with any loss over ``(pred, counts, groups)``.

``GeneExpressionRegressor`` wraps a backbone (``class_path``; a linear or MLP head on features)
and a loss module whose ``forward(pred, counts, groups)`` returns a scalar: STRank's relative
losses and the point-wise baselines of paper 13 (``lowrank_lit.methods.strank``) all fit. The
prediction is a per-gene score compared by correlation, not by absolute value.

Validation/test batches carry the truth instead of counts; the metric is the gene-wise Spearman
(and Pearson) correlation between prediction and truth, computed inside each group (slide) and
averaged over genes and groups. Predictions, truths and groups are gathered with torchmetrics'
``CatMetric`` (synchronised under DDP) and correlated with torchmetrics' functional
``spearman_corrcoef``/``pearson_corrcoef``.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torchmetrics import CatMetric
from torchmetrics.functional import pearson_corrcoef, spearman_corrcoef

from lowrank_lit.report import may_write, save_rows
from lowrank_lit.sharding import Shardable

__all__ = ["GeneExpressionRegressor", "groupwise_correlation"]


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def groupwise_correlation(pred: torch.Tensor, truth: torch.Tensor, groups: torch.Tensor, kind: str = "spearman") -> torch.Tensor:
    """Per-gene correlation of ``pred`` and ``truth`` inside each group, averaged over groups.

    Args:
        pred: ``(N, G)`` predictions.
        truth: ``(N, G)`` truth.
        groups: ``(N,)`` group ids.
        kind: ``spearman`` or ``pearson``.

    Returns:
        ``(G,)`` correlations. A gene whose prediction or truth is constant inside a group counts
        as 0 there (no ranking information), with a warning.
    """
    fn = {"spearman": spearman_corrcoef, "pearson": pearson_corrcoef}.get(kind)
    if fn is None:
        raise ValueError(f"groupwise_correlation: kind={kind!r}; allowed: spearman, pearson")
    pred, truth = pred.double().reshape(len(pred), -1), truth.double().reshape(len(truth), -1)
    per_group = []
    for g in torch.unique(groups):
        m = groups == g
        if int(m.sum()) < 2:
            continue
        p, t = pred[m], truth[m]  # (n_g, G)
        const = (p.std(dim=0) == 0) | (t.std(dim=0) == 0)
        if bool(const.any()):
            warnings.warn(f"groupwise_correlation: {int(const.sum())} gene(s) constant in group {int(g)}; counted as 0", stacklevel=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = fn(p, t) if p.shape[1] > 1 else fn(p[:, 0], t[:, 0]).reshape(1)
        per_group.append(torch.where(const | r.isnan(), torch.zeros_like(r), r))
    if not per_group:
        return torch.full((pred.shape[1],), float("nan"), dtype=torch.float64)
    return torch.stack(per_group).mean(dim=0)


class GeneExpressionRegressor(Shardable, pl.LightningModule):
    """Backbone ``x (B, D) -> pred (B, G)`` trained with ``loss(pred, counts, groups)``.

    Logs ``train/loss`` and ``{val,test}/{spearman,pearson}`` (mean over genes of the gene-wise
    correlation with the truth inside each group). After testing with a logger, writes
    ``predictions.csv`` (first input column, group, truth and prediction of each gene) to the run
    directory.

    Args:
        backbone: the network; its output width is the number of genes.
        loss: a module called as ``loss(pred, counts, groups)`` (e.g. ``STRankLoss``).
        optimizer: optimizer factory. Default: AdamW(lr=1e-2) (the card's toy).
        lr_scheduler: optional scheduler factory (stepped every epoch). Default: None.
    """

    def __init__(
        self,
        backbone: nn.Module,
        loss: nn.Module,
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone", "loss", "optimizer", "lr_scheduler"], logger=False)
        self.backbone = backbone
        self.loss_fn = loss
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.gathered = nn.ModuleDict({k: CatMetric(nan_strategy="disable") for k in ("x", "pred", "truth", "group")})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pred = self.backbone(x)
        return pred if pred.ndim == 2 else pred.reshape(len(pred), -1)  # (B, G)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        x, counts, groups = batch
        loss = self.loss_fn(self(x), counts, groups)
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True, batch_size=len(x))
        return loss

    def _eval_step(self, batch: tuple[torch.Tensor, ...]) -> None:
        x, truth, groups = batch
        pred = self(x)  # (B, G)
        self.gathered["x"].update(x.reshape(len(x), -1)[:, 0])
        self.gathered["pred"].update(pred)
        self.gathered["truth"].update(truth.reshape(len(truth), -1))
        self.gathered["group"].update(groups.to(pred.dtype))

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        self._eval_step(batch)

    def test_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        self._eval_step(batch)

    def _gather(self) -> dict[str, torch.Tensor]:
        out = {k: m.compute() for k, m in self.gathered.items()}
        for m in self.gathered.values():
            m.reset()
        n = len(out["group"])
        out["pred"], out["truth"] = out["pred"].reshape(n, -1), out["truth"].reshape(n, -1)
        out["group"] = out["group"].long()
        return out

    def _eval_end(self, stage: str) -> dict[str, torch.Tensor]:
        out = self._gather()
        for kind in ("spearman", "pearson"):
            r = groupwise_correlation(out["pred"], out["truth"], out["group"], kind)
            self.log(f"{stage}/{kind}", r.mean().float(), prog_bar=kind == "spearman")
        return out

    def on_validation_epoch_end(self) -> None:
        self._eval_end("val")

    def on_test_epoch_end(self) -> None:
        out = self._eval_end("test")
        if may_write(self.trainer):
            self._save_predictions(out)

    def _save_predictions(self, out: dict[str, torch.Tensor]) -> None:
        n_genes = out["pred"].shape[1]
        rows = []
        for i in range(len(out["group"])):
            row: dict[str, Any] = {"x": float(out["x"][i]), "group": int(out["group"][i])}
            for g in range(n_genes):
                row[f"truth_{g}"] = float(out["truth"][i, g])
                row[f"pred_{g}"] = float(out["pred"][i, g])
            rows.append(row)
        save_rows(self.trainer, rows, "predictions.csv")

    def predict_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameters())
        if self.scheduler_factory is None:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": self.scheduler_factory(optimizer)}
