"""Rendering speed of the procedural head renderer (lowrank_lit.data.heads), per domain.

    python benchmarks/heads_render.py [--n 512] [--size 64] [--repeats 3]

Time to draw parameters and ray-cast ``--n`` heads at ``--size`` pixels in one batch (fastest of ``--repeats``),
and images per second.
"""

from __future__ import annotations

import argparse
import time

import torch
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.data.heads import DOMAINS, render_heads, sample_params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    print(f"| domain | {args.n} images (s) | images / s |")
    print("|---|---|---|")
    for name in DOMAINS:
        best = float("inf")
        for r in range(args.repeats):
            start = time.perf_counter()
            render_heads(sample_params(args.n, name, torch.Generator().manual_seed(r)), args.size)
            best = min(best, time.perf_counter() - start)
        print(f"| {name} | {best:.2f} | {args.n / best:.0f} |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
