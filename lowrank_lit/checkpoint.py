"""Reading checkpoints back safely: no code runs from a checkpoint file, and a broken file is one clear line.

* :func:`load_checkpoint` reads with ``torch.load(..., weights_only=True)``: tensors, numbers,
  strings and containers only. A file that would need to import or call anything (a pickled
  payload, a whole ``nn.Module``) is refused with :class:`CheckpointError` before any of it runs.
* :func:`check_readable` tells a complete checkpoint from an empty or truncated one without
  loading it (torch writes a zip archive whose directory is at the end of the file), and names the
  newest readable checkpoint beside it.
* :func:`checkpoint_step` reads a checkpoint's ``global_step`` (memory-mapped, cheap) so a resume can
  pick the newest of several files.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "check_readable", "checkpoint_step", "load_checkpoint", "previous_good"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file."""


def _complete(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as archive:
            return bool(archive.namelist())
    except (zipfile.BadZipFile, OSError, EOFError):
        return False


def previous_good(path: str | os.PathLike) -> str | None:
    """The newest other readable ``*.ckpt`` in the file's folder and in its run directory (``hpc_ckpt_*``), else None."""
    path = Path(path)
    folders = {path.parent, path.parent.parent if path.parent.name == "checkpoints" else path.parent}
    found = [p for folder in folders if folder.is_dir() for p in folder.glob("*.ckpt")
             if p.resolve() != path.resolve() and _complete(p)]
    return str(max(found, key=lambda p: p.stat().st_mtime)) if found else None


def check_readable(path: str | os.PathLike, where: str = "ckpt_path") -> None:
    """Raise :class:`CheckpointError` (one line) when ``path`` is missing, empty or truncated.

    Args:
        path: the checkpoint file.
        where: the argument that named it, for the message (e.g. ``--ckpt_path``).
    """
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{where}={str(path)!r} is a folder; allowed: a checkpoint file (e.g. "
                              "RUN/checkpoints/last.ckpt)")
    if not path.is_file():
        raise CheckpointError(f"{where}={str(path)!r} does not exist")
    if _complete(path):
        return
    size = path.stat().st_size
    what = "is empty" if size == 0 else f"is truncated or not a checkpoint ({size} bytes, no complete torch archive)"
    prev = previous_good(path)
    hint = f"; the previous good checkpoint is {prev}" if prev else "; no other readable checkpoint beside it"
    raise CheckpointError(f"{where}={str(path)!r} {what}{hint}")


def load_checkpoint(path: str | os.PathLike, where: str = "ckpt_path", map_location: Any = "cpu") -> dict[str, Any]:
    """``torch.load`` with ``weights_only=True`` and one-line errors.

    Args:
        path: the checkpoint file.
        where: the argument that named it (e.g. ``model.init_args.pretrained``), for the messages.
        map_location: as in ``torch.load``. Default: ``"cpu"``.

    Raises:
        FileNotFoundError: the file does not exist.
        CheckpointError: empty, truncated, or holding objects that plain tensors and containers cannot
            express (nothing of them is run).
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"{where}={str(path)!r} does not exist")
    check_readable(path, where)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = next((ln.strip() for ln in str(exc).splitlines() if "GLOBAL" in ln or "Unsupported" in ln), "")
        raise CheckpointError(
            f"{where}={str(path)!r} holds objects other than tensors and plain containers{f' ({detail})' if detail else ''}; "
            "refusing to unpickle them (no code from a checkpoint is ever run)"
        ) from None


def checkpoint_step(path: str | os.PathLike) -> int:
    """The ``global_step`` stored in a Lightning checkpoint (-1 when it cannot be read)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - an unreadable file is never the newest
        return -1
    return int(ckpt.get("global_step", -1)) if isinstance(ckpt, dict) else -1
