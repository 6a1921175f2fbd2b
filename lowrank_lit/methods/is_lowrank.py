"""Low-rank (GaLore-style) Adam with an importance-sampled subspace.

Zhang, Yin, Wang, Liu, Yang, Zhang, Shrivastava, Braverman, *Breaking the Frozen Subspace: Importance
Sampling for Low-Rank Optimization in LLM Pretraining*, NeurIPS 2025 (arXiv 2502.05790). No official
code was found. Baseline: GaLore (Zhao et al., ICML 2024, github.com/jiaweizzhao/GaLore).

For each low-rank weight with gradient ``G (m, n)``, every ``update_proj_gap`` steps (including the
first) ``G = U S V^T`` (float32) and r singular directions ``I`` are chosen:

* ``dominant`` (GaLore): ``I = {1..r}``;
* ``importance`` (this paper): r distinct indices drawn without replacement with probability
  proportional to ``sigma`` (``torch.multinomial(sigma / sum(sigma), r, replacement=False)``), no
  reweighting. Zero singular values are never drawn; if fewer than r are non-zero the missing indices
  are filled in sigma order (an all-zero gradient gives the first r).

Projection side ``std`` (GaLore): ``m >= n`` -> right projector ``Q = V[:, I]^T (r, n)``, ``R = G Q^T``;
else left ``P = U[:, I] (m, r)``, ``R = P^T G``. Adam runs on R (moments of shape (m, r) or (r, n), kept
across projector changes): ``N = m_t / (sqrt(v_t) + eps)``, ``step = lr sqrt(1 - b2^t) / (1 - b1^t)``,
``W <- W - step * scale * (P N or N Q)``, then decoupled decay ``W <- W - lr wd W``. Parameters outside
low-rank groups get the same AdamW update without projection. Applying the sampled indices to V on
the right side is inferred (the paper describes columns of U).

DDP: gradients are all-reduced before ``step`` so every rank computes the same SVD; the sampling
generator is seeded with ``seed`` (default: the run seed) on every rank, so all ranks draw the same indices (saved in the
optimizer's ``state_dict`` for resuming).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.optim import SeededOptimizer, adam_moments_, bias_corrections
from lowrank_lit.registry import register_method
from lowrank_lit.report import (
    Run,
    class_label,
    markdown_table,
    may_write,
    new_figure,
    read_runs,
    save_figure,
    save_rows,
)

__all__ = [
    "LowRankAdam",
    "select_subspace",
    "projector_overlap",
    "effective_rank",
    "SubspaceOverlap",
    "plot_overlap",
    "summary_table",
]

PAPER = "Breaking the Frozen Subspace: Importance Sampling for Low-Rank Optimization in LLM Pretraining"
SELECTORS = ("dominant", "importance")
PROJ_TYPES = ("std", "reverse_std", "left", "right")


def select_subspace(sigma: torch.Tensor, rank: int, selector: str = "dominant", generator: torch.Generator | None = None) -> torch.Tensor:
    """Indices (into the descending singular values ``sigma``) of the r directions to keep.

    ``dominant``: ``0..r-1``. ``importance``: r distinct draws with probability proportional to sigma
    among the non-zero ones, filled up in sigma order when fewer than r are non-zero.
    """
    if selector == "dominant":
        return torch.arange(rank)
    if selector != "importance":
        raise ValueError(f"select_subspace: selector={selector!r}; allowed: {', '.join(SELECTORS)}")
    s = sigma.detach().double().cpu()
    nonzero = int((s > 0).sum())
    draws = min(rank, nonzero)
    chosen = torch.multinomial(s / s.sum(), draws, replacement=False, generator=generator) if draws else torch.empty(0, dtype=torch.long)
    if draws < rank:  # documented fallback: the missing indices in sigma order
        rest = [i for i in range(len(s)) if i not in set(chosen.tolist())]
        chosen = torch.cat([chosen, torch.tensor(rest[: rank - draws], dtype=torch.long)])
    return chosen


def projector_overlap(new: torch.Tensor, old: torch.Tensor) -> float:
    """``||P_new^T P_old||_F^2 / r`` for (m, r) projectors, or rows for (r, n): 1 = the same subspace."""
    if new.shape[0] < new.shape[1]:  # (r, n) right projector: rows are the basis
        new, old = new.T, old.T
    return float((new.T @ old).pow(2).sum() / new.shape[1])


def effective_rank(matrix: torch.Tensor, energy: float = 0.9) -> int:
    """Number of singular values holding ``energy`` of the squared Frobenius norm (0 for a zero matrix)."""
    s2 = torch.linalg.svdvals(matrix.detach().double()).pow(2)
    total = float(s2.sum())
    if total == 0:
        return 0
    return int((torch.cumsum(s2, 0) / total < energy).sum()) + 1


@register_method("is_lowrank", kind="Optimizer", paper=PAPER, summary="summary", bench="bench")
class LowRankAdam(SeededOptimizer):
    """Adam whose moments live in an r-dimensional projection of each weight matrix's gradient.

    Groups with ``lowrank=True`` (the default) must hold only 2-D tensors; others (embeddings, head,
    norms, biases) get plain AdamW. Every hyperparameter below may be set per group.

    Args:
        params: parameters or param groups.
        lr: learning rate. Default: 1e-3.
        betas: Adam's coefficients. Default: (0.9, 0.999).
        eps: Adam's epsilon. Default: 1e-6 (GaLore's AdamW).
        weight_decay: decoupled weight decay. Default: 0.0.
        rank: projection rank r (1 <= r <= min(m, n)). Default: 8.
        update_proj_gap: steps tau between projector refreshes. Default: 200 (GaLore).
        scale: alpha, the scale of the back-projected update. Default: 0.25 (GaLore).
        proj_type: ``std`` (project the smaller side), ``reverse_std``, ``left`` or ``right``. Default: std.
        selector: ``dominant`` (GaLore) or ``importance`` (this paper). Default: importance.
        seed: seed of the importance sampling; None takes the run seed (``torch.initial_seed()``, the same
            on every DDP rank after ``seed_everything``). Default: None.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: LearningRate = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        rank: int = 8,
        update_proj_gap: int = 200,
        scale: float = 0.25,
        proj_type: str = "std",
        selector: str = "importance",
        seed: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, rank=rank,
            update_proj_gap=update_proj_gap, scale=scale, proj_type=proj_type, selector=selector, lowrank=True,
        )
        super().__init__(params, defaults, seed)
        for group in self.param_groups:
            self._check(group)

    @staticmethod
    def _check(g: dict[str, Any]) -> None:
        where = "LowRankAdam"
        SeededOptimizer.check_adam(g, where)
        if not g["lowrank"]:
            return
        if not (isinstance(g["update_proj_gap"], int) and g["update_proj_gap"] >= 1):
            raise ValueError(f"{where}: update_proj_gap={g['update_proj_gap']!r}; allowed: an integer >= 1")
        if not g["scale"] > 0:
            raise ValueError(f"{where}: scale={g['scale']!r}; allowed: > 0")
        if g["selector"] not in SELECTORS:
            raise ValueError(f"{where}: selector={g['selector']!r}; allowed: {', '.join(SELECTORS)}")
        if g["proj_type"] not in PROJ_TYPES:
            raise ValueError(f"{where}: proj_type={g['proj_type']!r}; allowed: {', '.join(PROJ_TYPES)}")
        for i, p in enumerate(g["params"]):
            if p.ndim != 2:
                raise ValueError(
                    f"{where}: a low-rank group holds parameter {i} of shape {tuple(p.shape)}; only 2-D weights are "
                    "allowed (put embeddings/biases/norms in a group with lowrank=False)"
                )
            if not (isinstance(g["rank"], int) and 1 <= g["rank"] <= min(p.shape)):
                raise ValueError(f"{where}: rank={g['rank']!r} for a parameter of shape {tuple(p.shape)}; allowed: 1..{min(p.shape)}")

    def steady_state_bytes(self) -> int:
        """Bytes of the optimizer state once every parameter has stepped (``lowrank estimate``; no step needed, so it
        works on the meta device where the SVD cannot run): per low-rank weight
        ``(m, n)`` the projector and the two moments in the rank-r space, per dense parameter two moments."""
        total = 0
        for g in self.param_groups:
            for p in g["params"]:
                size = p.element_size()
                if g["lowrank"]:
                    (m, n), r = p.shape, g["rank"]
                    left = self._side(p.shape, g["proj_type"]) == "left"
                    total += size * ((m * r if left else r * n) + 2 * (r * n if left else m * r))
                else:
                    total += size * 2 * p.numel()
        return total

    def elementwise(self, p: torch.Tensor, group: dict[str, Any]) -> bool:
        return not group["lowrank"]  # AdamW outside the low-rank groups

    def _side(self, shape: torch.Size, proj_type: str) -> str:
        m, n = shape
        if proj_type == "left" or proj_type == "right":
            return proj_type
        std_right = m >= n
        return ("right" if std_right else "left") if proj_type == "std" else ("left" if std_right else "right")

    def _refresh(self, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        U, S, Vh = torch.linalg.svd(grad.float(), full_matrices=False)  # (m, q), (q,), (q, n)
        idx = select_subspace(S, group["rank"], group["selector"], self.generator).to(grad.device)
        side = self._side(grad.shape, group["proj_type"])
        proj = U[:, idx] if side == "left" else Vh[idx, :]  # (m, r) or (r, n)
        proj = proj.to(grad.dtype)
        if "projector" in state:
            state["overlap"] = projector_overlap(proj, state["projector"])
            state["overlaps"] = state.get("overlaps", 0) + 1
        state["projector"], state["side"] = proj, side

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any], t: int) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        lowrank = group["lowrank"]
        if lowrank:
            if not bool(torch.isfinite(grad).all()):
                raise RuntimeError(f"LowRankAdam: non-finite gradient (NaN/Inf) in a {tuple(p.shape)} weight at step {t}")
            if t % group["update_proj_gap"] == 0:
                self._refresh(grad, state, group)
            P = state["projector"]
            grad = P.T @ grad if state["side"] == "left" else grad @ P.T  # (r, n) or (m, r)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        adam_moments_(m, v, grad, b1, b2)
        bc1, bc2 = bias_corrections(b1, b2, t + 1)
        step_size = lr * math.sqrt(bc2) / bc1
        norm = m / (v.sqrt() + eps)
        if lowrank:
            P = state["projector"]
            norm = group["scale"] * (P @ norm if state["side"] == "left" else norm @ P)  # (m, n)
        p.add_(norm, alpha=-step_size)
        if wd:
            p.add_(p, alpha=-lr * wd)


class SubspaceOverlap(pl.Callback):
    """Logs the overlap of consecutive projectors and the effective rank of ``W_t - W_0``.

    After every projector refresh of a :class:`LowRankAdam`: ``subspace/overlap`` (mean over the
    low-rank weights of ``||P_k^T P_{k-1}||_F^2 / r``; 1 = frozen subspace). Every ``erank_every``
    steps and at the end of training: ``subspace/erank`` (mean number of singular values holding 90%
    of the energy of ``W_t - W_0``). Writes ``subspace.csv`` (step, overlap, erank) to the run directory.

    Args:
        erank_every: steps between effective-rank evaluations. Default: 250.
    """

    def __init__(self, erank_every: int = 250) -> None:
        if erank_every < 1:
            raise ValueError(f"SubspaceOverlap: erank_every={erank_every!r}; allowed: an integer >= 1")
        self.erank_every = erank_every
        self.rows: list[dict[str, Any]] = []

    @staticmethod
    def _lowrank_params(trainer: pl.Trainer) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """2-D parameters of groups flagged ``lowrank`` (any optimizer; missing flag = True) and their state."""
        return [(p, opt.state[p]) for opt in trainer.optimizers for g in opt.param_groups
                if g.get("lowrank", True) for p in g["params"] if p.ndim == 2]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the same matrices for every optimizer (AdamW too, via matrix_param_groups' flags): comparable ranks
        self.start = {p: p.detach().clone() for p, _ in self._lowrank_params(trainer)}
        self.seen: dict[int, int] = {}

    def _erank(self) -> float:
        ranks = [effective_rank(p.detach() - w0) for p, w0 in self.start.items()]
        return sum(ranks) / max(len(ranks), 1)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        new = []
        for p, st in self._lowrank_params(trainer):
            if st.get("overlaps", 0) > self.seen.get(id(p), 0):  # only LowRankAdam records overlaps
                self.seen[id(p)] = st["overlaps"]
                new.append(st["overlap"])
        row: dict[str, Any] = {}
        if new:
            row["overlap"] = sum(new) / len(new)
            pl_module.log("subspace/overlap", row["overlap"])
        if step % self.erank_every == 0:
            row["erank"] = self._erank()
            pl_module.log("subspace/erank", row["erank"])
        if row:
            self.rows.append({"step": step, "overlap": row.get("overlap", ""), "erank": row.get("erank", "")})

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rows.append({"step": trainer.global_step, "overlap": "", "erank": self._erank()})
        if may_write(trainer):
            save_rows(trainer, self.rows, "subspace.csv")


def plot_overlap(run_dirs: Sequence[str], out: str, labels: Sequence[str] | None = None) -> str:
    """Projector overlap vs step, one line per run directory (from ``subspace.csv``)."""
    import csv

    fig, ax = new_figure(figsize=(7, 4))
    colors: dict[str, str] = {}
    for i, d in enumerate(run_dirs):
        with open(os.path.join(d, "subspace.csv")) as f:
            rows = [r for r in csv.DictReader(f) if r["overlap"] not in ("", None)]
        label = labels[i] if labels else os.path.basename(os.path.normpath(d))
        color = colors.setdefault(label.split(",")[0], f"C{len(colors)}")  # one color per optimizer
        ax.plot([int(r["step"]) for r in rows], [float(r["overlap"]) for r in rows], marker=".", color=color, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("overlap of consecutive projectors")
    ax.set_ylim(0, 1.02)
    ax.set_title("Overlap of consecutive low-rank projectors (1: the subspace never moves)", fontsize=9)
    ax.legend(fontsize=8)
    return save_figure(fig, out)



def _run_summary(run_dir: str) -> dict[str, Any]:
    """Optimizer label, seed, final val/loss, late projector overlap and final effective rank of one run."""

    run = Run(run_dir)
    cfg = run.config
    opt = cfg["model"]["init_args"]["optimizer"]
    name = class_label(opt)
    if name == "LowRankAdam":
        name = {"dominant": "GaLore (dominant)", "importance": "importance"}[opt["init_args"].get("selector", "importance")]
    rows = run.rows("subspace.csv")
    overlaps = [float(r["overlap"]) for r in rows if r["overlap"] not in ("", None)]
    late = overlaps[len(overlaps) // 2 :]
    return {
        "optimizer": name,
        "seed": cfg.get("seed_everything"),
        "val_loss": run.metrics.get("val/loss", float("nan")),
        "overlap": sum(late) / len(late) if late else float("nan"),
        "erank": float(rows[-1]["erank"]),
    }


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table: per optimizer, mean +/- std over restarts of val loss, late overlap and erank(W_T - W_0)."""
    import statistics

    by: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(r["optimizer"], []).append(r)

    def ms(vals: list[float], fmt: str) -> str:
        if all(math.isnan(v) for v in vals):
            return "-"
        sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
        return f"{statistics.mean(vals):{fmt}} +/- {sd:{fmt}}"

    table = []
    for name in sorted(by, key=lambda n: ("AdamW" not in n, n)):
        rs = sorted(by[name], key=lambda r: r["seed"])
        table.append([name, len(rs), ms([r["val_loss"] for r in rs], ".4f"), ms([r["overlap"] for r in rs], ".3f"),
                      ms([r["erank"] for r in rs], ".1f")])
    return markdown_table(["optimizer", "restarts", "val loss (nats/char)", "overlap of consecutive projectors (2nd half)",
                           "effective rank of W_T - W_0"], table)


def summary(roots: Sequence[str], out: str | None = None) -> str:
    """Char-LM runs of AdamW, GaLore and importance-sampled LowRankAdam (and the projector-overlap plot)."""

    dirs = read_runs(roots, "subspace.csv")
    rows = [_run_summary(d) for d in dirs]
    if out:
        low = [(d, r) for d, r in zip(dirs, rows, strict=True) if r["optimizer"] != "AdamW"]
        plot_overlap([d for d, _ in low], out, [f"{r['optimizer']}, seed {r['seed']}" for _, r in low])
    return summary_table(rows)


def bench(ctx: Any) -> list[Any]:
    """Step time and optimizer state of importance-sampled LowRankAdam against GaLore and AdamW (``lowrank bench is_lowrank``)."""
    from lowrank_lit.bench import BenchRow, mib, ratio_row
    from lowrank_lit.studies.optimizer_bench import galore_adamw, optimizer_bench_models

    r = ctx.size(32, 8)
    models = optimizer_bench_models(ctx, {
        "AdamW": lambda g: torch.optim.AdamW(g, lr=1e-3),
        "GaLore": lambda g: LowRankAdam(g, lr=1e-3, rank=r, update_proj_gap=50, selector="dominant"),
        "importance": lambda g: LowRankAdam(g, lr=1e-3, rank=r, update_proj_gap=50, selector="importance", seed=0)})
    peer = galore_adamw()
    if peer is not None:  # galore-torch installed (pip install lowrank_lit[bench]): the reference implementation
        models.update(optimizer_bench_models(ctx, {"galore-torch": lambda g: peer(
            [{"params": g[0]["params"], "rank": r, "update_proj_gap": 50, "scale": 0.25, "proj_type": "std"},
             *g[1:]], lr=1e-3, weight_decay=0.0, eps=1e-6)}))
    times = ctx.compare({k: m.step for k, m in models.items()}, ctx.rounds(60, 4), warmup=2)
    state = {k: m.matrix_state_bytes() for k, m in models.items()}
    note = models["AdamW"].note + f", rank {r}, refresh every 50 steps"
    rows = []
    if peer is not None:
        rows.append(ratio_row(ctx, "is_lowrank", f"our LowRankAdam in GaLore mode step (r = {r})",
                              "galore-torch GaLoreAdamW step", times, "GaLore", "galore-torch",
                              "peer library: the same matrix updates bit for bit (tests/methods/test_is_lowrank.py); "
                              "reported", memory=f"matrix state {mib(state['GaLore'])} vs {mib(state['galore-torch'])}",
                              note=note))
    return rows + [ratio_row(ctx, "is_lowrank", f"importance-sampled LowRankAdam step (r = {r})", "GaLore step", times, "importance",
                      "GaLore", "paper: sampling costs about as much as GaLore's top-r; our target <= 1.1x", 1.1, note=note),
            ratio_row(ctx, "is_lowrank", f"importance-sampled LowRankAdam step (r = {r})", "AdamW step", times, "importance",
                      "AdamW", "reported (the SVD refresh every 50 steps is in the median's rounds)", note=note),
            BenchRow("is_lowrank", "LowRankAdam optimizer state of the matrices", "AdamW's", state["importance"] / state["AdamW"],
                     (state["importance"] / state["AdamW"],) * 2, "paper: moments of r / min(m, n) of each matrix "
                     f"(+ the projector): about {2 * r / ctx.size(256, 64):.2f}x", None, f"{mib(state['importance'])} vs {mib(state['AdamW'])}", note, ctx.device,
                     "memory")]
