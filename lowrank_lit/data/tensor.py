"""A DataModule over in-memory tensors, for synthetic tasks and tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from lowrank_lit.data.loader import ResumableDataLoader

__all__ = ["TensorDataModule"]


class TensorDataModule(pl.LightningDataModule):
    """Serve tensors already in memory, e.g. from a synthetic generator.

    Each split is a sequence of tensors sharing their first dimension (``(x, y)`` or more).
    Used from Python (tensors cannot be written in a YAML config); method-specific synthetic
    DataModules subclass it and build the tensors in :meth:`make_splits`.

    Args:
        train: tensors of the training split. Default: None (then :meth:`make_splits` must build them).
        val: tensors of the validation split. Default: None (no validation loop).
        test: tensors of the test split. Default: None (the test loop uses ``val``).
        batch_size: samples per batch. Default: 64.
        num_workers: DataLoader workers. Default: 0.
        shuffle: shuffle the training split each epoch. Default: True.
    """

    #: how a list of samples becomes a batch (a module-level function, so workers can pickle it); None: stacking.
    collate_fn: Callable[[list[tuple[torch.Tensor, ...]]], Any] | None = None
    #: samples per batch of the evaluation splits; None: ``batch_size``
    eval_batch_size: int | None = None

    def __init__(
        self,
        train: Sequence[torch.Tensor] | None = None,
        val: Sequence[torch.Tensor] | None = None,
        test: Sequence[torch.Tensor] | None = None,
        batch_size: int = 64,
        num_workers: int = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"TensorDataModule: batch_size={batch_size!r}; allowed: an integer >= 1")
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle = shuffle
        self._splits: dict[str, TensorDataset | None] = {}
        self._given = {"train": train, "val": val, "test": test}

    def make_splits(self) -> dict[str, Sequence[torch.Tensor] | None]:
        """Build ``{"train": ..., "val": ..., "test": ...}``; subclasses override this."""
        if self._given["train"] is None:
            raise ValueError("TensorDataModule: train=None; pass the training tensors or override make_splits()")
        return self._given

    @staticmethod
    def _dataset(name: str, tensors: Sequence[torch.Tensor] | None) -> TensorDataset | None:
        if tensors is None:
            return None
        sizes = {int(t.shape[0]) for t in tensors}
        if len(sizes) != 1:
            raise ValueError(f"TensorDataModule: tensors of split {name!r} differ in length: {sorted(sizes)}")
        return TensorDataset(*tensors)

    def setup(self, stage: str | None = None) -> None:
        if self._splits:
            return
        self._splits = {name: self._dataset(name, t) for name, t in self.make_splits().items()}

    def _loader(self, name: str, shuffle: bool = False) -> DataLoader:
        dataset = self._splits.get(name)
        if dataset is None:
            raise ValueError(f"TensorDataModule: no {name!r} split was given")
        batch_size = self.batch_size if name == "train" or self.eval_batch_size is None else self.eval_batch_size
        return ResumableDataLoader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=self.num_workers,
                                   collate_fn=self.collate_fn)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader | list:
        # no validation split: an empty list makes Lightning skip the validation loop
        return self._loader("val") if self._splits.get("val") is not None else []

    def test_dataloader(self) -> DataLoader:
        return self._loader("test" if self._splits.get("test") is not None else "val")

    def predict_dataloader(self) -> DataLoader:
        return self.test_dataloader()
