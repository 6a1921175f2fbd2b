"""Batches that keep groups (slides, patients, episodes) together, also under DDP."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

__all__ = ["GroupBatchSampler", "group_batches"]


def group_batches(groups: torch.Tensor, batch_size: int, generator: torch.Generator | None = None) -> list[list[int]]:
    """Split the indices ``0..N-1`` into batches in which every group is either whole or one chunk.

    A group larger than ``batch_size`` is cut into chunks of ``batch_size`` indices (the last one
    shorter), each chunk its own batch; groups of at most ``batch_size`` indices stay whole and are
    packed together (first fit, largest group first) into batches of at most ``batch_size``. The
    number and sizes of the batches therefore do not depend on the shuffling. With a ``generator``
    the indices inside each group and the batch order are shuffled; without one both keep index order.

    Args:
        groups: ``(N,)`` integer group id of every sample.
        batch_size: the most samples in one batch.
        generator: random source for shuffling; None keeps the order.

    Returns:
        The batches, as lists of sample indices.
    """
    if batch_size < 1:
        raise ValueError(f"group_batches: batch_size={batch_size!r}; allowed: an integer >= 1")
    groups = torch.as_tensor(groups)
    if groups.ndim != 1 or groups.is_floating_point():
        raise TypeError(f"group_batches: groups must be a 1-D integer tensor, got dtype {groups.dtype}, shape {tuple(groups.shape)}")
    uniq, sizes = torch.unique(groups, return_counts=True)
    uniq = uniq[torch.argsort(-sizes, stable=True)]  # largest first: a fixed packing
    chunks: list[list[int]] = []
    small: list[list[int]] = []
    for g in uniq.tolist():
        idx = torch.nonzero(groups == g).flatten()
        if generator is not None:
            idx = idx[torch.randperm(len(idx), generator=generator)]
        idx = idx.tolist()
        if len(idx) > batch_size:
            chunks += [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]
        else:
            small.append(idx)
    packed: list[list[int]] = []
    for idx in small:  # first fit: the first batch with room takes the whole group
        for batch in packed:
            if len(batch) + len(idx) <= batch_size:
                batch.extend(idx)
                break
        else:
            packed.append(list(idx))
    batches = chunks + packed
    if generator is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


class GroupBatchSampler(BatchSampler):
    """A batch sampler whose batches never mix part of one group with part of another.

    Losses that normalise inside a group (STRank's softmax over a slide's spots) need a group's
    samples together in one micro-batch: :func:`group_batches` keeps small groups whole and cuts
    large ones into ``batch_size`` chunks. Shuffled again each epoch: by ``set_epoch``, else by the
    epoch of a sampler that has one (the injected ``DistributedSampler``), else by counting passes.

    Under DDP Lightning injects a :class:`~torch.utils.data.DistributedSampler` as ``sampler``; this
    class reads the rank and world size from it and hands out whole batches round-robin (padded by
    repeating the first batches so every rank takes the same number of steps) instead of splitting
    samples, so a group is never divided across ranks. Any other ``sampler`` only fixes the dataset
    length.

    Args:
        sampler: an index sampler over the dataset (its length is the dataset size), or the
            ``DistributedSampler`` Lightning injects.
        batch_size: the most samples in one batch.
        drop_last: drop batches smaller than ``batch_size``. Default: False.
        groups: ``(N,)`` integer group id of every sample. Required.
        shuffle: reshuffle every epoch. Default: True.
        seed: base seed of the shuffling (the epoch is added). Default: 0.
    """

    def __init__(
        self,
        sampler: Sampler[int] | Sequence[int],
        batch_size: int,
        drop_last: bool = False,
        groups: torch.Tensor | Sequence[int] | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        if groups is None:
            raise ValueError("GroupBatchSampler: groups is required (the group id of every sample)")
        groups = torch.as_tensor(groups)
        # a DistributedSampler's length is one rank's share; the dataset size is what groups must match
        n = len(sampler.dataset) if isinstance(sampler, DistributedSampler) else len(sampler)
        if len(groups) != n:
            raise ValueError(f"GroupBatchSampler: len(groups)={len(groups)} != dataset size {n}")
        super().__init__(sampler, batch_size, drop_last)
        self.groups = groups
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self._passes = 0
        if isinstance(sampler, DistributedSampler):
            self.num_replicas, self.rank = sampler.num_replicas, sampler.rank
        else:
            self.num_replicas, self.rank = 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch``."""
        self.epoch = epoch
        self._epoch_given = True

    def _current_epoch(self) -> int:
        # Lightning calls set_epoch on the injected DistributedSampler, not on this object; without
        # either, every pass over the data (one per epoch) counts as the next epoch
        if getattr(self, "_epoch_given", False):
            return self.epoch
        return int(getattr(self.sampler, "epoch", self._passes))

    def _all_batches(self, epoch: int = 0) -> list[list[int]]:
        gen = torch.Generator().manual_seed(self.seed + epoch) if self.shuffle else None
        batches = group_batches(self.groups, self.batch_size, gen)
        if self.drop_last:
            batches = [b for b in batches if len(b) == self.batch_size]
        return batches

    def _rank_batches(self, epoch: int = 0) -> list[list[int]]:
        batches = self._all_batches(epoch)
        if self.num_replicas == 1 or not batches:
            return batches
        per_rank = -(-len(batches) // self.num_replicas)
        padded = [batches[i % len(batches)] for i in range(per_rank * self.num_replicas)]
        return padded[self.rank :: self.num_replicas]

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self._current_epoch()
        self._passes += 1
        yield from self._rank_batches(epoch)

    def __len__(self) -> int:  # the same in every epoch (see group_batches)
        return len(self._rank_batches())
