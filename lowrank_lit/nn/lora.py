"""LoRA adapters for any ``nn.Linear``: plain LoRA, asymmetric MoE-LoRA (HydraLoRA-style), injection by name.

* :class:`LoRALinear` -- ``h = W0 x + (alpha / r) B A x`` with ``A (r, d_in)`` Kaiming-uniform and ``B (d_out, r)``
  zero, so the adapted layer starts as the base layer (the same initialisation and scaling as HF ``peft``'s
  LoRA; tested to give ``peft``'s output on the same weights). ``merge()`` folds ``B A`` into ``W0``.
* :class:`AsymmetricLoRALinear` -- one shared down-projection A, N up-projection experts ``B_i`` and a per-token
  softmax router: ``h = W0 x + (alpha / r) sum_i w_i(x) B_i A x``. Some experts may be marked *poison* (LoPE's
  B_D): the ``mode`` decides how they take part (see the class). With one expert and no poison expert it is
  exactly :class:`LoRALinear`.
* :func:`inject_adapters` -- replace every ``nn.Linear`` whose name matches the patterns (the shared
  :mod:`lowrank_lit.nn.targets` path) by an adapter built from it; :func:`mark_only_adapters_trainable`
  freezes everything else (adapter parameters start with ``lora_``).
* :func:`dycompensate` -- redistribute the routing weight of masked (poison) experts to the K normal experts
  whose outputs are most similar to the poison expert's (LoPE's DyCompEnSate).

Shapes: ``x (..., d_in)``; routing weights ``(..., N)``; expert outputs ``(..., N, d_out)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.nn.export import ExportRefused, PeftExport
from lowrank_lit.nn.targets import match_modules, replace_module

__all__ = [
    "LoRALinear", "AsymmetricLoRALinear", "inject_adapters", "mark_only_adapters_trainable", "dycompensate",
    "ROUTER_INPUTS", "MODES", "is_linear_like",
]

ROUTER_INPUTS = ("lowrank", "input")
#: How an :class:`AsymmetricLoRALinear` combines its experts (see the class docstring).
MODES = ("route", "poison_only", "mask")


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def is_linear_like(module: nn.Module) -> bool:
    """An ``nn.Linear``, or a layer that computes one from a stored form (a quantized layer such as ``GLVQLinear``:
    integer ``in_features`` / ``out_features`` and ``(..., in) -> (..., out)``), which an adapter can wrap."""
    return isinstance(module, nn.Linear) or (isinstance(getattr(module, "in_features", None), int)
                                             and isinstance(getattr(module, "out_features", None), int)
                                             and not isinstance(module, (LoRALinear, AsymmetricLoRALinear)))


class LoRALinear(nn.Module):
    """``W0 x + (alpha / r) B A x`` around a frozen ``nn.Linear`` (or a Linear-like quantized layer, see
    :func:`is_linear_like`: its codes stay frozen, the adapter trains in float on top; ``merge`` needs a float
    ``nn.Linear``, a quantized base is merged by dequantizing and quantizing again, e.g.
    :func:`lowrank_lit.studies.compress_adapt_merge.merge_requantize`).

    Args:
        base: the layer to adapt (its parameters are frozen).
        r: rank, ``1 <= r <= min(d_in, d_out)``. Default: 8.
        alpha: scaling numerator (scaling = alpha / r). Default: 16.0.
        dropout: dropout on the adapter's input. Default: 0.0.
    """

    def __init__(self, base: nn.Linear, r: int = 8, alpha: float = 16.0, dropout: float = 0.0) -> None:
        super().__init__()
        _check(is_linear_like(base), f"LoRALinear: base is a {type(base).__name__}; allowed: nn.Linear or a "
               "Linear-like quantized layer (in_features, out_features)")
        _check(1 <= r <= min(base.in_features, base.out_features),
               f"LoRALinear: r={r}; allowed: 1 <= r <= min(in, out) = {min(base.in_features, base.out_features)}")
        self.base, self.r, self.scaling = base, r, alpha / r
        base.requires_grad_(False)
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))  # (r, d_in)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, r))  # (d_out, r)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.merged = False

    def delta_weight(self) -> torch.Tensor:
        return self.scaling * self.lora_B @ self.lora_A  # (d_out, d_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.merged:
            return out
        return out + self.scaling * F.linear(F.linear(self.lora_dropout(x), self.lora_A), self.lora_B)

    @torch.no_grad()
    def merge(self) -> None:
        """Fold ``(alpha / r) B A`` into the base weight (inference; no extra matmuls)."""
        if not isinstance(self.base, nn.Linear):
            raise ValueError(f"LoRALinear.merge: the base is a {type(self.base).__name__}, which has no float weight "
                             "to fold into; dequantize, add delta_weight() and quantize again (glvq.merge_requantize)")
        if not self.merged:
            self.base.weight += self.delta_weight().to(self.base.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self) -> None:
        if self.merged:
            self.base.weight -= self.delta_weight().to(self.base.weight.dtype)
            self.merged = False

    def unwrap(self, merge: bool) -> nn.Module:
        """The base layer, with ``(alpha / r) B A`` folded in when ``merge`` (:mod:`lowrank_lit.nn.export`)."""
        if merge:
            self.merge()
        return self.base

    def to_peft(self) -> PeftExport:
        """peft's ``LORA``: rank, alpha and dropout, and the two factors (:mod:`lowrank_lit.nn.export`)."""
        return PeftExport("LORA", {"r": self.r, "lora_alpha": round(self.scaling * self.r, 9),
                                   "lora_dropout": float(getattr(self.lora_dropout, "p", 0.0))},
                          {"lora_A.weight": self.lora_A.detach(), "lora_B.weight": self.lora_B.detach()})


class AsymmetricLoRALinear(nn.Module):
    """Shared A, N experts ``B_i`` and a per-token router around a frozen ``nn.Linear``.

    ``h = W0 x + (alpha / r) sum_i w_i(x) B_i A x`` with ``w = softmax(W_gate u)``, ``u = A x`` (``router_in=
    "lowrank"``, LoPE's ``W_gate in R^{r x N}``) or ``u = x`` (``"input"``, HydraLoRA). The last ``n_poison`` experts
    are poison experts. ``mode``:

    * ``route`` -- every expert, router weights (training; LoPE's stage II keeps B_D in the forward pass);
    * ``poison_only`` -- only the poison experts, weight ``poison_weight`` (1: LoPE's stage I) shared among them, no
      router;
    * ``mask`` -- inference: poison experts masked, their weight handed to the ``compensate_k`` normal experts
      most similar to them, scaled by ``compensate_beta`` (:func:`dycompensate`; ``compensate_k=0`` is plain
      masking).

    Args:
        base: the layer to adapt (frozen).
        r: rank of A. Default: 4.
        n_experts: normal experts (B's). Default: 3.
        n_poison: poison experts. Default: 1.
        router_in: ``lowrank`` (route on ``A x``) or ``input`` (route on ``x``). Default: lowrank.
        alpha: scaling numerator (``alpha / r``). Default: 8.0.
        compensate_k: K of the inference compensation; None: every normal expert. Default: None.
        compensate_beta: beta of the inference compensation. Default: 1.0.
    """

    def __init__(self, base: nn.Linear, r: int = 4, n_experts: int = 3, n_poison: int = 1, router_in: str = "lowrank",
                 alpha: float = 8.0, compensate_k: int | None = None, compensate_beta: float = 1.0) -> None:
        super().__init__()
        _check(is_linear_like(base), f"AsymmetricLoRALinear: base is a {type(base).__name__}; allowed: nn.Linear or a "
               "Linear-like quantized layer (in_features, out_features)")
        _check(1 <= r <= min(base.in_features, base.out_features),
               f"AsymmetricLoRALinear: r={r}; allowed: 1 <= r <= min(in, out) = {min(base.in_features, base.out_features)}")
        _check(n_experts >= 1, f"AsymmetricLoRALinear: n_experts={n_experts}; allowed: an integer >= 1")
        _check(0 <= n_poison < n_experts,
               f"AsymmetricLoRALinear: n_poison={n_poison}; allowed: 0 <= n_poison < n_experts = {n_experts}")
        _check(router_in in ROUTER_INPUTS, f"AsymmetricLoRALinear: router_in={router_in!r}; allowed: {', '.join(ROUTER_INPUTS)}")
        compensate_k = n_experts if compensate_k is None else compensate_k
        _check(0 <= compensate_k <= n_experts,
               f"AsymmetricLoRALinear: compensate_k={compensate_k}; allowed: 0 <= compensate_k <= n_experts = {n_experts}")
        _check(compensate_beta > 0, f"AsymmetricLoRALinear: compensate_beta={compensate_beta}; allowed: a float > 0")
        self.base, self.r, self.scaling = base, r, alpha / r
        self.n_experts, self.n_poison, self.router_in = n_experts, n_poison, router_in
        self.compensate_k, self.compensate_beta = compensate_k, compensate_beta
        base.requires_grad_(False)
        total = n_experts + n_poison
        self.lora_A = nn.Parameter(torch.empty(r, base.in_features))  # (r, d_in)
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        # one Parameter per expert, so one expert can be frozen bit-exactly while the others train; poison last
        self.lora_B = nn.ParameterList([nn.Parameter(torch.zeros(base.out_features, r)) for _ in range(total)])
        self.lora_router = nn.Linear(r if router_in == "lowrank" else base.in_features, total, bias=False)
        self.mode = "route"
        self.poison_weight = 1.0  # the poison experts' total weight in ``poison_only`` mode
        self.last_weights: torch.Tensor | None = None

    #: why neither peft nor a merged weight can express this layer (:mod:`lowrank_lit.nn.export`)
    export_refusal = "HydraLoRA / LoPE experts with a per-token router"

    def _refused(self) -> ExportRefused:
        return ExportRefused(f"an {type(self).__name__} ({self.export_refusal}): neither peft nor a merged weight can "
                             "express it")

    def unwrap(self, merge: bool) -> nn.Module:
        raise self._refused()

    def to_peft(self) -> PeftExport:
        raise self._refused()

    @property
    def poison_index(self) -> list[int]:
        return list(range(self.n_experts, self.n_experts + self.n_poison))

    def set_mode(self, mode: str) -> None:
        _check(mode in MODES, f"AsymmetricLoRALinear: mode={mode!r}; allowed: {', '.join(MODES)}")
        _check(mode == "route" or self.n_poison > 0, f"AsymmetricLoRALinear: mode={mode!r} needs n_poison >= 1")
        self.mode = mode

    def routing(self, x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """``(..., N)`` softmax router weights (every expert, poison included)."""
        if self.n_experts + self.n_poison == 1:
            return u.new_ones(*u.shape[:-1], 1)
        return self.lora_router(u if self.router_in == "lowrank" else x).softmax(dim=-1)

    def merge(self) -> None:
        """Refused: per-token routing gives every token its own ``sum_i w_i B_i``, so no single weight exists."""
        raise ValueError("AsymmetricLoRALinear: merge() is not possible with per-token routing (each token mixes the "
                         "experts with its own weights); merge only a fixed-routing LoRALinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = F.linear(x, self.lora_A)  # (..., r)
        experts = torch.einsum("...r,nor->...no", u, torch.stack(list(self.lora_B)))  # (..., N, d_out)
        if self.mode == "poison_only":
            w = u.new_zeros(*u.shape[:-1], self.n_experts + self.n_poison)
            w[..., self.poison_index] = self.poison_weight / self.n_poison
        else:
            w = self.routing(x, u)
            if self.mode == "mask":
                w = dycompensate(w, experts, self.poison_index, self.compensate_k, self.compensate_beta)
        self.last_weights = w.detach()
        return self.base(x) + self.scaling * torch.einsum("...n,...no->...o", w, experts)


def dycompensate(weights: torch.Tensor, expert_outputs: torch.Tensor, poison_idx: Sequence[int], k: int,
                 beta: float = 1.0) -> torch.Tensor:
    """Mask the poison experts and hand their weight to the K normal experts most similar to them.

    ``theta_i = cos(out_i, out_D)`` per token; among the normal experts the K largest get
    ``w_i + beta * w_D * theta_i^+ / sum_topK theta_j^+`` (an even split when every ``theta^+`` is 0); ``w_D = 0``.
    With several poison experts their weights and outputs are pooled (sum of weights, weighted mean output).

    Args:
        weights: ``(..., N)`` routing weights.
        expert_outputs: ``(..., N, d_out)`` outputs ``B_i A x`` of every expert.
        poison_idx: indices of the poison experts.
        k: experts that receive weight (0: plain masking). beta: share of the poison weight handed over.

    Returns:
        ``(..., N)`` weights with zeros at ``poison_idx``.
    """
    n = weights.shape[-1]
    poison = torch.zeros(n, dtype=torch.bool, device=weights.device)
    poison[list(poison_idx)] = True
    normal = (~poison).nonzero().flatten()
    if not 0 <= k <= len(normal):
        raise ValueError(f"dycompensate: k={k}; allowed: 0 <= k <= {len(normal)} (the normal experts)")
    w_d = weights[..., poison].sum(dim=-1, keepdim=True)  # (..., 1)
    out = weights.masked_fill(poison, 0.0)
    if k == 0 or not bool(poison.any()):
        return out
    pw = weights[..., poison].unsqueeze(-1)  # (..., P, 1)
    d = (pw * expert_outputs[..., poison, :]).sum(-2) / pw.sum(-2).clamp_min(1e-12)  # (..., d_out)
    theta = F.cosine_similarity(expert_outputs[..., normal, :], d.unsqueeze(-2), dim=-1)  # (..., n_normal)
    top = theta.topk(k, dim=-1)
    pos = top.values.clamp_min(0.0)  # (..., k)
    total = pos.sum(-1, keepdim=True)
    # no positive similarity among the top K: split evenly (inferred), so beta = 1 still keeps sum(w) = 1
    share = torch.where(total > 0, pos / total.clamp_min(1e-12), torch.full_like(pos, 1.0 / k))  # (..., k)
    add = torch.zeros_like(theta).scatter(-1, top.indices, beta * w_d * share)  # (..., n_normal)
    return out.index_add(out.ndim - 1, normal, add)


def inject_adapters(model: nn.Module, targets: Sequence[str], factory: Callable[[nn.Linear], nn.Module],
                    owner: str = "inject_adapters") -> list[str]:
    """Replace every ``nn.Linear`` (or Linear-like quantized layer) of ``model`` whose name matches ``targets`` by
    ``factory(linear)``.

    Patterns follow :func:`lowrank_lit.nn.targets.match_modules` (``"*.query"``, ``"encoder.layer.*.attention.self.value"``).

    Returns:
        the names of the replaced modules.

    Raises:
        ValueError: a pattern matches nothing, or matches a module that is not an ``nn.Linear``.
    """
    names = []
    for m in match_modules(model, targets, owner=owner):
        if isinstance(m.module, (LoRALinear, AsymmetricLoRALinear)):
            continue  # already adapted (two patterns, one layer)
        if not is_linear_like(m.module):
            raise ValueError(f"{owner}: {m.name!r} is a {type(m.module).__name__}; adapters wrap nn.Linear layers "
                             "(and Linear-like quantized layers) only")
        replace_module(model, m.name, factory(m.module))
        names.append(m.name)
    return names


def mark_only_adapters_trainable(model: nn.Module, prefix: str = "lora_", also: Sequence[str] = ()) -> int:
    """Freeze every parameter whose own name does not start with ``prefix`` (plus names containing ``also``).

    Returns:
        the number of trainable parameters left.
    """
    total = 0
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        keep = leaf.startswith(prefix) or ".lora_" in name or any(a in name for a in also)
        p.requires_grad_(keep)
        total += p.numel() if keep else 0
    return total
