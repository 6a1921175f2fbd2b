"""Decode throughput of GLVQLinear vs dequantizing RTN, and forward latency of a quantized layer vs nn.Linear.

    python benchmarks/glvq_decode.py [--out 1024] [--in 1024] [--group-size 128] [--dim 8] [--bits 2]

    python benchmarks/glvq_decode.py --out 4096 --in 4096 --repeats 5

Decode = rebuilding the dense (out, in) weight from codes. GLVQ computes s F_mu^-1(G z) for every
d-vector: `GLVQLinear.weight_hat` does it for all groups with one batched float32 matmul
(`decode_groups`); the float64 per-group reference (`weight_hat_reference`) is shown too. RTN
dequantize is lo + step * q from stored integer codes; its quantize + dequantize round trip (the
reference of earlier versions of this benchmark) is shown as well. Target: the float32 batched decode
<= 2x RTN's time. The forward latency of
GLVQLinear uses its cached decoded weight (decode once, then a dense matmul), so it matches
nn.Linear; the uncached row shows decode-on-every-call. Medians of --repeats runs, as ratios.
"""

from __future__ import annotations

import argparse

import torch
from timing import median_time, recorded
from torch import nn

from lowrank_lit.methods.glvq import quantize_linear, rtn_quantize


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

    t_glvq = median_time(glvq_decode, args.repeats)
    t_ref = median_time(q.weight_hat_reference, max(1, args.repeats // 4))
    torch.testing.assert_close(q.weight_hat().double(), q.weight_hat_reference(), rtol=1e-5, atol=1e-6)
    # RTN's stored form: uint8 codes per weight, lo and step per (row, group); dequantize = lo + step * q
    m, k = W.shape
    Wg = W.reshape(m, k // args.group_size, args.group_size)
    lo, hi = Wg.amin(dim=2, keepdim=True), Wg.amax(dim=2, keepdim=True)
    step = (hi - lo).clamp_min(1e-12) / (2**args.bits - 1)
    codes = torch.round((Wg - lo) / step).clamp(0, 2**args.bits - 1).to(torch.uint8)
    t_deq = median_time(lambda: (codes.to(torch.float32) * step + lo).reshape(m, k), args.repeats)
    t_rtn = median_time(lambda: rtn_quantize(W, args.bits, args.group_size), args.repeats)
    x = torch.randn(args.batch, args.inp)
    q.weight_hat()
    t_dense = median_time(lambda: lin(x), args.repeats * 5)
    t_cached = median_time(lambda: q(x), args.repeats * 5)

    def uncached() -> None:
        q._cache = None
        q(x)

    t_uncached = median_time(uncached, args.repeats)
    print(f"layer {args.out}x{args.inp}, group {args.group_size}, d={args.dim}, {args.bits} bits")
    print("| decode path | time | M weights/s | / RTN quantize + dequantize | / RTN dequantize |")
    print("|---|---|---|---|---|")
    for name, t in (("GLVQ, batched float32 (`GLVQLinear.weight_hat`)", t_glvq), ("GLVQ, float64 per-group reference", t_ref),
                    ("RTN dequantize (lo + step * q)", t_deq), ("RTN quantize + dequantize", t_rtn)):
        print(f"| {name} | {t * 1e3:.2f} ms | {n / t / 1e6:.0f} | {t / t_rtn:.2f}x | {t / t_deq:.2f}x |")
    print(f"forward, batch {args.batch}: nn.Linear {t_dense * 1e6:.0f} us, GLVQLinear cached {t_cached * 1e6:.0f} us "
          f"({t_cached / t_dense:.2f}x), decode every call {t_uncached * 1e3:.1f} ms ({t_uncached / t_dense:.0f}x)")

if __name__ == "__main__":
    with recorded(__file__):
        main()
