"""Generic callbacks (the YAML presets in the top-level ``callbacks/`` folder configure these and Lightning's)."""

from lowrank_lit.callbacks.config import RunConfigCallback
from lowrank_lit.callbacks.cost import StepCost
from lowrank_lit.callbacks.progress import LogProgress
from lowrank_lit.callbacks.resume import ResumeCheckpoint, RunInterrupted
from lowrank_lit.callbacks.rng import RNGStateCheckpoint
from lowrank_lit.callbacks.spectral import SpectralDiagnostics
from lowrank_lit.callbacks.trained_only import TrainedOnly

__all__ = ["LogProgress", "ResumeCheckpoint", "RNGStateCheckpoint", "RunConfigCallback", "RunInterrupted", "SpectralDiagnostics",
           "StepCost", "TrainedOnly"]
