"""Run a W&B sweep file offline with optuna: ``lowrank sweep sweeps/<slug>.yaml``.

The same ``sweeps/<slug>.yaml`` drives an online W&B sweep (``wandb sweep`` + ``wandb agent``) and
this offline runner, which needs no W&B server:

==============  ==========================================
W&B ``method``  trials
==============  ==========================================
``grid``        every combination, walked by the runner
``random``      :class:`optuna.samplers.RandomSampler`
``bayes``       :class:`optuna.samplers.TPESampler`
==============  ==========================================

Each trial is a ``lowrank fit`` subprocess with the trial's overrides as ``--key=value`` flags
(exactly what W&B's ``${args}`` macro passes), its own run directory and, unless ``--no-wandb``,
an offline W&B run grouped by the study name. A swept ``config`` key layers whole config files on the
command's (``--config=<file>``, first among the overrides, so the other swept keys still win): one sweep can
then compare methods that differ in more than one key (``sweeps/peft_suite.yaml``). The objective is the sweep's ``metric.name`` read
from the trial's ``metrics.csv`` (its last logged value, as W&B's run summary). A trial that
crashes is recorded as failed and the sweep goes on.

The study always lives on disk (default ``<run-root>/sweeps/<study>/study.journal``), so a sweep is
resumable like a run:

* Ctrl+C or SIGTERM (SLURM's time limit) is passed on to the running trial, which stops at its next
  batch boundary with a checkpoint; the trial is recorded as interrupted (not failed), the table and
  ``best.yaml`` are written for what finished, and the sweep exits with 128 + the signal number.
* Running the same command again continues the study: an interrupted trial runs again first (resuming
  its run directory from ``last.ckpt``), nothing finished is repeated, a grid ends with every point
  evaluated, and ``run_cap`` counts finished trials (complete or crashed), not attempts. A random or
  bayes restart draws new points (the sampler seed moves on with the study's size).
* A trial left RUNNING by a worker on this host that no longer exists (``kill -9``) is recorded as
  interrupted when the sweep restarts.

Several workers (processes or SLURM array tasks) share one ``--storage`` (an sqlite URL or a
``.journal`` file) and split the trials; a grid point is claimed by the first trial that asks for it.

The verb is here; the sweep file is read and checked in :mod:`~lowrank_lit.launch.sweep_spec`, a trial runs in
:mod:`~lowrank_lit.launch.sweep_trial` and the study in :mod:`~lowrank_lit.launch.sweep_study`; what
:mod:`~lowrank_lit.launch.matrix` runs a grid with is named here too.
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from lowrank_lit.argtypes import PassThrough, Seed, Typed
from lowrank_lit.launch.sweep_spec import (
    SweepError,
    SweepSpec,
    check_keys,
    describe_param,
    flag_clashes,
    load_sweep,
    static_check,
)
from lowrank_lit.launch.sweep_study import SweepStopped, best_config, run_sweep, summary_table, sweep_folder

__all__ = ["SweepError", "SweepStopped", "load_sweep", "flag_clashes", "run_sweep", "main"]


def main(sweep_file: str, *, n_trials: int | None = None, storage: str | None = None, study_name: str | None = None,
         run_root: str = "runs", seed: Seed | None = None, best_config: str | None = None, no_wandb: bool = False,
         check: bool = False, parse: bool = False, extra: PassThrough = [], given: Typed = ()) -> int:  # noqa: B006
    """Run a W&B sweep file offline with optuna (flags it does not know go to every trial's ``lowrank fit``).

    Args:
        sweep_file: W&B sweep YAML (sweeps/<slug>.yaml)
        n_trials: at most this many trials in this call (default: until every grid point, run_cap or 10 trials have
            finished)
        storage: optuna storage shared by workers: sqlite:///x.db or x.journal (default:
            <run-root>/sweeps/<study>/study.journal; the same command continues a stopped sweep)
        study_name: optuna study and W&B group (default: sweep file stem)
        run_root: folder for trial run directories (default: runs)
        seed: sampler seed (default: SLURM_ARRAY_TASK_ID or 0)
        best_config: where to write the best config (default: <run-root>/sweeps/<study>/best.yaml)
        no_wandb: do not create a W&B run per trial
        check: only validate the file, its config files and every swept key against them, run nothing (fast: imports
            neither Lightning nor torch)
        parse: with --check: also parse every swept value through the real `lowrank fit` parser (what every sweep
            does before its first trial)
        extra: the flags passed on to every trial
        given: the words after `lowrank sweep`
    """
    if n_trials is not None and n_trials < 1:  # refused before a study or folder is created
        print(f"lowrank sweep: error: --n-trials={n_trials}; allowed: a positive integer (omit it to run until "
              "the sweep's budget is met)", file=sys.stderr)
        return 2
    from lowrank_lit.launch.run_dir import RunDirError, check_run_root

    try:
        check_run_root(run_root)
    except RunDirError as exc:
        print(f"lowrank sweep: error: {str(exc).replace('--run_root', '--run-root', 1)}", file=sys.stderr)
        return 2
    try:
        spec = load_sweep(sweep_file)
        clashes = flag_clashes(spec, extra)
        if clashes:
            flag, key = clashes[0]
            raise SweepError(
                f"--{flag} sets {key!r}, which {spec.path} sweeps ({describe_param(spec.parameters[key])}); the swept "
                f"value would win in every trial. Drop the flag, or fix the key in the sweep file (`{key}: {{value: ...}}`)"
            )
        notes = static_check(spec)
        if not check or parse:
            check_keys(spec)
    except SweepError as exc:
        print(f"lowrank sweep: error: {exc}", file=sys.stderr)
        return 2
    if check:
        if spec.method == "grid":
            size = f"grid of {len(spec.grid_points())} points"
        else:
            cap = f"run_cap {spec.run_cap}" if spec.run_cap else "--n-trials (default 10)"
            size = f"{spec.method} search: trials are drawn until {cap}"
        parsed = "every swept value parsed by lowrank fit" if parse else "keys checked against the config files"
        print(f"{spec.path}: ok ({len(spec.parameters)} parameters, {size}; {parsed})")
        for note in notes if not parse else []:
            print(f"  note: {note}")
        return 0
    seed = seed if seed is not None else int(os.environ.get("SLURM_ARRAY_TASK_ID", "0"))
    study_name = study_name or spec.path.stem
    stopped: SweepStopped | None = None
    try:
        study, _ = run_sweep(spec, n_trials=n_trials, storage=storage, study_name=study_name,
                             run_root=run_root, seed=seed, wandb=not no_wandb, extra_args=extra, check=False)
    except SweepStopped as exc:
        stopped, study = exc, exc.study
    code = _report(spec, study, run_root, best_config, stopped is not None)
    if stopped is not None:
        again = shlex.join(["lowrank", "sweep", *given])
        print(f"\nlowrank sweep: stopped by {stopped.signal_name}; the study is saved, continue it with: {again}",
              file=sys.stderr, flush=True)
        return 128 + int(getattr(signal, stopped.signal_name))
    return code


def _report(spec: SweepSpec, study: Any, run_root: str, best_config_path: str | None, stopped: bool) -> int:
    """Print and save the table of every trial, and write the best config of what finished."""
    folder = sweep_folder(run_root, study.study_name)
    table = summary_table(spec, study)
    print()
    print(table)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trials.md").write_text(table + "\n")
    try:
        best = study.best_trial
    except ValueError:
        print("\nno trial completed", file=sys.stderr)
        return 1
    out = Path(best_config_path or folder / "best.yaml")
    best_config(spec, study, out)
    print(f"\nbest{' so far' if stopped else ''}: trial {best.number}  {spec.metric}={best.value:.6g}  "
          + " ".join(best.user_attrs.get("overrides", [])))
    print(f"best config: {out}\n  lowrank {spec.fit_args[0]} --config {out}")
    return 0
