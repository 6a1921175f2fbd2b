"""STRank: learning relative gene expression trends under batch effects.

Nishimura et al., *Learning Relative Gene Expression Trends from Pathology Images in Spatial
Transcriptomics*, NeurIPS 2025 (arXiv 2512.06612). Official code: github.com/naivete5656/STRank (MIT).

The model outputs a per-spot, per-gene score ``f (N, G)``; within one group (slide) the counts of
each gene are treated as multinomial draws over the group's spots with probabilities
``softmax(s)``, ``s = f + l`` (library offset ``l_i = log(mean_g c_ig + 1e-6)``,
``normalize_library=True``). Per-(slide, gene) scale factors cancel in that softmax.

* list loss (multinomial), per group k: ``log pi_ig = s_ig - logsumexp_{j in k} s_jg``;
  ``L = -mean_{i,g} c_ig log pi_ig`` (mean over all N*G entries of the batch).
* pair loss (binomial for P=2): P independent within-group permutations rho_1..rho_P of the batch,
  ``S[:, p] = s[rho_p]`` (N, P, G), ``log pi = log_softmax(S, dim=P)``, ``L = -mean(C log pi)``.
* ``entropy_weight`` adds ``w * (-mean(pi log pi))`` (the official real-data runs use w = 1).
* ``perm="global"`` ignores the groups (an ablation: one softmax over the whole batch).
* A group with a single spot in the batch contributes zero loss (in pair mode its spot could only
  be paired with itself, which adds a gradient-free constant; it is masked out).

Baselines of the official repository, with the same ``forward(pred, counts, groups)`` so a config
swaps them by ``class_path``: :class:`MSELog1pLoss`, :class:`PoissonNLLLoss`,
:class:`NegativeBinomialNLLLoss` (learned per-gene dispersion), :class:`NegativePearsonLoss`,
:class:`PairwiseMarginRankingLoss`. Choices the card leaves open (marked "inferred"): the Pearson
baseline correlates with ``log1p`` counts over the whole batch; the margin-ranking baseline uses
one within-group permutation per step, target ``sign(c_a - c_b)``, ties skipped, margin 1.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.registry import register_method
from lowrank_lit.report import (
    Run,
    class_label,
    markdown_table,
    new_figure,
    read_metric,
    read_runs,
    save_figure,
)

__all__ = [
    "STRankLoss",
    "strank_list_loss",
    "strank_pair_loss",
    "group_permutations",
    "MSELog1pLoss",
    "PoissonNLLLoss",
    "NegativeBinomialNLLLoss",
    "NegativePearsonLoss",
    "PairwiseMarginRankingLoss",
    "plot_curves",
    "summarize",
    "summary_table",
]

PAPER = "Learning Relative Gene Expression Trends from Pathology Images in Spatial Transcriptomics (STRank)"
MODES = ("list", "pair")
PERMS = ("group", "global")
_LIB_EPS = 1e-6


def _check(pred: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None, where: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate a batch; returns ``(pred (N, G), counts (N, G), groups (N,))``."""
    if not isinstance(pred, torch.Tensor) or not torch.is_floating_point(pred):
        raise TypeError(f"{where}: pred must be a floating-point tensor, got {getattr(pred, 'dtype', type(pred))}")
    counts = torch.as_tensor(counts, device=pred.device)
    if pred.ndim == 1:
        pred = pred[:, None]
    if counts.ndim == 1:
        counts = counts[:, None]
    if pred.ndim != 2 or pred.shape != counts.shape:
        raise ValueError(f"{where}: pred and counts must both be (N, G); got pred {tuple(pred.shape)}, counts {tuple(counts.shape)}")
    n = pred.shape[0]
    if n == 0:
        raise ValueError(f"{where}: empty batch (N = 0)")
    counts = counts.to(pred.dtype)
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()):
        raise ValueError(f"{where}: counts must be finite and >= 0 (found negative, NaN or inf entries)")
    if groups is None:
        groups = torch.zeros(n, dtype=torch.long, device=pred.device)
    groups = torch.as_tensor(groups, device=pred.device)
    if groups.is_floating_point() or groups.is_complex() or groups.dtype == torch.bool:
        raise TypeError(f"{where}: groups must be an integer tensor, got {groups.dtype}")
    if groups.ndim != 1 or len(groups) != n:
        raise ValueError(f"{where}: groups must have shape ({n},) like pred's first dimension, got {tuple(groups.shape)}")
    return pred, counts, groups


def _check_options(mode: str, perm: str, n_pairs: int, where: str) -> None:
    if mode not in MODES:
        raise ValueError(f"{where}: mode={mode!r}; allowed: {', '.join(MODES)}")
    if perm not in PERMS:
        raise ValueError(f"{where}: perm={perm!r}; allowed: {', '.join(PERMS)}")
    if not isinstance(n_pairs, int) or n_pairs < 2:
        raise ValueError(f"{where}: n_pairs={n_pairs!r}; allowed: an integer >= 2")


def _warn_small_groups(inv: torch.Tensor, n_groups: int, where: str) -> None:
    sizes = torch.bincount(inv, minlength=n_groups)
    if bool((sizes < 2).any()):
        warnings.warn(
            f"{where}: {int((sizes < 2).sum())} group(s) with fewer than 2 spots in this batch contribute zero loss",
            stacklevel=3,
        )


def _scores(pred: torch.Tensor, counts: torch.Tensor, normalize_library: bool) -> torch.Tensor:
    if not normalize_library:
        return pred
    return pred + torch.log(counts.mean(dim=1, keepdim=True) + _LIB_EPS)  # (N, G) + (N, 1)


def strank_list_loss(
    pred: torch.Tensor,
    counts: torch.Tensor,
    groups: torch.Tensor | None = None,
    normalize_library: bool = True,
    perm: str = "group",
    entropy_weight: float = 0.0,
) -> torch.Tensor:
    """STRank list (multinomial) loss.

    Args:
        pred: ``(N, G)`` float scores (unnormalised, log scale).
        counts: ``(N, G)`` non-negative counts.
        groups: ``(N,)`` integer slide ids; None puts all spots in one group.
        normalize_library: add the log library size ``log(mean_g c_ig + 1e-6)`` to the scores.
        perm: ``group`` (a softmax per group) or ``global`` (one softmax over the batch).
        entropy_weight: weight of the ``-mean(pi log pi)`` term.

    Returns:
        The scalar loss ``-mean(c * log pi)`` (+ the entropy term).
    """
    where = "strank_list_loss"
    _check_options("list", perm, 2, where)
    pred, counts, groups = _check(pred, counts, groups, where)
    s = _scores(pred, counts, normalize_library)  # (N, G)
    if perm == "global":
        groups = torch.zeros_like(groups)
    _, inv = torch.unique(groups, return_inverse=True)  # (N,) in 0..K-1
    n_groups = int(inv.max()) + 1
    _warn_small_groups(inv, n_groups, where)
    idx = inv[:, None].expand_as(s)  # (N, G)
    # logsumexp per (group, gene) with a detached per-group max for stability
    m = torch.full((n_groups, s.shape[1]), float("-inf"), dtype=s.dtype, device=s.device)
    m = m.scatter_reduce(0, idx, s.detach(), reduce="amax", include_self=True)  # (K, G)
    sumexp = torch.zeros_like(m).scatter_add(0, idx, torch.exp(s - m[inv]))  # (K, G)
    log_pi = s - (m + torch.log(sumexp))[inv]  # (N, G)
    loss = -(counts * log_pi).mean()
    if entropy_weight:
        loss = loss + entropy_weight * -(log_pi.exp() * log_pi).mean()
    return loss


def group_permutations(
    groups: torch.Tensor, n_perms: int, generator: torch.Generator | None = None, perm: str = "group"
) -> torch.Tensor:
    """``(N, n_perms)`` batch indices: column p is a random permutation rho_p that maps each spot to a
    spot of the same group (``perm="group"``) or of the whole batch (``perm="global"``)."""
    if perm not in PERMS:
        raise ValueError(f"group_permutations: perm={perm!r}; allowed: {', '.join(PERMS)}")
    n = len(groups)
    device = generator.device if generator is not None else groups.device
    _, inv = torch.unique(groups.to(device), return_inverse=True)
    if perm == "global":
        inv = torch.zeros_like(inv)
    base = torch.argsort(inv, stable=True)  # the spots, grouped, in index order
    cols = []
    for _ in range(n_perms):
        keys = inv.double() + 0.5 * torch.rand(n, generator=generator, device=device, dtype=torch.float64)
        shuffled = torch.argsort(keys)  # grouped the same way, random order inside each group
        rho = torch.empty_like(base)
        rho[base] = shuffled  # the j-th spot of a group -> a random spot of that group
        cols.append(rho)
    return torch.stack(cols, dim=1).to(groups.device)  # (N, P)


def strank_pair_loss(
    pred: torch.Tensor,
    counts: torch.Tensor,
    groups: torch.Tensor | None = None,
    n_pairs: int = 2,
    generator: torch.Generator | None = None,
    normalize_library: bool = True,
    perm: str = "group",
    entropy_weight: float = 0.0,
    perms: torch.Tensor | None = None,
) -> torch.Tensor:
    """STRank pair loss: binomial (P=2) or P-way multinomial over within-group permutations.

    Args:
        pred: ``(N, G)`` float scores.
        counts: ``(N, G)`` non-negative counts.
        groups: ``(N,)`` integer slide ids; None puts all spots in one group.
        n_pairs: number of permutations P stacked per spot (>= 2).
        generator: random source of the permutations (reproducible sampling).
        normalize_library: add the log library size to the scores.
        perm: ``group`` (permute inside each slide) or ``global`` (ablation).
        entropy_weight: weight of the ``-mean(pi log pi)`` term.
        perms: ``(N, P)`` permutation indices to use instead of drawing them.

    Returns:
        The scalar loss ``-mean(C * log_softmax(S, dim=1))`` over N*P*G entries (+ the entropy term).
    """
    where = "strank_pair_loss"
    _check_options("pair", perm, n_pairs, where)
    pred, counts, groups = _check(pred, counts, groups, where)
    s = _scores(pred, counts, normalize_library)  # (N, G)
    _, inv = torch.unique(groups, return_inverse=True)
    _warn_small_groups(inv, int(inv.max()) + 1, where)
    sizes = torch.bincount(inv)
    if perms is None:
        perms = group_permutations(groups, n_pairs, generator, perm)
    elif perms.ndim != 2 or perms.shape[0] != len(s) or perms.shape[1] < 2:
        raise ValueError(f"{where}: perms must be (N={len(s)}, P>=2) indices, got {tuple(perms.shape)}")
    S, C = s[perms], counts[perms]  # (N, P, G)
    if perm == "group":  # a spot alone in its group can only be paired with itself: no information, zero loss
        C = C * (sizes[inv] >= 2)[:, None, None]
    log_pi = torch.log_softmax(S, dim=1)
    loss = -(C * log_pi).mean()
    if entropy_weight:
        loss = loss + entropy_weight * -(log_pi.exp() * log_pi).mean()
    return loss


@register_method("strank", kind="Loss", paper=PAPER, summary="summary", bench="bench")
class STRankLoss(nn.Module):
    """STRank's relative-expression loss as a module: ``loss(pred, counts, groups)``.

    Args:
        mode: ``list`` (multinomial over a group's spots) or ``pair`` (over P sampled spots). Default: list.
        normalize_library: add the per-spot log library size to the scores (official default;
            turn off for a single gene, where it would cancel the signal). Default: True.
        n_pairs: spots compared per draw in ``pair`` mode (official toy 2, real data 256). Default: 2.
        perm: ``group`` (within slides) or ``global`` (ignore slides; ablation). Default: group.
        entropy_weight: weight of ``-mean(pi log pi)`` (official real-data code: 1.0). Default: 0.0.
        seed: seed of the pair sampling; None uses torch's global generator. Default: None.
    """

    def __init__(
        self,
        mode: str = "list",
        normalize_library: bool = True,
        n_pairs: int = 2,
        perm: str = "group",
        entropy_weight: float = 0.0,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        _check_options(mode, perm, n_pairs, "STRankLoss")
        if entropy_weight < 0:
            raise ValueError(f"STRankLoss: entropy_weight={entropy_weight!r}; allowed: a float >= 0")
        self.mode, self.normalize_library, self.n_pairs = mode, normalize_library, n_pairs
        self.perm, self.entropy_weight = perm, entropy_weight
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def forward(self, pred: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        if self.mode == "list":
            return strank_list_loss(pred, counts, groups, self.normalize_library, self.perm, self.entropy_weight)
        gen = self.generator
        if gen is not None and gen.device != pred.device:
            gen = None  # a CPU generator cannot drive CUDA sampling; fall back to the global one
        return strank_pair_loss(pred, counts, groups, self.n_pairs, gen, self.normalize_library, self.perm, self.entropy_weight)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, normalize_library={self.normalize_library}, n_pairs={self.n_pairs}, perm={self.perm}"


class MSELog1pLoss(nn.Module):
    """Baseline: mean squared error between the prediction and ``log1p(counts)`` (groups unused)."""

    def forward(self, pred: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        pred, counts, _ = _check(pred, counts, groups, "MSELog1pLoss")
        return F.mse_loss(pred, torch.log1p(counts))


class PoissonNLLLoss(nn.Module):
    """Baseline: Poisson negative log-likelihood with an exp link (``pred`` = log rate)."""

    def forward(self, pred: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        pred, counts, _ = _check(pred, counts, groups, "PoissonNLLLoss")
        return F.poisson_nll_loss(pred, counts, log_input=True, full=False)


class NegativeBinomialNLLLoss(nn.Module):
    """Baseline: negative-binomial NLL, mean ``exp(pred)``, learned per-gene dispersion theta.

    ``-log p(c) = -[lgamma(c+theta) - lgamma(theta) - lgamma(c+1) + theta log(theta/(theta+mu))
    + c log(mu/(theta+mu))]``, averaged over entries; ``theta = exp(log_theta)`` is a parameter
    (trained with the model).

    Args:
        n_genes: number of genes G (one theta each). Default: 1.
        init_theta: initial dispersion. Default: 1.0.
    """

    def __init__(self, n_genes: int = 1, init_theta: float = 1.0) -> None:
        super().__init__()
        if n_genes < 1 or init_theta <= 0:
            raise ValueError(f"NegativeBinomialNLLLoss: n_genes={n_genes!r}, init_theta={init_theta!r}; allowed: n_genes >= 1, init_theta > 0")
        self.log_theta = nn.Parameter(torch.full((n_genes,), float(init_theta)).log())

    def forward(self, pred: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        pred, c, _ = _check(pred, counts, groups, "NegativeBinomialNLLLoss")
        if pred.shape[1] != len(self.log_theta):
            raise ValueError(f"NegativeBinomialNLLLoss: pred has {pred.shape[1]} genes but n_genes={len(self.log_theta)}")
        log_theta = self.log_theta.to(pred.dtype)  # (G,)
        theta = log_theta.exp()
        log_theta_mu = torch.logaddexp(log_theta, pred)  # log(theta + mu), mu = exp(pred)
        ll = (
            torch.lgamma(c + theta) - torch.lgamma(theta) - torch.lgamma(c + 1)
            + theta * (log_theta - log_theta_mu) + c * (pred - log_theta_mu)
        )
        return -ll.mean()


class NegativePearsonLoss(nn.Module):
    """Baseline: ``-mean_g corr(pred[:, g], log1p(counts[:, g]))`` over the batch (inferred target)."""

    def forward(self, pred: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        pred, counts, _ = _check(pred, counts, groups, "NegativePearsonLoss")
        y = torch.log1p(counts)
        pc, yc = pred - pred.mean(dim=0), y - y.mean(dim=0)  # (N, G)
        r = (pc * yc).sum(dim=0) / (pc.norm(dim=0) * yc.norm(dim=0) + 1e-8)  # (G,)
        return -r.mean()


class PairwiseMarginRankingLoss(nn.Module):
    """Baseline: margin ranking on within-group pairs (one random partner per spot per step).

    Args:
        margin: the ranking margin (torch's ``MarginRankingLoss``). Default: 1.0 (inferred; with
            margin 0 a constant prediction has zero loss, and the toy's balanced runs collapse).
        seed: seed of the pair sampling; None uses torch's global generator. Default: None.
    """

    def __init__(self, margin: float = 1.0, seed: int | None = None) -> None:
        super().__init__()
        self.ranking = nn.MarginRankingLoss(margin=margin)
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None

    def forward(self, pred: torch.Tensor, counts: torch.Tensor, groups: torch.Tensor | None = None) -> torch.Tensor:
        pred, counts, groups = _check(pred, counts, groups, "PairwiseMarginRankingLoss")
        gen = self.generator if self.generator is not None and self.generator.device == pred.device else None
        partner = group_permutations(groups, 1, gen)[:, 0]  # (N,)
        target = torch.sign(counts - counts[partner])  # (N, G); 0 = tie
        keep = target != 0
        if not bool(keep.any()):
            return pred.sum() * 0.0
        return self.ranking(pred[keep], pred[partner][keep], target[keep])


def _run_info(run_dir: str) -> dict[str, Any]:
    """Loss name, data setting and seed of a run, from its saved ``config.yaml``."""

    cfg = Run(run_dir).config
    loss = cfg["model"]["init_args"]["loss"]
    name = class_label(loss)
    if name == "STRankLoss":
        name = f"STRank-{(loss.get('init_args') or {}).get('mode', 'list')}"
    return {"loss": name, "setting": cfg["data"]["init_args"].get("setting", "-"), "seed": cfg.get("seed_everything")}


def summarize(run_dirs: Sequence[str], metric: str = "test/spearman") -> list[dict[str, Any]]:
    """One row ``{"loss", "setting", "seed", metric}`` per run directory, sorted by loss, setting, seed."""

    rows = [{**_run_info(d), metric: read_metric(Path(d) / "metrics.csv", metric)} for d in run_dirs]
    return sorted(rows, key=lambda r: (r["loss"], r["setting"], r["seed"]))


def plot_curves(run_dirs: Sequence[str], out: str, gene: int = 0) -> str:
    """Plot predicted vs true curves (each z-scored) from the ``predictions.csv`` of several runs."""
    import csv

    fig, ax = new_figure(figsize=(7, 4))

    def zscore(v: torch.Tensor) -> torch.Tensor:
        return (v - v.mean()) / (v.std() + 1e-12)

    for i, d in enumerate(run_dirs):
        with open(os.path.join(d, "predictions.csv")) as f:
            rows = list(csv.DictReader(f))
        x = torch.tensor([float(r["x"]) for r in rows])
        order = torch.argsort(x)
        if i == 0:
            truth = torch.tensor([float(r[f"truth_{gene}"]) for r in rows])[order]
            ax.plot(x[order], zscore(truth), "k-", lw=2.5, alpha=0.4, label="truth")
        pred = torch.tensor([float(r[f"pred_{gene}"]) for r in rows])[order]
        info = _run_info(d)
        ax.plot(x[order], zscore(pred), lw=1.2, label=f"{info['loss']} ({info['setting']}, seed {info['seed']})")
    ax.set_xlabel("x")
    ax.set_ylabel("z-scored expression")
    ax.set_title(f"Predicted vs true expression of gene {gene} (each z-scored)", fontsize=9)
    ax.legend(fontsize=7)
    return save_figure(fig, out)


def summary_table(rows: Sequence[dict[str, Any]], metric: str = "test/spearman") -> str:
    """Markdown table of :func:`summarize` rows: per loss and setting, the per-seed values and their mean."""
    cells: dict[tuple[str, str], list[tuple[Any, float]]] = {}
    for r in rows:
        cells.setdefault((r["loss"], r["setting"]), []).append((r["seed"], r[metric]))
    settings = sorted({s for _, s in cells}, key=lambda s: (s != "imbalanced", s))
    table = []
    for loss in sorted({k for k, _ in cells}):
        parts = []
        for s in settings:
            vals = sorted(cells.get((loss, s), []), key=lambda t: (t[0] is None, t[0]))
            if not vals:
                parts += ["-", "-"]
                continue
            mean = sum(v for _, v in vals) / len(vals)
            parts += [f"{mean:+.3f}", " / ".join(f"{v:+.3f}" for _, v in vals)]
        table.append([loss, *parts])
    return markdown_table(["loss", *(h for s in settings for h in (f"{s}: mean", f"{s}: per seed"))], table)


def summary(roots: Sequence[str], out: str | None = None, metric: str = "test/spearman") -> str:
    """STRank / baseline runs: the metric per loss, setting and seed (--out: the predicted curves)."""

    dirs = [run for run in read_runs(roots, "config.yaml", required=False) if (run.path / "metrics.csv").is_file()]
    if not dirs:
        raise FileNotFoundError(f"no run directory (config.yaml + metrics.csv) under {roots}")
    if out:
        plot_curves(dirs, out)
    return summary_table(summarize(dirs, metric), metric)


def bench(ctx: Any) -> list[Any]:
    """Training-step time with the STRank loss against MSE on the synthetic slides (``lowrank bench strank``)."""
    from lowrank_lit.bench import ConfigBench

    return [ConfigBench("strank", "training step with the STRank list loss", "MSE(log1p) step",
                        "configs/strank/synthetic_imbalanced.yaml", "configs/strank/synthetic_imbalanced_mse.yaml",
                        "paper: a drop-in loss (reported)")]
