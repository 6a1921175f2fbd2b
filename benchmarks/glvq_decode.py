"""Decode throughput of GLVQLinear vs dequantizing RTN, forward latency of a quantized layer vs nn.Linear, and the
compact mode (decode on the fly, no dense weight kept) against the cached one.

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

Serving table (``--serve-bits``, default 2 and 3): the cached layer (dense float32 weight decoded once) against
``GLVQLinear(compact=True)`` (bit-packed codes; every forward pass unpacks and decodes ``tile_groups`` column
groups at a time) on ``--tokens`` rows of input, with the bytes each holds (weights, codes, generators, cache)
as a share of the fp32 weight. RTN's on-the-fly counterpart (dequantize uint8 codes, then the matmul) is the
reference. Codes of the other bit widths are random (time and memory do not depend on their values).
Targets: compact forward <= 3x cached, memory <= 0.12x fp32 at 2 bits.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from timing import median_time, recorded
from torch import nn

from lowrank_lit.bench import tensor_bytes
from lowrank_lit.nn.glvq import GLVQLinear, quantize_linear, rtn_quantize


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=int, default=1024)
    parser.add_argument("--in", dest="inp", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--dim", type=int, default=8)
    parser.add_argument("--bits", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--serve-bits", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 2048])
    parser.add_argument("--tile-groups", type=int, default=4)
    parser.add_argument("--serve-only", action="store_true",
                        help="only the serving table (random codes: a GLVQ calibration of a 4096 x 4096 layer is slow)")
    args = parser.parse_args()
    torch.manual_seed(0)
    lin = nn.Linear(args.inp, args.out)
    if args.serve_only:
        q = GLVQLinear(args.inp, args.out, args.group_size, args.dim)
        q.set_codes(torch.zeros_like(q.codes), args.bits)  # replaced per bit width below
        with torch.no_grad():
            q.G.copy_(torch.linalg.qr(torch.randn(q.G.shape[0], args.dim, args.dim))[0] * 0.01)
            q.bias.copy_(lin.bias)
        serve(args, q, lin)
        return
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
    serve(args, q, lin)


def rtn_forward(x: torch.Tensor, codes: torch.Tensor, step: torch.Tensor, lo: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """RTN served on the fly: dequantize uint8 codes ``(out, groups, group_size)`` (lo + step * q), then the matmul."""
    W = (codes.to(torch.float32) * step + lo).reshape(codes.shape[0], -1)  # (out, in)
    return torch.nn.functional.linear(x, W, bias)


def serve(args: argparse.Namespace, q: GLVQLinear, lin: nn.Linear) -> None:
    """Cached vs compact forward and the bytes each holds, per bit width and input size."""
    fp32 = lin.weight.numel() * 4
    print(f"\nserving, layer {args.out}x{args.inp}, groups of {args.group_size}, d = {args.dim}, "
          f"compact tiles of {args.tile_groups} groups; fp32 weight {fp32 / 2**20:.2f} MiB")
    print("| bits | tokens | cached | compact | compact / cached | RTN dequantize + matmul / cached "
          "| cached holds | compact holds |")
    print("|---|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(1)
    for bits in args.serve_bits:
        cached = GLVQLinear(args.inp, args.out, args.group_size, args.dim)
        cached.load_state_dict(q.state_dict())
        if bits != args.bits or args.serve_only:
            cached.set_codes(torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), cached.codes.shape, generator=g)
                             .to(torch.int8), bits)
        compact = GLVQLinear(args.inp, args.out, args.group_size, args.dim, compact=True, tile_groups=args.tile_groups)
        compact.load_state_dict(cached.state_dict())
        Wg = lin.weight.detach().reshape(args.out, args.inp // args.group_size, args.group_size)
        lo, hi = Wg.amin(dim=2, keepdim=True), Wg.amax(dim=2, keepdim=True)
        step = (hi - lo).clamp_min(1e-12) / (2**bits - 1)
        rtn = torch.round((Wg - lo) / step).clamp(0, 2**bits - 1).to(torch.uint8)
        for tokens in args.tokens:
            x = torch.randn(tokens, args.inp)
            with torch.no_grad():
                torch.testing.assert_close(compact(x), cached(x), rtol=1e-5, atol=1e-4)
                t_cached = median_time(partial(cached, x), args.repeats, warmup=1)
                t_compact = median_time(partial(compact, x), args.repeats, warmup=1)
                t_rtn = median_time(partial(rtn_forward, x, rtn, step, lo, lin.bias), args.repeats, warmup=1)
            held_c, held_k = tensor_bytes(cached, cached._cache), tensor_bytes(compact)
            print(f"| {bits} | {tokens} | {t_cached * 1e3:.2f} ms | {t_compact * 1e3:.2f} ms | **{t_compact / t_cached:.2f}x** "
                  f"| {t_rtn / t_cached:.2f}x | {held_c / 2**20:.2f} MiB ({held_c / fp32:.3f}x) "
                  f"| {held_k / 2**20:.2f} MiB (**{held_k / fp32:.3f}x**) |")

if __name__ == "__main__":
    with recorded(__file__):
        main()
