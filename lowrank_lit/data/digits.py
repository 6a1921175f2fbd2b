"""scikit-learn's bundled handwritten digits (1797 images, 8x8, 10 classes) as a DataModule.

Nothing is downloaded: ``sklearn.datasets.load_digits`` ships with scikit-learn. The split is
stratified and seeded, so every run (and every rank under DDP) sees the same partition.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lowrank_lit.data.loader import ResumableDataLoader
from lowrank_lit.seeding import run_seed

__all__ = ["DigitsDataModule"]

_NUM_CLASSES = 10
_MAX_PIXEL = 16.0  # load_digits pixels are integers in [0, 16]


class DigitsDataModule(pl.LightningDataModule):
    """Handwritten digits resized to ``image_size`` with ``channels`` channels.

    Batches are ``(x, y)`` with ``x`` of shape ``(B, channels, image_size, image_size)`` (or
    ``(B, channels * image_size**2)`` when ``flatten=True``) and ``y`` of shape ``(B,)``.

    Args:
        image_size: side length after bilinear resizing, 8..64. Default: 8 (native).
        channels: 1 (grey) or 3 (grey repeated, for RGB backbones). Default: 1.
        normalize: standardise pixels with the training split's mean and std. Default: True.
        flatten: flatten each image to a vector (for MLPs). Default: False.
        batch_size: samples per batch. Default: 64.
        num_workers: DataLoader workers. Default: 0 (the data is in memory).
        val_fraction: fraction of all samples held out for validation. Default: 0.15.
        test_fraction: fraction of all samples held out for testing. Default: 0.15.
        split_seed: seed of the stratified split (independent of the run seed); ``None`` draws the split
            with the run seed (``seed_everything``, the same on every rank). Default: 0.
        shuffle: shuffle the training split every epoch. Default: True.

    Raises:
        ValueError: on an out-of-range argument; the message names it and the allowed values.
    """

    num_classes: int = _NUM_CLASSES

    def __init__(
        self,
        image_size: int = 8,
        channels: int = 1,
        normalize: bool = True,
        flatten: bool = False,
        batch_size: int = 64,
        num_workers: int = 0,
        val_fraction: float = 0.15,
        test_fraction: float = 0.15,
        split_seed: int | None = 0,
        shuffle: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(image_size, int) or not 8 <= image_size <= 64:
            raise ValueError(f"DigitsDataModule: image_size={image_size!r}; allowed: an integer in 8..64")
        if channels not in (1, 3):
            raise ValueError(f"DigitsDataModule: channels={channels!r}; allowed: 1 or 3")
        if batch_size < 1:
            raise ValueError(f"DigitsDataModule: batch_size={batch_size!r}; allowed: an integer >= 1")
        if num_workers < 0:
            raise ValueError(f"DigitsDataModule: num_workers={num_workers!r}; allowed: an integer >= 0")
        for name, frac in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0.0 < frac < 0.5:
                raise ValueError(f"DigitsDataModule: {name}={frac!r}; allowed: a float in (0, 0.5)")
        self.save_hyperparameters(logger=False)
        self.image_size = image_size
        self.channels = channels
        self.normalize = normalize
        self.flatten = flatten
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.split_seed = split_seed
        self.shuffle = shuffle
        self.train_set: TensorDataset | None = None
        self.val_set: TensorDataset | None = None
        self.test_set: TensorDataset | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one sample ``x`` (without the batch dimension)."""
        if self.flatten:
            return (self.channels * self.image_size**2,)
        return (self.channels, self.image_size, self.image_size)

    def _images(self) -> tuple[torch.Tensor, torch.Tensor]:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        x = torch.as_tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / _MAX_PIXEL  # (N, 1, 8, 8)
        y = torch.as_tensor(bunch.target, dtype=torch.long)  # (N,)
        if self.image_size != 8:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        return x, y

    def resolved_split_seed(self) -> int:
        """``split_seed``, or the run seed set by ``seed_everything`` (0 if none) when it is None."""
        return run_seed(self.split_seed)

    def _split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        from sklearn.model_selection import train_test_split

        idx = torch.arange(len(y)).numpy()
        seed = self.resolved_split_seed()
        holdout = self.val_fraction + self.test_fraction
        train_idx, rest_idx = train_test_split(
            idx, test_size=holdout, stratify=y.numpy(), random_state=seed
        )
        val_idx, test_idx = train_test_split(
            rest_idx,
            test_size=self.test_fraction / holdout,
            stratify=y[rest_idx].numpy(),
            random_state=seed,
        )
        return torch.as_tensor(train_idx), torch.as_tensor(val_idx), torch.as_tensor(test_idx)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        x, y = self._images()
        train_idx, val_idx, test_idx = self._split(y)
        if self.normalize:
            mean, std = x[train_idx].mean(), x[train_idx].std()
            x = (x - mean) / std
        if self.channels == 3:
            x = x.expand(-1, 3, -1, -1).contiguous()  # (N, 3, S, S)
        if self.flatten:
            x = x.flatten(1)  # (N, C*S*S)
        self.train_set = TensorDataset(x[train_idx], y[train_idx])
        self.val_set = TensorDataset(x[val_idx], y[val_idx])
        self.test_set = TensorDataset(x[test_idx], y[test_idx])

    def _loader(self, dataset: TensorDataset | None, shuffle: bool) -> DataLoader:
        assert dataset is not None, "call setup() first"
        return ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=self.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)


class DigitsSplitDataModule(DigitsDataModule):
    """Digits split by class for sequential fine-tuning: pretrain on ``source_classes``, fine-tune on ``target_classes``.

    ``train_dataloader`` serves the target classes' training split (labels renumbered 0..T-1);
    ``source_train_dataloader`` the source classes' (labels 0..S-1, used for pretraining);
    ``test_dataloader`` returns two loaders, ``[target test, source test]``, so forgetting can be
    measured through a frozen source head. The underlying split is :class:`DigitsDataModule`'s
    (stratified, ``split_seed``), with the validation part folded into training.

    Args:
        source_classes: digits of the pretraining task. Default: [0, 1, 2, 3, 4].
        target_classes: digits of the fine-tuning task. Default: [5, 6, 7, 8, 9].
        normalize: standardise pixels (False: pixels / 16 only, the card's choice). Default: False.
        flatten: flatten images to 64-vectors. Default: True.
        batch_size: samples per batch. Default: 64.
        test_fraction: fraction of all samples held out for testing. Default: 0.25.
        split_seed: seed of the stratified split; ``None``: the run seed. Default: 0.
        num_workers: DataLoader workers. Default: 0.
    """

    def __init__(
        self,
        source_classes: list[int] | None = None,
        target_classes: list[int] | None = None,
        normalize: bool = False,
        flatten: bool = True,
        batch_size: int = 64,
        test_fraction: float = 0.25,
        split_seed: int | None = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__(image_size=8, channels=1, normalize=normalize, flatten=flatten, batch_size=batch_size,
                         num_workers=num_workers, val_fraction=0.01, test_fraction=test_fraction, split_seed=split_seed)
        self.source_classes = list(range(5)) if source_classes is None else list(source_classes)
        self.target_classes = list(range(5, 10)) if target_classes is None else list(target_classes)
        for name, cls in (("source_classes", self.source_classes), ("target_classes", self.target_classes)):
            if not cls or any(not 0 <= c < _NUM_CLASSES for c in cls) or len(set(cls)) != len(cls):
                raise ValueError(f"DigitsSplitDataModule: {name}={cls!r}; allowed: distinct digits in 0..9")
        if set(self.source_classes) & set(self.target_classes):
            raise ValueError(f"DigitsSplitDataModule: source_classes {self.source_classes} and target_classes {self.target_classes} overlap")
        self.sets: dict[str, TensorDataset] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.sets:
            return
        super().setup(stage)
        assert self.train_set is not None and self.val_set is not None and self.test_set is not None
        train_x = torch.cat([self.train_set.tensors[0], self.val_set.tensors[0]])
        train_y = torch.cat([self.train_set.tensors[1], self.val_set.tensors[1]])
        test_x, test_y = self.test_set.tensors

        def subset(x: torch.Tensor, y: torch.Tensor, classes: list[int]) -> TensorDataset:
            keep = torch.isin(y, torch.tensor(classes))
            relabel = torch.full((_NUM_CLASSES,), -1, dtype=torch.long)
            relabel[torch.tensor(classes)] = torch.arange(len(classes))
            return TensorDataset(x[keep], relabel[y[keep]])

        self.sets = {
            "source_train": subset(train_x, train_y, self.source_classes),
            "target_train": subset(train_x, train_y, self.target_classes),
            "source_test": subset(test_x, test_y, self.source_classes),
            "target_test": subset(test_x, test_y, self.target_classes),
        }

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.sets["target_train"], shuffle=True)

    def source_train_dataloader(self, generator: torch.Generator | None = None,
                                batch_size: int | None = None) -> DataLoader:
        """Shuffled source-class training batches (for pretraining); ``batch_size`` None: the data module's."""
        return DataLoader(self.sets["source_train"], batch_size=batch_size or self.batch_size, shuffle=True,
                          generator=generator)

    def val_dataloader(self) -> list:
        return []  # no validation loop: the test loaders measure both tasks at the end

    def test_dataloader(self) -> list[DataLoader]:
        return [self._loader(self.sets["target_test"], shuffle=False), self._loader(self.sets["source_test"], shuffle=False)]
