'''LoPE: noise robustness through noise -- asymmetric MoE-LoRA with a poisoning expert.

Wang, Guo, Pu, Chen, Pu, Ou, Qin, Tian, *Noise-Robustness Through Noise: A Framework combining Asymmetric
LoRA with Poisoning MoE*, NeurIPS 2025 (arXiv 2505.23868). No public code was found.

An asymmetric (HydraLoRA-style) adapter ``h = W0 x + (alpha / r) sum_i w_i(x) B_i A x`` with one shared A, N
normal experts ``B_i``, one poisoning expert ``B_D`` and a per-token softmax router
(:class:`lowrank_lit.nn.lora.AsymmetricLoRALinear`). Training has two stages:

* stage I: only A and ``B_D`` train, on the original data plus its HyNoIse copy (discrete character/word noise
  in the data, continuous embedding noise ``E' = E + alpha U(-1, 1) * mask`` in the model), ``w_D = 1``, no router;
* stage II: A, the normal ``B_i`` and the router train on the original data; ``B_D`` is frozen but stays in the
  forward pass.

At inference ``B_D`` is masked and its routing weight handed to the K normal experts whose outputs are most
similar to its own (DyCompEnSate, :func:`lowrank_lit.nn.lora.dycompensate`; K = 0 is plain masking).

Inferred where the paper is silent (method card 07): the router reads ``A x`` (the paper's ``W_gate in R^{r x N}``;
``router_in="input"`` gives HydraLoRA's); A is Kaiming-uniform, every B zero, scaling ``alpha / r``; stage I uses
``w_D = 1`` and no router; the DyCompEnSate formula (its equation did not survive extraction) is
``w_i + beta * w_D * theta_i^+ / sum_topK theta^+`` over the K normal experts most cosine-similar to ``B_D A x``.
The optimizer holds every adapter parameter from the start; a frozen one gets no gradient, so AdamW leaves it
bit-identical (no optimizer rebuild at the stage switch, and resuming across the switch is exact because the
stage follows ``global_step``).
'''

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lowrank_lit.nn.lora import AsymmetricLoRALinear
from lowrank_lit.registry import register_method

__all__ = ["LoPEStageCallback", "HyNoIse", "hynoise_embedding", "poison_share"]

PAPER = "Noise-Robustness Through Noise: Asymmetric LoRA with Poisoning MoE (LoPE)"


def hynoise_embedding(embeds: torch.Tensor, mask: torch.Tensor, alpha: float,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """``E + alpha * U(-1, 1) * mask``: bounded noise on the valid positions of ``embeds (b, s, H)``."""
    if alpha < 0:
        raise ValueError(f"hynoise_embedding: alpha={alpha}; allowed: a float >= 0")
    if mask.shape != embeds.shape[:2]:
        raise ValueError(f"hynoise_embedding: mask shape {tuple(mask.shape)} does not match embeds (b, s) = {tuple(embeds.shape[:2])}")
    if alpha == 0:
        return embeds
    u = torch.rand(embeds.shape, generator=generator, device=embeds.device, dtype=embeds.dtype) * 2 - 1  # U(-1, 1)
    return embeds + alpha * u * mask.unsqueeze(-1).to(embeds.dtype)


class HyNoIse:
    """The continuous half of HyNoIse as a callable ``(embeds, mask) -> embeds`` (the discrete half is data:
    :class:`lowrank_lit.data.text_tasks.TemplatedTextDataModule` ``noisy_copy_rate``).

    Args:
        emb_alpha: bound of the uniform embedding noise. Default: 0.05 (paper).
        generator: RNG of the noise; None uses the global torch RNG (seeded by ``seed_everything``).
    """

    def __init__(self, emb_alpha: float = 0.05, generator: torch.Generator | None = None) -> None:
        if emb_alpha < 0:
            raise ValueError(f"HyNoIse: emb_alpha={emb_alpha}; allowed: a float >= 0")
        self.emb_alpha, self.generator = emb_alpha, generator

    def __call__(self, embeds: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return hynoise_embedding(embeds, mask, self.emb_alpha, self.generator)


def _poison_layers(module: torch.nn.Module) -> list[AsymmetricLoRALinear]:
    return [m for m in module.modules() if isinstance(m, AsymmetricLoRALinear) and m.n_poison > 0]


@contextlib.contextmanager
def _poison_layers_in_mode(pl_module: Any, mode: str) -> Iterator[list[AsymmetricLoRALinear]]:
    """Every poison layer of ``pl_module`` in ``mode`` inside the block, each back in its own mode after it."""
    layers = _poison_layers(pl_module)
    modes = [m.mode for m in layers]
    for m in layers:
        m.set_mode(mode)
    try:
        yield layers
    finally:
        for m, old in zip(layers, modes, strict=True):
            m.set_mode(old)


@torch.no_grad()
def poison_share(pl_module: Any, input_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean routing weight of every expert over real tokens and adapted layers, routing unmasked -> ``(N,)``."""
    with _poison_layers_in_mode(pl_module, "route") as layers:
        lm = getattr(pl_module, "lm", None)  # PromptTunedLM: its prompted backbone takes (ids, mask)
        (lm if isinstance(lm, torch.nn.Module) else pl_module)(input_ids, mask)
        per_layer = []
        for m in layers:
            w = m.last_weights[:, -mask.shape[1]:]  # (b, s, N): real positions
            per_layer.append((w * mask.unsqueeze(-1)).sum((0, 1)) / mask.sum())
    return torch.stack(per_layer).mean(0)


@register_method("lope", kind="Callback", paper=PAPER, summary="summary", bench="bench")
class LoPEStageCallback(Callback):
    """LoPE's two training stages and inference masking for every :class:`AsymmetricLoRALinear` with a poison expert.

    Works on :class:`~lowrank_lit.models.text.PromptTunedClassifier` (templated text) and
    :class:`~lowrank_lit.models.text.PromptTunedLM` (a causal LM on QADataModule, e.g. Alpaca-style files with
    ``noisy_copy_rate``; ``configs/lope/llama_gpu.yaml``).

    The stage follows ``trainer.global_step`` (stage I before ``stage1_steps``, stage II after), re-applied at
    every training batch, so a resumed run continues in the right stage. In the test loop it logs the per-expert
    routing mass (routing unmasked) on clean inputs and, when the batches carry HyNoIse copies, on noisy ones:
    ``test/poison_share_clean``, ``test/poison_share_noisy``, ``test/expert_mass_{clean,noisy}_<i>``; a probe copy
    (``TemplatedTextDataModule(probe_rate=...)``) adds ``test/poison_share_probe`` and ``test/expert_mass_probe_<i>``.

    The mechanism, logged per run on a classifier (:class:`~lowrank_lit.models.text.PromptTunedClassifier`):
    ``probe/bd_alone_acc`` (step ``stage1_steps``: the test accuracy of ``B_D`` alone at its stage-I weight, at the end of
    stage I: how much of the task the poisoning expert learned), ``train/poison_share`` (B_D's routing share, measured in eval mode, on
    each logged stage-II training batch), and at test, beside ``test/acc`` (masked unless
    ``mask_at_inference=False``), ``test/acc_unmasked`` (routing with ``B_D``) and ``test/acc_bd_alone``.

    Args:
        stage1_steps: steps of stage I. Default: 150 (the CPU experiment: 150 + 150).
        emb_alpha: HyNoIse embedding-noise bound in stage I. Default: 0.05 (paper).
        mask_at_inference: mask ``B_D`` (with compensation) in validation and test; False keeps it (ablation). Default: True.
        compensate_k: K of DyCompEnSate; None: every normal expert; 0: plain masking. Default: None.
        compensate_beta: beta of DyCompEnSate. Default: 1.0.
        allow_skip_stage1: accept ``stage1_steps=0`` (stage II with an untrained poisoning expert). Default: False.
        stage1_inputs: ``original_and_noisy`` (the paper: the originals and their HyNoIse copies) or ``noisy_only``
            (ours: the copies alone). Default: original_and_noisy.
        stage1_labels: ``true`` (the paper) or ``shuffled`` (ours: the copies' labels permuted within the batch, so
            ``B_D`` can fit the noise but not the task; classifiers only). Default: true.
        stage1_poison_weight: ``w_D`` in stage I, in (0, 1] (the paper: 1; below 1, ours: ``B_D`` trains at part
            weight). Default: 1.0.
        test_diagnostics: log the routing shares and the unmasked / ``B_D``-alone accuracies in the test loop (up to
            four more forward passes per test batch, besides the model's own); False leaves the test loop to the
            inference alone (``lowrank bench lope`` times it so). Default: True.
    """

    def __init__(self, stage1_steps: int = 150, emb_alpha: float = 0.05, mask_at_inference: bool = True,
                 compensate_k: int | None = None, compensate_beta: float = 1.0, allow_skip_stage1: bool = False,
                 stage1_inputs: Literal["original_and_noisy", "noisy_only"] = "original_and_noisy",
                 stage1_labels: Literal["true", "shuffled"] = "true", stage1_poison_weight: float = 1.0,
                 test_diagnostics: bool = True) -> None:
        if stage1_steps < 0 or (stage1_steps == 0 and not allow_skip_stage1):
            raise ValueError(f"LoPEStageCallback: stage1_steps={stage1_steps}; allowed: an integer >= 1 (stage II needs the "
                             "poisoning expert trained in stage I; allow_skip_stage1=true runs stage II alone)")
        if emb_alpha < 0:
            raise ValueError(f"LoPEStageCallback: emb_alpha={emb_alpha}; allowed: a float >= 0")
        if compensate_k is not None and compensate_k < 0:
            raise ValueError(f"LoPEStageCallback: compensate_k={compensate_k}; allowed: an integer >= 0 or null")
        if compensate_beta <= 0:
            raise ValueError(f"LoPEStageCallback: compensate_beta={compensate_beta}; allowed: a float > 0")
        if stage1_inputs not in ("original_and_noisy", "noisy_only"):
            raise ValueError(f"LoPEStageCallback: stage1_inputs={stage1_inputs!r}; allowed: original_and_noisy, noisy_only")
        if stage1_labels not in ("true", "shuffled"):
            raise ValueError(f"LoPEStageCallback: stage1_labels={stage1_labels!r}; allowed: true, shuffled")
        if not 0 < stage1_poison_weight <= 1:
            raise ValueError(f"LoPEStageCallback: stage1_poison_weight={stage1_poison_weight}; allowed: a float in (0, 1]")
        self.stage1_inputs, self.stage1_labels, self.stage1_poison_weight = stage1_inputs, stage1_labels, stage1_poison_weight
        self.test_diagnostics = bool(test_diagnostics)
        self.stage1_steps, self.noise = stage1_steps, HyNoIse(emb_alpha)
        self.mask_at_inference, self.compensate_k, self.compensate_beta = mask_at_inference, compensate_k, compensate_beta
        self.stage: int | None = None
        self._mass: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._correct: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def _layers(self, pl_module: pl.LightningModule) -> list[AsymmetricLoRALinear]:
        layers = _poison_layers(pl_module)
        if not layers:
            raise ValueError("LoPEStageCallback: the model has no AsymmetricLoRALinear with n_poison >= 1; set the model's "
                             "adapter to lowrank_lit.nn.lora.AsymmetricLoRALinear with n_poison: 1")
        return layers

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if (self.stage1_inputs, self.stage1_labels) != ("original_and_noisy", "true") and not _is_classifier(pl_module):
            raise ValueError(f"LoPEStageCallback: stage1_inputs={self.stage1_inputs!r}, stage1_labels="
                             f"{self.stage1_labels!r} work on a PromptTunedClassifier only; allowed on "
                             f"{type(pl_module).__name__}: original_and_noisy, true")
        for m in self._layers(pl_module):
            k = m.n_experts if self.compensate_k is None else self.compensate_k
            if k > m.n_experts:
                raise ValueError(f"LoPEStageCallback: compensate_k={k}; allowed: 0 <= compensate_k <= {m.n_experts} (normal experts)")
            m.compensate_k, m.compensate_beta = k, self.compensate_beta

    def apply_stage(self, pl_module: pl.LightningModule, stage: int) -> None:
        """Set modes, trainable parameters, embedding noise and noisy-copy training for ``stage`` (1 or 2)."""
        for m in self._layers(pl_module):
            m.set_mode("poison_only" if stage == 1 else "route")
            m.poison_weight = self.stage1_poison_weight
            m.lora_A.requires_grad_(True)
            for i, b in enumerate(m.lora_B):
                b.requires_grad_((i in m.poison_index) == (stage == 1))
            m.lora_router.requires_grad_(stage == 2)
        pl_module.embed_noise = self.noise if stage == 1 else None
        pl_module.train_on_noisy_copies = stage == 1
        pl_module.noisy_copies_only = stage == 1 and self.stage1_inputs == "noisy_only"
        pl_module.shuffle_noisy_labels = stage == 1 and self.stage1_labels == "shuffled"
        self.stage = stage

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        stage = 1 if trainer.global_step < self.stage1_steps else 2
        if stage == 2 and self.stage == 1 and _is_classifier(pl_module):  # the switch: what stage I left in B_D
            with _untouched(pl_module):
                acc = _accuracy_in_mode(pl_module, trainer.datamodule.test_dataloader(), "poison_only")
            if trainer.logger is not None:
                trainer.logger.log_metrics({"probe/bd_alone_acc": acc}, step=trainer.global_step)
        self.apply_stage(pl_module, stage)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.stage != 2 or not isinstance(batch, (tuple, list)) or trainer.global_step % trainer.log_every_n_steps:
            return
        poison = self._layers(pl_module)[0].poison_index
        with _untouched(pl_module):  # a measurement: no dropout draw, so the training run is the one without it
            share = poison_share(pl_module, batch[0], batch[1])[poison].sum()
        pl_module.log("train/poison_share", share, on_step=True, on_epoch=False)

    def _inference_mode(self, pl_module: pl.LightningModule) -> None:
        for m in self._layers(pl_module):
            m.set_mode("mask" if self.mask_at_inference else "route")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._inference_mode(pl_module)

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._inference_mode(pl_module)
        self._mass = {"clean": [], "noisy": [], "probe": []}  # per batch: (routing mass * tokens (N,), tokens)
        self._correct = {"unmasked": [], "bd_alone": []}  # per batch: (correct, examples)

    def on_test_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        if not self.test_diagnostics:
            return
        if isinstance(batch, dict):  # QADataModule batches (PromptTunedLM)
            inputs = {"clean": (batch["input_ids"], batch["attention_mask"])}
            if "noisy_input_ids" in batch:
                inputs["noisy"] = (batch["noisy_input_ids"], batch["noisy_attention_mask"])
        else:  # TemplatedTextDataModule tuples (PromptTunedClassifier)
            inputs = {"clean": (batch[0], batch[1])}
            if len(batch) >= 6:
                inputs["noisy"] = (batch[4], batch[5])
            if len(batch) >= 8:  # TemplatedTextDataModule(probe_rate=...): the probe at e.g. the training rate
                inputs["probe"] = (batch[6], batch[7])
        for kind, (ids, mask) in inputs.items():
            tokens = mask.sum().float()
            self._mass[kind].append((poison_share(pl_module, ids, mask) * tokens, tokens))
        if _is_classifier(pl_module) and not isinstance(batch, dict):
            for name, mode in (("unmasked", "route"), ("bd_alone", "poison_only")):
                self._correct[name].append(_correct_in_mode(pl_module, batch, mode))

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        poison = self._layers(pl_module)[0].poison_index
        for kind, rows in self._mass.items():
            if not rows:
                continue
            total = trainer.strategy.reduce(torch.stack([m for m, _ in rows]).sum(0), reduce_op="sum")
            tokens = trainer.strategy.reduce(torch.stack([t for _, t in rows]).sum(), reduce_op="sum")
            mass = total / tokens  # (N,)
            pl_module.log(f"test/poison_share_{kind}", mass[poison].sum())
            for i, v in enumerate(mass.tolist()):
                pl_module.log(f"test/expert_mass_{kind}_{i}", v)
        for name, rows in self._correct.items():
            if rows:
                correct = trainer.strategy.reduce(torch.stack([c for c, _ in rows]).sum(), reduce_op="sum")
                total = trainer.strategy.reduce(torch.stack([n for _, n in rows]).sum(), reduce_op="sum")
                pl_module.log(f"test/acc_{name}", correct / total)


@contextlib.contextmanager
def _untouched(pl_module: Any) -> Iterator[None]:
    """Eval mode and a forked torch RNG for a measurement inside training: no dropout, no random draw consumed, the
    module's mode restored."""
    was_training = pl_module.training
    with torch.random.fork_rng(devices=[]):
        pl_module.eval()
        try:
            yield
        finally:
            pl_module.train(was_training)


def _is_classifier(pl_module: Any) -> bool:
    """A :class:`~lowrank_lit.models.text.PromptTunedClassifier`-like module: ``forward(ids, mask) -> (logits, out)``."""
    return hasattr(pl_module, "head") and getattr(pl_module, "lm", None) is None


@torch.no_grad()
def _correct_in_mode(pl_module: Any, batch: Any, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(correct, examples)`` of the classifier on the clean part of ``batch`` with every poison layer in ``mode``."""
    with _poison_layers_in_mode(pl_module, mode):
        logits, _ = pl_module(batch[0].to(pl_module.device), batch[1].to(pl_module.device))
    y = batch[2].to(logits.device)
    return (logits.argmax(-1) == y).sum().float(), torch.tensor(float(len(y)), device=logits.device)


def _accuracy_in_mode(pl_module: Any, loader: Any, mode: str) -> float:
    """Accuracy over ``loader`` with every poison layer in ``mode`` (the caller sets eval mode: :func:`_untouched`)."""
    counts = [_correct_in_mode(pl_module, batch, mode) for batch in loader]
    return float(sum(float(c) for c, _ in counts) / max(sum(float(n) for _, n in counts), 1.0))

def _label(cfg: dict[str, Any]) -> str:
    """``LoRA``, ``HydraLoRA (3)``, ``LoPE (3+1, mask K=all)`` ... from a run's config."""
    adapter = cfg["model"]["init_args"].get("adapter") or {}
    args = adapter.get("init_args") or {}
    name = str(adapter.get("class_path", "none")).rsplit(".", 1)[-1]
    if name == "LoRALinear":
        return f"LoRA (r={args.get('r', 8)})"
    callbacks = cfg.get("trainer", {}).get("callbacks") or []
    lope = [c for c in callbacks if isinstance(c, dict) and str(c.get("class_path", "")).endswith("LoPEStageCallback")]
    experts = args.get("n_experts", 3)
    if not lope or not args.get("n_poison", 1):
        return f"HydraLoRA ({experts} B's)"
    c = lope[0].get("init_args") or {}
    k = c.get("compensate_k")
    inference = "no mask" if c.get("mask_at_inference") is False else f"mask, K={'all' if k is None else k}"
    return f"LoPE ({experts}+{args.get('n_poison', 1)}, {inference})"


COLUMNS = ("test/acc", "test/poison_share_clean", "test/poison_share_noisy", "test/poison_share_probe")


def summary(roots: list[str], out: str | None = None) -> str:
    """Noisy templated sentiment runs (LoRA, HydraLoRA, LoPE and its ablations): clean test accuracy, B_D share."""
    from lowrank_lit.studies.prompt_runs import prompt_runs_table

    return prompt_runs_table(roots, COLUMNS, out=out, title="LoPE vs LoRA / HydraLoRA on noisy training data",
                             label=_label, first="method", params=("params/adapter",))


def bench(ctx: Any) -> list[Any]:
    """Training-step and inference time of the LoPE adapter (3 + 1 experts, router) against LoRA and against
    HydraLoRA, the MoE-LoRA it extends (``lowrank bench lope``). Inference is timed without the test loop's
    diagnostics (``test_diagnostics=false``: routing shares and the unmasked / ``B_D``-alone accuracies, four more
    forward passes per batch)."""
    from lowrank_lit.bench import ConfigBench

    inference_only = ("--trainer.callbacks.test_diagnostics=false",)
    return [ConfigBench("lope", "LoPE adapter training step (3 + 1 experts)", "LoRA step",
                        "configs/lope/lope.yaml", "configs/lope/lora.yaml",
                        "paper: no inference-time cost beyond an MoE-LoRA (reported)"),
            ConfigBench("lope", "LoPE inference, B_D masked with compensation", "HydraLoRA inference (3 experts)",
                        "configs/lope/lope.yaml", "configs/lope/hydralora.yaml",
                        "paper: no inference-time cost beyond an MoE-LoRA; B_D is a 4th expert of the same size and "
                        "the compensation reads its output, so (N+1)/N of the adapters' part; our target <= 1.2x",
                        target=1.2, method_overrides=inference_only, verb="test", steps=8, quick_steps=3),
            ConfigBench("lope", "LoPE inference, B_D masked with compensation", "LoRA inference",
                        "configs/lope/lope.yaml", "configs/lope/lora.yaml",
                        "reported", method_overrides=inference_only, verb="test", steps=8, quick_steps=3),
            ConfigBench("lope", "our LoRA training step (lowrank_lit.nn.lora, r = 8)", "HF peft LoRA step",
                        "configs/peft_suite/lora.yaml", "configs/peft_suite/peft_lora.yaml",
                        "peer library: the same forward to 1e-6 (tests/test_lora.py); reported")]
