"""Compress, adapt, merge: a model quantized with GLVQ (or RTN), adapted with LoRA, merged and quantized again.

A study of three papers' pieces in one ``lowrank fit`` (docs/compose.md): GLVQ's quantizer
(:mod:`lowrank_lit.nn.glvq`), a LoRA adapter on each quantized layer (:mod:`lowrank_lit.nn.lora`, the codes frozen bit
for bit while the adapters train), and the fold of each adapter into its dequantized weight before quantizing again
(:func:`merge_requantize`). :class:`QuantizeAdaptMerge` is the callback that runs it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lowrank_lit.nn.glvq import GLVQLinear, check_bits, layer_inputs, quantize_linear
from lowrank_lit.nn.targets import match_modules, replace_module
from lowrank_lit.report import may_write, save_rows

__all__ = ["QuantizeAdaptMerge", "merge_requantize"]


def merge_requantize(adapted: nn.Module, X: torch.Tensor, bits: int, group_size: int = 32, dim: int = 8,
                     method: str = "glvq", steps: int = 200, init: str = "both") -> tuple[nn.Module, dict[str, float]]:
    """Fold a LoRA adapter into its quantized base and quantize again: ``W = W_hat + (alpha / r) B A``, then
    :func:`quantize_linear` on calibration inputs ``X (N, in)``.

    Args:
        adapted: a :class:`~lowrank_lit.nn.lora.LoRALinear` around a :class:`GLVQLinear` (or an ``nn.Linear``, e.g.
            an RTN-dequantized layer).
        X, bits, group_size, dim, method, steps, init: as :func:`quantize_linear`.

    Returns:
        the re-quantized layer and :func:`quantize_linear`'s report.
    """
    from lowrank_lit.nn.lora import LoRALinear

    if not isinstance(adapted, LoRALinear):
        raise ValueError(f"merge_requantize: {type(adapted).__name__} is not a LoRALinear (per-token routed experts "
                         "cannot be merged)")
    base = adapted.base
    W = base.weight_hat() if isinstance(base, GLVQLinear) else base.weight.detach()  # (out, in)
    dense = nn.Linear(base.in_features, base.out_features, bias=base.bias is not None)
    with torch.no_grad():
        dense.weight.copy_(W + adapted.delta_weight().to(W.dtype))
        if base.bias is not None:
            dense.bias.copy_(base.bias)
    return quantize_linear(dense, X, bits, group_size, dim, method, steps=steps, init=init)


def _accuracy(module: pl.LightningModule, loader: Any) -> float:
    """Top-1 accuracy of ``module`` over ``loader``'s ``(x, y, ...)`` batches (no grad, eval mode restored)."""
    was = module.training
    module.eval()
    right = total = 0
    with torch.no_grad():
        for x, y, *_ in loader:
            right += int((module(x.to(module.device)).argmax(-1) == y.to(module.device)).sum())
            total += len(y)
    module.train(was)
    return right / max(total, 1)


class QuantizeAdaptMerge(pl.Callback):
    """Compress -> adapt -> merge in one ``lowrank fit``: load a trained full-precision model, quantize its target
    layers (GLVQ or RTN), put a LoRA adapter on each quantized layer and train only the adapters (the codes stay
    frozen, bit for bit), then fold each adapter into its dequantized weight and quantize again.

    Logged (and written to ``compose.csv``): ``compose/acc_fp`` (the loaded model), ``compose/acc_quantized``
    (before adapting), ``compose/acc_adapted`` (after training, adapters unmerged), ``compose/codes_unchanged``
    (1.0 when every GLVQ base kept its codes) and, with ``merge``, ``compose/acc_merged``: the merged, re-quantized
    model, which the test loop after fit also evaluates (``test/acc``). Accuracies are on the data module's test
    split.

    Args:
        fp_ckpt: checkpoint of the full-precision run (its weights are loaded at setup).
        targets: module-name patterns of the Linear layers to quantize and adapt.
        method: ``glvq`` or ``rtn``. Default: glvq.
        bits, group_size, dim, steps, init, calib_batches: as :class:`GLVQ`.
        r, alpha: the LoRA rank and scaling numerator. Default: 4, 8.0.
        merge: fold and re-quantize at the end of training. Default: True.
    """

    def __init__(self, fp_ckpt: str, targets: list[str], method: str = "glvq", bits: int = 2, group_size: int = 32,
                 dim: int = 8, steps: int = 200, init: str = "both", calib_batches: int = 8, r: int = 4,
                 alpha: float = 8.0, merge: bool = True) -> None:
        if method not in ("glvq", "rtn"):
            raise ValueError(f"QuantizeAdaptMerge: method={method!r}; allowed: glvq, rtn")
        check_bits(bits)
        if r < 1:
            raise ValueError(f"QuantizeAdaptMerge: r={r}; allowed: an integer >= 1")
        self.fp_ckpt, self.targets, self.method, self.bits = fp_ckpt, list(targets), method, bits
        self.group_size, self.dim, self.steps, self.init, self.calib_batches = group_size, dim, steps, init, calib_batches
        self.r, self.alpha, self.merge = r, alpha, merge
        self.results: dict[str, float] = {}
        self.frozen_codes: dict[str, torch.Tensor] = {}
        self._inputs: dict[str, torch.Tensor] = {}

    def _calibrate(self, trainer: pl.Trainer, pl_module: pl.LightningModule, names: list[str]) -> dict[str, torch.Tensor]:
        return layer_inputs(pl_module, trainer.datamodule.train_dataloader(), names, self.calib_batches)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lowrank_lit.checkpoint import load_checkpoint
        from lowrank_lit.nn.lora import LoRALinear, mark_only_adapters_trainable

        if stage != "fit" or self.results:
            return
        pl_module.load_state_dict(load_checkpoint(self.fp_ckpt, "QuantizeAdaptMerge: fp_ckpt")["state_dict"])
        dm = trainer.datamodule
        dm.setup("fit")
        self.results["acc_fp"] = _accuracy(pl_module, dm.test_dataloader())
        names = [m.name for m in match_modules(pl_module, self.targets, owner="QuantizeAdaptMerge: targets")]
        self._inputs = self._calibrate(trainer, pl_module, names)
        for name in names:
            q, _ = quantize_linear(pl_module.get_submodule(name), self._inputs[name], self.bits, self.group_size,
                                   self.dim, self.method, steps=self.steps, init=self.init)
            replace_module(pl_module, name, q.to(pl_module.device))
        self.results["acc_quantized"] = _accuracy(pl_module, dm.test_dataloader())
        for name in names:
            layer = pl_module.get_submodule(name)
            if isinstance(layer, GLVQLinear):
                self.frozen_codes[name] = layer.packed.clone()
            replace_module(pl_module, name, LoRALinear(layer, r=self.r, alpha=self.alpha).to(pl_module.device))
        mark_only_adapters_trainable(pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lowrank_lit.nn.lora import LoRALinear

        dm = trainer.datamodule
        self.results["acc_adapted"] = _accuracy(pl_module, dm.test_dataloader())
        if self.frozen_codes:  # 1.0: every quantized base kept its codes bit for bit while the adapters trained
            self.results["codes_unchanged"] = float(all(
                torch.equal(pl_module.get_submodule(n).base.packed, c) for n, c in self.frozen_codes.items()))
        if self.merge:  # layer by layer, each calibrated on the inputs the already merged layers before it give
            for name in [n for n, m in pl_module.named_modules() if isinstance(m, LoRALinear)]:
                X = self._calibrate(trainer, pl_module, [name])[name]
                merged, _ = merge_requantize(pl_module.get_submodule(name), X, self.bits, self.group_size, self.dim,
                                             self.method, self.steps, self.init)
                replace_module(pl_module, name, merged.to(pl_module.device))
            self.results["acc_merged"] = _accuracy(pl_module, dm.test_dataloader())
        for logger in trainer.loggers:
            logger.log_metrics({f"compose/{k}": v for k, v in self.results.items()}, step=trainer.global_step)
        if may_write(trainer):
            save_rows(trainer, [self.results], "compose.csv")
