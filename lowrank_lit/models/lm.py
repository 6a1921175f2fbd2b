"""Causal language models from a ``transformers`` config (random init, nothing downloaded).

``llama(...)`` builds a Llama-style decoder (``LlamaForCausalLM``) of any size; ``CausalLanguageModel``
trains any such model with next-token cross-entropy, logging ``{train,val}/loss`` (nats per token)
and ``val/bpc`` (bits per character for byte-level data).

The optimizer receives :func:`lowrank_lit.optim.matrix_param_groups`: the attention and MLP weight
matrices (``lowrank=True, nano=True``) and everything else (embeddings, LM head, norms: dense).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn

from lowrank_lit.checkpoint import load_checkpoint
from lowrank_lit.hub import from_pretrained
from lowrank_lit.optim import WarmupCosineLR, matrix_param_groups
from lowrank_lit.sharding import Shardable

__all__ = ["llama", "CausalLanguageModel", "PaddedCausalLM"]


def llama(
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 256,
    context: int = 64,
    tie_embeddings: bool = False,
) -> nn.Module:
    """A randomly initialised ``transformers`` Llama decoder (defaults: the card's 2-layer, d=64 model).

    Args:
        vocab_size: tokens (128 for ASCII bytes). Default: 128.
        hidden_size: model width d. Default: 64.
        num_layers: decoder blocks. Default: 2.
        num_heads: attention heads. Default: 4.
        intermediate_size: MLP width. Default: 256.
        context: maximum sequence length. Default: 64.
        tie_embeddings: share input and output embeddings. Default: False.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_heads:
        raise ValueError(f"llama: hidden_size={hidden_size} must be divisible by num_heads={num_heads}")
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        max_position_embeddings=context, tie_word_embeddings=tie_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return LlamaForCausalLM(cfg)


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


class CausalLanguageModel(Shardable, pl.LightningModule):
    """Next-token training of a causal LM ``backbone(input_ids) -> logits``.

    Args:
        backbone: a model whose output has ``.logits`` (transformers) or is the logits ``(B, T, V)``.
        optimizer: optimizer factory; receives the two param groups. Default: AdamW(lr=3e-3).
        lr_scheduler: optional scheduler (stepped every optimizer step); a ``WarmupCosineLR`` without
            ``total_steps`` gets the run's length. Default: None.
        dense: name patterns of 2-D weights that stay dense. Default: embeddings and the LM head.
        init_from: a checkpoint of an earlier run whose model weights start this one (fine-tuning;
            optimizer state and step count are not taken). Default: None.
    """

    def __init__(
        self,
        backbone: nn.Module,
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        dense: list[str] | None = None,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone", "optimizer", "lr_scheduler"], logger=False)
        self.backbone = backbone
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.dense = ["*embed*", "*lm_head*", "*wte*", "*wpe*"] if dense is None else list(dense)
        if init_from is not None:
            self.load_weights(init_from)

    def load_weights(self, path: str) -> None:
        """Copy the model weights of a Lightning checkpoint (same architecture) into this module."""
        import os

        if not os.path.isfile(path):
            raise FileNotFoundError(f"CausalLanguageModel: init_from={path!r} does not exist")
        ckpt = load_checkpoint(path, "CausalLanguageModel: init_from")
        state = ckpt.get("state_dict", ckpt)
        try:
            missing, unexpected = self.load_state_dict(state, strict=False)
        except RuntimeError as err:  # shape mismatches
            raise ValueError(f"CausalLanguageModel: init_from={path!r} does not match the model: {str(err).splitlines()[-1].strip()}") from None
        if missing or unexpected:
            raise ValueError(f"CausalLanguageModel: init_from={path!r} does not match the model "
                             f"(missing {missing[:3]}..., unexpected {unexpected[:3]}...)")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = self.backbone(input_ids)
        return out.logits if hasattr(out, "logits") else out  # (B, T, V)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        self.log("val/bpc", loss / math.log(2), sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("test/loss", loss, sync_dist=True)
        self.log("test/bpc", loss / math.log(2), sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(matrix_param_groups(self.backbone, dense=self.dense))
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        if isinstance(scheduler, WarmupCosineLR) and scheduler.total_steps is None:
            scheduler.set_total_steps(int(self.trainer.estimated_stepping_batches))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class PaddedCausalLM(nn.Module):
    """Any ``transformers`` causal LM behind the packed-batch interface of
    :class:`lowrank_lit.nn.context_parallel.PackedCausalLM` (``forward(packed)``, ``targets(packed)``), for
    Skrull's data-parallel training: the whole sequences of a micro-batch are padded to the longest (attention
    mask; positions restart at 0 per sequence, so no sequence attends to another) and the logits come back in
    the packed order.

    Args:
        model: a causal LM module (e.g. :func:`llama`); or None with ``name_or_path``. Default: None.
        name_or_path: a local folder with a ``from_pretrained`` checkpoint (your model; nothing is downloaded). Default: None.
        dtype: ``float32`` or ``bfloat16`` for ``name_or_path``. Default: float32.
    """

    def __init__(self, model: nn.Module | None = None, name_or_path: str | None = None, dtype: str = "float32") -> None:
        super().__init__()
        if (model is None) == (name_or_path is None):
            raise ValueError("PaddedCausalLM: give exactly one of model= or name_or_path=")
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"PaddedCausalLM: dtype={dtype!r}; allowed: float32, bfloat16")
        if model is None:
            import os

            from transformers import AutoModelForCausalLM

            if not os.path.isdir(str(name_or_path)):
                raise FileNotFoundError(f"PaddedCausalLM: name_or_path={name_or_path!r} is not a local folder")
            model = from_pretrained(AutoModelForCausalLM, name_or_path, torch_dtype=getattr(torch, dtype), local_files_only=True)
        self.model = model

    def forward(self, packed: dict[str, Any], group: Any = None) -> torch.Tensor:
        dist = packed["dist"]["tokens"]
        if group is not None or len(dist):
            raise ValueError("PaddedCausalLM runs whole sequences only (data parallel); sharded sequences need "
                             "lowrank_lit.nn.context_parallel.PackedCausalLM")
        loc = packed["local"]
        _, counts = torch.unique_consecutive(loc["seq"], return_counts=True)
        seqs = torch.split(loc["tokens"], counts.tolist())
        longest = int(counts.max())
        ids = torch.zeros(len(seqs), longest, dtype=torch.long, device=loc["tokens"].device)  # (B, L)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits  # (B, L, V)
        return torch.cat([logits[i, : len(s)] for i, s in enumerate(seqs)])

    @staticmethod
    def computed_tokens(lengths: list[int]) -> int:
        """Positions one forward pass over whole sequences of ``lengths`` computes: each padded to the longest."""
        return len(lengths) * max(lengths, default=0)

    @staticmethod
    def targets(packed: dict[str, Any]) -> torch.Tensor:
        return torch.cat([packed["local"]["targets"], packed["dist"]["targets"]])
