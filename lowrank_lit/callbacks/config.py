"""Save the resolved run config to the run directory and log it, nested, to the trackers once."""

from __future__ import annotations

import os
import shutil
from typing import Any

import yaml
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from lowrank_lit.report import artifact_path, debug_reason, keep_previous

__all__ = ["RunConfigCallback", "WANDB_CONFIG_FILE"]

#: name of the resolved config among a W&B run's files
WANDB_CONFIG_FILE = "lowrank_config.yaml"


class RunConfigCallback(SaveConfigCallback):
    """:class:`~lightning.pytorch.cli.SaveConfigCallback` that also logs the config to trackers.

    ``config.yaml`` is written to the run directory (rank 0); a debug run's (``fast_dev_run``, ``overfit_batches``,
    ``limit_train_batches``) starts with a ``# debug run (...)`` line. Every logger other than the CSV
    logger (which already sits next to ``config.yaml``) receives the whole config once, as a
    nested mapping, through ``log_hyperparams``; W&B additionally stores ``config.yaml`` as the
    run file ``lowrank_config.yaml``. Modules call ``save_hyperparameters(logger=False)`` so that nothing is logged twice.

    A resumed run (``resuming=True``) writes nothing until its checkpoint has loaded: ``config.yaml`` is written at
    ``on_train_start`` and the earlier attempt's is kept as ``config.<n>.yaml``, so a resume refused while loading
    leaves the run directory as it was.

    Args:
        resuming: this fit continues from a checkpoint (the CLI sets it); every other argument is Lightning's.
    """

    def __init__(self, *args: Any, resuming: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resuming = resuming

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self.resuming and stage == "fit":
            return  # written once the checkpoint has loaded (on_train_start)
        super().setup(trainer, pl_module, stage)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.resuming or self.already_saved:
            return
        if trainer.is_global_zero and self.save_to_log_dir:
            keep_previous(os.path.dirname(artifact_path(trainer, self.config_filename)), self.config_filename)
        self.resuming = False
        super().setup(trainer, pl_module, "fit")

    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        # this runs on rank 0 only: trainer.log_dir would broadcast (a collective) and deadlock DDP;
        # the CLI makes the CSV log dir and the run directory the same folder
        config_path = artifact_path(trainer, self.config_filename)
        reason = debug_reason(config.get("trainer") or {})
        if reason and os.path.isfile(config_path):  # marked for people; `lowrank summarize` reads the trainer keys
            with open(config_path) as f:
                text = f.read()
            if not text.startswith("# debug run"):
                with open(config_path, "w") as f:
                    f.write(f"# debug run ({reason}): `lowrank summarize` leaves it out (--include-debug keeps it)\n{text}")
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                continue
            logger.log_hyperparams(config)
            if isinstance(logger, WandbLogger) and os.path.isfile(config_path) and os.path.isdir(logger.experiment.dir):
                # (WANDB_MODE=disabled gives a run whose files/ folder does not exist: nothing to upload)
                # files in the run's files/ folder are uploaded (now, or by `wandb sync`); W&B keeps its
                # own files/config.yaml, hence the other name
                shutil.copyfile(config_path, os.path.join(logger.experiment.dir, WANDB_CONFIG_FILE))
