"""Keep ``checkpoints/last.ckpt`` current so that an interrupted run resumes where it stopped.

:class:`ResumeCheckpoint` is added to every ``lowrank fit`` run. It writes ``last.ckpt``

* at the end of every training epoch (after validation, so the epoch's state is complete),
* every ``every_n_train_steps`` optimizer steps when set (for long epochs),
* when the run is interrupted by SIGINT (Ctrl+C), SIGTERM (``kill``, SLURM's time limit) or
  SIGUSR1: the signal is noted, the current batch finishes, the checkpoint is written at that
  batch boundary and :class:`RunInterrupted` ends the run. A second Ctrl+C aborts at once
  (nothing is written; the previous ``last.ckpt`` stays).

Together with :class:`~lowrank_lit.callbacks.RNGStateCheckpoint` (random states) and
:class:`~lowrank_lit.data.loader.ResumableDataLoader` (position in the epoch's shuffle),
``lowrank fit ... --run_id <id> --ckpt_path last`` continues such a run batch for batch: a
deterministic config ends with the same weights and metrics as an uninterrupted run.

In your own Lightning code::

    ckpt = ResumeCheckpoint(dirpath="checkpoints", every_n_train_steps=500)
    trainer = Trainer(callbacks=[ckpt, RNGStateCheckpoint()])
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt.last_path if os.path.exists(ckpt.last_path) else None)
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

__all__ = ["ResumeCheckpoint", "RunInterrupted", "STOP_SIGNALS"]

#: signals that stop a run at the next batch boundary with a checkpoint
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")


class RunInterrupted(SIGTERMException):
    """Raised at a batch boundary after a stop signal, once ``last.ckpt`` is written.

    Attributes:
        signal_name: ``"SIGINT"``, ``"SIGTERM"`` or ``"SIGUSR1"``.
        ckpt_path: the checkpoint written at the interruption (None when nothing could be written).
        epoch: the epoch being trained when the run stopped (0-based).
        global_step: optimizer steps taken.
    """

    def __init__(self, signal_name: str, ckpt_path: str | None, epoch: int, global_step: int) -> None:
        super().__init__(128 + int(getattr(signal, signal_name)))
        self.signal_name = signal_name
        self.ckpt_path = ckpt_path
        self.epoch = epoch
        self.global_step = global_step

    def __str__(self) -> str:
        return f"interrupted by {self.signal_name} at step {self.global_step}, in epoch {self.epoch + 1}"


class ResumeCheckpoint(Checkpoint):
    """Write ``<dirpath>/<filename>.ckpt`` at every epoch end, every N steps and on interruption.

    Args:
        dirpath: folder of the checkpoint. Default: ``<trainer.default_root_dir>/checkpoints``
            (the run directory's ``checkpoints/`` under ``lowrank``).
        filename: file name without ``.ckpt``. Default: ``"last"``.
        every_n_train_steps: also write it every this many optimizer steps; 0 writes only at epoch
            ends and on interruption. Default: 0.
        stop_signals: signals that stop the run with a checkpoint, a subset of
            ``("SIGINT", "SIGTERM", "SIGUSR1")``. SIGUSR1 is left to Lightning when it already handles
            it (SLURM auto-requeue). Default: all three.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str = "last",
        every_n_train_steps: int = 0,
        stop_signals: list[str] | tuple[str, ...] = STOP_SIGNALS,
    ) -> None:
        super().__init__()
        if not filename or "/" in filename:
            raise ValueError(f"ResumeCheckpoint: filename={filename!r} must be a non-empty file name without '/'")
        if not isinstance(every_n_train_steps, int) or isinstance(every_n_train_steps, bool) or every_n_train_steps < 0:
            raise ValueError(f"ResumeCheckpoint: every_n_train_steps={every_n_train_steps!r} must be an integer >= 0")
        bad = [s for s in stop_signals if s not in STOP_SIGNALS]
        if bad:
            raise ValueError(f"ResumeCheckpoint: stop_signals={list(stop_signals)!r}; allowed: {', '.join(STOP_SIGNALS)}")
        self.dirpath = dirpath
        self.filename = filename
        self.every_n_train_steps = every_n_train_steps
        self.stop_signals = tuple(stop_signals)
        self._received: str | None = None
        self._previous: dict[int, Any] = {}
        self._last_saved: tuple[int, int, bool] | None = None  # (epoch, global_step, at epoch end)

    # ------------------------------------------------------------------ paths
    @property
    def last_path(self) -> str:
        """Where the checkpoint is written (known once the trainer is set up when ``dirpath`` is None)."""
        if self.dirpath is None:
            raise RuntimeError("ResumeCheckpoint.last_path: dirpath is resolved in setup(); pass dirpath= to know it earlier")
        return os.path.join(self.dirpath, self.filename + ".ckpt")

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.dirpath is None:
            self.dirpath = os.path.join(trainer.default_root_dir, "checkpoints")

    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=self.dirpath, filename=self.filename)

    def state_dict(self) -> dict[str, Any]:
        return {"every_n_train_steps": self.every_n_train_steps}

    # ------------------------------------------------------------------ saving
    def _save(self, trainer: Trainer, at_epoch_end: bool) -> str | None:
        if trainer.fast_dev_run or trainer.sanity_checking:
            return None
        key = (trainer.current_epoch, trainer.global_step, at_epoch_end)
        if self._last_saved != key:
            trainer.save_checkpoint(self.last_path)
            self._last_saved = key
        return self.last_path

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._received is not None:
            self._stop(trainer, at_epoch_end=False)
        n = self.every_n_train_steps
        if n and trainer.global_step > 0 and trainer.global_step % n == 0:
            self._save(trainer, at_epoch_end=False)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer, at_epoch_end=True)
        if self._received is not None:
            self._stop(trainer, at_epoch_end=True)

    def _stop(self, trainer: Trainer, at_epoch_end: bool) -> None:
        name, self._received = self._received, None
        path = self._save(trainer, at_epoch_end)
        raise RunInterrupted(name or "SIGTERM", path, trainer.current_epoch, trainer.global_step)

    @staticmethod
    def _attach_loaders(trainer: Trainer) -> None:
        """Let resumable training loaders read the loop's exact position when a checkpoint is written."""
        from lowrank_lit.data.loader import ResumableDataLoader

        progress = trainer.fit_loop.epoch_loop.batch_progress

        def position() -> tuple[int, bool]:
            processed = progress.current.processed
            return processed, processed >= trainer.num_training_batches

        loaders = trainer.train_dataloader
        flat = list(loaders.values()) if isinstance(loaders, dict) else list(loaders) if isinstance(loaders, list | tuple) else [loaders]
        for loader in flat:
            if isinstance(loader, ResumableDataLoader):
                loader.attach_position(position)

    # ------------------------------------------------------------------ signals
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._attach_loaders(trainer)
        # after Lightning's own handlers (registered when the run starts), which ours call in turn
        if trainer.fast_dev_run:
            return
        if trainer.received_sigterm:  # arrived during set-up or the sanity check: stop after the first batch
            self._received = "SIGTERM"
        for name in self.stop_signals:
            signum = getattr(signal, name, None)
            if signum is None:  # e.g. SIGUSR1 on Windows
                continue
            previous = signal.getsignal(signum)
            if name == "SIGUSR1" and previous not in (signal.SIG_DFL, None):
                continue  # Lightning's SLURM requeue handler (or the user's) owns it
            try:
                signal.signal(signum, self._handler(trainer, name, previous))
            except ValueError:  # not the main thread
                return
            self._previous[signum] = previous

    def _handler(self, trainer: Trainer, name: str, previous: Any) -> Any:
        def handle(signum: int, frame: Any) -> None:
            if name == "SIGINT" and self._received is not None:
                raise KeyboardInterrupt  # second Ctrl+C: abort now
            if trainer.is_global_zero and self._received is None:
                print(f"\n{name}: stopping after this batch and saving a checkpoint"
                      + (" (Ctrl+C again to abort now)" if name == "SIGINT" else ""), file=sys.stderr, flush=True)
            if trainer.world_size > 1:
                # ranks must stop at the same batch: Lightning broadcasts rank 0's flag at every batch start
                # and raises SIGTERMException on all ranks; on_exception then writes the checkpoint
                trainer._signal_connector.received_sigterm = True
                if name == "SIGTERM" and callable(previous):
                    previous(signum, frame)  # Lightning's notifier forwards SIGTERM to launched workers
            self._received = name

        return handle

    def _restore_handlers(self) -> None:
        for signum, previous in self._previous.items():
            try:
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            except ValueError:
                pass
        self._previous = {}

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore_handlers()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._restore_handlers()
        if isinstance(exception, SIGTERMException) and not isinstance(exception, RunInterrupted):
            # Lightning's own stop (DDP: raised on every rank at a batch start, i.e. at a batch boundary);
            # mid-validation the previous last.ckpt is kept
            if not (trainer.validating or trainer.sanity_checking):
                self._save(trainer, at_epoch_end=False)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._restore_handlers()
