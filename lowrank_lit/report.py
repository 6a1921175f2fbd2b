"""A run's results: writing tables and plots (run directory, and W&B when configured), and reading runs back."""

from __future__ import annotations

import csv
import glob
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["save_rows", "log_image", "last_values", "read_metric", "read_config", "find_runs"]


def save_rows(trainer: Any, rows: Sequence[dict[str, Any]], filename: str) -> str:
    """Write ``rows`` (dicts with the same keys) as CSV ``<run directory>/<filename>``; returns the path."""
    path = os.path.join(trainer.default_root_dir, filename)
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


def find_runs(roots: Iterable[str], marker: str) -> list[str]:
    """Run directories (sorted) at any depth below ``roots`` that hold a file named ``marker``."""
    return sorted(os.path.dirname(p) for r in roots for p in glob.glob(os.path.join(r, "**", marker), recursive=True))
