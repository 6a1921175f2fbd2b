"""Spatial-transcriptomics style data: ``(x, counts, group)`` per spot, groups = slides.

* :func:`batch_effect_data` / :class:`SyntheticSTDataModule` — the STRank paper's toy generator
  (paper 13, card section 2), extended to several genes and slides: each gene follows a smooth
  curve of a 1-D input, every slide but the first sees it through a scale and an offset (the batch
  effect), counts are negative-binomial. Validation and test compare predictions with the noiseless
  curve on a grid.
* :class:`SpatialTranscriptomicsDataModule` — real data: per-slide feature matrices (e.g. frozen
  patch embeddings) and count matrices that the user provides.

Batches are ``(x (B, D), y (B, G), group (B,))``: ``y`` is the counts in training and the truth
(synthetic: the noiseless curve; real: normalised log counts) in validation and test.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, SequentialSampler, TensorDataset

from lowrank_lit.argtypes import InputPath
from lowrank_lit.data.groups import GroupBatchSampler
from lowrank_lit.data.loader import ResumableDataLoader
from lowrank_lit.seeding import run_seed

__all__ = ["batch_effect_data", "gene_curves", "SyntheticSTDataModule", "SpatialTranscriptomicsDataModule"]

SETTINGS = ("balanced", "imbalanced")
#: The official toy's first curve: mu(x) = 0.2 sin(25 x) + 0.3 sin(7 x), shifted to min 0 on [0, 1].
OFFICIAL_CURVE = (0.2, 0.3, 25.0, 7.0)
_FINE_GRID = np.linspace(0.0, 1.0, 20001)


def gene_curves(n_genes: int, seed: int) -> np.ndarray:
    """Curve parameters ``(G, 4)`` = ``(A, B, C, D)`` of mu_g(x) = A sin(C x) + B sin(D x).

    Gene 0 uses the official toy's curve (0.2, 0.3, 25, 7); further genes (an extension of the toy,
    inferred) draw A, B ~ U(0.1, 0.4) and C, D ~ U(2, 30) from ``seed``.
    """
    rng = np.random.default_rng([seed, 7919])
    params = [OFFICIAL_CURVE]
    for _ in range(n_genes - 1):
        a, b = rng.uniform(0.1, 0.4, size=2)
        c, d = rng.uniform(2.0, 30.0, size=2)
        params.append((a, b, c, d))
    return np.asarray(params, dtype=np.float64)


def _mu(x: np.ndarray, params: np.ndarray) -> np.ndarray:
    """Noiseless curves ``(N, G)`` at ``x (N,)``, each shifted so that its minimum over [0, 1] is 0."""
    a, b, c, d = (params[:, i] for i in range(4))

    def raw(t: np.ndarray) -> np.ndarray:
        return a * np.sin(np.outer(t, c)) + b * np.sin(np.outer(t, d))  # (N, G)

    return raw(x) - raw(_FINE_GRID).min(axis=0)


def batch_effect_data(
    setting: str = "imbalanced",
    n_spots: int = 4000,
    n_slides: int = 2,
    n_genes: int = 1,
    dispersion: float = 10.0,
    drop_rate: float = 0.0,
    slide_scale: Sequence[float] = (1.0, 10.0),
    slide_offset: Sequence[float] = (0.0, 10.0),
    scale_sigma: float = 0.0,
    offset_max: float = 0.0,
    library_sigma: float = 0.0,
    window: float = 0.1,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Draw the STRank batch-effect toy data.

    Slide 0 draws ``x ~ U(0, 1)`` and has mean ``m = mu(x)``. Slide k >= 1 has mean
    ``m = s_kg * mu_g(x) + o_kg`` with ``s_kg = slide_scale[k] * LogNormal(0, scale_sigma)`` and
    ``o_kg = slide_offset[k] + U(0, offset_max)`` (the official toy: slide 1 = 10 mu + 10); its ``x``
    is ``U(0, 1)`` (``balanced``) or ``U(c_k - window, c_k + window)`` with ``c_k ~ U(0, 1)``
    (``imbalanced``: the batch effect is confounded with x). Each spot's mean is multiplied by a
    library factor ``LogNormal(0, library_sigma)``. Counts ``~ NegBin(mean m, dispersion r)``
    (numpy's ``negative_binomial(r, r / (r + m))``), then binomially thinned with ``drop_rate``.

    Returns:
        ``{"x": (N,), "counts": (N, G), "groups": (N,), "mu": (N, G), "params": (G, 4)}`` with
        ``N = n_spots * n_slides``.
    """
    if setting not in SETTINGS:
        raise ValueError(f"batch_effect_data: setting={setting!r}; allowed: {', '.join(SETTINGS)}")
    if n_spots < 1 or n_slides < 1 or n_genes < 1:
        raise ValueError(
            f"batch_effect_data: n_spots={n_spots}, n_slides={n_slides}, n_genes={n_genes}; allowed: integers >= 1"
        )
    if len(slide_scale) < n_slides or len(slide_offset) < n_slides:
        raise ValueError(
            f"batch_effect_data: slide_scale and slide_offset need one value per slide ({n_slides}), "
            f"got {len(slide_scale)} and {len(slide_offset)}"
        )
    if dispersion <= 0 or not 0.0 <= drop_rate < 1.0:
        raise ValueError(
            f"batch_effect_data: dispersion={dispersion}, drop_rate={drop_rate}; allowed: dispersion > 0, drop_rate in [0, 1)"
        )
    rng = np.random.default_rng(seed)
    params = gene_curves(n_genes, seed)
    xs, means, mus, groups = [], [], [], []
    for k in range(n_slides):
        if k == 0 or setting == "balanced":
            x = rng.uniform(0.0, 1.0, n_spots)
        else:
            c = rng.uniform(0.0, 1.0)
            x = rng.uniform(c - window, c + window, n_spots)
        mu = _mu(x, params)  # (n, G)
        scale = slide_scale[k] * rng.lognormal(0.0, scale_sigma, n_genes) if scale_sigma > 0 else np.full(n_genes, slide_scale[k])
        offset = slide_offset[k] + (rng.uniform(0.0, offset_max, n_genes) if offset_max > 0 else 0.0)
        m = np.maximum(mu * scale + offset, 0.0)  # (n, G); mu may dip 1e-9 below 0 between fine-grid points
        if library_sigma > 0:
            m = m * rng.lognormal(0.0, library_sigma, (n_spots, 1))
        xs.append(x)
        means.append(m)
        mus.append(mu)
        groups.append(np.full(n_spots, k))
    m = np.concatenate(means)
    counts = rng.negative_binomial(dispersion, dispersion / (dispersion + m)).astype(np.float64)
    if drop_rate > 0:
        counts = rng.binomial(counts.astype(np.int64), 1.0 - drop_rate).astype(np.float64)
    return {
        "x": np.concatenate(xs),
        "counts": counts,
        "groups": np.concatenate(groups),
        "mu": np.concatenate(mus),
        "params": params,
    }


class _GroupedDataModule(pl.LightningDataModule):
    """Loaders shared by the spatial DataModules: grouped or shuffled training batches."""

    def __init__(self, batch_size: int, group_batches: bool, num_workers: int, seed: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"{type(self).__name__}: batch_size={batch_size!r}; allowed: an integer >= 1")
        if num_workers < 0:
            raise ValueError(f"{type(self).__name__}: num_workers={num_workers!r}; allowed: an integer >= 0")
        self.batch_size = batch_size
        self.group_batches = group_batches
        self.num_workers = num_workers
        self.seed = seed
        self.splits: dict[str, TensorDataset] = {}

    def train_dataloader(self) -> DataLoader:
        ds = self.splits["train"]
        if self.group_batches:
            groups = ds.tensors[2]
            sampler = GroupBatchSampler(SequentialSampler(ds), self.batch_size, groups=groups, seed=self.seed)
            return ResumableDataLoader(ds, batch_sampler=sampler, num_workers=self.num_workers)
        return ResumableDataLoader(ds, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers)

    def _eval_loader(self, name: str) -> DataLoader:
        return DataLoader(self.splits[name], batch_size=max(self.batch_size, 1024), num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")

    def predict_dataloader(self) -> DataLoader:
        return self._eval_loader("test")


class SyntheticSTDataModule(_GroupedDataModule):
    """The STRank batch-effect toy (paper 13) as a DataModule; see :func:`batch_effect_data`.

    Training: ``n_slides x n_spots`` spots ``(x (1,), counts (G,), slide)``. Validation: the
    noiseless curves on ``n_grid // 2`` grid midpoints; test: on ``n_grid`` points of [0, 1]
    (group 0). Pred/truth correlation there is the card's metric.

    Args:
        setting: ``imbalanced`` (slides 1.. see x in a window of width 0.2) or ``balanced``. Default: imbalanced.
        n_spots: spots per slide. Default: 4000 (card).
        n_slides: slides (groups). Default: 2 (card).
        n_genes: genes; gene 0 is the official curve. Default: 1 (card).
        dispersion: negative-binomial dispersion r. Default: 10.0 (card).
        drop_rate: binomial thinning of the counts. Default: 0.0.
        slide_scale: per-slide scale of the curve. Default: [1.0, 10.0] (official: slide 1 = 10 mu + 10).
        slide_offset: per-slide offset. Default: [0.0, 10.0].
        scale_sigma: log-normal spread of a per-(slide, gene) scale factor. Default: 0.0.
        offset_max: per-(slide, gene) extra offset ~ U(0, offset_max). Default: 0.0.
        library_sigma: log-normal spread of a per-spot library factor. Default: 0.0.
        n_grid: test grid points (card: 2000). Default: 2000.
        data_seed: seed of the generator; None (the default) uses the run seed (``seed_everything``,
            read from ``PL_GLOBAL_SEED``), so one seed sets data and model as the card's "random state".
        batch_size: spots per training batch. Default: 256 (card).
        group_batches: use :class:`GroupBatchSampler` (one slide per batch, never split across DDP
            ranks) instead of shuffled mixed batches (the official toy). Default: False.
        num_workers: DataLoader workers. Default: 0.
    """

    def __init__(
        self,
        setting: str = "imbalanced",
        n_spots: int = 4000,
        n_slides: int = 2,
        n_genes: int = 1,
        dispersion: float = 10.0,
        drop_rate: float = 0.0,
        slide_scale: list[float] | None = None,
        slide_offset: list[float] | None = None,
        scale_sigma: float = 0.0,
        offset_max: float = 0.0,
        library_sigma: float = 0.0,
        n_grid: int = 2000,
        data_seed: int | None = None,
        batch_size: int = 256,
        group_batches: bool = False,
        num_workers: int = 0,
    ) -> None:
        super().__init__(batch_size, group_batches, num_workers, 0)
        self.data_seed = data_seed
        if n_grid < 2:
            raise ValueError(f"SyntheticSTDataModule: n_grid={n_grid!r}; allowed: an integer >= 2")
        self.kwargs: dict[str, Any] = dict(
            setting=setting, n_spots=n_spots, n_slides=n_slides, n_genes=n_genes, dispersion=dispersion,
            drop_rate=drop_rate, scale_sigma=scale_sigma, offset_max=offset_max, library_sigma=library_sigma,
            slide_scale=[1.0] + [10.0] * (n_slides - 1) if slide_scale is None else slide_scale,
            slide_offset=[0.0] + [10.0] * (n_slides - 1) if slide_offset is None else slide_offset,
            seed=0,
        )
        self.n_grid = n_grid
        self.n_genes = n_genes
        # validate now, not at the first batch (a bad setting fails before the trainer starts)
        batch_effect_data(**{**self.kwargs, "n_spots": 1})

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        seed = run_seed(self.data_seed)
        self.kwargs["seed"] = self.seed = seed
        data = batch_effect_data(**self.kwargs)
        self.curve_params = data["params"]
        f32 = torch.float32
        self.splits["train"] = TensorDataset(
            torch.as_tensor(data["x"], dtype=f32)[:, None],  # (N, 1)
            torch.as_tensor(data["counts"], dtype=f32),  # (N, G)
            torch.as_tensor(data["groups"], dtype=torch.long),  # (N,)
        )
        test_x = np.linspace(0.0, 1.0, self.n_grid)
        val_x = (np.arange(self.n_grid // 2) + 0.5) / (self.n_grid // 2)
        for name, x in (("val", val_x), ("test", test_x)):
            mu = _mu(x, self.curve_params)
            self.splits[name] = TensorDataset(
                torch.as_tensor(x, dtype=f32)[:, None], torch.as_tensor(mu, dtype=f32), torch.zeros(len(x), dtype=torch.long)
            )


def _load_matrix(path: str, what: str) -> np.ndarray:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"SpatialTranscriptomicsDataModule: {what} file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npy":
        arr = np.load(path)
    elif ext == ".pt":
        arr = torch.load(path, map_location="cpu", weights_only=True)
        arr = arr.numpy() if isinstance(arr, torch.Tensor) else np.asarray(arr)
    elif ext == ".csv":
        arr = np.loadtxt(path, delimiter=",", ndmin=2)
    else:
        raise ValueError(f"SpatialTranscriptomicsDataModule: {what} file {path!r}; allowed extensions: .npy, .pt, .csv")
    if arr.ndim != 2:
        raise ValueError(f"SpatialTranscriptomicsDataModule: {what} file {path!r} holds shape {arr.shape}; expected (spots, columns)")
    return arr.astype(np.float32)


class SpatialTranscriptomicsDataModule(_GroupedDataModule):
    """Real spatial transcriptomics: one feature matrix and one count matrix per slide (user files).

    ``features[k]`` is a ``(spots, D)`` matrix of slide k (``.npy``/``.pt``/``.csv``, e.g. frozen
    patch embeddings computed once), ``counts[k]`` the ``(spots, genes)`` raw counts of the same
    spots (``.npy``/``.csv``). Slides listed in ``val_slides``/``test_slides`` are held out. The
    ``n_genes`` most variable genes of the training slides (variance of log1p of library-normalised
    counts, the usual highly-variable-gene choice; the paper uses 50) are kept. The evaluation truth
    is ``log1p(1e4 * c / sum_g c)`` per spot (inferred; correlations are computed per slide).

    Args:
        features: per-slide feature files.
        counts: per-slide count files (same order and spot order as ``features``).
        val_slides: indices of validation slides. Default: [] (no validation loop).
        test_slides: indices of test slides. Default: [-1] (the last slide).
        n_genes: highly variable genes kept; None keeps all. Default: 50 (paper).
        batch_size: spots per training batch. Default: 256 (paper).
        group_batches: one slide per batch (:class:`GroupBatchSampler`). Default: True.
        num_workers: DataLoader workers. Default: 0.
        seed: shuffling seed of the group batches. Default: 0.
    """

    def __init__(
        self,
        features: list[InputPath],
        counts: list[InputPath],
        val_slides: list[int] | None = None,
        test_slides: list[int] | None = None,
        n_genes: int | None = 50,
        batch_size: int = 256,
        group_batches: bool = True,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size, group_batches, num_workers, seed)
        if not features or len(features) != len(counts):
            raise ValueError(
                f"data.init_args.features ({len(features)} files) and data.init_args.counts ({len(counts)} files) need "
                "one file per slide each, in the same order: --data.init_args.features='[s1_feats.npy, ...]' "
                "--data.init_args.counts='[s1_counts.npy, ...]'"
            )
        n = len(features)
        self.test_slides = sorted({i % n for i in ([-1] if test_slides is None else test_slides)})
        self.val_slides = sorted({i % n for i in (val_slides or [])})
        if set(self.val_slides) & set(self.test_slides):
            raise ValueError(f"SpatialTranscriptomicsDataModule: val_slides {self.val_slides} and test_slides {self.test_slides} overlap")
        train = [i for i in range(n) if i not in self.test_slides and i not in self.val_slides]
        if not train:
            raise ValueError(f"SpatialTranscriptomicsDataModule: no training slide left (val {self.val_slides}, test {self.test_slides})")
        if n_genes is not None and n_genes < 1:
            raise ValueError(f"SpatialTranscriptomicsDataModule: n_genes={n_genes!r}; allowed: None or an integer >= 1")
        self.train_slides = train
        self.feature_files, self.count_files, self.n_genes = list(features), list(counts), n_genes

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        feats = [_load_matrix(p, "features") for p in self.feature_files]
        cnts = [_load_matrix(p, "counts") for p in self.count_files]
        for k, (f, c) in enumerate(zip(feats, cnts, strict=True)):
            if f.shape[0] != c.shape[0]:
                raise ValueError(f"SpatialTranscriptomicsDataModule: slide {k} has {f.shape[0]} feature rows but {c.shape[0]} count rows")
            if not np.isfinite(c).all() or (c < 0).any():
                raise ValueError(f"SpatialTranscriptomicsDataModule: counts of slide {k} contain negative or non-finite values")
        if len({c.shape[1] for c in cnts}) != 1 or len({f.shape[1] for f in feats}) != 1:
            raise ValueError("SpatialTranscriptomicsDataModule: all slides need the same feature and gene columns")

        def normalised(c: np.ndarray) -> np.ndarray:
            return np.log1p(1e4 * c / np.maximum(c.sum(axis=1, keepdims=True), 1e-12))

        genes = np.arange(cnts[0].shape[1])
        if self.n_genes is not None and self.n_genes < len(genes):
            var = np.concatenate([normalised(cnts[k]) for k in self.train_slides]).var(axis=0)
            genes = np.sort(np.argsort(-var, kind="stable")[: self.n_genes])
        self.genes = genes

        def dataset(slides: list[int], truth: bool) -> TensorDataset:
            x = torch.as_tensor(np.concatenate([feats[k] for k in slides]))
            y = np.concatenate([(normalised(cnts[k]) if truth else cnts[k])[:, genes] for k in slides])
            g = torch.as_tensor(np.concatenate([np.full(len(feats[k]), k) for k in slides]), dtype=torch.long)
            return TensorDataset(x, torch.as_tensor(y, dtype=torch.float32), g)

        self.splits = {"train": dataset(self.train_slides, truth=False), "test": dataset(self.test_slides, truth=True)}
        if self.val_slides:
            self.splits["val"] = dataset(self.val_slides, truth=True)

    def val_dataloader(self) -> DataLoader | list:
        return self._eval_loader("val") if "val" in self.splits else []  # [] skips validation

