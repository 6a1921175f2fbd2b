"""Early termination of sweep trials: report the sweep's metric to its optuna study and stop when pruned.

``lowrank sweep`` on a file with W&B's ``early_terminate: {type: hyperband, ...}`` gives each trial one more callback
on its command line (``--trainer.callbacks+=lowrank_lit.launch.pruning.SweepPruning`` and its ``init_args``, parsed
by LightningCLI like any other): :class:`SweepPruning`, which after every
validation round reports the metric (step = the round, 1, 2, ...) and, when optuna's ``HyperbandPruner`` says the
trial cannot reach the next rung, records the round in the trial (``pruned_at``) and stops fit at that point. The
sweep records the trial as ``PRUNED``.
"""

from __future__ import annotations

import math
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lowrank_lit.launch.sweep_spec import make_pruner, optuna_storage

__all__ = ["SweepPruning"]


class SweepPruning(Callback):
    """Report ``metric`` after each validation round to an optuna trial and stop fit when the pruner says so.

    Args:
        storage: the study's optuna storage (``*.journal`` path or ``sqlite:///`` URL).
        study: the study name.
        trial_id: optuna's id of this trial in the storage.
        metric: the logged key the sweep optimises (``val/loss``).
        early_terminate: the sweep file's ``early_terminate`` block (the pruner is rebuilt from it).
    """

    def __init__(self, storage: str, study: str, trial_id: int, metric: str, early_terminate: dict[str, Any]) -> None:
        super().__init__()
        self.storage, self.study_name, self.trial_id, self.metric = storage, study, trial_id, metric
        self.early_terminate = early_terminate
        self.rounds = 0
        self._trial: Any = None

    def _optuna_trial(self) -> Any:
        if self._trial is None:
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            study = optuna.load_study(study_name=self.study_name, storage=optuna_storage(self.storage),
                                      pruner=make_pruner(self.early_terminate))
            self._trial = optuna.trial.Trial(study, self.trial_id)
        return self._trial

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        value = trainer.callback_metrics.get(self.metric)
        if value is None:
            return
        self.rounds += 1
        should_stop = False
        if trainer.is_global_zero:
            value = float(value)
            trial = self._optuna_trial()
            if math.isfinite(value):
                trial.report(value, self.rounds)
            if not math.isfinite(value) or trial.should_prune():
                trial.set_user_attr("pruned_at", self.rounds)
                should_stop = True
        should_stop = trainer.strategy.broadcast(should_stop)  # every rank stops at the same round
        if should_stop:
            trainer.should_stop = True
