"""Constrained environments for safe RL, batched in torch (tabular: exact evaluation)."""

from lowrank_lit.envs.gridnav import Evaluation, SafeGridNav, evaluate, state_occupancy

__all__ = ["SafeGridNav", "Evaluation", "evaluate", "state_occupancy"]
