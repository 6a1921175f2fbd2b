"""Continuous constrained task families, vectorised in torch (a batch of tasks x envs in one tensor op), and a
velocity-limited MuJoCo HalfCheetah through gymnasium's vector API.

Every family has ``obs_dim``, ``act_dim``, ``horizon``, ``gamma``, ``limit`` (the cost limit d on the discounted
cost), ``num_tasks`` and ``rollout(policy, tasks, n_envs, generator) -> Rollout``: ``obs (T, N, H, obs_dim)``,
``act (T, N, H, act_dim)``, ``rew (T, N, H)``, ``cost (T, N, H)`` for ``T = len(tasks)`` tasks, ``N`` envs each,
``H`` steps. The policy is called on ``(T, N, obs_dim)`` observations and returns actions (sampled).

* :class:`PointNav2D`: ``x' = x + 0.1 clip(a, -1, 1)`` from the origin; reward ``-|x - goal_task|``; cost 1 inside
  any hazard disc. Goals on the unit circle; discs half way to every other goal, so those goals need a detour.
* :class:`VelocityCart`: a double integrator ``v' = v + 0.1 clip(a)``, ``x' = x + 0.1 v'``; reward ``-|v - v_task|``;
  cost ``1[|v| > v_max]``. Targets beyond ``v_max`` trade reward against cost.
* :class:`HalfCheetahVelocity`: gymnasium's ``HalfCheetah-v5``; reward ``-|x_velocity - v_task|`` minus the control
  cost, cost ``1[x_velocity > v_max]`` from ``info["x_velocity"]``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Rollout", "ContinuousFamily", "PointNav2D", "VelocityCart", "HalfCheetahVelocity", "discounted_sum"]

Policy = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Rollout:
    obs: torch.Tensor  # (T, N, H, obs_dim)
    act: torch.Tensor  # (T, N, H, act_dim)
    rew: torch.Tensor  # (T, N, H)
    cost: torch.Tensor  # (T, N, H)


def discounted_sum(x: torch.Tensor, gamma: float) -> torch.Tensor:
    """``sum_t gamma^t x[..., t]`` ``(...)``."""
    w = gamma ** torch.arange(x.shape[-1], dtype=x.dtype)
    return (x * w).sum(-1)


class ContinuousFamily:
    """Base of the continuous families: ``reset`` / ``step`` on batched states ``(T, N, ...)``, or ``rollout`` itself."""

    obs_dim = act_dim = horizon = 0
    gamma = limit = 0.0

    def __init__(self, horizon: int, gamma: float, limit: float) -> None:
        if not 0 <= gamma < 1:
            raise ValueError(f"{type(self).__name__}: gamma={gamma!r}; allowed: [0, 1)")
        self.horizon, self.gamma, self.limit = horizon, gamma, limit

    @property
    def num_tasks(self) -> int:
        raise NotImplementedError

    def _check_tasks(self, tasks: torch.Tensor) -> None:
        if tasks.numel() == 0 or int(tasks.min()) < 0 or int(tasks.max()) >= self.num_tasks:
            raise ValueError(f"{type(self).__name__}: tasks {tasks.tolist()}; allowed: 0..{self.num_tasks - 1}")

    def reset(self, tasks: torch.Tensor, n_envs: int, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def step(self, state: torch.Tensor, action: torch.Tensor, tasks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def observe(self, state: torch.Tensor) -> torch.Tensor:
        return state

    def rollout(self, policy: Policy, tasks: torch.Tensor, n_envs: int, generator: torch.Generator) -> Rollout:
        self._check_tasks(tasks)
        state = self.reset(tasks, n_envs, generator)
        obs, acts, rews, costs = [], [], [], []
        for _ in range(self.horizon):
            o = self.observe(state)
            with torch.no_grad():
                a = policy(o)
            state, r, c = self.step(state, a, tasks)
            obs.append(o)
            acts.append(a)
            rews.append(r)
            costs.append(c)
        return Rollout(torch.stack(obs, 2), torch.stack(acts, 2), torch.stack(rews, 2), torch.stack(costs, 2))


class PointNav2D(ContinuousFamily):
    """Point navigation with hazard discs (module docstring).

    Args:
        num_goals: goals evenly spaced on the unit circle. Default: 8.
        hazard_radius: radius of the discs (centred half way to every other goal). Default: 0.2.
        horizon: steps per episode. Default: 40.
        gamma: discount. Default: 0.95.
        limit: cost limit d on the discounted cost. Default: 1.0.
    """

    obs_dim = act_dim = 2

    def __init__(self, num_goals: int = 8, hazard_radius: float = 0.2, horizon: int = 40, gamma: float = 0.95,
                 limit: float = 1.0) -> None:
        if num_goals < 2:
            raise ValueError(f"PointNav2D: num_goals={num_goals!r}; allowed: >= 2")
        super().__init__(horizon, gamma, limit)
        ang = torch.arange(num_goals) * 2 * math.pi / num_goals
        self.goals = torch.stack([ang.cos(), ang.sin()], 1)  # (G, 2)
        self.hazards = 0.5 * self.goals[::2]  # (G/2, 2)
        self.hazard_radius = hazard_radius

    @property
    def num_tasks(self) -> int:
        return self.goals.shape[0]

    def reset(self, tasks: torch.Tensor, n_envs: int, generator: torch.Generator) -> torch.Tensor:
        return 0.02 * torch.randn(len(tasks), n_envs, 2, generator=generator)

    def step(self, state: torch.Tensor, action: torch.Tensor, tasks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = state + 0.1 * action.clamp(-1, 1)  # (T, N, 2)
        rew = -(x - self.goals[tasks][:, None]).norm(dim=-1)
        inside = (torch.cdist(x.reshape(-1, 2), self.hazards) < self.hazard_radius).any(-1).reshape(x.shape[:2])
        return x, rew, inside.float()


class VelocityCart(ContinuousFamily):
    """Velocity tracking with a speed limit (module docstring).

    Args:
        targets: target velocities per task; None: 8 evenly from -1.6 to 1.6. Default: None.
        v_max: speed above which each step costs 1. Default: 1.0.
        horizon: steps per episode. Default: 40.
        gamma: discount. Default: 0.95.
        limit: cost limit d on the discounted cost. Default: 2.0.
    """

    obs_dim, act_dim = 2, 1

    def __init__(self, targets: list[float] | None = None, v_max: float = 1.0, horizon: int = 40, gamma: float = 0.95,
                 limit: float = 2.0) -> None:
        super().__init__(horizon, gamma, limit)
        self.targets = torch.tensor(targets if targets is not None else torch.linspace(-1.6, 1.6, 8).tolist())
        self.v_max = v_max

    @property
    def num_tasks(self) -> int:
        return self.targets.shape[0]

    def reset(self, tasks: torch.Tensor, n_envs: int, generator: torch.Generator) -> torch.Tensor:
        return 0.05 * torch.randn(len(tasks), n_envs, 2, generator=generator)  # (x, v)

    def step(self, state: torch.Tensor, action: torch.Tensor, tasks: torch.Tensor) -> tuple[torch.Tensor, ...]:
        v = state[..., 1] + 0.1 * action[..., 0].clamp(-1, 1)
        x = state[..., 0] + 0.1 * v
        rew = -(v - self.targets[tasks][:, None]).abs()
        return torch.stack([x, v], -1), rew, (v.abs() > self.v_max).float()


class HalfCheetahVelocity(ContinuousFamily):
    """Velocity-limited HalfCheetah-v5 (gymnasium + mujoco, CPU): one synchronous vector env of ``n_envs`` per
    task; reward ``-|x_velocity - v_task| - ctrl_cost``, cost ``1[x_velocity > v_max]``.

    Args:
        targets: target forward velocities per task. Default: [0.5, 1.0, 1.5, 2.0, 2.5, 3.0].
        v_max: velocity limit. Default: 2.0.
        horizon: steps per episode. Default: 100.
        gamma: discount. Default: 0.99.
        limit: cost limit d on the discounted cost. Default: 10.0.
    """

    obs_dim, act_dim = 17, 6

    def __init__(self, targets: list[float] | None = None, v_max: float = 2.0, horizon: int = 100, gamma: float = 0.99,
                 limit: float = 10.0) -> None:
        try:
            import gymnasium  # noqa: F401
            import mujoco  # noqa: F401
        except ImportError as err:
            raise ImportError("HalfCheetahVelocity needs gymnasium and mujoco (pip install 'gymnasium[mujoco]')") from err
        super().__init__(horizon, gamma, limit)
        self.targets = list(targets) if targets is not None else [0.5, 1.0, 1.5, 2.0, 2.5, 3.0]
        self.v_max = v_max

    @property
    def num_tasks(self) -> int:
        return len(self.targets)

    def rollout(self, policy: Policy, tasks: torch.Tensor, n_envs: int, generator: torch.Generator) -> Rollout:
        import gymnasium as gym

        self._check_tasks(tasks)
        out: list[list[torch.Tensor]] = [[], [], [], []]
        for t in tasks.tolist():
            envs = gym.vector.SyncVectorEnv([lambda: gym.make("HalfCheetah-v5") for _ in range(n_envs)])
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
            o, _ = envs.reset(seed=seed)
            obs, acts, rews, costs = [], [], [], []
            for _ in range(self.horizon):
                ot = torch.as_tensor(o, dtype=torch.float32)
                with torch.no_grad():
                    a = policy(ot[None])[0].clamp(-1, 1)
                o, _, _, _, info = envs.step(a.numpy())
                vel = torch.as_tensor(info["x_velocity"], dtype=torch.float32)
                ctrl = torch.as_tensor(info["reward_ctrl"], dtype=torch.float32)
                obs.append(ot)
                acts.append(a)
                rews.append(-(vel - self.targets[t]).abs() + ctrl)
                costs.append((vel > self.v_max).float())
            envs.close()
            for lst, xs in zip(out, (obs, acts, rews, costs), strict=True):
                lst.append(torch.stack(xs, 1))
        return Rollout(*(torch.stack(x, 0) for x in out))

    def describe(self) -> dict[str, Any]:
        return {"targets": self.targets, "v_max": self.v_max}
