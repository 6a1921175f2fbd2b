"""CIFAR-10-C (Hendrycks & Dietterich, 2019) as a test-time adaptation stream, from your local copy.

Point ``data_dir`` at the folder of the standard release: one ``<corruption>.npy`` per corruption
(50000 x 32 x 32 x 3 uint8: severities 1-5, 10000 images each) and ``labels.npy``. Nothing is
downloaded. Images are scaled to [0, 1] and normalised with the CIFAR-10 channel statistics that
:class:`lowrank_lit.data.CIFAR10DataModule` uses, so a source model trained with it fits. The stream is
CSC (the corruptions in order, ``recurrences`` times, the papers' protocol: 15 corruptions, severity 5,
batches of 200, 20 recurrences) or CDC (random runs), as in :mod:`lowrank_lit.data.corruptions`, or one of the
harder streams over the CSC visits: ``mixed`` (every image from a random corruption), ``correlated`` (each
visit's labels in a Dirichlet(``dirichlet_alpha``) order) and ``gradual`` (severity 1 -> 5 -> 1 inside each visit,
read from the release's five severity blocks).
``source_dataloader`` serves clean CIFAR-10 training images (``cifar10_dir``) for source statistics.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from lowrank_lit.argtypes import InputPath
from lowrank_lit.data.corruptions import STREAM_SETTINGS, StreamDataset, index_plan

__all__ = ["CIFAR10CDataModule", "CIFAR10C_CORRUPTIONS"]

CIFAR10C_CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
_MEAN = torch.tensor([0.4914, 0.4822, 0.4465]).view(1, 3, 1, 1)
_STD = torch.tensor([0.2470, 0.2435, 0.2616]).view(1, 3, 1, 1)


def _to_tensor(images: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2).float() / 255.0  # (N, 3, 32, 32)
    return (x - _MEAN) / _STD


class CIFAR10CDataModule(pl.LightningDataModule):
    """The CIFAR-10-C stream; see the module docstring.

    Args:
        data_dir: folder with ``<corruption>.npy`` and ``labels.npy``.
        cifar10_dir: folder holding ``cifar-10-batches-py`` (clean source batches); None: no source batches. Default: None.
        corruptions: corruptions in stream order. Default: the 15 standard ones.
        severity: 1..5. Default: 5.
        recurrences: passes over all corruptions. Default: 20.
        batch_size: images per batch. Default: 200.
        setting: one of ``csc``, ``cdc``, ``mixed``, ``correlated``, ``gradual``. Default: csc.
        stream_seed: seed of the image order and the CDC runs. Default: 0.
        dirichlet_alpha: ``correlated``: the label concentration. Default: 0.01.
        dirichlet_slots: ``correlated``: time slots per visit; None: one per batch. Default: None.
    """

    def __init__(
        self,
        data_dir: InputPath,
        cifar10_dir: str | None = None,
        corruptions: list[str] | None = None,
        severity: int = 5,
        recurrences: int = 20,
        batch_size: int = 200,
        setting: str = "csc",
        stream_seed: int = 0,
        dirichlet_alpha: float = 0.01,
        dirichlet_slots: int | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= severity <= 5:
            raise ValueError(f"CIFAR10CDataModule: severity={severity!r}; allowed: 1..5")
        if setting not in STREAM_SETTINGS:
            raise ValueError(f"CIFAR10CDataModule: setting={setting!r}; allowed: {', '.join(STREAM_SETTINGS)}")
        if not dirichlet_alpha > 0:
            raise ValueError(f"CIFAR10CDataModule: dirichlet_alpha={dirichlet_alpha}; allowed: > 0")
        self.dirichlet_alpha, self.dirichlet_slots = dirichlet_alpha, dirichlet_slots
        self.data_dir, self.cifar10_dir = data_dir, cifar10_dir
        self.corruptions = list(CIFAR10C_CORRUPTIONS) if corruptions is None else list(corruptions)
        self.severity, self.recurrences, self.batch_size = severity, recurrences, batch_size
        self.setting, self.stream_seed = setting, stream_seed
        self.stream: StreamDataset | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.stream is not None:
            return
        if not os.path.isdir(self.data_dir):
            raise FileNotFoundError(f"CIFAR10CDataModule: data_dir={self.data_dir!r} is not a directory (CIFAR-10-C is not downloaded)")
        all_labels = np.load(os.path.join(self.data_dir, "labels.npy"))
        n = len(all_labels) // 5  # 10000 images per severity in the standard release
        lo, hi = (self.severity - 1) * n, self.severity * n
        labels = torch.from_numpy(all_labels[lo:hi]).long()
        gradual = self.setting == "gradual"
        images: dict[int, np.ndarray] = {}
        for d, name in enumerate(self.corruptions):  # uint8 in memory (30 MB per corruption); floats per batch
            path = os.path.join(self.data_dir, f"{name}.npy")
            if not os.path.isfile(path):
                raise FileNotFoundError(f"CIFAR10CDataModule: {path!r} is missing")
            whole = np.load(path, mmap_mode="r")
            images[d] = whole if gradual else np.ascontiguousarray(whole[lo:hi])  # gradual: every severity, from disk
        per_visit = max(1, n // self.batch_size)
        plan = index_plan(n, labels, len(self.corruptions), self.recurrences, per_visit, self.batch_size, self.setting,
                          self.stream_seed, self.dirichlet_alpha, self.dirichlet_slots, self.severity)
        if gradual:  # row offset of the ramp's severity block in the whole release file
            plan = [(doms, r, idx, (sev - 1) * n) for doms, r, idx, sev in plan]
        else:  # the loaded block holds the configured severity only
            plan = [(doms, r, idx, torch.zeros_like(sev)) for doms, r, idx, sev in plan]
        self.stream = _LazyStream(images, labels, plan)

    def source_dataloader(self, batch_size: int | None = None, generator: torch.Generator | None = None) -> DataLoader:
        if self.cifar10_dir is None:
            raise ValueError("CIFAR10CDataModule: cifar10_dir is needed for clean source batches (EATA, ReservoirTTA)")
        from torchvision import datasets

        train = datasets.CIFAR10(self.cifar10_dir, train=True, download=False)
        x = _to_tensor(train.data)
        y = torch.as_tensor(train.targets)
        return DataLoader(TensorDataset(x, y), batch_size=batch_size or self.batch_size, shuffle=True, drop_last=True, generator=generator)

    def test_dataloader(self) -> DataLoader:
        assert self.stream is not None, "call setup() first"
        return DataLoader(self.stream, batch_size=None, shuffle=False)


class _LazyStream(StreamDataset):
    """Stream batches built on access (the whole stream would not fit in memory as floats)."""

    def __init__(self, images: dict[int, np.ndarray], labels: torch.Tensor,
                 plan: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]) -> None:
        super().__init__([])
        self.images, self.labels, self.plan = images, labels, plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        doms, r, idx, offset = self.plan[i]  # per image: corruption, index, row offset of its severity block
        n = len(idx)
        out = np.empty((n, 32, 32, 3), dtype=np.uint8)
        for d in torch.unique(doms).tolist():
            sel = (doms == d).numpy()
            rows = (idx + offset).numpy()[sel]
            order = np.argsort(rows)  # sorted reads from a memory-mapped file
            block = np.empty((len(rows), 32, 32, 3), dtype=np.uint8)
            block[order] = self.images[d][rows[order]]
            out[sel] = block
        return _to_tensor(out), self.labels[idx], doms.clone(), torch.full((n,), r)
