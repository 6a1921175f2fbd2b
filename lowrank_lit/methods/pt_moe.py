'''PT-MoE: prompt tuning with decomposed prompts and mixture-of-experts routing.

Li, Su, Collier, *PT-MoE: An Efficient Finetuning Framework for Integrating Mixture-of-Experts into Prompt
Tuning*, NeurIPS 2025 (arXiv 2505.09519). The official repository (ZongqianLi/PT-MoE) holds no code.

N soft prompts share one low-rank factor, ``P_i = A_i B`` with ``A_i (T, R)`` and ``B (R, H)``. A linear
router reads the masked mean of the input word embeddings, ``l = W mu + b``; in training the logits get
multiplicative noise ``l * (1 + eps)``, ``eps ~ N(0, 0.01^2)``; ``p = softmax(l)`` and the selective +
probationary routing keeps only the top expert, scaled by its probability::

    w = p * onehot(argmax p);   P = sum_i w_i A_i B   (b, T, H);   inputs = [P; Embed(x)], mask = [1_T; m]

The router learns through ``p_{i*}`` (the paper's straight-through estimate). Trainable parameters:
``N*T*R + R*H + N*H + N``. Initialisation: every ``A_i`` and ``B`` from the truncated SVD of the word
embeddings of a task text (its first T tokens, repeated when shorter), the router with nn.Linear's default.
Ablations: ``routing="non_selective"`` (all experts weighted by p), ``"non_probationary"`` (hard one-hot),
``n_experts=1`` (equals DPT with the same factors).

Inferred where the paper is silent: the router's mean ignores padding (the paper writes a mean over the
sequence); a text shorter than T repeats its tokens. The shared pieces (router, SVD init, the PT / DPT /
SMoP baselines, the frozen backbone) are in :mod:`lowrank_lit.nn.prompts` and :mod:`lowrank_lit.models.text`.
'''

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lowrank_lit.models.text import routing_purity
from lowrank_lit.nn.prompts import (
    ROUTING_MODES,
    PromptModule,
    PromptRouter,
    TextEmbedder,
    check_arg,
    svd_init_prompt,
    text_svd_factors,
)
from lowrank_lit.registry import register_method

__all__ = ["DecomposedMoEPrompt", "routing_purity", "svd_init_prompt"]

PAPER = "PT-MoE: Mixture-of-Experts in Prompt Tuning"


@register_method("pt_moe", kind="Layer", paper=PAPER, summary="summary", bench="bench")
class DecomposedMoEPrompt(PromptModule):
    """PT-MoE: N decomposed prompts ``P_i = A_i B`` (shared B) picked per input by a noisy router.

    ``P = sum_i w_i A_i B`` with the router weights ``w`` of :class:`PromptRouter` (one non-zero weight
    under the default selective + probationary routing). Trainable: ``N*T*R + R*H + N*H + N``.
    Initialisation: every ``A_i`` and B from the SVD of the task text's embeddings (:func:`svd_init_prompt`).

    Args:
        n_experts: N. Default: 2 (paper).
        prompt_len: T. Default: 16 (the CPU experiment; the paper uses 40).
        rank: R, ``1 <= R <= min(T, H)``. Default: 13 (budget-matched to PT with T=16).
        hidden: H. Default: 384.
        noise_std: router noise sigma (training only; multiplicative). Default: 0.01 (paper).
        routing: ``selective_prob`` (paper) | ``non_selective`` | ``non_probationary`` (ablations).
        init_text: task description for the SVD init; None: random ``N(0, init_std^2)`` factors
            (identical for every expert). Default: None.
        init_std: random-init standard deviation. Default: 0.02.
        balance_weight: weight of a Switch-style load-balancing loss on the router (:meth:`PromptRouter.balance_loss`)
            added to the task loss in training. Not in the paper (which has no balancing term): a beyond-paper
            ablation against router collapse; 0 is the paper's method. Default: 0.0.
    """

    method = "ptmoe"

    def __init__(self, n_experts: int = 2, prompt_len: int = 16, rank: int = 13, hidden: int = 384,
                 noise_std: float = 0.01, routing: str = "selective_prob", init_text: str | None = None,
                 init_std: float = 0.02, balance_weight: float = 0.0) -> None:
        super().__init__(hidden)
        check_arg(n_experts >= 1, f"DecomposedMoEPrompt: n_experts={n_experts}; allowed: an integer >= 1")
        check_arg(prompt_len >= 1, f"DecomposedMoEPrompt: prompt_len={prompt_len}; allowed: an integer >= 1")
        check_arg(1 <= rank <= min(prompt_len, hidden),
               f"DecomposedMoEPrompt: rank={rank}; allowed: 1 <= rank <= min(prompt_len, hidden) = {min(prompt_len, hidden)}")
        check_arg(noise_std >= 0, f"DecomposedMoEPrompt: noise_std={noise_std}; allowed: a float >= 0")
        check_arg(balance_weight >= 0, f"DecomposedMoEPrompt: balance_weight={balance_weight}; allowed: a float >= 0")
        self.balance_weight = balance_weight
        check_arg(routing in ROUTING_MODES, f"DecomposedMoEPrompt: routing={routing!r}; allowed: {', '.join(ROUTING_MODES)}")
        self.n_experts, self.prompt_len, self.rank, self.init_text = n_experts, prompt_len, rank, init_text
        A = torch.randn(prompt_len, rank) * init_std
        self.prompt_A = nn.Parameter(A.unsqueeze(0).repeat(n_experts, 1, 1))  # (N, T, R)
        self.prompt_B = nn.Parameter(torch.randn(rank, hidden) * init_std)  # (R, H)
        self.router = PromptRouter(n_experts, hidden, noise_std, routing, noise="multiplicative")

    def initialize(self, embed_text: TextEmbedder) -> None:
        if self.init_text is not None:
            A, B = text_svd_factors(embed_text, self.init_text, self.prompt_len, self.rank, "DecomposedMoEPrompt")
            with torch.no_grad():
                self.prompt_A.copy_(A.unsqueeze(0).expand_as(self.prompt_A))
                self.prompt_B.copy_(B)

    def input_prompt(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        w = self.router(embeds, mask)  # (b, N)
        self.last_routing = w.detach()
        use = self.training and self.balance_weight > 0
        self.aux_loss = self.balance_weight * self.router.balance_loss() if use else None
        A = torch.einsum("bn,ntr->btr", w, self.prompt_A)  # (b, T, R): sum_i w_i A_i
        return (A @ self.prompt_B).to(embeds.dtype)  # (b, T, H)

    def expected_count(self) -> int:
        N, T, R, H = self.n_experts, self.prompt_len, self.rank, self.hidden
        return N * T * R + R * H + N * H + N



COLUMNS = ("test/mean_domain_acc", "test/acc_sentiment", "test/acc_topic", "test/routing_purity")


def summary(roots: list[str], out: str | None = None) -> str:
    """Templated two-domain runs (PT, DPT, SMoP, PT-MoE and ablations): accuracy mean +/- std, purity, params."""
    from lowrank_lit.studies.prompt_runs import prompt_runs_table

    return prompt_runs_table(roots, COLUMNS, out=out, title="PT-MoE vs prompt baselines (MiniLM, 2 layers)",
                             highlight="DecomposedMoEPrompt")


def bench(ctx: Any) -> list[Any]:
    """Training-step time of PT-MoE (N = 2) against prompt tuning on the templated task (``lowrank bench pt_moe``)."""
    from lowrank_lit.bench import ConfigBench

    return [ConfigBench("pt_moe", "PT-MoE training step (N = 2 experts, shared B)", "PT step",
                        "configs/pt_moe/templated_ptmoe.yaml", "configs/pt_moe/templated_pt.yaml",
                        "paper: fewer parameters than PT at a similar cost (reported)"),
            ConfigBench("pt_moe", "our prompt tuning step (SoftPrompt)", "HF peft PromptTuning step",
                        "configs/peft_suite/pt.yaml", "configs/peft_suite/peft_pt.yaml",
                        "peer library: the same forward to 1e-6 (tested); reported")]
