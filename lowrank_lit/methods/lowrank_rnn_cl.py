"""What/how continual learning with context-composed low-rank RNNs.

Shan, Minni, Duncker, "Separating the what and how of compositional computation to enable reuse and continual
learning" (NeurIPS 2025, arXiv 2510.20709). No public code. The "what" system (:class:`EpochHMM`) learns a
vocabulary of task epochs online, one trial at a time, and infers the current epoch from the inputs; the "how"
system (:class:`ComposedLowRankRNN`) runs a recurrence composed from per-epoch low-rank components weighted by
that context.

What (forms inferred, our spec's choices):

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

import torch
from torch import nn

__all__ = ["ComposedLowRankRNN", "EpochHMM", "check_context"]


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
        seed: seed of the fixed W_0, W_in and the initial parameters. Default: 0.
    """

    def __init__(self, n_in: int = 3, n_out: int = 3, n_units: int = 64, rank: int = 2, max_components: int = 16,
                 alpha: float = 0.2, gamma: float = 1.0, w0_gain: float = 0.8, init_std: float = 0.1, seed: int = 0) -> None:
        super().__init__()
        if not 1 <= rank <= n_units:
            raise ValueError(f"ComposedLowRankRNN: rank={rank!r}; allowed: 1..n_units={n_units}")
        if not 0 < alpha <= 1:
            raise ValueError(f"ComposedLowRankRNN: alpha={alpha!r}; allowed: (0, 1]")
        if max_components < 1:
            raise ValueError(f"ComposedLowRankRNN: max_components={max_components!r}; allowed: >= 1")
        g = torch.Generator().manual_seed(seed)
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

    def forward(self, inputs: torch.Tensor, context: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
        """``inputs (B, T, n_in)``, ``context (B, T, K)`` -> outputs ``(B, T, n_out)``."""
        B, T, n_in = inputs.shape
        if n_in != self.n_in:
            raise ValueError(f"ComposedLowRankRNN: inputs with {n_in} features; allowed: n_in={self.n_in}")
        if not bool(torch.isfinite(inputs).all()):
            raise ValueError("ComposedLowRankRNN: inputs contain NaN or inf")
        check_context(context, B, T, self.max_components)
        h = torch.zeros(B, self.n_units, dtype=inputs.dtype) if h0 is None else h0
        drive = inputs @ self.W_in.T + context @ self.b  # (B, T, N)
        outs = []
        for t in range(T):
            r = torch.tanh(h)  # (B, N)
            proj = torch.einsum("bn,knr->bkr", r, self.V)  # (B, K, r)
            low = torch.einsum("bk,bkr,knr->bn", context[:, t], proj, self.U)  # (B, N)
            h = (1 - self.alpha) * h + self.alpha * (r @ self.W0.T + self.gamma * low + drive[:, t])
            outs.append(torch.tanh(h) @ self.W_out.T)
        return torch.stack(outs, 1)


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
        c = self.init.get(task, torch.zeros(self.K_max, dtype=torch.float64))[: self.K] + self.eps
        return c / c.sum()

    # -- inference -----------------------------------------------------------------------------------------
    def filter(self, inputs: torch.Tensor, x: float, task: str) -> torch.Tensor:
        """``c_t = p(z_t | s_1..t, task)`` ``(T, max_components)`` (zeros beyond the vocabulary) from the inputs
        ``(T, n_inputs)``; the target dimensions are marginalised (not used)."""
        if inputs.shape[-1] != self.n_inputs:
            raise ValueError(f"EpochHMM.filter: inputs with {inputs.shape[-1]} features; allowed: n_inputs={self.n_inputs}")
        lam = self.transition_matrix(task)
        q = torch.cat([inputs.double(), torch.zeros(inputs.shape[0], self.D - self.n_inputs, dtype=torch.float64)], 1)
        ll = self.loglik(q, x, slice(0, self.n_inputs))  # (T, K)
        out = torch.zeros(inputs.shape[0], self.K_max, dtype=torch.float64)
        alpha = self._initial(task)
        for t in range(ll.shape[0]):
            prior = alpha if t == 0 else alpha @ lam
            post = prior * torch.exp(ll[t] - ll[t].max())
            alpha = post / post.sum()
            out[t, : self.K] = alpha
        return out

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
        path = self._viterbi(ll, lam, torch.full((self.K,), 1.0 / self.K, dtype=torch.float64))
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
            k = self._new_epoch(self.pending.pop(task))
            self.pending.pop(task, None)
            del k
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


