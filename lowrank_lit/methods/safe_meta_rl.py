"""Safe meta-RL with a one-step closed-form safe adaptation and a Hessian-free meta-gradient.

"Efficient Safe Meta-Reinforcement Learning: Provable Near-Optimality and Anytime Safety" (NeurIPS 2025). No
public code; the paper's equations beyond the abstract were not available, so the forms below are a
reconstruction (inferred where marked).

Adaptation step from an anchor policy ``pi0`` on a task (inferred form)::

    max_pi  E_{s~d0} E_{a~pi}[A_r] - eta E_s KL(pi || pi0)
    s.t.    E_{s~d0} E_{a~pi}[A_c] + kappa E_s KL(pi || pi0) <= b,   b = (1 - gamma) (d - J_c(pi0))

with ``d0`` the anchor's normalised discounted occupancy. Its solution is the exponential tilt
``pi_nu = pi0 exp(z_nu) / Z_nu``, ``z_nu = (A_r - nu A_c) / (eta + nu kappa)``, with the scalar dual
``nu* = argmin_{nu >= 0} g(nu)``, ``g(nu) = (eta + nu kappa) E_{d0}[log Z_nu] + nu b`` (convex). By the envelope
theorem ``g'(nu) = b - C(nu)`` where ``C(nu)`` is the constraint's left side at ``pi_nu``, which falls with nu;
:func:`solve_dual` returns 0 when ``C(0) <= b`` and otherwise solves ``C(nu) = b`` by bracketing and Brent's method
(complementary slackness).
A feasible anchor (``b >= 0``) always has a solution (``C -> -kappa E log E_pi0 exp(-A_c / kappa) <= 0``); an
infeasible one raises :class:`InfeasibleAnchorError`.

Meta-gradient (inferred, first order): hold ``A_r, A_c, nu*`` (so z) fixed; ``pi1 = softmax(phi + z)`` for
tabular logits, so ``grad_phi J_r(pi1) = d1(s) / (1 - gamma) pi1(a|s) A_r^{pi1}(s, a)`` exactly
(:func:`tabular_policy_gradient`), no Hessian-vector product. Meta-constraint: primal-dual on
``max_tau J_c,tau(pi_phi) - d`` (inferred). The second-order baseline differentiates a policy-gradient
adaptation step with a fixed multiplier through autograd (MAML).

Neural policies (inferred): the adapted policy is non-parametric, self-normalised weights ``exp(z_i)`` on actions
sampled from ``pi_phi`` (the same dual on the sample distribution: :func:`sample_weights`), projected back to
the policy class by weighted maximum likelihood (:func:`weighted_ml_projection`).
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.callbacks.rng import gather_per_rank
from lowrank_lit.data.loader import ResumableDataLoader
from lowrank_lit.envs.continuous import ContinuousFamily
from lowrank_lit.envs.gridnav import SafeGridNav
from lowrank_lit.registry import register_method
from lowrank_lit.report import (
    artifact_path,
    class_label,
    log_image,
    markdown_table,
    may_write,
    new_figure,
    read_runs,
    save_figure,
    save_rows,
)
from lowrank_lit.seeding import run_seed
from lowrank_lit.sharding import Shardable

__all__ = ["InfeasibleAnchorError", "tilt", "constraint_value", "dual_objective", "solve_dual", "safe_adapt",
           "sample_weights", "tabular_policy_gradient", "hessian_free_meta_grad", "second_order_meta_grad",
           "pg_lagrange_step", "SafeMetaRLModule", "NeuralSafeMetaRLModule", "GaussianPolicy", "gae", "SafetyMonitor", "TaskDataModule", "weighted_ml_projection"]

PAPER = "Efficient Safe Meta-Reinforcement Learning: Provable Near-Optimality and Anytime Safety"
ADAPT = ("safe", "unconstrained", "pg_lagrange")
META_GRAD = ("hessian_free", "second_order")


class InfeasibleAnchorError(ValueError):
    """The anchor policy already violates the cost limit (``b < 0``): no safe step exists from it."""


def _check(log_pi0: torch.Tensor, adv_r: torch.Tensor, adv_c: torch.Tensor, occupancy: torch.Tensor, eta: float,
           kappa: float) -> None:
    if eta <= 0:
        raise ValueError(f"safe_adapt: eta={eta!r}; allowed: > 0")
    if kappa < 0:
        raise ValueError(f"safe_adapt: kappa={kappa!r}; allowed: >= 0")
    if adv_r.shape != log_pi0.shape or adv_c.shape != log_pi0.shape:
        raise ValueError(f"safe_adapt: advantages of shapes {tuple(adv_r.shape)}, {tuple(adv_c.shape)}; allowed: the "
                         f"policy's shape {tuple(log_pi0.shape)} (S, A)")
    if occupancy.shape != log_pi0.shape[:1]:
        raise ValueError(f"safe_adapt: occupancy of shape {tuple(occupancy.shape)}; allowed: ({log_pi0.shape[0]},)")
    for name, t in (("adv_r", adv_r), ("adv_c", adv_c), ("occupancy", occupancy)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"safe_adapt: {name} contains NaN or inf")


def _log_policy(policy: torch.Tensor) -> torch.Tensor:
    if policy.ndim != 2:
        raise ValueError(f"safe_adapt: policy of shape {tuple(policy.shape)}; allowed: (S, A) probabilities")
    if bool((policy < 0).any()) or not torch.allclose(policy.sum(1), torch.ones_like(policy[:, 0]), atol=1e-6):
        raise ValueError("safe_adapt: policy rows must be non-negative and sum to 1")
    return policy.clamp_min(1e-300).log()


def tilt(log_pi0: torch.Tensor, adv_r: torch.Tensor, adv_c: torch.Tensor, nu: float, eta: float,
         kappa: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(log pi_nu (S, A), z_nu (S, A), log Z_nu (S,))``; max-subtracted (log-sum-exp), safe for |z| ~ 1e3.

    Raises:
        ValueError: a row of ``log_pi0`` is not a log-distribution (its probabilities do not sum to 1 within 1e-4).
    """
    sums = log_pi0.exp().sum(1)
    bad = (sums - 1).abs() > 1e-4
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise ValueError(f"tilt: log_pi0 row {row} sums to {float(sums[row]):.4g} as probabilities; allowed: rows of "
                         "log-probabilities (exp(log_pi0) sums to 1 over actions)")
    if math.isinf(nu):  # the limit nu -> inf: z = -A_c / kappa (or the argmin of A_c when kappa = 0)
        z = -adv_c / kappa if kappa > 0 else torch.where(adv_c == adv_c.min(1, keepdim=True).values, 0.0, -torch.inf)
    else:
        z = (adv_r - nu * adv_c) / (eta + nu * kappa)
    logits = log_pi0 + z
    log_z = torch.logsumexp(logits, dim=1)
    return logits - log_z[:, None], z, log_z


def constraint_value(log_pi: torch.Tensor, log_pi0: torch.Tensor, adv_c: torch.Tensor, occupancy: torch.Tensor,
                     kappa: float) -> torch.Tensor:
    """``C = E_{s~d0}[E_{a~pi} A_c + kappa KL(pi || pi0)]``."""
    pi = log_pi.exp()
    kl = (pi * (log_pi - log_pi0).nan_to_num(0.0, 0.0, 0.0)).sum(1)
    return occupancy @ ((pi * adv_c).sum(1) + kappa * kl)


def dual_objective(nu: float, log_pi0: torch.Tensor, adv_r: torch.Tensor, adv_c: torch.Tensor, occupancy: torch.Tensor,
                   budget: float, eta: float, kappa: float) -> float:
    """``g(nu) = (eta + nu kappa) E_{d0}[log Z_nu] + nu b``."""
    _, _, log_z = tilt(log_pi0, adv_r, adv_c, nu, eta, kappa)
    return float((eta + nu * kappa) * (occupancy @ log_z) + nu * budget)


def solve_dual(log_pi0: torch.Tensor, adv_r: torch.Tensor, adv_c: torch.Tensor, occupancy: torch.Tensor, budget: float,
               eta: float, kappa: float, tol: float = 1e-10, nu_max: float = 1e12) -> float:
    """``nu* >= 0`` (module docstring): 0 when the unconstrained tilt is feasible, else the root of ``C(nu) = b``
    by bracketing (doubling) and Brent's method (scipy) to relative ``tol``, on its feasible side.

    Raises:
        InfeasibleAnchorError: ``budget < 0`` (the anchor violates the limit), or no nu up to ``nu_max`` is feasible.
    """
    _check(log_pi0, adv_r, adv_c, occupancy, eta, kappa)
    if budget < -1e-12:
        raise InfeasibleAnchorError(f"solve_dual: budget b={budget:.4g} < 0: the anchor policy violates the cost limit")

    def excess(nu: float) -> float:
        log_pi, _, _ = tilt(log_pi0, adv_r, adv_c, nu, eta, kappa)
        return float(constraint_value(log_pi, log_pi0, adv_c, occupancy, kappa)) - budget

    if excess(0.0) <= 0:
        return 0.0
    lo, hi = 0.0, 1.0
    while excess(hi) > 0:
        lo, hi = hi, 2 * hi
        if hi > nu_max:
            raise InfeasibleAnchorError(f"solve_dual: no nu <= {nu_max:g} satisfies the constraint (b={budget:.4g})")
    from scipy.optimize import brentq

    nu = brentq(excess, lo, hi, xtol=tol * (1 + hi), rtol=1e-15)
    while excess(nu) > 0:  # the feasible side of the root
        nu += tol * (1 + hi)
    return float(nu)


def safe_adapt(policy: torch.Tensor, adv_r: torch.Tensor, adv_c: torch.Tensor, occupancy: torch.Tensor, budget: float,
               eta: float, kappa: float) -> tuple[torch.Tensor, float]:
    """One safe adaptation step: ``(pi_nu* (S, A), nu*)`` from the anchor ``policy`` ``(S, A)``, its advantages
    ``(S, A)``, normalised occupancy ``(S,)`` and the budget ``b = (1 - gamma)(d - J_c(anchor))``."""
    log_pi0 = _log_policy(policy)
    nu = solve_dual(log_pi0, adv_r, adv_c, occupancy, budget, eta, kappa)
    return tilt(log_pi0, adv_r, adv_c, nu, eta, kappa)[0].exp(), nu


def sample_weights(adv_r: torch.Tensor, adv_c: torch.Tensor, budget: float, eta: float, kappa: float,
                   constrained: bool = True, base: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """The non-parametric adapted policy on ``N`` sampled (state, action) pairs: self-normalised weights ``(N,)``
    (summing to 1) and nu*: the same dual with the sample distribution as the anchor (one "state"; anchor
    weights ``base`` ``(N,)``, e.g. the discount ``gamma^t`` of each sample's step, uniform when None; inferred)."""
    n = adv_r.shape[0]
    if base is None:
        log_pi0 = torch.full((1, n), -math.log(n), dtype=adv_r.dtype)
    else:
        log_pi0 = (base / base.sum()).clamp_min(1e-300).log()[None].to(adv_r.dtype)
    occ = torch.ones(1, dtype=adv_r.dtype)
    nu = solve_dual(log_pi0, adv_r[None], adv_c[None], occ, budget, eta, kappa) if constrained else 0.0
    log_pi, _, _ = tilt(log_pi0, adv_r[None], adv_c[None], nu, eta, kappa)
    return log_pi[0].exp(), nu


# -- tabular meta-gradients -------------------------------------------------------------------------------

def tabular_policy_gradient(env: Any, pi: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``dJ/dphi (S, A)`` for softmax logits phi at ``pi = softmax(phi)``: ``d(s) / (1 - gamma) pi(a|s) A(s, a)``."""
    from lowrank_lit.envs.gridnav import evaluate, state_occupancy

    ev = evaluate(env.P, pi, r, env.mu0, env.gamma)
    return _softmax_gradient(state_occupancy(env.P, pi, env.mu0, env.gamma), pi, ev.A, env.gamma)


def _softmax_gradient(occ: torch.Tensor, pi: torch.Tensor, adv: torch.Tensor, gamma: float) -> torch.Tensor:
    """``d(s) / (1 - gamma) pi(a|s) A(s, a)`` ``(S, A)`` from the occupancy ``(S,)``, policy and advantages."""
    return occ[:, None] / (1 - gamma) * pi * adv


def adapt_tabular(env: Any, pi: torch.Tensor, task: int, eta: float, kappa: float, mode: str = "safe",
                  lam: float = 1.0, alpha: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One adaptation step on ``task``: ``(pi1, z, nu)`` (``z``: the fixed logit shift, ``pi1 = softmax(log pi + z)``).

    ``safe``: the closed-form safe step; ``unconstrained``: the same tilt with nu = 0; ``pg_lagrange``: a
    policy-gradient step ``alpha grad(J_r - lam J_c)`` on the logits (fixed multiplier).
    """
    if mode not in ADAPT:
        raise ValueError(f"adapt_tabular: mode={mode!r}; allowed: {', '.join(ADAPT)}")
    if mode == "pg_lagrange":
        z = alpha * (tabular_policy_gradient(env, pi, env.reward(task)) - lam * tabular_policy_gradient(env, pi, env.c))
        return torch.softmax(pi.clamp_min(1e-300).log() + z, 1), z, lam
    er, ec, occ = env.evaluate(pi, task)
    budget = (1 - env.gamma) * (env.limit - float(ec.J))
    log_pi0 = _log_policy(pi)
    nu = solve_dual(log_pi0, er.A, ec.A, occ, budget, eta, kappa) if mode == "safe" else 0.0
    log_pi1, z, _ = tilt(log_pi0, er.A, ec.A, nu, eta, kappa)
    return log_pi1.exp(), z, nu


def hessian_free_meta_grad(env: Any, phi: torch.Tensor, tasks: list[int], eta: float, kappa: float,
                           mode: str = "safe") -> tuple[torch.Tensor, dict[str, float]]:
    """Mean over ``tasks`` of ``grad_phi J_r(softmax(phi + z))`` with z held fixed (exact, no Hessian), and the
    adapted returns. An infeasible anchor contributes the gradient at the anchor (no step; counted).

    The anchor is evaluated once for all tasks (its cost value and occupancy do not depend on the task; the tasks'
    rewards share one factorisation), and the adapted policy only on the reward (its cost is not needed)."""
    pi = torch.softmax(phi, 1)
    grad = torch.zeros_like(phi)
    stats = {"adapted_J_r": 0.0, "infeasible": 0.0, "nu": 0.0}
    if mode != "pg_lagrange" and hasattr(env, "P"):  # the tabular family: one evaluation of the anchor
        from lowrank_lit.envs.gridnav import evaluate_many

        log_pi0 = _log_policy(pi)
        (ec, *ers), occ0 = evaluate_many(env.P, pi, [env.c, *(env.reward(t) for t in tasks)], env.mu0, env.gamma)
        budget = (1 - env.gamma) * (env.limit - float(ec.J))
        for t, er in zip(tasks, ers, strict=True):
            try:
                nu = solve_dual(log_pi0, er.A, ec.A, occ0, budget, eta, kappa) if mode == "safe" else 0.0
                pi1 = tilt(log_pi0, er.A, ec.A, nu, eta, kappa)[0].exp()
            except InfeasibleAnchorError:
                pi1, nu = pi, float("nan")
                stats["infeasible"] += 1
            (er1,), occ1 = evaluate_many(env.P, pi1, [env.reward(t)], env.mu0, env.gamma)
            grad += _softmax_gradient(occ1, pi1, er1.A, env.gamma)
            stats["adapted_J_r"] += float(er1.J) / len(tasks)
            stats["nu"] += (0.0 if math.isnan(nu) else nu) / len(tasks)
        return grad / len(tasks), stats
    for t in tasks:
        try:
            pi1, _, nu = adapt_tabular(env, pi, t, eta, kappa, mode)
        except InfeasibleAnchorError:
            pi1, nu = pi, float("nan")
            stats["infeasible"] += 1
        er, _, occ = env.evaluate(pi1, t)
        grad += _softmax_gradient(occ, pi1, er.A, env.gamma)  # = tabular_policy_gradient(env, pi1, r), reusing er
        stats["adapted_J_r"] += float(er.J) / len(tasks)
        stats["nu"] += (0.0 if math.isnan(nu) else nu) / len(tasks)
    return grad / len(tasks), stats


def pg_lagrange_step(env: Any, phi: torch.Tensor, task: int, lam: float, alpha: float,
                     create_graph: bool = False) -> torch.Tensor:
    """MAML inner step on the logits: ``phi + alpha grad_phi (J_r - lam J_c)`` through autograd (differentiable
    when ``create_graph``)."""
    from lowrank_lit.envs.gridnav import evaluate

    if not phi.requires_grad:
        phi = phi.requires_grad_(True)
    pi = torch.softmax(phi, 1)
    lag = evaluate(env.P, pi, env.reward(task), env.mu0, env.gamma).J - lam * evaluate(env.P, pi, env.c, env.mu0, env.gamma).J
    (g,) = torch.autograd.grad(lag, phi, create_graph=create_graph)
    return phi + alpha * g


def second_order_meta_grad(env: Any, phi: torch.Tensor, tasks: list[int], lam: float, alpha: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The MAML baseline: ``grad_phi`` of the mean ``J_r(softmax(phi'))`` with ``phi'`` the inner step, differentiated
    through the inner gradient (Hessian-vector products by autograd)."""
    from lowrank_lit.envs.gridnav import evaluate

    phi = phi.detach().requires_grad_(True)
    total = 0.0
    for t in tasks:
        phi1 = pg_lagrange_step(env, phi, t, lam, alpha, create_graph=True)
        total = total + evaluate(env.P, torch.softmax(phi1, 1), env.reward(t), env.mu0, env.gamma).J / len(tasks)
    (g,) = torch.autograd.grad(total, phi)
    return g, {"adapted_J_r": float(total.detach()), "infeasible": 0.0, "nu": lam}


def weighted_ml_projection(log_prob_fn: Any, params: list[torch.Tensor], states: torch.Tensor, actions: torch.Tensor,
                           weights: torch.Tensor, steps: int = 50, lr: float = 1e-2) -> float:
    """Fit a parametric policy to the weighted samples: maximise ``sum_i w_i log pi(a_i | s_i)`` by Adam on
    ``params`` (in place); returns the final weighted negative log-likelihood."""
    opt = torch.optim.Adam(params, lr=lr)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        loss = -(weights * log_prob_fn(states, actions)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss)


# -- Lightning ----------------------------------------------------------------------------------------------

class _TaskBatches(torch.utils.data.Dataset):
    def __init__(self, tasks: list[int], per_batch: int, n_batches: int, seed: int, rank: int = 0, shuffle: bool = True) -> None:
        self.tasks, self.per_batch, self.n_batches, self.seed, self.rank, self.shuffle = tasks, per_batch, n_batches, seed, rank, shuffle
        self.epoch = 0

    def __len__(self) -> int:
        return self.n_batches

    def __getitem__(self, i: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.tensor(self.tasks)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.rank * 7919 + self.epoch * 101 + i)
        idx = torch.randperm(len(self.tasks), generator=g)[: self.per_batch]
        return torch.tensor(self.tasks)[idx]


class TaskDataModule(pl.LightningDataModule):
    """Batches of task indices: training batches draw ``tasks_per_batch`` of ``train_tasks`` (seeded per rank,
    epoch and step: ranks get separate streams), validation and test give all ``test_tasks`` at once.

    Args:
        train_tasks: meta-training task indices.
        test_tasks: held-out task indices (never trained on).
        tasks_per_batch: tasks per meta-step (per rank). Default: 3.
        steps_per_epoch: meta-steps per epoch. Default: 50.
        seed: None: the run seed. Default: None.
    """

    def __init__(self, train_tasks: list[int], test_tasks: list[int], tasks_per_batch: int = 3, steps_per_epoch: int = 50,
                 seed: int | None = None) -> None:
        super().__init__()
        overlap = sorted(set(train_tasks) & set(test_tasks))
        if overlap:
            raise ValueError(f"TaskDataModule: tasks {overlap} are in both train_tasks and test_tasks")
        if not train_tasks or not test_tasks:
            raise ValueError("TaskDataModule: train_tasks and test_tasks must be non-empty")
        if not 1 <= tasks_per_batch <= len(train_tasks):
            raise ValueError(f"TaskDataModule: tasks_per_batch={tasks_per_batch!r}; allowed: 1..{len(train_tasks)}")
        self.train_tasks, self.test_tasks = list(train_tasks), list(test_tasks)
        self.tasks_per_batch, self.steps_per_epoch, self.seed = tasks_per_batch, steps_per_epoch, seed

    def _loader(self, ds: Any) -> Any:
        return ResumableDataLoader(ds, batch_size=None, shuffle=False)  # an interrupted run skips the meta-steps it took

    def train_dataloader(self) -> Any:
        rank = self.trainer.global_rank if self.trainer is not None else 0
        return self._loader(_TaskBatches(self.train_tasks, self.tasks_per_batch, self.steps_per_epoch, run_seed(self.seed), rank))

    def val_dataloader(self) -> Any:
        return self._loader(_TaskBatches(self.test_tasks, len(self.test_tasks), 1, 0, shuffle=False))

    def test_dataloader(self) -> Any:
        return self.val_dataloader()


class _MetaTestMixin:
    """Meta-test shared by the tabular and neural modules: ``hparams.adapt_steps`` successive adaptation steps from
    the meta-policy on each held-out task, one row per (task, step) with J_r, J_c, nu and violation (step 0 = the
    meta-policy); stops on a task whose anchor is already infeasible. Subclasses give ``_measure(policy, task) ->
    (J_r, J_c, data)``, ``_step(policy, task, data) -> (policy, nu)``, ``policy`` and ``_violation_tol``."""

    _violation_tol = 0.0

    def meta_test(self, tasks: list[int]) -> list[dict[str, Any]]:
        rows = []
        steps = self.hparams.adapt_steps
        for t in tasks:
            policy = self.policy
            for k in range(steps + 1):
                jr, jc, data = self._measure(policy, t)
                rows.append({"task": t, "step": k, "J_r": jr, "J_c": jc,
                             "violation": int(jc > self.env.limit + self._violation_tol), "nu": float("nan")})
                if k == steps:
                    break
                try:
                    policy, rows[-1]["nu"] = self._step(policy, t, data)
                except InfeasibleAnchorError:  # the anchor violates the limit: no safe step from it
                    break
        return rows

    def _eval(self, batch: torch.Tensor, stage: str) -> None:
        rows = self.meta_test([int(t) for t in batch])
        for r in rows:
            r["stage"] = stage
        self.adapt_rows = rows
        finals = [max((r for r in rows if r["task"] == t), key=lambda r: r["step"])["J_r"] for t in {r["task"] for r in rows}]
        self.log(f"{stage}/stopped", float(len(batch) * (self.hparams.adapt_steps + 1) - len(rows)))
        self.log(f"{stage}/violations", float(sum(r["violation"] for r in rows if r["step"] > 0)))
        self.log(f"{stage}/J_c_max", max(r["J_c"] for r in rows))
        self.log(f"{stage}/J_r_final", sum(finals) / max(1, len(finals)))
        self.log(f"{stage}/J_r_meta", sum(r["J_r"] for r in rows if r["step"] == 0) / len(batch))

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._eval(batch, "val")

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self._eval(batch, "test")


@register_method("safe_meta_rl", kind="LightningModule", paper=PAPER, summary="summary", bench="bench")
class SafeMetaRLModule(Shardable, _MetaTestMixin, pl.LightningModule):
    """Safe meta-training of tabular softmax logits on a :class:`lowrank_lit.envs.SafeGridNav` family, and
    meta-testing by ``adapt_steps`` successive adaptation steps on each held-out task (manual optimisation).

    Per meta-step: the mean over the batch's tasks of ``grad J_r(pi1)`` (``meta_gradient``: ``hessian_free``, the
    exact first-order gradient with z fixed, or ``second_order``, MAML through a policy-gradient step), minus
    ``lambda`` times the gradient of the worst training-task cost of the meta-policy; ``lambda`` follows
    projected dual ascent on ``max_tau J_c(pi_phi) - d`` (the meta-constraint). Gradients are all-reduced over
    DDP ranks (each rank draws its own tasks).

    Logged: ``train/adapted_J_r``, ``train/meta_J_c``, ``train/lambda``, ``train/infeasible``, ``train/step_s``;
    at validation / test: ``<stage>/J_r_final`` (mean over the held-out tasks of J_r after their last step),
    ``<stage>/violations`` (adaptation steps over all held-out tasks whose J_c exceeds d), ``<stage>/J_c_max``,
    ``<stage>/stopped`` (steps not taken because an anchor was already infeasible); :class:`SafetyMonitor` adds the per-step curves and plot.

    Args:
        env: the tabular environment family.
        eta: KL weight of the objective (> 0). Default: 0.1.
        kappa: KL weight of the cost constraint (>= 0). Default: 0.1.
        meta_lr: Adam learning rate on the logits. Default: 0.1.
        adapt: adaptation step at meta-test (and in meta-training for ``hessian_free``): ``safe``, ``unconstrained``
            (nu = 0) or ``pg_lagrange`` (policy-gradient step with the fixed multiplier ``pg_lambda``). Default: safe.
        meta_gradient: ``hessian_free`` or ``second_order``. Default: hessian_free.
        adapt_steps: successive adaptation steps at meta-test. Default: 5.
        dual_lr: step size of the meta-constraint multiplier. Default: 1.0.
        pg_lambda: fixed Lagrange multiplier of the ``pg_lagrange`` step. Default: 1.0.
        pg_alpha: step size of the ``pg_lagrange`` step on the logits. Default: 1.0.
    """

    #: the meta-gradient is computed by hand and written to ``phi.grad``; under FSDP2 the optimizer steps the sharded
    #: parameter, whose gradient comes from backward only, so the update would be silently lost
    sharding_refusal: ClassVar[str | None] = ("it writes its hand-computed meta-gradient to the policy's .grad, which "
                                              "FSDP2 does not reduce into the shards; use ddp")

    def __init__(self, env: SafeGridNav, eta: float = 0.1, kappa: float = 0.1, meta_lr: LearningRate = 0.1, adapt: str = "safe",
                 meta_gradient: str = "hessian_free", adapt_steps: int = 5, dual_lr: LearningRate = 1.0, pg_lambda: float = 1.0,
                 pg_alpha: float = 1.0) -> None:
        super().__init__()
        if adapt not in ADAPT:
            raise ValueError(f"SafeMetaRLModule: adapt={adapt!r}; allowed: {', '.join(ADAPT)}")
        if meta_gradient not in META_GRAD:
            raise ValueError(f"SafeMetaRLModule: meta_gradient={meta_gradient!r}; allowed: {', '.join(META_GRAD)}")
        if eta <= 0:
            raise ValueError(f"SafeMetaRLModule: eta={eta!r}; allowed: > 0")
        if kappa < 0:
            raise ValueError(f"SafeMetaRLModule: kappa={kappa!r}; allowed: >= 0")
        if adapt_steps < 1:
            raise ValueError(f"SafeMetaRLModule: adapt_steps={adapt_steps!r}; allowed: >= 1")
        if not hasattr(env, "P"):
            raise ValueError(f"SafeMetaRLModule: env {type(env).__name__} is not tabular (needs P, c, mu0, gamma, reward)")
        self.save_hyperparameters(ignore=["env"], logger=False)
        self.automatic_optimization = False
        self.env = env
        self.eta, self.kappa, self.adapt, self.meta_gradient = eta, kappa, adapt, meta_gradient
        self.dual_lr, self.pg_lambda, self.pg_alpha = dual_lr, pg_lambda, pg_alpha
        self.phi = torch.nn.Parameter(torch.zeros(env.S, env.A, dtype=env.dtype))  # (S, A) logits: uniform start
        self.register_buffer("lam", torch.zeros((), dtype=env.dtype))
        self.adapt_rows: list[dict[str, Any]] = []

    @property
    def policy(self) -> torch.Tensor:
        """The meta-policy ``softmax(phi)`` ``(S, A)``."""
        return torch.softmax(self.phi.detach(), 1)

    def adapt_step(self, pi: torch.Tensor, task: int) -> tuple[torch.Tensor, float]:
        pi1, _, nu = adapt_tabular(self.env, pi, task, self.eta, self.kappa, self.adapt, self.pg_lambda, self.pg_alpha)
        return pi1, nu

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        t0 = time.perf_counter()
        tasks = [int(t) for t in batch]
        phi = self.phi.detach()
        if self.meta_gradient == "hessian_free":
            g_r, stats = hessian_free_meta_grad(self.env, phi, tasks, self.eta, self.kappa, self.adapt)
        else:
            g_r, stats = second_order_meta_grad(self.env, phi, tasks, self.pg_lambda, self.pg_alpha)
        pi = torch.softmax(phi, 1)
        costs = [float(self.env.evaluate(pi, t)[1].J) for t in tasks]
        worst = max(range(len(tasks)), key=lambda i: costs[i])
        g_c = tabular_policy_gradient(self.env, pi, self.env.c)  # the cost gradient (task-independent cost)
        grad = -(g_r - self.lam * g_c)  # descent direction of the negated Lagrangian
        if self.trainer.world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(grad)
            grad /= self.trainer.world_size
        opt = self.optimizers()
        opt.zero_grad()
        self.phi.grad = grad
        opt.step()
        self.lam.copy_((self.lam + self.dual_lr * (costs[worst] - self.env.limit)).clamp_min(0))
        self.log_dict({"train/adapted_J_r": stats["adapted_J_r"], "train/meta_J_c": costs[worst], "train/lambda": float(self.lam),
                       "train/infeasible": stats["infeasible"], "train/nu": stats["nu"],
                       "train/step_s": time.perf_counter() - t0}, prog_bar=False)

    _violation_tol = 1e-9  # exact evaluation: only round-off is forgiven

    def _measure(self, pi: torch.Tensor, task: int) -> tuple[float, float, None]:
        er, ec, _ = self.env.evaluate(pi, task)
        return float(er.J), float(ec.J), None

    def _step(self, pi: torch.Tensor, task: int, data: None) -> tuple[torch.Tensor, float]:
        return self.adapt_step(pi, task)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam([self.phi], lr=self.hparams.meta_lr)


class SafetyMonitor(Callback):
    """Anytime-safety monitor: after each validation / test, logs the mean J_r and J_c at every adaptation step
    (``<stage>/step<k>/J_r``, ``.../J_c``) and the violation count, and writes ``adaptation_<stage>.csv`` and
    ``adaptation_<stage>.png`` (reward and cost per step, one line per held-out task, the limit dashed)."""

    def _report(self, trainer: pl.Trainer, pl_module: Any, stage: str) -> None:
        rows = [r for r in getattr(pl_module, "adapt_rows", []) if r.get("stage") == stage]
        if not rows or trainer.sanity_checking:
            return
        steps = sorted({r["step"] for r in rows})
        for k in steps:
            at = [r for r in rows if r["step"] == k]
            pl_module.log(f"{stage}/step{k}/J_r", sum(r["J_r"] for r in at) / len(at))
            pl_module.log(f"{stage}/step{k}/J_c", sum(r["J_c"] for r in at) / len(at))
        if not may_write(trainer):
            return
        save_rows(trainer, rows, f"adaptation_{stage}.csv")
        fig, axes = new_figure(1, 2, figsize=(8, 3))
        for t in sorted({r["task"] for r in rows}):
            tr = sorted((r for r in rows if r["task"] == t), key=lambda r: r["step"])
            axes[0].plot([r["step"] for r in tr], [r["J_r"] for r in tr], "o-", label=f"task {t}")
            axes[1].plot([r["step"] for r in tr], [r["J_c"] for r in tr], "o-", label=f"task {t}")
        axes[1].axhline(pl_module.env.limit, ls="--", c="k", lw=1)
        axes[0].set(xlabel="adaptation step", ylabel="J_r")
        axes[1].set(xlabel="adaptation step", ylabel="J_c")
        axes[0].legend(fontsize=7)
        path = save_figure(fig, artifact_path(trainer, f"adaptation_{stage}.png"))
        log_image(trainer, f"{stage}/adaptation", path)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._report(trainer, pl_module, "val")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: Any) -> None:
        self._report(trainer, pl_module, "test")


# -- neural path --------------------------------------------------------------------------------------------

class GaussianPolicy(torch.nn.Module):
    """``a ~ N(mu(s), diag(exp(log_std)^2))`` with an MLP mean and a state-independent log-std.

    Args:
        obs_dim, act_dim: sizes.
        hidden: hidden width (two layers). Default: 64.
        init_log_std: initial log-std. Default: -0.5.
    """

    def __init__(self, obs_dim: int, act_dim: int, hidden: int = 64, init_log_std: float = -0.5) -> None:
        super().__init__()
        self.mean = torch.nn.Sequential(torch.nn.Linear(obs_dim, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, hidden),
                                        torch.nn.Tanh(), torch.nn.Linear(hidden, act_dim))
        self.log_std = torch.nn.Parameter(torch.full((act_dim,), init_log_std))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """A sampled action ``(..., act_dim)`` (uses the global RNG; seed it for reproducible rollouts)."""
        mu = self.mean(obs)
        return mu + self.log_std.exp() * torch.randn_like(mu)

    def log_prob(self, obs: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        """``log pi(a | s)`` ``(...)``."""
        mu, std = self.mean(obs), self.log_std.exp()
        return (-0.5 * ((act - mu) / std) ** 2 - std.log() - 0.5 * math.log(2 * math.pi)).sum(-1)


def gae(rew: torch.Tensor, gamma: float, lam: float = 0.95) -> torch.Tensor:
    """GAE(lambda) advantages ``(T, N, H)`` with a time-indexed baseline ``V_t`` = the mean over the N envs of
    the discounted return-to-go from step t (no value network; ``V_H = 0``)."""
    H = rew.shape[-1]
    ret = torch.zeros_like(rew)
    run = torch.zeros_like(rew[..., 0])
    for t in reversed(range(H)):
        run = rew[..., t] + gamma * run
        ret[..., t] = run
    V = ret.mean(1, keepdim=True).expand_as(rew)  # (T, N, H)
    V_next = torch.cat([V[..., 1:], torch.zeros_like(V[..., :1])], -1)
    delta = rew + gamma * V_next - V
    adv = torch.zeros_like(rew)
    run = torch.zeros_like(rew[..., 0])
    for t in reversed(range(H)):
        run = delta[..., t] + gamma * lam * run
        adv[..., t] = run
    return adv


def summary(roots: list[str], out: str | None = None) -> str:
    """Reward and cost per adaptation step and violations of safe meta-RL runs.

    Markdown: per environment, adaptation step and meta-gradient (from the saved configs): runs, mean J_r and
    max J_c at every adaptation step over the held-out tasks and seeds, the violation count (steps >= 1 over
    tasks and seeds), and the median meta-step time; ``out``: mean reward and worst cost per adaptation step."""
    import statistics as st

    by: dict[str, list[tuple[list[dict[str, str]], list[float]]]] = {}
    for run in read_runs(roots, "adaptation_test.csv"):
        rows = run.rows("adaptation_test.csv")
        times = run.history("train/step_s")
        init = run.config["model"]["init_args"]
        key = f"{class_label(init['env'])} {init.get('adapt', 'safe')}"
        if init.get("meta_gradient", "hessian_free") != "hessian_free":
            key += f" ({init['meta_gradient']} meta-gradient)"
        by.setdefault(key, []).append((rows, times))
    if not by:
        raise FileNotFoundError(f"no finished safe meta-RL run (with adaptation_test.csv) under {', '.join(roots)}")
    steps = sorted({int(r["step"]) for runs in by.values() for rows, _ in runs for r in rows})
    if out:
        fig, axes = new_figure(1, 2, figsize=(9, 3.4))
        for name, runs in sorted(by.items()):
            allrows = [r for rows, _ in runs for r in rows]
            at = {k: [r for r in allrows if int(r["step"]) == k] for k in steps}
            axes[0].plot(steps, [st.fmean(float(r["J_r"]) for r in at[k]) for k in steps], marker="o", label=name)
            axes[1].plot(steps, [max(float(r["J_c"]) for r in at[k]) for k in steps], marker="o", label=name)
        for ax, ylabel, title in ((axes[0], "mean J_r (held-out tasks)", "Reward per adaptation step"),
                                  (axes[1], "max J_c (held-out tasks)", "Worst cost per adaptation step")):
            ax.set_xlabel("adaptation step")
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=9)
            ax.set_xticks(steps)
        axes[0].legend(fontsize=7)
        save_figure(fig, out)
    table = []
    for name, runs in sorted(by.items()):
        allrows = [r for rows, _ in runs for r in rows]
        cells = []
        for k in steps:
            at = [r for r in allrows if int(r["step"]) == k]
            cells.append(f"{st.fmean(float(r['J_r']) for r in at):.2f} / {max(float(r['J_c']) for r in at):.2f}" if at else "-")
        viol = sum(int(r["violation"]) for r in allrows if int(r["step"]) > 0)
        times = [t for _, ts in runs for t in ts[1:]]
        table.append([name, len(runs), *cells, viol, f"{1e3 * st.median(times):.1f}" if times else "-"])
    return markdown_table(["environment / step", "runs", *(f"step {k} J_r / max J_c" for k in steps), "violations",
                           "meta-step (ms)"], table)


class NeuralSafeMetaRLModule(Shardable, _MetaTestMixin, pl.LightningModule):
    """Safe meta-RL with a Gaussian policy network on a continuous task family (:mod:`lowrank_lit.envs.continuous`).

    Rollouts run inside the module (manual optimisation). Adaptation (inferred, module docstring): GAE(lambda)
    advantages of reward and cost on ``n_envs`` rollouts of the anchor; the safe step's self-normalised weights
    on the sampled (s, a) pairs (anchor weights ``gamma^t``, budget ``(1 - gamma)(d - J_c)``); projection to the
    network by weighted maximum likelihood (``proj_steps`` Adam steps from the anchor's weights).
    Meta-gradient (Hessian-free, first order): the gradient of ``sum_i w_i (A_i - sum_j w_j A_j) log pi_phi(a_i|s_i)``
    (the adapted policy's score with z fixed; the anchor's advantages stand in for the adapted policy's), minus
    ``lambda`` times the REINFORCE gradient of the worst task's cost; ``lambda`` by projected dual ascent.
    Meta-test: ``adapt_steps`` successive steps per held-out task, each policy evaluated by its rollouts (one row
    per step, as :class:`SafeMetaRLModule`, for :class:`SafetyMonitor`). The baselines differ only in the
    test-time step: ``unconstrained`` (nu = 0) and ``pg_lagrange`` (one policy-gradient step with the fixed
    multiplier ``pg_lambda``).

    Args:
        env: a continuous family (``PointNav2D``, ``VelocityCart``, ``HalfCheetahVelocity``).
        eta: KL weight (> 0), in the advantages' units. Default: 1.0.
        kappa: KL weight of the constraint (>= 0). Default: 0.5.
        meta_lr: Adam learning rate of the meta-policy. Default: 3e-3.
        adapt: ``safe``, ``unconstrained`` or ``pg_lagrange``. Default: safe.
        adapt_steps: successive adaptation steps at meta-test. Default: 3.
        n_envs: rollouts per task and step. Default: 32.
        dual_lr: step of the meta-constraint multiplier. Default: 0.1.
        pg_lambda: fixed multiplier of the ``pg_lagrange`` step. Default: 1.0.
        pg_alpha: step size of the ``pg_lagrange`` step. Default: 0.05.
        proj_steps: Adam steps of the weighted maximum-likelihood projection. Default: 50.
        proj_lr: their learning rate (small: the projection stays near the anchor where the samples are). Default: 1e-3.
        gae_lambda: GAE lambda. Default: 0.95.
        hidden: policy width. Default: 64.
    """

    #: adaptation deep-copies the policy for each task, and the ranks adapt different numbers of tasks
    sharding_refusal: ClassVar[str | None] = ("it adapts a deep copy of the policy per task, and the ranks adapt "
                                              "different numbers of tasks; use ddp")

    def __init__(self, env: ContinuousFamily, eta: float = 1.0, kappa: float = 0.5, meta_lr: LearningRate = 3e-3, adapt: str = "safe",
                 adapt_steps: int = 3, n_envs: int = 32, dual_lr: LearningRate = 0.1, pg_lambda: float = 1.0, pg_alpha: float = 0.05,
                 proj_steps: int = 50, proj_lr: LearningRate = 1e-3, gae_lambda: float = 0.95, hidden: int = 64) -> None:
        super().__init__()
        if adapt not in ADAPT:
            raise ValueError(f"NeuralSafeMetaRLModule: adapt={adapt!r}; allowed: {', '.join(ADAPT)}")
        if eta <= 0:
            raise ValueError(f"NeuralSafeMetaRLModule: eta={eta!r}; allowed: > 0")
        if kappa < 0:
            raise ValueError(f"NeuralSafeMetaRLModule: kappa={kappa!r}; allowed: >= 0")
        if adapt_steps < 1 or n_envs < 2:
            raise ValueError(f"NeuralSafeMetaRLModule: adapt_steps={adapt_steps!r} (>= 1), n_envs={n_envs!r} (>= 2)")
        self.save_hyperparameters(ignore=["env"], logger=False)
        self.automatic_optimization = False
        self.env = env
        self.policy = GaussianPolicy(env.obs_dim, env.act_dim, hidden)
        self.register_buffer("lam", torch.zeros(()))
        self.adapt_rows: list[dict[str, Any]] = []
        self._gen = torch.Generator().manual_seed(0)
        self._resumed_gen: torch.Tensor | None = None  # the rollout generator's state from a checkpoint

    def on_fit_start(self) -> None:
        if self._resumed_gen is not None:  # a resumed run continues each rank's rollout stream where it stopped
            self._gen.set_state(self._resumed_gen)
            self._resumed_gen = None
            return
        self._gen.manual_seed(int(torch.randint(0, 2**31 - 1, (1,))) + 7919 * self.global_rank)  # per-rank stream

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rollout_generator"] = gather_per_rank(self.trainer, self._gen.get_state())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("rollout_generator")
        rank = self.trainer.global_rank if self._trainer is not None else 0
        if states and rank < len(states):
            self._resumed_gen = states[rank]

    def _rollout(self, policy: GaussianPolicy, tasks: list[int]) -> dict[str, torch.Tensor]:
        ro = self.env.rollout(policy, torch.tensor(tasks), self.hparams.n_envs, self._gen)
        g, H = self.env.gamma, ro.rew.shape[-1]
        from lowrank_lit.envs.continuous import discounted_sum

        return {"obs": ro.obs, "act": ro.act, "adv_r": gae(ro.rew, g, self.hparams.gae_lambda),
                "adv_c": gae(ro.cost, g, self.hparams.gae_lambda), "J_r": discounted_sum(ro.rew, g).mean(1),
                "J_c": discounted_sum(ro.cost, g).mean(1), "base": (g ** torch.arange(H, dtype=torch.float32)).expand_as(ro.rew)}

    def _weights(self, b: dict[str, torch.Tensor], k: int, constrained: bool) -> tuple[torch.Tensor, float]:
        budget = (1 - self.env.gamma) * (self.env.limit - float(b["J_c"][k]))
        w, nu = sample_weights(b["adv_r"][k].flatten().double(), b["adv_c"][k].flatten().double(), budget, self.hparams.eta,
                               self.hparams.kappa, constrained, base=b["base"][k].flatten().double())
        return w.float(), nu

    def adapt_step(self, policy: GaussianPolicy, b: dict[str, torch.Tensor], k: int) -> tuple[GaussianPolicy, float]:
        """One adaptation step from ``policy`` with its rollouts ``b`` (task row ``k``)."""
        import copy

        new = copy.deepcopy(policy)
        obs, act = b["obs"][k].flatten(0, 1), b["act"][k].flatten(0, 1)  # (N*H, d)
        if torch.is_inference_mode_enabled():
            raise RuntimeError("NeuralSafeMetaRLModule: adaptation needs gradients; set trainer.inference_mode: false")
        with torch.enable_grad():
            return self._adapt(new, b, k, obs, act)

    def _adapt(self, new: GaussianPolicy, b: dict[str, torch.Tensor], k: int, obs: torch.Tensor,
               act: torch.Tensor) -> tuple[GaussianPolicy, float]:
        if self.hparams.adapt == "pg_lagrange":
            p = b["base"][k].flatten() / b["base"][k].sum()
            adv = (b["adv_r"][k] - self.hparams.pg_lambda * b["adv_c"][k]).flatten()
            loss = -(p * adv * new.log_prob(obs, act)).sum()
            grads = torch.autograd.grad(loss, list(new.parameters()))
            with torch.no_grad():
                for prm, g in zip(new.parameters(), grads, strict=True):
                    prm -= self.hparams.pg_alpha * g
            return new, self.hparams.pg_lambda
        w, nu = self._weights(b, k, self.hparams.adapt == "safe")
        weighted_ml_projection(new.log_prob, list(new.parameters()), obs, act, w, self.hparams.proj_steps, self.hparams.proj_lr)
        return new, nu

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        t0 = time.perf_counter()
        tasks = [int(t) for t in batch]
        b = self._rollout(self.policy, tasks)
        loss_r = torch.zeros(())
        infeasible = 0
        for k in range(len(tasks)):
            obs, act = b["obs"][k].flatten(0, 1), b["act"][k].flatten(0, 1)
            adv = b["adv_r"][k].flatten()
            try:
                w, _ = self._weights(b, k, True)
            except InfeasibleAnchorError:
                w, infeasible = b["base"][k].flatten() / b["base"][k].sum(), infeasible + 1
            loss_r = loss_r - (w * (adv - (w * adv).sum()) * self.policy.log_prob(obs, act)).sum() / len(tasks)
        worst = int(b["J_c"].argmax())
        p = b["base"][worst].flatten() / b["base"][worst].sum()
        loss_c = (p * b["adv_c"][worst].flatten() * self.policy.log_prob(b["obs"][worst].flatten(0, 1), b["act"][worst].flatten(0, 1))).sum()
        loss = loss_r + self.lam * loss_c
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        if self.trainer.world_size > 1:
            import torch.distributed as dist

            for prm in self.policy.parameters():
                dist.all_reduce(prm.grad)
                prm.grad /= self.trainer.world_size
        opt.step()
        self.lam.copy_((self.lam + self.hparams.dual_lr * (float(b["J_c"][worst]) - self.env.limit)).clamp_min(0))
        self.log_dict({"train/J_r": float(b["J_r"].mean()), "train/meta_J_c": float(b["J_c"][worst]), "train/lambda": float(self.lam),
                       "train/infeasible": float(infeasible), "train/step_s": time.perf_counter() - t0})

    def _measure(self, policy: GaussianPolicy, task: int) -> tuple[float, float, dict[str, torch.Tensor]]:
        b = self._rollout(policy, [task])  # the rollouts estimate J and feed the next step
        return float(b["J_r"][0]), float(b["J_c"][0]), b

    def _step(self, policy: GaussianPolicy, task: int, data: dict[str, torch.Tensor]) -> tuple[GaussianPolicy, float]:
        return self.adapt_step(policy, data, 0)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.policy.parameters(), lr=self.hparams.meta_lr)


def feasible_anchor_logits(env: Any) -> torch.Tensor:
    """Logits ``(S, A)`` of a feasible SafeGridNav anchor: along row 0, then down the last column (90 %; 10 %
    uniform), the fixed starting point of the meta-gradient timings."""
    n = env.size
    pi = torch.zeros(env.S, env.A, dtype=torch.float64)
    for s in range(env.S):
        i, j = divmod(s, n)
        pi[s, 1 if i == 0 and j < n - 1 else 2] = 1
    return (0.9 * pi + 0.1 / env.A).log()


def bench(ctx: Any) -> list[Any]:
    """Time of one meta-gradient, first order (Hessian-free safe step) against second-order MAML, on SafeGridNav
    at the 6 x 6 grid of the experiment and a larger one (``lowrank bench safe_meta_rl``)."""
    from lowrank_lit.bench import ratio_row
    from lowrank_lit.envs import SafeGridNav

    rows = []
    for n in ctx.size((6, 18), (6, 10)):
        env = SafeGridNav(size=n)
        phi = feasible_anchor_logits(env)
        tasks = list(range(min(3, env.num_tasks)))
        times = ctx.compare({"first order": lambda e=env, p=phi, t=tasks: hessian_free_meta_grad(e, p, t, 0.1, 0.1, "safe"),
                             "second order": lambda e=env, p=phi, t=tasks: second_order_meta_grad(e, p, t, 1.0, 1.0)},
                            ctx.rounds(10, 3), warmup=1)
        rows.append(ratio_row(ctx, "safe_meta_rl", f"Hessian-free meta-gradient, {n} x {n} grid ({env.S} states)",
                              "second-order MAML meta-gradient", times, "first order", "second order",
                              "paper: first order, no Hessian: cheaper; our target <= 1.0x", 1.0, note="3 tasks"))
    return rows
