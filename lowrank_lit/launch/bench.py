"""``lowrank bench``: run the registered cost benchmarks of the methods and print (or write) one table.

The benchmarks and their helpers live in :mod:`lowrank_lit.bench` and beside each method; this module resolves
them, runs the :class:`~lowrank_lit.bench.ConfigBench` comparisons (two configs built as ``lowrank fit`` /
``lowrank test`` builds them, timed per step by a callback) and writes docs/performance.md.
"""

from __future__ import annotations

import operator
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jsonargparse.typing import PositiveInt

from lowrank_lit.argtypes import Typed
from lowrank_lit.bench import BenchContext, BenchRow, ConfigBench, bench_table, mib, tensor_bytes
from lowrank_lit.registry import import_dotted

__all__ = ["get_bench", "run_benches", "run_config_bench", "main"]


def get_bench(slug: str) -> Callable[[BenchContext], list[BenchRow | ConfigBench]]:
    """The benchmark function the registration of ``slug`` names.

    Raises:
        KeyError: ``slug`` is not registered, or registers no benchmark (the message names the ones that do).
    """

    from lowrank_lit import registry

    methods = {m.slug: m for m in registry.scan_methods()}
    info = methods.get(slug)
    if info is None or info.bench is None:
        known = ", ".join(sorted(s for s, m in methods.items() if m.bench)) or "(none)"
        what = "is not a registered method" if info is None else "registers no benchmark"
        raise KeyError(f"{slug!r} {what}; methods with a benchmark: {known}")
    return import_dotted(info.bench)


def _build(config: str, overrides: Sequence[str], verb: str) -> tuple[Any, Any, list[Any]]:
    """The model, data module and method callbacks of ``lowrank <verb> --config config overrides`` (random weights
    where a pretrained checkpoint is missing: the cost does not depend on them)."""
    from lowrank_lit.launch.build import build_from_config

    built = build_from_config(config, overrides, verb, quiet=True)
    return built.model, built.data, built.callbacks


def run_config_bench(ctx: BenchContext, spec: ConfigBench) -> BenchRow:
    """Time ``spec``'s two configs in interleaved rounds; the row's ratio is the median of the per-round ratios."""
    import logging

    import lightning.pytorch as pl

    from lowrank_lit.callbacks.cost import StepCost

    for name in ("lightning.pytorch", "lightning.fabric"):  # no "GPU available" lines per round
        logging.getLogger(name).setLevel(logging.WARNING)
    steps = spec.quick_steps if ctx.quick else spec.steps
    rounds = ctx.rounds(spec.rounds)
    built = {"method": _build(spec.config, (*spec.overrides, *spec.method_overrides), spec.verb),
             "baseline": _build(spec.baseline_config, spec.overrides, spec.verb)}
    per_round: dict[str, list[float]] = {"method": [], "baseline": []}
    memory: dict[str, int] = {"method": 0, "baseline": 0}
    cuda = ctx.device.startswith("cuda")
    phases: dict[str, list[float]] = {}
    owner, _, attr = (spec.phases or "").rpartition(".")
    recorder = operator.attrgetter(owner)(built["method"][0]) if spec.phases and owner else built["method"][0]
    for _ in range(rounds):
        for name, (model, data, callbacks) in built.items():
            if spec.phases and name == "method":
                setattr(recorder, attr, {})
            timer = StepCost(skip=0, stage="train" if spec.verb == "fit" else "test")
            limit = {"max_steps": steps, "limit_val_batches": 0, "num_sanity_val_steps": 0} if spec.verb == "fit" \
                else {"limit_test_batches": steps}
            trainer = pl.Trainer(accelerator="gpu" if ctx.device.startswith("cuda") else "cpu", devices=1, logger=False,
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 inference_mode=False, callbacks=[*callbacks, timer], **limit)
            if cuda:
                import torch

                torch.cuda.reset_peak_memory_stats()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                (trainer.fit if spec.verb == "fit" else trainer.test)(model, datamodule=data, **({"verbose": False} if spec.verb == "test" else {}))
            if cuda:  # the peak of the round: weights, activations, optimizer state
                memory[name] = max(memory[name], int(torch.cuda.max_memory_allocated()))
            else:  # the tensors the run holds: weights, buffers and optimizer state
                memory[name] = tensor_bytes(model, trainer.optimizers)
            times = timer.times[1:] or timer.times  # the first batch pays one-off costs, unless it is the only one
            if not times:
                raise RuntimeError(f"lowrank bench: {spec.config if name == 'method' else spec.baseline_config} ran no "
                                   f"{'training step' if spec.verb == 'fit' else 'test batch'}; check its data and limits")
            per_round[name].append(statistics.median(times))
            if spec.phases and name == "method":
                for phase, seconds in getattr(recorder, attr).items():
                    phases.setdefault(phase, []).extend(seconds[1:] or seconds)  # as the timer: the first batch left out
                setattr(recorder, attr, None)
    ratios = [a / b for a, b in zip(per_round["method"], per_round["baseline"], strict=True)]
    unit = "step" if spec.verb == "fit" else "test batch"
    note = (f"{1e3 * statistics.median(per_round['method']):.1f} vs {1e3 * statistics.median(per_round['baseline']):.1f} "
            f"ms per {unit}; {spec.config}{' ' + ' '.join(spec.method_overrides) if spec.method_overrides else ''} "
            f"vs {spec.baseline_config}")
    if phases:
        note += "; per batch: " + ", ".join(f"{p} {1e3 * statistics.median(s):.1f} ms" for p, s in phases.items())
    held = f"{'peak' if cuda else 'held'} {mib(memory['method'])} vs {mib(memory['baseline'])}"
    return BenchRow(spec.method, spec.compared, spec.baseline, statistics.median(ratios), (min(ratios), max(ratios)),
                    spec.claim, spec.target, memory=held, note=note, device=ctx.device)


def run_benches(slugs: Iterable[str], ctx: BenchContext, progress: Callable[[str], None] | None = None) -> list[BenchRow]:
    """Run the benchmarks of ``slugs`` in order; every row they return (:class:`ConfigBench` entries executed)."""
    rows: list[BenchRow] = []
    for slug in slugs:
        start = time.perf_counter()
        got = [run_config_bench(ctx, r) if isinstance(r, ConfigBench) else r for r in get_bench(slug)(ctx)]
        rows += got
        if progress:
            progress(f"{slug}: {len(got)} row(s) in {time.perf_counter() - start:.0f} s")
    return rows


def _machine(device: str) -> str:
    import os
    import platform

    import torch

    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.get_num_threads()} threads " \
           f"(torch {torch.__version__})"


def main(*slugs: str, quick: bool = False, device: str = "cpu", repeats: PositiveInt | None = None,
         out: str | None = None, given: Typed = ()) -> int:
    """Every method's cost as a ratio against its baseline, measured in the same process (one table).

    Args:
        slugs: methods to run (default: every method with a benchmark)
        quick: small sizes and few rounds: a smoke run (minutes)
        device: cpu or cuda (CUDA synchronised around every timed region)
        repeats: timed rounds per comparison (default: each benchmark's)
        out: also write the table as a markdown page (e.g. docs/performance.md)
        given: the words after ``lowrank bench`` (the page's command line)
    """
    import shlex
    from pathlib import Path

    from lowrank_lit import registry

    with_bench = sorted(m.slug for m in registry.scan_methods() if m.bench)
    unknown = [s for s in slugs if s not in with_bench]
    error = None
    if unknown:
        error = f"SLUG: {unknown[0]!r} has no benchmark; choose from {', '.join(with_bench)}"
    elif device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        error = f"--device: {device!r} is not one of cpu, cuda"
    elif device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            error = f"--device: {device!r} asked for, but torch sees no CUDA device on this machine"
    if error:
        print(f"lowrank bench: error: {error}", file=sys.stderr)
        return 2
    ctx = BenchContext(device, quick, repeats)
    start = time.perf_counter()
    rows = run_benches(list(slugs) or with_bench, ctx, progress=lambda line: print(line, file=sys.stderr, flush=True))
    table = bench_table(rows)
    print(table)
    if out:
        command = shlex.join(["lowrank", "bench", *given])
        head = _PAGE_HEAD.format(command=command, machine=_machine(device),
                                 minutes=(time.perf_counter() - start) / 60, quick=" (quick mode: indicative only)" if quick else "")
        Path(out).write_text(head + table + "\n" + _PAGE_TAIL)
        print(out, file=sys.stderr)
    return 0


_PAGE_HEAD = """# Performance: every method against its baseline

Each row times a method and its baseline in the same process, on the same inputs, in interleaved rounds (so machine
noise hits both alike); the ratio is the median of the per-round ratios, with their min and max. A row is met when
the ratio is at most the target named beside it (the paper's claim where it makes one, else ours). On a GPU the
timed regions are CUDA-synchronised and the memory column is the peak `torch.cuda.max_memory_allocated`; on the CPU
it is the bytes of the tensors a run holds (weights, buffers, optimizer state; for the hand-written rows the
optimizer state, adapters or caches named in the row).

```bash
{command}
```

Machine: {machine}; {minutes:.1f} min{quick}.

"""

_PAGE_TAIL = """
A row that is not met is explained, with measurements, on its method's page (`docs/methods/<slug>.md`).
`lowrank bench SLUG` runs one method's rows; `--quick` is the smoke run that CI makes (no timing asserted);
`--device cuda` runs the same benchmarks on a GPU. Rows against a peer library that is not a dependency (galore-torch's
GaLoreAdamW) appear when the benchmark extra is installed: `pip install -e ".[bench]"`.
"""
