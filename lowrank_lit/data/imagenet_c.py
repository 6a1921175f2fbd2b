"""ImageNet-C (Hendrycks & Dietterich, 2019) as a test-time adaptation stream, from your local copy.

Point ``data_dir`` at the standard release: ``<data_dir>/<corruption>/<severity>/<wnid>/<image>.JPEG`` (the
class folders in the same sorted order as ImageNet's, as torchvision's ``ImageFolder`` reads them). Nothing is
downloaded. Images are resized to ``resize`` (256), centre-cropped to ``img_size`` (224) and normalised with
the ImageNet channel statistics. The stream visits the corruptions in order, ``recurrences`` times, each
visit a seeded shuffled pass over that corruption's images (or its first ``max_batches`` batches); batches
are ``(x, y, domain, recurrence)`` as :class:`lowrank_lit.tta.TTAModule` expects, read by ``num_workers``
processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

__all__ = ["ImageNetCDataModule", "IMAGENET_C_CORRUPTIONS"]

IMAGENET_C_CORRUPTIONS = (
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
)
_MEAN, _STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class _CorruptionStream(IterableDataset):
    def __init__(self, folders: list, batch_size: int, recurrences: int, seed: int, max_batches: int | None,
                 num_workers: int) -> None:
        self.folders, self.batch_size, self.recurrences = folders, batch_size, recurrences
        self.seed, self.max_batches, self.num_workers = seed, max_batches, num_workers

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for r in range(self.recurrences):
            for d, folder in enumerate(self.folders):
                g = torch.Generator().manual_seed(self.seed * 100003 + r * 101 + d)
                loader = DataLoader(folder, batch_size=self.batch_size, shuffle=True, generator=g, num_workers=self.num_workers)
                for i, (x, y) in enumerate(loader):
                    if self.max_batches is not None and i >= self.max_batches:
                        break
                    n = len(y)
                    yield x, y, torch.full((n,), d), torch.full((n,), r)


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
        stream_seed: seed of the image order. Default: 0.

    Raises:
        ValueError: on a bad argument or a missing ``<corruption>/<severity>`` folder (named in the message).
    """

    def __init__(self, data_dir: str, corruptions: list[str] | None = None, severity: int = 5, recurrences: int = 1,
                 batch_size: int = 64, img_size: int = 224, resize: int = 256, max_batches: int | None = None,
                 num_workers: int = 8, stream_seed: int = 0) -> None:
        super().__init__()
        if not 1 <= severity <= 5:
            raise ValueError(f"ImageNetCDataModule: severity={severity!r}; allowed: 1..5")
        if recurrences < 1 or batch_size < 1 or (max_batches is not None and max_batches < 1):
            raise ValueError(f"ImageNetCDataModule: recurrences={recurrences}, batch_size={batch_size}, max_batches={max_batches}; "
                             "allowed: >= 1 (max_batches: None or >= 1)")
        self.data_dir = data_dir
        self.corruptions = list(IMAGENET_C_CORRUPTIONS) if corruptions is None else list(corruptions)
        self.severity, self.recurrences, self.batch_size = severity, recurrences, batch_size
        self.img_size, self.resize, self.max_batches = img_size, resize, max_batches
        self.num_workers, self.stream_seed = num_workers, stream_seed
        self.stream: _CorruptionStream | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.stream is not None:
            return
        from torchvision import datasets, transforms

        tf = transforms.Compose([transforms.Resize(self.resize), transforms.CenterCrop(self.img_size), transforms.ToTensor(),
                                 transforms.Normalize(_MEAN, _STD)])
        folders = []
        for c in self.corruptions:
            path = os.path.join(self.data_dir, c, str(self.severity))
            if not os.path.isdir(path):
                raise ValueError(f"ImageNetCDataModule: data_dir={self.data_dir!r} has no {c}/{self.severity} folder "
                                 f"(expected <data_dir>/<corruption>/<severity>/<wnid>/*.JPEG)")
            folders.append(datasets.ImageFolder(path, transform=tf))
        self.stream = _CorruptionStream(folders, self.batch_size, self.recurrences, self.stream_seed, self.max_batches,
                                        self.num_workers)

    def test_dataloader(self) -> DataLoader:
        assert self.stream is not None, "call setup() first"
        return DataLoader(self.stream, batch_size=None)
