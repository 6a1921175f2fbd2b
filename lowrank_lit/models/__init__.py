"""Backbones and the generic LightningModules that wrap them.

Heavy libraries (timm, transformers) are imported inside the factories, never at import time.
"""

from lowrank_lit.models.mlp import MLP

__all__ = ["MLP"]
