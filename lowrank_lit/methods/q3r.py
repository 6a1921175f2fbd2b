"""Q3R: Quadratic Reweighted Rank Regularizer for Effective Low-Rank Training.

Ghosh, Nguyen, Kümmerle, NeurIPS 2025 (arXiv 2511.04485). Official code: github.com/ThatE10/Q3R.

An IRLS-style rank regularizer. Every ``period`` optimizer steps the reweighting operator of each
target matrix ``W`` (or row slice: q, k, v of a fused qkv) is rebuilt from its SVD
``W = U diag(sigma) V^T``; in between, the penalty ``lam * <X, R(X)>`` is a cheap quadratic that
majorizes a smoothed log-det rank surrogate::

    eps   <- min(eps, sigma_{r+1}(W))                 (schedule "default"; eps starts at 1e8)
    r_env  = #{i : sigma_i > eps}                     (>= r)
    s_i    = eps / sigma_i   for i <= r_env
    R(X)   = P_L X P_R,   P_L = I - U diag(1 - s) U^T,   P_R = I - V diag(1 - s) V^T
           (in W's singular basis: [R(X)]_ij = min(1, eps/sigma_i) min(1, eps/sigma_j) X_ij)

The optimizer step is decoupled like AdamW's weight decay: an ordinary optimizer step on the task
loss, then ``W <- W - lr * 2 * lam * R(W)``; the penalty gradient never enters Adam's moments.
Directions below ``eps`` get full weight decay ``2 lam``, dominant ones almost none, so the weights
become (near) rank-r and can be truncated after training with little loss.

Components:

* :class:`Q3RRegularizer` -- the operator, penalty, gradient and epsilon schedules (``default``,
  ``linear``, ``constant``, ``exploration``) for a set of target matrices; no ``d x d`` matrix is formed.
* :class:`Q3R` -- a Lightning Callback owning the regularizer; composes with any optimizer and any
  LightningModule (``trainer.callbacks``). With ``Adam(weight_decay=0)`` it reproduces :class:`AdamQ3R`.
* :class:`AdamQ3R` -- the paper's optimizer (Adam + decoupled Q3R step), for plain PyTorch loops.
* :func:`truncate` and :class:`TruncationEval` -- post-hoc SVD truncation to real low-rank layers.

Deviations / choices: the official code once multiplied both update terms by a hard-coded 3 and
its latest commit references an undefined name in the penalty line; here both use the plain
learning rate (the evident intent). The penalty step uses the learning rate that the optimizer
used for that step (read from the parameter's param group before the step, so a per-step LR
schedule does not shift it). ``target_rank`` follows the official code: a float in (0, 1) means
``int(frac * max(d1, d2))``; an integer ``r >= 1`` means ``int(r * max(d1, d2) / min(d1, d2))``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.linalg import entropy_rank
from lowrank_lit.nn.lowrank_linear import svd_factorize
from lowrank_lit.nn.targets import match_modules, module_copy, replace_module
from lowrank_lit.registry import register_method
from lowrank_lit.report import (
    artifact_path,
    group_runs,
    log_image,
    markdown_table,
    may_write,
    new_figure,
    read_runs,
    save_figure,
    save_rows,
)
from lowrank_lit.sharding import from_owner, full_tensor, is_sharded, owners, whole_matrix_update

__all__ = [
    "EPS_SCHEDULES",
    "Q3RTarget",
    "Q3RRegularizer",
    "Q3R",
    "AdamQ3R",
    "Q3RHparams",
    "resolve_targets",
    "truncation_rank",
    "truncate",
    "TruncationEval",
]

PAPER = "Q3R: Quadratic Reweighted Rank Regularizer for Effective Low-Rank Training"
EPS_SCHEDULES = ("default", "linear", "constant", "exploration")
EPS_INIT = 1e8  # official initial epsilon: the first refresh sets eps = sigma_{r+1}


# --------------------------------------------------------------------------------------- targets
@dataclass
class Q3RTarget:
    """One regularized matrix: rows ``rows`` of ``module.weight`` (all rows when None)."""

    name: str
    module: nn.Linear
    rows: slice
    # state, filled at each refresh
    rank: int = 0
    eps: float = EPS_INIT
    eps0: float | None = None
    r_env: int = 0
    U: torch.Tensor | None = None  # (d1, r_env)
    V: torch.Tensor | None = None  # (d2, r_env)
    sigma: torch.Tensor | None = None  # (min(d1, d2),) all singular values at the last refresh
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def weight(self) -> torch.Tensor:
        return self.module.weight[self.rows]  # (d1, d2) view

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows.stop - self.rows.start, self.module.weight.shape[1])


def resolve_targets(model: nn.Module, patterns: Sequence[str]) -> list[Q3RTarget]:
    """Targets from module-name patterns (:func:`lowrank_lit.nn.targets.match_modules`); ``"blocks.*.attn.qkv[3]"``
    splits the rows in 3.

    Raises:
        ValueError: a pattern matches nothing, a match is not 2-D, the rows do not split evenly,
            or two patterns select overlapping rows.
    """
    out: list[Q3RTarget] = []
    seen: dict[str, list[slice]] = {}
    for match in match_modules(model, patterns, owner="Q3R: targets"):
        name, mod = match.name, match.module
        weight = getattr(mod, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2:
            raise ValueError(f"Q3R: target {name!r} has no 2-D weight (got {type(mod).__name__})")
        try:
            row_slices = match.rows(weight.shape[0])
        except ValueError as err:
            raise ValueError(f"Q3R: target {err}") from None
        for k, rows in enumerate(row_slices):
            for other in seen.get(name, []):
                if rows.start < other.stop and other.start < rows.stop:
                    raise ValueError(f"Q3R: target {name!r}: row slices {other} and {rows} overlap")
            seen.setdefault(name, []).append(rows)
            label = name if match.slices == 1 else f"{name}[{k}]"
            out.append(Q3RTarget(label, mod, rows))  # type: ignore[arg-type]
    return out


def _resolve_rank(target_rank: float, d1: int, d2: int, name: str) -> int:
    big, small = max(d1, d2), min(d1, d2)
    if isinstance(target_rank, bool) or not isinstance(target_rank, int | float) or target_rank <= 0:
        raise ValueError(f"Q3R: target_rank={target_rank!r} for {name!r}; allowed: a float in (0, 1) or an int >= 1")
    if isinstance(target_rank, float) and target_rank < 1:
        r = int(target_rank * big)
    else:
        r = int(target_rank * big / small)
    if not 1 <= r < small:
        raise ValueError(
            f"Q3R: target_rank={target_rank!r} gives rank {r} for {name!r} ({d1}x{d2}); "
            f"allowed: 1 <= rank < {small} (sigma_(r+1) must exist)"
        )
    return r


# --------------------------------------------------------------------------------------- regularizer
@dataclass(frozen=True)
class Q3RHparams:
    """Q3R's hyperparameters, validated once here for the callback and the regularizer alike.

    Attributes:
        target_rank: rank target r: a float in (0, 1) (fraction of max(d1, d2)) or an int >= 1 (see the module
            docstring). Default: 0.1.
        lam: penalty weight lambda >= 0. Default: 0.1.
        period: optimizer steps between operator refreshes T >= 1. Default: 5.
        eps_schedule: one of :data:`EPS_SCHEDULES`: ``default`` (eps = min(eps, sigma_{r+1})), ``linear`` (geometric
            decay from sigma_{r+1} to ``eps_min`` over ``eps_decay_steps``), ``constant`` (sigma_{r+1} of the first
            refresh) or ``exploration`` (sigma_{r+1} at every refresh). Default: ``default``.
        eps_decay_steps: length of the ``linear`` schedule in optimizer steps, >= 1. Default: 10000.
        eps_min: end point of the ``linear`` schedule, > 0. Default: 1e-5.
    """

    target_rank: float = 0.1
    lam: float = 0.1
    period: int = 5
    eps_schedule: str = "default"
    eps_decay_steps: int = 10000
    eps_min: float = 1e-5

    def __post_init__(self) -> None:
        tr = self.target_rank
        if isinstance(tr, bool) or not isinstance(tr, int | float) or not tr > 0:
            raise ValueError(f"Q3R: target_rank={tr!r}; allowed: a float in (0, 1) or an int >= 1")
        lam = self.lam
        if isinstance(lam, bool) or not isinstance(lam, int | float) or lam < 0 or not math.isfinite(lam):
            raise ValueError(f"Q3R: lam={lam!r}; allowed: a finite float >= 0")
        if isinstance(self.period, bool) or not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"Q3R: period={self.period!r}; allowed: an integer >= 1")
        if self.eps_schedule not in EPS_SCHEDULES:
            raise ValueError(f"Q3R: eps_schedule={self.eps_schedule!r}; allowed: {', '.join(EPS_SCHEDULES)}")
        if isinstance(self.eps_decay_steps, bool) or not isinstance(self.eps_decay_steps, int) or self.eps_decay_steps < 1:
            raise ValueError(f"Q3R: eps_decay_steps={self.eps_decay_steps!r}; allowed: an integer >= 1")
        if isinstance(self.eps_min, bool) or not isinstance(self.eps_min, int | float) or not self.eps_min > 0:
            raise ValueError(f"Q3R: eps_min={self.eps_min!r}; allowed: a float > 0")


class Q3RRegularizer:
    """The Q3R operators of a set of target matrices.

    Args:
        targets: the matrices (see :func:`resolve_targets`).
        hparams: rank target, penalty weight, refresh period and epsilon schedule (:class:`Q3RHparams`, validated
            there; its defaults are the paper's). ``Q3RRegularizer(targets, Q3RHparams(target_rank=2, lam=0.5))``.

    Raises:
        ValueError: a ``target_rank`` without sigma_{r+1} for one of the targets.
    """

    def __init__(self, targets: list[Q3RTarget], hparams: Q3RHparams | None = None) -> None:
        self.hparams = hp = Q3RHparams() if hparams is None else hparams
        if not isinstance(hp, Q3RHparams):
            raise TypeError(f"Q3RRegularizer: hparams={hp!r}; allowed: a Q3RHparams (or None for the defaults)")
        self.targets = targets
        self.lam = float(hp.lam)
        self.period = hp.period
        self.eps_schedule = hp.eps_schedule
        self.eps_decay_steps = hp.eps_decay_steps
        self.eps_min = hp.eps_min
        self.steps = 0  # optimizer steps taken (the schedule clock)
        self._owners: dict[int, int] | None = None  # sharded weights: the rank holding each one's bases
        for t in targets:
            t.rank = _resolve_rank(hp.target_rank, *t.shape, t.name)

    # ------------------------------------------------------------------ operator
    def refresh(self) -> None:
        """Recompute eps, the envelope rank and the singular bases of every target (float32). A sharded weight is
        gathered and refreshed on the rank that owns it (see :meth:`step`)."""
        for t in self.targets:
            owner = self._owner(t)
            if owner is None:
                self._refresh(t, t.weight.detach().float())
                continue
            W = full_tensor(t.module.weight.detach())[t.rows].float()  # (d1, d2), gathered on every rank
            if dist.get_rank() == owner:
                self._refresh(t, W)
            # every rank logs and schedules alike; the bases stay on the owner
            t.eps, t.eps0, t.r_env = from_owner((t.eps, t.eps0, t.r_env), owner)

    def _refresh(self, t: Q3RTarget, W: torch.Tensor) -> None:
        if not torch.isfinite(W).all():
            raise RuntimeError(f"Q3R: non-finite weights in {t.name!r} at step {self.steps}")
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)  # (d1, m), (m,), (m, d2)
        sigma_next = float(S[t.rank])
        if t.eps0 is None:
            t.eps0 = sigma_next
        if self.eps_schedule == "default":
            t.eps = min(t.eps, sigma_next)
        elif self.eps_schedule == "exploration":
            t.eps = sigma_next
        elif self.eps_schedule == "constant":
            t.eps = t.eps0
        else:  # linear: geometric interpolation from eps0 to eps_min
            frac = min(self.steps, self.eps_decay_steps) / self.eps_decay_steps
            t.eps = t.eps0 * (self.eps_min / t.eps0) ** frac if t.eps0 > 0 else 0.0
        t.r_env = int((S > t.eps).sum())
        t.U, t.V, t.sigma = U[:, : t.r_env].contiguous(), Vh[: t.r_env].T.contiguous(), S

    def _owner(self, t: Q3RTarget) -> int | None:
        """The rank that holds the bases of a sharded target (None when its weight is not sharded): the weights are
        spread over the ranks by :func:`lowrank_lit.sharding.owners`, all row slices of one weight on one rank."""
        weight = t.module.weight
        if not is_sharded(weight):
            return None
        if self._owners is None:
            unique = list({id(x.module.weight): x.module.weight for x in self.targets}.values())
            self._owners = owners(unique, dist.get_world_size())
        return self._owners[id(weight)]

    @staticmethod
    def apply(t: Q3RTarget, X: torch.Tensor) -> torch.Tensor:
        """``R(X) = P_L X P_R`` for target ``t`` in O(d1 d2 r_env) (no d x d matrix)."""
        if t.U is None or t.sigma is None:
            raise RuntimeError(f"Q3R: operator of {t.name!r} used before the first refresh")
        if t.r_env == 0:
            return X.clone()  # eps >= sigma_1: R is the identity (plain weight decay)
        X32 = X.float()
        w = 1.0 - t.eps / t.sigma[: t.r_env]  # (r_env,) = 1 - s_i
        U, V = t.U.to(X32.device), t.V.to(X32.device)
        Y = X32 - U @ (w.to(X32.device)[:, None] * (U.T @ X32))  # P_L X: (d1, d2)
        out = Y - ((Y @ V) * w.to(X32.device)[None, :]) @ V.T  # (P_L X) P_R: (d1, d2)
        return out.to(X.dtype)

    def penalty(self, params: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """``lam * sum_t <X_t, R_t(X_t)>`` at the current weights (or at ``params[name]``)."""
        total = torch.zeros(())
        for t in self.targets:
            X = t.weight if params is None else params[t.name]
            total = total + (X.float() * self.apply(t, X).float()).sum().cpu()
        return self.lam * total

    # ------------------------------------------------------------------ update
    @torch.no_grad()
    def step(self, lr_of: Callable[[torch.Tensor], float]) -> None:
        """One decoupled penalty step ``W <- W - lr * 2 * lam * R(W)`` (refreshing R every ``period`` steps).

        Args:
            lr_of: the learning rate to use for a given weight tensor (that of its param group).
        """
        if self.steps % self.period == 0:
            self.refresh()
        if self.lam > 0:
            for t in self.targets:
                W = t.module.weight
                c = lr_of(W) * 2.0 * self.lam

                def penalty_step(w: torch.Tensor, _grad: Any, t: Q3RTarget = t, c: float = c) -> None:
                    w[t.rows] -= c * self.apply(t, w[t.rows])

                owner = self._owner(t)
                if owner is None:
                    penalty_step(W, None)
                else:  # gathered, stepped on the owner (which holds the bases), scattered back
                    whole_matrix_update(W, owner, penalty_step, with_grad=False)
        self.steps += 1

    # ------------------------------------------------------------------ diagnostics and state
    def stats(self) -> dict[str, dict[str, float]]:
        """Per target: eps, envelope rank, effective rank (exp of the singular-value entropy), penalty."""
        out = {}
        for t in self.targets:
            owner = self._owner(t)
            W = (t.weight if owner is None else full_tensor(t.module.weight)[t.rows]).detach()
            row = None
            if t.sigma is not None:
                value = float((W.float() * self.apply(t, W).float()).sum())
                row = {"eps": t.eps, "r_env": float(t.r_env), "erank": entropy_rank(t.sigma), "penalty": self.lam * value}
            if owner is not None:  # computed where the bases are, known to every rank
                row = from_owner(row, owner)
            if row is not None:
                out[t.name] = row
        return out

    def state_dict(self) -> dict[str, Any]:
        """The schedule clock and each target's operator; under sharding every rank returns the whole of it (each
        target's bases taken from its owner), so a consolidated checkpoint resumes on any number of processes."""
        targets = {}
        for t in self.targets:
            row = {"eps": t.eps, "eps0": t.eps0, "r_env": t.r_env, "U": t.U, "V": t.V, "sigma": t.sigma}
            owner = self._owner(t)
            targets[t.name] = row if owner is None else from_owner(row, owner)
        return {"steps": self.steps, "targets": targets}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        by_name = {t.name: t for t in self.targets}
        missing = set(by_name) ^ set(state["targets"])
        if missing:
            raise ValueError(f"Q3R: checkpoint targets differ from the model's: {sorted(missing)}")
        for name, s in state["targets"].items():
            t = by_name[name]
            t.eps, t.eps0, t.r_env, t.U, t.V, t.sigma = s["eps"], s["eps0"], s["r_env"], s["U"], s["V"], s["sigma"]


def _lr_lookup(optimizers: Iterable[torch.optim.Optimizer]) -> Callable[[torch.Tensor], float]:
    table = {id(p): float(g["lr"]) for opt in optimizers for g in opt.param_groups for p in g["params"]}

    def lr_of(param: torch.Tensor) -> float:
        try:
            return table[id(param)]
        except KeyError:
            raise RuntimeError("Q3R: a target weight is not optimized by any optimizer") from None

    return lr_of


# --------------------------------------------------------------------------------------- optimizer
class AdamQ3R(torch.optim.Adam):
    """The paper's optimizer: bias-corrected Adam on the task gradient, then the decoupled Q3R step.

    Args:
        params: parameters (or param groups) to optimize.
        q3r: the regularizer of (some of) these parameters.
        lr: learning rate (also scales the penalty step). Default: 1e-3.
        betas: Adam's betas, each in [0, 1). Default: (0.9, 0.999).
        eps: Adam's epsilon. Default: 1e-8.
    """

    def __init__(self, params: Any, q3r: Q3RRegularizer, lr: LearningRate = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8) -> None:
        if lr < 0:
            raise ValueError(f"AdamQ3R: lr={lr}; allowed: >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamQ3R: betas={betas}; allowed: each in [0, 1)")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=0.0)
        self.q3r = q3r

    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        lr_of = _lr_lookup([self])  # the lr of this step, before any scheduler moves it
        loss = super().step(closure)
        self.q3r.step(lr_of)
        return loss


# --------------------------------------------------------------------------------------- callback
@register_method("q3r", kind="Callback", paper=PAPER, summary="compare", bench="bench")
class Q3R(Callback):
    """Q3R as a Lightning Callback: add it to ``trainer.callbacks`` of any run.

    After every optimizer step it applies ``W <- W - lr * 2 * lam * R(W)`` to each target, with
    the step's learning rate from the parameter's param group, and rebuilds R every ``period``
    steps. Its state (epsilons, bases, step counter) is saved in checkpoints. At each refresh it
    logs ``q3r/<target>/{eps,r_env,erank,penalty}``.

    Args:
        targets: module-name patterns of ``pl_module`` (fnmatch); ``name[n]`` splits the rows into
            n slices regularized separately (``backbone.blocks.*.attn.qkv[3]`` for q, k, v).
        target_rank: float in (0, 1) (fraction of max(d1, d2)) or int >= 1.
        lam: penalty weight lambda (the paper's 0.1; the official CLI default is 0.01).
        period: optimizer steps between refreshes T.
        eps_schedule: ``default``, ``linear``, ``constant`` or ``exploration``.
        eps_decay_steps: length of the ``linear`` schedule.
        eps_min: end point of the ``linear`` schedule.
        log_stats: log the per-target statistics at each refresh. Default: True.

    The six hyperparameters are :class:`Q3RHparams`'s (its defaults, its checks), spelled out here so that each is
    a config key of its own (``--trainer.callbacks.init_args.lam=0.05``).
    """

    def __init__(
        self,
        targets: list[str],
        target_rank: float = Q3RHparams.target_rank,
        lam: float = Q3RHparams.lam,
        period: int = Q3RHparams.period,
        eps_schedule: str = Q3RHparams.eps_schedule,
        eps_decay_steps: int = Q3RHparams.eps_decay_steps,
        eps_min: float = Q3RHparams.eps_min,
        log_stats: bool = True,
    ) -> None:
        super().__init__()
        if isinstance(targets, str) or not targets:
            raise ValueError(f"Q3R: targets={targets!r}; allowed: a non-empty list of module-name patterns")
        # fail at config time, before any training
        self.hparams = Q3RHparams(target_rank, lam, period, eps_schedule, eps_decay_steps, eps_min)
        self.patterns = list(targets)
        self.log_stats = log_stats
        self.regularizer: Q3RRegularizer | None = None
        self._pending_state: dict[str, Any] | None = None
        self._lr_of: Callable[[torch.Tensor], float] | None = None
        self._seen_step = -1

    @property
    def rank_targets(self) -> list[str]:
        """The module patterns this callback pulls towards low rank (``lowrank export --format factors`` and
        :class:`TruncationEval` truncate these)."""
        return list(self.patterns)

    def factorize(self, model: nn.Module, keep: float, targets: Sequence[str] | None = None) -> nn.Module:
        """``model`` with its targets (default: :attr:`rank_targets`) truncated by SVD to two factors keeping the share
        ``keep`` of each target's parameters (:func:`truncate`; ``lowrank export --format factors``)."""
        return truncate(model, keep, list(targets) if targets else self.rank_targets)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.regularizer is not None:
            return
        self.regularizer = Q3RRegularizer(resolve_targets(pl_module, self.patterns), self.hparams)
        if self._pending_state is not None:
            self.regularizer.load_state_dict(self._pending_state)
            self._pending_state = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._seen_step = trainer.global_step

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self._lr_of = _lr_lookup(trainer.optimizers)  # this step's learning rates

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step == self._seen_step or self._lr_of is None:
            return  # no optimizer step on this batch (gradient accumulation or a skipped step)
        self._seen_step = trainer.global_step
        reg = self.regularizer
        assert reg is not None
        refreshed = reg.steps % reg.period == 0
        reg.step(self._lr_of)
        if refreshed and self.log_stats:
            for name, stats in reg.stats().items():
                for key, value in stats.items():
                    pl_module.log(f"q3r/{name}/{key}", value, on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return self.regularizer.state_dict() if self.regularizer is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.regularizer is None:
            self._pending_state = state_dict
        else:
            self.regularizer.load_state_dict(state_dict)


# --------------------------------------------------------------------------------------- truncation
def truncation_rank(d1: int, d2: int, keep_fraction: float) -> int:
    """Rank that keeps ``keep_fraction`` of a d1 x d2 matrix's parameters: floor(rho d1 d2 / (d1 + d2)), >= 1."""
    if not isinstance(keep_fraction, int | float) or not 0.0 < keep_fraction <= 1.0:
        raise ValueError(f"keep_fraction={keep_fraction!r}; allowed: a float in (0, 1]")
    return max(1, int(keep_fraction * d1 * d2 / (d1 + d2)))


def truncate(model: nn.Module, keep_fraction: float, targets: Sequence[str]) -> nn.Module:
    """Replace each target Linear by its SVD-truncated :class:`LowRankLinear`, in place.

    Each row slice (``name[n]`` patterns) gets rank :func:`truncation_rank` of its own shape, so
    the parameter count really drops. ``keep_fraction=1.0`` leaves the model unchanged.

    Returns:
        ``model`` (modified in place).
    """
    truncation_rank(1, 1, keep_fraction)  # validates
    if keep_fraction == 1.0:
        return model
    by_module: dict[str, list[Q3RTarget]] = {}
    for t in resolve_targets(model, targets):
        name = t.name.split("[")[0]
        by_module.setdefault(name, []).append(t)
    for name, parts in by_module.items():
        module = parts[0].module
        if not isinstance(module, nn.Linear):
            raise ValueError(f"truncate: target {name!r} is a {type(module).__name__}, not nn.Linear")
        slices = [p.rows for p in parts]
        ranks = [truncation_rank(*p.shape, keep_fraction) for p in parts]
        replace_module(model, name, svd_factorize(module, slices, ranks))
    return model


def _target_module_names(model: nn.Module, targets: Sequence[str]) -> list[str]:
    return sorted({t.name.split("[")[0] for t in resolve_targets(model, targets)})


def _params_of(model: nn.Module, names: Sequence[str]) -> int:
    return sum(p.numel() for n in names for p in model.get_submodule(n).parameters())


class TruncationEval(Callback):
    """After ``fit`` (or ``test``): test accuracy of SVD-truncated copies of the model.

    For each keep fraction the targets are replaced by :func:`truncate` on a copy of the module
    and the test set is evaluated. Writes ``truncation.csv`` and ``truncation.png`` (accuracy vs
    kept parameters of the targets) into the run directory, logs ``trunc/acc@<rho>`` to every
    logger, and the plot to W&B when a WandbLogger is configured.

    Args:
        targets: module-name patterns (as in :class:`Q3R`). Default: None (the ``rank_targets`` a callback of the run declares: Q3R's).
        keep_fractions: fractions of target parameters kept. Default: [1.0, 0.6, 0.4, 0.2, 0.1].
        on: ``fit`` (after training) or ``test`` (after a test run). Default: ``fit``.
    """

    def __init__(
        self,
        targets: list[str] | None = None,
        keep_fractions: list[float] | None = None,
        on: str = "fit",
    ) -> None:
        super().__init__()
        self.targets = targets
        self.keep_fractions = [1.0, 0.6, 0.4, 0.2, 0.1] if keep_fractions is None else list(keep_fractions)
        for rho in self.keep_fractions:
            truncation_rank(1, 1, rho)
        if on not in ("fit", "test"):
            raise ValueError(f"TruncationEval: on={on!r}; allowed: fit, test")
        self.on = on
        self.results: list[dict[str, float]] = []

    def _patterns(self, trainer: Trainer) -> list[str]:
        if self.targets is not None:
            return self.targets
        for cb in trainer.callbacks:
            if getattr(cb, "rank_targets", None):
                return list(cb.rank_targets)
        raise ValueError("TruncationEval: targets=None and no callback of the run declares rank_targets (e.g. Q3R); pass targets")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.on == "fit":
            self.evaluate(trainer, pl_module)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.on == "test":
            self.evaluate(trainer, pl_module)

    @torch.no_grad()
    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> list[dict[str, float]]:
        datamodule = trainer.datamodule
        if datamodule is None:
            raise ValueError("TruncationEval needs a LightningDataModule with a test_dataloader")
        datamodule.setup("test")
        loader = datamodule.test_dataloader()
        patterns = self._patterns(trainer)
        names = _target_module_names(pl_module, patterns)
        full = _params_of(pl_module, names)
        rows = []
        for rho in self.keep_fractions:
            model = truncate(module_copy(pl_module).eval(), rho, patterns)
            correct = total = 0
            for i, (x, y) in enumerate(loader):
                if trainer.fast_dev_run and i >= 1:  # smoke runs: one batch per keep fraction
                    break
                x, y = x.to(pl_module.device), y.to(pl_module.device)
                correct += int((model(x).argmax(-1) == y).sum())
                total += len(y)
            kept = _params_of(model, names) / full
            rows.append({"keep_fraction": rho, "kept_params": kept, "acc": correct / total})
        self.results = rows
        if trainer.is_global_zero:
            self._report(trainer, rows)
        return rows

    @staticmethod
    def _report(trainer: Trainer, rows: list[dict[str, float]]) -> None:
        for logger in trainer.loggers:
            logger.log_metrics({f"trunc/acc@{r['keep_fraction']:g}": r["acc"] for r in rows}, step=trainer.global_step)
        if may_write(trainer):
            save_rows(trainer, rows, "truncation.csv")
            log_image(trainer, "trunc/plot", _plot(rows, artifact_path(trainer, "truncation.png")))
        print("keep_fraction  kept_params  test_acc")
        for r in rows:
            print(f"{r['keep_fraction']:13.2f}  {r['kept_params']:11.3f}  {r['acc']:.4f}")


def _plot(rows: list[dict[str, float]], path: str) -> str:
    return plot_truncation({"": rows}, path)


def plot_truncation(series: dict[str, list[dict[str, float]]], path: str) -> str:
    """Accuracy vs kept parameters, one line per series (rows as in ``truncation.csv``)."""
    fig, ax = new_figure(figsize=(4.5, 3.2))
    for label, rows in series.items():
        ax.plot([r["kept_params"] for r in rows], [r["acc"] for r in rows], "o-", label=label or None)
    ax.set_xlabel("kept parameters of the targets")
    ax.set_ylabel("test accuracy")
    ax.invert_xaxis()
    ax.set_title("Accuracy after truncating the targets' SVD", fontsize=9)
    ax.grid(alpha=0.3)
    if any(series):
        ax.legend()
    return save_figure(fig, path)


def compare(experiment_dirs: Sequence[str], out: str | None = None) -> str:
    """Average ``truncation.csv`` over the runs (seeds) of each experiment (and swept value); markdown table (+ plot).

    ``lowrank summarize q3r runs/q3r/mlp_digits runs/q3r/mlp_digits_adamw --out cmp.png``
    """
    series: dict[str, list[dict[str, float]]] = {}
    counts: dict[str, int] = {}
    found = read_runs(experiment_dirs, "truncation.csv", required=False)
    if not found:
        raise FileNotFoundError(f"compare: no run with a truncation.csv under {', '.join(experiment_dirs)} "
                                "(debug runs left out)")
    # one column per experiment (and per swept value within one), never pooled across: a folder holding both the
    # Q3R and the AdamW experiment gives two columns
    for label, members in group_runs(found, strip="q3r/").items():
        runs = [run.rows("truncation.csv") for run in members]
        series[label] = [
            {k: sum(float(r[i][k]) for r in runs) / len(runs) for k in ("keep_fraction", "kept_params", "acc")}
            for i in range(len(runs[0]))
        ]
        counts[label] = len(runs)
    rhos = [r["keep_fraction"] for r in next(iter(series.values()))]
    header = ["keep fraction", *(f"{k} (n={counts[k]})" for k in series)]
    rows = [[f"{rho:g}", *(f"{series[k][i]['acc']:.4f}" for k in series)] for i, rho in enumerate(rhos)]
    if out:
        plot_truncation(series, out)
    return markdown_table(header, rows)


def bench(ctx: Any) -> list[Any]:
    """Training-step time of Q3R + Adam against AdamW on the ViT-Tiny digits configs (``lowrank bench q3r``)."""
    from lowrank_lit.bench import ConfigBench

    name = ctx.size("vit_tiny_digits", "mlp_digits")  # quick: the MLP (the ViT's data setup takes a minute)
    return [*_spectral_bench(ctx), ConfigBench("q3r", f"Q3R + Adam training step ({name}, period 5)", "AdamW step",
                        f"configs/q3r/{name}.yaml", f"configs/q3r/{name}_adamw.yaml",
                        "paper: a small overhead over AdamW; our target <= 1.15x", 1.15, steps=20, quick_steps=6)]


def _spectral_bench(ctx: Any) -> list[Any]:
    """The cost of watching a run's effective ranks (``SpectralDiagnostics``, every 100 steps by default) on the
    ViT-Tiny digits model: the SVDs of one measurement amortised over 100 AdamW training steps."""
    import statistics

    import torch.nn.functional as F

    from lowrank_lit.bench import BenchRow
    from lowrank_lit.callbacks.spectral import SpectralDiagnostics
    from lowrank_lit.models.vit import vit_tiny

    torch.manual_seed(0)
    model = vit_tiny(num_classes=10, img_size=ctx.size(32, 16), patch_size=4, in_chans=3).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(32, 3, ctx.size(32, 16), ctx.size(32, 16), device=ctx.device)
    y = torch.randint(0, 10, (32,), device=ctx.device)
    diag = SpectralDiagnostics()

    def step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    times = ctx.compare({"step": step, "measure": lambda: diag.measure(model)}, ctx.rounds(10, 3), warmup=1)
    period = diag.every_n_steps
    ratios = [1 + m / (period * s) for s, m in zip(times["step"], times["measure"], strict=True)]
    n = len(diag.matrices(model))
    return [BenchRow("q3r", f"AdamW step + SpectralDiagnostics (every {period} steps, amortised)", "AdamW step",
                     statistics.median(ratios), (min(ratios), max(ratios)), "our target <= 1.1x (any run can watch "
                     "its effective ranks)", 1.1, note=f"ViT-Tiny, {n} matrices: one measurement "
                     f"{1e3 * statistics.median(times['measure']):.1f} ms, one step "
                     f"{1e3 * statistics.median(times['step']):.1f} ms", device=ctx.device)]
