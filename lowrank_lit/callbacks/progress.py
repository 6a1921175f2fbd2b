"""Plain progress lines for logs (SLURM output files, ``> file``, CI), where a live bar prints nothing.

``lowrank`` uses :class:`LogProgress` instead of Lightning's Rich bar whenever stdout is not a
terminal and no progress bar is configured. It prints one line per epoch::

    epoch 3/30  step 80  train/loss 0.1203  val/acc 0.9704  val/loss 0.1121  elapsed 0:00:04  left ~0:00:36

and, inside long epochs, a line every ``every_n_steps`` optimizer steps or ``every_n_seconds``
seconds (whichever comes first). ``lowrank test``, ``predict`` and ``validate`` print the same kind of lines over
their batches (a TTA stream, a watermark detection)::

    test: 300 batches
    test  batch 120/300  elapsed 0:01:00  left ~0:01:30
    test: test/acc 0.8712 (300 batches in 0:02:31)
 Compose it explicitly with
``--trainer.callbacks+=lowrank_lit.callbacks.LogProgress``.
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any, TextIO

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar

__all__ = ["LogProgress", "format_metrics", "time_left"]


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=int(max(seconds, 0))))


def time_left(now: float, fraction: float, start: float, first_batch: tuple[float, float] | None) -> float | None:
    """Seconds left at ``fraction`` done (0..1) of a run started at ``start``: the pace since the end of the first
    batch ``first_batch = (time, fraction)``, which leaves out start-up, data loading warm-up and compilation (they made
    estimates from the whole elapsed time several times too high on short runs); the whole elapsed time before that.
    None when nothing or everything is done."""
    if not 0 < fraction < 1:
        return None
    if first_batch is not None and fraction > first_batch[1] and now > first_batch[0]:
        return (now - first_batch[0]) * (1 - fraction) / (fraction - first_batch[1])
    return (now - start) * (1 - fraction) / fraction


def format_metrics(metrics: dict[str, Any], prefixes: tuple[str, ...] = ("train/", "val/"), per: str = "epoch") -> str:
    """``train/loss 0.1203  val/acc 0.9704`` from Lightning's logged metrics (scalars, sorted).

    A metric logged per step and per epoch (``x_step`` / ``x_epoch``) is shown once, as ``x``: its
    ``per="epoch"`` value (epoch lines) or its ``per="step"`` value (lines inside an epoch).
    """
    if per not in ("epoch", "step"):
        raise ValueError(f"format_metrics: per={per!r}; allowed: epoch, step")
    other = "_step" if per == "epoch" else "_epoch"
    shown: dict[str, float] = {}
    for key, value in metrics.items():
        if not key.startswith(prefixes) or key.endswith(other):
            continue
        if getattr(value, "numel", lambda: 1)() != 1:
            continue
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        shown[key.removesuffix(f"_{per}")] = number
    return "  ".join(f"{k} {v:.4g}" for k, v in sorted(shown.items()))


class LogProgress(ProgressBar):
    """A progress "bar" that prints plain lines: one per epoch, and periodic ones inside long epochs.

    Args:
        every_n_steps: also print a line every this many optimizer steps inside an epoch (in ``lowrank
            test``/``predict``/``validate``: every this many batches); 0 turns step lines off. Default: 0.
        every_n_seconds: also print a line when this many seconds passed since the last line
            (long epochs); 0 turns it off. Default: 60.
        stream: where to print. Default: ``sys.stdout``.
    """

    def __init__(self, every_n_steps: int = 0, every_n_seconds: float = 60.0, stream: TextIO | None = None) -> None:
        super().__init__()
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"LogProgress: every_n_steps={every_n_steps!r} must be an integer >= 0")
        if not isinstance(every_n_seconds, int | float) or every_n_seconds < 0:
            raise ValueError(f"LogProgress: every_n_seconds={every_n_seconds!r} must be a number >= 0")
        self.every_n_steps = every_n_steps
        self.every_n_seconds = float(every_n_seconds)
        self.stream = stream
        self._enabled = True
        self._start = 0.0
        self._last_line = 0.0
        self._start_step = 0
        self._start_epoch = 0
        self._eval_start_time = 0.0
        self._first_batch: tuple[float, float] | None = None  # (time, fraction done) at the end of the first batch
        self._eval_total: int | None = None
        self._eval_done = 0

    # ProgressBar interface
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.trainer.is_global_zero

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_enabled:
            print(*args, file=self.stream or sys.stdout, flush=True, **kwargs)

    # lines
    def _epochs(self, trainer: Trainer) -> str:
        return f"{trainer.current_epoch + 1}/{trainer.max_epochs}" if trainer.max_epochs and trainer.max_epochs > 0 else str(trainer.current_epoch + 1)

    def _fraction(self, trainer: Trainer, epoch_done: bool) -> float:
        """The share of this fit (since it started or resumed) that is done, by steps or epochs, whichever is further."""
        fractions = []
        if trainer.max_steps and trainer.max_steps > 0 and trainer.global_step > self._start_step:
            fractions.append((trainer.global_step - self._start_step) / max(trainer.max_steps - self._start_step, 1))
        if trainer.max_epochs and trainer.max_epochs > 0:
            total = self.total_train_batches
            within = (trainer.fit_loop.epoch_loop.batch_progress.current.completed / total) if isinstance(total, int) and total > 0 and not epoch_done else 0.0
            done = trainer.current_epoch + (1.0 if epoch_done else within)
            if trainer.max_epochs > self._start_epoch:
                fractions.append((done - self._start_epoch) / (trainer.max_epochs - self._start_epoch))
        return max(fractions) if fractions else 0.0

    def _remaining(self, trainer: Trainer, epoch_done: bool) -> str:
        now = time.monotonic()
        elapsed = now - self._start
        fraction = self._fraction(trainer, epoch_done)
        left = time_left(now, fraction, self._start, self._first_batch)
        return f"elapsed {_duration(elapsed)}" + (f"  left ~{_duration(left)}" if left is not None else "")

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start = self._last_line = time.monotonic()
        self._start_step = trainer.global_step
        self._start_epoch = trainer.current_epoch
        self._first_batch = None
        what = f"{trainer.max_epochs} epoch" + ("s" if trainer.max_epochs != 1 else "") if trainer.max_epochs and trainer.max_epochs > 0 else f"{trainer.max_steps} steps"
        batches = self.total_train_batches
        per_epoch = f", {batches} batches per epoch" if isinstance(batches, int) else ""
        resumed = (f" (resumed at step {trainer.global_step}, in epoch {trainer.current_epoch + 1})"  # as the interruption says
                   if trainer.global_step else "")
        self.print(f"training: {what}{per_epoch}{resumed}")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = time.monotonic()
        if self._first_batch is None:  # the time estimate is calibrated from here on (start-up and warm-up excluded)
            self._first_batch = (now, self._fraction(trainer, epoch_done=False))
        by_steps = self.every_n_steps and trainer.global_step > 0 and trainer.global_step % self.every_n_steps == 0
        by_time = self.every_n_seconds and now - self._last_line >= self.every_n_seconds
        total = self.total_train_batches
        last = isinstance(total, int) and batch_idx + 1 >= total
        if (by_steps or by_time) and not last:
            self._last_line = now
            metrics = format_metrics(trainer.progress_bar_metrics, prefixes=("train/",), per="step")
            where = f"{batch_idx + 1}/{total}" if isinstance(total, int) else str(batch_idx + 1)
            self.print(f"epoch {self._epochs(trainer)}  batch {where}  step {trainer.global_step}  {metrics}  "
                       f"{self._remaining(trainer, epoch_done=False)}")

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_line = time.monotonic()
        metrics = format_metrics(trainer.callback_metrics)
        self.print(f"epoch {self._epochs(trainer)}  step {trainer.global_step}  {metrics}  {self._remaining(trainer, epoch_done=True)}")

    # evaluation outside fit (lowrank test / predict / validate): a start line and periodic batch lines
    def _eval_start(self, trainer: Trainer, stage: str, totals: Any) -> None:
        self._eval_start_time = self._last_line = time.monotonic()
        totals = [t for t in (totals or []) if isinstance(t, int | float)]
        self._eval_total = int(sum(totals)) if totals and all(t != float("inf") for t in totals) else None
        self._eval_done = 0
        loaders = f" in {len(totals)} dataloaders" if len(totals) > 1 else ""
        size = f": {self._eval_total} batches{loaders}" if self._eval_total is not None else ""
        self.print(f"{stage}{size}")

    def _eval_batch(self, trainer: Trainer, stage: str) -> None:
        self._eval_done += 1
        now = time.monotonic()
        by_batches = self.every_n_steps and self._eval_done % self.every_n_steps == 0
        by_time = self.every_n_seconds and now - self._last_line >= self.every_n_seconds
        total = self._eval_total
        if not (by_batches or by_time) or (total is not None and self._eval_done >= total):
            return
        self._last_line = now
        elapsed = now - self._eval_start_time
        where = f"{self._eval_done}/{total}" if total else str(self._eval_done)
        left = f"  left ~{_duration(elapsed * (total - self._eval_done) / self._eval_done)}" if total else ""
        metrics = format_metrics(trainer.progress_bar_metrics, prefixes=(f"{stage}/",), per="step")
        self.print(f"{stage}  batch {where}  {metrics + '  ' if metrics else ''}elapsed {_duration(elapsed)}{left}")

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_start(trainer, "test", trainer.num_test_batches)

    def on_test_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                          batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch(trainer, "test")

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._eval_start(trainer, "predict", trainer.num_predict_batches)

    def on_predict_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        self._eval_batch(trainer, "predict")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "validate":
            self._eval_start(trainer, "validate", trainer.num_val_batches)

    def on_validation_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        if trainer.state.fn == "validate":
            self._eval_batch(trainer, "val")

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        done = f" ({self._eval_done} batches in {_duration(time.monotonic() - self._eval_start_time)})"
        self.print(f"test: {format_metrics(trainer.callback_metrics, prefixes=('test/',))}{done}")

    def on_predict_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.print(f"predict done: {self._eval_done} batches in {_duration(time.monotonic() - self._eval_start_time)}")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.state.fn == "validate":
            self.print(f"validate: {format_metrics(trainer.callback_metrics, prefixes=('val/',))}")

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.print(f"training done: epoch {trainer.current_epoch}, {trainer.global_step} steps in {_duration(time.monotonic() - self._start)}")

