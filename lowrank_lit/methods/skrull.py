"""Skrull: dynamic data scheduling for long-context SFT on mixed long and short sequences.

Xu, Shen, Wei, Wang, Guo, Wang, Li, Li, Jia, NeurIPS 2025 (arXiv 2505.19609). No public code.

Per global batch, Skrull decides how sequences form micro-batches on each data-parallel (DP) rank
(Global Data Scheduling, :func:`gds_plan`) and, inside each micro-batch, which sequences are sharded over
the context-parallel (CP) group and which run whole on one CP rank (Distributed-Aware Context Parallelism,
:func:`dacp_plan`). The global batch is unchanged, so with the loss normalised by the global-batch token
count the gradients equal standard training (:class:`SkrullSFTModule`).

Cost model (:class:`SkrullCostModel`), per sequence of S tokens (b = 1, sequence packing):

* ``FLOPs(S) = 20 h^2 S + 4 h h_kv S + 4 h S^2``; a shard over N ranks costs ``FLOPs(S) / N`` (inferred);
* compute ``T_comp(S, N) = layers * (a * 3 FLOPs(S) / N / eff(S / N) + c)`` with ``eff(x) = x / (x + knee)``
  (short chunks run below peak; ``knee = 0``: the plain linear fit ``a FLOPs + c``); ``calibrate`` fits
  ``(a, c)`` (and optionally ``knee`` over a grid) to measured timings by least squares;
* communication of a sharded sequence ``T_comm(S, N) = layers * 3 * (latency + 4 S h_kv (N - 1) / N / bandwidth)``
  (K and V in 16-bit, all-gathered forward and backward);
* memory ``Mem(S) = alpha S + beta`` (``alpha`` measured with ``saved_tensors_hooks``, :func:`fit_memory`) and
  the bucket size ``C = (budget - static - beta) / alpha`` tokens per rank.

DACP (paper Alg. 1), one micro-batch, CP degree N, bucket C: visit the sequences by ascending length (ties by
index); (1) the least-loaded rank takes it whole if its remaining bucket allows; (2) else the rank with the
most room; (3) else shard it if the rank with the least room still has ``S / N``; (4) else roll back: the
shortest whole sequence on that rank becomes sharded (its S refunded there, ``S / N`` charged to every rank)
and the current sequence is retried; a rank without whole sequences to roll back is a scheduling error. The
printed RollBack line has a sign/scope slip; this refund/charge-all reading is inferred. A rollback's charge
can push another rank over its bucket; then nothing is placed until rollbacks on the rank with the least
room have cleared every deficit (inferred), so the final plan never exceeds the bucket.

GDS (paper Alg. 2): longest-processing-time assignment of the sequences' FLOPs to the DP ranks (greedy to
the least loaded, inferred); on each rank sort ascending; ``m = ceil(sum S / (C N))`` micro-batches taken
strided (``subset[j::m]``, each mixes long and short); accept when every micro-batch has ``sum S < C N``
and DACP succeeds on each, else ``m + 1``.

Time of a micro-batch (the paper's objective): ``max_j [max(T_comm(dist), T_comp(local_j)) + T_comp(dist)]``
(communication of the sharded sequences overlaps the rank's local compute); an iteration is the slowest DP
rank's sum over its micro-batches (:func:`simulate_iteration`). The baseline shards every sequence and
overlaps nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import nn

from lowrank_lit.registry import register_method
from lowrank_lit.report import markdown_table, new_figure, read_runs, save_figure
from lowrank_lit.sharding import Shardable

__all__ = ["SkrullSFTModule", "SkrullPlanner", "micro_batch_loss", "SchedulingError", "SkrullCostModel", "fit_memory", "saved_tensor_bytes", "dacp_plan", "gds_plan",
           "baseline_plan", "sorted_plan", "dacp_only_plan", "skrull_plan", "simulate_iteration", "plan_tokens"]

PAPER = "Skrull: Towards Efficient Long Context Fine-tuning through Dynamic Data Scheduling"

#: one micro-batch: (sequence indices, DACP placement per index: -1 sharded, j whole on CP rank j)
MicroBatch = tuple[list[int], list[int]]


class SchedulingError(ValueError):
    """DACP cannot place a micro-batch within the bucket (the message names the sequence)."""


def _check_lengths(lengths: Sequence[int], where: str) -> list[int]:
    if len(lengths) == 0:
        raise ValueError(f"{where}: lengths is empty; allowed: a non-empty list of positive integers")
    out = []
    for i, s in enumerate(lengths):
        if isinstance(s, bool) or not isinstance(s, (int,)) and not (hasattr(s, "is_integer") and float(s).is_integer()):
            raise ValueError(f"{where}: lengths[{i}]={s!r} is not an integer; allowed: positive integers")
        if int(s) <= 0:
            raise ValueError(f"{where}: lengths[{i}]={s!r}; allowed: positive integers")
        out.append(int(s))
    return out


def _check_bucket_cp(bucket: float, cp: int, where: str) -> None:
    if not bucket > 0:
        raise ValueError(f"{where}: bucket={bucket!r}; allowed: > 0 (tokens one rank can hold)")
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"{where}: cp={cp!r}; allowed: an integer >= 1")


@dataclass
class SkrullCostModel:
    """FLOPs, compute, communication and memory of packed sequences (see the module docstring).

    Args:
        hidden: model width h. Default: 896 (Qwen2.5-0.5B).
        kv_hidden: key/value width h_kv. Default: 128.
        layers: transformer layers. Default: 24.
        mem_alpha: bytes of activations per token. Default: 1.0 (then buckets are in bytes = tokens).
        mem_beta: fixed activation bytes. Default: 0.0.
        comp_fit: ``(a, c)``: seconds per effective FLOP and per-layer launch overhead. Default: (1 / 400e12, 20e-6)
            (400 TFLOP/s x efficiency of the card's H100 simulation).
        knee: ``eff(x) = x / (x + knee)`` for a chunk of x tokens; 0 disables it. Default: 512.
        comm_fit: ``(latency s, bandwidth B/s)`` of one K/V all-gather. Default: (50e-6, 160e9).
    """

    hidden: int = 896
    kv_hidden: int = 128
    layers: int = 24
    mem_alpha: float = 1.0
    mem_beta: float = 0.0
    comp_fit: tuple[float, float] = (1.0 / 400e12, 20e-6)
    knee: float = 512.0
    comm_fit: tuple[float, float] = (50e-6, 160e9)

    def flops(self, S: float, n_shards: int = 1) -> float:
        """FLOPs of one forward pass over a sequence of S tokens, split over ``n_shards`` ranks."""
        h, hk = self.hidden, self.kv_hidden
        return (20 * h * h * S + 4 * h * hk * S + 4 * h * S * S) / n_shards

    def eff(self, tokens: float) -> float:
        return 1.0 if self.knee <= 0 else tokens / (tokens + self.knee)

    def effective_flops(self, S: float, n_shards: int = 1) -> float:
        """Forward + backward FLOPs (3x) of the shard, divided by the efficiency at its token count."""
        return 3 * self.flops(S, n_shards) / self.eff(S / n_shards)

    def t_comp(self, S: float, n_shards: int = 1) -> float:
        a, c = self.comp_fit
        return self.layers * (a * self.effective_flops(S, n_shards) + c)

    def t_comm(self, S: float, n_shards: int) -> float:
        """K/V all-gather time of one sharded sequence (0 when not sharded)."""
        if n_shards <= 1:
            return 0.0
        latency, bandwidth = self.comm_fit
        return self.layers * 3 * (latency + 4 * S * self.kv_hidden * (n_shards - 1) / n_shards / bandwidth)

    def memory(self, S: float) -> float:
        return self.mem_alpha * S + self.mem_beta

    def bucket_size(self, mem_budget: float, static: float = 0.0) -> int:
        """Tokens one rank can hold: ``(mem_budget - static - beta) / alpha``."""
        c = int((mem_budget - static - self.mem_beta) // self.mem_alpha)
        if c <= 0:
            raise ValueError(f"SkrullCostModel.bucket_size: mem_budget={mem_budget!r} leaves no room after static={static!r} "
                             f"and beta={self.mem_beta!r}; allowed: a budget above static + beta + alpha")
        return c

    def calibrate(self, lengths: Sequence[float], times: Sequence[float], n_shards: int = 1,
                  knees: Sequence[float] | None = None) -> SkrullCostModel:
        """Fit ``comp_fit = (a, c)`` (and ``knee`` from ``knees`` if given) to measured times of whole forward +
        backward passes over ``layers`` layers; returns self.

        Raises:
            ValueError: fewer than 2 points, or lengths and times of different sizes.
        """
        if len(lengths) != len(times) or len(lengths) < 2:
            raise ValueError(f"SkrullCostModel.calibrate: {len(lengths)} lengths and {len(times)} times; allowed: "
                             "the same number, at least 2")
        best: tuple[float, float, float, float] | None = None
        for knee in (list(knees) if knees else [self.knee]):
            self.knee = float(knee)
            x = torch.tensor([self.effective_flops(S, n_shards) for S in lengths], dtype=torch.float64)
            y = torch.tensor([float(t) / self.layers for t in times], dtype=torch.float64)
            design = torch.stack([x, torch.ones_like(x)], 1)
            sol = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
            if sol[1] < 0:  # a negative launch overhead is not physical: refit through the origin
                sol = torch.stack([(x @ y) / (x @ x), torch.zeros((), dtype=torch.float64)])
            resid = float(((design @ sol - y) ** 2).sum())
            if best is None or resid < best[0]:
                best = (resid, float(knee), float(sol[0]), float(sol[1]))
        assert best is not None
        _, self.knee, a, c = best
        self.comp_fit = (a, c)
        return self


def saved_tensor_bytes(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes of the tensors autograd saves for backward while ``fn()`` runs (each storage counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return total


def fit_memory(run: Callable[[int], torch.Tensor], lengths: Sequence[int] = (256, 1024)) -> tuple[float, float]:
    """``(alpha, beta)`` of ``Mem(S) = alpha S + beta`` from the saved-for-backward bytes of ``run(S)`` at two lengths."""
    if len(lengths) < 2:
        raise ValueError(f"fit_memory: lengths={list(lengths)!r}; allowed: at least 2 lengths")
    xs = [float(s) for s in lengths]
    ys = [float(saved_tensor_bytes(lambda s=s: run(int(s)))) for s in lengths]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    alpha = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return alpha, my - alpha * mx


# -- planners ----------------------------------------------------------------------------------------

def dacp_plan(lengths: Sequence[int], bucket: float, cp: int, cost: SkrullCostModel | None = None) -> list[int]:
    """DACP placement of one micro-batch: ``plan[k] = -1`` (sharded over the CP group) or ``j`` (whole on CP rank j).

    Raises:
        ValueError: bad arguments, or a sequence that cannot fit even sharded (``S / cp > bucket``).
        SchedulingError: the rollback runs out of whole sequences on the rank that needs room.
    """
    lens = _check_lengths(lengths, "dacp_plan")
    _check_bucket_cp(bucket, cp, "dacp_plan")
    for i, s in enumerate(lens):
        if s / cp > bucket:
            raise ValueError(f"dacp_plan: lengths[{i}]={s} cannot fit even sharded: {s} / cp={cp} > bucket={bucket}")
    cost = cost or SkrullCostModel()
    order = sorted(range(len(lens)), key=lambda k: (lens[k], k))
    room = [float(bucket)] * cp
    load = [0.0] * cp
    whole: list[list[int]] = [[] for _ in range(cp)]  # per rank, in placement order (= ascending length)
    plan = [0] * len(lens)

    def shard(k: int) -> None:
        for j in range(cp):
            room[j] -= lens[k] / cp
            load[j] += cost.flops(lens[k], cp)
        plan[k] = -1

    i = 0
    while i < len(order):
        k, S = order[i], lens[order[i]]
        if min(room) >= 0:  # no rank over its bucket (a rollback may have charged one below zero)
            t = min(range(cp), key=lambda j: (load[j], j))  # (1) least loaded
            if room[t] < S:
                t = max(range(cp), key=lambda j: (room[j], -j))  # (2) most room
            if room[t] >= S:
                room[t] -= S
                load[t] += cost.flops(S)
                whole[t].append(k)
                plan[k] = t
                i += 1
                continue
            if min(room) >= S / cp:  # (3) shard it
                shard(k)
                i += 1
                continue
        t = min(range(cp), key=lambda j: (room[j], j))  # (4) roll back on the rank with the least room
        if not whole[t]:
            raise SchedulingError(f"dacp_plan: cannot place lengths[{k}]={S}: CP rank {t} has {room[t]:.0f} of bucket={bucket} "
                                  f"tokens left and no whole sequence to roll back")
        r = whole[t].pop(0)  # the shortest whole sequence on rank t becomes sharded
        room[t] += lens[r]
        load[t] -= cost.flops(lens[r])
        shard(r)
    return plan


def _dp_split_lpt(lens: list[int], dp_size: int, cost: SkrullCostModel) -> list[list[int]]:
    order = sorted(range(len(lens)), key=lambda k: (-cost.flops(lens[k]), k))
    loads = [0.0] * dp_size
    parts: list[list[int]] = [[] for _ in range(dp_size)]
    for k in order:
        i = min(range(dp_size), key=lambda j: (loads[j], j))
        parts[i].append(k)
        loads[i] += cost.flops(lens[k])
    return parts


def _check_dp(dp_size: int, dp_rank: int | None, where: str) -> None:
    if isinstance(dp_size, bool) or not isinstance(dp_size, int) or dp_size < 1:
        raise ValueError(f"{where}: dp_size={dp_size!r}; allowed: an integer >= 1")
    if dp_rank is not None and not (isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
        raise ValueError(f"{where}: dp_rank={dp_rank!r}; allowed: 0..{dp_size - 1}")


def gds_plan(lengths: Sequence[int], bucket: float, cp: int, dp_size: int, dp_rank: int,
             cost: SkrullCostModel | None = None, max_micro_batches: int | None = None) -> list[list[int]]:
    """The micro-batches (lists of global-batch indices) DP rank ``dp_rank`` runs (see the module docstring).

    Every rank computes the same split from the same lengths (deterministic tie-breaks), so the ranks agree
    without communication. Use :func:`skrull_plan` for the micro-batches together with their DACP placements.

    Raises:
        ValueError: bad arguments; ``sum(lengths) > bucket * cp * dp_size * max_micro_batches``.
        SchedulingError: no micro-batch count up to the rank's sequence count (or ``max_micro_batches``) works.
    """
    return [idx for idx, _ in _gds_rank(lengths, bucket, cp, dp_size, dp_rank, cost, max_micro_batches)]


def _gds_rank(lengths: Sequence[int], bucket: float, cp: int, dp_size: int, dp_rank: int,
              cost: SkrullCostModel | None, max_micro_batches: int | None) -> list[MicroBatch]:
    lens = _check_lengths(lengths, "gds_plan")
    _check_bucket_cp(bucket, cp, "gds_plan")
    _check_dp(dp_size, dp_rank, "gds_plan")
    if max_micro_batches is not None and sum(lens) > bucket * cp * dp_size * max_micro_batches:
        raise ValueError(f"gds_plan: sum(lengths)={sum(lens)} > bucket x cp x dp_size x max_micro_batches = "
                         f"{bucket} x {cp} x {dp_size} x {max_micro_batches}")
    for i, s in enumerate(lens):
        if s / cp > bucket:
            raise ValueError(f"gds_plan: lengths[{i}]={s} cannot fit even sharded: {s} / cp={cp} > bucket={bucket}")
    cost = cost or SkrullCostModel()
    mine = sorted(_dp_split_lpt(lens, dp_size, cost)[dp_rank], key=lambda k: (lens[k], k))
    if not mine:
        return []
    m = max(1, math.ceil(sum(lens[k] for k in mine) / (bucket * cp)))
    limit = min(len(mine), max_micro_batches or len(mine))
    while m <= limit:
        mbs = [mine[j::m] for j in range(m)]
        out = []
        for mb in mbs:
            if sum(lens[k] for k in mb) >= bucket * cp and len(mb) > 1:
                break
            try:
                out.append((mb, dacp_plan([lens[k] for k in mb], bucket, cp, cost)))
            except SchedulingError:
                break
        else:
            return out
        m += 1
    raise SchedulingError(f"gds_plan: DP rank {dp_rank} cannot split its {len(mine)} sequences into <= {limit} "
                          f"micro-batches that fit bucket={bucket} x cp={cp}")


def skrull_plan(lengths: Sequence[int], bucket: float, cp: int, dp_size: int, cost: SkrullCostModel | None = None,
                max_micro_batches: int | None = None) -> list[list[MicroBatch]]:
    """GDS + DACP for every DP rank: ``plan[i]`` = rank i's micro-batches ``(indices, placements)``."""
    return [_gds_rank(lengths, bucket, cp, dp_size, i, cost, max_micro_batches) for i in range(dp_size)]


def _pack_in_order(idx: list[int], lens: list[int], capacity: float) -> list[list[int]]:
    mbs: list[list[int]] = []
    cur: list[int] = []
    for k in idx:
        if cur and sum(lens[j] for j in cur) + lens[k] > capacity:
            mbs.append(cur)
            cur = []
        cur.append(k)
    if cur:
        mbs.append(cur)
    return mbs


def _contiguous_split(idx: list[int], dp_size: int) -> list[list[int]]:
    n = len(idx)
    return [idx[i * n // dp_size:(i + 1) * n // dp_size] for i in range(dp_size)]


def baseline_plan(lengths: Sequence[int], bucket: float, cp: int, dp_size: int) -> list[list[MicroBatch]]:
    """Uniform CP: arrival-order DP split, greedy packing to ``bucket * cp`` tokens, every sequence sharded."""
    lens = _check_lengths(lengths, "baseline_plan")
    _check_bucket_cp(bucket, cp, "baseline_plan")
    _check_dp(dp_size, None, "baseline_plan")
    return [[(mb, [-1] * len(mb)) for mb in _pack_in_order(part, lens, bucket * cp)]
            for part in _contiguous_split(list(range(len(lens))), dp_size)]


def sorted_plan(lengths: Sequence[int], bucket: float, cp: int, dp_size: int) -> list[list[MicroBatch]]:
    """Sorted batching (LongAlign): the global batch sorted by length, then as :func:`baseline_plan`."""
    lens = _check_lengths(lengths, "sorted_plan")
    _check_bucket_cp(bucket, cp, "sorted_plan")
    _check_dp(dp_size, None, "sorted_plan")
    order = sorted(range(len(lens)), key=lambda k: (lens[k], k))
    return [[(mb, [-1] * len(mb)) for mb in _pack_in_order(part, lens, bucket * cp)] for part in _contiguous_split(order, dp_size)]


def dacp_only_plan(lengths: Sequence[int], bucket: float, cp: int, dp_size: int,
                   cost: SkrullCostModel | None = None) -> list[list[MicroBatch]]:
    """The baseline's DP split and micro-batches with DACP inside each (all-sharded where DACP cannot place)."""
    lens = _check_lengths(lengths, "dacp_only_plan")
    out = []
    for rank in baseline_plan(lens, bucket, cp, dp_size):
        mbs = []
        for idx, _ in rank:
            try:
                place = dacp_plan([lens[k] for k in idx], bucket, cp, cost)
            except SchedulingError:
                place = [-1] * len(idx)
            mbs.append((idx, place))
        out.append(mbs)
    return out


# -- simulation ----------------------------------------------------------------------------------------

def plan_tokens(lengths: Sequence[int], micro_batch: MicroBatch, cp: int) -> list[float]:
    """Tokens each CP rank holds for one micro-batch: whole sequences plus ``S / cp`` of every sharded one."""
    idx, place = micro_batch
    dist = sum(lengths[k] for k, p in zip(idx, place, strict=True) if p < 0) / cp
    return [dist + sum(lengths[k] for k, p in zip(idx, place, strict=True) if p == j) for j in range(cp)]


def micro_batch_time(lengths: Sequence[int], micro_batch: MicroBatch, cp: int, cost: SkrullCostModel,
                     overlap: bool = True) -> float:
    """``max_j [max(T_comm(dist), T_comp(local_j)) + T_comp(dist)]`` (``overlap=False``: comm + local + dist)."""
    idx, place = micro_batch
    dist = [lengths[k] for k, p in zip(idx, place, strict=True) if p < 0]
    t_dist = sum(cost.t_comp(s, cp) for s in dist)
    t_comm = sum(cost.t_comm(s, cp) for s in dist)
    times = []
    for j in range(cp):
        t_local = sum(cost.t_comp(lengths[k]) for k, p in zip(idx, place, strict=True) if p == j)
        times.append((max(t_comm, t_local) if overlap else t_comm + t_local) + t_dist)
    return max(times)


def simulate_iteration(lengths: Sequence[int], plan: Sequence[Sequence[MicroBatch]], cost: SkrullCostModel, cp: int,
                       overlap: bool = True) -> dict[str, Any]:
    """Iteration time (the slowest DP rank's sum over its micro-batches), per-rank times, the largest token count
    any CP rank holds in any micro-batch, and the micro-batch count."""
    lens = list(lengths)
    per_rank = [sum(micro_batch_time(lens, mb, cp, cost, overlap) for mb in rank) for rank in plan]
    max_tokens = max((max(plan_tokens(lens, mb, cp)) for rank in plan for mb in rank), default=0.0)
    return {"time": max(per_rank), "per_rank": per_rank, "max_tokens": max_tokens,
            "micro_batches": sum(len(rank) for rank in plan),
            "sharded": sum(p < 0 for rank in plan for _, place in rank for p in place)}


SCHEDULES = ("skrull", "dacp", "sorted", "baseline")


class SkrullPlanner:
    """A schedule for :class:`lowrank_lit.data.packed.SkrullBatchSampler`: ``planner(lengths, dp_size)`` -> every DP
    rank's micro-batches.

    Args:
        bucket: tokens one rank holds per micro-batch (BucketSize C). Default: 4096.
        cp: CP degree the plan assumes. Default: 1.
        schedule: ``skrull`` (GDS + DACP), ``dacp`` (arrival-order split and packing, DACP inside), ``sorted``
            (sorted batching) or ``baseline`` (arrival order, greedy packing, all sharded). Default: skrull.
        cost: the cost model (FLOPs balance). Default: ``SkrullCostModel()``.
    """

    def __init__(self, bucket: int = 4096, cp: int = 1, schedule: str = "skrull", cost: SkrullCostModel | None = None) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"SkrullPlanner: schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")
        _check_bucket_cp(bucket, cp, "SkrullPlanner")
        self.bucket, self.cp, self.schedule, self.cost = bucket, cp, schedule, cost or SkrullCostModel()
        self.max_length = int(bucket * cp)

    def __call__(self, lengths: list[int], dp_size: int) -> list[list[MicroBatch]]:
        if self.schedule == "skrull":
            return skrull_plan(lengths, self.bucket, self.cp, dp_size, self.cost)
        if self.schedule == "dacp":
            return dacp_only_plan(lengths, self.bucket, self.cp, dp_size, self.cost)
        fn = sorted_plan if self.schedule == "sorted" else baseline_plan
        return fn(lengths, self.bucket, self.cp, dp_size)


# -- training ---------------------------------------------------------------------------------------------

def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def micro_batch_loss(model: Any, seqs: Sequence[torch.Tensor], total_targets: int) -> torch.Tensor:
    """Summed next-token cross-entropy of whole sequences packed in one pass, divided by the global batch's
    target count (so that the micro-batches' losses add up to the global batch's mean token loss)."""
    from lowrank_lit.nn.context_parallel import packed_loss

    return packed_loss(model, seqs, [0] * len(seqs), 0, 1, total_targets)


@register_method("skrull", kind="LightningModule", paper=PAPER, summary="summary", bench="bench")
class SkrullSFTModule(Shardable, pl.LightningModule):
    """Causal LM fine-tuning over Skrull-scheduled micro-batches (manual optimisation, one step per global batch).

    Each training batch is this DP rank's share of one global batch (:class:`lowrank_lit.data.packed.SkrullBatchSampler`):
    micro-batches of whole sequences packed into one pass. The loss of every micro-batch is its summed token
    cross-entropy divided by the global batch's target count (known to every rank from the shared plan, the same
    number an all-reduce of the per-rank counts gives), times the DP world size because DDP averages gradients;
    all but the last micro-batch run under DDP's ``no_sync``; so the update equals one step on the whole global
    batch up to floating-point reassociation, whatever the schedule. Logged: ``train/loss`` (mean token loss of
    the global batch), ``train/micro_batches``, ``train/step_s`` (wall time of the step), ``train/tokens_per_s``
    (this rank's sequence tokens per second of step), ``train/pad_share`` (the share of the positions the model
    computes that are padding: 0 for a packed model; a model that pads says how much through
    ``computed_tokens(lengths)``), ``val/loss``.

    Args:
        model: the network (``lowrank_lit.nn.context_parallel.PackedCausalLM``).
        optimizer: optimizer factory. Default: AdamW lr 1e-3.
        grad_clip: gradient-norm clip (0: off). Default: 1.0.
    """

    #: FSDP2 gathers each sharded group's parameters at every forward, on every rank together, while Skrull's
    #: scheduler gives the ranks different numbers of micro-batches
    sharding_refusal: ClassVar[str | None] = ("its ranks run different numbers of micro-batches, while FSDP2 gathers "
                                              "parameters at every forward on every rank; use ddp")

    def __init__(self, model: nn.Module, optimizer: OptimizerCallable = _default_optimizer, grad_clip: float = 1.0) -> None:
        super().__init__()
        if grad_clip < 0:
            raise ValueError(f"SkrullSFTModule: grad_clip={grad_clip!r}; allowed: >= 0")
        self.save_hyperparameters(ignore=["model", "optimizer"], logger=False)
        self.model, self.optimizer_factory, self.grad_clip = model, optimizer, grad_clip
        self.automatic_optimization = False

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.model.parameters())

    def _no_sync(self, last: bool) -> Any:
        from contextlib import nullcontext

        wrapped = getattr(self.trainer.strategy, "model", None)
        if last or not hasattr(wrapped, "no_sync"):
            return nullcontext()
        return wrapped.no_sync()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        import time

        start = time.perf_counter()
        opt = self.optimizers()
        opt.zero_grad(set_to_none=True)
        world = self.trainer.world_size
        mbs = batch["micro_batches"]
        if not mbs:
            raise RuntimeError(f"SkrullSFTModule: DP rank {self.global_rank} got no sequences; use a global_batch_size >= the DP world size")
        total, real, computed = 0.0, 0, 0
        count = getattr(self.model, "computed_tokens", None)  # positions the model runs, padding included
        for i, seqs in enumerate(mbs):
            lens = [len(q) for q in seqs]
            real += sum(lens)
            computed += count(lens) if count is not None else sum(lens)
            with self._no_sync(i == len(mbs) - 1):
                loss = micro_batch_loss(self.model, seqs, batch["global_targets"])
                self.manual_backward(loss * world)
            total += float(loss.detach())
        if self.grad_clip:
            self.clip_gradients(opt, gradient_clip_val=self.grad_clip, gradient_clip_algorithm="norm")
        opt.step()
        loss = self.trainer.strategy.reduce(torch.tensor(total), reduce_op="sum")  # the ranks' shares add up
        self.log("train/loss", loss, prog_bar=True, batch_size=1)
        self.log("train/micro_batches", float(len(mbs)), batch_size=1)
        wall = time.perf_counter() - start
        self.log("train/step_s", wall, batch_size=1)  # wall time of the whole global-batch step
        self.log("train/tokens_per_s", real / wall, batch_size=1)  # this rank's sequence tokens (padding not counted)
        self.log("train/pad_share", 1.0 - real / max(computed, 1), batch_size=1)  # share of computed positions that are padding

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        total = sum(float(micro_batch_loss(self.model, seqs, batch["global_targets"])) for seqs in batch["micro_batches"])
        self.log("val/loss", self.trainer.strategy.reduce(torch.tensor(total), reduce_op="sum"), prog_bar=True, batch_size=1,
                 sync_dist=True)  # already summed over ranks: the mean over ranks of equal values changes nothing


def plot_plan(lengths: Sequence[int], plans: dict[str, Sequence[MicroBatch]], cost: SkrullCostModel, cp: int, out: str,
              overlap: dict[str, bool] | None = None) -> str:
    """Gantt chart of one DP rank's micro-batches under each named plan: per CP rank, local compute (solid),
    K/V communication of the sharded sequences (hatched, overlapping local compute when the plan overlaps) and
    the sharded sequences' compute (light); micro-batches one after the other."""

    lens = list(lengths)
    fig, axes = new_figure(nrows=len(plans), figsize=(9, 1.2 + 0.28 * cp * len(plans)), squeeze=False, sharex=True)
    for ax, (name, mbs) in zip(axes[:, 0], plans.items(), strict=True):
        ov = True if overlap is None else overlap.get(name, True)
        t0 = 0.0
        for mb in mbs:
            idx, place = mb
            dist = [lens[k] for k, p in zip(idx, place, strict=True) if p < 0]
            t_dist = sum(cost.t_comp(s, cp) for s in dist)
            t_comm = sum(cost.t_comm(s, cp) for s in dist)
            for j in range(cp):
                t_loc = sum(cost.t_comp(lens[k]) for k, p in zip(idx, place, strict=True) if p == j)
                ax.barh(j, t_loc, left=t0, color="tab:blue", height=0.8)
                ax.barh(j, t_comm, left=t0 if ov else t0 + t_loc, color="none", edgecolor="tab:orange", hatch="///", height=0.8)
                start = t0 + (max(t_comm, t_loc) if ov else t_comm + t_loc)
                ax.barh(j, t_dist, left=start, color="tab:cyan", height=0.8)
            t0 += micro_batch_time(lens, mb, cp, cost, ov)
            ax.axvline(t0, color="k", lw=0.6)
        ax.set_title(f"{name}: {t0:.3f} s", fontsize=9)
        ax.set_ylabel("CP rank")
        ax.set_yticks(range(cp))
    axes[-1, 0].set_xlabel("time (s)")
    fig.suptitle("Micro-batches of one DP rank under each schedule (one time axis)", fontsize=10)
    from matplotlib.patches import Patch

    axes[0, 0].legend(handles=[Patch(color="tab:blue", label="local sequences"), Patch(color="tab:cyan", label="sharded sequences"),
                               Patch(facecolor="none", edgecolor="tab:orange", hatch="///", label="K/V all-gather")],
                      fontsize=7, loc="upper right")
    return save_figure(fig, out)


def summary(roots: list[str], out: str | None = None) -> str:
    """Loss and step time per schedule and length mix of SkrullSFTModule runs.

    Markdown: per model, schedule and mix (mean over seeds), the final train and validation loss, micro-batches per
    step, the median step time and tokens per second (the first step excluded) and the padding share; ``out``: bars of the step time and the final
    validation loss per schedule and mix."""
    import statistics as st

    by: dict[tuple[str, str, str], list[tuple[float, ...]]] = {}
    for run in read_runs(roots, "metrics.csv"):
        cfg = run.config
        data = cfg["data"]["init_args"]
        net = (cfg.get("model") or {}).get("init_args", {}).get("model") or {}
        net_name = str(net.get("class_path", "-")).rsplit(".", 1)[-1] if isinstance(net, dict) else "-"
        key = (net_name, data["planner"]["init_args"].get("schedule", "skrull"), data.get("mix", "long_tail"))
        rows = run.rows("metrics.csv")
        train = [float(r["train/loss"]) for r in rows if r.get("train/loss")]
        val = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
        steps = [float(r["train/step_s"]) for r in rows if r.get("train/step_s")][1:]
        mbs = [float(r["train/micro_batches"]) for r in rows if r.get("train/micro_batches")]
        tps = [float(r["train/tokens_per_s"]) for r in rows if r.get("train/tokens_per_s")][1:]
        pad = [float(r["train/pad_share"]) for r in rows if r.get("train/pad_share")]
        if train and val and steps:
            by.setdefault(key, []).append((train[-1], val[-1], st.fmean(mbs), st.median(steps),
                                           st.median(tps) if tps else math.nan, st.fmean(pad) if pad else math.nan))
    cells = sorted(by.items(), key=lambda kv: (kv[0][2], kv[0][0], SCHEDULES.index(kv[0][1])))
    if not cells:
        raise FileNotFoundError(f"no Skrull run with train/loss, val/loss and train/step_s under {', '.join(roots)}")
    def _fmt(v: float, spec: str) -> str:
        return "-" if math.isnan(v) else format(v, spec)

    table = [[net, sch, mix, len(v), *(f"{st.fmean(x[i] for x in v):.3f}" for i in range(3)), f"{1e3 * st.fmean(x[3] for x in v):.0f}",
              _fmt(st.fmean(x[4] for x in v), ".0f"), _fmt(st.fmean(x[5] for x in v), ".3f")]
             for (net, sch, mix), v in cells]
    if out:
        fig, axes = new_figure(1, 2, figsize=(9, 3.4))
        labels = [f"{sch}\n{mix}" + (f"\n{net}" if net != "-" else "") for (net, sch, mix), _ in cells]
        for ax, i, scale, ylabel, title in ((axes[0], 3, 1e3, "median step (ms)", "Step time per schedule"),
                                            (axes[1], 1, 1.0, "final val/loss", "Validation loss per schedule")):
            ax.bar(range(len(cells)), [scale * st.fmean(x[i] for x in v) for _, v in cells],
                   color=["tab:red" if sch == "skrull" else "tab:gray" for (_, sch, _), _ in cells])
            ax.set_xticks(range(len(cells)), labels, fontsize=8)
            ax.set_ylabel(ylabel)
            ax.set_title(title, fontsize=9)
        save_figure(fig, out)
    return markdown_table(["model", "schedule", "mix", "runs", "final train/loss", "final val/loss", "micro-batches / step",
                           "step (ms)", "tokens/s", "padding share"], table)


def bench(ctx: Any) -> list[Any]:
    """Training-step time of the SFT module under the Skrull schedule against the baseline schedule (``lowrank bench skrull``)."""
    from lowrank_lit.bench import ConfigBench

    return [ConfigBench("skrull", "SFT step, Skrull schedule (long-tail mix)", "baseline schedule step",
                        "configs/skrull/sft_skrull.yaml", "configs/skrull/sft_baseline.yaml",
                        "paper: 3.76x faster on average (GPU, context parallel); here 1 CPU rank, < 1 expected")]
