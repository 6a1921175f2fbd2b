"""``lowrank matrix --config BASE.yaml --grid GRID.yaml``: run the cross product of composable components, one table.

A grid file names axes; each axis maps names to config fragments (a file, or an inline mapping with nested or
dotted keys) that are layered onto the base config in axis order::

    # grids/opt_reg_ptq.yaml
    metrics: [test/acc]              # table columns; the first is the sweep's objective
    goal: maximize
    seeds: [0, 1]                    # seed_everything of every cell
    axes:
      optimizer:
        adamw: {}
        nanoadam: configs/compose/fragments/nanoadam.yaml
      ptq:
        fp: {}
        glvq2: {trainer.callbacks+: [{class_path: lowrank_lit.methods.glvq.GLVQ, init_args: {bits: 2, ...}}]}

``lowrank matrix`` is a thin layer over the sweep machinery (:mod:`lowrank_lit.launch.sweep`):

1. every cell's fragments are merged into one file ``<root>/cells/<cell>.yaml`` (``callbacks+`` lists are
   concatenated; the cell's ``experiment`` is ``<matrix>/<cell>``, so each cell has its own run folder);
2. every cell is built (model, data, callbacks: ``lowrank fit``'s parser and constructors, no training); a cell
   that fails is named in one line with the two components responsible (each fragment alone on the base, then
   each pair) and marked ``incompatible`` in the table; it never runs;
3. per seed, the cells without a finished run of that seed are a W&B grid sweep file
   (``<root>/matrix.seed<S>.sweep.yaml``: ``config`` x ``seed_everything``) run in this process by the sweep API
   (:func:`~lowrank_lit.launch.sweep.run_sweep`; only the trials are subprocesses): ``--jobs N`` runs N trials at
   once on one study, a SLURM array runs the same file (``lowrank submit``), and running the command again (or with
   other ``--seeds``) runs only what is not finished on disk;
4. the table (``<root>/matrix.csv`` and ``matrix.md``: per cell the mean and spread over seeds of each metric,
   the run folders and the command that reproduces each run) and a heatmap per metric (``matrix_<metric>.png``).
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import os
import shlex
import signal
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from jsonargparse.typing import NonNegativeInt

from lowrank_lit.argtypes import PassThrough, Seed, Typed
from lowrank_lit.launch.config_yaml import YamlFileError, load_yaml, merge_config_layers

__all__ = ["Grid", "GridError", "load_grid", "prepare", "check_cells", "collect", "main"]

GOALS = ("minimize", "maximize")


class GridError(ValueError):
    """A grid file or a cell that cannot run; the message is one line."""


@dataclass
class Grid:
    """A parsed grid file.

    Attributes:
        path: the file. axes: axis -> component name -> fragment (nested mapping). seeds: seed_everything values.
        metrics: logged keys reported (the first is the objective). goal: minimize or maximize.
    """

    path: Path
    axes: dict[str, dict[str, dict[str, Any]]]
    seeds: list[int]
    metrics: list[str]
    goal: str = "maximize"
    verb: str = "fit"
    config: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    def cells(self) -> list[tuple[tuple[str, str], ...]]:
        """Every combination: a tuple of ``(axis, component)`` in axis order."""
        names = [[(axis, name) for name in comps] for axis, comps in self.axes.items()]
        return [tuple(combo) for combo in itertools.product(*names)]


def cell_name(cell: Sequence[tuple[str, str]]) -> str:
    """``optimizer.adamw__ptq.fp``: a cell's name (also its folder and the last part of its experiment)."""
    return "__".join(f"{axis}.{name}" for axis, name in cell)


def _nest(fragment: dict[str, Any]) -> dict[str, Any]:
    """Dotted keys (``model.init_args.lr``) as nested mappings."""
    out: dict[str, Any] = {}
    for key, value in fragment.items():
        value = _nest(value) if isinstance(value, dict) else value
        parts = str(key).split(".") if not str(key).endswith("+") or "." in str(key) else [str(key)]
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        last = parts[-1]
        if isinstance(node.get(last), dict) and isinstance(value, dict):
            node[last] = merge_config_layers([node[last], value])
        else:
            node[last] = value
    return out


def _fragment(grid_path: Path, axis: str, name: str, spec: Any) -> dict[str, Any]:
    from lowrank_lit.registry import project_root

    if spec is None:
        return {}
    if isinstance(spec, str):
        candidates = [Path(spec), grid_path.parent / spec, project_root() / spec]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise GridError(f"{grid_path}: axes.{axis}.{name}: fragment file {spec!r} does not exist")
        try:
            spec = load_yaml(found, f"{grid_path}: axes.{axis}.{name}")
        except YamlFileError as exc:
            raise GridError(str(exc)) from None
    if not isinstance(spec, dict):
        raise GridError(f"{grid_path}: axes.{axis}.{name}: a fragment is a mapping or a file name, not {spec!r}")
    return _nest(spec)


def load_grid(path: str | os.PathLike) -> Grid:
    """Read and check a grid file.

    Raises:
        GridError: the file, an axis, a fragment, ``seeds``, ``metrics`` or ``goal`` is missing or malformed.
    """
    path = Path(path)
    if not path.is_file():
        raise GridError(f"--grid: {str(path)!r} does not exist")
    try:
        raw = load_yaml(path, "--grid")
    except YamlFileError as exc:
        raise GridError(str(exc)) from None
    axes = raw.get("axes")
    if not isinstance(axes, dict) or not axes or not all(isinstance(c, dict) and c for c in axes.values()):
        raise GridError(f"{path}: axes must map each axis name to a non-empty mapping of components")
    for axis, comps in axes.items():
        for name in comps:
            if not str(name).replace("_", "").replace("-", "").isalnum() or not str(axis).isidentifier():
                raise GridError(f"{path}: axes.{axis}.{name}: names are letters, digits, '_' and '-' (they name folders)")
    metrics = raw.get("metrics")
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
        raise GridError(f"{path}: metrics must be a non-empty list of logged keys (e.g. [test/acc])")
    goal = raw.get("goal", "maximize")
    if goal not in GOALS:
        raise GridError(f"{path}: goal={goal!r}; allowed: {', '.join(GOALS)}")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds):
        raise GridError(f"{path}: seeds must be a non-empty list of integers")
    verb = raw.get("verb", "fit")
    if verb not in ("fit", "test"):
        raise GridError(f"{path}: verb={verb!r}; allowed: fit, test")
    parsed = {axis: {str(name): _fragment(path, axis, str(name), spec) for name, spec in comps.items()}
              for axis, comps in axes.items()}
    return Grid(path, parsed, seeds, metrics, goal, verb, raw.get("config"), raw)


def prepare(grid: Grid, base: str, root: Path, name: str) -> dict[str, Path]:
    """Write every cell's merged fragment file under ``root/cells/``; cell name -> file."""
    folder = root / "cells"
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for cell in grid.cells():
        merged = merge_config_layers([grid.axes[axis][comp] for axis, comp in cell])
        merged["experiment"] = f"{name}/{cell_name(cell)}"
        path = folder / f"{cell_name(cell)}.yaml"
        text = f"# cell {cell_name(cell)} of {grid.path}, layered on {base}\n" + yaml.safe_dump(merged, sort_keys=False)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        files[cell_name(cell)] = path
    return files


def _builds(base: str, fragment_files: Sequence[Path], verb: str) -> str | None:
    """None when ``base`` + the fragments build (model, data, callbacks), else the first line of the error."""
    from lowrank_lit.launch.build import build_from_config

    overrides = [a for f in fragment_files for a in ("--config", str(f))]
    try:
        built = build_from_config(base, overrides, verb, quiet=True)
        try:  # the optimizer sees the parameters (a rank larger than a matrix, a group it cannot take)
            if verb == "fit":
                built.model.configure_optimizers()
        except RuntimeError as exc:
            if "trainer" not in str(exc).lower():  # needs the trainer (e.g. a scheduler's step count): not checkable
                raise
    except BaseException as exc:  # jsonargparse exits on bad configs; any constructor may raise
        if isinstance(exc, KeyboardInterrupt):
            raise
        text = " ".join(str(exc).split()) or type(exc).__name__
        return text if len(text) <= 300 else text[:297] + "..."
    return None


def check_cells(grid: Grid, base: str, root: Path, files: dict[str, Path]) -> dict[str, str]:
    """Build every cell before anything trains; cell name -> one line naming the components that do not fit."""
    single: dict[tuple[str, str], Path] = {}
    folder = root / "cells" / "parts"
    folder.mkdir(parents=True, exist_ok=True)
    for axis, comps in grid.axes.items():
        for comp, frag in comps.items():
            p = folder / f"{axis}.{comp}.yaml"
            p.write_text(yaml.safe_dump(frag or {}, sort_keys=False))
            single[(axis, comp)] = p
    alone: dict[tuple[str, str], str | None] = {}
    bad: dict[str, str] = {}
    for cell in grid.cells():
        error = _builds(base, [files[cell_name(cell)]], grid.verb)
        if error is None:
            continue
        culprit = None
        for part in cell:
            if part not in alone:
                alone[part] = _builds(base, [single[part]], grid.verb)
            if alone[part] is not None:
                culprit = f"{part[0]}={part[1]} fails on its own: {alone[part]}"
                break
        if culprit is None:
            for a, b in itertools.combinations(cell, 2):
                why = _builds(base, [single[a], single[b]], grid.verb)
                if why is not None:
                    culprit = f"{a[0]}={a[1]} and {b[0]}={b[1]} do not fit together: {why}"
                    break
        bad[cell_name(cell)] = culprit or f"the cell does not build: {error}"
    return bad


def _finished_runs(root: Path, name: str, cell: str, metric: str) -> list[tuple[Any, dict[str, float]]]:
    """The cell's finished runs (those that logged ``metric``): their seed and last logged values."""
    from lowrank_lit.report import last_values

    out = []
    for run in _runs(root, name, cell):
        got = last_values(run / "metrics.csv") if (run / "metrics.csv").is_file() else {}
        if metric in got:
            out.append(((yaml.safe_load((run / "config.yaml").read_text()) or {}).get("seed_everything"), got))
    return out


def sweep_files(grid: Grid, base: str, root: Path, name: str, files: dict[str, Path],
                skip: set[str]) -> list[tuple[int, Path, str, int]]:
    """Per seed, the W&B grid sweep of the runnable cells without a finished run of that seed: ``(seed, sweep file,
    study name, cells)``. The study name carries a digest of the cells it holds, so a restart, a changed grid or a
    subset of its seeds never meets a study with another parameter space; seeds with nothing left are left out."""
    import hashlib

    finished = {n: {seed for seed, _ in _finished_runs(root, name, n, grid.metrics[0])} for n in files if n not in skip}
    out = []
    for seed in grid.seeds:
        todo = [str(files[n]) for n, done in finished.items() if seed not in done]
        if not todo:
            continue
        spec = {
            "program": "lowrank_lit/__main__.py",
            "method": "grid",
            "metric": {"name": grid.metrics[0], "goal": grid.goal},
            "parameters": {"config": {"values": todo}, "seed_everything": {"values": [seed]}},
            "command": ["${env}", "${interpreter}", "-m", "lowrank_lit", grid.verb, "--config", base, "${args}"],
        }
        path = root / f"matrix.seed{seed}.sweep.yaml"
        text = f"# written by lowrank matrix from {grid.path}\n" + yaml.safe_dump(spec, sort_keys=False)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        digest = hashlib.sha256("\n".join(todo).encode()).hexdigest()[:8]
        out.append((seed, path, f"{name}-seed{seed}-{digest}", len(todo)))
    return out


def _runs(root: Path, name: str, cell: str) -> list[Path]:
    folder = root / name / cell
    return sorted(p.parent for p in folder.rglob("config.yaml")) if folder.is_dir() else []


def collect(grid: Grid, base: str, root: Path, name: str, files: dict[str, Path], bad: dict[str, str],
            extra: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One row per cell: each metric's mean and min-max over its finished runs, the runs and their commands."""
    rows = []
    for cell in grid.cells():
        cname = cell_name(cell)
        row: dict[str, Any] = {axis: comp for axis, comp in cell}
        if cname in bad:
            rows.append({**row, "status": "incompatible", "why": bad[cname]})
            continue
        values: dict[str, list[float]] = {m: [] for m in grid.metrics}
        commands, seeds = [], []
        for seed, got in _finished_runs(root, name, cname, grid.metrics[0]):
            seeds.append(seed)
            for m in grid.metrics:
                if m in got:
                    values[m].append(float(got[m]))
            commands.append(shlex.join(["lowrank", grid.verb, "--config", base, "--config", str(files[cname]),
                                        *extra, f"--seed_everything={seed}", "--run_root", str(root)]))
        row["status"] = "done" if len(seeds) >= len(grid.seeds) else f"{len(seeds)}/{len(grid.seeds)} runs"
        row["seeds"] = " ".join(str(s) for s in sorted(seeds))
        for m in grid.metrics:
            v = values[m]
            row[m] = statistics.mean(v) if v else None
            row[f"{m} min-max"] = f"{min(v):.4g}-{max(v):.4g}" if len(v) > 1 else ""
        row["command"] = commands[0] if commands else ""
        rows.append(row)
    return rows


def write_table(grid: Grid, rows: list[dict[str, Any]], root: Path) -> str:
    """``matrix.csv`` (every field) and ``matrix.md`` (the table); returns the markdown."""
    axes = list(grid.axes)
    cols = [*axes, "status", *[c for m in grid.metrics for c in (m, f"{m} min-max")], "seeds", "command"]
    with (root / "matrix.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*cols, "why"], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)

    def fmt(v: Any) -> str:
        return "-" if v is None or v == "" else f"{v:.4f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if r["status"] == "incompatible":
            cells = [fmt(r.get(a)) for a in axes] + [f"incompatible: {r['why']}"] + ["-"] * (len(cols) - len(axes) - 1)
        else:
            cells = [fmt(r.get(c)) if c != "command" else f"`{r[c]}`" if r[c] else "-" for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    (root / "matrix.md").write_text(text)
    return text


def pivot_table(grid: Grid, rows: list[dict[str, Any]], axis: str) -> str:
    """The first metric as a compact table: one row per combination of the other axes, one column per component of
    ``axis`` (mean over seeds, with the min-max range when there are several)."""
    if axis not in grid.axes:
        raise GridError(f"--pivot: {axis!r} is not an axis of {grid.path} ({', '.join(grid.axes)})")
    others = [a for a in grid.axes if a != axis]
    comps = list(grid.axes[axis])
    metric = grid.metrics[0]
    by: dict[tuple[str, ...], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(tuple(r[a] for a in others), {})[r[axis]] = r
    lines = ["| " + " | ".join([*others, *(f"{metric} {axis}={c}" for c in comps)]) + " |",
             "|" + "---|" * (len(others) + len(comps))]
    for key, cells in by.items():
        out = []
        for c in comps:
            r = cells.get(c, {})
            v = r.get(metric)
            spread = r.get(f"{metric} min-max") or ""
            out.append("-" if v is None else f"{v:.3f}" + (f" ({spread})" if spread else ""))
        lines.append("| " + " | ".join([*key, *out]) + " |")
    return "\n".join(lines) + "\n"


def plot_heatmaps(grid: Grid, rows: list[dict[str, Any]], root: Path) -> list[Path]:
    """A heatmap per metric: rows = the first axis' components, columns = the other axes' combinations."""
    from lowrank_lit.report import new_figure, save_figure

    axes = list(grid.axes)
    first, rest = axes[0], axes[1:]
    ylabels = list(grid.axes[first])
    xcombos = list(itertools.product(*[list(grid.axes[a]) for a in rest])) or [()]
    out = []
    for metric in grid.metrics:
        table = [[float("nan")] * len(xcombos) for _ in ylabels]
        for r in rows:
            if r.get(metric) is None:
                continue
            i = ylabels.index(r[first])
            j = xcombos.index(tuple(r[a] for a in rest))
            table[i][j] = r[metric]
        fig, ax = new_figure(figsize=(1.6 + 1.1 * len(xcombos), 1.2 + 0.5 * len(ylabels)))
        im = ax.imshow(table, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(xcombos)), [",".join(c) or "-" for c in xcombos], rotation=45, ha="right")
        ax.set_yticks(range(len(ylabels)), ylabels)
        ax.set_xlabel(" x ".join(rest) or "-")
        ax.set_ylabel(first)
        finite = [v for row in table for v in row if v == v]
        lo, hi = (min(finite), max(finite)) if finite else (0.0, 1.0)
        for i, row in enumerate(table):
            for j, v in enumerate(row):
                bright = v == v and hi > lo and (v - lo) / (hi - lo) > 0.6  # dark text on the light end of viridis
                ax.text(j, i, "x" if v != v else f"{v:.3f}", ha="center", va="center", color="k" if bright else "w",
                        fontsize=8)
        fig.colorbar(im, ax=ax, label=metric)
        ax.set_title(f"{grid.path.stem}: {metric} (mean over seeds; x: incompatible or not run)")
        path = root / f"matrix_{metric.replace('/', '_')}.png"
        save_figure(fig, str(path))
        out.append(path)
    return out


def _build_cells(grid: Grid, base: str, root: Path, name: str) -> tuple[dict[str, Path], dict[str, str]]:
    """Write and build every cell under ``root``; report the incompatible ones (stderr) and the count (stdout)."""
    files = prepare(grid, base, root, name)
    bad = check_cells(grid, base, root, files)
    for cell, why in bad.items():
        print(f"lowrank matrix: {cell}: incompatible: {why}", file=sys.stderr)
    runnable = len(files) - len(bad)
    print(f"{len(files)} cells x {len(grid.seeds)} seeds: {runnable} cells build, {len(bad)} incompatible", flush=True)
    return files, bad


def _check_only(grid: Grid, base: str, tmp: Path, name: str, root: Path, argv: Sequence[str]) -> int:
    """``--check``: build every cell (in ``tmp``) and report; 0 when every cell builds, 1 otherwise."""
    tmp.mkdir(parents=True)
    _, bad = _build_cells(grid, base, tmp, name)
    again = shlex.join(["lowrank", "matrix", *[a for a in argv if a != "--check"], "--limit", "0"])
    print(f"--check wrote nothing under {root}; to write the cells and the per-seed sweep files there and print the "
          f"SLURM array command of each seed, run: {again}")
    return 0 if not bad else 1


def _run_cells(sweep: Path, study: str, folder: Path, n_trials: int | None, workers: int, extra: list[str]) -> int:
    """Run one seed's cells: its grid sweep in this process, ``workers`` trials (``lowrank fit`` subprocesses) at
    once, in the matrix's journal. 0 when it ran to its end; 2 for a refused flag; 128 + the signal number when
    stopped (finished cells are kept: the same command continues)."""
    from lowrank_lit.launch.sweep import SweepError, SweepStopped, flag_clashes, load_sweep, run_sweep

    try:
        spec = load_sweep(sweep)
        clashes = flag_clashes(spec, extra)
        if clashes:
            raise SweepError(f"--{clashes[0][0]} sets {clashes[0][1]!r}, which the grid varies; drop the flag")
        # check=False: every cell was already built with lowrank fit's parser and constructors (_build_cells)
        run_sweep(spec, n_trials=n_trials, storage=str(folder / "matrix.journal"), study_name=study, run_root=folder,
                  seed=0, wandb=False, extra_args=list(extra), check=False, workers=workers)
    except SweepError as exc:
        print(f"lowrank matrix: error: {exc}", file=sys.stderr)
        return 2
    except SweepStopped as stopped:
        print(f"lowrank matrix: stopped by {stopped.signal_name}; finished cells are kept, run the same command "
              "again to continue", file=sys.stderr, flush=True)
        return 128 + int(getattr(signal, stopped.signal_name))
    return 0


def main(*, grid: str, config: str | None = None, root: str | None = None, jobs: int = 1, check: bool = False,
         limit: NonNegativeInt | None = None, seeds: list[Seed] | None = None, pivot: str | None = None,
         extra: PassThrough = [], given: Typed = ()) -> int:  # noqa: B006
    """Run the cross product of config fragments over seeds (a grid sweep) and write one table and a heatmap per metric.

    Flags it does not know go to every run (``--trainer.max_epochs=3``).

    Args:
        grid: the grid file (axes of named config fragments)
        config: the base config (default: the grid file's `config`)
        root: the matrix folder (default: runs/matrix/<grid name>)
        jobs: runs at once, each a `lowrank fit` subprocess (default 1)
        check: build every cell and report, run nothing
        limit: run at most this many runs in this call (smoke; 0 writes the cells and runs nothing)
        seeds: run (and tabulate) only these seeds of the grid's
        pivot: also write the first metric with this axis' components as columns (matrix_pivot.md)
        extra: the flags passed on to every run
        given: the words after `lowrank matrix`
    """
    try:
        spec = load_grid(grid)
        base = config or spec.config
        if not base:
            raise GridError("--config: no base config (give --config or `config:` in the grid file)")
        if jobs < 1:
            raise GridError(f"--jobs: {jobs}; allowed: an integer >= 1")
        if seeds:
            unknown = [x for x in seeds if x not in spec.seeds]
            if unknown:
                raise GridError(f"--seeds: {unknown} are not seeds of {grid} ({spec.seeds})")
            spec = dataclasses.replace(spec, seeds=list(seeds))
        if pivot and pivot not in spec.axes:
            raise GridError(f"--pivot: {pivot!r} is not an axis of {grid} ({', '.join(spec.axes)})")
    except GridError as exc:
        print(f"lowrank matrix: error: {exc}", file=sys.stderr)
        return 2
    name = spec.path.stem
    folder = Path(root or Path("runs") / "matrix" / name)
    if check:  # a check writes nothing where the runs go: the cells are built in a temporary folder
        import tempfile

        with tempfile.TemporaryDirectory(prefix="lowrank-matrix-check-") as tmp:
            return _check_only(spec, base, Path(tmp) / name, name, folder, given)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"lowrank matrix: error: --root={str(folder)!r}: cannot create it ({exc.strerror}); allowed: a folder you "
              "can write", file=sys.stderr)
        return 2
    files, bad = _build_cells(spec, base, folder, name)
    runnable = len(files) - len(bad)
    pending = sweep_files(spec, base, folder, name, files, set(bad)) if runnable else []
    for seed, sweep, study, cells in pending:
        submit = ["lowrank", "submit", "--sweep", str(sweep), "--array", "K", "--storage", str(folder / "matrix.journal"),
                  "--study-name", study, "--run-root", str(folder), *extra]
        print(f"on SLURM, K workers: {shlex.join(submit)}; then this command again writes the table "
              f"(seed {seed}: {cells} cells to run)")
    budget = limit
    for _seed, sweep, study, cells in pending:
        n = cells if budget is None else min(cells, budget)
        if n <= 0:
            break
        code = _run_cells(sweep, study, folder, n if budget is not None else None, min(jobs, n), extra)
        if code:
            return code
        if budget is not None:
            budget -= n
    rows = collect(spec, base, folder, name, files, bad, extra)
    print(write_table(spec, rows, folder))
    if pivot:
        pivoted = pivot_table(spec, rows, pivot)
        (folder / "matrix_pivot.md").write_text(pivoted)
        print(pivoted)
    for path in plot_heatmaps(spec, rows, folder):
        print(f"heatmap: {path}")
    print(f"table: {folder / 'matrix.md'} (and matrix.csv)")
    return 0
