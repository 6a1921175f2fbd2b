"""Test-time adaptation: the adapting LightningModule, single-model methods that plug-ins wrap, and the standard
baselines (SAR, RoTTA, LAME; AdaBN is ``SourceOnly(batch_stats=True)``)."""

from lowrank_lit.tta.base import (
           EATA,
           CoTTA,
           SourceData,
           SourceOnly,
           Tent,
           TTAMethod,
           TTAWrapper,
           entropy,
           norm_affine_params,
)
from lowrank_lit.tta.baselines import (
    LAME,
    SAR,
    RobustBatchNorm,
    RoTTA,
    knn_affinity,
    laplacian_adjust,
    linear_affinity,
    rbf_affinity,
)
from lowrank_lit.tta.module import TTAModule, load_backbone, plot_recurrence, purity

__all__ = ["TTAMethod", "TTAWrapper", "SourceData", "SourceOnly", "Tent", "EATA", "CoTTA", "SAR", "RoTTA", "LAME",
           "RobustBatchNorm", "knn_affinity", "rbf_affinity", "linear_affinity", "laplacian_adjust", "TTAModule", "entropy", "norm_affine_params",
           "load_backbone", "plot_recurrence", "purity"]
