"""Character (byte) level language-modelling data from text that ships with Python, or from your files.

``CharTextDataModule`` reads the ``.py`` sources of Python's standard library by default (found with
``sysconfig.get_paths()["stdlib"]``, sorted by path, concatenated up to ``max_bytes``), keeps bytes
below ``vocab_size`` (128: ASCII), splits 90/10 into train/validation, and serves non-overlapping
windows of ``context + 1`` bytes as ``(input (B, context), target (B, context))`` pairs. Nothing is
downloaded; the exact text depends on the installed Python version.
"""

from __future__ import annotations

import glob
import os
import sysconfig

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lowrank_lit.argtypes import InputPath
from lowrank_lit.data.loader import ResumableDataLoader

__all__ = ["CharTextDataModule", "read_text_bytes"]


def read_text_bytes(files: list[str] | None = None, root: str | None = None, pattern: str = "**/*.py",
                    max_bytes: int = 2_000_000, vocab_size: int = 128) -> np.ndarray:
    """Concatenate the bytes of ``files`` (or of ``root``/``pattern``, default: the stdlib ``.py`` files).

    Bytes ``>= vocab_size`` are dropped; reading stops at ``max_bytes`` kept bytes.

    Returns:
        ``(n,)`` uint8 array.
    """
    if files is None:
        root = root or sysconfig.get_paths()["stdlib"]
        if not os.path.isdir(root):
            raise FileNotFoundError(f"CharTextDataModule: root={root!r} is not a directory")
        files = sorted(p for p in glob.glob(os.path.join(root, pattern), recursive=True)
                       if "site-packages" not in p and os.path.isfile(p))
    if not files:
        raise FileNotFoundError(f"CharTextDataModule: no text files found (root={root!r}, pattern={pattern!r})")
    chunks, total = [], 0
    for path in files:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CharTextDataModule: file {path!r} does not exist")
        with open(path, "rb") as f:
            data = np.frombuffer(f.read(), dtype=np.uint8)
        data = data[data < vocab_size]
        chunks.append(data[: max_bytes - total])
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    return np.concatenate(chunks)


class _Windows(Dataset):
    """Non-overlapping windows of ``context + 1`` tokens: ``(x = w[:-1], y = w[1:])``."""

    def __init__(self, tokens: torch.Tensor, context: int) -> None:
        self.tokens, self.context = tokens, context
        self.n = (len(tokens) - 1) // context

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.tokens[i * self.context : i * self.context + self.context + 1]
        return w[:-1], w[1:]


class CharTextDataModule(pl.LightningDataModule):
    """Byte-level LM data; see the module docstring.

    Args:
        files: text files to read, in order; None reads ``root``. Default: None.
        root: folder searched with ``pattern``; None = Python's standard library. Default: None.
        pattern: glob under ``root``. Default: ``**/*.py``.
        max_bytes: bytes kept in all. Default: 2_000_000 (card: ~2 MB).
        vocab_size: bytes below this are kept (128 = ASCII, 256 = all). Default: 128.
        context: tokens per training window. Default: 64 (card).
        val_fraction: the last fraction of the text is the validation split. Default: 0.1 (card).
        batch_size: windows per batch. Default: 32 (card).
        num_workers: DataLoader workers. Default: 0.
    """

    def __init__(
        self,
        files: list[str] | None = None,
        root: InputPath | None = None,
        pattern: str = "**/*.py",
        max_bytes: int = 2_000_000,
        vocab_size: int = 128,
        context: int = 64,
        val_fraction: float = 0.1,
        batch_size: int = 32,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 2 <= vocab_size <= 256:
            raise ValueError(f"CharTextDataModule: vocab_size={vocab_size!r}; allowed: an integer in 2..256")
        if context < 1 or batch_size < 1 or max_bytes < 2 * (context + 1):
            raise ValueError(f"CharTextDataModule: context={context}, batch_size={batch_size}, max_bytes={max_bytes}; "
                             "allowed: context >= 1, batch_size >= 1, max_bytes >= 2 (context + 1)")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"CharTextDataModule: val_fraction={val_fraction!r}; allowed: a float in (0, 1)")
        self.files, self.root, self.pattern = files, root, pattern
        self.max_bytes, self.vocab_size, self.context = max_bytes, vocab_size, context
        self.val_fraction, self.batch_size, self.num_workers = val_fraction, batch_size, num_workers
        self.splits: dict[str, _Windows] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.splits:
            return
        data = torch.from_numpy(read_text_bytes(self.files, self.root, self.pattern, self.max_bytes, self.vocab_size).astype(np.int64))
        cut = int(len(data) * (1 - self.val_fraction))
        self.n_bytes = len(data)
        self.splits = {"train": _Windows(data[:cut], self.context), "val": _Windows(data[cut:], self.context)}
        if len(self.splits["val"]) == 0:
            raise ValueError(f"CharTextDataModule: the validation split ({len(data) - cut} bytes) is shorter than one window of {self.context + 1}")

    def train_dataloader(self) -> DataLoader:
        return ResumableDataLoader(self.splits["train"], batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.splits["val"], batch_size=max(self.batch_size, 64), num_workers=self.num_workers)

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
