"""Synthetic data drawn fresh every step, reproducibly: batch ``i`` of epoch ``e`` from its own seed.

:class:`SeededBatches` is a map-style dataset whose item ``i`` is a whole batch drawn by ``sample(generator)``
from a generator seeded by ``(seed, epoch, i)``. A resumed run redraws exactly the batches it would have seen,
and under DDP each rank (which Lightning's distributed sampler hands other indices) has its own stream.
:func:`stream_loader` serves it in order with :class:`EpochSampler`, whose ``set_epoch`` (Lightning calls it
every epoch) moves the dataset to the next epoch's draws. Under DDP Lightning's distributed sampler reorders
the same ``n_batches`` indices every epoch: raise ``n_batches`` rather than the number of epochs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from lowrank_lit.data.loader import ResumableDataLoader
from lowrank_lit.seeding import run_seed

__all__ = ["SeededBatches", "EpochSampler", "stream_loader", "run_seed"]


class SeededBatches(Dataset):
    """Item ``i``: ``sample(generator)`` with the generator seeded by ``(seed, epoch, i)``.

    Args:
        sample: ``generator -> batch`` (a tensor or a tuple of tensors).
        n_batches: batches per epoch.
        seed: the stream's seed.
    """

    def __init__(self, sample: Callable[[torch.Generator], Any], n_batches: int, seed: int) -> None:
        if n_batches < 1:
            raise ValueError(f"SeededBatches: n_batches={n_batches}; allowed: an integer >= 1")
        self.sample, self.n, self.seed = sample, int(n_batches), int(seed)
        self.epoch = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_033 + int(i))
        return self.sample(g)


class EpochSampler(Sampler[int]):
    """Indices ``0..n-1`` in order; ``set_epoch`` gives the dataset the next epoch's draws."""

    def __init__(self, dataset: SeededBatches) -> None:
        self.dataset = dataset

    def set_epoch(self, epoch: int) -> None:
        self.dataset.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.dataset)))


def stream_loader(dataset: SeededBatches) -> ResumableDataLoader:
    """A resumable loader yielding the dataset's batches as they are (no extra batching)."""
    return ResumableDataLoader(dataset, batch_size=None, sampler=EpochSampler(dataset))
