"""Soft-prompt modules for frozen transformers: input prompts, routed prompts, deep prompts, capsules.

Every prompt here is a small ``nn.Module`` whose parameters start with ``prompt_`` (so adapter-only
saving and freezing is one name filter) and that a frozen backbone consumes through
:class:`lowrank_lit.models.text.PromptedBackbone`. Two hooks describe a prompt:

* ``input_prompt(embeds, mask) -> (b, n, H)``: the ``n = n_tokens`` vectors placed in front of the word
  embeddings before the backbone's embedding layer (position embeddings and LayerNorm then apply to them
  as to any token, which is what prompt tuning and HF ``peft``'s ``PromptTuningConfig`` do);
* ``layer_prompt(i, hidden, mask) -> (b, n, H) | None``: for deep prompts, what overwrites the first
  ``n`` slots of the hidden state entering layer ``i`` (0-based); ``None`` leaves them as they are.

``input_prompt`` sees the ``(b, s)`` mask of the real tokens; ``layer_prompt`` the ``(b, n + s)`` attention
mask of the prompted sequence (prompt slots first, padding 0).

Components:

* :class:`SoftPrompt` -- prompt tuning (Lester et al., 2021): T free vectors, ``T*H`` parameters.
* :class:`DecomposedPrompt` -- DPT: ``P = A B`` with ``A (T, R)``, ``B (R, H)``.
* :class:`SMoPPrompt` -- SMoP (Choi et al., 2023): N short prompts, a noisy top-1 router.
* :class:`DeepPrompt` -- deep prompt tuning / P-tuning v2 with m hidden-state tokens per layer.
* :class:`PromptRouter` -- the linear router over the mean input embedding shared by SMoP and PT-MoE.

The paper methods built from these pieces live with their papers: ``DecomposedMoEPrompt`` in
:mod:`lowrank_lit.methods.pt_moe` and ``CapsulePrompt`` in :mod:`lowrank_lit.methods.capt`.

Helpers: :func:`masked_mean`, :func:`svd_init_prompt`, :func:`anchor_attention_share`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.nn.export import ExportRefused, PeftExport

__all__ = [
    "PromptModule", "SoftPrompt", "DecomposedPrompt", "SMoPPrompt", "DeepPrompt", "PromptRouter", "masked_mean",
    "svd_init_prompt", "text_matrix", "text_svd_factors", "anchor_attention_share", "describe", "ROUTING_MODES",
]

#: PT-MoE routing modes: the paper's default and its two ablations.
ROUTING_MODES = ("selective_prob", "non_selective", "non_probationary")

#: ``embed_text(text) -> (t, H)`` word embeddings of a text's tokens (no special tokens).
TextEmbedder = Callable[[str], torch.Tensor]


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of ``x (b, s, H)`` over the positions where ``mask (b, s)`` is non-zero -> ``(b, H)``.

    Computed in float32 and cast back. A row with no unmasked position raises ``ValueError`` (a mean
    over zero tokens is undefined; returning NaN would poison training silently).
    """
    if mask is None:
        return x.mean(dim=1)
    if mask.shape != x.shape[:2]:
        raise ValueError(f"masked_mean: mask shape {tuple(mask.shape)} does not match the input's (b, s) = {tuple(x.shape[:2])}")
    m = mask.to(torch.float32).unsqueeze(-1)  # (b, s, 1)
    count = m.sum(dim=1)  # (b, 1)
    if not count.is_meta and bool((count == 0).any()):  # (no values to check on the meta device)
        rows = (count.squeeze(-1) == 0).nonzero().flatten().tolist()
        raise ValueError(f"masked_mean: rows {rows} have no unmasked token (all padding); the mean over 0 tokens is undefined")
    return ((x.to(torch.float32) * m).sum(dim=1) / count).to(x.dtype)


def svd_init_prompt(E: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-R factors of a prompt matrix from its SVD: ``A = U_R S_R^(1/2)``, ``B = S_R^(1/2) V_R^T``.

    Args:
        E: ``(T, H)`` matrix (e.g. the word embeddings of a task text).
        rank: R, ``1 <= R <= min(T, H)``.

    Returns:
        ``A (T, R)`` and ``B (R, H)`` with ``A @ B`` the best rank-R approximation of E (Eckart-Young).
    """
    if E.ndim != 2:
        raise ValueError(f"svd_init_prompt: E must be 2-D (T, H), got shape {tuple(E.shape)}")
    T, H = E.shape
    if not 1 <= rank <= min(T, H):
        raise ValueError(f"svd_init_prompt: rank={rank}; allowed: 1 <= rank <= min(T, H) = {min(T, H)}")
    U, S, Vh = torch.linalg.svd(E.to(torch.float64), full_matrices=False)
    root = S[:rank].sqrt()
    A = U[:, :rank] * root  # (T, R)
    B = root[:, None] * Vh[:rank]  # (R, H)
    return A.to(E.dtype), B.to(E.dtype)


def text_matrix(embed_text: TextEmbedder, text: str, length: int, who: str) -> torch.Tensor:
    """``(length, H)`` word embeddings of ``text``, its tokens repeated cyclically when it is shorter."""
    E = embed_text(text)
    if E.shape[0] == 0:
        raise ValueError(f"{who}: init_text={text!r} tokenises to 0 tokens; give a non-empty task description")
    reps = math.ceil(length / E.shape[0])
    return E.repeat(reps, 1)[:length].detach().clone()


def text_svd_factors(embed_text: TextEmbedder, text: str, length: int, rank: int, who: str) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`svd_init_prompt` of the ``(length, H)`` word embeddings of ``text`` (see :func:`text_matrix`)."""
    return svd_init_prompt(text_matrix(embed_text, text, length, who), rank)


def check_arg(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


class PromptModule(nn.Module):
    """Base of all prompts: ``n_tokens`` slots in front of the input, optional per-layer overwrite.

    Attributes:
        method: short name used in logs (``pt``, ``dpt``, ``smop``, ``ptmoe``, ``deep_pt``, ``capt`` ...).
        hidden: width H the prompt is built for; must equal the backbone's.
        num_layers: for deep prompts, the backbone depth the prompt is built for (else None).
        last_routing: ``(b, N)`` routing weights of the last forward (routed prompts only).
        aux_loss: a scalar the last training forward adds to the task loss (e.g. an optional load-balancing
            term), else None.
    """

    method = "prompt"
    num_layers: int | None = None
    instance_aware = False

    def __init__(self, hidden: int) -> None:
        super().__init__()
        check_arg(hidden >= 1, f"{type(self).__name__}: hidden={hidden}; allowed: an integer >= 1")
        self.hidden = hidden
        self.last_routing: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None

    @property
    def n_tokens(self) -> int:
        """Slots in front of the input: ``prompt_len`` (subclasses with another layout override this)."""
        return self.prompt_len

    @property
    def deep(self) -> bool:
        """True when the prompt overwrites slots at every layer (then ``num_layers`` is set)."""
        return self.num_layers is not None

    def input_prompt(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(b, n_tokens, H)`` vectors placed before the word embeddings ``(b, s, H)`` (mask ``(b, s)``).

        Deep prompts return zeros: their slots are overwritten at every layer.
        """
        return embeds.new_zeros(embeds.shape[0], self.n_tokens, embeds.shape[-1])

    def layer_prompt(self, layer: int, hidden: torch.Tensor, mask: torch.Tensor,
                     instance_mask: torch.Tensor | None = None) -> torch.Tensor | None:
        """What overwrites the first ``n_tokens`` slots entering ``layer``; None keeps them."""
        return None

    def initialize(self, embed_text: TextEmbedder) -> None:
        """Data-dependent initialisation from the backbone's word embeddings (optional)."""

    def trainable_count(self) -> int:
        """Number of trainable prompt parameters."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def expected_count(self) -> int:  # pragma: no cover - every subclass defines it
        """The parameter count of the method's formula."""
        raise NotImplementedError

    def to_peft(self) -> PeftExport:
        """This prompt in peft's terms (:mod:`lowrank_lit.nn.export`); peft has plain prompt tuning only, so every
        prompt but :class:`SoftPrompt` is refused."""
        raise ExportRefused(f"{type(self).__name__} has no peft type (peft has LoRA and plain prompt tuning, one per "
                            "adapter)")


class SoftPrompt(PromptModule):
    """Prompt tuning: T free vectors prepended to the input embeddings (``T*H`` parameters).

    Args:
        prompt_len: T, number of prompt tokens. Default: 16.
        hidden: H, the backbone's width. Default: 384 (MiniLM).
        init_text: initialise from the word embeddings of this text (tokens repeated to length T), as
            ``peft``'s ``PromptTuningInit.TEXT``; None draws ``N(0, init_std^2)``. Default: None.
        init_std: standard deviation of the random init. Default: 0.02.
    """

    method = "pt"

    def __init__(self, prompt_len: int = 16, hidden: int = 384, init_text: str | None = None, init_std: float = 0.02) -> None:
        super().__init__(hidden)
        check_arg(prompt_len >= 1, f"SoftPrompt: prompt_len={prompt_len}; allowed: an integer >= 1")
        self.prompt_len = prompt_len
        self.init_text = init_text
        self.prompt_embeddings = nn.Parameter(torch.randn(prompt_len, hidden) * init_std)  # (T, H)

    def initialize(self, embed_text: TextEmbedder) -> None:
        if self.init_text is not None:
            with torch.no_grad():
                self.prompt_embeddings.copy_(text_matrix(embed_text, self.init_text, self.prompt_len, "SoftPrompt"))

    def input_prompt(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.prompt_embeddings.to(embeds.dtype).unsqueeze(0).expand(embeds.shape[0], -1, -1)  # (b, T, H)

    def expected_count(self) -> int:
        return self.prompt_len * self.hidden

    def to_peft(self) -> PeftExport:
        """peft's ``PROMPT_TUNING``: the same forward (T vectors before the word embeddings), tested against peft."""
        if type(self) is not SoftPrompt:  # a subclass that changes the forward says what it is itself
            return super().to_peft()
        table = self.prompt_embeddings.detach()  # (T, H)
        return PeftExport("PROMPT_TUNING", {"num_virtual_tokens": table.shape[0]}, {"prompt_embeddings": table})


class DecomposedPrompt(PromptModule):
    """DPT: a low-rank prompt ``P = A B`` with ``A (T, R)``, ``B (R, H)`` (``T*R + R*H`` parameters).

    Args:
        prompt_len: T. Default: 16.
        rank: R, ``1 <= R <= min(T, H)``. Default: 15 (the budget-matched DPT of PT-MoE's CPU experiment).
        hidden: H. Default: 384.
        init_text: SVD initialisation from this text's word embeddings (as PT-MoE); None: random
            ``N(0, init_std^2)`` factors. Default: None.
        init_std: random-init standard deviation. Default: 0.02.
    """

    method = "dpt"

    def __init__(self, prompt_len: int = 16, rank: int = 15, hidden: int = 384, init_text: str | None = None,
                 init_std: float = 0.02) -> None:
        super().__init__(hidden)
        check_arg(prompt_len >= 1, f"DecomposedPrompt: prompt_len={prompt_len}; allowed: an integer >= 1")
        check_arg(1 <= rank <= min(prompt_len, hidden),
               f"DecomposedPrompt: rank={rank}; allowed: 1 <= rank <= min(prompt_len, hidden) = {min(prompt_len, hidden)}")
        self.prompt_len, self.rank, self.init_text = prompt_len, rank, init_text
        self.prompt_A = nn.Parameter(torch.randn(prompt_len, rank) * init_std)  # (T, R)
        self.prompt_B = nn.Parameter(torch.randn(rank, hidden) * init_std)  # (R, H)

    def initialize(self, embed_text: TextEmbedder) -> None:
        if self.init_text is not None:
            A, B = text_svd_factors(embed_text, self.init_text, self.prompt_len, self.rank, "DecomposedPrompt")
            with torch.no_grad():
                self.prompt_A.copy_(A)
                self.prompt_B.copy_(B)

    def input_prompt(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        P = (self.prompt_A @ self.prompt_B).to(embeds.dtype)  # (T, H)
        return P.unsqueeze(0).expand(embeds.shape[0], -1, -1)

    def expected_count(self) -> int:
        return self.prompt_len * self.rank + self.rank * self.hidden


class PromptRouter(nn.Module):
    """A linear router over the masked mean of the input embeddings (``N*H + N`` parameters).

    ``l = W mean(e) + b``; in training ``l`` is perturbed (``noise="multiplicative"``: ``l * (1 + eps)``,
    PT-MoE; ``"additive"``: ``l + eps``, SMoP), ``eps ~ N(0, noise_std^2)``; in eval never. Routing weights:

    * ``selective_prob``: ``w = p * onehot(argmax p)`` -- one prompt, scaled by its probability, so the
      router gets a gradient through ``p_{i*}`` (PT-MoE's straight-through estimate);
    * ``non_selective``: ``w = p`` (all prompts, weighted);
    * ``non_probationary``: ``w = onehot(argmax p)`` (no scaling; the router gets no gradient).

    :meth:`balance_loss` is the Switch Transformer load-balancing term of the last forward (not part of PT-MoE or
    SMoP; an optional ablation).
    """

    def __init__(self, n_experts: int, hidden: int, noise_std: float = 0.01, routing: str = "selective_prob",
                 noise: str = "multiplicative") -> None:
        super().__init__()
        check_arg(n_experts >= 1, f"PromptRouter: n_experts={n_experts}; allowed: an integer >= 1")
        check_arg(noise_std >= 0, f"PromptRouter: noise_std={noise_std}; allowed: a float >= 0")
        check_arg(routing in ROUTING_MODES, f"PromptRouter: routing={routing!r}; allowed: {', '.join(ROUTING_MODES)}")
        check_arg(noise in ("multiplicative", "additive"), f"PromptRouter: noise={noise!r}; allowed: multiplicative, additive")
        self.n_experts, self.noise_std, self.routing, self.noise = n_experts, noise_std, routing, noise
        self.prompt_router = nn.Linear(hidden, n_experts)  # default nn.Linear init (paper)

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Routing weights ``(b, N)`` from word embeddings ``(b, s, H)`` and their mask ``(b, s)``."""
        mu = masked_mean(embeds, mask)  # (b, H)
        logits = self.prompt_router(mu.to(self.prompt_router.weight.dtype))  # (b, N)
        if self.training and self.noise_std > 0:
            eps = torch.randn_like(logits) * self.noise_std
            logits = logits * (1 + eps) if self.noise == "multiplicative" else logits + eps
        p = logits.softmax(dim=-1)  # (b, N)
        self.last_probs = p
        if self.routing == "non_selective":
            return p
        onehot = F.one_hot(p.argmax(dim=-1), self.n_experts).to(p.dtype)  # (b, N)
        return p * onehot if self.routing == "selective_prob" else onehot

    def balance_loss(self) -> torch.Tensor:
        """Switch-style load balance of the last forward, ``N * sum_i f_i P_i`` (1 when balanced, N when collapsed):
        ``f_i`` the share of inputs whose top expert is i (no gradient), ``P_i`` the mean router probability."""
        p = self.last_probs  # (b, N)
        f = torch.bincount(p.argmax(dim=-1), minlength=self.n_experts).to(p.dtype) / p.shape[0]  # (N,)
        return self.n_experts * (f * p.mean(dim=0)).sum()


class SMoPPrompt(PromptModule):
    """SMoP: N short full-rank prompts, a top-1 router with additive noise (``N*T*H + N*H + N``).

    The chosen prompt is scaled by its router probability (as in PT-MoE's probationary routing), so
    the router is trained by the task loss.

    Args:
        n_prompts: N. Default: 2.
        prompt_len: T of each short prompt. Default: 8 (two 8-token prompts = the 16-token budget).
        hidden: H. Default: 384.
        noise_std: router noise sigma (training only). Default: 1.0 (inferred).
        init_std: random-init standard deviation. Default: 0.02.
    """

    method = "smop"

    def __init__(self, n_prompts: int = 2, prompt_len: int = 8, hidden: int = 384, noise_std: float = 1.0,
                 init_std: float = 0.02) -> None:
        super().__init__(hidden)
        check_arg(n_prompts >= 1, f"SMoPPrompt: n_prompts={n_prompts}; allowed: an integer >= 1")
        check_arg(prompt_len >= 1, f"SMoPPrompt: prompt_len={prompt_len}; allowed: an integer >= 1")
        self.n_prompts, self.prompt_len = n_prompts, prompt_len
        self.prompt_embeddings = nn.Parameter(torch.randn(n_prompts, prompt_len, hidden) * init_std)  # (N, T, H)
        self.router = PromptRouter(n_prompts, hidden, noise_std, "selective_prob", noise="additive")

    def input_prompt(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w = self.router(embeds, mask)  # (b, N)
        self.last_routing = w.detach()
        return torch.einsum("bn,nth->bth", w, self.prompt_embeddings).to(embeds.dtype)  # (b, T, H)

    def expected_count(self) -> int:
        return self.n_prompts * self.prompt_len * self.hidden + self.n_prompts * self.hidden + self.n_prompts


class DeepPrompt(PromptModule):
    """Deep prompt tuning (P-tuning v2 with hidden-state tokens): m fresh vectors at every layer.

    The first m slots of the hidden state entering layer i are overwritten by ``prompt_deep[i]`` (their
    outputs are discarded by the next overwrite); ``L*m*H`` parameters.

    Args:
        num_layers: L, the backbone depth. Default: 6.
        prompt_len: m tokens per layer. Default: 4.
        hidden: H. Default: 384.
        init_std: random-init standard deviation. Default: 0.02.
    """

    method = "deep_pt"

    def __init__(self, num_layers: int = 6, prompt_len: int = 4, hidden: int = 384, init_std: float = 0.02) -> None:
        super().__init__(hidden)
        check_arg(num_layers >= 1, f"DeepPrompt: num_layers={num_layers}; allowed: an integer >= 1")
        check_arg(prompt_len >= 1, f"DeepPrompt: prompt_len={prompt_len}; allowed: an integer >= 1")
        self.num_layers, self.prompt_len = num_layers, prompt_len
        self.prompt_deep = nn.Parameter(torch.randn(num_layers, prompt_len, hidden) * init_std)  # (L, m, H)

    def layer_prompt(self, layer: int, hidden: torch.Tensor, mask: torch.Tensor,
                     instance_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.prompt_deep[layer].to(hidden.dtype).unsqueeze(0).expand(hidden.shape[0], -1, -1)  # (b, m, H)

    def expected_count(self) -> int:
        return self.num_layers * self.prompt_len * self.hidden


def anchor_attention_share(attentions: tuple[torch.Tensor, ...] | list[torch.Tensor], mask: torch.Tensor,
                           n_prompt: int) -> torch.Tensor:
    """Mean attention from real tokens to each prompt slot, averaged over layers, heads and queries.

    Args:
        attentions: per layer ``(b, heads, n+s, n+s)`` attention probabilities.
        mask: ``(b, n+s)`` attention mask (prompt slots first).
        n_prompt: n, the number of prompt slots.

    Returns:
        ``(n,)`` share of attention each prompt slot receives from real (unmasked) query tokens; entry 0
        is CaPT's anchor share.
    """
    q = mask.to(torch.float32).clone()
    q[:, :n_prompt] = 0  # queries: real tokens only
    shares = []
    for att in attentions:
        to_prompt = att[..., :n_prompt].to(torch.float32).mean(dim=1)  # (b, n+s, n): averaged over heads
        shares.append((to_prompt * q.unsqueeze(-1)).sum(dim=(0, 1)) / q.sum())  # (n,)
    return torch.stack(shares).mean(dim=0)


def describe(prompt: PromptModule | None) -> dict[str, Any]:
    """A one-line description for logs: method name, tokens, trainable count."""
    if prompt is None:
        return {"method": "head", "tokens": 0, "params": 0}
    return {"method": prompt.method, "tokens": prompt.n_tokens, "params": prompt.trainable_count()}
