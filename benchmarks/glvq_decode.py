"""Decode throughput of GLVQLinear vs dequantizing RTN, and forward latency of a quantized layer vs nn.Linear.

    python benchmarks/glvq_decode.py [--out 1024] [--in 1024] [--group-size 128] [--dim 8] [--bits 2]

Decode = rebuilding the dense (out, in) weight from codes: GLVQ computes s * G z for every d-vector
(a d x d matrix-vector product per vector, CPU reference path, float64); RTN computes lo + step * q. The
forward latency of GLVQLinear uses its cached decoded weight (decode once, then a dense matmul), so it
matches nn.Linear; the uncached row shows decode-on-every-call. Medians of --repeats runs, as ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from lowrank_lit.methods.glvq import quantize_linear, rtn_quantize


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=int, default=1024)
    parser.add_argument("--in", dest="inp", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    lin = nn.Linear(args.inp, args.out)
    X = torch.randn(256, args.inp)
    q, _ = quantize_linear(lin, X, args.bits, args.group_size, args.dim, "glvq", steps=5)
    W = lin.weight.detach()
    n = W.numel()

    def glvq_decode() -> None:
        q._cache = None
        q.weight_hat()

    t_glvq = _median_time(glvq_decode, args.repeats)
    t_rtn = _median_time(lambda: rtn_quantize(W, args.bits, args.group_size), args.repeats)
    x = torch.randn(args.batch, args.inp)
    q.weight_hat()
    t_dense = _median_time(lambda: lin(x), args.repeats * 5)
    t_cached = _median_time(lambda: q(x), args.repeats * 5)

    def uncached() -> None:
        q._cache = None
        q(x)

    t_uncached = _median_time(uncached, args.repeats)
    print(f"layer {args.out}x{args.inp}, group {args.group_size}, d={args.dim}, {args.bits} bits")
    print(f"decode: GLVQ {n / t_glvq / 1e6:.1f} M weights/s, RTN quantize+dequantize {n / t_rtn / 1e6:.1f} M weights/s "
          f"(GLVQ / RTN time {t_glvq / t_rtn:.2f}x)")
    print(f"forward, batch {args.batch}: nn.Linear {t_dense * 1e6:.0f} us, GLVQLinear cached {t_cached * 1e6:.0f} us "
          f"({t_cached / t_dense:.2f}x), decode every call {t_uncached * 1e3:.1f} ms ({t_uncached / t_dense:.0f}x)")


if __name__ == "__main__":
    main()
