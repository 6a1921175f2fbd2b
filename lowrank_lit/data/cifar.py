"""CIFAR-10 from a folder you provide (torchvision format); nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Subset

from lowrank_lit.argtypes import InputPath
from lowrank_lit.data.loader import ResumableDataLoader

__all__ = ["CIFAR10DataModule"]

_MEAN = (0.4914, 0.4822, 0.4465)
_STD = (0.2470, 0.2435, 0.2616)


class CIFAR10DataModule(pl.LightningDataModule):
    """CIFAR-10 read by ``torchvision.datasets.CIFAR10(data_dir, download=False)``.

    ``data_dir`` must contain ``cifar-10-batches-py/`` (the python version of the data set from
    the CIFAR-10 web page, extracted). Training images get random crop (padding 4) and horizontal
    flips; all images are normalised with the usual CIFAR-10 channel statistics.

    Args:
        data_dir: folder that holds ``cifar-10-batches-py/``.
        batch_size: samples per batch. Default: 128.
        num_workers: DataLoader workers. Default: 4.
        val_size: training images held out for validation (seeded). Default: 5000.
        split_seed: seed of the validation hold-out. Default: 0.
        augment: random crop + flip on training images. Default: True.

    Raises:
        FileNotFoundError: ``data_dir`` has no ``cifar-10-batches-py/`` (the message says how to get it).
        ValueError: bad ``batch_size`` or ``val_size``.
    """

    num_classes: int = 10

    def __init__(
        self,
        data_dir: InputPath,
        batch_size: int = 128,
        num_workers: int = 4,
        val_size: int = 5000,
        split_seed: int = 0,
        augment: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"CIFAR10DataModule: batch_size={batch_size}; allowed: an integer >= 1")
        if not 0 <= val_size < 50000:
            raise ValueError(f"CIFAR10DataModule: val_size={val_size}; allowed: 0..49999")
        self.save_hyperparameters(logger=False)
        self.data_dir = Path(data_dir).expanduser()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_size = val_size
        self.split_seed = split_seed
        self.augment = augment

    def _check(self) -> None:
        if not (self.data_dir / "cifar-10-batches-py").is_dir():
            raise FileNotFoundError(
                f"CIFAR10DataModule: data_dir={str(self.data_dir)!r} has no cifar-10-batches-py/; download "
                "cifar-10-python.tar.gz from the CIFAR-10 web page and extract it there (nothing is downloaded here)"
            )

    def setup(self, stage: str | None = None) -> None:
        from torchvision import datasets, transforms

        self._check()
        norm = transforms.Normalize(_MEAN, _STD)
        train_tf = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if self.augment else []
        train_tf = transforms.Compose([*train_tf, transforms.ToTensor(), norm])
        eval_tf = transforms.Compose([transforms.ToTensor(), norm])
        train_full = datasets.CIFAR10(str(self.data_dir), train=True, transform=train_tf, download=False)
        eval_full = datasets.CIFAR10(str(self.data_dir), train=True, transform=eval_tf, download=False)
        perm = torch.randperm(len(train_full), generator=torch.Generator().manual_seed(self.split_seed)).tolist()
        self.train_set = Subset(train_full, perm[self.val_size:])
        self.val_set = Subset(eval_full, perm[: self.val_size])
        self.test_set = datasets.CIFAR10(str(self.data_dir), train=False, transform=eval_tf, download=False)

    def _loader(self, dataset, shuffle: bool) -> DataLoader:
        return ResumableDataLoader(dataset, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          pin_memory=True, persistent_workers=self.num_workers > 0)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)
