"""Cost benchmarks: every method's cost as a ratio against its baseline, measured in the same process.

Each method registers a benchmark beside itself, as it registers its summary
(``@register_method(..., bench="bench")``): a function ``bench(ctx: BenchContext) -> list[BenchRow | ConfigBench]``
that times the method and its baseline on the same inputs, interleaved so that machine noise hits both alike,
and returns one row per comparison (a :class:`ConfigBench` names two configs whose step times the runner
compares). ``lowrank bench [SLUG ...] [--quick] [--device cuda] [--out FILE]``
(:mod:`lowrank_lit.launch.bench`) runs them and prints one table; ``--out docs/performance.md`` writes the page.

Timing: :meth:`BenchContext.compare` calls the timed functions round-robin (``repeats`` rounds after
``warmup`` untimed ones), synchronising CUDA before and after every timed region; a row's ratio is the median
of the per-round ratios and its spread their min and max. Memory: on CUDA, the peak of
``torch.cuda.max_memory_allocated`` over a config's round (reset before each round); on the CPU the bytes of the
tensors a method holds (:func:`tensor_bytes`: optimizer state, adapters, caches), which is what differs between
the methods.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BenchContext", "BenchRow", "ConfigBench", "ratio_row", "tensor_bytes", "mib", "bench_table"]


@dataclass
class BenchRow:
    """One comparison of a method against its baseline.

    Attributes:
        method: the method's slug.
        compared: what is timed (``"Q3R + Adam training step"``).
        baseline: what it is divided by (``"AdamW step"``).
        ratio: median over the rounds of method time / baseline time (a memory ratio when ``unit="memory"``).
        spread: (min, max) of the per-round ratios.
        claim: the paper's claim or our target, in words.
        target: the ratio is met when ``ratio <= target`` (None: reported only).
        memory: memory of the method and the baseline, in words (``"-"`` when not measured).
        note: a short remark (sizes, what differs).
        device: where it ran.
        unit: ``"time"`` or ``"memory"`` (or ``"iterations"``): what the ratio is of.
    """

    method: str
    compared: str
    baseline: str
    ratio: float
    spread: tuple[float, float]
    claim: str
    target: float | None = None
    memory: str = "-"
    note: str = ""
    device: str = "cpu"
    unit: str = "time"

    @property
    def met(self) -> str:
        """``yes`` / ``no`` against :attr:`target`, ``-`` when there is none."""
        if self.target is None:
            return "-"
        return "yes" if self.ratio <= self.target else "no"


@dataclass
class BenchContext:
    """Where and how long a benchmark runs.

    Attributes:
        device: ``"cpu"`` or ``"cuda"``.
        quick: a short run (smaller sizes, fewer rounds) for a smoke check; ratios are indicative only.
        repeats: timed rounds (None: each benchmark's own default, fewer in quick mode).
    """

    device: str = "cpu"
    quick: bool = False
    repeats: int | None = None

    def rounds(self, full: int, quick: int = 3) -> int:
        """The number of timed rounds: ``repeats`` if given, else ``quick`` in quick mode, else ``full``."""
        return self.repeats or (quick if self.quick else full)

    def size(self, full: Any, quick: Any) -> Any:
        """``quick`` in quick mode, else ``full`` (a problem size, a step count)."""
        return quick if self.quick else full

    def sync(self) -> None:
        """Wait for queued CUDA work (a no-op on the CPU)."""
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def compare(self, fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 1) -> dict[str, list[float]]:
        """Seconds per call of every function, round-robin: ``warmup`` untimed rounds, then ``repeats`` timed ones.

        Returns:
            name -> list of ``repeats`` wall times (CUDA synchronised around each timed call).
        """
        times: dict[str, list[float]] = {name: [] for name in fns}
        for i in range(warmup + repeats):
            for name, fn in fns.items():
                self.sync()
                start = time.perf_counter()
                fn()
                self.sync()
                if i >= warmup:
                    times[name].append(time.perf_counter() - start)
        return times


def tensor_bytes(*objects: Any) -> int:
    """Bytes of every distinct tensor reachable in ``objects`` (modules, optimizers, dicts, lists, tensors)."""
    import torch

    seen: set[int] = set()
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if id(obj) not in seen:
                seen.add(id(obj))
                total += obj.numel() * obj.element_size()
        elif isinstance(obj, torch.nn.Module):
            for t in (*obj.parameters(), *obj.buffers()):
                visit(t)
        elif isinstance(obj, torch.optim.Optimizer):
            visit(list(obj.state.values()))
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, list | tuple | set):
            for v in obj:
                visit(v)

    for obj in objects:
        visit(obj)
    return total


def mib(n: int | None) -> str:
    """``"1.23 MiB"`` (``"-"`` for None)."""
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def ratio_row(ctx: BenchContext, method: str, compared: str, baseline: str, times: dict[str, list[float]], mine: str,
              base: str, claim: str, target: float | None = None, memory: str = "-", note: str = "") -> BenchRow:
    """A :class:`BenchRow` of ``times[mine] / times[base]`` per round (median, min, max), with the absolute
    medians in the note."""
    ratios = [a / b for a, b in zip(times[mine], times[base], strict=True)]
    note = (f"{1e3 * statistics.median(times[mine]):.2f} vs {1e3 * statistics.median(times[base]):.2f} ms"
            + (f"; {note}" if note else ""))
    return BenchRow(method, compared, baseline, statistics.median(ratios), (min(ratios), max(ratios)), claim, target,
                    memory, note, ctx.device)


@dataclass(frozen=True)
class ConfigBench:
    """A comparison of two configs by their step time, run by ``lowrank bench`` (:mod:`lowrank_lit.launch.bench`):
    each config's model, data and method callbacks are built as ``lowrank <verb>`` builds them, and every round
    runs ``steps`` training steps (``verb="fit"``) or test batches (``verb="test"``) of each, timed per step by a
    callback (CUDA synchronised); a round's time is its median step, the first step of the round left out.

    Attributes:
        method: the method's slug.
        compared: what is timed, in words.
        baseline: the baseline, in words.
        config: the method's config (a path relative to the project root).
        baseline_config: the baseline's config.
        overrides: dotted overrides given to both (``--model.init_args.source_ckpt=null``).
        method_overrides: dotted overrides given to the method's config only (two modes of one config).
        verb: ``fit`` (training steps) or ``test`` (test batches: TTA methods adapt there).
        steps: steps per round (``quick_steps`` in quick mode).
        claim: the paper's claim or our target, in words.
        target: the row is met when the ratio is at most this.
        rounds: timed rounds (3 in quick mode).
        phases: the dotted attribute of the method's module that records its phases when set to ``{}``
            (``phase -> [seconds per batch]``, e.g. ReservoirTTA's ``method.phase_seconds``); the row's note then gives
            the median milliseconds of each phase per batch. None: no breakdown.
    """

    method: str
    compared: str
    baseline: str
    config: str
    baseline_config: str
    claim: str
    target: float | None = None
    overrides: tuple[str, ...] = ()
    method_overrides: tuple[str, ...] = ()
    verb: str = "fit"
    steps: int = 12
    quick_steps: int = 4
    rounds: int = 5
    phases: str | None = None


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 100 else f"{x:.0f}"


def bench_table(rows: Sequence[BenchRow]) -> str:
    """The markdown table of ``rows``: method, what is compared, ratio (median, min-max), claim, met, memory, device."""
    from lowrank_lit.report import markdown_table

    return markdown_table(
        ["method", "compared", "baseline", "ratio (median)", "min - max", "paper's claim / our target", "met", "memory",
         "device", "note"],
        [[r.method, r.compared, r.baseline, f"{_fmt(r.ratio)}x" + ("" if r.unit == "time" else f" ({r.unit})"),
          f"{_fmt(r.spread[0])} - {_fmt(r.spread[1])}", r.claim, r.met, r.memory, r.device, r.note] for r in rows])


