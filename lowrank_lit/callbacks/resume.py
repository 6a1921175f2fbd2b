"""Keep ``checkpoints/last.ckpt`` current so that an interrupted run resumes where it stopped.

:class:`ResumeCheckpoint` is added to every ``lowrank fit`` run. It writes ``last.ckpt``

* at the end of every training epoch (after validation, so the epoch's state is complete),
* every ``every_n_train_steps`` optimizer steps when set (for long epochs),
* when the run is interrupted by SIGINT (Ctrl+C), SIGTERM (``kill``, SLURM's time limit) or
  SIGUSR1: the signal is noted, the current batch finishes, the checkpoint is written at that
  batch boundary and :class:`RunInterrupted` ends the run. A second Ctrl+C aborts at once
  (nothing is written; the previous ``last.ckpt`` stays).

Under DDP the ranks agree at every batch end (one all-reduce of a small integer) whether any rank
was signalled, so a signal to one rank or to all of them stops every rank after the same batch,
and the checkpoint is written once. Under SLURM with auto-requeue, SIGUSR1 (``--signal=SIGUSR1@90``)
stops the run the same way and then asks SLURM to requeue the job (``scontrol requeue``); the
requeued job resumes from ``last.ckpt``. Lightning's own SIGUSR1 handler (which writes
``hpc_ckpt_*.ckpt`` inside the signal handler, in the middle of a step) is replaced once training
starts, and its SIGTERM handler (which issues a collective inside the signal handler and can leave
rank 0 waiting in a broadcast forever) is not called.

The file is written beside its final name and renamed over it after an fsync, so a crash or a full
disk in the middle of a save leaves the previous ``last.ckpt`` intact (a rename within one folder
is atomic; a temporary file elsewhere would be copied across filesystems).

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
import subprocess
import sys
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lowrank_lit.report import artifact_path

__all__ = ["ApplyResumeChanges", "ResumeCheckpoint", "RunInterrupted", "STOP_SIGNALS"]

#: signals that stop a run at the next batch boundary with a checkpoint
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")
#: what ranks exchange at a batch end: 0 = no signal; the largest code wins (SIGUSR1 also requeues)
_CODES = {"SIGINT": 1, "SIGTERM": 2, "SIGUSR1": 3}
_NAMES = {code: name for name, code in _CODES.items()}


def _slurm_requeue_job() -> str | None:
    """The job id ``scontrol requeue`` takes when this process runs under SLURM with auto-requeue, else None."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    if not SLURMEnvironment.detect():
        return None
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else os.environ.get("SLURM_JOB_ID")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        dirpath: folder of the checkpoint. Default: ``checkpoints/`` in the run directory
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
        self._armed = False  # True while training runs (between on_train_start and the end of fit)
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
            self.dirpath = artifact_path(trainer, "checkpoints")

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
            self._write(trainer, self.last_path)
            self._last_saved = key
        return self.last_path

    @staticmethod
    def _write(trainer: Trainer, path: str) -> None:
        """``trainer.save_checkpoint`` (collective under DDP) into a file beside ``path``, fsync, rename over it."""
        if "://" in path:  # a remote filesystem: its own write semantics
            trainer.save_checkpoint(path)
            return
        folder, name = os.path.split(path)
        tmp = os.path.join(folder, f".{name}.partial")
        trainer.save_checkpoint(tmp)
        if trainer.is_global_zero:
            _fsync(tmp)
            os.replace(tmp, path)
            try:
                _fsync(folder)
            except OSError:  # some filesystems do not fsync folders
                pass

    def _agreed_signal(self, trainer: Trainer) -> str | None:
        """The stop signal every rank acts on: this rank's, or under DDP the strongest any rank received."""
        code = _CODES.get(self._received or "", 0)
        if trainer.world_size > 1:
            flag = torch.tensor([code], dtype=torch.int32, device=trainer.strategy.root_device)
            code = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        return _NAMES.get(code)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._armed:
            return
        name = self._agreed_signal(trainer)
        if name is not None:
            self._stop(trainer, name, at_epoch_end=False)
        n = self.every_n_train_steps
        if n and trainer.global_step > 0 and trainer.global_step % n == 0:
            self._save(trainer, at_epoch_end=False)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._save(trainer, at_epoch_end=True)
        name = self._agreed_signal(trainer) if self._armed else None
        if name is not None:
            self._stop(trainer, name, at_epoch_end=True)

    def _stop(self, trainer: Trainer, name: str, at_epoch_end: bool) -> None:
        self._received = None
        path = self._save(trainer, at_epoch_end)
        if name == "SIGUSR1" and trainer.is_global_zero:
            self._requeue()
        raise RunInterrupted(name, path, trainer.current_epoch, trainer.global_step)

    @staticmethod
    def _requeue() -> None:
        """Under SLURM, ask for this job to be queued again (what Lightning's auto-requeue does, after our save)."""
        job = _slurm_requeue_job()
        if job is None:
            return
        try:
            code = subprocess.call(["scontrol", "requeue", job])
        except FileNotFoundError:
            code = None
        msg = "requeued" if code == 0 else f"could not requeue (scontrol exit {code})"
        print(f"SLURM job {job}: {msg}", file=sys.stderr, flush=True)

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
    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Lightning registers its handlers just before the sanity check: replace them from here on (its
        # SIGTERM handler issues a collective inside the handler, which can hang DDP ranks)
        if not trainer.fast_dev_run:
            self._install(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._attach_loaders(trainer)
        if trainer.fast_dev_run:
            return
        self._armed = True
        if trainer.received_sigterm:  # arrived before our handlers: stop after the first batch
            self._received = self._received or "SIGTERM"
        self._install(trainer)

    def _install(self, trainer: Trainer) -> None:
        if self._previous:
            return
        for name in self.stop_signals:
            signum = getattr(signal, name, None)
            if signum is None:  # e.g. SIGUSR1 on Windows
                continue
            previous = signal.getsignal(signum)
            if name == "SIGUSR1" and previous not in (signal.SIG_DFL, None) and not _is_lightnings(previous):
                continue  # the user's own SIGUSR1 handler
            try:
                signal.signal(signum, self._handler(trainer, name))
            except ValueError:  # not the main thread
                return
            self._previous[signum] = previous

    def _handler(self, trainer: Trainer, name: str) -> Any:
        def handle(signum: int, frame: Any) -> None:
            if name == "SIGINT" and self._received is not None:
                raise KeyboardInterrupt  # second Ctrl+C: abort now
            if self._received is None:
                where = f"rank {trainer.global_rank}: " if trainer.world_size > 1 else ""
                print(f"\n{where}{name}: stopping after this batch and saving a checkpoint"
                      + (" (Ctrl+C again to abort now)" if name == "SIGINT" else ""), file=sys.stderr, flush=True)
            if _CODES[name] > _CODES.get(self._received or "", 0):
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
        self._armed = False
        self._restore_handlers()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._armed = False
        self._restore_handlers()
        if isinstance(exception, SIGTERMException) and not isinstance(exception, RunInterrupted):
            # Lightning's own stop (DDP: raised on every rank at a batch start, i.e. at a batch boundary);
            # mid-validation the previous last.ckpt is kept
            if not (trainer.validating or trainer.sanity_checking):
                self._save(trainer, at_epoch_end=False)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._armed = False
        self._restore_handlers()


def _is_lightnings(handler: Any) -> bool:
    """True for the signal handler Lightning installs itself (its SLURM requeue handler)."""
    return type(handler).__module__.startswith("lightning.")


class ApplyResumeChanges(Callback):
    """Apply a resume's changed optimizer hyperparameters to the restored optimizers (``--resume_changes=apply``).

    Restoring a checkpoint loads each optimizer's ``state_dict``, whose param groups carry the hyperparameters the run
    was trained with (``lr``, ``weight_decay``, ``betas``, ...), and each scheduler's ``base_lrs``. This callback
    records the values the resumed config built (``on_fit_start``, after the optimizers exist and before the
    checkpoint's training state is loaded) and sets them again once it is loaded (``on_train_start``). A learning rate
    under a scheduler keeps its place in the schedule: the restored rate is scaled by new base / old base. Each value
    it changes is printed once (rank 0).

    Used by ``lowrank fit ... --ckpt_path ... --resume_changes=apply``
    (:mod:`lowrank_lit.launch.resume_contract`); in your own code, add it to a ``Trainer`` that resumes.
    """

    def __init__(self) -> None:
        super().__init__()
        self._built: list[list[dict[str, Any]]] = []
        self._base_lrs: list[list[float] | None] = []
        #: ``"optimizer 0, group 0: lr 0.001 -> 0.5"`` for every value set
        self.applied: list[str] = []

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._built = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
                       for opt in trainer.optimizers]
        self._base_lrs = [list(getattr(cfg.scheduler, "base_lrs", []) or []) or None for cfg in trainer.lr_scheduler_configs]

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        scheduled = {id(cfg.scheduler.optimizer) for cfg in trainer.lr_scheduler_configs}
        for i, (opt, built) in enumerate(zip(trainer.optimizers, self._built, strict=False)):
            for j, (group, new) in enumerate(zip(opt.param_groups, built, strict=False)):
                for key, value in new.items():
                    old = group.get(key)
                    if key == "initial_lr" or _same(old, value):
                        continue
                    if key == "lr" and id(opt) in scheduled and "initial_lr" in group and group["initial_lr"]:
                        value = group["lr"] * float(new.get("initial_lr", value)) / float(group["initial_lr"])
                    group[key] = value
                    self.applied.append(f"optimizer {i}, group {j}: {key} {old} -> {value}")
                if "initial_lr" in new and not _same(group.get("initial_lr"), new["initial_lr"]):
                    group["initial_lr"] = new["initial_lr"]
        for cfg, base in zip(trainer.lr_scheduler_configs, self._base_lrs, strict=False):
            if base is not None and list(cfg.scheduler.base_lrs) != base:
                self.applied.append(f"scheduler {type(cfg.scheduler).__name__}: base_lrs {list(cfg.scheduler.base_lrs)} -> {base}")
                cfg.scheduler.base_lrs = list(base)
        if trainer.is_global_zero:
            what = "; ".join(self.applied) if self.applied else "no optimizer hyperparameter differs"
            print(f"resume applies the changed config: {what}", flush=True)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.equal(torch.as_tensor(a), torch.as_tensor(b)))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
