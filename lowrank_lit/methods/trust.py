"""TRUST: test-time refinement of VMamba with uncertainty-guided SSM traversals and weight averaging.

Dastani, Bahri, Vargas Hakim, Yazdanpanah, Noori, Osowiechi, Barbeau, Ben Ayed, Lombaert, Desrosiers,
NeurIPS 2025 (arXiv 2509.22813). Official code: github.com/Sahardastani/trust.

VMamba's SS2D scans a feature map in four directions, each with its own selective-scan parameter group
(:mod:`lowrank_lit.models.vmamba`). A *traversal permutation* ``pi`` re-assigns group ``k`` to direction
``pi(k)``, which gives several causal views of one image. Per test batch (online, non-episodic inside a
domain; reset to the source weights and a fresh Adam at each new domain with
``TTAModule(reset_each_domain=True)``):

1. for each of the K traversals in order (``mode="sequential"``): set ``pi_k``; pseudo-label
   ``y_hat = argmax`` of an eval-mode, no-grad forward; cross-entropy of a train-mode forward against
   ``y_hat``; ``steps`` Adam steps; snapshot ``theta_k``. Weights carry over from k to k+1. ``"parallel"``
   follows the official code: after each traversal the weights and the Adam state go back to the source
   state (the domain's start), so the first traversal of a batch continues from the previous batch's merged
   weights (with a fresh Adam state) and the other K-1 start from the source; ``"parallel_batch"`` instead starts every traversal from
   the weights and Adam state this batch started from (adaptation accumulates across batches);
2. ``theta = mean_k theta_k`` (``merge="mean"``) or SLERP with inverse-entropy weights (``"slerp"``, the
   official ``multi_slerp_state_dict``): ``c_k = (1/H_k) / sum_j (1/H_j)`` with ``H_k`` the mean prediction
   entropy of traversal k's first train-mode forward; ``theta <- theta_1``, then for k = 2..K
   ``theta <- slerp(theta, theta_k, c_k)`` with ONE angle for all tensors, ``Omega = arccos(mean over tensors of
   cos(theta_t, theta_k,t))``, and linear interpolation when ``Omega = 0``. The official code averages the
   cosine over every parameter of the network (frozen ones included, cosine 1) and applies the two SLERP
   coefficients to the frozen tensors too, which rescales them by ``(sin((1-c)Omega) + sin(c Omega)) / sin Omega``;
   here the angle and the interpolation cover the adapted tensors only, so frozen weights stay as trained.
   ``"slerp_per_tensor"`` is the earlier form: one angle per tensor and cumulative weights
   ``w_k / sum_{j<=k} w_j``. Load the merge and keep the Adam state of the last step;
3. predict the batch in eval mode with the default traversal ``abcd`` (the prediction is therefore
   post-adaptation, unlike Tent's).

Trainable set: the affine parameters of every BatchNorm (batch statistics, running statistics removed) or
GroupNorm layer, and every SS2D parameter except ``out_norm`` (in_proj, conv2d, x_proj, dt_proj weight and
bias, A_log, D, out_proj); the rest is frozen.

Traversals: ``"ranked"`` ranks the 24 permutations by the source model's mean prediction entropy on the
first batch of each domain (:func:`rank_traversals`) and keeps the K lowest -- the paper ranks offline on
target data; ranking on the first batch keeps the method online (pass an offline ranking as a list to
reproduce the paper's protocol exactly). ``"paper"`` uses the six of the official code (0123, 1023, 0132,
3120, 1032, 0321, in the order of their ImageNet-C entropies), the first K of them.

TRUST-naive (:class:`TrustNaive`) is the same loss and parameters with one traversal; Tent on the same
backbone is ``lowrank_lit.tta.Tent(norms="batchnorm")``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.models.vmamba import PERMUTATIONS, SS2D, check_permutation, set_traversal
from lowrank_lit.registry import register_method
from lowrank_lit.report import Run, markdown_table, new_figure, read_runs, save_figure
from lowrank_lit.tta.base import TTAMethod, entropy

__all__ = ["PAPER_TRAVERSALS", "trust_params", "traversal_entropies", "rank_traversals", "merge_mean", "merge_slerp",
           "merge_slerp_per_tensor",
           "TRUST", "TrustNaive", "summary"]

PAPER = "TRUST: Test-Time Refinement using Uncertainty-Guided SSM Traverses"
MODES = ("sequential", "parallel", "parallel_batch")
MERGES = ("mean", "slerp", "slerp_per_tensor")
IDENTITY = (0, 1, 2, 3)

#: the official code's six traversals (abcd, bacd, abdc, dbca, badc, adcb), by ImageNet-C mean entropy
#: (4.06, 4.47, 4.53, 4.53, 4.72, 5.00)
PAPER_TRAVERSALS: tuple[tuple[int, ...], ...] = ((0, 1, 2, 3), (1, 0, 2, 3), (0, 1, 3, 2), (3, 1, 2, 0), (1, 0, 3, 2), (0, 3, 2, 1))


def _ss2d_modules(model: nn.Module, where: str) -> list[SS2D]:
    mods = [m for m in model.modules() if isinstance(m, SS2D)]
    if not mods:
        raise ValueError(f"{where}: {type(model).__name__} has no SS2D module (TRUST needs a VMamba backbone, "
                         "e.g. lowrank_lit.models.vmamba.TinyVMamba)")
    return mods


def trust_params(model: nn.Module) -> list[nn.Parameter]:
    """TRUST's trainable set: BatchNorm/GroupNorm affine parameters + every SS2D parameter except ``out_norm``."""
    mods = _ss2d_modules(model, "trust_params")
    norms = [p for m in model.modules() if isinstance(m, (nn.modules.batchnorm._BatchNorm, nn.GroupNorm))
             for p in (m.weight, m.bias) if p is not None]
    return norms + [p for m in mods for p in m.adaptable_parameters()]


def _current_traversal(model: nn.Module) -> tuple[int, ...]:
    return tuple(int(v) for v in _ss2d_modules(model, "traversal")[0].perm.tolist())


def traversal_entropies(model: nn.Module, batches: Iterable[Any],
                        permutations: Sequence[Sequence[int]] = PERMUTATIONS) -> list[tuple[tuple[int, ...], float]]:
    """Mean prediction entropy of ``model`` (eval mode, no grad) under each permutation, over ``batches``
    (tensors or ``(x, ...)`` tuples); the model's traversal and mode are restored afterwards."""
    perms = [check_permutation(p, "traversal_entropies") for p in permutations]
    before, was_training = _current_traversal(model), model.training
    xs = [b[0] if isinstance(b, (tuple, list)) else b for b in batches]
    if not xs:
        raise ValueError("traversal_entropies: batches is empty")
    out = []
    model.eval()
    try:
        with torch.no_grad():
            for p in perms:
                set_traversal(model, p)
                total = sum(float(entropy(model(x)).sum()) for x in xs)
                out.append((p, total / sum(len(x) for x in xs)))
    finally:
        set_traversal(model, before)
        model.train(was_training)
    return out


def _by_entropy(ents: list[tuple[tuple[int, ...], float]]) -> list[tuple[tuple[int, ...], float]]:
    """Lowest entropy first; entropies equal to 1e-6 are ordered by the permutation (lexicographic)."""
    return sorted(ents, key=lambda pe: (round(pe[1], 6), pe[0]))


def rank_traversals(model: nn.Module, loader: Iterable[Any], k: int) -> list[tuple[tuple[int, ...], float]]:
    """The ``k`` traversals of lowest mean prediction entropy on ``loader``, as ``(perm, entropy)`` sorted by
    entropy; ties (entropies equal to 1e-6) are broken by the permutation's lexicographic order.

    Raises:
        ValueError: ``k`` outside 1..24, or a model without SS2D modules.
    """
    if not isinstance(k, int) or not 1 <= k <= len(PERMUTATIONS):
        raise ValueError(f"rank_traversals: k={k!r}; allowed: an integer in 1..24")
    _ss2d_modules(model, "rank_traversals")
    ents = traversal_entropies(model, loader)
    return _by_entropy(ents)[:k]


def merge_mean(snapshots: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """Uniform average of parameter snapshots (each a list of tensors in the same order), as a running mean
    ``m_k = m_{k-1} + (theta_k - m_{k-1}) / k`` so that identical snapshots average to themselves exactly."""
    acc = [t.clone() for t in snapshots[0]]
    for k, snap in enumerate(snapshots[1:], start=2):
        for a, t in zip(acc, snap, strict=True):
            a.add_((t - a) / k)
    return acc


def _slerp(a: torch.Tensor, b: torch.Tensor, t: float, eps: float = 1e-7) -> torch.Tensor:
    va, vb = a.flatten(), b.flatten()
    cos = (va @ vb) / (va.norm() * vb.norm()).clamp_min(eps)
    omega = torch.arccos(cos.clamp(-1.0, 1.0))
    s = torch.sin(omega)
    if float(s) < 1e-4:  # (anti)parallel or identical: linear interpolation
        return (1 - t) * a + t * b
    return (torch.sin((1 - t) * omega) / s) * a + (torch.sin(t * omega) / s) * b


def _check_weights(where: str, snapshots: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> None:
    if len(weights) != len(snapshots) or any(not w > 0 for w in weights):
        raise ValueError(f"{where}: {len(weights)} weights for {len(snapshots)} snapshots; allowed: one positive weight each")


def merge_slerp(snapshots: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """The official code's multi-model SLERP: with ``c = weights / sum(weights)``, ``theta <- snapshots[0]`` and
    for k >= 1 ``theta <- slerp(theta, snapshots[k], c_k)``, one angle for all tensors (the arccos of the mean
    per-tensor cosine similarity), linear interpolation when that angle is 0. ``c_0`` is not used."""
    _check_weights("merge_slerp", snapshots, weights)
    total = float(sum(weights))
    acc = [t.clone() for t in snapshots[0]]
    for snap, w in zip(snapshots[1:], weights[1:], strict=True):
        c = float(w) / total
        cos = torch.stack([(a.flatten().double() @ b.flatten().double()) / (a.norm().double() * b.norm().double() + 1e-8)
                           for a, b in zip(acc, snap, strict=True)]).mean()
        omega = torch.arccos(cos.clamp(-1.0, 1.0))
        if float(omega) == 0.0:
            acc = [(1 - c) * a + c * b for a, b in zip(acc, snap, strict=True)]
            continue
        s = torch.sin(omega)
        ca, cb = float(torch.sin((1 - c) * omega) / s), float(torch.sin(c * omega) / s)
        acc = [ca * a + cb * b for a, b in zip(acc, snap, strict=True)]
    return acc


def merge_slerp_per_tensor(snapshots: Sequence[Sequence[torch.Tensor]], weights: Sequence[float]) -> list[torch.Tensor]:
    """Weighted spherical interpolation per tensor: ``theta <- slerp(theta, theta_k, w_k / sum_{j<=k} w_j)``,
    each tensor with its own angle (the equal-share running form; ``merge="slerp_per_tensor"``)."""
    _check_weights("merge_slerp_per_tensor", snapshots, weights)
    acc, total = [t.clone() for t in snapshots[0]], float(weights[0])
    for snap, w in zip(snapshots[1:], weights[1:], strict=True):
        total += float(w)
        acc = [_slerp(a, b, float(w) / total) for a, b in zip(acc, snap, strict=True)]
    return acc


def _check_lr_steps(where: str, lr: float, steps: int) -> None:
    if not lr > 0:
        raise ValueError(f"{where}: lr={lr!r}; allowed: > 0")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"{where}: steps={steps!r}; allowed: an integer >= 1")


class _PseudoLabelMixin:
    """The pseudo-label step both TRUST and TRUST-naive take under one traversal."""

    model: nn.Module | None
    optimizer: torch.optim.Optimizer | None
    steps: int

    def _pseudo_label_steps(self, x: torch.Tensor, perm: Sequence[int]) -> float:
        """Set ``perm``; label with an eval-mode no-grad forward; ``steps`` CE steps in train mode. Returns the
        mean prediction entropy of the first train-mode forward (the one the official code weights SLERP by)."""
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        set_traversal(self.model, perm)
        self.model.eval()
        with torch.no_grad():
            logits = self.model(x)  # (B, classes)
        y_hat = logits.argmax(dim=1)  # (B,)
        self.model.train()
        ent = None
        with torch.enable_grad():
            for _ in range(self.steps):
                out = self.model(x)  # (B, classes)
                if ent is None:
                    ent = float(entropy(out.detach()).mean())
                loss = F.cross_entropy(out, y_hat)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        assert ent is not None
        return ent

    def _predict_with(self, x: torch.Tensor, perm: Sequence[int]) -> torch.Tensor:
        assert self.model is not None
        set_traversal(self.model, perm)
        self.model.eval()
        with torch.no_grad():
            return self.model(x)


@register_method("trust", kind="TTAMethod", paper=PAPER, summary="summary", bench="bench")
class TRUST(_PseudoLabelMixin, TTAMethod):
    """TRUST test-time adaptation (see the module docstring); run it inside ``lowrank_lit.tta.TTAModule``.

    Args:
        k: traversals used per batch, 1..24. Default: 6.
        lr: Adam learning rate. Default: 1e-4 (the paper's; 1e-3 in the digits experiment).
        steps: Adam steps per traversal. Default: 1.
        mode: ``sequential`` (weights carry over from traversal to traversal), ``parallel`` (the official code:
            after each traversal back to the source weights and a fresh Adam state) or ``parallel_batch`` (each
            traversal starts from the weights and Adam state the batch started from). Default: sequential.
        merge: ``mean`` (uniform weight average), ``slerp`` (the official inverse-entropy weighted SLERP with one
            shared angle) or ``slerp_per_tensor`` (one angle per tensor, cumulative weights). Default: mean.
        traversals: ``ranked`` (the K lowest-entropy permutations on the first batch of each domain), ``paper``
            (the official code's six, first K), or an explicit list of K permutations of 0..3. Default: ranked.
        eval_traversal: the traversal of the final prediction. Default: (0, 1, 2, 3) (abcd).
        betas: Adam's coefficients. Default: (0.9, 0.999).
        batched: in the two parallel modes, run the K traversals as one ``torch.func.vmap``-ed forward and backward
            per step, with K stacked copies of the adapted parameters and one Adam step on the stack (K times the
            activation memory, fewer and larger kernels); the SS2D scans switch to
            :func:`~lowrank_lit.models.vmamba.linear_scan` for it. False: one traversal after another. The results
            agree to float32 rounding (``tests/methods/test_trust.py``). Sequential mode is always one after
            another. Default: True.

    Raises:
        ValueError: on a bad argument (the message names it and the allowed values), or at setup for a model
            without SS2D modules.
    """

    def __init__(self, k: int = 6, lr: LearningRate = 1e-4, steps: int = 1, mode: str = "sequential", merge: str = "mean",
                 traversals: str | list[list[int]] = "ranked", eval_traversal: list[int] | tuple[int, ...] = IDENTITY,
                 betas: tuple[float, float] = (0.9, 0.999), batched: bool = True) -> None:
        super().__init__(lr, betas)
        _check_lr_steps("TRUST", lr, steps)
        if not isinstance(batched, bool):
            raise ValueError(f"TRUST: batched={batched!r}; allowed: true, false")
        self.batched = batched
        if not isinstance(k, int) or not 1 <= k <= len(PERMUTATIONS):
            raise ValueError(f"TRUST: k={k!r}; allowed: an integer in 1..24")
        if mode not in MODES:
            raise ValueError(f"TRUST: mode={mode!r}; allowed: {', '.join(MODES)}")
        if merge not in MERGES:
            raise ValueError(f"TRUST: merge={merge!r}; allowed: {', '.join(MERGES)}")
        self.fixed: list[tuple[int, ...]] | None = None
        if isinstance(traversals, str):
            if traversals not in ("ranked", "paper"):
                raise ValueError(f"TRUST: traversals={traversals!r}; allowed: ranked, paper, or a list of permutations of 0..3")
            if traversals == "paper":
                if k > len(PAPER_TRAVERSALS):
                    raise ValueError(f"TRUST: k={k} with traversals='paper'; allowed: k <= 6 (the official code's six)")
                self.fixed = list(PAPER_TRAVERSALS[:k])
        else:
            perms = [check_permutation(p, "TRUST") for p in traversals]
            if len(perms) != k or len(set(perms)) != k:
                raise ValueError(f"TRUST: traversals has {len(perms)} ({len(set(perms))} distinct) permutations; "
                                 f"allowed: exactly k={k} distinct ones")
            self.fixed = perms
        self.k, self.steps, self.mode, self.merge = k, steps, mode, merge
        self.eval_traversal = check_permutation(eval_traversal, "TRUST")
        self.order: list[tuple[int, ...]] | None = self.fixed
        self.last_entropies: list[float] = []
        self.rankings: list[dict[str, Any]] = []

    def stream_state(self) -> dict[str, Any]:
        """The adapted state and the traversal order chosen for the current domain."""
        return {**super().stream_state(), "order": [list(t) for t in getattr(self, "order", self.fixed)]}

    def load_stream_state(self, state: dict[str, Any]) -> None:
        super().load_stream_state(state)
        self.order = [tuple(int(i) for i in t) for t in state["order"]]

    def select_params(self, model: nn.Module) -> list[nn.Parameter]:
        return trust_params(model)

    def reset(self) -> None:
        super().reset()
        self.order = self.fixed  # a new domain is ranked again

    def _rank(self, x: torch.Tensor) -> list[tuple[int, ...]]:
        assert self.model is not None
        ents = traversal_entropies(self.model, [x])
        ranked = _by_entropy(ents)
        for r, (p, e) in enumerate(ranked):
            self.rankings.append({"domain": self.domain, "rank": r, "perm": "".join(map(str, p)), "entropy": e})
        return [p for p, _ in ranked[: self.k]]

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        """Adapt on ``x`` over the K traversals, merge, and return the merged model's logits ``(B, classes)``."""
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        self._check_batch(x)
        if self.order is None:
            self.order = self._rank(x)
        if self.mode == "parallel":  # the official code: back to the source state after every traversal
            start = getattr(self, "_source_state", None)
            if start is None:  # used outside TTAModule without snapshot_source(): the weights before the first batch
                self.snapshot_source()
                start = self._source_state
        else:
            start = self.get_state() if self.mode == "parallel_batch" else None
        batched = self._batched_traversals(x, start) if start is not None and self.batched else None
        if batched is not None:
            snapshots, ents = batched
        else:
            snapshots, ents = [], []
            for i, perm in enumerate(self.order):
                if start is not None and i > 0:
                    self.set_state(start)  # weights and Adam state of the source (parallel) or of the batch start
                ents.append(self._pseudo_label_steps(x, perm))
                snapshots.append(self.get_params())
        if self.mode == "parallel":
            self.set_state(start)  # the official reset follows the last traversal too; the merge is loaded below
        self.last_entropies = ents
        if self.merge == "mean":
            merged = merge_mean(snapshots)
        else:
            merge = merge_slerp if self.merge == "slerp" else merge_slerp_per_tensor
            merged = merge(snapshots, [1.0 / max(e, 1e-8) for e in ents])
        self.load_params(merged)
        return self._predict_with(x, self.eval_traversal)

    def _batched_traversals(self, x: torch.Tensor, start: dict[str, Any]
                            ) -> tuple[list[list[torch.Tensor]], list[float]] | None:
        """The parallel modes' K traversals at once: what the loop in :meth:`forward_and_adapt` computes, with the
        same starts (traversal 1 from the current weights and Adam state, the others from ``start``). Leaves the
        optimizer as the loop does (the last traversal's Adam state) and returns the K snapshots and entropies;
        None where the K Adam states cannot share one stacked step (different step counts), and the loop runs."""
        from torch.func import functional_call, grad, vmap

        from lowrank_lit.models.vmamba import vmappable_scans

        assert self.model is not None and self.optimizer is not None and self.order is not None
        model, opt, k = self.model, self.optimizer, len(self.order)
        if type(opt) is not torch.optim.Adam or opt.param_groups[0].get("amsgrad"):  # the state stacked below
            return None
        names = {id(p): n for n, p in model.named_parameters()}
        keys = [names[id(p)] for p in self.params]
        rows = [[p.detach() for p in self.params]] + [start["params"]] * (k - 1)  # each traversal's start (stacked below)
        first = opt.state_dict()["state"]
        moments = [first] + [start["optim"]["state"] if start["optim"] else {}] * (k - 1)  # {index: Adam state}
        if any(set(m) != set(first) for m in moments) or any(
                float(m[i]["step"]) != float(first[i]["step"]) for m in moments for i in first):
            return None
        stack = [torch.stack([row[i] for row in rows]).requires_grad_() for i in range(len(keys))]  # (K, ...) each
        group = {key: v for key, v in opt.param_groups[0].items() if key != "params"}
        kopt = torch.optim.Adam(stack, **group)
        for i, t in enumerate(stack):
            if i in first:
                kopt.state[t] = {"step": first[i]["step"].clone(),
                                 "exp_avg": torch.stack([m[i]["exp_avg"] for m in moments]),
                                 "exp_avg_sq": torch.stack([m[i]["exp_avg_sq"] for m in moments])}
        perm_keys = [f"{n}.perm" for n, m in model.named_modules() if isinstance(m, SS2D)]
        perms = torch.tensor(self.order, device=x.device)  # (K, 4)

        def logits(weights: dict[str, torch.Tensor], perm: torch.Tensor) -> torch.Tensor:
            return functional_call(model, {**weights, **dict.fromkeys(perm_keys, perm)}, (x,))  # (B, classes)

        def loss(weights: dict[str, torch.Tensor], perm: torch.Tensor, y: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
            out = logits(weights, perm)
            return F.cross_entropy(out, y), entropy(out.detach()).mean()

        def current() -> dict[str, torch.Tensor]:
            return {key: t.detach() for key, t in zip(keys, stack, strict=True)}

        ents: torch.Tensor | None = None
        with vmappable_scans(model), torch.enable_grad():
            model.eval()
            with torch.no_grad():
                y_hat = vmap(logits)(current(), perms).argmax(-1)  # (K, B)
            model.train()
            step = vmap(grad(loss, has_aux=True))
            for _ in range(self.steps):
                grads, ent = step(current(), perms, y_hat)  # (K, ...) each; (K,)
                ents = ent if ents is None else ents
                for key, t in zip(keys, stack, strict=True):
                    t.grad = grads[key]
                kopt.step()
        assert ents is not None
        with torch.no_grad():  # the loop leaves the last traversal's Adam state in the optimizer
            last = {i: {"step": kopt.state[t]["step"].clone(), "exp_avg": kopt.state[t]["exp_avg"][-1].clone(),
                        "exp_avg_sq": kopt.state[t]["exp_avg_sq"][-1].clone()} for i, t in enumerate(stack)}
            opt.load_state_dict({"state": last, "param_groups": opt.state_dict()["param_groups"]})
        return [[t[j].detach().clone() for t in stack] for j in range(k)], [float(e) for e in ents]

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        self._check_batch(x)
        return self._predict_with(x, self.eval_traversal)

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        return {"trust_traversals.csv": self.rankings} if self.rankings else {}


class TrustNaive(_PseudoLabelMixin, TTAMethod):
    """TRUST-naive: TRUST's pseudo-label loss and parameters under one traversal, no averaging.

    Args:
        lr: Adam learning rate. Default: 1e-4.
        steps: Adam steps per batch. Default: 1.
        traversal: the traversal adapted under. Default: (0, 1, 2, 3).
        eval_traversal: the traversal of the prediction. Default: (0, 1, 2, 3).
        betas: Adam's coefficients. Default: (0.9, 0.999).
    """

    def __init__(self, lr: LearningRate = 1e-4, steps: int = 1, traversal: list[int] | tuple[int, ...] = IDENTITY,
                 eval_traversal: list[int] | tuple[int, ...] = IDENTITY, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        super().__init__(lr, betas)
        _check_lr_steps("TrustNaive", lr, steps)
        self.steps = steps
        self.traversal = check_permutation(traversal, "TrustNaive")
        self.eval_traversal = check_permutation(eval_traversal, "TrustNaive")

    def select_params(self, model: nn.Module) -> list[nn.Parameter]:
        return trust_params(model)

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        self._check_batch(x)
        self._pseudo_label_steps(x, self.traversal)
        return self._predict_with(x, self.eval_traversal)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        self._check_batch(x)
        return self._predict_with(x, self.eval_traversal)


# -- reports ---------------------------------------------------------------------------------------

def _method_label(entry: dict[str, Any]) -> str:
    name = entry["class_path"].rsplit(".", 1)[-1]
    args = entry.get("init_args") or {}
    if name == "TRUST" and (args.get("mode", "sequential") != "sequential" or args.get("merge", "mean") != "mean"):
        return f"TRUST ({args.get('mode', 'sequential')}, {args.get('merge', 'mean')})"
    if name == "SourceOnly":
        return "source" if args.get("batch_stats") is False else "source + test-batch BN statistics"
    return {"TrustNaive": "TRUST-naive"}.get(name, name)


_ORDER = ("source", "source + test-batch BN statistics", "Tent", "TRUST-naive", "TRUST")
_NORM_NAMES = {"bn": "BatchNorm", "ln2d": "LayerNorm", "gn": "GroupNorm"}


def _setting(cfg: dict[str, Any]) -> tuple[tuple[str, int], str]:
    """A run's backbone normalisation and batch size: a sort key and the label of its tables."""
    norm = ((cfg["model"]["init_args"].get("model") or {}).get("init_args") or {}).get("norm", "bn")
    batch = (cfg["data"].get("init_args") or {}).get("batch_size") or 0
    return (norm, -batch), f"{_NORM_NAMES.get(norm, norm)}, batch {batch}"


def _sort_key(row: dict[str, Any]) -> tuple[int, str]:
    m = row["method"]
    return (_ORDER.index(m) if m in _ORDER else len(_ORDER), m)


def summarize(run_dirs: list[str]) -> list[dict[str, Any]]:
    """Method, seed and accuracy per corruption of each TTA run (from ``metrics.csv`` and the saved config)."""

    out = []
    for run in map(Run, run_dirs):
        cfg = run.config
        vals = run.metrics
        accs = {k[len("test/acc_"):]: v for k, v in vals.items() if k.startswith("test/acc_") and k != "test/acc_domains"}
        key, label = _setting(cfg)
        out.append({"method": _method_label(cfg["model"]["init_args"]["method"]), "seed": cfg.get("seed_everything"),
                    "accs": accs, "setting": label, "setting_key": key})
    return sorted(out, key=lambda r: (r["setting_key"], *_sort_key(r)))


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: accuracy per corruption and mean per method (mean over the runs' seeds; seeds counted)."""
    corrs = sorted({c for r in rows for c in r["accs"]})
    by: dict[str, list[dict[str, float]]] = {}
    for r in rows:
        by.setdefault(r["method"], []).append(r["accs"])
    table = []
    for method, runs in by.items():
        per = {c: [a[c] for a in runs if c in a] for c in corrs}
        means = [sum(a.values()) / len(a) for a in runs if a]
        table.append([method, len(runs), *(f"{sum(v) / len(v):.3f}" if v else "-" for v in per.values()),
                      f"{sum(means) / len(means):.3f}"])
    return markdown_table(["method", "runs", *corrs, "mean"], table)


def traversal_spread(run_dirs: list[str]) -> str:
    """Markdown: per corruption, the lowest and highest mean entropy over the 24 traversals (first batch, source
    model; mean over the runs with a ``trust_traversals.csv``), their spread, and how often the default
    traversal ``0123`` was among the K kept."""
    import csv
    import os

    per: dict[str, list[tuple[float, float, bool]]] = {}
    for run in map(Run, run_dirs):
        path = os.path.join(run, "trust_traversals.csv")
        if not os.path.isfile(path):
            continue
        cfg = run.config
        names = cfg["data"]["init_args"].get("corruptions") or []
        k = int((cfg["model"]["init_args"]["method"].get("init_args") or {}).get("k", 6))
        with open(path) as f:
            rows = list(csv.DictReader(f))
        for dom in sorted({int(r["domain"]) for r in rows}):
            ents = sorted((int(r["rank"]), float(r["entropy"]), r["perm"]) for r in rows if int(r["domain"]) == dom)
            name = names[dom] if dom < len(names) else f"d{dom}"
            per.setdefault(name, []).append((min(e for _, e, _ in ents), max(e for _, e, _ in ents),
                                             "0123" in [p for _, _, p in ents[:k]]))
    table = []
    for name, vals in sorted(per.items()):
        lo, hi = (sum(v[i] for v in vals) / len(vals) for i in (0, 1))
        table.append([name, len(vals), f"{lo:.3f}", f"{hi:.3f}", f"{hi - lo:.3f}", f"{sum(v[2] for v in vals)}/{len(vals)}"])
    return markdown_table(["corruption", "runs", "lowest entropy", "highest entropy", "spread", "0123 kept"], table)


def drift_table(run_dirs: list[str]) -> str:
    """Markdown: per setting and method, accuracy and mean prediction entropy over the first and the last third of
    each corruption's batches (``tta_batches.csv``), averaged over corruptions and runs: whether adaptation
    improves along the stream or collapses (entropy falling while accuracy falls)."""
    import csv
    import os

    acc: dict[tuple[tuple[str, int], str, str], dict[str, list[float]]] = {}
    for run in map(Run, run_dirs):
        path = os.path.join(run, "tta_batches.csv")
        if not os.path.isfile(path):
            continue
        cfg = run.config
        key = (*_setting(cfg), _method_label(cfg["model"]["init_args"]["method"]))
        with open(path) as f:
            rows = list(csv.DictReader(f))
        per_dom: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            per_dom.setdefault(r["domain"], []).append((1 - float(r["error"]), float(r["entropy"])))
        cell = acc.setdefault(key, {"a0": [], "a1": [], "e0": [], "e1": []})
        for vals in per_dom.values():
            q = max(1, len(vals) // 3)
            cell["a0"].append(statistics.fmean(a for a, _ in vals[:q]))
            cell["a1"].append(statistics.fmean(a for a, _ in vals[-q:]))
            cell["e0"].append(statistics.fmean(e for _, e in vals[:q]))
            cell["e1"].append(statistics.fmean(e for _, e in vals[-q:]))
    table = []
    for (_, setting, method), c in sorted(acc.items(), key=lambda kv: (kv[0][0], _sort_key({"method": kv[0][2]}))):
        table.append([setting, method, f"{statistics.fmean(c['a0']):.3f}", f"{statistics.fmean(c['a1']):.3f}",
                      f"{statistics.fmean(c['e0']):.3f}", f"{statistics.fmean(c['e1']):.3f}"])
    return markdown_table(["setting", "method", "accuracy, first third", "accuracy, last third", "entropy, first third",
                           "entropy, last third"], table)


def seed_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: accuracy averaged over every corruption run of a method and seed, one column per seed."""
    by: dict[str, dict[Any, list[float]]] = {}
    for r in rows:
        by.setdefault(r["method"], {}).setdefault(r["seed"], []).extend(r["accs"].values())
    seeds = sorted({r["seed"] for r in rows}, key=str)
    table = []
    for method, per in by.items():
        vals = [sum(per[s]) / len(per[s]) if per.get(s) else None for s in seeds]
        got = [v for v in vals if v is not None]
        std = statistics.stdev(got) if len(got) > 1 else 0.0
        table.append([method, *("-" if v is None else f"{v:.3f}" for v in vals), f"{statistics.fmean(got):.3f} ± {std:.3f}"])
    return markdown_table(["method", *(f"seed {s}" for s in seeds), "mean ± std"], table)


def summary(roots: list[str], out: str | None = None) -> str:
    """Accuracy per corruption of TRUST, TRUST-naive, Tent and the source model.

    Accuracy per corruption and method (mean over seeds) of ``lowrank test`` runs, and the traversal-entropy
    spread of the TRUST runs; ``out``: a bar plot."""

    dirs = read_runs(roots, "tta_batches.csv")
    rows = summarize(dirs)
    if out:
        plot_accuracy(rows, out)
    settings = list(dict.fromkeys(r["setting"] for r in rows))
    parts = []
    for setting in settings:
        sub = [r for r in rows if r["setting"] == setting]
        head = f"{setting}:\n\n" if len(settings) > 1 else ""
        parts.append(head + summary_table(sub) + "\n\nMean over the corruptions per seed:\n\n" + seed_table(sub))
    spread = traversal_spread(dirs)
    drift = drift_table(dirs)
    return "\n\n".join(parts) + ("\n\nEntropy over the 24 traversals (source model, first batch):\n\n" + spread
                                  if spread.count("\n") > 1 else "") + \
        ("\n\nAlong each corruption's stream (first vs last third of its batches):\n\n" + drift if drift.count("\n") > 1 else "")


def plot_accuracy(rows: list[dict[str, Any]], out: str) -> str:
    """Grouped bars: mean accuracy per corruption, one bar per method."""

    corrs = sorted({c for r in rows for c in r["accs"]})
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = new_figure(figsize=(9.5, 4))
    width = 0.8 / max(len(methods), 1)
    for i, m in enumerate(methods):
        runs = [r["accs"] for r in rows if r["method"] == m]
        vals = [statistics.fmean(a[c] for a in runs if c in a) if any(c in a for a in runs) else math.nan for c in corrs]
        ax.bar([j + i * width for j in range(len(corrs))], vals, width, label=m)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(corrs))], corrs, rotation=20, fontsize=8)
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1)
    ax.set_title("Test-time adaptation: accuracy per corruption (mean over runs)", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, out)


def bench(ctx: Any) -> list[Any]:
    """Time per test batch of TRUST against Tent, and of its parallel mode against its sequential one, on the
    digits-C TinyVMamba (random source weights: the cost does not depend on them) (``lowrank bench trust``)."""
    import torch.nn.functional as F

    from lowrank_lit.bench import ConfigBench, ratio_row
    from lowrank_lit.models.vmamba import selective_scan

    def scan(inputs: tuple[torch.Tensor, ...], parallel: bool) -> None:
        leaves = [t.detach().requires_grad_() for t in inputs]
        selective_scan(*leaves, parallel=parallel).sum().backward()

    rows: list[Any] = []
    for length in ctx.size((16, 64, 256), (16,)):  # the scan length L
        g = torch.Generator().manual_seed(length)
        x = (torch.randn(64, length, 32, generator=g), F.softplus(torch.randn(64, length, 32, generator=g)),
             -torch.exp(torch.randn(32, 4, generator=g)), torch.randn(64, length, 4, generator=g),
             torch.randn(64, length, 4, generator=g), torch.randn(32, generator=g))
        x = tuple(t.to(ctx.device) for t in x)  # u, delta (B, L, C); A (C, N); B, C (B, L, N); D (C)
        times = ctx.compare({"ours": lambda x=x: scan(x, False), "mambapy": lambda x=x: scan(x, True)},
                            ctx.rounds(10, 3), warmup=1)
        rows.append(ratio_row(ctx, "trust", f"our selective scan (linear_scan), forward + backward (L = {length})",
                              "mambapy's parallel scan (pscan, the SS2D default)", times, "ours", "mambapy",
                              "peer library: same output and gradients to 1e-5 (tests/test_vmamba.py); reported",
                              note="batch 64, d 32, N 4; ours runs under torch.func.vmap (TRUST's batched parallel mode)"))
    none = ("--model.init_args.source_ckpt=null",)
    return [*rows,
            ConfigBench("trust", "TRUST K = 6 per test batch (sequential)", "Tent per batch",
                        "configs/trust/digits_c_trust.yaml", "configs/trust/digits_c_tent.yaml",
                        "paper: K forward/backward passes per batch (~K x Tent)", 6.0, overrides=none, verb="test",
                        steps=8, quick_steps=3),
            ConfigBench("trust", "TRUST K = 6 parallel mode per test batch", "TRUST sequential per batch",
                        "configs/trust/digits_c_trust.yaml", "configs/trust/digits_c_trust.yaml",
                        "paper: parallel costs memory, not time; our target <= 0.75x (K traversals in one vmap)", 0.75,
                        overrides=none,
                        method_overrides=("--model.init_args.method.init_args.mode=parallel",), verb="test", steps=8,
                        quick_steps=3)]
