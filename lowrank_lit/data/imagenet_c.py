"""ImageNet-C (Hendrycks & Dietterich, 2019) as a test-time adaptation stream, from your local copy.

Point ``data_dir`` at the standard release: ``<data_dir>/<corruption>/<severity>/<wnid>/<image>.JPEG`` (the
class folders in the same sorted order as ImageNet's, as torchvision's ``ImageFolder`` reads them). Nothing is
downloaded. Images are resized to ``resize`` (256), centre-cropped to ``img_size`` (224) and normalised with
the ImageNet channel statistics. The stream is one of the orders of :mod:`lowrank_lit.data.corruptions`
(:func:`~lowrank_lit.data.corruptions.index_plan`, as CIFAR-10-C's): ``csc`` (the corruptions in order,
``recurrences`` times, each visit a seeded shuffled pass over that corruption's images or its first ``max_batches``
batches), ``cdc`` (random runs), ``mixed`` (every image from a random corruption), ``correlated`` (each visit's
labels in a Dirichlet(``dirichlet_alpha``) order) and ``gradual`` (severity 1 -> 5 -> 1 inside each visit, read
from the release's five severity folders). Batches are ``(x, y, domain, recurrence)`` as
:class:`lowrank_lit.tta.TTAModule` expects, each decoded whole by one of ``num_workers`` processes.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lowrank_lit.argtypes import InputPath
from lowrank_lit.data.corruptions import STREAM_SETTINGS, index_plan

__all__ = ["ImageNetCDataModule", "IMAGENET_C_CORRUPTIONS"]

IMAGENET_C_CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
_MEAN, _STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class _BatchStream(Dataset):
    """Item i = the stream's batch i, its images decoded from their (corruption, severity) folders on access."""

    def __init__(self, folders: dict[tuple[int, int], Any], plan: list[tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]) -> None:
        self.folders, self.plan = folders, plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        doms, r, idx, sev = self.plan[i]
        items = [self.folders[(d, s)][j] for d, j, s in zip(doms.tolist(), idx.tolist(), sev.tolist(), strict=True)]
        x = torch.stack([im for im, _ in items])  # (B, 3, img_size, img_size)
        y = torch.tensor([t for _, t in items])
        return x, y, doms.clone(), torch.full((len(idx),), r)


class ImageNetCDataModule(pl.LightningDataModule):
    """The ImageNet-C stream; see the module docstring.

    Args:
        data_dir: the ImageNet-C root (``<corruption>/<severity>/<wnid>/*.JPEG``).
        corruptions: corruptions in stream order. Default: the 15 standard ones.
        severity: 1..5. Default: 5.
        recurrences: passes over all corruptions. Default: 1.
        batch_size: images per batch. Default: 64.
        img_size: centre-crop side. Default: 224.
        resize: shorter side before the crop. Default: 256.
        max_batches: batches per corruption visit; None: the whole folder. Default: None.
        num_workers: image-decoding processes. Default: 8.
        stream_seed: seed of the image orders, the CDC runs, the mixed domains and the Dirichlet slots. Default: 0.
        setting: one of ``csc``, ``cdc``, ``mixed``, ``correlated``, ``gradual``. Default: csc.
        dirichlet_alpha: ``correlated``: the label concentration. Default: 0.01.
        dirichlet_slots: ``correlated``: time slots per visit; None: one per batch. Default: None.

    Raises:
        ValueError: on a bad argument or a missing ``<corruption>/<severity>`` folder (named in the message).
    """

    def __init__(self, data_dir: InputPath, corruptions: list[str] | None = None, severity: int = 5, recurrences: int = 1,
                 batch_size: int = 64, img_size: int = 224, resize: int = 256, max_batches: int | None = None,
                 num_workers: int = 8, stream_seed: int = 0, setting: str = "csc", dirichlet_alpha: float = 0.01,
                 dirichlet_slots: int | None = None) -> None:
        super().__init__()
        if not 1 <= severity <= 5:
            raise ValueError(f"ImageNetCDataModule: severity={severity!r}; allowed: 1..5")
        if recurrences < 1 or batch_size < 1 or (max_batches is not None and max_batches < 1):
            raise ValueError(f"ImageNetCDataModule: recurrences={recurrences}, batch_size={batch_size}, max_batches={max_batches}; "
                             "allowed: >= 1 (max_batches: None or >= 1)")
        if setting not in STREAM_SETTINGS:
            raise ValueError(f"ImageNetCDataModule: setting={setting!r}; allowed: {', '.join(STREAM_SETTINGS)}")
        if not dirichlet_alpha > 0:
            raise ValueError(f"ImageNetCDataModule: dirichlet_alpha={dirichlet_alpha}; allowed: > 0")
        self.setting, self.dirichlet_alpha, self.dirichlet_slots = setting, dirichlet_alpha, dirichlet_slots
        self.data_dir = data_dir
        self.corruptions = list(IMAGENET_C_CORRUPTIONS) if corruptions is None else list(corruptions)
        self.severity, self.recurrences, self.batch_size = severity, recurrences, batch_size
        self.img_size, self.resize, self.max_batches = img_size, resize, max_batches
        self.num_workers, self.stream_seed = num_workers, stream_seed
        self.stream: _BatchStream | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.stream is not None:
            return
        from torchvision import datasets, transforms

        tf = transforms.Compose([transforms.Resize(self.resize), transforms.CenterCrop(self.img_size), transforms.ToTensor(),
                                 transforms.Normalize(_MEAN, _STD)])
        severities = range(1, 6) if self.setting == "gradual" else (self.severity,)
        folders: dict[tuple[int, int], Any] = {}
        for d, c in enumerate(self.corruptions):
            for sev in severities:
                path = os.path.join(self.data_dir, c, str(sev))
                if not os.path.isdir(path):
                    raise ValueError(f"ImageNetCDataModule: data_dir={self.data_dir!r} has no {c}/{sev} folder "
                                     f"(expected <data_dir>/<corruption>/<severity>/<wnid>/*.JPEG"
                                     f"{'; the gradual stream reads severities 1-5' if self.setting == 'gradual' else ''})")
                folders[(d, sev)] = datasets.ImageFolder(path, transform=tf)
        sizes = {key: len(f) for key, f in folders.items()}
        n = min(sizes.values())
        if self.setting != "csc" and self.setting != "cdc" and len(set(sizes.values())) > 1:
            raise ValueError(f"ImageNetCDataModule: setting={self.setting!r} reads image i of any corruption, but the "
                             f"folders hold different numbers of images ({sizes}); allowed: the release's equal folders")
        first = folders[(0, severities[0])]
        labels = torch.tensor(first.targets)[:n]  # the same class folders and files under every corruption
        per_visit = -(-n // self.batch_size)  # a whole pass, the last batch short
        if self.max_batches is not None:
            per_visit = min(per_visit, self.max_batches)
        plan = index_plan(n, labels, len(self.corruptions), self.recurrences, per_visit, self.batch_size, self.setting,
                          self.stream_seed, self.dirichlet_alpha, self.dirichlet_slots, self.severity)
        self.stream = _BatchStream(folders, plan)

    def test_dataloader(self) -> DataLoader:
        assert self.stream is not None, "call setup() first"
        return DataLoader(self.stream, batch_size=None, shuffle=False, num_workers=self.num_workers)
