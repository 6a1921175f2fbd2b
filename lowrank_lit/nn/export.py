"""What a layer is outside this package: the protocol ``lowrank export`` reads, so the exporter names no layer.

The way each of ``peft``'s tuner configs owns its serialisation, each adapter or prompt here says how it is written
in another library's terms, or why it cannot be:

* ``to_peft() -> PeftExport``: the peft type, the peft config arguments the layer fixes (rank, alpha, dropout;
  number of virtual tokens) and peft's state-dict entries relative to the layer's own name. A layer that has no
  peft type raises :class:`ExportRefused` with the reason.
* ``unwrap(merge: bool) -> nn.Module``: an adapter's base layer, with the adapter folded into it when ``merge``
  (what a plain ``transformers`` model holds). An adapter that cannot be folded raises :class:`ExportRefused`.
* ``factorize(model, keep, targets) -> model`` on a callback: the model with its target layers replaced by low-rank
  factors keeping the share ``keep`` of each target's parameters (``--format factors``; Q3R's callback has it).

``lowrank_lit.launch.export`` finds adapters by ``unwrap``, prompts and adapters by ``to_peft`` and factorizers
by ``factorize``; a new layer or method gets a format by implementing the method, not by an edit to the exporter.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["PeftExport", "ExportRefused", "is_adapter", "is_peft_exportable"]


class ExportRefused(ValueError):
    """A layer cannot be written in the asked format; the message is the reason (one line)."""


class PeftExport(NamedTuple):
    """One layer in peft's terms.

    Attributes:
        peft_type: ``"LORA"`` or ``"PROMPT_TUNING"`` (``peft.PeftType`` names).
        config: the peft config's keyword arguments this layer fixes (``r``, ``lora_alpha``, ``lora_dropout``;
            ``num_virtual_tokens``).
        state: peft's state-dict entries, keyed relative to the layer's name (``lora_A.weight``), or absolute for a
            model-level tensor (``prompt_embeddings``).
    """

    peft_type: str
    config: dict[str, Any]
    state: dict[str, torch.Tensor]


def is_adapter(module: nn.Module) -> bool:
    """True for a layer wrapped around a base layer that it can hand back (``unwrap``)."""
    return callable(getattr(module, "unwrap", None))


def is_peft_exportable(module: nn.Module) -> bool:
    """True for a layer that says what it is in peft's terms (``to_peft``), or why it cannot."""
    return callable(getattr(module, "to_peft", None))
