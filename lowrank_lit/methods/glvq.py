"""GLVQ: grouped lattice vector quantization of Linear weights with Babai rounding.

Zhang, Wu, Wang, Lin, *Learning Grouped Lattice Vector Quantizers for Low-Bit LLM Compression*,
NeurIPS 2025 (arXiv 2510.20984). The official repository (xzhang9308/GLVQ) holds no code yet.

Each group of ``group_size`` input columns of a weight ``W (m, n)`` gets its own lattice
``{G z : z in Z^d}`` (generation matrix ``G (d, d)``) and, optionally, a mu-law compander. The group's
``m x group_size`` weights are cut into ``d``-vectors (row-major: ``d`` consecutive entries of a row,
inferred), ``Y (d, L)``:

    encode:  z = clamp(round(G^-1 F_mu(w / s) - o), -2^(b-1), 2^(b-1) - 1)    (Babai rounding, b bits)
    decode:  w_hat = s * F_mu^-1(G (z + o))   F_mu(w) = sign(w) ln(1 + mu |w|) / ln(1 + mu)

The codebook (``codebook``, inferred: neither the paper nor its repository, which holds no code, says): ``integer``
(``o = 0``, the default) is the lattice ``G Z^d`` clamped to the b-bit integer range, asymmetric about 0 (2 bits:
levels -2, -1, 0, 1); ``symmetric`` (``o = 1/2``) is its coset shifted by half a step, symmetric about 0 (2 bits:
-3/2, -1/2, 1/2, 3/2). The codes are stored the same way; docs/methods/glvq.md has the table of both.

``s = max |W_g|`` when companding (else 1). ``G`` (and ``mu``) minimise the calibration output error
``||(W_g - W_hat_g) X_g||_F^2 = tr(E H_g E^T)`` with ``H_g = X_g X_g^T`` (only the Gram matrix is needed),
by alternating Babai rounding (codes fixed, no gradient) and Adam steps on ``G`` (the decode is smooth in
``G`` for fixed codes: no straight-through estimator), with ``G``'s singular values clamped to
``[sigma_min, sigma_max]`` and the best iterate kept. ``G`` starts from the card's ``G_0`` (the Cholesky
factor of the d-vectors' covariance, scaled by ``c / 2^(b-1)`` with ``c`` grid-searched on the loss) and,
in a second run, from the best scalar lattice ``G = s I`` (grid search on the same loss); the better run
is kept (``init="both"``, default). The scalar lattice is the keep-best baseline, so GLVQ's calibration
error is never above the scalar lattice's: per group by the keep-best rule, and per layer because :func:`select_groups` keeps a group's
scalar lattice where the cross-group terms of the layer error favour it (inferred). ``mu`` is initialised from the group kurtosis (``clip(10 kappa, 10, 255)``, inferred) and
projected to [10, 255] after every step.

Salience-determined bit allocation (SDBA, from Slim-LLM): with target ``N`` bits, the ``k`` most salient
groups (salience ``sum_ij w_ij^2 ||X_j||^2``) get ``N+1`` bits, the ``k`` least salient ``N-1``, the rest
``N``; ``k`` in ``[0, groups/2]`` minimises the layer output error. Storage per layer: codes at ``b_g``
bits per weight plus one fp16 ``d x d`` matrix and one fp16 ``mu`` per group:
``sum_g (m * group_size * b_g) + groups * (d^2 + 1) * 16`` bits.

Baselines: per-group RTN (min-max uniform per row and column group) and the best scalar lattice (``G = s I``).
Inferred choices (the paper leaves them open) are marked "inferred".

This file holds the paper's component, the :class:`GLVQ` callback, with the summary and the cost benchmark of its
runs. The quantizer itself and :class:`~lowrank_lit.nn.glvq.GLVQLinear`, the layer that serves the codes, are in
:mod:`lowrank_lit.nn.glvq` (the compress-adapt-merge study, :mod:`lowrank_lit.studies.compress_adapt_merge`, uses them
too); the function names below refer to that module.
"""

from __future__ import annotations

import statistics
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn

from lowrank_lit.nn.glvq import (
    INITS,
    METHODS,
    GLVQLinear,
    check_bits,
    check_codebook,
    decode_groups,
    layer_inputs,
    quantize_linear,
    save_quantized,
)
from lowrank_lit.nn.targets import match_modules, replace_module
from lowrank_lit.registry import register_method
from lowrank_lit.report import (
    Run,
    artifact_path,
    markdown_table,
    may_write,
    new_figure,
    read_runs,
    save_figure,
    save_rows,
)

__all__ = ["GLVQ", "summary", "summarize", "bench"]

PAPER = "Learning Grouped Lattice Vector Quantizers for Low-Bit LLM Compression (GLVQ)"


@register_method("glvq", kind="Callback", paper=PAPER, summary="summary", bench="bench")
class GLVQ(pl.Callback):
    """Post-training quantization at the start of ``lowrank test``: calibrate, quantize, evaluate, save.

    Collects the inputs of the layers matching ``targets`` on ``calib_batches`` training batches
    (forward hooks), replaces each by its quantized version (:func:`quantize_linear`), writes
    ``quantization.csv`` (per layer: relative output error, bits per weight) and the quantized
    ``state_dict`` (``quantized.pt``) to the run directory; the test loop then evaluates the quantized
    model. Run it on a trained checkpoint: ``lowrank test --config ... --ckpt_path <fit run>/last.ckpt``.

    Args:
        targets: module-name patterns of the Linear layers to quantize.
        method: ``glvq``, ``scalar`` (best scalar lattice) or ``rtn``. Default: glvq.
        bits: bits per weight (the average with ``sdba``). Default: 2.
        group_size: input columns per group. Default: 32 (card's CPU setting; the paper uses 128).
        dim: lattice dimension d. Default: 8.
        compand: learn a mu-law compander per group. Default: False.
        sdba: salience-determined N-1 / N / N+1 bit allocation. Default: False.
        steps: optimisation steps per group (per start). Default: 200.
        calib_batches: training batches whose activations calibrate. Default: 8 (512 images at batch 64).
        init: starting generation matrix of ``glvq``: ``cholesky`` (the card's G_0), ``scalar`` (the best
            scalar lattice) or ``both`` (one run from each, the better kept). Default: both.
        compact: serve the quantized layers in compact mode (:class:`GLVQLinear`: decoded on the fly, no dense
            weight kept). Default: False (decoded once and cached).
        codebook: ``integer`` (the lattice clamped to the b-bit integers) or ``symmetric`` (its coset shifted by half
            a step, symmetric about 0); ``glvq`` and ``scalar`` only. Default: integer.
    """

    def __init__(self, targets: list[str], method: str = "glvq", bits: int = 2, group_size: int = 32, dim: int = 8,
                 compand: bool = False, sdba: bool = False, steps: int = 200, calib_batches: int = 8,
                 init: str = "both", compact: bool = False,
                 codebook: Literal["integer", "symmetric"] = "integer") -> None:
        if method not in METHODS:
            raise ValueError(f"GLVQ: method={method!r}; allowed: {', '.join(METHODS)}")
        check_bits(bits)
        check_codebook(codebook)
        self.codebook = codebook
        if sdba and bits < 2:
            raise ValueError(f"GLVQ: bits={bits} with sdba; allowed: >= 2")
        if calib_batches < 1:
            raise ValueError(f"GLVQ: calib_batches={calib_batches!r}; allowed: >= 1")
        if init not in INITS:
            raise ValueError(f"GLVQ: init={init!r}; allowed: {', '.join(INITS)}")
        self.init, self.compact = init, compact
        self.targets, self.method, self.bits, self.group_size, self.dim = list(targets), method, bits, group_size, dim
        self.compand, self.sdba, self.steps, self.calib_batches = compand, sdba, steps, calib_batches
        self.report: list[dict[str, Any]] = []

    def _layers(self, module: nn.Module) -> list[tuple[str, nn.Module]]:
        found = [(m.name, m.module) for m in match_modules(module, self.targets, owner="GLVQ: targets")]
        for n, m in found:
            if isinstance(m, GLVQLinear):
                raise ValueError(f"GLVQ: {n!r} is already quantized")
            if not isinstance(m, nn.Linear):
                raise ValueError(f"GLVQ: {n!r} is a {type(m).__name__}, not an nn.Linear")
        return found

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        layers = self._layers(pl_module)
        trainer.datamodule.setup("fit")
        X_of = layer_inputs(pl_module, trainer.datamodule.train_dataloader(), [n for n, _ in layers], self.calib_batches)
        self.report = []
        for name, lin in layers:
            X = X_of[name]
            q, rep = quantize_linear(lin, X, self.bits, self.group_size, self.dim, self.method, self.compand, self.sdba, self.steps,
                                     self.init, self.codebook)
            if isinstance(q, GLVQLinear):
                q.set_compact(self.compact)
            replace_module(pl_module, name, q.to(pl_module.device))
            self.report.append({"layer": name, **rep})
        for logger in trainer.loggers:
            logger.log_metrics({f"glvq/{r['layer']}/{k}": r[k] for r in self.report for k in ("rel_error", "bits_per_weight")}, step=0)
        if may_write(trainer):
            save_rows(trainer, self.report, "quantization.csv")
            torch.save(pl_module.state_dict(), artifact_path(trainer, "quantized.pt"))
            if any(isinstance(m, GLVQLinear) for m in pl_module.modules()):  # packed codes, readable without us
                save_quantized(pl_module, str(artifact_path(trainer, "quantized.safetensors")))


def summarize(run_dirs: list[str]) -> list[dict[str, Any]]:
    """Method, bits, per-layer relative error, bits per weight and test accuracy of quantization runs."""

    rows = []
    for run in map(Run, run_dirs):
        cfg = run.config
        cb = [c for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith(".GLVQ")][0]["init_args"]
        layers = run.rows("quantization.csv")
        acc = {k: v for k, v in run.metrics.items() if k in ["test/acc"]}.get("test/acc", float("nan"))
        label = cb.get("method", "glvq") + (" + mu-law" if cb.get("compand") else "") + (" + SDBA" if cb.get("sdba") else "")
        rows.append({"method": label, "bits": cb.get("bits", 2), "errors": [float(r["rel_error"]) for r in layers],
                     "bits_per_weight": float(layers[0]["bits_per_weight"]), "acc": acc})
    return sorted(rows, key=lambda r: (r["bits"], r["method"]))


def summary(roots: list[str], out: str | None = None) -> str:
    """GLVQ / scalar-lattice / RTN quantization runs: per-layer error, stored bits, test accuracy (and a bar plot)."""

    dirs = read_runs(roots, "quantization.csv")
    rows = summarize(dirs)
    table = markdown_table(
        ["bits", "method", "rel. output error, layer 1", "layer 2", "stored bits / weight", "test acc"],
        [[r["bits"], r["method"], f"{r['errors'][0]:.4f}", f"{r['errors'][-1]:.4f}", f"{r['bits_per_weight']:.3f}",
          f"{r['acc']:.4f}"] for r in rows],
    )
    if out:
        fig, ax = new_figure(figsize=(7.5, 3.8))
        labels = [f"{r['method']}\n{r['bits']} bit" for r in rows]
        for j in range(len(rows[0]["errors"])):
            ax.bar([i + 0.4 * j for i in range(len(rows))], [r["errors"][j] for r in rows], width=0.4, label=f"layer {j + 1}")
        ax.set_xticks([i + 0.2 for i in range(len(rows))])
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("relative output error")
        ax.set_title("Quantized layers: relative output error per method and bit width", fontsize=9)
        ax.legend(fontsize=8)
        save_figure(fig, out)
    return table


def bench(ctx: Any) -> list[Any]:
    """GLVQ's batched decode against RTN dequantization, and a cached GLVQLinear forward against nn.Linear
    (``lowrank bench glvq``)."""
    from lowrank_lit.bench import mib, ratio_row, tensor_bytes

    side = ctx.size(1024, 256)
    torch.manual_seed(0)
    lin = nn.Linear(side, side).to(ctx.device)
    q, _ = quantize_linear(lin, torch.randn(256, side, device=ctx.device), 2, 128, 8, "glvq", steps=ctx.size(5, 2))
    W = lin.weight.detach()
    Wg = W.reshape(side, side // 128, 128)
    lo, hi = Wg.amin(dim=2, keepdim=True), Wg.amax(dim=2, keepdim=True)
    step = (hi - lo).clamp_min(1e-12) / 3
    codes = torch.round((Wg - lo) / step).clamp(0, 3).to(torch.uint8)

    # both decode from byte codes: RTN's uint8 codes, GLVQ's int8 codes as unpacked once from the bit-packed state
    # (at load in cached mode; the compact mode's per-call unpack is timed in benchmarks/glvq_decode.py's serving table)
    n_groups = q.G.shape[0]
    unpacked = q.group_codes(0, n_groups)
    offset = float(q.offset)

    def decode() -> None:
        decode_groups(q.G, unpacked, q.mu, q.scale, side, 128, offset)

    times = ctx.compare({"GLVQ": decode, "RTN": lambda: (codes.to(torch.float32) * step + lo).reshape(side, side),
                         "unpack": lambda: q.group_codes(0, n_groups)}, ctx.rounds(20, 3), warmup=1)
    x = torch.randn(64, side, device=ctx.device)
    q.weight_hat()
    fwd = ctx.compare({"GLVQ": lambda: q(x), "dense": lambda: lin(x)}, ctx.rounds(50, 5), warmup=2)
    note = f"{side} x {side}, groups of 128, d = 8, 2 bits"
    unpack_ms = 1e3 * statistics.median(times["unpack"])  # as ratio_row's medians
    return [ratio_row(ctx, "glvq", "GLVQ decode of a layer from int8 codes (batched float32)",
                      "RTN dequantize from uint8 codes (lo + step * q)", times, "GLVQ", "RTN", "our target <= 2x RTN", 2.0,
                      note=f"{note}; unpacking the 2-bit packed codes to int8 (once per load): {unpack_ms:.2f} ms"),
            ratio_row(ctx, "glvq", "GLVQLinear forward (decoded weight cached)", "nn.Linear forward", fwd, "GLVQ", "dense",
                      "reported (the cache holds a dense float weight)", memory=f"GLVQLinear {mib(tensor_bytes(q, q._cache))} vs "
                      f"{mib(tensor_bytes(lin))}", note=note)]
