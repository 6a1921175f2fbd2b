"""A run's results: where a run writes, writing tables and plots (run directory, and W&B when configured), and reading runs back.

Writing: :func:`run_directory` is where the run writes (the CLI makes it ``<run_root>/<experiment>/<run_id>``),
:func:`may_write` says whether this process writes the run's files now, :func:`artifact_path` is the path of a named
file in it. Every method, callback and summary goes through these three; nothing else reads
``trainer.default_root_dir``.

Method summaries: each method names, in its registration (``register_method(..., summary="summary")``),
the function that turns its runs into a markdown table (and optionally a figure);
``lowrank summarize <slug> <run-root>... [--out FILE]`` finds it through the registry and runs it. The pieces they share live here: :func:`markdown_table`,
:func:`class_label` (a run label from a config entry), :func:`new_figure` / :func:`save_figure`.
"""

from __future__ import annotations

import csv
import glob
import os
import statistics
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cached_property
from pathlib import Path
from typing import Any

__all__ = [
    "run_directory", "may_write", "artifact_path", "save_rows", "log_image", "last_values", "read_metric", "read_config", "find_runs", "Run", "read_runs",
    "debug_reason", "including_debug_runs", "markdown_table", "mean_std", "class_label", "new_figure", "save_figure",
    "RunFilter", "only_runs_of", "config_classes", "group_runs", "NoMethodRuns", "keep_previous", "UNFINISHED_FILE",
    "unfinished_runs",
]

#: the file a ``lowrank`` run keeps in its directory from the moment it starts training (or evaluating) until it ends
#: well: a run killed, crashed or interrupted (or still running) holds it, and summaries leave it out and count it
UNFINISHED_FILE = "unfinished.json"


def run_directory(trainer: Any | None) -> str | None:
    """The directory this run writes into, or None when there is no trainer.

    Under ``lowrank`` it is ``<run_root>/<experiment>/<run_id>`` (the CLI points ``trainer.default_root_dir``,
    the CSV logger and any W&B logger at it, on every rank); with a plain Lightning ``Trainer`` it is the
    trainer's ``default_root_dir`` (the working directory unless given).
    """
    return None if trainer is None else str(trainer.default_root_dir)


def may_write(trainer: Any | None) -> bool:
    """Whether this process writes the run's result files (tables, figures, exports) now.

    True on global rank zero of a run that keeps results: a trainer is attached, it is not the sanity
    check, it is not a ``fast_dev_run`` (which, as Lightning does for its loggers and checkpoints, leaves
    no results behind) and it has a logger (a ``Trainer(logger=False)`` writes nothing into its
    directory). ``limit_*`` and ``overfit_batches`` runs do write; reading them back marks them
    :attr:`Run.debug`. Files that every rank needs (checkpoints, per-rank caches) do not ask this.
    """
    if trainer is None or not trainer.is_global_zero or trainer.sanity_checking or trainer.fast_dev_run:
        return False
    return bool(trainer.loggers)


def keep_previous(folder: str | os.PathLike, name: str) -> Path | None:
    """Move an earlier attempt's ``<folder>/<name>`` (``metrics.csv``, ``config.yaml``) aside to ``<stem>.<n><suffix>``
    with the first free ``n`` (``metrics.1.csv``, ``config.2.yaml``), so a re-entered run directory keeps every
    attempt's file. Returns the new path, None when there was no such file. Called by the one process that writes."""
    path = Path(folder) / name
    if not path.is_file():
        return None
    stem, suffix = Path(name).stem, Path(name).suffix
    n = 1
    while (path.parent / f"{stem}.{n}{suffix}").exists():
        n += 1
    target = path.parent / f"{stem}.{n}{suffix}"
    path.rename(target)
    return target


def artifact_path(trainer: Any, name: str) -> str:
    """The path of the file or folder ``name`` in the run directory (the directory is created if missing).

    Raises:
        ValueError: ``name`` is absolute or leaves the run directory.
    """
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise ValueError(f"name={name!r}; allowed: a path relative to the run directory, without '..'")
    root = run_directory(trainer)
    if root is None:
        raise ValueError("artifact_path: no trainer attached, so there is no run directory")
    path = os.path.join(root, name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


def save_rows(trainer: Any, rows: Sequence[dict[str, Any]], filename: str) -> str:
    """Write ``rows`` (dicts with the same keys) as CSV ``<run directory>/<filename>``; returns the path.

    The caller decides whether to write (:func:`may_write`).
    """
    path = artifact_path(trainer, filename)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def log_image(trainer: Any, key: str, path: str) -> None:
    """Log the image file ``path`` under ``key`` to every W&B logger of ``trainer`` (others keep the file)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.log_image(key, [path])


def last_values(metrics_csv: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, float]:
    """The last logged value of every metric (or of those in ``names`` that were logged) in a CSVLogger ``metrics.csv``."""
    wanted = None if names is None else set(names)
    out: dict[str, float] = {}
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            out.update({k: float(v) for k, v in row.items() if v not in ("", None) and (wanted is None or k in wanted)})
    return out


def read_metric(metrics_csv: Path, name: str) -> float:
    """Last logged value of ``name`` in a CSVLogger ``metrics.csv``."""
    if not metrics_csv.is_file():
        raise RuntimeError(f"{metrics_csv} was not written")
    values = last_values(metrics_csv)
    if name not in values:
        keys = sorted(set(values) - {"epoch", "step"})
        raise RuntimeError(f"metric {name!r} was never logged; logged keys: {', '.join(keys) or '(none)'}")
    return values[name]


def read_config(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The resolved config a run saved (``<run_dir>/config.yaml``)."""
    import yaml

    with open(os.path.join(run_dir, "config.yaml")) as f:
        return yaml.safe_load(f)


def find_runs(roots: Iterable[str], marker: str, required: bool = False) -> list[str]:
    """Run directories (sorted) at any depth below ``roots`` that hold a file named ``marker``.

    Raises:
        FileNotFoundError: ``required`` and there is none (the message names the roots and the marker).
    """
    roots = list(roots)
    found = sorted(os.path.dirname(p) for r in roots for p in glob.glob(os.path.join(r, "**", marker), recursive=True))
    if required and not found:
        raise FileNotFoundError(f"no run directory holding {marker} under {', '.join(roots)}")
    return found




#: trainer keys whose non-default value marks a debug run (a smoke or a partial run, not a result). A limit on
#: validation or test batches alone is not one: real configs set it as their evaluation budget.
DEBUG_TRAINER_KEYS = {"fast_dev_run": (False, 0, None), "overfit_batches": (0, 0.0, None),
                      "limit_train_batches": (1.0, None)}


class Run:
    """One run directory read back: its path, the config it saved, its final metrics and its artifacts.

    Everything is read on first use, so a summary that skips a run for one reason never trips over another.

    Attributes:
        path: the run directory.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._given = os.fspath(path)  # as found (``str(run)``: the same text as the path the search returned)

    def __repr__(self) -> str:
        return f"Run({self._given!r})"

    def __str__(self) -> str:
        return self._given

    def __fspath__(self) -> str:
        return self._given

    @cached_property
    def config(self) -> dict[str, Any]:
        """The resolved config the run saved (``config.yaml``)."""
        return read_config(self.path)

    @cached_property
    def metrics(self) -> dict[str, float]:
        """The last logged value of every metric in ``metrics.csv`` (empty when there is none)."""
        path = self.path / "metrics.csv"
        return last_values(path) if path.is_file() else {}

    def rows(self, filename: str = "metrics.csv") -> list[dict[str, str]]:
        """The rows of a CSV file of the run (``metrics.csv`` or a method's table)."""
        with open(self.path / filename) as f:
            return list(csv.DictReader(f))

    def history(self, key: str, filename: str = "metrics.csv") -> list[float]:
        """Every logged value of ``key``, in order."""
        return [float(r[key]) for r in self.rows(filename) if r.get(key) not in ("", None)]

    @property
    def unfinished(self) -> str | None:
        """Why the run did not end well (``"crashed: RuntimeError ..."``, ``"interrupted by SIGTERM"``, ``"killed or
        still running"``), None for a run that ended well (or that no ``lowrank`` command ran)."""
        path = self.path / UNFINISHED_FILE
        if not path.is_file():
            return None
        import json

        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            info = {}
        return str(info.get("ended") or "killed or still running") if isinstance(info, dict) else "killed or still running"

    @property
    def debug(self) -> bool:
        """True for a debug run: ``fast_dev_run``, ``overfit_batches`` or ``limit_train_batches`` below a full pass."""
        return self.debug_reason is not None

    @property
    def debug_reason(self) -> str | None:
        """What makes it a debug run (``"limit_train_batches=2"``), or None for a real run."""
        trainer = (self.config.get("trainer") or {}) if (self.path / "config.yaml").is_file() else {}
        return debug_reason(trainer)


def debug_reason(trainer: dict[str, Any]) -> str | None:
    """The trainer settings (of a saved config's ``trainer:`` section) that make a run a debug run, e.g.
    ``"fast_dev_run=True"`` or ``"limit_train_batches=2, overfit_batches=1"``; None for a real run."""
    def is_default(value: Any, defaults: tuple[Any, ...]) -> bool:  # by type too: limit_train_batches=1 is one batch
        return any(value is d or (type(value) is type(d) and value == d) for d in defaults)

    set_ = [f"{k}={trainer[k]}" for k, defaults in DEBUG_TRAINER_KEYS.items() if not is_default(trainer.get(k, defaults[0]), defaults)]
    return ", ".join(set_) or None


_INCLUDE_DEBUG: ContextVar[bool] = ContextVar("include_debug", default=False)


@contextmanager
def including_debug_runs(include: bool = True) -> Iterator[None]:
    """Within this block :func:`read_runs` also returns debug runs (``lowrank summarize --include-debug``)."""
    token = _INCLUDE_DEBUG.set(include)
    try:
        yield
    finally:
        _INCLUDE_DEBUG.reset(token)


def read_runs(roots: Iterable[str], marker: str = "metrics.csv", required: bool = True) -> list[Run]:
    """The runs (sorted by path) at any depth below ``roots`` whose directory holds ``marker``.

    Debug runs (:attr:`Run.debug`: ``fast_dev_run``, ``overfit_batches``, ``limit_train_batches``) are left out, so a
    smoke never enters a result table, unless inside :func:`including_debug_runs`. Inside :func:`only_runs_of` (what
    ``lowrank summarize <slug>`` does) only the runs of that method are returned, and of several evaluations of one
    checkpoint with one config only the latest; what was left out is counted in the filter.

    Raises:
        FileNotFoundError: ``required`` and there is none (the message names the roots and the marker, and how many
            debug runs were left out).
    """
    roots = list(roots)
    method = _METHOD_FILTER.get()
    runs = [Run(d) for d in find_runs(roots, marker, required=required and method is None)]
    if method is not None:
        runs = method.keep(runs)
        if required and not runs:
            raise NoMethodRuns(method.slug, roots)
    finished = [r for r in runs if r.unfinished is None]  # never a result: counted by unfinished_runs()
    if required and runs and not finished:
        raise FileNotFoundError(f"no run directory holding {marker} under {', '.join(roots)} except {len(runs)} "
                                f"unfinished run(s) ({runs[0]}: {runs[0].unfinished}), which summaries leave out")
    runs = finished
    if _INCLUDE_DEBUG.get():
        return runs
    kept = [r for r in runs if not r.debug]
    if required and not kept:
        raise FileNotFoundError(
            f"no run directory holding {marker} under {', '.join(roots)} except {len(runs)} debug run(s) "
            f"({runs[0].debug_reason}, ...), which summaries leave out; --include-debug keeps them"
        )
    return kept


def unfinished_runs(roots: Iterable[str]) -> list[Run]:
    """The run directories below ``roots`` that hold :data:`UNFINISHED_FILE` (killed, crashed, interrupted or still
    running), sorted by path: :func:`read_runs` leaves them out, ``lowrank summarize`` counts them."""
    return [Run(d) for d in find_runs(roots, UNFINISHED_FILE)]


# --------------------------------------------------------------------------------------- whose runs
#: class paths every run may carry whatever its method: the callbacks the CLI and the presets add
_INFRASTRUCTURE = ("lowrank_lit.callbacks.",)
#: config keys that differ between the runs of one experiment without making them different experiments
_REPLICATE_KEYS = ("run_id", "run_root", "ckpt_path", "default_root_dir", "save_dir", "dirpath", "config")


def config_classes(config: Any) -> set[str]:
    """The ``lowrank_lit`` classes a config builds: every ``class_path`` value under ``lowrank_lit.`` at any depth of a
    (saved or written) config, except the callbacks every run may carry (``lowrank_lit.callbacks.*``)."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                if k == "class_path" and isinstance(v, str):
                    if v.startswith("lowrank_lit.") and not v.startswith(_INFRASTRUCTURE):
                        found.add(v)
                else:
                    walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(config)
    return found


class NoMethodRuns(FileNotFoundError):
    """No run of the method under the roots (``lowrank summarize`` exits 1 with one line)."""

    def __init__(self, slug: str, roots: Sequence[str]) -> None:
        super().__init__(f"no {slug} runs under {', '.join(map(str, roots))}")


class RunFilter:
    """Which runs belong to a method: the runs whose saved config builds a class of the method's module, or builds
    every ``lowrank_lit`` class of one of the method's configs (``configs/<slug>/*.yaml``: its baselines), and no
    class of another method's module that none of its configs builds.

    Attributes:
        slug: the method (or benchmark) whose runs are kept.
        skipped: reason -> how many runs were left out for it (``lowrank summarize`` prints them on stderr).
    """

    def __init__(self, slug: str, module: str | None, config_dir: Path) -> None:
        import yaml

        self.slug = slug
        self.module = module
        self.skipped: dict[str, int] = {}
        self.signatures: list[set[str]] = []
        for path in sorted(config_dir.glob("*.yaml")):
            try:
                classes = config_classes(yaml.safe_load(path.read_text()))
            except (OSError, yaml.YAMLError):
                continue
            if classes:
                self.signatures.append(classes)
        self.known = set().union(*self.signatures) if self.signatures else set()

    def _skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def belongs(self, run: Run) -> str | None:
        """None when ``run`` is one of the method's runs, else why not (one phrase). A summary with neither a module
        nor configs to judge by (a study over any runs) keeps every run."""
        if not self.module and not self.signatures:
            return None
        if not (run.path / "config.yaml").is_file():
            return "no config.yaml"
        try:
            classes = config_classes(run.config)
        except Exception:  # noqa: BLE001 - an unreadable config is a reason, not a crash
            return "an unreadable config.yaml"
        foreign = sorted(c for c in classes - self.known if c.startswith("lowrank_lit.methods.")
                         and not (self.module and c.startswith(self.module + ".")))
        if foreign:
            return f"runs of another method ({foreign[0].rsplit('.', 2)[-2]})"
        if self.module and any(c.startswith(self.module + ".") for c in classes):
            return None
        if any(sig <= classes for sig in self.signatures):
            return None
        return f"builds none of {self.slug}'s configs' classes"

    def keep(self, runs: list[Run]) -> list[Run]:
        """The runs of the method; of several evaluations of one checkpoint with the same config, the latest."""
        mine = []
        for run in runs:
            why = self.belongs(run)
            if why is None:
                mine.append(run)
            else:
                self._skip(why)
        latest: dict[str, Run] = {}
        for run in mine:
            ckpt = _saved_config(run).get("ckpt_path")
            if not ckpt:
                latest[str(run.path)] = run
                continue
            key = _evaluation_key(run)
            old = latest.get(key)
            if old is not None:
                self._skip(f"an earlier evaluation of {ckpt} with the same config (the latest is kept)")
            if old is None or _written_at(run) >= _written_at(old):
                latest[key] = run
        kept = set(map(id, latest.values()))
        return [r for r in mine if id(r) in kept]


def _saved_config(run: Run) -> dict[str, Any]:
    """The run's saved config, or an empty one when it saved none (such a run is labelled by its folder)."""
    return run.config if (run.path / "config.yaml").is_file() else {}


def _flat(value: Any, key: str = "") -> dict[str, Any]:
    """A nested config as ``{"a.b.c": leaf}`` (lists as ``a.0``)."""
    if isinstance(value, dict):
        return {k: v for name, sub in value.items() for k, v in _flat(sub, f"{key}.{name}" if key else str(name)).items()}
    if isinstance(value, list):
        return {k: v for i, sub in enumerate(value) for k, v in _flat(sub, f"{key}.{i}").items()}
    return {key: value}


def _is_replicate_key(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return "seed" in last or any(part in _REPLICATE_KEYS for part in key.split("."))


def _evaluation_key(run: Run) -> str:
    """A run's config with what differs between two evaluations of one checkpoint (the run's own id and paths)
    left out."""
    flat = {k: v for k, v in _flat(run.config).items() if not (_is_replicate_key(k) and "seed" not in k)}
    return f"{run.config.get('ckpt_path')}|{sorted(flat.items(), key=str)!r}"


def _written_at(run: Run) -> float:
    path = run.path / "metrics.csv"
    return (path if path.is_file() else run.path / "config.yaml").stat().st_mtime


def group_runs(runs: Sequence[Run], strip: str = "") -> dict[str, list[Run]]:
    """The runs by experiment and, within an experiment, by the values that differ between its runs (a sweep's
    values), never across: label -> runs, in first-seen order. Seeds and the runs' own ids and paths are replicates,
    not groups. ``strip`` is a prefix left off the labels (``"q3r/"``)."""
    by_exp: dict[str, list[Run]] = {}
    for run in runs:
        exp = str(_saved_config(run).get("experiment") or run.path.parent.name)
        by_exp.setdefault(exp.removeprefix(strip) if strip else exp, []).append(run)
    groups: dict[str, list[Run]] = {}
    for exp, members in by_exp.items():
        flats = [{k: v for k, v in _flat(_saved_config(r)).items() if not _is_replicate_key(k)} for r in members]
        keys = sorted({k for f in flats for k in f})
        varying = [k for k in keys if len({repr(f.get(k)) for f in flats}) > 1]
        for run, flat in zip(members, flats, strict=True):
            label = exp + "".join(f" {k.rsplit('.', 1)[-1]}={flat.get(k)}" for k in varying)
            groups.setdefault(label, []).append(run)
    return groups


_METHOD_FILTER: ContextVar[RunFilter | None] = ContextVar("method_filter", default=None)


@contextmanager
def only_runs_of(run_filter: RunFilter) -> Iterator[RunFilter]:
    """Within this block :func:`read_runs` returns only the runs ``run_filter`` keeps (``lowrank summarize <slug>``)."""
    token = _METHOD_FILTER.set(run_filter)
    try:
        yield run_filter
    finally:
        _METHOD_FILTER.reset(token)


# --------------------------------------------------------------------------------------- shared pieces
def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """``| a | b |`` lines: the header, the ``|---|`` delimiter and one line per row (cells as ``str``)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def mean_std(xs: Sequence[float], spec: str = ".1f", scale: float = 1.0) -> str:
    """``"mean ± std"`` of ``xs`` times ``scale``, each formatted with ``spec``; the mean alone for one value, ``-``
    for none (the cells of every summary table)."""
    if not xs:
        return "-"
    mean = format(scale * statistics.fmean(xs), spec)
    return f"{mean} ± {format(scale * statistics.stdev(xs), spec)}" if len(xs) > 1 else mean


def class_label(entry: dict[str, Any]) -> str:
    """The class name of a config entry ``{class_path: a.b.C, init_args: ...}`` -> ``"C"``."""
    return str(entry["class_path"]).rsplit(".", 1)[-1]


def new_figure(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """``plt.subplots(*args, **kwargs)`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig: Any, path: str | os.PathLike, dpi: int = 120) -> str:
    """Lay out, save and close ``fig``; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return str(path)

