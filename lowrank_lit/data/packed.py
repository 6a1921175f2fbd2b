"""Variable-length SFT sequences scheduled by global batch: the Skrull plan as a Lightning data pipeline.

``PackedSFTDataModule`` draws sequence lengths from a mix (``long_tail``: 90 % U[16, 256], 10 % U[1024, 2048];
``bimodal``: 50 % U[32, 256], 50 % U[768, 2048]; or a jsonl file's ``text`` fields) and cuts byte windows of
those lengths from Python's standard-library sources (or the jsonl texts). ``SkrullBatchSampler`` walks a
seeded permutation in global batches of ``global_batch_size`` sequences; every DP rank computes the same plan
from the shared lengths (:func:`lowrank_lit.methods.skrull.skrull_plan` or a baseline schedule) and yields only
its own micro-batches, with the global batch's target-token count, so the ranks agree without communication.
Use it with ``trainer.use_distributed_sampler: false``.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from typing import Any, Protocol

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from lowrank_lit.argtypes import InputPath
from lowrank_lit.data.loader import ResumableDataLoader
from lowrank_lit.data.text import read_text_bytes
from lowrank_lit.seeding import run_seed

__all__ = ["LENGTH_MIXES", "draw_lengths", "Planner", "SkrullBatchSampler", "PlannedSequences", "PackedSFTDataModule"]

LENGTH_MIXES = {
    "long_tail": ((0.9, 16, 256), (0.1, 1024, 2048)),
    "bimodal": ((0.5, 32, 256), (0.5, 768, 2048)),
}


def draw_lengths(n: int, mix: str, seed: int) -> list[int]:
    """``n`` lengths from ``LENGTH_MIXES[mix]`` (weight, low, high) components, uniform integers inside each."""
    if mix not in LENGTH_MIXES:
        raise ValueError(f"draw_lengths: mix={mix!r}; allowed: {', '.join(LENGTH_MIXES)}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        u, acc = rng.random(), 0.0
        comps = LENGTH_MIXES[mix]
        pick = comps[-1]
        for comp in comps:
            acc += comp[0]
            if u < acc:
                pick = comp
                break
        out.append(rng.randint(pick[1], pick[2]))
    return out


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class Planner(Protocol):
    """``planner(lengths, dp_size)`` -> every DP rank's micro-batches ``[(indices, placements), ...]`` (e.g.
    :class:`lowrank_lit.methods.skrull.SkrullPlanner`); ``max_length`` is the longest sequence it can place."""

    max_length: int

    def __call__(self, lengths: list[int], dp_size: int) -> list[list[tuple[list[int], list[int]]]]:
        ...


class SkrullBatchSampler(Sampler):
    """Per global batch, this DP rank's micro-batches: items ``{"micro_batches": [[idx, ...], ...], "placements":
    [[p, ...], ...], "global_targets": int}``.

    Args:
        lengths: the dataset's sequence lengths (tokens).
        global_batch_size: sequences per optimizer step over all DP ranks.
        planner: the schedule (see :class:`Planner`).
        seed: seed of the permutation (epoch e uses ``seed + e``). Default: 0.
        dp_size, dp_rank: data-parallel world and rank; None: from ``torch.distributed`` when iterating. Default: None.
    """

    def __init__(self, lengths: list[int], global_batch_size: int, planner: Planner, seed: int = 0,
                 dp_size: int | None = None, dp_rank: int | None = None) -> None:
        if global_batch_size < 1 or global_batch_size > len(lengths):
            raise ValueError(f"SkrullBatchSampler: global_batch_size={global_batch_size}; allowed: 1..{len(lengths)} (the dataset size)")
        self.lengths, self.global_batch_size, self.planner = list(lengths), global_batch_size, planner
        self.seed, self.dp_size, self.dp_rank = seed, dp_size, dp_rank
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.lengths) // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def plan(self, batch: list[int], dp_size: int) -> list[list[tuple[list[int], list[int]]]]:
        """Every DP rank's micro-batches ``(positions in batch, placements)`` for one global batch."""
        return self.planner([self.lengths[i] for i in batch], dp_size)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        rank, world = _dist_rank_world()
        dp_size = self.dp_size or world
        dp_rank = rank if self.dp_rank is None else self.dp_rank
        order = torch.randperm(len(self.lengths), generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        for b in range(len(self)):
            batch = order[b * self.global_batch_size:(b + 1) * self.global_batch_size]
            mine = self.plan(batch, dp_size)[dp_rank]
            yield {"micro_batches": [[batch[k] for k in idx] for idx, _ in mine],
                   "placements": [list(place) for _, place in mine],
                   "global_targets": sum(self.lengths[i] - 1 for i in batch)}


class PlannedSequences(Dataset):
    """Token sequences; indexed by a :class:`SkrullBatchSampler` item, returns the sequences of its micro-batches."""

    def __init__(self, sequences: list[torch.Tensor]) -> None:
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, item: Any) -> Any:
        if isinstance(item, dict):
            return {**item, "micro_batches": [[self.sequences[i] for i in mb] for mb in item["micro_batches"]]}
        return self.sequences[item]


def _identity(x: Any) -> Any:
    return x


class PackedSFTDataModule(pl.LightningDataModule):
    """Variable-length byte sequences for SFT-style causal LM training under a Skrull schedule (module docstring).

    Args:
        mix: ``long_tail`` or ``bimodal`` (ignored with ``jsonl``). Default: long_tail.
        num_sequences: training sequences. Default: 512.
        val_sequences: validation sequences (same mix, other windows). Default: 64.
        planner: the schedule (``lowrank_lit.methods.skrull.SkrullPlanner(bucket, cp, schedule)``).
        global_batch_size: sequences per optimizer step over all DP ranks. Default: 32.
        jsonl: a jsonl file with a ``text`` field per line (your SFT data); None: stdlib sources. Default: None.
        tokenizer: a local ``transformers`` tokenizer folder for the jsonl texts; None: bytes < 128. Default: None.
        max_length: longest sequence kept (longer jsonl texts are cut). Default: 2048.
        data_seed: seed of lengths and windows; None: the run seed. Default: None.
    """

    vocab_size = 128

    def __init__(self, planner: Planner, mix: str = "long_tail", num_sequences: int = 512, val_sequences: int = 64,
                 global_batch_size: int = 32, jsonl: InputPath | None = None, max_length: int = 2048,
                 data_seed: int | None = None, tokenizer: str | None = None) -> None:
        super().__init__()
        if mix not in LENGTH_MIXES:
            raise ValueError(f"PackedSFTDataModule: mix={mix!r}; allowed: {', '.join(LENGTH_MIXES)}")
        if max_length > planner.max_length:
            raise ValueError(f"PackedSFTDataModule: max_length={max_length} > the planner's longest placeable sequence "
                             f"({planner.max_length} = bucket x cp)")
        if jsonl is not None and not os.path.isfile(jsonl):
            raise FileNotFoundError(f"PackedSFTDataModule: jsonl={jsonl!r} does not exist")
        self.mix, self.num_sequences, self.val_sequences = mix, num_sequences, val_sequences
        self.planner, self.global_batch_size = planner, global_batch_size
        if tokenizer is not None and (jsonl is None or not os.path.isdir(tokenizer)):
            raise ValueError(f"PackedSFTDataModule: tokenizer={tokenizer!r}; allowed: a local tokenizer folder, with jsonl= set")
        self.jsonl, self.max_length, self.data_seed, self.tokenizer = jsonl, max_length, data_seed, tokenizer
        self.train_set: PlannedSequences | None = None
        self.val_set: PlannedSequences | None = None

    def _texts(self, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if self.jsonl is not None:
            tok = None
            if self.tokenizer is not None:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(self.tokenizer, local_files_only=True)
            seqs = []
            with open(self.jsonl) as f:
                for ln, line in enumerate(f):
                    if not line.strip():
                        continue
                    try:
                        text = json.loads(line)["text"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"PackedSFTDataModule: {self.jsonl}:{ln + 1} is not a json object with a 'text' field") from None
                    if tok is not None:
                        data = np.asarray(tok(text)["input_ids"][: self.max_length], dtype=np.int64)
                    else:
                        data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
                        data = data[data < self.vocab_size][: self.max_length]
                    if len(data) >= 2:
                        seqs.append(torch.as_tensor(data.astype(np.int64)))
            n_val = max(1, len(seqs) // 10)
            return seqs[n_val:], seqs[:n_val]
        corpus = torch.as_tensor(read_text_bytes(max_bytes=4_000_000).astype(np.int64))
        n = self.num_sequences + self.val_sequences
        lens = [min(s, self.max_length) for s in draw_lengths(n, self.mix, seed)]
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(corpus) - self.max_length, (n,), generator=g).tolist()
        seqs = [corpus[a:a + s].clone() for a, s in zip(starts, lens, strict=True)]
        return seqs[: self.num_sequences], seqs[self.num_sequences:]

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        train, val = self._texts(run_seed(self.data_seed))
        self.train_set, self.val_set = PlannedSequences(train), PlannedSequences(val)

    def _loader(self, ds: PlannedSequences, seed: int, shuffle_seed: bool) -> DataLoader:
        gbs = min(self.global_batch_size, len(ds))
        sampler = SkrullBatchSampler([len(s) for s in ds.sequences], gbs, self.planner, seed=seed if shuffle_seed else 0)
        # resumable: an interrupted run skips the global batches it trained on (the plan is seeded per epoch)
        return ResumableDataLoader(ds, sampler=sampler, batch_size=None, collate_fn=_identity)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        return self._loader(self.train_set, run_seed(self.data_seed), True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return self._loader(self.val_set, 0, False)
