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
then compare methods that differ in more than one key (``sweeps/peft_bench.yaml``). The objective is the sweep's ``metric.name`` read
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
"""

from __future__ import annotations

import itertools
import json
import math
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lowrank_lit.launch.checks import config_files, experiment_from_configs, yaml_syntax_error
from lowrank_lit.launch.verbs import PassThrough, Typed
from lowrank_lit.report import read_metric

__all__ = ["SweepSpec", "SweepError", "SweepStopped", "load_sweep", "format_value", "run_sweep", "sweep_folder", "default_storage", "main"]

METHODS = ("grid", "random", "bayes")
GOALS = ("minimize", "maximize")
DISTRIBUTIONS = ("uniform", "log_uniform_values", "int_uniform", "q_uniform", "categorical")
ARGS_MACRO = "${args}"
#: the swept key whose values are config files layered on the command's (``--config=<file>``)
CONFIG_KEY = "config"


class SweepError(ValueError):
    """A sweep file that cannot be run; the message names the file and the offending key."""


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


@dataclass
class SweepSpec:
    """A parsed, validated W&B sweep file.

    Attributes:
        path: the sweep file.
        method: ``grid``, ``random`` or ``bayes``.
        metric: logged key to optimise; ``goal`` is ``minimize`` or ``maximize``.
        parameters: dotted CLI key -> W&B parameter spec.
        fit_args: the ``lowrank`` arguments fixed by the command (``fit --config ...``).
        run_cap: W&B's optional cap on the number of runs.
        early_terminate: W&B's ``early_terminate`` (``{type: hyperband, min_iter|max_iter, eta}``), or None. Offline it
            becomes optuna's ``HyperbandPruner``: each trial reports the metric at every validation and stops when
            the pruner says so (recorded as ``PRUNED``).
    """

    path: Path
    method: str
    metric: str
    goal: str
    parameters: dict[str, dict[str, Any]]
    fit_args: list[str]
    run_cap: int | None = None
    raw: dict[str, Any] = field(default_factory=dict)
    early_terminate: dict[str, Any] | None = None

    def grid_points(self) -> list[dict[str, Any]]:
        """Every combination of the ``values`` lists (grid sweeps)."""
        keys = list(self.parameters)
        values = [_choices(self.parameters[k]) for k in keys]
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]

    def corner_overrides(self) -> list[dict[str, Any]]:
        """Overrides that touch every swept value (values) or both bounds (distributions)."""
        out = []
        for key, p in self.parameters.items():
            if "values" in p or "value" in p:
                out += [{key: v} for v in _choices(p)]
            else:
                lo, hi = p["min"], p["max"]
                if p["distribution"] == "int_uniform":
                    lo, hi = int(lo), int(hi)
                out += [{key: lo}, {key: hi}]
        return out


def _describe(p: dict[str, Any]) -> str:
    """One swept parameter in a few words: ``values [1, 2]`` or ``log_uniform_values 0.0001..0.01``."""
    if "values" in p:
        return f"values {p['values']}"
    if "value" in p:
        return f"value {p['value']!r}"
    return f"{p.get('distribution', 'uniform')} {p.get('min')}..{p.get('max')}"


def _choices(p: dict[str, Any]) -> list[Any]:
    return list(p["values"]) if "values" in p else [p["value"]]


def _fail(path: Path, msg: str) -> SweepError:
    return SweepError(f"{path}: {msg}")


def load_sweep(path: str | os.PathLike) -> SweepSpec:
    """Read and validate a W&B sweep file.

    Raises:
        SweepError: missing or bad ``method``/``metric``/``parameters``/``program``/``command``.
    """
    path = Path(path)
    if not path.is_file():
        raise SweepError(f"sweep file {str(path)!r} does not exist")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SweepError(yaml_syntax_error(path, exc)) from None
    if not isinstance(raw, dict):
        raise _fail(path, "not a sweep file (a W&B sweep file is a mapping with method, metric and parameters)")
    method = raw.get("method")
    if method is None and "parameters" not in raw:
        raise SweepError(f"{path} is not a sweep file (it has no method: and no parameters:); a W&B sweep file names "
                         f"method ({', '.join(METHODS)}), metric.name and parameters, plus the command that runs a "
                         "config: see sweeps/*.yaml, e.g. lowrank sweep sweeps/q3r.yaml")
    if method not in METHODS:
        raise _fail(path, f"method={method!r}; allowed: {', '.join(METHODS)}")
    metric = raw.get("metric") or {}
    if not isinstance(metric, dict) or not metric.get("name"):
        raise _fail(path, "metric.name is required (a key the module logs, e.g. val/loss)")
    goal = metric.get("goal", "minimize")
    if goal not in GOALS:
        raise _fail(path, f"metric.goal={goal!r}; allowed: {', '.join(GOALS)}")
    if not raw.get("program"):
        raise _fail(path, "program is required by W&B (use lowrank_lit/__main__.py)")
    params = raw.get("parameters")
    if not isinstance(params, dict) or not params:
        raise _fail(path, "parameters must map dotted CLI keys to specs")
    for key, p in params.items():
        _check_param(path, key, p, method)
    command = raw.get("command")
    subcommands = [c for c in command or [] if c in ("fit", "validate", "test")] if isinstance(command, list) else []
    if not isinstance(command, list) or ARGS_MACRO not in command or not subcommands:
        raise _fail(path, "command must be [${env}, ${interpreter}, -m, lowrank_lit, fit|test, --config, <config>, ${args}]")
    start = command.index(subcommands[0])
    fit_args = [str(c) for c in command[start:] if c != ARGS_MACRO and not str(c).startswith("${")]
    run_cap = raw.get("run_cap")
    early = _check_early_terminate(path, raw.get("early_terminate"))
    return SweepSpec(path, method, metric["name"], goal, params, fit_args, run_cap, raw, early)


def _check_early_terminate(path: Path, early: Any) -> dict[str, Any] | None:
    """W&B's ``early_terminate`` block, validated: ``type: hyperband`` with ``min_iter`` (or ``max_iter``) and ``eta``."""
    if early is None:
        return None
    if not isinstance(early, dict) or early.get("type") != "hyperband":
        raise _fail(path, f"early_terminate={early!r}; allowed: {{type: hyperband, min_iter: N, eta: 3}} (W&B's only type)")
    unknown = sorted(set(early) - {"type", "min_iter", "max_iter", "eta", "s", "strict"})
    if unknown:
        raise _fail(path, f"early_terminate: unknown key(s) {unknown}; allowed: type, min_iter, max_iter, eta, s, strict")
    for key in ("min_iter", "max_iter", "s"):
        v = early.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise _fail(path, f"early_terminate.{key}={v!r}; allowed: an integer >= 1")
    if early.get("min_iter") is None and early.get("max_iter") is None:
        raise _fail(path, "early_terminate needs min_iter or max_iter (validation rounds)")
    eta = early.get("eta", 3)
    if not isinstance(eta, int | float) or isinstance(eta, bool) or eta < 2:
        raise _fail(path, f"early_terminate.eta={eta!r}; allowed: a number >= 2")
    return dict(early)


def make_pruner(early: dict[str, Any] | None) -> Any:
    """The optuna pruner of a sweep's ``early_terminate`` (None: no pruning). The resource is the number of
    validation rounds a trial has reported; W&B's ``min_iter`` is the first rung, ``max_iter`` the longest run
    (with only ``max_iter``, the first rung is ``max_iter / eta**s``, ``s`` = 3 brackets by default)."""
    import optuna

    if early is None:
        return optuna.pruners.NopPruner()
    eta = early.get("eta", 3)
    min_iter, max_iter = early.get("min_iter"), early.get("max_iter")
    if min_iter is None:
        min_iter = max(1, int(max_iter / eta ** early.get("s", 3)))
    return optuna.pruners.HyperbandPruner(min_resource=min_iter, max_resource=max_iter or "auto",
                                          reduction_factor=eta)


def _check_param(path: Path, key: str, p: Any, method: str) -> None:
    where = f"parameters.{key}"
    if not isinstance(p, dict):
        raise _fail(path, f"{where} must be a mapping with values/value or distribution/min/max")
    if key == CONFIG_KEY:
        files = p.get("values", [p.get("value")] if "value" in p else None)
        if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
            raise _fail(path, f"{where}: values must be a non-empty list of config files")
        missing = [f for f in files if not Path(f).is_file()]
        if missing:
            raise _fail(path, f"{where}: config file {missing[0]!r} does not exist")
        return
    if "values" in p:
        if not isinstance(p["values"], list) or not p["values"]:
            raise _fail(path, f"{where}.values must be a non-empty list")
        return
    if "value" in p:
        return
    if method == "grid":
        raise _fail(path, f"{where}: grid sweeps need `values` for every parameter")
    dist = p.get("distribution", "uniform" if "min" in p else None)
    if dist not in DISTRIBUTIONS or dist == "categorical":
        raise _fail(path, f"{where}.distribution={dist!r}; allowed: {', '.join(DISTRIBUTIONS[:4])} (or use values)")
    p["distribution"] = dist
    for bound in ("min", "max"):
        if not isinstance(p.get(bound), int | float) or isinstance(p.get(bound), bool):
            raise _fail(path, f"{where}.{bound} must be a number (write 1.0e-4, not 1e-4), got {p.get(bound)!r}")
    if p["min"] >= p["max"]:
        raise _fail(path, f"{where}: min={p['min']} must be below max={p['max']}")
    if dist == "log_uniform_values" and p["min"] <= 0:
        raise _fail(path, f"{where}: log_uniform_values needs min > 0, got {p['min']}")
    if dist == "int_uniform" and not (float(p["min"]).is_integer() and float(p["max"]).is_integer()):
        raise _fail(path, f"{where}: int_uniform needs integer min/max")
    if dist == "q_uniform" and not (isinstance(p.get("q", 1.0), int | float) and p.get("q", 1.0) > 0):
        raise _fail(path, f"{where}.q must be a positive number")


def format_value(value: Any) -> str:
    """Format a value as a ``--key=value`` override the way W&B's ``${args}`` does (YAML/JSON scalars)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, list | dict):
        return json.dumps(value)
    return str(value)


def overrides_to_args(overrides: dict[str, Any]) -> list[str]:
    """``{"model.init_args.lr": 0.01}`` -> ``["--model.init_args.lr=0.01"]``; a ``config`` file comes first."""
    ordered = sorted(overrides.items(), key=lambda kv: kv[0] != CONFIG_KEY)
    return [f"--{k}={format_value(v)}" for k, v in ordered]


#: top-level keys of ``lowrank fit`` (tests/test_sweeps.py keeps this equal to the real parser's)
TOP_LEVEL_KEYS = (
    "seed_everything", "trainer", "model", "data", "ckpt_path", "experiment", "run_root", "run_id",
    "test_after_fit", "checkpoint_every_n_steps", "weights_only", "run",
)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Compose config files as ``lowrank`` does: later files win, ``key+:`` appends to a list."""
    out = dict(base)
    for key, value in update.items():
        if key.endswith("+"):
            key = key[:-1]
            old = out.get(key)
            old = [] if old is None else old if isinstance(old, list) else [old]
            out[key] = old + (value if isinstance(value, list) else [value])
        elif isinstance(value, dict):
            out[key] = _merge(out[key] if isinstance(out.get(key), dict) else {}, value)
        else:
            out[key] = value
    return out


def static_check(spec: SweepSpec) -> list[str]:
    """Check the sweep against its config files without importing Lightning, torch or any method.

    Every ``--config`` file of the command must exist; every swept key must start with a ``lowrank fit``
    key and must not be a near-miss of a key the configs set. A key the configs do not set (an argument
    left at its default) cannot be checked this way: it is returned as a note, and the real parser
    checks it when the sweep starts (or with ``lowrank sweep --check --parse``).

    Raises:
        SweepError: a missing config file, an unknown top-level key, a near-miss of a configured key.
    """
    from lowrank_lit.launch.checks import closest

    files = [spec.fit_args[i + 1] for i, a in enumerate(spec.fit_args[:-1]) if a in ("--config", "-c")]
    composed: dict[str, Any] = {}
    for f in files:
        if not Path(f).is_file():
            raise _fail(spec.path, f"command: --config file {f!r} does not exist")
        composed = _merge(composed, yaml.safe_load(Path(f).read_text()) or {})
    notes = []
    for key in spec.parameters:
        if key == CONFIG_KEY:
            continue  # files checked by load_sweep; their keys by check_keys (the real parser)
        parts = key.split(".")
        if parts[0] not in TOP_LEVEL_KEYS:
            match = closest(parts[0], TOP_LEVEL_KEYS)
            hint = f"; did you mean {match}?" if match else f"; allowed: {', '.join(TOP_LEVEL_KEYS)}"
            raise _fail(spec.path, f"parameters.{key}: {parts[0]!r} is not a lowrank fit key{hint}")
        node: Any = composed
        for depth, part in enumerate(parts):
            if isinstance(node, list):
                node = node[-1] if node else None  # jsonargparse: a list's key means its last entry
            if isinstance(node, dict) and part in node:
                node = node[part]
                continue
            known = [k for k in node if isinstance(k, str)] if isinstance(node, dict) else []
            match = closest(part, known, cutoff=0.8)
            where = ".".join(parts[:depth]) or "(top level)"
            if match:
                raise _fail(spec.path, f"parameters.{key}: {part!r} is not set under {where}; did you mean {match!r}?")
            notes.append(f"{key}: not set in {', '.join(files)} (a default); the parser checks it when the sweep starts")
            break
    return notes


def check_keys(spec: SweepSpec) -> None:
    """Parse the command with every swept value (or both bounds) through the real CLI parser.

    Raises:
        SweepError: naming the key and the parser's one-line error.
    """
    from jsonargparse import ArgumentError

    from lowrank_lit.launch.checks import one_line_error
    from lowrank_lit.launch.lightning_cli import build_parser

    parser = build_parser(spec.fit_args[0])
    for override in spec.corner_overrides():
        argv = spec.fit_args[1:] + overrides_to_args(override)
        try:
            parser.parse_args(argv)
        except ArgumentError as exc:
            key = next(iter(override))
            raise _fail(spec.path, f"parameters.{key}: {one_line_error(exc, parser)}") from None


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
    return _decode(stored, _choices(p)) if ("values" in p or "value" in p) else stored


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
            choices = _choices(p)
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


@dataclass
class TrialResult:
    number: int
    params: dict[str, Any]
    state: str
    value: float | None
    run_dir: str | None
    error: str | None = None


class _Stop:
    """SIGINT/SIGTERM handlers of the sweep process: note the signal, pass it on to the running trial."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.child: subprocess.Popen | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Stop:
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
        if self.name is None:
            where = " (stopping the running trial at its next batch boundary)" if self.child is not None else ""
            print(f"\n{name}: stopping the sweep{where}", file=sys.stderr, flush=True)
        self.name = self.name or name
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signum)  # a second Ctrl+C reaches the trial too: it aborts at once


def flag_clashes(spec: SweepSpec, extra_args: Sequence[str]) -> list[tuple[str, str]]:
    """The flags given to ``lowrank sweep`` that set a swept key (or a key above or below one): ``(flag, swept key)``.

    Each trial passes the swept values after the command line's flags, so such a flag would be silently overridden;
    the sweep refuses instead (:func:`main`)."""
    clashes = []
    for tok in extra_args:
        if not tok.startswith("--") or tok.startswith("--config"):
            continue
        flag = tok[2:].split("=", 1)[0]
        for key in spec.parameters:
            if key == CONFIG_KEY:
                continue
            if flag == key or flag.startswith(key + ".") or key.startswith(flag + "."):
                clashes.append((flag, key))
    return clashes


def run_trial(spec: SweepSpec, number: int, params: dict[str, Any], *, study_name: str, run_root: Path,
              wandb: bool, extra_args: list[str], log_dir: Path, resume_run_id: str | None = None,
              stop: _Stop | None = None, prune: dict[str, Any] | None = None) -> TrialResult:
    """Run one ``lowrank fit`` subprocess and read its objective.

    ``resume_run_id`` continues that run directory from its ``last.ckpt`` (an interrupted trial run again).
    With ``stop``, a signal to the sweep is passed on to the trial; the result is then ``INTERRUPTED``.
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
    experiment = trial_experiment(args)
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
            stop.child = proc
            if stop.name is not None:  # the signal came while the trial was starting
                proc.send_signal(getattr(signal, stop.name))
        try:
            proc.wait()
        finally:
            if stop is not None:
                stop.child = None
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


def trial_experiment(args: Sequence[str]) -> str:
    """The experiment a ``lowrank fit`` command line writes to, as the CLI decides it: the last ``--experiment`` flag,
    else the last ``experiment:`` key of its config files, else the name :func:`experiment_from_configs` derives from
    them. The sweep passes it to every trial, so each trial's run directory is known before it starts."""
    flags = [a.split("=", 1)[1] if "=" in a else args[i + 1] for i, a in enumerate(args)
             if a.split("=", 1)[0] == "--experiment" and ("=" in a or i + 1 < len(args))]
    if flags:
        return flags[-1]
    files = config_files(args)
    keys = []
    for f in files:
        try:
            data = yaml.safe_load(Path(f).read_text())
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(data, dict) and data.get("experiment"):
            keys.append(str(data["experiment"]))
    return keys[-1] if keys else experiment_from_configs(files)


def _preset(name: str) -> Path:
    from lowrank_lit.registry import project_root

    return project_root() / "callbacks" / name


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


def _orphaned(trial: Any) -> bool:
    """A RUNNING trial whose worker ran on this host and has exited (killed without a chance to record it)."""
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


def _duplicate(study: Any, trial: Any, spec: SweepSpec) -> bool:
    """Another worker claimed the same grid point first (a lower-numbered trial, running or finished)."""
    if spec.method != "grid":
        return False
    mine = _key(trial.params)
    return any(t.number < trial.number and _key(t.params) == mine and _taken(t) for t in study.get_trials(deepcopy=False))


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

    Raises:
        SweepStopped: SIGINT or SIGTERM arrived; the running trial was stopped and recorded as interrupted.
    """
    import numpy as np
    import optuna

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
    with _Stop() as stop:
        _requeue_interrupted(study)
        while stop.name is None and (n_trials is None or len(results) < n_trials):
            trial = _next_trial(study, spec, cap, rng)
            if trial is None:
                break
            trial.set_user_attr("worker", _worker_id())
            params = suggest(trial, spec)
            if _duplicate(study, trial, spec):
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            trial.set_user_attr("overrides", overrides_to_args(params))
            prune = None if spec.early_terminate is None else {
                "storage": storage, "study": study_name, "trial_id": trial._trial_id, "metric": spec.metric,
                "early_terminate": spec.early_terminate}
            res = run_trial(spec, trial.number, params, study_name=study_name, run_root=run_root, wandb=wandb,
                            extra_args=list(extra_args or []), log_dir=sweep_folder(run_root, study_name) / "logs",
                            resume_run_id=trial.user_attrs.get("resume_run_id"), stop=stop, prune=prune)
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
                continue
            if res.state == "PRUNED":
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                continue
            trial.set_user_attr("error", res.error)
            if res.state == "INTERRUPTED":
                trial.set_user_attr("interrupted", True)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
        if stop.name is not None:
            raise SweepStopped(stop.name, study, results)
    return study, results


def optuna_storage(storage: str | None) -> Any:
    if storage is None:
        return None
    if "://" in storage:
        return storage
    import optuna
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(storage))


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
        f"# Run: lowrank {spec.fit_args[0]} --config {out_path}\n"
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


def main(sweep_file: str, *, n_trials: int | None = None, storage: str | None = None, study_name: str | None = None,
         run_root: str = "runs", seed: int | None = None, best_config: str | None = None, no_wandb: bool = False,
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
                f"--{flag} sets {key!r}, which {spec.path} sweeps ({_describe(spec.parameters[key])}); the swept "
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
