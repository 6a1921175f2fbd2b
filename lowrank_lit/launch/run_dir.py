"""Where a run writes: ``<run_root>/<experiment>/<run_id>/``.

* ``run_id`` is the SLURM job id (``<job>_<task>`` for array tasks) when the process runs under
  a SLURM batch job, so a requeued job lands in the same directory and resumes there; otherwise
  a timestamp plus a random suffix, and a directory that already exists is never reused.
* DDP workers started by Lightning's subprocess launcher inherit ``LOWRANK_RUN_DIR`` from the
  rank-0 process, so all ranks agree on one directory.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["RunDir", "slurm_run_id", "new_run_id", "resolve_run_dir", "keep_previous_metrics", "newest_checkpoint", "ENV_RUN_DIR"]

ENV_RUN_DIR = "LOWRANK_RUN_DIR"
_EXPERIMENT_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class RunDir:
    """A resolved run directory.

    Attributes:
        path: the directory (created).
        experiment: experiment name, e.g. ``baseline/mlp_digits``.
        run_id: the run's id inside the experiment folder.
        resumed: True when the directory existed before (SLURM requeue or an explicit ``run_id``).
    """

    path: Path
    experiment: str
    run_id: str
    resumed: bool

    @property
    def wandb_id(self) -> str:
        """A W&B run id that is stable for the directory: ``<experiment>-<run_id>`` (safe characters)."""
        return re.sub(r"[^A-Za-z0-9_\-]", "-", f"{self.experiment}-{self.run_id}")[-120:]


def slurm_run_id() -> str | None:
    """The SLURM job id of a batch job (``<array_job>_<task>`` for arrays), else None.

    Interactive allocations (job name ``bash``/``interactive``, which Lightning's SLURM detection
    also skips) get None, so runs started by hand inside one do not share a directory.
    """
    job = os.environ.get("SLURM_JOB_ID")
    if not job or os.environ.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    array_job, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{task}" if array_job and task else job


def new_run_id() -> str:
    """``YYYYmmdd-HHMMSS-xxxx`` (local time plus 4 random hex digits)."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _validate(experiment: str, run_id: str | None) -> None:
    if not _EXPERIMENT_RE.match(experiment) or ".." in experiment.split("/"):
        raise ValueError(
            f"experiment={experiment!r}; allowed: path segments of letters, digits, '_', '.', '-' joined by '/'"
        )
    if run_id is not None and (not _RUN_ID_RE.match(run_id) or run_id in (".", "..")):
        raise ValueError(f"run_id={run_id!r}; allowed: letters, digits, '_', '.', '-'")


def keep_previous_metrics(path: Path) -> None:
    """Lightning's CSVLogger deletes an existing ``metrics.csv``; move it to ``metrics.<n>.csv`` first.

    Called once a re-entry is accepted (a refused one touches nothing), by the first process only.
    """
    metrics = path / "metrics.csv"
    if metrics.is_file():
        n = 1
        while (path / f"metrics.{n}.csv").exists():
            n += 1
        metrics.rename(path / f"metrics.{n}.csv")


def resolve_run_dir(run_root: str | os.PathLike, experiment: str, run_id: str | None = None) -> RunDir:
    """Pick and create the run directory.

    Args:
        run_root: folder holding all experiments, e.g. ``runs``.
        experiment: experiment name (may contain ``/``).
        run_id: reuse this id (resume an existing run). Default: the SLURM job id, else a fresh id.

    Returns:
        The created (or re-entered) :class:`RunDir`.
    """
    _validate(experiment, run_id)
    inherited = os.environ.get(ENV_RUN_DIR)
    if inherited and int(os.environ.get("LOCAL_RANK", "0") or 0) > 0:
        # a DDP worker spawned by rank 0: use rank 0's directory
        path = Path(inherited)
        path.mkdir(parents=True, exist_ok=True)
        return RunDir(path, experiment, path.name, resumed=True)
    base = Path(run_root) / experiment
    fixed = run_id or slurm_run_id()
    if fixed is not None:
        path = base / fixed
        resumed = path.is_dir() and any(path.iterdir())
        path.mkdir(parents=True, exist_ok=True)
        return RunDir(path, experiment, fixed, resumed)
    base.mkdir(parents=True, exist_ok=True)
    while True:  # never reuse an existing directory for a new run
        rid = new_run_id()
        try:
            (base / rid).mkdir()
        except FileExistsError:
            continue
        return RunDir(base / rid, experiment, rid, resumed=False)


def newest_checkpoint(paths: list[Path]) -> Path | None:
    """Of the existing, readable checkpoints in ``paths``: the one with the most optimizer steps (then the newest file)."""
    from lowrank_lit.checkpoint import checkpoint_step

    found = [(checkpoint_step(p), p.stat().st_mtime, p) for p in paths if p.is_file()]
    found = [f for f in found if f[0] >= 0]
    return max(found, key=lambda f: (f[0], f[1]))[2] if found else None
