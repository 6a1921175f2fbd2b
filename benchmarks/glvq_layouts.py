"""Ways to put GLVQ's decoded d-vectors into the ``(out, in)`` weight layout, against RTN's dequantize.

    python benchmarks/glvq_layouts.py [--out 1024] [--in 1024] [--repeats 30] [--threads 1]

A 2-bit layer, groups of 128 columns, d = 8, random int8 codes and generation matrices (the cost does not depend on
the values). Every variant's weight equals ``decode_groups``'s; the table gives the best of ``--repeats`` calls in
ms (the machine's noise hits medians more than minima), with the pieces of today's decode timed alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from timing import recorded, wall_times  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.nn.glvq import decode_groups


def best(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` calls after one warm-up, in ms."""
    return 1e3 * min(wall_times(fn, repeats, warmup=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=int, default=1024)
    parser.add_argument("--in", dest="inp", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gs, d, out = 128, 8, args.out
    g = args.inp // gs
    L = out * gs // d
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-2, 2, (g, d, L), generator=gen).to(torch.int8)  # (groups, d, L)
    G = torch.randn(g, d, d, generator=gen)
    ones = torch.ones(g)
    rtn_codes = torch.randint(0, 4, (out, g, gs), generator=gen).to(torch.uint8)
    step, lo = torch.rand(out, g, 1, generator=gen), torch.rand(out, g, 1, generator=gen)
    ref = decode_groups(G, codes, torch.zeros(g), ones, out, gs)

    Z = codes.to(torch.float32)
    V = torch.bmm(G, Z)
    Zt = codes.transpose(1, 2).contiguous().to(torch.float32)  # (groups, L, d)

    def transposed() -> torch.Tensor:  # W^T (in, out): per column block j, G @ (d x out) codes
        Zp = codes.view(g, d, out, gs // d).permute(0, 3, 1, 2).contiguous().to(torch.float32)  # (g, gs/d, d, out)
        return torch.matmul(G.unsqueeze(1), Zp).view(g * gs, out).t()

    def tall() -> torch.Tensor:  # (L x d) @ (d x d) per group: d-vectors land contiguous
        return torch.bmm(Zt, G.transpose(1, 2)).view(g, out, gs).permute(1, 0, 2).reshape(out, g * gs)

    table = torch.randn(2 * g * 256, d, generator=gen)  # G z for 4 coordinates, 256 entries per group and half
    idx = torch.randint(0, 2 * g * 256, (g * L,), generator=gen)
    assert torch.allclose(transposed(), ref, atol=1e-5) and torch.allclose(tall(), ref, atol=1e-5)
    rows = [
        ("RTN dequantize from uint8 codes (lo + step q)", best(lambda: rtn_codes.to(torch.float32) * step + lo, args.repeats)),
        ("today's decode_groups", best(lambda: decode_groups(G, codes, torch.zeros(g), ones, out, gs), args.repeats)),
        ("  its int8 -> float32", best(lambda: codes.to(torch.float32), args.repeats)),
        ("  its matmul G (d x d) @ Z (d x L) per group", best(lambda: torch.bmm(G, Z), args.repeats)),
        ("  its strided copy into (out, in)",
         best(lambda: V.view(g, d, out, gs // d).permute(2, 0, 3, 1).reshape(out, g * gs), args.repeats)),
        ("the tall matmul Z^T (L x d) @ G^T, then a copy of 128-column blocks", best(tall, args.repeats)),
        ("  its matmul alone", best(lambda: torch.bmm(Zt, G.transpose(1, 2)), args.repeats)),
        ("the transposed weight (in, out): int8 permutation, G @ codes per column block", best(transposed, args.repeats)),
        ("a half-vector lookup: two gathers of the whole weight and their sum",
         best(lambda: table.index_select(0, idx) + table.index_select(0, idx), args.repeats)),
    ]
    base = rows[0][1]
    print(f"{out} x {args.inp}, groups of {gs}, d = {d}, 2 bits, torch threads {torch.get_num_threads()}, "
          f"best of {args.repeats}")
    print("| decode variant | ms | / RTN |")
    print("|---|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} | {ms / base:.2f} |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
