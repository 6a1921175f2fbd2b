"""A sweep's optuna study on disk: sampling and grid points, claiming and requeueing trials, :func:`run_sweep`, and
the tables written from the study."""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lowrank_lit.launch.sweep_spec import (
    SweepSpec,
    check_keys,
    format_value,
    load_sweep,
    make_pruner,
    optuna_storage,
    overrides_to_args,
    param_choices,
)
from lowrank_lit.launch.sweep_trial import StopRelay, TrialResult, run_trial

__all__ = ["SweepStopped", "trial_value", "make_sampler", "suggest", "sweep_folder", "default_storage", "run_sweep",
           "optuna_storage", "best_config", "summary_table"]

class SweepStopped(Exception):
    """The sweep was stopped by a signal; the running trial was stopped and recorded as interrupted.

    Attributes:
        signal_name: ``"SIGINT"`` or ``"SIGTERM"``.
        study: the optuna study (on disk; the same command continues it).
        results: the trials this worker ran, the interrupted one last.
    """

    def __init__(self, signal_name: str, study: Any, results: list[Any]) -> None:
        super().__init__(f"sweep stopped by {signal_name}")
        self.signal_name, self.study, self.results = signal_name, study, results


# --------------------------------------------------------------------------------------- optuna
def _encode(v: Any) -> Any:
    return v if v is None or isinstance(v, bool | int | float | str) else json.dumps(v)


def _decode(v: Any, original: list[Any]) -> Any:
    for o in original:
        if _encode(o) == v:
            return o
    return v


def trial_value(spec: SweepSpec, key: str, stored: Any) -> Any:
    """A trial's value of ``key`` as the sweep file wrote it (categorical values are stored encoded)."""
    p = spec.parameters[key]
    return _decode(stored, param_choices(p)) if ("values" in p or "value" in p) else stored


def make_sampler(spec: SweepSpec, seed: int | None) -> Any:
    import optuna

    if spec.method in ("grid", "random"):
        # random: plain draws; a grid is walked by the runner itself (each point is queued with fixed
        # parameters once no trial has finished or claimed it), so a grid's sampler is never asked
        return optuna.samplers.RandomSampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed)


def suggest(trial: Any, spec: SweepSpec) -> dict[str, Any]:
    """The trial's value for every swept key."""
    out = {}
    for key, p in spec.parameters.items():
        if "values" in p or "value" in p:
            choices = param_choices(p)
            out[key] = _decode(trial.suggest_categorical(key, [_encode(v) for v in choices]), choices)
            continue
        dist, lo, hi = p["distribution"], p["min"], p["max"]
        if dist == "int_uniform":
            out[key] = trial.suggest_int(key, int(lo), int(hi))
        elif dist == "log_uniform_values":
            out[key] = trial.suggest_float(key, float(lo), float(hi), log=True)
        elif dist == "q_uniform":
            q = float(p.get("q", 1.0))
            hi_q = lo + math.floor((hi - lo) / q) * q
            out[key] = trial.suggest_float(key, float(lo), float(hi_q), step=q)
        else:
            out[key] = trial.suggest_float(key, float(lo), float(hi))
    return out


def sweep_folder(run_root: str | os.PathLike, study_name: str) -> Path:
    """A sweep's own folder, ``<run_root>/sweeps/<study>``: its study, trial logs, table and best config."""
    return Path(run_root) / "sweeps" / study_name


def default_storage(run_root: str | os.PathLike, study_name: str) -> Path:
    """Where a sweep's study lives unless ``--storage`` says otherwise: ``<run_root>/sweeps/<study>/study.journal``."""
    return sweep_folder(run_root, study_name) / "study.journal"


def _key(params: dict[str, Any]) -> str:
    """A hashable, order-free form of a trial's (encoded) parameters."""
    return json.dumps({k: _encode(v) for k, v in params.items()}, sort_keys=True)


def _worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


#: seconds between a running trial's heartbeats (``alive_at``); a trial silent for 4 of them is orphaned
HEARTBEAT_S = float(os.environ.get("LOWRANK_SWEEP_HEARTBEAT", "30"))


def _orphaned(trial: Any) -> bool:
    """A RUNNING trial whose worker has exited (killed without a chance to record it): on this host its process is
    gone; on any host (a shared database) its heartbeat stopped more than 4 heartbeats ago."""
    alive_at = trial.user_attrs.get("alive_at")
    if isinstance(alive_at, int | float) and time.time() - alive_at > 4 * HEARTBEAT_S:
        return True
    host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, under another user
        pass
    return False


def _interrupted(trial: Any) -> bool:
    import optuna

    return trial.state == optuna.trial.TrialState.FAIL and bool(trial.user_attrs.get("interrupted"))


def _early_stopped(trial: Any) -> bool:
    """Stopped by the pruner (``early_terminate``), not a duplicate grid point (also recorded as pruned)."""
    import optuna

    return trial.state == optuna.trial.TrialState.PRUNED and "pruned_at" in trial.user_attrs


def _finished(trial: Any) -> bool:
    """Complete, stopped early by the pruner, or crashed (a failure that is not an interruption): such a trial is
    never run again."""
    import optuna

    state = trial.state
    return (state == optuna.trial.TrialState.COMPLETE or _early_stopped(trial)
            or (state == optuna.trial.TrialState.FAIL and not _interrupted(trial)))


def _taken(trial: Any) -> bool:
    """Finished, or running in some worker: its parameters are not handed out again."""
    import optuna

    return _finished(trial) or trial.state == optuna.trial.TrialState.RUNNING


def _requeue_interrupted(study: Any) -> None:
    """Record orphaned trials as interrupted, and queue every interrupted trial that has no rerun yet."""
    import optuna

    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        if _orphaned(t):
            study._storage.set_trial_user_attr(t._trial_id, "interrupted", True)
            study.tell(t.number, state=optuna.trial.TrialState.FAIL)
    trials = study.get_trials(deepcopy=False)
    rerun = {t.user_attrs.get("rerun_of") for t in trials}
    for t in trials:
        if _interrupted(t) and t.number not in rerun:
            run_dir = t.user_attrs.get("run_dir")
            resumable = run_dir and (Path(run_dir) / "checkpoints" / "last.ckpt").is_file()
            attrs = {"rerun_of": t.number, **({"resume_run_id": Path(run_dir).name} if resumable else {})}
            study.enqueue_trial(t.params, user_attrs=attrs, skip_if_exists=False)


def _next_trial(study: Any, spec: SweepSpec, cap: int | None, rng: Any) -> Any:
    """Ask the study for the next trial to run, or None when the budget is met.

    Queued trials (interrupted ones run again) come first. A grid then takes a point that no trial has
    finished or is running; random and bayes draw from the sampler until ``cap`` trials have finished
    (running ones count, so parallel workers do not overshoot).
    """
    import optuna

    trials = study.get_trials(deepcopy=False)
    states = optuna.trial.TrialState
    if not any(t.state == states.WAITING for t in trials):
        taken = [t for t in trials if _taken(t)]
        if spec.method == "grid":
            claimed = {_key(t.params) for t in taken}
            pending = [p for p in spec.grid_points() if _key(p) not in claimed]
            if not pending:
                return None
            study.enqueue_trial({k: _encode(v) for k, v in pending[int(rng.integers(len(pending)))].items()})
        elif cap is not None and len(taken) >= cap:
            return None
    return study.ask()


def _claimed_key(trial: Any) -> str:
    """The grid point a trial holds: its parameters, or before it has drawn them the point it was queued with."""
    return _key(trial.params) if trial.params else _key(trial.system_attrs.get("fixed_params") or {})


def _duplicate(study: Any, trial: Any, spec: SweepSpec) -> bool:
    """Another worker claimed the same grid point first: a lower-numbered trial with that point, running, finished or
    queued (a queued point is visible from the moment it is queued, so of two workers that drew the same point at
    once exactly one runs it, whatever order their steps interleave in)."""
    import optuna

    if spec.method != "grid":
        return False
    mine = _key(trial.params)
    waiting = optuna.trial.TrialState.WAITING
    return any(t.number < trial.number and _claimed_key(t) == mine and (_taken(t) or t.state == waiting)
               for t in study.get_trials(deepcopy=False))


@contextlib.contextmanager
def _heartbeat(study: Any, trial: Any) -> Iterator[None]:
    """While a trial runs, its ``alive_at`` is refreshed every :data:`HEARTBEAT_S` seconds, so workers on other hosts
    can tell a running trial from one whose worker was killed."""
    done = threading.Event()

    def beat() -> None:
        while not done.wait(HEARTBEAT_S):
            try:
                study._storage.set_trial_user_attr(trial._trial_id, "alive_at", time.time())
            except Exception:  # noqa: BLE001 - the trial was recorded meanwhile; the next claim says the rest
                return

    thread = threading.Thread(target=beat, name=f"heartbeat-{trial.number}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=5)


def run_sweep(
    sweep_file: str | os.PathLike | SweepSpec,
    *,
    n_trials: int | None = None,
    storage: str | None = None,
    study_name: str | None = None,
    run_root: str | os.PathLike = "runs",
    seed: int | None = 0,
    wandb: bool = True,
    extra_args: list[str] | None = None,
    check: bool = True,
    workers: int = 1,
) -> tuple[Any, list[TrialResult]]:
    """Run (this worker's share of) a sweep and return the optuna study and this worker's trials.

    Args:
        sweep_file: W&B sweep YAML (or its loaded :class:`SweepSpec`).
        n_trials: at most this many trials in this call. Default: until the budget is met (every grid
            point, else ``run_cap`` finished trials, else 10).
        storage: optuna storage shared by workers: ``sqlite:///file.db`` or a ``*.journal`` path.
            Default: ``<run_root>/sweeps/<study>/study.journal``.
        study_name: optuna study name and W&B group. Default: the sweep file's stem.
        run_root: where trial run directories go. Default: ``runs``.
        seed: sampler seed (workers sharing a study should pass different seeds). Default: 0.
        wandb: log each trial to W&B (offline unless logged in). Default: True.
        extra_args: more ``lowrank fit`` flags for every trial (e.g. a smaller budget).
        check: parse every swept value through the CLI before the first trial. Default: True.
        workers: trials run at once, each a ``lowrank fit`` subprocess started by its own thread of this process
            (``lowrank matrix --jobs``). ``n_trials`` counts the trials of all of them. Default: 1.

    Raises:
        SweepStopped: SIGINT or SIGTERM arrived; the running trial was stopped and recorded as interrupted.
    """
    import numpy as np
    import optuna

    from lowrank_lit.launch.lightning_cli import command_experiment

    spec = sweep_file if isinstance(sweep_file, SweepSpec) else load_sweep(sweep_file)
    if check:
        check_keys(spec)
    study_name = study_name or spec.path.stem
    run_root = Path(run_root)
    if storage is None:
        storage = str(default_storage(run_root, study_name))
    if "://" not in storage:
        Path(storage).parent.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name=study_name, storage=optuna_storage(storage), pruner=make_pruner(spec.early_terminate),
                                direction="minimize" if spec.goal == "minimize" else "maximize", load_if_exists=True)
    # a restart must not draw the points of the first start again: the seed moves on with the study
    base = 0 if seed is None else seed
    study.sampler = make_sampler(spec, base + 1_000_003 * len(study.trials))
    rng = np.random.default_rng(base)
    if spec.method == "grid":
        cap: int | None = len(spec.grid_points())
    else:
        cap = spec.run_cap or (10 if n_trials is None else None)
    results: list[TrialResult] = []
    started = 0
    lock = threading.Lock()  # claiming a trial and recording one are one worker at a time; trials run side by side
    failures: list[BaseException] = []

    def claim() -> tuple[Any, dict[str, Any]] | None:
        nonlocal started
        while stop.name is None and (n_trials is None or started < n_trials):
            _requeue_interrupted(study)  # a worker killed meanwhile (any host): its trial is queued again
            trial = _next_trial(study, spec, cap, rng)
            if trial is None:
                return None
            trial.set_user_attr("worker", _worker_id())
            trial.set_user_attr("alive_at", time.time())
            params = suggest(trial, spec)
            if _duplicate(study, trial, spec):
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            trial.set_user_attr("overrides", overrides_to_args(params))
            started += 1
            return trial, params
        return None

    def record(trial: Any, res: TrialResult) -> None:
        pruned_at = study._storage.get_trial(trial._trial_id).user_attrs.get("pruned_at")
        if pruned_at is not None and res.state == "COMPLETE":
            res = TrialResult(res.number, res.params, "PRUNED", res.value, res.run_dir,
                              f"stopped early by the pruner after validation round {pruned_at}")
        results.append(res)
        print(_trial_line(res, spec.metric), flush=True)
        if res.run_dir:
            trial.set_user_attr("run_dir", res.run_dir)
        if res.state == "COMPLETE":
            study.tell(trial, float(res.value))
        elif res.state == "PRUNED":
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            trial.set_user_attr("error", res.error)
            if res.state == "INTERRUPTED":
                trial.set_user_attr("interrupted", True)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def work() -> None:
        try:
            while True:
                with lock:
                    claimed = claim()
                if claimed is None:
                    return
                trial, params = claimed
                prune = None if spec.early_terminate is None else {
                    "storage": storage, "study": study_name, "trial_id": trial._trial_id, "metric": spec.metric,
                    "early_terminate": spec.early_terminate}
                with _heartbeat(study, trial):
                    res = run_trial(spec, trial.number, params, study_name=study_name, run_root=run_root, wandb=wandb,
                                    extra_args=list(extra_args or []), log_dir=sweep_folder(run_root, study_name) / "logs",
                                    resume_run_id=trial.user_attrs.get("resume_run_id"), stop=stop, prune=prune,
                                    experiment_of=command_experiment)
                with lock:
                    record(trial, res)
        except BaseException as exc:  # noqa: BLE001 - handed to the calling thread
            failures.append(exc)

    with StopRelay() as stop:
        _requeue_interrupted(study)
        if workers == 1:
            work()
        else:
            threads = [threading.Thread(target=work, name=f"sweep-worker-{i}", daemon=True) for i in range(workers)]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():  # short joins: a signal is handled by this (the main) thread meanwhile
                    t.join(0.2)
        if failures:
            raise failures[0]
        if stop.name is not None:
            raise SweepStopped(stop.name, study, results)
    return study, results


def _trial_line(res: TrialResult, metric: str) -> str:
    shown = " ".join(f"{k.split('.')[-1]}={format_value(v)}" for k, v in res.params.items())
    val = f"{metric}={res.value:.5g}" if res.value is not None else res.error
    return f"trial {res.number:3d} {res.state:8s} {shown}  {val}"


def best_config(spec: SweepSpec, study: Any, out_path: Path) -> Path:
    """Write the best trial as a config: the sweep's base config(s) with the best overrides applied."""
    from lowrank_lit.launch.lightning_cli import build_parser

    best = study.best_trial
    params = {k: trial_value(spec, k, v) for k, v in best.params.items()}
    parser = build_parser(spec.fit_args[0])
    cfg = parser.parse_args(spec.fit_args[1:] + overrides_to_args(params))
    cfg.pop("config", None)
    header = (
        f"# Best trial {best.number} of sweep {spec.path} ({spec.metric} = {best.value:.6g}, {spec.goal}).\n"
        f"# lowrank {spec.fit_args[0]} --config {out_path}\n"
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(header + parser.dump(cfg, skip_none=False))
    return out_path


def summary_table(spec: SweepSpec, study: Any) -> str:
    """A markdown table of every trial in the study (all workers), best first."""
    import optuna

    trials = [t for t in study.get_trials(deepcopy=False) if t.state != optuna.trial.TrialState.PRUNED or _early_stopped(t)]
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    done.sort(key=lambda t: t.value, reverse=spec.goal == "maximize")
    rest = [t for t in trials if t.state != optuna.trial.TrialState.COMPLETE]
    keys = list(spec.parameters)
    lines = ["| trial | state | " + " | ".join(keys) + f" | {spec.metric} |", "|" + "---|" * (len(keys) + 3)]
    for t in done + rest:
        vals = [format_value(trial_value(spec, k, t.params.get(k))) for k in keys]
        last = t.value if t.value is not None else (t.intermediate_values[max(t.intermediate_values)]
                                                     if t.intermediate_values else None)
        value = f"{last:.4f}" if last is not None else "-"
        state = "INTERRUPTED" if _interrupted(t) else t.state.name
        if _early_stopped(t):
            state = f"PRUNED (after validation round {t.user_attrs['pruned_at']})"
        if "rerun_of" in t.user_attrs:
            state += f" (rerun of {t.user_attrs['rerun_of']})"
        lines.append(f"| {t.number} | {state} | " + " | ".join(vals) + f" | {value} |")
    return "\n".join(lines)
