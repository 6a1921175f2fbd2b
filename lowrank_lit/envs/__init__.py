"""Constrained environments for safe RL, batched in torch (tabular: exact evaluation; continuous: vectorised
rollouts; HalfCheetah through gymnasium)."""

from lowrank_lit.envs.continuous import (
           ContinuousFamily,
           HalfCheetahVelocity,
           PointNav2D,
           Rollout,
           VelocityCart,
           discounted_sum,
)
from lowrank_lit.envs.gridnav import Evaluation, SafeGridNav, evaluate, state_occupancy

__all__ = ["SafeGridNav", "Evaluation", "evaluate", "state_occupancy", "ContinuousFamily", "PointNav2D", "VelocityCart", "HalfCheetahVelocity",
           "Rollout", "discounted_sum"]
