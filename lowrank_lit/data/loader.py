"""A ``DataLoader`` that Lightning can resume in the middle of an epoch, batch for batch.

Lightning resumes a mid-epoch checkpoint exactly only when the training dataloader implements
``state_dict`` / ``load_state_dict`` (it then stores the loader's state in the checkpoint and
hands it back before iterating). :class:`ResumableDataLoader` is a plain
:class:`torch.utils.data.DataLoader` with that interface:

* at every ``iter()`` it remembers the random state the epoch's shuffle is drawn from (the
  loader's ``generator``, else the global torch RNG) and counts the batches it yields;
* its state is that random state plus the number of batches the training loop has consumed (and,
  for a sampler with ``set_epoch`` such as the ``DistributedSampler`` Lightning puts in under DDP,
  the sampler's epoch: Lightning builds the resumed epoch's iterator before it sets the epoch, so
  the replay sets it itself);
* after ``load_state_dict`` the next ``iter()`` replays the epoch's shuffle from the saved state
  and skips the consumed batches, then puts the global RNG back as it found it, so the run goes on
  with the RNG states the checkpoint restored (:class:`~lowrank_lit.callbacks.RNGStateCheckpoint`).

An uninterrupted run draws exactly the same batches as with a plain ``DataLoader`` (recording the
state consumes no random numbers), so switching a DataModule to it changes no result.

Where the loop stands is read from the training loop itself when a
:class:`~lowrank_lit.callbacks.ResumeCheckpoint` is attached (every ``lowrank fit`` run): the
batches processed in this epoch, and whether the epoch is complete (an epoch-end checkpoint then
starts the next epoch afresh). Without it the loader counts what it yielded, less the batch that
Lightning's fetcher holds ahead for loaders without a length (``LIGHTNING_PREFETCH``), and takes a
full count as the epoch's end. ``tests/test_resume.py`` checks both against real interrupted runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

__all__ = ["ResumableDataLoader", "LIGHTNING_PREFETCH"]

#: batches Lightning's training fetcher holds ahead of the loop for a loader without a length
#: (``_PrefetchDataFetcher``; sized loaders are not prefetched)
LIGHTNING_PREFETCH = 1


class ResumableDataLoader(DataLoader):
    """``torch.utils.data.DataLoader`` with ``state_dict`` / ``load_state_dict`` for exact mid-epoch resume.

    Takes exactly the arguments of ``DataLoader``. Skipping on resume fetches and drops the consumed
    batches (cheap for in-memory datasets; with workers the workers do the loading).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._epoch_rng: torch.Tensor | None = None  # random state the current epoch's order was drawn from
        self._sampler_epoch: int | None = None  # the sampler's epoch (DistributedSampler) when the order was drawn
        self._yielded = 0
        self._exhausted = False
        self._pending: dict[str, Any] | None = None
        self._position: Callable[[], tuple[int, bool]] | None = None

    def attach_position(self, position: Callable[[], tuple[int, bool]] | None) -> None:
        """Read the loop's position from ``position() -> (batches processed this epoch, epoch complete)``.

        :class:`~lowrank_lit.callbacks.ResumeCheckpoint` attaches the trainer's batch progress; None
        goes back to counting yielded batches.
        """
        self._position = position

    # ------------------------------------------------------------------ state
    def _rng_state(self) -> torch.Tensor:
        return self.generator.get_state() if self.generator is not None else torch.get_rng_state()

    def _set_rng_state(self, state: torch.Tensor) -> None:
        if self.generator is not None:
            self.generator.set_state(state)
        else:
            torch.set_rng_state(state)

    def _consumed(self) -> tuple[int, bool]:
        if self._position is not None:
            return self._position()
        try:
            total: int | None = len(self)
        except TypeError:
            total = None
        consumed = self._yielded - (LIGHTNING_PREFETCH if total is None else 0)
        return max(consumed, 0), self._exhausted or (total is not None and consumed >= total)

    def _epoch_sampler(self) -> Any:
        """The sampler whose order depends on an epoch number (``set_epoch``), else None."""
        sampler = self.sampler if hasattr(self.sampler, "set_epoch") else None
        inner = getattr(self.batch_sampler, "sampler", None)
        return sampler or (inner if hasattr(inner, "set_epoch") else None)

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch_rng": ByteTensor | None, "consumed": int, "sampler_epoch": int | None}``: where the
        training loop stands in this epoch."""
        consumed, epoch_done = self._consumed()
        if self._epoch_rng is None or epoch_done:
            return {"epoch_rng": None, "consumed": 0, "sampler_epoch": None}
        return {"epoch_rng": self._epoch_rng.clone(), "consumed": consumed, "sampler_epoch": self._sampler_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved position on the next ``iter()`` (a no-op for an epoch-end state)."""
        if not isinstance(state, dict) or "consumed" not in state:
            raise ValueError(f"ResumableDataLoader.load_state_dict: expected keys epoch_rng, consumed; got {state!r}")
        consumed = int(state["consumed"])
        if consumed < 0:
            raise ValueError(f"ResumableDataLoader.load_state_dict: consumed={consumed} must be >= 0")
        self._pending = dict(state) if state.get("epoch_rng") is not None and consumed > 0 else None

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        pending, self._pending = self._pending, None
        self._yielded, self._exhausted = 0, False
        sampler = self._epoch_sampler()
        if pending is None:
            self._epoch_rng = self._rng_state()
            self._sampler_epoch = getattr(sampler, "epoch", None)
            return self._counting(super().__iter__())
        # replay the interrupted epoch's order, skip what was trained on, then restore the RNG
        if sampler is not None and pending.get("sampler_epoch") is not None:
            sampler.set_epoch(int(pending["sampler_epoch"]))
        self._sampler_epoch = pending.get("sampler_epoch")
        current = self._rng_state()
        self._epoch_rng = pending["epoch_rng"].clone()
        self._set_rng_state(self._epoch_rng)
        it = super().__iter__()
        for _ in range(int(pending["consumed"])):
            try:
                next(it)
            except StopIteration:
                break
            self._yielded += 1
        self._set_rng_state(current)
        return self._counting(it)

    def _counting(self, it: Iterator[Any]) -> Iterator[Any]:
        for batch in it:
            self._yielded += 1
            yield batch
        self._exhausted = True
