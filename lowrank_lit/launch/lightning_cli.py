"""``LowrankCLI``: Lightning's ``LightningCLI`` with run directories, resumable runs and helpful errors.

Importing this module imports Lightning; the ``lowrank`` entry point (:mod:`lowrank_lit.cli`) does
so only for the Lightning subcommands. :func:`build_parser` gives the real parser of a subcommand
without parsing or running anything (the sweep runner checks swept values with it).
:func:`run_command` runs one Lightning subcommand and returns its run directory.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
from jsonargparse import Namespace
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lowrank_lit.argtypes import SEED_MAX
from lowrank_lit.callbacks.config import RunConfigCallback
from lowrank_lit.callbacks.resume import ResumeCheckpoint
from lowrank_lit.callbacks.rng import RNGStateCheckpoint
from lowrank_lit.launch.checks import (
    check_input_files,
    check_values,
    is_rank_zero,
    resolve_path_templates,
    setup_error,
    stdout_is_terminal,
    wandb_online_allowed,
)
from lowrank_lit.launch.config_yaml import LIGHTNING_COMMANDS, RunSpec, experiment_from_configs
from lowrank_lit.launch.messages import ConfigError, first_line, one_line_error, quiet_known_noise
from lowrank_lit.launch.resume_contract import RESUME_CHANGES, ResumeChanges, check_resume, saved_config
from lowrank_lit.launch.run_dir import (
    CLAIM_FILE,
    ENV_RUN_DIR,
    RunDir,
    RunDirError,
    newest_checkpoint,
    release_claims,
    resolve_run_dir,
    slurm_run_id,
)
from lowrank_lit.registry import import_dotted
from lowrank_lit.report import UNFINISHED_FILE

__all__ = ["LowrankCLI", "RunStopped", "AlreadyFinished", "build_parser", "run_command", "experiment_of",
           "command_experiment", "parser_fit_keys"]

CallbackT = TypeVar("CallbackT", bound=pl.Callback)

quiet_known_noise()


class LowrankCLI(LightningCLI):
    """LightningCLI with run directories, CSV + optional W&B logging and config logging.

    Model and data are given by ``class_path`` (subclass mode). The module owns its optimizer
    (``auto_configure_optimizers=False``): pass it as ``model.init_args.optimizer``.
    After parsing, the run directory ``<run_root>/<experiment>/<run_id>`` is created and
    ``trainer.default_root_dir``, the CSV logger and any W&B logger are pointed at it.
    """

    #: this run's directory, once the arguments are parsed
    run_dir: RunDir | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("subclass_mode_model", True)
        kwargs.setdefault("subclass_mode_data", True)
        kwargs.setdefault("auto_configure_optimizers", False)
        kwargs.setdefault("save_config_callback", RunConfigCallback)
        # a directory is only re-entered by the same SLURM job or an explicit --run_id
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        # no prefix matching: --trainer.max_epoch must not silently mean --trainer.max_epochs
        kwargs.setdefault(
            "parser_kwargs",
            {"exit_on_error": False, "allow_abbrev": False, **{c: {"allow_abbrev": False} for c in LIGHTNING_COMMANDS}},
        )
        # RNG states travel with every checkpoint, so resuming is exact (added to every run)
        # and the step of the last validation is recorded (a fit ending mid-epoch is validated once more, after_fit)
        # and a run that has started holds unfinished.json until it ends well (summaries leave such runs out)
        kwargs.setdefault("trainer_defaults", {"callbacks": [RNGStateCheckpoint(), _LastValidation(), _RunStart()]})
        try:
            super().__init__(pl.LightningModule, pl.LightningDataModule, *args, **kwargs)
        except SIGTERMException as exc:  # stopped by a signal: say where the run was writing
            raise RunStopped(exc, self.run_dir) from exc
        finally:  # the run directory is free again, however the run ended
            release_claims()

    def _set_seed(self) -> None:
        """Seed as LightningCLI does, without its "Seed set to N" line on stderr (a refused command prints one line
        only); the seed is printed on the run's start line and saved in its config."""
        from lightning.fabric.utilities.seed import seed_everything

        config_seed = self._get(self.config, "seed_everything")
        self._random_seed = config_seed is True  # a resume takes the seed its run was trained with
        if isinstance(config_seed, int) and not isinstance(config_seed, bool) and not 0 <= config_seed <= SEED_MAX:
            raise ConfigError(f"--seed_everything={config_seed}: allowed: an integer seed in 0..{SEED_MAX}, true (a random "
                              "seed, saved in the run's config) or false (no seeding)")
        if config_seed is False:
            return
        config_seed = seed_everything(None if config_seed is True else config_seed, workers=True, verbose=False)
        if self.subcommand:
            self.config[self.subcommand]["seed_everything"] = config_seed
        else:
            self.config["seed_everything"] = config_seed

    def _parse_ckpt_path(self) -> None:
        """LightningCLI reads the hyperparameters of ``--ckpt_path`` before anything else: a folder, an empty or a
        truncated file is one line naming it first (not torch's EOFError)."""
        sub = self.config.get("subcommand")
        if sub and os.path.exists(str(self.config[sub].get("ckpt_path") or "")):  # a missing one: check_input_files
            self._check_ckpt_path(self.config[sub])
        if sub == "fit":
            # Lightning would overwrite the command line's model arguments with the checkpoint's hyperparameters (a
            # change ignored without a word); a resume compares the two configs instead (resume_contract)
            return
        super()._parse_ckpt_path()

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parse as LightningCLI does; a parse error becomes one line naming the key (and the closest valid one)."""
        from jsonargparse import ArgumentError

        argv = sys.argv[1:] if args is None else [str(a) for a in args]
        # a run id from the command line re-enters a run on purpose; one set in a config file names a prerequisite
        self._run_id_given = any(a == "--run_id" or a.startswith("--run_id=") for a in argv)
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as exc:
            argv = sys.argv[1:] if args is None else list(args)
            sub = self._subcommand_parsers.get(argv[0]) if argv and isinstance(argv[0], str) else None
            raise ConfigError(one_line_error(exc, sub)) from exc

    def add_arguments_to_parser(self, parser: Any) -> None:
        # how the config is run (its verb, what must run first, what it needs): read by lowrank and the tests
        parser.add_dataclass_arguments(RunSpec, "run")
        parser.add_argument(
            "--experiment",
            type=str | None,
            default=None,
            help="Experiment name, the folder under run_root (default: derived from the first --config, "
            "configs/baseline/mlp_digits.yaml -> baseline/mlp_digits).",
        )
        parser.add_argument("--run_root", type=str, default="runs", help="Folder holding all run directories.")
        parser.add_argument(
            "--run_id",
            type=str | None,
            default=None,
            help="Re-enter this run directory (resume). Default: the SLURM job id, else a new unique id.",
        )
        parser.add_argument(
            "--checkpoint_every_n_steps",
            type=int,
            default=0,
            help="Also write checkpoints/last.ckpt every this many optimizer steps (it is always written at every "
            "epoch end and when the run is interrupted by SIGINT, SIGTERM or SIGUSR1). 0: epoch ends only.",
        )
        parser.add_argument(
            "--resume_changes",
            type=ResumeChanges,
            default="refuse",
            help="What a resume (--ckpt_path) does with a config that differs from the one its checkpoint was trained "
            f"with ({', '.join(RESUME_CHANGES)}): refuse lists the keys in one line; apply builds the new config, loads "
            "the checkpoint into it and sets the new optimizer hyperparameters on the restored optimizer. Keys that may "
            "always change (epochs, logging, devices, ...): docs/cli.md.",
        )
        parser.add_argument(
            "--test_after_fit",
            type=bool,
            default=False,
            help="After `fit`, run the test loop on the final weights (metrics land in the same run).",
        )

    def after_instantiate_classes(self) -> None:
        """Say where the run writes and what it runs on, when it starts (once its classes are built and set up: a
        class or callback that refuses its arguments names no run). Lightning's own "GPU available" lines are
        silenced: they went to stderr."""
        super().after_instantiate_classes()
        trainer = getattr(self, "trainer", None)
        start = _callback(trainer, _RunStart)
        if trainer is None or start is None or not is_rank_zero() or self.subcommand is None:
            return
        run_dir = self.run_dir
        if run_dir is not None:
            cfg = self.config[self.subcommand]
            seed = cfg.get("seed_everything")
            start.lines.append(f"run {run_dir.experiment}/{run_dir.run_id}: {run_dir.path}"
                               + (" (re-entered)" if run_dir.resumed else "")
                               + (f" (seed {seed})" if seed is not False and seed is not None else ""))
        kind = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()
        start.lines.append(f"devices: {trainer.num_nodes * trainer.num_devices} x {kind} ({trainer.num_nodes} node(s), "
                           f"precision {trainer.precision})")

    def after_fit(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if self.trainer.interrupted:
            return
        self._validate_final_weights()
        if cfg.get("test_after_fit"):
            self.trainer.test(self.model, datamodule=self.datamodule, verbose=True, ckpt_path=self._final_weights())

    def _validate_final_weights(self) -> None:
        """Validate once more when fit ended after its last validation (``max_steps`` mid-epoch, or
        ``check_val_every_n_epoch`` skipping the last epoch), so the run's last ``val/*`` values describe the weights
        it ends with, as a sweep reading them assumes."""
        from lightning.pytorch.utilities.model_helpers import is_overridden

        trainer = self.trainer
        tracker = _callback(trainer, _LastValidation)
        if tracker is None or tracker.step == trainer.global_step or trainer.global_step == 0:
            return
        if not is_overridden("validation_step", self.model) or not any(n > 0 for n in trainer.num_val_batches or [0]):
            return
        trainer.validate(self.model, datamodule=self.datamodule, verbose=False)

    def _final_weights(self) -> str | None:
        """The checkpoint holding the weights fit ended with, for ``trainer.test``; None means the model as it is.

        Lightning's test loop on a SLURM job loads the newest ``hpc_ckpt_*.ckpt`` of the run when it is
        given no path, whatever fit did after it; the final ``last.ckpt`` is passed instead (the same
        weights as the model in memory). Without a final ``last.ckpt`` any hpc checkpoint is moved out of
        the test loop's way (renamed ``*.ckpt.stale``) rather than tested.
        """
        from lowrank_lit.callbacks.resume import ResumeCheckpoint
        from lowrank_lit.checkpoint import checkpoint_step

        trainer = self.trainer
        if slurm_run_id() is None or self.run_dir is None or not any(self.run_dir.path.glob("hpc_ckpt_*.ckpt")):
            return None  # Lightning tests the model as it is
        for cb in trainer.callbacks:
            if isinstance(cb, ResumeCheckpoint) and cb.dirpath and os.path.isfile(cb.last_path):
                if checkpoint_step(cb.last_path) == trainer.global_step:
                    return cb.last_path
        if trainer.is_global_zero:
            for stale in self.run_dir.path.glob("hpc_ckpt_*.ckpt"):
                stale.rename(stale.with_suffix(".ckpt.stale"))
        trainer.strategy.barrier("stale hpc checkpoints")
        return None

    def before_instantiate_classes(self) -> None:
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        check_values(cfg, self.subcommand)  # before a run directory exists: a bad input leaves nothing behind
        _ddp_for_the_model(cfg)
        _sharding_for_the_model(cfg)
        self._templates = resolve_path_templates(cfg)  # {seed}, {torso}: filled once, here; classes get plain paths
        check_input_files(cfg)
        experiment = experiment_of(cfg)
        try:  # claimed before anything is written into it (a second run on a live run's directory is refused)
            run_dir = resolve_run_dir(cfg.run_root, experiment, cfg.run_id, claim=is_rank_zero())
        except RunDirError as exc:
            raise ConfigError(str(exc)) from None
        os.environ[ENV_RUN_DIR] = str(run_dir.path)  # inherited by DDP worker processes
        self.run_dir = run_dir
        cfg.experiment = experiment
        cfg.trainer.default_root_dir = str(run_dir.path)
        try:
            cfg.trainer.logger = self._loggers(cfg.trainer.get("logger"), run_dir)
            cfg.trainer.callbacks = self._callbacks(cfg.trainer.get("callbacks"), cfg, self.subcommand)
            if self.subcommand == "fit":
                self._resume_point(cfg, run_dir, reuse=not getattr(self, "_run_id_given", True))
            self._check_ckpt_path(cfg)
            if self.subcommand == "fit":
                self._resume_contract(cfg, run_dir)
        except BaseException:
            self._remove_if_unstarted(run_dir)
            raise

    def _resume_contract(self, cfg: Namespace, run_dir: RunDir) -> None:
        """A fit that loads a checkpoint runs the config that checkpoint was trained with, up to the keys that may
        change (:mod:`~lowrank_lit.launch.resume_contract`); other changes are refused in one line, or applied with
        ``--resume_changes=apply``. Nothing is written before: config.yaml and metrics.csv of the run directory are
        kept (as ``config.<n>.yaml``, ``metrics.<n>.csv``) only once the checkpoint has loaded."""
        import yaml

        path = cfg.get("ckpt_path")
        self._resuming = bool(path) and os.path.isfile(str(path))
        if not self._resuming:
            return
        own = os.path.abspath(str(path)).startswith(os.path.abspath(run_dir.path) + os.sep)
        saved = saved_config(str(path))
        seed = (saved[1] or {}).get("seed_everything")
        if getattr(self, "_random_seed", False) and isinstance(seed, int) and not isinstance(seed, bool):
            cfg.seed_everything = seed  # `true` drew a new seed: take the run's
        new = yaml.safe_load(self._parser(self.subcommand).dump(cfg, skip_none=False, skip_check=True)) or {}
        mode = cfg.get("resume_changes") or "refuse"
        changes = check_resume(str(path), new, own_run=own, mode=mode, saved=saved)
        self._apply_changes = mode == "apply"
        self.save_config_kwargs = {**self.save_config_kwargs, "resuming": True}
        if changes and is_rank_zero():
            print(f"--resume_changes=apply: {len(changes)} key(s) differ from the checkpoint's config and apply: "
                  + "; ".join(map(str, changes)), flush=True)

    @staticmethod
    def _check_ckpt_path(cfg: Namespace) -> None:
        """An empty or truncated ``--ckpt_path`` file is one line naming it (and the previous good checkpoint)."""
        from lowrank_lit.checkpoint import CheckpointError, check_readable

        path = cfg.get("ckpt_path")
        if path in (None, "last", "best", "hpc", "registry") or "://" in str(path):
            return
        try:
            check_readable(path, "--ckpt_path")
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
        # the run that wrote the checkpoint saved its config beside it: another model class cannot load it
        folder = os.path.dirname(os.path.abspath(str(path)))
        saved = os.path.join(os.path.dirname(folder) if os.path.basename(folder) == "checkpoints" else folder, "config.yaml")
        model = cfg.get("model")
        ours = model.get("class_path") if isinstance(model, Namespace) else None
        if ours and os.path.isfile(saved):
            import yaml

            try:
                with open(saved) as f:
                    theirs = ((yaml.safe_load(f) or {}).get("model") or {}).get("class_path")
            except (OSError, yaml.YAMLError, AttributeError):
                theirs = None
            if theirs and theirs != ours:
                raise ConfigError(f"--ckpt_path={str(path)!r} was trained as {theirs.rsplit('.', 1)[-1]} ({saved}), but the "
                                  f"config builds {ours.rsplit('.', 1)[-1]}; give the config of that run: --config {saved}")

    @staticmethod
    def _resume_point(cfg: Namespace, run_dir: RunDir, reuse: bool = False) -> None:
        """Re-entering a run directory never restarts training over its checkpoints, and never silently.

        ``--ckpt_path last`` resolves to the run's ``checkpoints/last.ckpt`` (an error naming the run
        directory when there is none). A requeued SLURM job resumes from Lightning's
        ``hpc_ckpt_*.ckpt`` (ckpt_path stays None) or, when there is none, from ``checkpoints/last.ckpt``.
        Re-entering with ``--run_id`` needs an explicit ``--ckpt_path`` once the run has checkpoints. A run id set in
        a config file (a prerequisite such as a source model) whose run finished with the same config is reused
        (``reuse``): :class:`AlreadyFinished`.
        """
        ckpts = run_dir.path / "checkpoints"
        last = ckpts / "last.ckpt"
        if cfg.get("ckpt_path") == "last":
            if not run_dir.resumed:
                raise ConfigError(
                    f"--ckpt_path last: {run_dir.path} is a new run directory with nothing to resume; "
                    "pass --run_id <id> of the run to continue (its directory is printed when it starts)"
                )
            if not last.is_file():
                raise ConfigError(
                    f"--ckpt_path last: no checkpoint to resume in {run_dir.path} (no checkpoints/last.ckpt); "
                    "drop --ckpt_path to start this run over, or pick another --run_id"
                )
            cfg.ckpt_path = str(last)
            return
        if cfg.get("ckpt_path") is not None or not run_dir.resumed:
            return
        has_ckpts = ckpts.is_dir() and any(ckpts.glob("*.ckpt"))
        if slurm_run_id() == run_dir.run_id and not cfg.get("run_id"):
            newest = newest_checkpoint([last, *run_dir.path.glob("hpc_ckpt_*.ckpt")])
            if newest is not None:
                cfg.ckpt_path = str(newest)
                if is_rank_zero():
                    print(f"requeued SLURM job {run_dir.run_id}: resuming from {newest}", flush=True)
            return
        if has_ckpts and reuse and _finished_with(cfg, run_dir):
            raise AlreadyFinished(run_dir)
        if has_ckpts:
            raise ConfigError(
                f"run directory {run_dir.path} already has checkpoints; pass --ckpt_path last to resume it "
                "or drop --run_id to start a new run"
            )

    @staticmethod
    def _callbacks(value: Any, cfg: Namespace, subcommand: str | None) -> list:
        """Add what every run needs: ``checkpoints/last.ckpt`` kept current (fit) and log-friendly progress.

        * :class:`~lowrank_lit.callbacks.ResumeCheckpoint` writes ``last.ckpt`` at every epoch end, every
          ``--checkpoint_every_n_steps`` steps and on interruption; a configured ``ModelCheckpoint``
          keeps its best/top-k files but leaves ``last.ckpt`` to it (one writer, so resuming is exact).
        * With stdout not a terminal and no progress bar configured, :class:`~lowrank_lit.callbacks.LogProgress`
          prints plain lines instead of the Rich bar (which shows nothing in a log file).
        """
        trainer_cfg = cfg.trainer
        entries = [] if value is None else list(value) if isinstance(value, list) else [value]
        classes = [import_dotted(e.class_path) for e in entries]
        checkpointing = trainer_cfg.get("enable_checkpointing") is not False
        if subcommand == "fit" and checkpointing and not any(issubclass(c, ResumeCheckpoint) for c in classes):
            for entry, cls in zip(entries, classes, strict=True):
                args = entry.get("init_args") or Namespace()
                if issubclass(cls, ModelCheckpoint) and args.get("save_last") and args.get("dirpath") is None:
                    args.save_last = False  # last.ckpt has one writer: ResumeCheckpoint
                    entry.init_args = args
            every = cfg.get("checkpoint_every_n_steps") or 0
            entries.append(
                Namespace(
                    class_path="lowrank_lit.callbacks.ResumeCheckpoint",
                    init_args=Namespace(every_n_train_steps=int(every)),
                )
            )
        wants_bar = trainer_cfg.get("enable_progress_bar") is not False
        if wants_bar and not any(issubclass(c, ProgressBar) for c in classes) and not stdout_is_terminal():
            entries.append(Namespace(class_path="lowrank_lit.callbacks.LogProgress", init_args=Namespace()))
        return entries

    def instantiate_classes(self) -> None:
        """Build model, data and trainer; a bad argument becomes a one-line :class:`ConfigError`.

        A run directory created for this run is removed again when nothing could be built.
        """
        try:
            super().instantiate_classes()
            if getattr(self, "_apply_changes", False):
                from lowrank_lit.callbacks.resume import ApplyResumeChanges

                self.trainer.callbacks.append(ApplyResumeChanges())
            cfg = self.config[self.subcommand] if self.subcommand else self.config
            for key, template in getattr(self, "_templates", {}).items():
                cfg[key] = template  # config.yaml keeps the template: the seeds of a sweep stay one experiment
        except Exception as exc:
            if self.run_dir is not None:
                self._remove_if_unstarted(self.run_dir)
            root = _root_cause(exc)
            from lightning.fabric.utilities.exceptions import MisconfigurationException

            if isinstance(root, (ValueError, TypeError, ImportError, AttributeError, MisconfigurationException)):
                raise ConfigError(f"{type(root).__name__}: {first_line(root)}") from exc
            raise

    def _run_subcommand(self, subcommand: str) -> None:
        """Run the subcommand; an input error raised while the run was being set up (a data module's missing file,
        a layer's bad argument, before the first batch) becomes one line, and the run directory it made is removed
        when nothing was written into it but its config."""
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException as exc:
            self._mark_unfinished(f"interrupted by {getattr(exc, 'signal_name', 'a signal')}")
            raise
        except BaseException as exc:
            self._mark_unfinished(f"crashed: {type(_root_cause(exc)).__name__}: {first_line(_root_cause(exc))[:200]}")
            if not isinstance(exc, Exception):
                raise
            self._handle_run_error(exc)
        else:
            if self.run_dir is not None and is_rank_zero():  # ended well
                (self.run_dir.path / UNFINISHED_FILE).unlink(missing_ok=True)

    def _mark_unfinished(self, why: str) -> None:
        """Say in the run's unfinished.json how it ended (it exists only once training or evaluating started)."""
        import json

        path = self.run_dir.path / UNFINISHED_FILE if self.run_dir is not None else None
        if path is None or not is_rank_zero() or not path.is_file() or not self._wrote_marker():
            return
        try:
            info = json.loads(path.read_text())
            info["ended"] = why
            path.write_text(json.dumps(info, sort_keys=True) + "\n")
        except (OSError, ValueError):
            pass

    def _wrote_marker(self) -> bool:
        start = _callback(getattr(self, "trainer", None), _RunStart)
        return bool(start is not None and start.wrote)

    def _handle_run_error(self, exc: Exception) -> None:
        """An input error raised while the run was being set up becomes one line (see :meth:`_run_subcommand`)."""
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        root = _root_cause(exc)
        cfg = self.config[self.subcommand] if self.subcommand else self.config
        if getattr(self, "_resuming", False) and not self._restored():
            # the checkpoint did not load into what the config builds: one line, and the run directory untouched
            if self.run_dir is not None and is_rank_zero():
                self._remove_if_unstarted(self.run_dir)
            detail = "; ".join(ln.strip() for ln in str(root).splitlines()[:3] if ln.strip())
            raise ConfigError(f"--ckpt_path={str(cfg.get('ckpt_path'))!r} does not load into what this config builds "
                              f"({type(root).__name__}: {detail[:300]}); resume with the config it was trained with "
                              "(its run's config.yaml)") from exc
        if not isinstance(root, (ValueError, OSError, MisconfigurationException)) or self._batches_done():
            raise exc
        if self.run_dir is not None and is_rank_zero():  # an input error: the run never started
            if self._wrote_marker():
                (self.run_dir.path / UNFINISHED_FILE).unlink(missing_ok=True)
            self._remove_if_unstarted(self.run_dir)
        raise ConfigError(setup_error(root, cfg)) from exc

    def _restored(self) -> bool:
        """Whether fit got past loading its checkpoint (the training loop started)."""
        tracker = _callback(getattr(self, "trainer", None), _LastValidation)
        return tracker is None or tracker.train_started

    def _batches_done(self) -> int:
        """Batches any loop of this trainer has finished (0: the run failed while it was being set up)."""
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0
        loops = [trainer.fit_loop.epoch_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop]
        return sum(loop.batch_progress.total.completed for loop in loops if hasattr(loop, "batch_progress"))

    @staticmethod
    def _remove_if_unstarted(run_dir: RunDir) -> None:
        """Remove a run directory this run created when it is empty or holds nothing but what setup writes (config
        and hyperparameter files, a metrics.csv without rows): a run that never started leaves nothing behind."""
        if run_dir.resumed or not run_dir.path.is_dir():
            return
        setup_files = {"config.yaml", "hparams.yaml", "metrics.csv", CLAIM_FILE}
        entries = list(run_dir.path.iterdir())
        if any(e.name not in setup_files or not e.is_file() for e in entries):
            return
        metrics = run_dir.path / "metrics.csv"
        if metrics.is_file() and len(metrics.read_text().splitlines()) > 1:
            return
        release_claims()
        for e in entries:
            e.unlink(missing_ok=True)
        run_dir.path.rmdir()
        for folder in run_dir.created:  # the experiment folders this run added, when nothing else is in them
            if folder != run_dir.path and folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()

    def _loggers(self, value: Any, run_dir: RunDir) -> Any:
        if value is False:  # logging explicitly switched off
            return False
        entries = [] if value in (None, True) else list(value) if isinstance(value, list) else [value]
        csv = [e for e in entries if issubclass(import_dotted(e.class_path), CSVLogger)]
        if not csv:
            csv = [Namespace(class_path="lowrank_lit.loggers.CSVLogger", init_args=Namespace())]
        elif import_dotted(csv[0].class_path) is CSVLogger:  # Lightning's: ours keeps an earlier metrics.csv
            csv[0].class_path = "lowrank_lit.loggers.CSVLogger"
        others = [e for e in entries if e not in csv]
        # CSV first: trainer.log_dir (config.yaml) and checkpoints/ then live in the run directory itself
        csv[0].init_args.update(Namespace(save_dir=str(run_dir.path), name="", version=""))
        for entry in others:
            if issubclass(import_dotted(entry.class_path), WandbLogger):
                self._configure_wandb(entry.init_args, run_dir)
        return [csv[0], *others]

    @staticmethod
    def _configure_wandb(args: Namespace, run_dir: RunDir) -> None:
        args.save_dir = str(run_dir.path)
        if os.environ.get("WANDB_MODE", "").lower() != "disabled":
            args.offline = bool(args.get("offline")) or not wandb_online_allowed()
        args.id = args.get("id") or run_dir.wandb_id
        args.name = args.get("name") or f"{run_dir.experiment}/{run_dir.run_id}"
        args.group = args.get("group") or os.environ.get("WANDB_RUN_GROUP") or run_dir.experiment
        args.resume = args.get("resume") or "allow"  # a requeued SLURM job continues the same W&B run
        if args.get("project") in (None, "lightning_logs"):
            args.project = "lowrank_lit"


def _callback(trainer: Any, cls: type[CallbackT]) -> CallbackT | None:
    """The trainer's callback of class ``cls`` (None without a trainer or such a callback)."""
    return next((c for c in trainer.callbacks if isinstance(c, cls)), None) if trainer is not None else None


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception of a ``raise ... from`` chain (what the user's input actually triggered)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


class _LastValidation(pl.Callback):
    """Records the global step of the last validation run inside fit (sanity check excluded), and whether training
    started (after a resumed checkpoint loaded)."""

    def __init__(self) -> None:
        self.step = -1
        self.train_started = False  # on_train_start: a checkpoint fit resumes from has loaded by then

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.train_started = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == "fit":
            self.step = trainer.global_step


class _RunStart(pl.Callback):
    """What a run leaves when its first batch starts and says when that batch has run (training, the sanity check,
    evaluation or prediction), after every class and callback was set up and a resumed checkpoint has loaded: a run
    refused while it is set up or in its first batch (an input error) names no run and leaves nothing.

    * ``unfinished.json`` is written into the run directory (rank 0) when the first batch starts; the CLI removes it
      when the command ends well (or is refused as an input error) and records in it how the run ended otherwise. A
      run killed with SIGKILL keeps it as written. ``lowrank summarize`` leaves such runs out and counts them.
    * ``lines`` (the run directory, the devices; set by the CLI) are printed on stdout when the first batch has run.
    """

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._marked = False
        #: this process wrote the run's unfinished.json (an earlier attempt's is never touched)
        self.wrote = False

    def _mark(self, trainer: pl.Trainer) -> None:
        if self._marked:
            return
        self._marked = True
        import json
        import socket
        import time

        from lowrank_lit.report import artifact_path

        if not trainer.is_global_zero or trainer.fast_dev_run or not trainer.loggers:
            return
        info = {"stage": str(getattr(trainer.state.fn, "value", trainer.state.fn)), "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S"), "pid": os.getpid(), "step": trainer.global_step}
        with open(artifact_path(trainer, UNFINISHED_FILE), "w") as f:
            f.write(json.dumps(info, sort_keys=True) + "\n")
        self.wrote = True

    def _announce(self) -> None:
        for line in self.lines:
            print(line, flush=True)
        self.lines = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._mark(trainer)

    def on_validation_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._mark(trainer)

    def on_test_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._mark(trainer)

    def on_predict_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._mark(trainer)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._announce()

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._announce()

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._announce()

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._announce()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._announce()  # a fit with nothing left to train (resumed at its end) still says where it ran


def _ddp_for_the_model(cfg: Namespace) -> None:
    """A model some of whose parameters get no gradient at some steps (``ddp_find_unused_parameters = True`` on its
    class) runs several processes with Lightning's ``ddp_find_unused_parameters_true``: plain DDP would stop at its
    first step. The strategy is set in the config, so config.yaml says what ran."""
    trainer = cfg.get("trainer")
    model = cfg.get("model")
    if trainer is None or not isinstance(model, Namespace) or not isinstance(model.get("class_path"), str):
        return
    try:
        cls = import_dotted(model.class_path)
    except Exception:  # noqa: BLE001 - the parser has said what it could not import
        return
    if not getattr(cls, "ddp_find_unused_parameters", False):
        return
    devices = trainer.get("devices")
    count = len(devices) if isinstance(devices, list) else int(devices) if str(devices).isdigit() else 1  # "auto": 1
    several = count > 1 or (trainer.get("num_nodes") or 1) > 1
    if str(trainer.get("strategy")) == "ddp" or (str(trainer.get("strategy")) == "auto" and several):
        trainer.strategy = "ddp_find_unused_parameters_true"


def _sharding_for_the_model(cfg: Namespace) -> None:
    """A sharded run (``trainer.strategy: ShardedStrategy``, configs/base/trainer_fsdp.yaml) of a model that does not
    run sharded stops here in one line with the reason, before any process starts."""
    trainer, model = cfg.get("trainer"), cfg.get("model")
    strategy = trainer.get("strategy") if trainer is not None else None
    path = strategy.get("class_path") if isinstance(strategy, Namespace) else strategy
    if not (isinstance(path, str) and path.rsplit(".", 1)[-1] == "ShardedStrategy"):
        return
    if not isinstance(model, Namespace) or not isinstance(model.get("class_path"), str):
        return
    from lowrank_lit.sharding import sharding_refusal

    try:
        cls = import_dotted(model.class_path)
    except Exception:  # noqa: BLE001 - the parser has said what it could not import
        return
    reason = sharding_refusal(cls) if isinstance(cls, type) else None
    if reason:
        raise ConfigError(reason)


def _finished_with(cfg: Namespace, run_dir: RunDir) -> bool:
    """Whether ``run_dir`` holds a run that finished training with the model, data, seed and length ``cfg`` asks
    for (a fixed-id prerequisite run again: reused, not trained twice)."""
    import yaml

    from lowrank_lit.checkpoint import CheckpointError, load_checkpoint

    try:
        saved = yaml.safe_load((run_dir.path / "config.yaml").read_text()) or {}
        ckpt = load_checkpoint(run_dir.path / "checkpoints" / "last.ckpt")
    except (OSError, yaml.YAMLError, CheckpointError):
        return False
    new = cfg.as_dict()
    keys = ("model", "data", "seed_everything")
    if any(yaml.safe_load(yaml.safe_dump(new.get(k))) != saved.get(k) for k in keys):
        return False
    trainer = new.get("trainer") or {}
    if any(trainer.get(k) != (saved.get("trainer") or {}).get(k) for k in ("max_epochs", "max_steps")):
        return False
    epochs = ((ckpt.get("loops") or {}).get("fit_loop") or {}).get("epoch_progress", {}).get("current", {}).get("processed", 0)
    max_epochs, max_steps = trainer.get("max_epochs"), trainer.get("max_steps")
    return bool((max_steps or -1) > 0 and ckpt.get("global_step", 0) >= max_steps) or \
        bool((max_epochs or -1) > 0 and epochs >= max_epochs)


class AlreadyFinished(Exception):
    """A fixed-id run (a prerequisite whose config file sets ``run_id``) started again after it finished with the
    same model, data, seed and length: it is reused, not trained again (``lowrank`` says so and exits 0), so a quick
    run a user repeats works again. An explicit ``--run_id`` is still refused (resume it with ``--ckpt_path last``)."""

    def __init__(self, run_dir: RunDir) -> None:
        super().__init__(f"run {run_dir.experiment}/{run_dir.run_id} already finished with this config: reused "
                         f"({run_dir.path / 'checkpoints' / 'last.ckpt'}), nothing trained; --run_id <another id> "
                         "trains it again")
        self.run_dir = run_dir


class RunStopped(Exception):
    """A run stopped by a signal (after its checkpoint was written, see :class:`~lowrank_lit.callbacks.RunInterrupted`).

    Attributes:
        cause: Lightning's ``SIGTERMException`` (or its subclass ``RunInterrupted``); ``cause.code`` is the exit code.
        run_dir: the run directory it was writing into, None when it stopped before one existed.
    """

    def __init__(self, cause: SIGTERMException, run_dir: RunDir | None) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.run_dir = run_dir


def run_command(args: list[str] | None = None) -> RunDir | None:
    """Run one Lightning subcommand (``fit``, ``validate``, ``test``, ``predict``) with :class:`LowrankCLI`.

    Args:
        args: the command line after ``lowrank``, e.g. ``["fit", "--config", "x.yaml"]``; None reads ``sys.argv``.

    Returns:
        The run directory the command wrote into.

    Raises:
        RunStopped: a stop signal ended the run (its checkpoint is written).
        ConfigError: a bad argument or input, as one line.
    """
    return LowrankCLI(args=args).run_dir


class _ParserOnlyCLI(LowrankCLI):
    """LowrankCLI that builds its parsers and stops: nothing is parsed, seeded, instantiated or run."""

    def parse_arguments(self, parser: Any, args: Any) -> None:
        self.config = Namespace(subcommand=None, seed_everything=False)

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


def build_parser(subcommand: str = "fit") -> Any:
    """The real ``lowrank <subcommand>`` argument parser, without parsing or instantiating anything.

    ``build_parser("fit").parse_args(["--config", "x.yaml", "--model.init_args.lr=0.1"])`` checks a
    command line exactly as ``lowrank fit`` would (raising ``jsonargparse.ArgumentError``).
    """
    if subcommand not in LIGHTNING_COMMANDS:
        raise ValueError(f"build_parser: subcommand={subcommand!r}; allowed: {', '.join(LIGHTNING_COMMANDS)}")
    return _ParserOnlyCLI(args=[subcommand])._parser(subcommand)


def experiment_of(cfg: Any) -> str:
    """The experiment a parsed command writes to (its run directory is ``<run_root>/<experiment>/<run_id>``): its
    ``experiment`` (the last ``--experiment`` flag or ``experiment:`` key), else the name
    :func:`~lowrank_lit.launch.config_yaml.experiment_from_configs` derives from its ``--config`` files."""
    return str(cfg.experiment or experiment_from_configs(cfg.get("config")))


def command_experiment(args: Sequence[str]) -> str:
    """The experiment of a ``lowrank`` command line (``["fit", "--config", "x.yaml", ...]``), decided by the real
    parser exactly as a run decides it (:func:`experiment_of`); the sweep names each trial's run directory with it.

    Raises:
        ConfigError: the command line does not parse (one line naming the key).
    """
    from jsonargparse import ArgumentError

    with _PARSING:  # the sweep's workers are threads sharing one parser
        parser = _parser_of(args[0])
        try:
            return experiment_of(parser.parse_args(list(args[1:])))
        except ArgumentError as exc:
            raise ConfigError(one_line_error(exc, parser)) from None


_PARSING = threading.Lock()


@functools.cache
def _parser_of(subcommand: str) -> Any:
    return build_parser(subcommand)


def parser_fit_keys() -> list[str]:
    """The top-level keys of the real ``lowrank fit`` parser (``--config`` left out), sorted."""
    return sorted({key.split(".")[0] for key in build_parser("fit").get_defaults().keys()} - {"config"})


def write_fit_keys() -> Path:
    """Write :func:`parser_fit_keys` to :data:`~lowrank_lit.launch.config_yaml.FIT_KEYS_FILE` (what the sweep's
    static check reads without Lightning)."""
    import json

    from lowrank_lit.launch.config_yaml import FIT_KEYS_FILE

    FIT_KEYS_FILE.write_text(json.dumps(parser_fit_keys(), indent=1) + "\n")
    return FIT_KEYS_FILE


if __name__ == "__main__":
    print(f"wrote {write_fit_keys()}", file=sys.stderr)
