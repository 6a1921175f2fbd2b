"""What/how continual learning with context-composed low-rank RNNs.

Shan, Minni, Duncker, "Separating the what and how of compositional computation to enable reuse and continual
learning" (NeurIPS 2025, arXiv 2510.20709). No public code. The "what" system (:class:`EpochHMM`) learns a
vocabulary of task epochs online, one trial at a time, and infers the current epoch from the inputs; the "how"
system (:class:`ComposedLowRankRNN`) runs a recurrence composed from per-epoch low-rank components weighted by
that context.

What (forms inferred; our choices):

* emission ``q_t | z = k, x ~ N(A_k phi(x), diag sigma_k^2)``, ``phi(x) = [1, cos x, sin x]``, ``q_t = [s_t, y_t]``;
  ``A_k`` by weighted least squares on exponentially forgotten (rho) sufficient statistics, ``sigma_k^2`` from the
  weighted residuals with a prior (a young epoch is uncertain) and a floor;
* task-specific transitions ``Lambda^c`` from Dirichlet counts with a sticky prior ``kappa`` on self-transitions
  and ``eps`` elsewhere (never-seen transitions keep only prior mass);
* a trial's segment is unexplained where the best per-step emission log-likelihood stays below ``tau_new`` for at
  least ``min_len`` steps; our additions: the run is cut at the first jump in the observations (two new epochs in
  a row stay apart); a Viterbi path that returns to an epoch it already left is relabelled to an unused epoch
  that explains it, or is unexplained (the tasks visit each epoch once per trial: the memory epoch looks like
  fixation, only its place in the sequence tells them apart); and one trial fixes only one stimulus angle, so
  an epoch opens once ``min_trials`` trials had such a segment, fitted on all of them;
* test-time context: forward filtering with the inputs only (target dimensions marginalised) and the task id,
  ``c_t = p(z_t | s_1..t, task)``.

How: ``h_{t+1} = (1 - alpha) h_t + alpha [(W_0 + gamma sum_k c_tk U_k V_k^T) tanh(h_t) + W_in s_t + sum_k c_tk b_k]``,
``y_t = W_out tanh(h_{t+1})``; components pre-allocated (``max_components``) so every DDP rank holds the same
parameters; the context sum is one einsum over components (no Python loop).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import nn

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.data.stream import SeededBatches, stream_loader
from lowrank_lit.registry import register_method
from lowrank_lit.report import (
    artifact_path,
    log_image,
    markdown_table,
    may_write,
    mean_std,
    new_figure,
    read_runs,
    save_figure,
    save_rows,
)
from lowrank_lit.seeding import run_seed
from lowrank_lit.sharding import Shardable

__all__ = ["ComposedLowRankRNN", "EpochHMM", "check_context", "VanillaRNN", "CognitiveStreamDataModule", "WhatHowModule",
           "state_holding", "hold_loss"]

PAPER = "Separating the what and how of compositional computation to enable reuse and continual learning"


def check_context(context: torch.Tensor, batch: int, steps: int, k: int) -> None:
    """Raise ValueError unless ``context`` is ``(batch, steps, k)``, non-negative, rows summing to 1 (tol 1e-4)."""
    if context.shape != (batch, steps, k):
        raise ValueError(f"context of shape {tuple(context.shape)}; allowed: (B, T, max_components) = ({batch}, {steps}, {k})")
    if bool((context < 0).any()):
        raise ValueError("context has negative entries; allowed: probabilities")
    if not torch.allclose(context.sum(-1), torch.ones((), dtype=context.dtype), atol=1e-4):
        raise ValueError("context rows must sum to 1 (tol 1e-4)")


class ComposedLowRankRNN(nn.Module):
    """The "how" system (module docstring).

    Args:
        n_in: input size. Default: 3.
        n_out: output size. Default: 3.
        n_units: N. Default: 64.
        rank: r of each component. Default: 2.
        max_components: pre-allocated components K. Default: 16.
        alpha: leak in (0, 1]. Default: 0.2.
        gamma: scale of the low-rank sum. Default: 1.0.
        w0_gain: gain of the fixed random W_0 (entries N(0, (gain / sqrt(N))^2)); 0 for none. Default: 0.8.
        init_std: std of U_k, V_k. Default: 0.1.
        seed: seed of the fixed W_0, W_in and the initial parameters; None: drawn from torch's global generator
            (the run seed under ``seed_everything``). Default: None.
    """

    def __init__(self, n_in: int = 3, n_out: int = 3, n_units: int = 64, rank: int = 2, max_components: int = 16,
                 alpha: float = 0.2, gamma: float = 1.0, w0_gain: float = 0.8, init_std: float = 0.1, seed: int | None = None) -> None:
        super().__init__()
        if not 1 <= rank <= n_units:
            raise ValueError(f"ComposedLowRankRNN: rank={rank!r}; allowed: 1..n_units={n_units}")
        if not 0 < alpha <= 1:
            raise ValueError(f"ComposedLowRankRNN: alpha={alpha!r}; allowed: (0, 1]")
        if max_components < 1:
            raise ValueError(f"ComposedLowRankRNN: max_components={max_components!r}; allowed: >= 1")
        g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, (1,))))
        self.n_in, self.n_out, self.n_units, self.rank, self.max_components = n_in, n_out, n_units, rank, max_components
        self.alpha, self.gamma = alpha, gamma
        self.U = nn.Parameter(init_std * torch.randn(max_components, n_units, rank, generator=g))  # (K, N, r)
        self.V = nn.Parameter(init_std * torch.randn(max_components, n_units, rank, generator=g))  # (K, N, r)
        self.b = nn.Parameter(torch.zeros(max_components, n_units))  # (K, N)
        self.W_out = nn.Parameter(torch.randn(n_out, n_units, generator=g) / math.sqrt(n_units))  # (n_out, N)
        self.register_buffer("W0", w0_gain / math.sqrt(n_units) * torch.randn(n_units, n_units, generator=g))
        self.register_buffer("W_in", torch.randn(n_units, n_in, generator=g) / math.sqrt(n_in))

    def component(self, k: int) -> torch.Tensor:
        """``U_k V_k^T`` ``(N, N)`` (rank <= r)."""
        return self.U[k] @ self.V[k].T

    def forward(self, inputs: torch.Tensor, context: torch.Tensor, h0: torch.Tensor | None = None,
                return_states: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``inputs (B, T, n_in)``, ``context (B, T, K)`` -> outputs ``(B, T, n_out)`` (and, with ``return_states``,
        the rates ``tanh(h_{t+1})`` ``(B, T, N)`` the outputs are read from)."""
        B, T, n_in = inputs.shape
        if n_in != self.n_in:
            raise ValueError(f"ComposedLowRankRNN: inputs with {n_in} features; allowed: n_in={self.n_in}")
        if not bool(torch.isfinite(inputs).all()):
            raise ValueError("ComposedLowRankRNN: inputs contain NaN or inf")
        check_context(context, B, T, self.max_components)
        h = torch.zeros(B, self.n_units, dtype=inputs.dtype) if h0 is None else h0
        drive = inputs @ self.W_in.T + context @ self.b  # (B, T, N)
        rates = []
        for t in range(T):
            r = torch.tanh(h)  # (B, N)
            proj = torch.einsum("bn,knr->bkr", r, self.V)  # (B, K, r)
            low = torch.einsum("bk,bkr,knr->bn", context[:, t], proj, self.U)  # (B, N)
            h = (1 - self.alpha) * h + self.alpha * (r @ self.W0.T + self.gamma * low + drive[:, t])
            rates.append(torch.tanh(h))
        states = torch.stack(rates, 1)  # (B, T, N)
        outs = states @ self.W_out.T  # (B, T, n_out)
        return (outs, states) if return_states else outs


class EpochHMM:
    """The "what" system (module docstring).

    Args:
        obs_dim: size of q = [inputs, targets]. Default: 6.
        n_inputs: the first ``n_inputs`` dimensions are inputs (seen at test time). Default: 3.
        max_components: vocabulary capacity. Default: 16.
        tau_new: per-step log-likelihood (nats) below which steps are unexplained. Default: -8.
        min_len: unexplained steps in a row that open an epoch. Default: 3.
        kappa: sticky prior count on self-transitions. Default: 10.
        eps: prior count on every other transition. Default: 0.01.
        rho: forgetting factor of the emission statistics per trial. Default: 0.99.
        var_floor: minimum emission variance. Default: 0.01.
        ridge: ridge on the cos / sin columns of A. Default: 1e-3.
        var_prior, prior_steps: prior variance of a new epoch and its weight in steps. Default: 0.02, 20.
        min_trials: trials with an unexplained segment (at different trial variables) that open one epoch fitted
            on all of them; the trials in between only wait. Default: 3.
        jump: an unexplained run is cut where consecutive observations differ by more than this (norm). Default: 0.5.
    """

    def __init__(self, obs_dim: int = 6, n_inputs: int = 3, max_components: int = 16, tau_new: float = -8.0, min_len: int = 3,
                 kappa: float = 10.0, eps: float = 0.01, rho: float = 0.99, var_floor: float = 0.01, ridge: float = 1e-3,
                 var_prior: float = 0.02, prior_steps: float = 20.0, min_trials: int = 3, jump: float = 0.5) -> None:
        if max_components < 1:
            raise ValueError(f"EpochHMM: max_components={max_components!r}; allowed: >= 1")
        self.D, self.n_inputs, self.K_max = obs_dim, n_inputs, max_components
        self.tau_new, self.min_len, self.kappa, self.eps, self.rho = tau_new, min_len, kappa, eps, rho
        self.var_floor, self.ridge, self.var_prior, self.prior_steps = var_floor, ridge, var_prior, prior_steps
        self.min_trials, self.jump = min_trials, jump
        d = torch.float64
        self.K = 0
        self.Sff = torch.zeros(max_components, 3, 3, dtype=d)  # sum w phi phi^T
        self.Sfq = torch.zeros(max_components, 3, obs_dim, dtype=d)  # sum w phi q^T
        self.Sqq = torch.zeros(max_components, obs_dim, dtype=d)  # sum w q^2
        self.n = torch.zeros(max_components, dtype=d)
        self.A = torch.zeros(max_components, obs_dim, 3, dtype=d)
        self.var = torch.ones(max_components, obs_dim, dtype=d)
        self.trans: dict[str, torch.Tensor] = {}  # task -> (K_max, K_max) counts
        self.pending: dict[str, list[tuple[torch.Tensor, float]]] = {}  # unexplained segments awaiting min_trials
        self.init: dict[str, torch.Tensor] = {}  # task -> (K_max,) counts

    @property
    def vocab_size(self) -> int:
        return self.K

    # -- model pieces --------------------------------------------------------------------------------------
    @staticmethod
    def features(x: torch.Tensor | float) -> torch.Tensor:
        x = torch.as_tensor(x, dtype=torch.float64)
        return torch.stack([torch.ones_like(x), x.cos(), x.sin()], -1)

    def loglik(self, q: torch.Tensor, x: float, dims: slice | None = None) -> torch.Tensor:
        """Per-step emission log-likelihood ``(T, K)`` of the active epochs (``dims``: the observed dimensions)."""
        if not bool(torch.isfinite(q).all()):
            raise ValueError("EpochHMM: observations contain NaN or inf")
        dims = dims or slice(None)
        mu = torch.einsum("kdf,f->kd", self.A[: self.K], self.features(x))[:, dims]  # (K, d)
        var = self.var[: self.K, dims]
        qd = q.double()[:, dims]  # (T, d)
        return -0.5 * (((qd[:, None] - mu[None]) ** 2 / var[None]) + torch.log(2 * math.pi * var[None])).sum(-1)

    def transition_matrix(self, task: str) -> torch.Tensor:
        """``Lambda^task`` ``(K, K)``: rows sum to 1 (counts + sticky prior)."""
        if task not in self.trans:
            raise KeyError(f"EpochHMM: unknown task {task!r}; known: {', '.join(sorted(self.trans)) or '(none)'}")
        return self._lambda(self.trans[task])

    def _lambda(self, counts: torch.Tensor) -> torch.Tensor:
        K = self.K
        prior = torch.full((K, K), self.eps, dtype=torch.float64) + (self.kappa - self.eps) * torch.eye(K, dtype=torch.float64)
        m = counts[:K, :K] + prior
        return m / m.sum(1, keepdim=True)

    def _initial(self, task: str) -> torch.Tensor:
        """The task's initial-epoch distribution; a new task borrows the counts pooled over the known tasks."""
        pooled = sum(self.init.values()) if self.init else torch.zeros(self.K_max, dtype=torch.float64)
        c = self.init.get(task, pooled)[: self.K] + self.eps
        return c / c.sum()

    # -- inference -----------------------------------------------------------------------------------------
    def filter(self, inputs: torch.Tensor, x: torch.Tensor | float, task: str) -> torch.Tensor:
        """``c_t = p(z_t | s_1..t, task)`` from the inputs only (the target dimensions are marginalised): inputs
        ``(T, n_inputs)`` or a batch ``(B, T, n_inputs)`` with trial variables ``x`` ``(B,)``; returns ``(T, K_max)``
        or ``(B, T, K_max)`` (zeros beyond the vocabulary)."""
        if inputs.shape[-1] != self.n_inputs:
            raise ValueError(f"EpochHMM.filter: inputs with {inputs.shape[-1]} features; allowed: n_inputs={self.n_inputs}")
        single = inputs.ndim == 2
        s = inputs[None] if single else inputs  # (B, T, n)
        xs = torch.as_tensor(x, dtype=torch.float64).reshape(-1).expand(s.shape[0])
        if not bool(torch.isfinite(s).all()):
            raise ValueError("EpochHMM: observations contain NaN or inf")
        lam = self.transition_matrix(task)  # (K, K)
        K, n = self.K, self.n_inputs
        mu = torch.einsum("kdf,bf->bkd", self.A[:K, :n], self.features(xs))  # (B, K, n)
        var = self.var[:K, :n]
        ll = -0.5 * (((s.double()[:, :, None] - mu[:, None]) ** 2 / var) + torch.log(2 * math.pi * var)).sum(-1)  # (B, T, K)
        out = torch.zeros(s.shape[0], s.shape[1], self.K_max, dtype=torch.float64)
        alpha = self._initial(task).expand(s.shape[0], K)
        for t in range(s.shape[1]):
            prior = alpha if t == 0 else alpha @ lam
            post = prior * torch.exp(ll[:, t] - ll[:, t].max(1, keepdim=True).values)
            alpha = post / post.sum(1, keepdim=True)
            out[:, t, :K] = alpha
        return out[0] if single else out

    def _viterbi(self, ll: torch.Tensor, lam: torch.Tensor, init: torch.Tensor) -> list[int]:
        T, K = ll.shape
        score = init.log() + ll[0]
        back = torch.zeros(T, K, dtype=torch.long)
        for t in range(1, T):
            cand = score[:, None] + lam.log()  # (K, K): from j to i
            back[t] = cand.argmax(0)
            score = cand.max(0).values + ll[t]
        path = [int(score.argmax())]
        for t in range(T - 1, 0, -1):
            path.append(int(back[t, path[-1]]))
        return path[::-1]

    # -- learning ------------------------------------------------------------------------------------------
    def _new_epoch(self, segments: list[tuple[torch.Tensor, float]]) -> int:
        if self.K >= self.K_max:
            raise RuntimeError(f"EpochHMM: the vocabulary would exceed max_components={self.K_max}")
        k = self.K
        self.K += 1
        for q, x in segments:
            self._accumulate(k, q, x, torch.ones(q.shape[0], dtype=torch.float64))
        self._refit(k)
        return k

    def _unexplained(self, q: torch.Tensor, x: float, task: str) -> tuple[int, int] | None:
        """The first segment the current vocabulary does not explain: emission below tau_new (cut at the first jump
        in the observations, so two new epochs in a row are not merged), or a revisit no unused epoch explains."""
        if self.K == 0:  # the first epoch starts from the trial's first steps
            return 0, self.min_len
        seg = _first_run(self.loglik(q, x).max(1).values < self.tau_new, self.min_len)
        if seg is not None:
            jumps = ((q[seg[0] + 1: seg[1]] - q[seg[0]: seg[1] - 1]).norm(dim=1) > self.jump).nonzero()
            return (seg[0], seg[0] + 1 + int(jumps[0])) if len(jumps) and int(jumps[0]) + 1 >= self.min_len else seg
        _, seg = self._path(q, x, task)
        return seg

    def _path(self, q: torch.Tensor, x: float, task: str) -> tuple[list[int], tuple[int, int] | None]:
        """The trial's Viterbi path with each revisit relabelled to the best unused epoch that explains it; the
        first revisit that none explains is returned as the segment for a new epoch."""
        ll = self.loglik(q, x)
        lam = self._lambda(self.trans.get(task, torch.zeros(self.K_max, self.K_max, dtype=torch.float64)))
        path = self._viterbi(ll, lam, self._initial(task))
        runs, t = [], 0
        while t < len(path):
            s0 = t
            while t < len(path) and path[t] == path[s0]:
                t += 1
            runs.append([path[s0], s0, t])
        used: set[int] = set()
        for run in runs:
            k, a, b = run
            if k in used:
                score = ll[a:b].mean(0)
                free = [j for j in range(self.K) if j not in used and float(score[j]) >= self.tau_new]
                if not free:
                    return path, ((a, b) if b - a >= self.min_len else None)
                run[0] = max(free, key=lambda j: float(score[j]))
            used.add(run[0])
        return [k for k, a, b in runs for _ in range(b - a)], None

    def _accumulate(self, k: int, q: torch.Tensor, x: float, w: torch.Tensor) -> None:
        f = self.features(x)  # (3,)
        qd = q.double()
        self.Sff[k] += w.sum() * torch.outer(f, f)
        self.Sfq[k] += torch.outer(f, (w[:, None] * qd).sum(0))
        self.Sqq[k] += (w[:, None] * qd**2).sum(0)
        self.n[k] += w.sum()

    def _refit(self, k: int) -> None:
        reg = torch.diag(torch.tensor([1e-6, self.ridge, self.ridge], dtype=torch.float64))
        A = torch.linalg.solve(self.Sff[k] + reg, self.Sfq[k]).T  # (D, 3)
        self.A[k] = A
        # residual variance: E[q^2] - 2 E[q mu] + E[mu^2] via the statistics
        sq = self.Sqq[k] - 2 * (A * self.Sfq[k].T).sum(1) + torch.einsum("df,fg,dg->d", A, self.Sff[k], A)
        # an inverse-gamma-like prior (var_prior over prior_steps pseudo-steps): a young epoch is uncertain, so the
        # next trial's other stimulus angle does not look novel
        self.var[k] = ((sq.clamp_min(0) + self.prior_steps * self.var_prior) / (self.n[k] + self.prior_steps)).clamp_min(self.var_floor)

    def observe_trial(self, q: torch.Tensor, x: float, task: str) -> list[int]:
        """Learn from one trial ``q (T, obs_dim)`` with trial variable ``x`` of ``task``: open new epochs where
        needed, then update the emission statistics (forgetting ``rho``) and the task's transition counts from the
        trial's Viterbi path, which is returned (epoch index per step)."""
        if q.ndim != 2 or q.shape[1] != self.D:
            raise ValueError(f"EpochHMM.observe_trial: q of shape {tuple(q.shape)}; allowed: (T, obs_dim={self.D})")
        if not bool(torch.isfinite(q).all()):
            raise ValueError("EpochHMM: observations contain NaN or inf")
        T = q.shape[0]
        seg = self._unexplained(q, x, task)
        if seg is not None:  # wait for min_trials trials with such a segment: their angles identify A_k
            self.pending.setdefault(task, []).append((q[seg[0]: seg[1]], x))
            if len(self.pending[task]) < self.min_trials:
                return []
            self._new_epoch(self.pending.pop(task))
            return self.observe_trial(q, x, task)
        if self.K == 0:
            return []
        path, _ = self._path(q, x, task)
        self.Sff *= self.rho
        self.Sfq *= self.rho
        self.Sqq *= self.rho
        self.n *= self.rho
        for k in set(path):
            w = torch.tensor([1.0 if p == k else 0.0 for p in path], dtype=torch.float64)
            self._accumulate(k, q, x, w)
            self._refit(k)
        counts = self.trans.setdefault(task, torch.zeros(self.K_max, self.K_max, dtype=torch.float64))
        for a, b in zip(path, path[1:], strict=False):
            counts[a, b] += 1
        self.init.setdefault(task, torch.zeros(self.K_max, dtype=torch.float64))[path[0]] += 1
        assert len(path) == T
        return path


def _first_run(mask: torch.Tensor, min_len: int) -> tuple[int, int] | None:
    """The first run of at least ``min_len`` True values: ``(start, end)``."""
    start = None
    for t, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = t
        elif not m and start is not None:
            if t - start >= min_len:
                return start, t
            start = None
    return None




# -- Lightning ----------------------------------------------------------------------------------------------

class VanillaRNN(nn.Module):
    """Baseline: a full-rank leaky RNN (same leak and sizes) with a one-hot task input appended to the inputs.

    Args:
        n_in, n_out, n_units: sizes (n_in includes the one-hot task block). alpha: leak. seed: init seed.
    """

    def __init__(self, n_in: int = 7, n_out: int = 3, n_units: int = 64, alpha: float = 0.2, seed: int | None = None) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31 - 1, (1,))))
        self.alpha, self.n_units = alpha, n_units
        self.W = nn.Parameter(0.8 * torch.randn(n_units, n_units, generator=g) / math.sqrt(n_units))
        self.W_in = nn.Parameter(torch.randn(n_units, n_in, generator=g) / math.sqrt(n_in))
        self.b = nn.Parameter(torch.zeros(n_units))
        self.W_out = nn.Parameter(torch.randn(n_out, n_units, generator=g) / math.sqrt(n_units))

    def forward(self, inputs: torch.Tensor, return_states: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``inputs (B, T, n_in)`` -> outputs ``(B, T, n_out)`` (and the rates ``(B, T, N)`` with ``return_states``)."""
        h = torch.zeros(inputs.shape[0], self.n_units, dtype=inputs.dtype)
        drive = inputs @ self.W_in.T + self.b
        rates = []
        for t in range(inputs.shape[1]):
            h = (1 - self.alpha) * h + self.alpha * (torch.tanh(h) @ self.W.T + drive[:, t])
            rates.append(torch.tanh(h))
        states = torch.stack(rates, 1)  # (B, T, N)
        outs = states @ self.W_out.T
        return (outs, states) if return_states else outs


class _StreamBatches(SeededBatches):
    """Item i: a batch of ``tasks[i // steps]`` from the generator seeded by (seed, epoch, i)."""

    def __init__(self, tasks: list[str], steps: int, batch_size: int, noise: float, seed: int) -> None:
        super().__init__(lambda g: None, len(tasks) * steps, seed)
        self.tasks, self.steps, self.batch_size, self.noise = tasks, steps, batch_size, noise

    def __getitem__(self, i: int) -> dict[str, Any]:
        from lowrank_lit.data.cognitive import make_trials

        stage = int(i) // self.steps
        self.sample = lambda g: {**make_trials(self.tasks[stage], self.batch_size, g, self.noise), "stage": stage}
        return super().__getitem__(i)


class CognitiveStreamDataModule(pl.LightningDataModule):
    """The task stream: ``steps_per_stage`` batches of each of ``tasks`` in order (one epoch = the whole stream),
    every batch seeded by its index (the same on every rank and after a resume).

    Args:
        tasks: training tasks in stage order. Default: [DelayPro, DelayAnti, MemoryPro].
        eval_tasks: tasks of the forgetting matrix (may include unseen ones). Default: the four tasks.
        steps_per_stage: Adam steps per task. Default: 250.
        batch_size: trials per step. Default: 64.
        noise: input noise. Default: 0.05.
        seed: None: the run seed. Default: None.
    """

    def __init__(self, tasks: list[str] | None = None, eval_tasks: list[str] | None = None, steps_per_stage: int = 250,
                 batch_size: int = 64, noise: float = 0.05, seed: int | None = None) -> None:
        super().__init__()
        from lowrank_lit.data.cognitive import TASKS

        self.tasks = list(tasks) if tasks is not None else ["DelayPro", "DelayAnti", "MemoryPro"]
        self.eval_tasks = list(eval_tasks) if eval_tasks is not None else list(TASKS)
        for t in [*self.tasks, *self.eval_tasks]:
            if t not in TASKS:
                raise ValueError(f"CognitiveStreamDataModule: task {t!r}; allowed: {', '.join(TASKS)}")
        if steps_per_stage < 1:
            raise ValueError(f"CognitiveStreamDataModule: steps_per_stage={steps_per_stage!r}; allowed: >= 1")
        self.steps_per_stage, self.batch_size, self.noise, self.seed = steps_per_stage, batch_size, noise, seed

    def train_dataloader(self) -> Any:
        return stream_loader(_StreamBatches(self.tasks, self.steps_per_stage, self.batch_size, self.noise, run_seed(self.seed)))


METHODS = ("what_how", "oracle", "vanilla")


def _decode_accuracy(fit: torch.Tensor, theta_fit: torch.Tensor, test: torch.Tensor, theta_test: torch.Tensor,
                     tol: float = math.pi / 10, ridge: float = 1e-3) -> float:
    """Linear decoder ``[r, 1] -> (cos, sin)`` fitted by ridge regression (``ridge``; plain least squares
    extrapolates wildly off the fitted states' subspace) on ``fit (n, N)``; the share of ``test`` trials whose
    decoded angle is within ``tol`` of the stimulus angle."""
    X = torch.cat([fit, torch.ones(len(fit), 1, dtype=fit.dtype)], 1).double()  # (n, N + 1)
    Y = torch.stack([theta_fit.cos(), theta_fit.sin()], 1).double()  # (n, 2)
    W = torch.linalg.solve(X.T @ X + ridge * torch.eye(X.shape[1], dtype=X.dtype), X.T @ Y)  # (N + 1, 2)
    pred = torch.cat([test, torch.ones(len(test), 1, dtype=test.dtype)], 1).double() @ W
    err = torch.atan2(pred[:, 1], pred[:, 0]) - theta_test.double()
    return float((torch.atan2(err.sin(), err.cos()).abs() < tol).float().mean())


def _memory_steps(epochs: torch.Tensor) -> torch.Tensor:
    """``(T,)`` mask of the memory epoch in trials with epochs ``(n, T)`` (the same sequence in every trial)."""
    from lowrank_lit.data.cognitive import EPOCHS

    return epochs[0] == EPOCHS.index("M")


def hold_loss(states: torch.Tensor, epochs: torch.Tensor) -> torch.Tensor | None:
    """Mean over the memory steps of ``||r_t - r_S||^2 / ||r_S||^2`` for rates ``states (B, T, N)``, ``r_S`` the
    (detached) rates at the last stimulus step; None for trials without a memory epoch (``epochs (B, T)``, the
    same epoch sequence in every trial)."""
    memory = _memory_steps(epochs)  # (T,)
    if not bool(memory.any()):
        return None
    r_s = states[:, int(memory.nonzero()[0]) - 1].detach()  # (B, N)
    dist = (states[:, memory] - r_s[:, None]).pow(2).sum(-1) / r_s.pow(2).sum(-1, keepdim=True).clamp_min(1e-8)
    return dist.mean()


def state_holding(states: torch.Tensor, epochs: torch.Tensor, theta: torch.Tensor) -> dict[str, float]:
    """How well the memory epoch holds the stimulus, from rates ``states (n, T, N)`` of trials with epochs
    ``(n, T)`` and stimulus angles ``theta (n,)``; {} for trials without a memory epoch.

    * ``hold_distance``: mean ``||r_M - r_S|| / ||r_S||`` between the rates at the last memory step and at the
      last stimulus step (0: the state is held exactly);
    * ``decode_delay``: decoding accuracy of the angle from ``r_M`` (ridge decoder, ridge 1e-3, fitted on the
      first half of the trials at the same step, tested on the second);
    * ``decode_transfer``: the decoder fitted on ``r_S`` applied to ``r_M``: whether what a component reading the
      state right after the stimulus would read is still there after the delay.
    """
    m = _memory_steps(epochs).nonzero()
    if len(m) == 0:
        return {}
    s_end, m_end = int(m[0]) - 1, int(m[-1])
    r_s, r_m = states[:, s_end].double(), states[:, m_end].double()  # (n, N)
    half = len(theta) // 2
    return {"hold_distance": float(((r_m - r_s).norm(dim=1) / r_s.norm(dim=1).clamp_min(1e-8)).mean()),
            "decode_delay": _decode_accuracy(r_m[:half], theta[:half], r_m[half:], theta[half:]),
            "decode_transfer": _decode_accuracy(r_s[:half], theta[:half], r_m[half:], theta[half:])}


@register_method("lowrank_rnn_cl", kind="LightningModule", paper=PAPER, summary="summary", bench="bench")
class WhatHowModule(Shardable, pl.LightningModule):
    """Continual learning over the task stream of :class:`CognitiveStreamDataModule`.

    ``method``: ``what_how`` (context inferred by the :class:`EpochHMM`, which first observes ``what_trials`` trials
    of each new task, unsupervised, one at a time), ``oracle`` (one-hot true epochs; one component per epoch in
    order of first appearance) or ``vanilla`` (:class:`VanillaRNN` with a one-hot task input, every weight
    trained at every stage). At a stage boundary the optimizer is rebuilt (fresh Adam state), the components that
    existed before the stage are frozen when ``freeze_reused`` (exactly: their gradients are masked, so Adam
    leaves them bit-identical) and ``W_out`` is trained in the first stage only. After every stage the accuracy
    on every evaluation task is logged (``forget/after_<k>_<trained>/<task>``), the forgetting matrix is written to
    ``forgetting.csv`` / ``forgetting.png`` and the vocabulary size to ``train/vocab``; ``inferred_epochs.png``
    shows inferred against true epochs of one trial per task.

    Args:
        how: the composed RNN (``what_how`` / ``oracle``).
        what: the epoch HMM (``what_how``); None: defaults.
        method: ``what_how``, ``oracle`` or ``vanilla``. Default: what_how.
        vanilla: the baseline network (``vanilla``); None: defaults.
        freeze_reused: freeze components used by earlier stages. Default: True.
        lr: Adam learning rate. Default: 3e-3.
        what_trials: trials the what system observes per new task (also for an unseen evaluation task). Default: 30.
        eval_trials: trials per task in the forgetting matrix. Default: 256.
        hold_weight: weight of an auxiliary state-holding loss on the memory epoch of a training trial (ours, not
            the paper's): the mean over the memory steps of ``||r_t - r_S||^2 / ||r_S||^2``, ``r_S`` the rates at
            the last stimulus step (detached), so that the memory component keeps the state where a response
            component trained straight after the stimulus reads it. 0: off. Default: 0.

    After every stage, for each evaluation task with a memory epoch, the state-holding diagnostics are logged
    (:func:`state_holding`): ``state/after_<k>_<trained>/<task>/hold_distance``, ``.../decode_delay`` and
    ``.../decode_transfer``.
    """

    #: under DDP some parameters get no gradient at a step (the network the method does not use, components frozen
    #: after their stage, the readout after the first stage): the CLI runs it with ``ddp_find_unused_parameters_true``
    ddp_find_unused_parameters: ClassVar[bool] = True

    def __init__(self, how: ComposedLowRankRNN | None = None, what: EpochHMM | None = None, method: str = "what_how",
                 vanilla: VanillaRNN | None = None, freeze_reused: bool = True, lr: LearningRate = 3e-3, what_trials: int = 30,
                 eval_trials: int = 256, hold_weight: float = 0.0) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"WhatHowModule: method={method!r}; allowed: {', '.join(METHODS)}")
        if not hold_weight >= 0:
            raise ValueError(f"WhatHowModule: hold_weight={hold_weight!r}; allowed: >= 0")
        self.save_hyperparameters(ignore=["how", "what", "vanilla"], logger=False)
        self.method = method
        self.how = how if how is not None else ComposedLowRankRNN()
        self.what = what if what is not None else EpochHMM()
        self.vanilla = vanilla if vanilla is not None else VanillaRNN()
        self.stage = -1
        self.epoch_slot: dict[int, int] = {}  # oracle: true epoch -> component
        self.register_buffer("frozen", torch.zeros(self.how.max_components, dtype=torch.bool))
        self.register_buffer("out_frozen", torch.zeros((), dtype=torch.bool))
        self.matrix: list[dict[str, Any]] = []
        for name in ("U", "V", "b"):
            getattr(self.how, name).register_hook(self._mask_grad)
        self.how.W_out.register_hook(lambda g: g * (~self.out_frozen).to(g.dtype))

    def _mask_grad(self, g: torch.Tensor) -> torch.Tensor:
        keep = (~self.frozen).to(g.dtype)
        return g * keep.view(-1, *([1] * (g.ndim - 1)))

    # -- context ------------------------------------------------------------------------------------------
    def _oracle_context(self, epochs: torch.Tensor) -> torch.Tensor:
        for e in epochs.unique().tolist():
            if e not in self.epoch_slot:
                if len(self.epoch_slot) >= self.how.max_components:
                    raise RuntimeError(f"WhatHowModule: more epochs than max_components={self.how.max_components}")
                self.epoch_slot[e] = len(self.epoch_slot)
        idx = epochs.clone().apply_(lambda e: self.epoch_slot[e])
        return torch.nn.functional.one_hot(idx, self.how.max_components).float()

    def context(self, batch: dict[str, Any], task: str, what: EpochHMM | None = None) -> torch.Tensor:
        if self.method == "oracle":
            return self._oracle_context(batch["epochs"])
        return (what or self.what).filter(batch["inputs"], batch["theta"], task).float()

    def outputs(self, batch: dict[str, Any], task: str, what: EpochHMM | None = None,
                return_states: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.method == "vanilla":
            from lowrank_lit.data.cognitive import TASKS

            onehot = torch.zeros(*batch["inputs"].shape[:2], len(TASKS))
            onehot[..., list(TASKS).index(task)] = 1
            return self.vanilla(torch.cat([batch["inputs"], onehot], -1), return_states=return_states)
        return self.how(batch["inputs"], self.context(batch, task, what), return_states=return_states)

    def _observe(self, what: EpochHMM, task: str, seed: int) -> None:
        from lowrank_lit.data.cognitive import make_trials

        tr = make_trials(task, self.hparams.what_trials, torch.Generator().manual_seed(seed), self._dm.noise)
        for i in range(self.hparams.what_trials):
            what.observe_trial(torch.cat([tr["inputs"][i], tr["targets"][i]], 1), float(tr["theta"][i]), task)
        if task not in what.trans:
            raise RuntimeError(f"WhatHowModule: after what_trials={self.hparams.what_trials} trials of {task!r} the what "
                               "system still waits for new epochs to open (each needs min_trials trials); raise what_trials")

    # -- stages -------------------------------------------------------------------------------------------
    @property
    def _dm(self) -> CognitiveStreamDataModule:
        return self.trainer.datamodule

    def _start_stage(self, stage: int) -> None:
        task = self._dm.tasks[stage]
        if self.method == "what_how":
            before = self.what.vocab_size
            self._observe(self.what, task, 7919 + stage)  # the same trials on every rank: identical vocabularies
            used = before
        else:
            used = len(self.epoch_slot)
        if self.hparams.freeze_reused and self.method != "vanilla":
            self.frozen[:used] = True
        self.out_frozen.fill_(stage > 0 and self.method != "vanilla")
        self.stage = stage
        self.trainer.strategy.setup_optimizers(self.trainer)  # fresh Adam state for the new stage

    def on_train_batch_start(self, batch: dict[str, Any], batch_idx: int) -> None:
        if int(batch["stage"]) != self.stage:
            self._start_stage(int(batch["stage"]))

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        task = self._dm.tasks[int(batch["stage"])]
        out, states = self.outputs(batch, task, return_states=True)
        loss = (batch["mask"] * (out - batch["targets"]) ** 2).mean()
        hold = hold_loss(states, batch["epochs"]) if self.hparams.hold_weight > 0 else None
        if hold is not None:
            self.log("train/hold_loss", hold)
            loss = loss + self.hparams.hold_weight * hold
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/stage", float(batch["stage"]))
        self.log("train/vocab", float(self.what.vocab_size if self.method == "what_how" else len(self.epoch_slot)))
        return loss

    def setup(self, stage: str) -> None:
        world = self.trainer.world_size
        if stage == "fit" and self._dm.steps_per_stage % world:
            raise ValueError(f"CognitiveStreamDataModule: steps_per_stage={self._dm.steps_per_stage} over {world} "
                             f"processes; allowed: a multiple of {world} (each process takes every {world}th batch "
                             "of the stream, and every stage must end on the same step in all of them)")

    def on_train_batch_end(self, outputs: Any, batch: dict[str, Any], batch_idx: int) -> None:
        # the stream's batches are dealt out to the processes in turn: each sees steps_per_stage / world of a stage
        if (batch_idx + 1) % (self._dm.steps_per_stage // self.trainer.world_size) == 0:
            self.evaluate_all(int(batch["stage"]))

    @torch.no_grad()
    def evaluate_all(self, stage: int) -> dict[str, float]:
        """Accuracy on every evaluation task after ``stage`` (a row of the forgetting matrix)."""
        import copy

        from lowrank_lit.data.cognitive import make_trials, response_accuracy

        row: dict[str, Any] = {"stage": stage, "trained": self._dm.tasks[stage],
                               "vocab": self.what.vocab_size if self.method == "what_how" else len(self.epoch_slot)}
        for j, task in enumerate(self._dm.eval_tasks):
            what = None
            if self.method == "what_how" and task not in self.what.trans:  # an unseen task: the what system
                what = copy.deepcopy(self.what)  # observes a few of its trials (no training of the how system)
                self._observe(what, task, 104729 + j)
            tr = make_trials(task, self.hparams.eval_trials, torch.Generator().manual_seed(31337 + j), self._dm.noise)
            slots = dict(self.epoch_slot)
            out, states = self.outputs(tr, task, what, return_states=True)
            acc = response_accuracy(out, tr["targets"], tr["epochs"])
            self.epoch_slot = slots  # evaluation never allocates components
            row[task] = acc
            self.log(f"forget/after_{stage}_{self._dm.tasks[stage]}/{task}", acc)
            for key, val in state_holding(states, tr["epochs"], tr["theta"]).items():
                self.log(f"state/after_{stage}_{self._dm.tasks[stage]}/{task}/{key}", val)
        self.matrix.append(row)
        return row

    def on_train_end(self) -> None:
        if not self.matrix or not may_write(self.trainer):
            return
        save_rows(self.trainer, self.matrix, "forgetting.csv")
        tasks = self._dm.eval_tasks
        # the forgetting matrix on stdout: one line per stage, `forget/after_<k>_<task>/<eval task> <accuracy>`
        print(f"accuracy on every task after every stage ({self.method}; zero-shot: tasks not trained yet):")
        for stage, r in enumerate(self.matrix):
            print("  " + "  ".join(f"forget/after_{stage}_{r['trained']}/{t} {r[t]:.3f}" for t in tasks))
        fig, ax = new_figure(figsize=(1.4 * len(tasks) + 1.5, 0.6 * len(self.matrix) + 1.2))
        m = [[r[t] for t in tasks] for r in self.matrix]
        ax.imshow(m, vmin=0, vmax=1, cmap="viridis")
        for i, r in enumerate(m):
            for j, v in enumerate(r):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
        ax.set_xticks(range(len(tasks)), tasks, fontsize=8)
        ax.set_yticks(range(len(self.matrix)), [f"after {r['trained']} (vocab {r['vocab']})" for r in self.matrix], fontsize=8)
        ax.set_title(f"accuracy, {self.method}", fontsize=9)
        log_image(self.trainer, "forgetting", save_figure(fig, artifact_path(self.trainer, "forgetting.png")))
        if self.method == "what_how":
            self._plot_epochs()

    @torch.no_grad()
    def _plot_epochs(self) -> None:
        """``inferred_epochs.png``: per trained task, one trial's filtered posterior (image) and the true epochs."""
        from lowrank_lit.data.cognitive import EPOCHS, make_trials

        tasks = [t for t in self._dm.eval_tasks if t in self.what.trans]
        fig, axes = new_figure(len(tasks), 1, figsize=(7, 1.3 * len(tasks)), squeeze=False)
        for ax, task in zip(axes[:, 0], tasks, strict=True):
            tr = make_trials(task, 1, torch.Generator().manual_seed(0), self._dm.noise)
            c = self.what.filter(tr["inputs"][0], float(tr["theta"][0]), task)[:, : self.what.vocab_size]  # (T, K)
            ax.imshow(c.T.numpy(), aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest")
            true = tr["epochs"][0]
            for e in true.unique().tolist():
                xs = (true == e).nonzero()[:, 0]
                ax.text(float(xs.float().mean()), -0.9, EPOCHS[e], ha="center", fontsize=7, color="tab:red")
            ax.set_ylabel(task, fontsize=7)
            ax.set_yticks(range(self.what.vocab_size))
        axes[-1, 0].set_xlabel("time step (grey: inferred epoch posterior; red: true epochs)")
        save_figure(fig, artifact_path(self.trainer, "inferred_epochs.png"))

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["what_how"] = {"what": self.what.__dict__, "stage": self.stage, "epoch_slot": self.epoch_slot, "matrix": self.matrix}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        st = checkpoint.get("what_how")
        if st:
            self.what.__dict__.update(st["what"])
            self.stage, self.epoch_slot, self.matrix = st["stage"], st["epoch_slot"], st["matrix"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.vanilla.parameters() if self.method == "vanilla" else self.how.parameters()
        return torch.optim.Adam(params, lr=self.hparams.lr)


def summary(roots: list[str], out: str | None = None) -> str:
    """Forgetting matrices (accuracy on every task after every stage) per method.

    Markdown: per method (and W_0 gain) and stage, the mean (over seeds) accuracy on every evaluation task and
    the vocabulary size; then per method the drop of the first task from its post-training accuracy to the end and the zero-shot
    accuracy of the never-trained tasks after the last stage (mean, min and max over seeds)."""
    import statistics as st

    by: dict[str, list[list[dict[str, str]]]] = {}
    metrics: dict[str, list[tuple[Any, dict[str, float]]]] = {}
    for run in read_runs(roots, "forgetting.csv"):
        init = run.config["model"]["init_args"]
        method = init.get("method", "what_how")
        if method != "vanilla":
            method += f" (W_0 gain {((init.get('how') or {}).get('init_args') or {}).get('w0_gain', 0.8):g})"
        if float(init.get("hold_weight") or 0) > 0:
            method += f", hold {float(init['hold_weight']):g}"
        by.setdefault(method, []).append(run.rows("forgetting.csv"))
        metrics.setdefault(method, []).append((run.config.get("seed_everything"), run.metrics))
    order = sorted(by, key=lambda m: (METHODS.index(m.split(" ")[0]) if m.split(" ")[0] in METHODS else len(METHODS), m))
    tasks = [k for k in next(iter(by.values()))[0][0] if k not in ("stage", "trained", "vocab")]
    rows = []
    for m in order:
        runs = by[m]
        for i, r in enumerate(runs[0]):
            at = [run[i] for run in runs if len(run) > i]
            rows.append([m, f"after {r['trained']}", len(at), "/".join(sorted({a["vocab"] for a in at})),
                         *(f"{st.fmean(float(a[t]) for a in at):.2f}" for t in tasks)])
    text = markdown_table(["method", "stage", "runs", "vocabulary", *tasks], rows)
    trained = [r["trained"] for r in next(iter(by.values()))[0]]
    unseen = [t for t in tasks if t not in trained]
    crit = []
    for m in order:
        runs = by[m]
        drop = [float(run[0][trained[0]]) - float(run[-1][trained[0]]) for run in runs]
        forget = [max(float(run[k][t]) - float(run[-1][t]) for k, t in enumerate(trained)) for run in runs]
        cells = [f"{st.fmean(drop):.2f}", f"{max(forget):.2f}"]
        for t in unseen:
            z = [float(run[-1][t]) for run in runs]
            cells.append(f"{st.fmean(z):.2f} ({min(z):.2f}-{max(z):.2f})")
        crit.append([m, len(runs), *cells])
    text += "\n\n" + markdown_table(["method", "runs", f"{trained[0]} drop", "largest forgetting of a trained task",
                                     *(f"{t} zero-shot" for t in unseen)], crit)
    # per seed: zero-shot accuracy of the unseen task(s) and the state-holding diagnostics after the last stage
    after = f"after_{len(trained) - 1}_{trained[-1]}"
    keys = ("hold_distance", "decode_delay", "decode_transfer")
    seed_rows = []
    for m in order:
        per = sorted(metrics.get(m, []), key=lambda sm: str(sm[0]))
        for t in unseen:
            z = [v.get(f"forget/{after}/{t}", math.nan) for _, v in per]
            diag = [[v.get(f"state/{after}/{t}/{k}", math.nan) for _, v in per] for k in keys]
            spread = mean_std([x for x in z if not math.isnan(x)], ".2f")  # a run without the metric: left out
            seed_rows.append([m, t, " / ".join(f"{x:.2f}" for x in z), spread,
                              *(f"{st.fmean(d):.2f}" if d and not any(math.isnan(x) for x in d) else "-" for d in diag)])
    if seed_rows:
        text += "\n\nPer seed, after the last stage (diagnostics: mean over seeds):\n\n" + markdown_table(
            ["method", "task", "zero-shot per seed", "mean ± std", "hold distance", "decode at delay end",
             "stimulus decoder at delay end"], seed_rows)
    if out:

        fig, axes = new_figure(1, len(order), figsize=(3.4 * len(order), 2.6), squeeze=False)
        for ax, m in zip(axes[0], order, strict=True):
            runs = by[m]
            mat = [[st.fmean(float(run[i][t]) for run in runs) for t in tasks] for i in range(len(runs[0]))]
            ax.imshow(mat, vmin=0, vmax=1, cmap="viridis")
            for i, row in enumerate(mat):
                for j, v in enumerate(row):
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=7)
            ax.set_xticks(range(len(tasks)), tasks, fontsize=6, rotation=20)
            ax.set_yticks(range(len(mat)), [f"after {t}" for t in trained], fontsize=6)
            ax.set_title(m, fontsize=8)
        save_figure(fig, out)
    return text


def bench(ctx: Any) -> list[Any]:
    """Training-step time of the what/how system against the vanilla RNN (``lowrank bench lowrank_rnn_cl``)."""
    from lowrank_lit.bench import ConfigBench

    return [ConfigBench("lowrank_rnn_cl", "what/how training step (online HMM + composed low-rank RNN)",
                        "vanilla RNN step", "configs/lowrank_rnn_cl/what_how.yaml", "configs/lowrank_rnn_cl/vanilla.yaml",
                        "reported")]
