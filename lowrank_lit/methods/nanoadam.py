"""NanoAdam: fine-tune only the small-magnitude weights.

Zhou, Jacobs, Gadhikar, Burkholz, *Pay Attention to Small Weights*, NeurIPS 2025 (arXiv 2506.21374).
No official code was found.

During fine-tuning of a pretrained network, large gradients sit mostly on weights of small magnitude.
NanoAdam updates, in every masked tensor, only the k entries with the smallest ``|theta|`` (chosen from
the weights alone, no gradient needed), refreshes that index set every ``mask_interval`` steps (and
whenever the density schedule changes k), and keeps Adam moments only for those k entries (the paper's
Algorithm 1)::

    if t % mask_interval == 0 or k changed:   I = Bottom_k(|theta_t|)      # per tensor
    g = grad[I];  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2               # states exist only for I
    theta[I] -= lr * m_hat / (sqrt(v_hat) + eps);   theta[not I] unchanged

Inferred where the paper is silent (method card 12): (a) the moments and the bias-correction counter
restart at zero whenever I is recomputed (``keep_overlap=True`` carries the states of indices that stay
selected); (b) ``k = max(1, round(density * numel))``, ties broken by flat index (stable sort of
``|theta|``); (c) only tensors with ``ndim >= 2`` in groups with ``nano=True`` (the default) are masked;
1-D tensors and groups with ``nano=False`` (biases, norms, a new head) get ordinary dense Adam;
(d) density schedules ``constant``, ``linear``, ``cosine`` from ``density`` to ``final_density`` over
``total_steps``, evaluated every ``density_interval`` steps; (e) decoupled weight decay (AdamW-style)
on the selected entries only. Ablation selectors: ``random`` (k uniformly drawn entries, seeded)
and ``largest`` (top-k ``|theta|``).

State per masked tensor: ``idx`` (k int64), ``exp_avg``/``exp_avg_sq`` (k values) with
``compact_state=True``; a bool ``mask`` and dense moments otherwise (a debugging mode that must give
the same trajectory).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.optim import SeededOptimizer, adam_moments_, bias_corrections
from lowrank_lit.registry import register_method
from lowrank_lit.report import Run, class_label, markdown_table, new_figure, read_runs, save_figure
from lowrank_lit.sharding import full_tensor

__all__ = ["NanoAdam", "bottom_k_mask", "select_indices", "kept_count", "grad_weight_correlation", "GradWeightCorrelation"]

PAPER = "Pay Attention to Small Weights (NanoAdam)"
SELECTORS = ("smallest", "random", "largest")
SCHEDULES = ("constant", "linear", "cosine")


def kept_count(numel: int, density: float) -> int:
    """``k = max(1, round(density * numel))`` (warns when the density would keep nothing)."""
    k = round(density * numel)
    if k < 1:
        warnings.warn(f"NanoAdam: density {density} keeps {density * numel:.3g} < 1 of {numel} entries; k clamped to 1", stacklevel=3)
    return max(1, min(numel, k))


def select_indices(weight: torch.Tensor, k: int, selector: str = "smallest", generator: torch.Generator | None = None) -> torch.Tensor:
    """Flat indices (sorted ascending) of the k entries that ``selector`` picks from ``weight`` alone.

    ``smallest``: the k smallest ``|w|``; ``largest``: the k largest; ties go to the lower flat index
    (stable sort). ``random``: k entries drawn uniformly without replacement from ``generator``.
    """
    flat = weight.detach().reshape(-1)
    if selector == "smallest":
        idx = torch.sort(flat.abs(), stable=True).indices[:k]
    elif selector == "largest":
        idx = torch.sort(flat.abs(), stable=True, descending=True).indices[:k]
    elif selector == "random":
        idx = torch.randperm(flat.numel(), generator=generator, device="cpu")[:k].to(flat.device)
    else:
        raise ValueError(f"select_indices: selector={selector!r}; allowed: {', '.join(SELECTORS)}")
    return torch.sort(idx).values


def bottom_k_mask(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the k smallest ``|tensor|`` entries (ties to the lower flat index)."""
    mask = torch.zeros(tensor.numel(), dtype=torch.bool, device=tensor.device)
    mask[select_indices(tensor, k, "smallest")] = True
    return mask.reshape(tensor.shape)


def _schedule(kind: str, start: float, end: float, t: int, total: int) -> float:
    if kind == "constant":
        return start
    frac = min(max(t / total, 0.0), 1.0)
    if kind == "linear":
        return start + (end - start) * frac
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * frac))  # cosine


@register_method("nanoadam", kind="Optimizer", paper=PAPER, summary="summary", bench="bench")
class NanoAdam(SeededOptimizer):
    """Adam on the k smallest-magnitude entries of each weight matrix, re-selected periodically.

    Use it like any torch optimizer, or in a config as ``optimizer: class_path:
    lowrank_lit.methods.nanoadam.NanoAdam``. Param groups may set ``nano=False`` (dense Adam) and
    any of the hyperparameters below.

    Args:
        params: parameters or param groups.
        lr: learning rate (the paper uses 5-10x the AdamW lr). Default: 1e-3.
        betas: Adam's coefficients. Default: (0.9, 0.999).
        eps: Adam's epsilon. Default: 1e-8.
        weight_decay: decoupled decay on the selected entries. Default: 0.0.
        density: fraction k / numel of each masked tensor updated. Default: 0.05.
        mask_interval: steps between re-selections of the index set. Default: 100.
        density_interval: steps between density-schedule evaluations; None = never. Default: None.
        density_schedule: ``constant``, ``linear`` or ``cosine``. Default: constant.
        final_density: end point of a non-constant schedule. Default: None.
        total_steps: length of a non-constant schedule. Default: None.
        selector: ``smallest`` (NanoAdam), ``random`` or ``largest`` (ablations). Default: smallest.
        compact_state: keep k moments + k indices (True) or dense moments + a mask (False). Default: True.
        keep_overlap: keep the moments of indices that stay selected at a refresh. Default: False.
        seed: seed of the ``random`` selector; None takes the run seed (``torch.initial_seed()``,
            identical on every DDP rank after ``seed_everything``). Default: None.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: LearningRate = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        density: float = 0.05,
        mask_interval: int = 100,
        density_interval: int | None = None,
        density_schedule: str = "constant",
        final_density: float | None = None,
        total_steps: int | None = None,
        selector: str = "smallest",
        compact_state: bool = True,
        keep_overlap: bool = False,
        seed: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, density=density,
            mask_interval=mask_interval, density_interval=density_interval, density_schedule=density_schedule,
            final_density=final_density, total_steps=total_steps, selector=selector, nano=True,
        )
        self._check(defaults)
        self.compact_state = compact_state
        self.keep_overlap = keep_overlap
        super().__init__(params, defaults, seed)
        for group in self.param_groups:
            self._check(group)

    @staticmethod
    def _check(g: dict[str, Any]) -> None:
        where = "NanoAdam"
        SeededOptimizer.check_adam(g, where)
        if not 0.0 < g["density"] <= 1.0:
            raise ValueError(f"{where}: density={g['density']!r}; allowed: (0, 1]")
        if not (isinstance(g["mask_interval"], int) and g["mask_interval"] >= 1):
            raise ValueError(f"{where}: mask_interval={g['mask_interval']!r}; allowed: an integer >= 1")
        if g["density_interval"] is not None and not (isinstance(g["density_interval"], int) and g["density_interval"] >= 1):
            raise ValueError(f"{where}: density_interval={g['density_interval']!r}; allowed: None or an integer >= 1")
        if g["selector"] not in SELECTORS:
            raise ValueError(f"{where}: selector={g['selector']!r}; allowed: {', '.join(SELECTORS)}")
        if g["density_schedule"] not in SCHEDULES:
            raise ValueError(f"{where}: density_schedule={g['density_schedule']!r}; allowed: {', '.join(SCHEDULES)}")
        if g["density_schedule"] == "constant":
            if g["final_density"] is not None:
                raise ValueError(f"{where}: final_density={g['final_density']!r} needs density_schedule linear or cosine (got constant)")
        else:
            if g["final_density"] is None or not 0.0 < g["final_density"] <= 1.0:
                raise ValueError(f"{where}: final_density={g['final_density']!r}; allowed: (0, 1] with schedule {g['density_schedule']!r}")
            if g["total_steps"] is None or g["total_steps"] < 1 or g["density_interval"] is None:
                raise ValueError(f"{where}: density_schedule={g['density_schedule']!r} needs total_steps >= 1 and a density_interval")

    # -- selection ---------------------------------------------------------------------------------

    def _density(self, group: dict[str, Any], t: int) -> float:
        return _schedule(group["density_schedule"], group["density"], group["final_density"] or group["density"], t, group["total_steps"] or 1)

    def _refresh(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], k: int) -> None:
        """Re-select the index set of ``p`` from its weights (no gradient used)."""
        idx = select_indices(p, k, group["selector"], self.generator)
        old_idx = state.get("idx")
        if self.compact_state:
            m, v = torch.zeros(k, dtype=p.dtype, device=p.device), torch.zeros(k, dtype=p.dtype, device=p.device)
            if self.keep_overlap and old_idx is not None:
                new_pos, old_pos = _intersect(idx, old_idx)
                m[new_pos], v[new_pos] = state["exp_avg"][old_pos], state["exp_avg_sq"][old_pos]
            state["idx"], state["exp_avg"], state["exp_avg_sq"] = idx, m, v
        else:
            mask = torch.zeros(p.numel(), dtype=torch.bool, device=p.device)
            mask[idx] = True
            if not (self.keep_overlap and "mask" in state):
                state["exp_avg"] = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                state["exp_avg_sq"] = torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
            else:
                state["exp_avg"][~mask] = 0
                state["exp_avg_sq"][~mask] = 0
            state["mask"], state["idx"] = mask, idx
        state["k"] = k
        if not (self.keep_overlap and "local_step" in state):
            state["local_step"] = 0  # bias correction restarts with the new index set (inferred)
        state["refreshes"] = state.get("refreshes", 0) + 1

    def masks(self) -> dict[torch.Tensor, torch.Tensor]:
        """The current flat index set of every masked parameter (empty before the first step)."""
        return {p: s["idx"] for p, s in self.state.items() if "idx" in s}

    # -- step --------------------------------------------------------------------------------------

    def elementwise(self, p: torch.Tensor, group: dict[str, Any]) -> bool:
        return not (group["nano"] and p.ndim >= 2)  # dense Adam

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any], t: int) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        b1, b2 = group["betas"]
        if group["nano"] and p.ndim >= 2:
            self._nano_update(p, grad, state, group, t, lr, wd, eps, b1, b2)
        else:
            self._dense_update(p, grad, state, lr, wd, eps, b1, b2)

    def _nano_update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any], t: int,
                     lr: float, wd: float, eps: float, b1: float, b2: float) -> None:
        k = state.get("k")
        refresh_k = group["density_interval"] is not None and t % group["density_interval"] == 0
        if k is None or refresh_k:
            k_new = kept_count(p.numel(), self._density(group, t))
        else:
            k_new = k
        if k is None or t % group["mask_interval"] == 0 or k_new != k:
            self._refresh(p, state, group, k_new)
        state["local_step"] += 1
        n = state["local_step"]
        bc1, bc2 = bias_corrections(b1, b2, n)
        flat = p.view(-1)
        idx = state["idx"]
        if self.compact_state:
            g = grad.reshape(-1)[idx]  # (k,)
            m, v = state["exp_avg"], state["exp_avg_sq"]
            adam_moments_(m, v, g, b1, b2)
            upd = (m / bc1) / ((v / bc2).sqrt() + eps)
            w = flat[idx]
            if wd:
                w = w * (1 - lr * wd)
            flat[idx] = w - lr * upd
        else:
            mask = state["mask"]
            g = torch.where(mask, grad.reshape(-1), torch.zeros((), dtype=p.dtype, device=p.device))
            m, v = state["exp_avg"], state["exp_avg_sq"]
            adam_moments_(m, v, g, b1, b2)
            upd = (m / bc1) / ((v / bc2).sqrt() + eps)
            new = flat * (1 - lr * wd) - lr * upd if wd else flat - lr * upd
            flat.copy_(torch.where(mask, new, flat))

    @staticmethod
    def _dense_update(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], lr: float, wd: float, eps: float, b1: float, b2: float) -> None:
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(p)
            state["exp_avg_sq"] = torch.zeros_like(p)
        bc1, bc2 = bias_corrections(b1, b2, state.get("step", 0) + 1)
        m, v = state["exp_avg"], state["exp_avg_sq"]
        adam_moments_(m, v, grad, b1, b2)
        if wd:
            p.mul_(1 - lr * wd)
        p.addcdiv_(m, (v.sqrt() / math.sqrt(bc2)).add_(eps), value=-lr / bc1)


def _intersect(new: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions in ``new`` and in ``old`` (both sorted, distinct) of the indices they share."""
    values, counts = torch.cat([new, old]).unique(return_counts=True)
    common = values[counts == 2]
    return torch.searchsorted(new, common), torch.searchsorted(old, common)


def grad_weight_correlation(module: nn.Module, min_dim: int = 2) -> dict[str, float]:
    """Spearman correlation of ``|theta|`` and ``|grad|`` for every parameter with a gradient (sharded parameters are
    gathered: call it on every rank)."""
    from torchmetrics.functional import spearman_corrcoef

    out = {}
    for name, p in module.named_parameters():
        if p.grad is None or p.ndim < min_dim or p.numel() < 3:
            continue
        weight, grad = full_tensor(p.detach()), full_tensor(p.grad.detach())  # whole, on every rank, when sharded
        a, b = weight.abs().reshape(-1).double(), grad.abs().reshape(-1).double()
        if a.std() == 0 or b.std() == 0:
            continue
        out[name] = float(spearman_corrcoef(a, b))
    return out


class GradWeightCorrelation(pl.Callback):
    """Logs ``gwc/<param>`` = Spearman(|theta|, |grad|) per weight matrix every ``every_n_steps`` steps.

    The paper's observation is a negative correlation (large gradients on small weights) in large
    pretrained models; small networks may not show it.

    Args:
        every_n_steps: logging period in optimizer steps. Default: 50.
    """

    def __init__(self, every_n_steps: int = 50) -> None:
        if every_n_steps < 1:
            raise ValueError(f"GradWeightCorrelation: every_n_steps={every_n_steps!r}; allowed: an integer >= 1")
        self.every_n_steps = every_n_steps

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        corr = grad_weight_correlation(pl_module)
        if corr and trainer.is_global_zero:
            metrics = {f"gwc/{k}": v for k, v in corr.items()} | {"gwc/mean": sum(corr.values()) / len(corr)}
            for logger in trainer.loggers:  # straight to the loggers: written whatever log_every_n_steps is
                logger.log_metrics(metrics, step=trainer.global_step)


METRICS = ("test/target_acc", "test/source_acc", "test/drift")


def _run_rows(run_dirs: list[str]) -> list[dict[str, Any]]:
    """Optimizer label, lr, seed and the test metrics of each split-digits run directory."""

    rows = []
    for run in map(Run, run_dirs):
        cfg = run.config
        opt = cfg["model"]["init_args"]["optimizer"]
        name = class_label(opt)
        if name == "NanoAdam":
            name = f"NanoAdam ({opt['init_args'].get('selector', 'smallest')})"
        row: dict[str, Any] = {"optimizer": name, "lr": opt["init_args"].get("lr"), "seed": cfg.get("seed_everything")}
        row.update({k: v for k, v in run.metrics.items() if k in METRICS})
        if all(k in row for k in METRICS):
            rows.append(row)
    return rows


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table: per optimizer and lr, the seed means (and per-seed values) of the three metrics."""
    cells: dict[tuple[Any, str], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["lr"], r["optimizer"]), []).append(r)
    table = []
    for (lr, name), rs in sorted(cells.items(), key=lambda kv: (-kv[0][0], kv[0][1])):
        rs = sorted(rs, key=lambda r: r["seed"])
        mean = {k: sum(r[k] for r in rs) / len(rs) for k in METRICS}
        per = "; ".join(f"{r['test/target_acc']:.3f} / {r['test/source_acc']:.3f} / {r['test/drift']:.1f}" for r in rs)
        table.append([f"{lr:g}", name, f"{mean['test/target_acc']:.4f}", f"{mean['test/source_acc']:.4f}",
                      f"{mean['test/drift']:.2f}", per])
    return markdown_table(["lr", "optimizer", "target acc", "source acc (forgetting)", "body drift",
                           "per seed (target / source / drift)"], table)


def plot_summary(rows: list[dict[str, Any]], out: str, lr: float | None = None) -> str:
    """Bars of target accuracy, source accuracy and drift per optimizer (seed means) at one lr."""
    lr = lr if lr is not None else max(r["lr"] for r in rows)
    names = sorted({r["optimizer"] for r in rows if r["lr"] == lr})
    fig, axes = new_figure(1, 3, figsize=(11, 3.5))
    for ax, key, title in zip(axes, METRICS, ("target accuracy (digits 5-9)", "source accuracy (0-4, frozen head)", "L2 drift of the body"), strict=True):
        vals = [sum(r[key] for r in rows if r["optimizer"] == n and r["lr"] == lr) /
                max(1, sum(1 for r in rows if r["optimizer"] == n and r["lr"] == lr)) for n in names]
        ax.bar(range(len(names)), vals, color=["C0" if "AdamW" in n else "C1" for n in names])
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.replace("NanoAdam ", "Nano\n") for n in names], fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("accuracy" if "acc" in key else "L2 distance to the base weights")
        if "acc" in key:
            ax.set_ylim(0, 1)
    fig.suptitle(f"split-digits fine-tuning, lr {lr:g}, mean of seeds", fontsize=10)
    return save_figure(fig, out)


def summary(roots: list[str], out: str | None = None) -> str:
    """Split-digits fine-tuning runs (NanoAdam, its ablations, AdamW); --out: bars of the largest lr's results."""

    rows = _run_rows(read_runs(roots, "config.yaml", required=False))
    if not rows:
        raise FileNotFoundError(f"no finished split-digits run under {roots}")
    if out:
        plot_summary(rows, out)
    return summary_table(rows)


def bench(ctx: Any) -> list[Any]:
    """NanoAdam's optimizer state and step time against AdamW on a byte-level Llama (``lowrank bench nanoadam``)."""
    from lowrank_lit.bench import BenchRow, mib, ratio_row
    from lowrank_lit.studies.optimizer_bench import optimizer_bench_models

    models = optimizer_bench_models(ctx, {"AdamW": lambda g: torch.optim.AdamW(g, lr=1e-3),
                                          "NanoAdam": lambda g: NanoAdam(g, lr=1e-3, density=0.05, mask_interval=100)})
    times = ctx.compare({k: m.step for k, m in models.items()}, ctx.rounds(30, 4), warmup=2)
    a, n = (models[k].matrix_state_bytes() for k in ("AdamW", "NanoAdam"))
    return [ratio_row(ctx, "nanoadam", "NanoAdam (density 0.05) training step", "AdamW step", times, "NanoAdam", "AdamW",
                      "reported", memory=f"state {mib(n)} vs {mib(a)}", note=models["AdamW"].note),
            BenchRow("nanoadam", "NanoAdam optimizer state of the matrices", "AdamW's", n / a, (n / a, n / a),
                     "paper: about 2 x density of AdamW's for the tuned matrices; our target <= 0.15x", 0.15,
                     f"{mib(n)} vs {mib(a)}", "attention / MLP matrices (embeddings and head: dense Adam)", ctx.device, "memory")]
