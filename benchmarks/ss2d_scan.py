"""Selective scan of the pure-torch VMamba: step-by-step loop vs mambapy's parallel scan.

    python benchmarks/ss2d_scan.py [--lengths 16 64 256] [--batch 64] [--dim 32] [--state 4]

Forward + backward time of one scan ``(batch, L, dim)`` with state size N, fastest of ``--repeats`` runs, and
the ratio loop / parallel at each length (the parallel path is the default of ``SS2D``), plus the largest
difference between the two outputs.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.models.vmamba import selective_scan


def timed(parallel: bool, args: tuple[torch.Tensor, ...], repeats: int) -> tuple[float, torch.Tensor]:
    best = float("inf")
    out = None
    for _ in range(repeats):
        inputs = [a.detach().requires_grad_(a.is_floating_point()) for a in args]
        start = time.perf_counter()
        out = selective_scan(*inputs, parallel=parallel)
        out.sum().backward()
        best = min(best, time.perf_counter() - start)
    return best, out.detach()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--state", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    print("| L | loop (ms) | parallel (ms) | loop / parallel | max difference |")
    print("|---|---|---|---|---|")
    for L in args.lengths:
        g = torch.Generator().manual_seed(0)
        b, d, n = args.batch, args.dim, args.state
        inputs = (torch.randn(b, L, d, generator=g), F.softplus(torch.randn(b, L, d, generator=g)),
                  -torch.exp(torch.randn(d, n, generator=g)), torch.randn(b, L, n, generator=g),
                  torch.randn(b, L, n, generator=g), torch.randn(d, generator=g))
        t_loop, y_loop = timed(False, inputs, args.repeats)
        t_par, y_par = timed(True, inputs, args.repeats)
        print(f"| {L} | {1e3 * t_loop:.2f} | {1e3 * t_par:.2f} | {t_loop / t_par:.2f} | {(y_loop - y_par).abs().max():.1e} |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
