"""Writing a run's result tables and plots: into the run directory, and to W&B when it is configured."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["save_rows", "log_image"]


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
