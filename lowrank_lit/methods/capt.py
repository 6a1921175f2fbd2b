'''CaPT: capsule prompt tuning -- one instance-aware prompt vector per layer.

Liu, Liang, Fan, Yang, Cui, Han, Huang, Liu, Wang, Han, *All You Need is One: Capsule Prompt Tuning with a
Single Vector*, NeurIPS 2025 (arXiv 2510.16670). No public code was found.

Each layer i of a frozen transformer gets exactly one extra token at position 0, the capsule
``S_i = p_i + Mean(input of layer i)``: the sum of a learnable task vector ``p_i (H,)`` and the masked mean
of the instance's hidden states entering that layer::

    S_1 = p_1 + Mean(E);                 [S'_1, H_1] = L_1([S_1; E])
    S_i = p_i + Mean([S'_{i-1}; H_{i-1}]);  [S'_i, H_i] = L_i([S_i; H_{i-1}])     (i >= 2)

The slot is overwritten at every layer (P-tuning-v2 style); ``S'_i`` only feeds the next mean. Trainable:
``p in R^{L x H}`` (plus the task head). With zero ``p`` the capsule is the training-free instance token;
without the instance term it is deep prompt tuning with one token per layer.

Inferred where the paper is silent: the means ignore padding (and, in decoder LMs, every answer token:
:class:`~lowrank_lit.models.text.PromptTunedLM` requires an instance mask); the real tokens are shifted by
one position, as in prompt tuning; the last layer's output drops position 0 before pooling; ``p`` starts
at zeros (``init="normal"`` gives N(0, 0.02^2)); the ``conv`` and ``proj`` ablation variants are a
depth-wise kernel-3 convolution (identity init) before the mean and a rank-8 zero-initialised residual
map of the mean.
'''

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.nn.prompts import PromptModule, anchor_attention_share, check_arg, masked_mean
from lowrank_lit.registry import register_method

__all__ = ["CapsulePrompt", "anchor_attention_share", "CAPSULE_VARIANTS", "CAPSULE_INITS"]

PAPER = "All You Need is One: Capsule Prompt Tuning with a Single Vector (CaPT)"
#: CaPT variants of the paper's ablation (``add`` is the method).
CAPSULE_VARIANTS = ("add", "prepend", "conv", "proj")
CAPSULE_INITS = ("zeros", "normal")


@register_method("capt", kind="Layer", paper=PAPER, summary="summary", bench="bench")
class CapsulePrompt(PromptModule):
    """CaPT: one capsule per layer, ``S_i = p_i + Mean(input of layer i)``, at position 0.

    Layer 1: ``S_1 = p_1 + Mean(E)`` over the real tokens; layer ``i >= 2``: ``S_i = p_i + Mean([S'_{i-1};
    H_{i-1}])``, the masked mean over the previous layer's capsule output and real tokens. The means use
    ``instance_mask`` when given (decoder LMs: the instance/prompt tokens only, never the answer).

    Args:
        num_layers: L, the backbone depth. Default: 6.
        hidden: H. Default: 384.
        init: ``zeros`` (the training-free instance token) or ``normal`` (``N(0, 0.02^2)``). Default: zeros.
        instance: add the instance mean; False gives deep prompt tuning with m=1. Default: True.
        train_task_vector: train ``p``; False keeps ``p`` at its init (the instance-only ablation). Default: True.
        variant: ``add`` (the method), ``prepend`` (two slots: mean token, then p), ``conv`` (p + mean of a
            depth-wise kernel-3 conv over the tokens, identity init; inferred), ``proj`` (p + a rank-``proj_rank``
            linear map of the mean, zero-init up-projection; inferred). Default: add.
        n_capsules: capsules per layer; only ``variant="prepend"`` uses two (the method is one vector). Default: 1.
        proj_rank: rank of the ``proj`` variant. Default: 8.
    """

    method = "capt"
    instance_aware = True

    def __init__(self, num_layers: int = 6, hidden: int = 384, init: str = "zeros", instance: bool = True,
                 train_task_vector: bool = True, variant: str = "add", n_capsules: int = 1, proj_rank: int = 8) -> None:
        super().__init__(hidden)
        check_arg(num_layers >= 1, f"CapsulePrompt: num_layers={num_layers}; allowed: an integer >= 1")
        check_arg(init in CAPSULE_INITS, f"CapsulePrompt: init={init!r}; allowed: {', '.join(CAPSULE_INITS)}")
        check_arg(variant in CAPSULE_VARIANTS, f"CapsulePrompt: variant={variant!r}; allowed: {', '.join(CAPSULE_VARIANTS)}")
        expected = 2 if variant == "prepend" else 1
        check_arg(n_capsules == expected,
               f"CapsulePrompt: n_capsules={n_capsules} with variant={variant!r}; allowed: {expected} (CaPT is one vector "
               "per layer; only variant='prepend' uses two slots: the mean token and p)")
        self.num_layers, self.init, self.instance, self.variant = num_layers, init, instance, variant
        self.instance_aware = instance
        self.train_task_vector = train_task_vector
        p = torch.zeros(num_layers, hidden) if init == "zeros" else torch.randn(num_layers, hidden) * 0.02
        self.prompt_capsule = nn.Parameter(p, requires_grad=train_task_vector)  # (L, H)
        if variant == "conv":
            kernel = torch.zeros(num_layers, hidden, 1, 3)
            kernel[..., 1] = 1.0  # identity: starts as the plain mean
            self.prompt_conv = nn.Parameter(kernel)  # (L, H, 1, 3): depth-wise conv per layer
        if variant == "proj":
            self.prompt_down = nn.Parameter(torch.randn(num_layers, hidden, proj_rank) / math.sqrt(hidden))
            self.prompt_up = nn.Parameter(torch.zeros(num_layers, proj_rank, hidden))
        if not instance:
            self.method = "deep_pt"
        elif not train_task_vector:
            self.method = "instance_only"

    @property
    def n_tokens(self) -> int:
        return 2 if self.variant == "prepend" else 1

    def instance_term(self, layer: int, hidden: torch.Tensor, mask: torch.Tensor,
                      instance_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(b, H)``: the mean of layer ``layer``'s input (layer 0: real tokens; later: capsule + tokens)."""
        n = self.n_tokens
        span = mask if instance_mask is None else instance_mask
        if span.shape != mask.shape:
            raise ValueError(f"CapsulePrompt: instance_mask shape {tuple(span.shape)} does not match the attention mask's {tuple(mask.shape)}")
        span = span.clone()
        if layer == 0:
            span[:, :n] = 0  # E: the real tokens only (the slot holds a placeholder)
        else:
            span[:, :n] = 1  # [S'_{i-1}; H_{i-1}]: the previous capsule output is part of the mean
        x = hidden
        if self.variant == "conv":
            x = F.conv1d(hidden.transpose(1, 2), self.prompt_conv[layer].to(hidden.dtype), padding=1,
                         groups=self.hidden).transpose(1, 2)  # (b, n+s, H)
        mu = masked_mean(x, span)  # (b, H)
        if self.variant == "proj":
            mu = mu + (mu @ self.prompt_down[layer]) @ self.prompt_up[layer]
        return mu

    def layer_prompt(self, layer: int, hidden: torch.Tensor, mask: torch.Tensor,
                     instance_mask: torch.Tensor | None = None) -> torch.Tensor:
        p = self.prompt_capsule[layer].to(hidden.dtype).unsqueeze(0).expand(hidden.shape[0], -1)  # (b, H)
        if not self.instance:
            return p.unsqueeze(1)  # (b, 1, H)
        mu = self.instance_term(layer, hidden, mask, instance_mask)
        if self.variant == "prepend":
            return torch.stack([mu, p], dim=1)  # (b, 2, H)
        return (p + mu).unsqueeze(1)  # (b, 1, H)

    def expected_count(self) -> int:
        if not self.train_task_vector:
            return sum(p.numel() for n, p in self.named_parameters() if n != "prompt_capsule")
        return sum(p.numel() for p in self.parameters())



COLUMNS = ("test/acc", "test/acc_sentiment", "test/acc_topic", "test/anchor_share", "test/max_slot_share")


def summary(roots: list[str], out: str | None = None) -> str:
    """Templated two-domain runs (head, PT, P-tuning v2, deep PT, instance-only, CaPT): accuracy and attention shares."""
    from lowrank_lit.studies.prompt_runs import prompt_runs_table

    return prompt_runs_table(roots, COLUMNS, out=out, title="CaPT vs prompt baselines (MiniLM, 2 layers)",
                             highlight="CapsulePrompt")


def bench(ctx: Any) -> list[Any]:
    """Training-step time of CaPT against prompt tuning with 16 tokens, on the templated task and on random token
    inputs of growing length (the prompt tokens' share of the sequence falls with it) (``lowrank bench capt``)."""
    import torch.nn.functional as F

    from lowrank_lit.bench import ConfigBench, ratio_row
    from lowrank_lit.models.text import PromptTunedClassifier
    from lowrank_lit.nn.prompts import SoftPrompt

    claim = "paper: PT takes 8.77x CaPT's training time (CaPT / PT = 0.114)"
    rows: list[Any] = [ConfigBench("capt", "CaPT training step (one capsule per layer, 2 layers)", "PT m=16 step",
                                   "configs/capt/templated_capt.yaml", "configs/capt/templated_pt16.yaml", claim, 1 / 8.77)]
    torch.manual_seed(0)
    models = {"CaPT": PromptTunedClassifier(num_layers=2, prompt=CapsulePrompt(2, 384), measure_attention=False),
              "PT": PromptTunedClassifier(num_layers=2, prompt=SoftPrompt(16, 384), measure_attention=False)}
    optimizers = {k: m.to(ctx.device).configure_optimizers() for k, m in models.items()}
    for length in ctx.size((64, 256), (64,)):
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(1000, 30000, (32, length), generator=g).to(ctx.device)  # (B, L)
        mask = torch.ones_like(ids)
        y = torch.randint(0, 2, (32,), generator=g).to(ctx.device)

        def step(name: str, ids: torch.Tensor = ids, mask: torch.Tensor = mask, y: torch.Tensor = y) -> None:
            logits, _ = models[name](ids, mask)
            optimizers[name].zero_grad()
            F.cross_entropy(logits, y).backward()
            optimizers[name].step()

        times = ctx.compare({"CaPT": lambda: step("CaPT"), "PT": lambda: step("PT")}, ctx.rounds(10, 3), warmup=1)
        rows.append(ratio_row(ctx, "capt", f"CaPT training step, {length}-token inputs (2 layers, batch 32)",
                              "PT m=16 step", times, "CaPT", "PT", claim, 1 / 8.77,
                              note=f"prompt tokens {16 / (16 + length):.0%} of PT's sequence"))
    return rows
