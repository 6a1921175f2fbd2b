"""Synthetic data drawn fresh every step, reproducibly: batch ``i`` of epoch ``e`` from its own seed.

:class:`SeededBatches` is a map-style dataset whose item ``i`` is a whole batch drawn by ``sample(generator)``
from a generator seeded by ``(seed, epoch, i)``. A resumed run redraws exactly the batches it would have seen,
and under DDP each rank (which Lightning's distributed sampler hands other indices) has its own stream.
:func:`stream_loader` serves it in order with :class:`EpochSampler`, whose ``set_epoch`` (Lightning calls it
every epoch) moves the dataset to the next epoch's draws. Under DDP Lightning's distributed sampler reorders
the same ``n_batches`` indices every epoch: raise ``n_batches`` rather than the number of epochs.

Orders of test streams (used by :class:`lowrank_lit.data.corruptions.DigitsCorruptionDataModule` and the CIFAR /
ImageNet corruption streams): :func:`dirichlet_order` makes labels temporally correlated (the non-i.i.d.
protocol of the test-time adaptation literature: each class's samples spread over the time slots by a Dirichlet
draw with concentration ``alpha``; small alpha puts each class in few slots), :func:`severity_ramp` gives the
severities of a gradual shift (1 -> 5 -> 1), and :func:`label_entropy` measures a batch's label mix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from lowrank_lit.data.loader import ResumableDataLoader
from lowrank_lit.seeding import run_seed

__all__ = ["SeededBatches", "EpochSampler", "stream_loader", "run_seed", "dirichlet_order", "severity_ramp", "label_entropy"]


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


def dirichlet_order(labels: torch.Tensor, n_slots: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """A permutation of ``labels (N,)`` whose classes are correlated in time: for every class a Dirichlet(``alpha``)
    draw over ``n_slots`` consecutive time slots says which share of its samples goes to each slot; the slots are
    concatenated in order, and inside a slot each class's samples come together (classes in random order).
    ``alpha`` -> 0: every class in one slot; large ``alpha``: every class spread evenly over the slots (with one
    slot per batch, every batch holds every class).

    Raises:
        ValueError: ``n_slots < 1`` or ``alpha <= 0``.
    """
    if n_slots < 1 or not alpha > 0:
        raise ValueError(f"dirichlet_order: n_slots={n_slots}, alpha={alpha}; allowed: >= 1, > 0")
    slots: list[list[torch.Tensor]] = [[] for _ in range(n_slots)]
    for c in torch.unique(labels).tolist():
        members = torch.nonzero(labels == c).flatten()
        members = members[torch.randperm(len(members), generator=generator)]
        # Dirichlet(alpha, ..., alpha) as normalised Gamma(alpha) draws from the stream's generator (float64:
        # alpha = 0.01 draws reach 1e-100)
        gam = torch._standard_gamma(torch.full((n_slots,), float(alpha), dtype=torch.float64), generator=generator)
        share = gam.clamp_min(1e-300) / gam.clamp_min(1e-300).sum()
        cuts = torch.round(torch.cumsum(share, 0) * len(members)).long().tolist()
        start = 0
        for t, stop in enumerate(cuts):
            if stop > start:
                slots[t].append(members[start:stop])
            start = stop
    out = []
    for blocks in slots:  # inside a slot: its classes in random order, each class's samples together
        out += [blocks[int(i)] for i in torch.randperm(len(blocks), generator=generator)]
    return torch.cat(out) if out else torch.empty(0, dtype=torch.long)


def severity_ramp(n: int, low: int = 1, high: int = 5) -> list[int]:
    """Severities of ``n`` consecutive batches rising from ``low`` to ``high`` and back (``n = 9``: 1 2 3 4 5 4 3 2 1)."""
    if n < 1 or not 1 <= low <= high:
        raise ValueError(f"severity_ramp: n={n}, low={low}, high={high}; allowed: n >= 1, 1 <= low <= high")
    if n == 1:
        return [high]
    return [int(round(low + (high - low) * (1 - abs(2 * j / (n - 1) - 1)))) for j in range(n)]


def label_entropy(labels: torch.Tensor, num_classes: int) -> float:
    """Entropy (nats) of the label histogram of one batch: 0 for a single class, ln C for a balanced batch."""
    p = torch.bincount(labels.flatten().long(), minlength=num_classes).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum()) if len(p) else math.nan
