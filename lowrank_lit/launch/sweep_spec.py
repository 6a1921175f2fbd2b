"""A sweep file (W&B's format) read and checked: :class:`SweepSpec`, :func:`load_sweep`, the static and key checks,
and the command-line flags of a trial."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowrank_lit.launch.config_yaml import (
    YamlFileError,
    appends_applied,
    fit_keys,
    load_yaml,
    merge_config_layers,
)

__all__ = ["METHODS", "GOALS", "DISTRIBUTIONS", "ARGS_MACRO", "CONFIG_KEY", "SweepError", "SweepSpec", "load_sweep",
           "make_pruner", "format_value", "overrides_to_args", "static_check", "check_keys", "flag_clashes",
           "describe_param", "param_choices", "optuna_storage"]

METHODS = ("grid", "random", "bayes")


GOALS = ("minimize", "maximize")


DISTRIBUTIONS = ("uniform", "log_uniform_values", "int_uniform", "q_uniform", "categorical")


ARGS_MACRO = "${args}"


#: the swept key whose values are config files layered on the command's (``--config=<file>``)
CONFIG_KEY = "config"


class SweepError(ValueError):
    """A sweep file that cannot be run; the message names the file and the offending key."""


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
        values = [param_choices(self.parameters[k]) for k in keys]
        return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]

    def corner_overrides(self) -> list[dict[str, Any]]:
        """Overrides that touch every swept value (values) or both bounds (distributions)."""
        out = []
        for key, p in self.parameters.items():
            if "values" in p or "value" in p:
                out += [{key: v} for v in param_choices(p)]
            else:
                lo, hi = p["min"], p["max"]
                if p["distribution"] == "int_uniform":
                    lo, hi = int(lo), int(hi)
                out += [{key: lo}, {key: hi}]
        return out


def describe_param(p: dict[str, Any]) -> str:
    """One swept parameter in a few words: ``values [1, 2]`` or ``log_uniform_values 0.0001..0.01``."""
    if "values" in p:
        return f"values {p['values']}"
    if "value" in p:
        return f"value {p['value']!r}"
    return f"{p.get('distribution', 'uniform')} {p.get('min')}..{p.get('max')}"


def param_choices(p: dict[str, Any]) -> list[Any]:
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
        raw = load_yaml(path, "sweep file", mapping=False) or {}
    except YamlFileError as exc:
        raise SweepError(str(exc)) from None
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


def static_check(spec: SweepSpec) -> list[str]:
    """Check the sweep against its config files without importing Lightning, torch or any method.

    Every ``--config`` file of the command must exist; every swept key must start with a ``lowrank fit``
    key and must not be a near-miss of a key the configs set. A key the configs do not set (an argument
    left at its default) cannot be checked this way: it is returned as a note, and the real parser
    checks it when the sweep starts (or with ``lowrank sweep --check --parse``).

    Raises:
        SweepError: a missing config file, an unknown top-level key, a near-miss of a configured key.
    """
    from lowrank_lit.launch.messages import closest

    files = [spec.fit_args[i + 1] for i, a in enumerate(spec.fit_args[:-1]) if a in ("--config", "-c")]
    composed: dict[str, Any] = {}
    for f in files:
        if not Path(f).is_file():
            raise _fail(spec.path, f"command: --config file {f!r} does not exist")
        try:
            composed = merge_config_layers([composed, load_yaml(f, "--config")])
        except YamlFileError as exc:
            raise _fail(spec.path, f"command: {exc}") from None
    notes = []
    for key in spec.parameters:
        if key == CONFIG_KEY:
            continue  # files checked by load_sweep; their keys by check_keys (the real parser)
        parts = key.split(".")
        if parts[0] not in fit_keys():
            match = closest(parts[0], fit_keys())
            hint = f"; did you mean {match}?" if match else f"; allowed: {', '.join(fit_keys())}"
            raise _fail(spec.path, f"parameters.{key}: {parts[0]!r} is not a lowrank fit key{hint}")
        node: Any = appends_applied(composed)
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

    from lowrank_lit.launch.lightning_cli import build_parser
    from lowrank_lit.launch.messages import one_line_error

    parser = build_parser(spec.fit_args[0])
    for override in spec.corner_overrides():
        argv = spec.fit_args[1:] + overrides_to_args(override)
        try:
            parser.parse_args(argv)
        except ArgumentError as exc:
            key = next(iter(override))
            raise _fail(spec.path, f"parameters.{key}: {one_line_error(exc, parser)}") from None


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


def optuna_storage(storage: str | None) -> Any:
    """An optuna storage: a journal file (the default; safe on NFS), or a database URL (``sqlite:///x.db``,
    ``postgresql://user@host:port/db`` with the ``postgres`` extra) for many workers on many hosts."""
    if storage is None:
        return None
    if storage.startswith(("postgresql://", "postgresql+psycopg2://", "postgres://")):
        try:
            import psycopg2  # noqa: F401
        except ImportError:
            raise ValueError(f"--storage={storage!r} needs the PostgreSQL driver: pip install 'lowrank-lit[postgres]' "
                             "(psycopg2-binary)") from None
        import optuna

        scheme, rest = storage.split("://", 1)
        return optuna.storages.RDBStorage(f"postgresql+psycopg2://{rest}", engine_kwargs={"pool_pre_ping": True})
    if "://" in storage:
        return storage
    import optuna
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(storage))
