"""Loggers: Lightning's, with the settings lowrank runs need."""

from __future__ import annotations

import os
from typing import Any

from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from lowrank_lit.report import keep_previous

__all__ = ["CSVLogger", "WandbLogger"]


class WandbLogger(_LightningWandbLogger):
    """Lightning's :class:`~lightning.pytorch.loggers.WandbLogger`, minus the ``anonymous`` setting.

    Lightning always passes ``anonymous=None`` to ``wandb.init``, and W&B (0.19 and newer) answers every
    run with "The anonymous setting has no effect and will be removed". This class passes it only when
    you set it. Every argument is Lightning's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)


class _KeepingWriter(ExperimentWriter):
    """Lightning's CSV experiment writer, except that an earlier ``metrics.csv`` in the folder is neither deleted nor
    overwritten: the first save of this run moves it to ``metrics.<n>.csv`` (and writes ``hparams.yaml`` then too), so
    a run refused before its first logged step leaves the folder as it was."""

    def __init__(self, log_dir: str) -> None:
        self._kept = False
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv here, before anything is logged
        pass

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)

    def save(self) -> None:
        if not self._kept and (self.metrics or self.hparams):
            keep_previous(self.log_dir, self.NAME_METRICS_FILE)
            self._kept = True
        if self.hparams:
            from lightning.pytorch.core.saving import save_hparams_to_yaml

            save_hparams_to_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)
        super().save()


class CSVLogger(_LightningCSVLogger):
    """Lightning's :class:`~lightning.pytorch.loggers.CSVLogger`, which every ``lowrank`` run writes ``metrics.csv``
    with: an earlier attempt's ``metrics.csv`` in a re-entered run directory is kept as ``metrics.<n>.csv`` when this
    attempt first saves (not deleted when the logger starts), so a resume refused while it loads its checkpoint
    changes nothing. Every argument is Lightning's."""

    @property
    def experiment(self) -> Any:
        if self._experiment is None and rank_zero_only.rank == 0:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingWriter(log_dir=self.log_dir)
        return super().experiment
