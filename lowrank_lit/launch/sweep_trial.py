"""One sweep trial: a ``lowrank fit`` subprocess whose run directory is fixed before it starts, its objective read
back (:func:`run_trial`), and the signal handling that passes a stop on to it."""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowrank_lit.launch.sweep_spec import CONFIG_KEY, SweepSpec, overrides_to_args
from lowrank_lit.report import read_metric

__all__ = ["TrialResult", "run_trial", "StopRelay"]

@dataclass
class TrialResult:
    number: int
    params: dict[str, Any]
    state: str
    value: float | None
    run_dir: str | None
    error: str | None = None


class StopRelay:
    """SIGINT/SIGTERM handlers of the sweep process: note the signal, pass it on to every running trial (one per
    worker thread)."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.children: set[subprocess.Popen] = set()
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRelay:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they are
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        running = [c for c in list(self.children) if c.poll() is None]
        if self.name is None:
            where = " (stopping the running trial at its next batch boundary)" if running else ""
            print(f"\n{name}: stopping the sweep{where}", file=sys.stderr, flush=True)
        self.name = self.name or name
        for child in running:
            child.send_signal(signum)  # a second Ctrl+C reaches the trials too: they abort at once


def run_trial(spec: SweepSpec, number: int, params: dict[str, Any], *, study_name: str, run_root: Path,
              wandb: bool, extra_args: list[str], log_dir: Path, resume_run_id: str | None = None,
              stop: StopRelay | None = None, prune: dict[str, Any] | None = None,
              experiment_of: Callable[[Sequence[str]], str]) -> TrialResult:
    """Run one ``lowrank fit`` subprocess and read its objective.

    ``resume_run_id`` continues that run directory from its ``last.ckpt`` (an interrupted trial run again).
    With ``stop``, a signal to the sweep is passed on to the trial; the result is then ``INTERRUPTED``.
    ``experiment_of`` names the experiment of the trial's command line (``lowrank fit ...``) as the CLI names it
    (:func:`lowrank_lit.launch.lightning_cli.command_experiment`): its run directory is fixed before it starts.
    With ``prune`` (storage, study, trial id, metric, early_terminate), the trial reports the metric to the study at
    every validation and stops when the pruner says so (:class:`lowrank_lit.launch.pruning.SweepPruning`).
    """
    run_id = resume_run_id or f"{study_name}-t{number:04d}-{secrets.token_hex(2)}"
    args = [sys.executable, "-m", "lowrank_lit", *spec.fit_args]
    if wandb:
        args += ["--config", str(_preset("wandb.yaml"))]
    layered = {k: v for k, v in params.items() if k == CONFIG_KEY}  # a swept config file, then the command line's
    rest = {k: v for k, v in params.items() if k != CONFIG_KEY}  # own flags, then the other swept keys
    args += [*overrides_to_args(layered), *extra_args, *overrides_to_args(rest)]
    try:
        experiment = experiment_of(args[3:])  # after "python -m lowrank_lit"
    except Exception as exc:  # noqa: BLE001 - a trial whose command does not parse fails; the sweep goes on
        return TrialResult(number, params, "FAIL", None, None, f"{exc}")
    run_dir = run_root / experiment / run_id  # fixed before the trial starts: the CLI is told all three
    args += ["--run_root", str(run_root), "--experiment", experiment, "--run_id", run_id]
    if prune is not None:  # one more callback, given last so that its init_args flags reach it
        args += ["--trainer.callbacks+=lowrank_lit.launch.pruning.SweepPruning",
                 *[f"--trainer.callbacks.init_args.{k}={json.dumps(v) if isinstance(v, dict) else v}"
                   for k, v in prune.items()]]
    if resume_run_id is not None:
        args += ["--ckpt_path", "last"]
    env = {**os.environ, "WANDB_RUN_GROUP": study_name}
    env.pop("LOWRANK_RUN_DIR", None)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{run_id}.log"
    with log_path.open("a" if resume_run_id else "w") as log:
        # its own session: a Ctrl+C at the terminal reaches the trial only through the sweep (once)
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if stop is not None:
            stop.children.add(proc)
            if stop.name is not None:  # the signal came while the trial was starting
                proc.send_signal(getattr(signal, stop.name))
        try:
            proc.wait()
        finally:
            if stop is not None:
                stop.children.discard(proc)
    where = str(run_dir) if run_dir.is_dir() else None
    if stop is not None and stop.name is not None:
        return TrialResult(number, params, "INTERRUPTED", None, where, f"interrupted by {stop.name} (log: {log_path})")
    if proc.returncode != 0:
        tail = [ln for ln in log_path.read_text().splitlines() if ln.strip()][-1:] or ["(no output)"]
        return TrialResult(number, params, "FAIL", None, where, f"exit {proc.returncode}: {tail[0][:200]} (log: {log_path})")
    try:
        value = read_metric(run_dir / "metrics.csv", spec.metric)
    except RuntimeError as exc:
        return TrialResult(number, params, "FAIL", None, where, str(exc))
    if math.isnan(value):
        return TrialResult(number, params, "FAIL", None, where, f"{spec.metric} is NaN")
    return TrialResult(number, params, "COMPLETE", value, where)


def _preset(name: str) -> Path:
    from lowrank_lit.registry import project_root

    return project_root() / "callbacks" / name
