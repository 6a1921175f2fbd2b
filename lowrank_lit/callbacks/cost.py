"""The cost of a run's training steps: median step time and peak memory, logged once at the end of training.

Compose it with ``--trainer.callbacks+=lowrank_lit.callbacks.StepCost`` (or ``callbacks+:`` in a config); the
PEFT suite configs do, so ``lowrank summarize peft_suite`` can show each method's step time as a ratio to
prompt tuning measured in the same sweep, and its peak memory.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from lowrank_lit.bench import tensor_bytes

__all__ = ["StepCost", "peak_memory_mb"]


def peak_memory_mb(device: torch.device | None = None) -> float:
    """Peak memory in MiB: CUDA's peak allocated memory on a CUDA device, else the process's peak resident set."""
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


class StepCost(Callback):
    """Logs ``cost/step_s`` (median wall time of a batch after ``skip`` warm-up batches), ``cost/peak_mem_mb``
    (:func:`peak_memory_mb`) and, for training, ``cost/optimizer_state_mb`` (the tensors the optimizers hold) when
    the stage ends.

    A training batch is timed from its start to the end of its optimizer step; a test batch from its start to its
    end (for TTA methods: the adaptation and the prediction). On a CUDA device the queued kernels are waited for
    at both ends of a batch, so the time is the device's, not the launch's. ``lowrank bench`` reads
    :attr:`times` of this callback to time the two configs of a comparison.

    Args:
        skip: first batches left out of the median (allocation, first-call overheads). Default: 5.
        stage: ``"train"`` (training batches) or ``"test"`` (test batches). Default: ``"train"``.

    Attributes:
        times: seconds of every timed batch after the first ``skip``, in order.
    """

    def __init__(self, skip: int = 5, stage: str = "train") -> None:
        if skip < 0:
            raise ValueError(f"StepCost: skip={skip}; allowed: an integer >= 0")
        if stage not in ("train", "test"):
            raise ValueError(f"StepCost: stage={stage!r}; allowed: 'train', 'test'")
        self.skip = skip
        self.stage = stage
        self.times: list[float] = []
        self._start: float | None = None
        self._seen = 0

    @staticmethod
    def _sync(pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def _batch_start(self, pl_module: LightningModule) -> None:
        self._sync(pl_module)
        self._start = time.perf_counter()

    def _batch_end(self, pl_module: LightningModule) -> None:
        if self._start is not None:
            self._sync(pl_module)
            self._seen += 1
            if self._seen > self.skip:
                self.times.append(time.perf_counter() - self._start)
        self._start = None

    def _log(self, trainer: Trainer, pl_module: LightningModule) -> None:
        values = {"cost/peak_mem_mb": peak_memory_mb(pl_module.device)}
        if self.stage == "train" and trainer.optimizers:  # moments, masks, projectors: what a lean optimizer saves
            values["cost/optimizer_state_mb"] = tensor_bytes(trainer.optimizers) / 2**20
        if self.times:
            values["cost/step_s"] = statistics.median(self.times)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=trainer.global_step)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.stage == "train":
            self._batch_start(pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self.stage == "train":
            self._batch_end(pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.stage == "train":
            self._log(trainer, pl_module)

    def on_test_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None:
        if self.stage == "test":
            self._batch_start(pl_module)

    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        if self.stage == "test":
            self._batch_end(pl_module)

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.stage == "test":
            self._log(trainer, pl_module)
