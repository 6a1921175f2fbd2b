"""Test-time adaptation: the adapting LightningModule and single-model methods that plug-ins wrap."""

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
from lowrank_lit.tta.module import TTAModule, load_backbone, plot_recurrence, purity

__all__ = ["TTAMethod", "TTAWrapper", "SourceData", "SourceOnly", "Tent", "EATA", "CoTTA", "TTAModule", "entropy", "norm_affine_params",
           "load_backbone", "plot_recurrence", "purity"]
