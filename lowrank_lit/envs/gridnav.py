"""SafeGridNav: a tabular constrained MDP family with exact evaluation by linear solves.

An ``n x n`` grid (default 6), 4 actions (up, right, down, left); with probability ``slip`` the move goes in a
uniformly random direction instead; moves off the grid stay put. The episode starts in the corner (0, 0).
Hazard cells (default: a diagonal band ``row + col = n - 2`` across the middle, open at its top end (0, n - 2), so
goals left of the gap need a detour or a hazard crossing) cost 1 on every entry; the task's goal
cell gives reward 1 on every entry (staying on it keeps earning), so returns are in [0, 1 / (1 - gamma)].
Tasks are goal cells on the far side of the hazards; the cost limit ``d`` is shared.

Everything is a dense tensor: ``P (S, A, S)``, ``r (T, S, A)`` (one row per task), ``c (S, A)``, ``mu0 (S,)``.
:func:`evaluate` gives ``V = (I - gamma P_pi)^{-1} r_pi``, ``Q``, advantages, the discounted return ``J = mu0 V``
and the normalised discounted occupancy ``d_pi = (1 - gamma) mu0^T (I - gamma P_pi)^{-1}`` (sums to 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SafeGridNav", "Evaluation", "evaluate", "evaluate_many", "state_occupancy"]

MOVES = ((-1, 0), (0, 1), (1, 0), (0, -1))  # up, right, down, left (row, col)


@dataclass
class Evaluation:
    """Exact values of one policy on one (reward or cost) function."""

    V: torch.Tensor  # (S,)
    Q: torch.Tensor  # (S, A)
    A: torch.Tensor  # (S, A) = Q - V
    J: torch.Tensor  # () = mu0 . V


def _check_policy(pi: torch.Tensor, S: int, A: int) -> None:
    if pi.shape != (S, A):
        raise ValueError(f"policy of shape {tuple(pi.shape)}; allowed: (S, A) = ({S}, {A})")
    if bool((pi < -1e-9).any()) or not torch.allclose(pi.sum(1), torch.ones(S, dtype=pi.dtype), atol=1e-6):
        raise ValueError("policy rows must be non-negative and sum to 1")


def state_occupancy(P: torch.Tensor, pi: torch.Tensor, mu0: torch.Tensor, gamma: float) -> torch.Tensor:
    """Normalised discounted state occupancy ``(1 - gamma) mu0^T (I - gamma P_pi)^{-1}`` ``(S,)``."""
    P_pi = torch.einsum("sa,sat->st", pi, P)
    eye = torch.eye(P.shape[0], dtype=P.dtype)
    return (1 - gamma) * torch.linalg.solve((eye - gamma * P_pi).T, mu0)


def evaluate(P: torch.Tensor, pi: torch.Tensor, r: torch.Tensor, mu0: torch.Tensor, gamma: float) -> Evaluation:
    """Exact V, Q, A and J of ``pi`` ``(S, A)`` for the per-(s, a) reward ``r`` ``(S, A)`` (differentiable)."""
    if not 0 <= gamma < 1:
        raise ValueError(f"evaluate: gamma={gamma!r}; allowed: [0, 1)")
    S, A = r.shape
    _check_policy(pi.detach(), S, A)
    P_pi = torch.einsum("sa,sat->st", pi, P)  # (S, S)
    r_pi = (pi * r).sum(1)  # (S,)
    V = torch.linalg.solve(torch.eye(S, dtype=P.dtype) - gamma * P_pi, r_pi)
    Q = r + gamma * torch.einsum("sat,t->sa", P, V)
    return Evaluation(V=V, Q=Q, A=Q - V[:, None], J=mu0 @ V)


def evaluate_many(P: torch.Tensor, pi: torch.Tensor, rewards: list[torch.Tensor], mu0: torch.Tensor,
                  gamma: float) -> tuple[list[Evaluation], torch.Tensor]:
    """:func:`evaluate` of one policy on several rewards and its :func:`state_occupancy`, from one LU factorisation of
    ``I - gamma P_pi`` (every value a solve with it, the occupancy a solve with its transpose): the same values as
    :func:`evaluate` and :func:`state_occupancy`, with one factorisation instead of one per call."""
    if not 0 <= gamma < 1:
        raise ValueError(f"evaluate_many: gamma={gamma!r}; allowed: [0, 1)")
    S, A = rewards[0].shape
    _check_policy(pi.detach(), S, A)
    P_pi = torch.einsum("sa,sat->st", pi, P)  # (S, S)
    lu = torch.linalg.lu_factor(torch.eye(S, dtype=P.dtype) - gamma * P_pi)
    r_pi = torch.stack([(pi * r).sum(1) for r in rewards], 1)  # (S, K)
    V = torch.linalg.lu_solve(*lu, r_pi)  # (S, K)
    occ = (1 - gamma) * torch.linalg.lu_solve(*lu, mu0[:, None], adjoint=True)[:, 0]  # (S,)
    out = []
    for k, r in enumerate(rewards):
        Q = r + gamma * torch.einsum("sat,t->sa", P, V[:, k])
        out.append(Evaluation(V=V[:, k], Q=Q, A=Q - V[:, k, None], J=mu0 @ V[:, k]))
    return out, occ


class SafeGridNav:
    """The grid CMDP family (module docstring).

    Args:
        size: grid side n. Default: 6.
        slip: probability of a uniformly random move. Default: 0.1.
        gamma: discount. Default: 0.95.
        hazards: hazard cells ``[[row, col], ...]``; None: the band ``row + col = n - 2`` without its top cell
            ((1, 3), (2, 2), (3, 1), (4, 0) on 6 x 6). Default: None.
        goals: task goal cells; None: the cells of the far row and column with row + col >= n (9 on 6 x 6).
        limit: the cost limit d. Default: 0.8.
        dtype: float64 for exact evaluation. Default: float64.
    """

    def __init__(self, size: int = 6, slip: float = 0.1, gamma: float = 0.95, hazards: list[list[int]] | None = None,
                 goals: list[list[int]] | None = None, limit: float = 0.8, dtype: torch.dtype = torch.float64) -> None:
        if size < 3:
            raise ValueError(f"SafeGridNav: size={size!r}; allowed: >= 3")
        if not 0 <= slip <= 1:
            raise ValueError(f"SafeGridNav: slip={slip!r}; allowed: [0, 1]")
        if not 0 <= gamma < 1:
            raise ValueError(f"SafeGridNav: gamma={gamma!r}; allowed: [0, 1)")
        n = size
        self.size, self.slip, self.gamma, self.limit, self.dtype = n, slip, gamma, limit, dtype
        if hazards is None:  # a diagonal band across the middle, open only at its top end
            hazards = [[i, n - 2 - i] for i in range(1, n - 1)]
        if goals is None:
            far = [[n - 1, j] for j in range(n)] + [[i, n - 1] for i in range(n - 1)]
            goals = [g for g in far if g not in hazards and g[0] + g[1] >= n][:9]
        for cell in [*hazards, *goals]:
            if not (0 <= cell[0] < n and 0 <= cell[1] < n):
                raise ValueError(f"SafeGridNav: cell {cell} outside the {n} x {n} grid")
        self.hazards, self.goals = [list(h) for h in hazards], [list(g) for g in goals]
        S, A = n * n, 4
        P = torch.zeros(S, A, S, dtype=dtype)
        for s in range(S):
            i, j = divmod(s, n)
            for a in range(A):
                for b, (di, dj) in enumerate(MOVES):
                    p = (1 - slip) * (a == b) + slip / A
                    ni, nj = min(max(i + di, 0), n - 1), min(max(j + dj, 0), n - 1)
                    P[s, a, ni * n + nj] += p
        self.P = P
        hazard = torch.zeros(S, dtype=dtype)
        for h in self.hazards:
            hazard[h[0] * n + h[1]] = 1
        self.c = torch.einsum("sat,t->sa", P, hazard)  # expected cost of entering a hazard
        self.mu0 = torch.zeros(S, dtype=dtype)
        self.mu0[0] = 1
        self.S, self.A = S, A

    @property
    def num_tasks(self) -> int:
        return len(self.goals)

    def reward(self, task: int) -> torch.Tensor:
        """``r (S, A)``: probability of entering the goal of ``task``."""
        if not 0 <= task < self.num_tasks:
            raise ValueError(f"SafeGridNav: task={task!r}; allowed: 0..{self.num_tasks - 1}")
        g = self.goals[task]
        goal = torch.zeros(self.S, dtype=self.dtype)
        goal[g[0] * self.size + g[1]] = 1
        return torch.einsum("sat,t->sa", self.P, goal)

    def evaluate(self, pi: torch.Tensor, task: int) -> tuple[Evaluation, Evaluation, torch.Tensor]:
        """Reward and cost evaluations of ``pi`` on ``task`` and its normalised state occupancy ``(S,)``."""
        er = evaluate(self.P, pi, self.reward(task), self.mu0, self.gamma)
        ec = evaluate(self.P, pi, self.c, self.mu0, self.gamma)
        return er, ec, state_occupancy(self.P, pi, self.mu0, self.gamma)
