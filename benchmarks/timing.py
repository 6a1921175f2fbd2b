"""Timing helper shared by the benchmark scripts (run as ``python benchmarks/<name>.py``)."""

from __future__ import annotations

import contextlib
import io
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: the folder of the benchmark run in progress (set by :func:`recorded`)
CURRENT: list[Path] = []


def output_path(name: str) -> Path:
    """A file ``name`` in the folder of the benchmark run in progress (``runs/benchmarks/<script>/<stamp>/``)."""
    if not CURRENT:
        raise RuntimeError("output_path: no benchmark run in progress (run the script: `with recorded(__file__)`)")
    return CURRENT[-1] / name


def wall_times(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> list[float]:
    """Wall times (s) of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def median_time(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> float:
    """Median wall time (s) of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    return statistics.median(wall_times(fn, repeats, warmup))



@contextlib.contextmanager
def recorded(script: str, root: str | None = None) -> Iterator[Path]:
    """Run a benchmark with its output kept: ``<root>/benchmarks/<script name>/<time stamp>/`` gets ``output.md``
    (everything the script prints) and ``command.txt``; ``root`` defaults to ``$LOWRANK_RUN_ROOT`` or ``runs``.
    Benchmarks never write into ``docs/`` unless asked to (``--write-docs`` where a script draws a page's figure).

        if __name__ == "__main__":
            with recorded(__file__):
                main()
    """
    name = Path(script).stem
    folder = Path(root or os.environ.get("LOWRANK_RUN_ROOT", "runs")) / "benchmarks" / name / time.strftime("%Y%m%d-%H%M%S")
    while folder.exists():  # two runs in the same second: never overwrite
        folder = folder.with_name(folder.name + "b")
    folder.mkdir(parents=True)
    (folder / "command.txt").write_text(shlex.join(["python", script, *sys.argv[1:]]) + "\n")

    class _Tee(io.TextIOBase):
        def __init__(self, *streams: Any) -> None:
            self.streams = streams

        def write(self, text: str) -> int:
            for s in self.streams:
                s.write(text)
            return len(text)

        def flush(self) -> None:
            for s in self.streams:
                s.flush()

    CURRENT.append(folder)
    try:
        with open(folder / "output.md", "w") as log, contextlib.redirect_stdout(_Tee(sys.stdout, log)):
            yield folder
    finally:
        CURRENT.pop()
    print(f"output kept in {folder}", file=sys.stderr)
