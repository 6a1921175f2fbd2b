"""Time per test batch of TRUST and its baselines on the digits TinyVMamba, as ratios to Tent in the same run.

    python benchmarks/trust_step.py [--batch 64] [--k 6] [--repeats 10] [--dim 32] [--stem-stride 2]

Each method is set up on a fresh randomly initialised TinyVMamba (BatchNorm, batch statistics) and adapts on
the same random batches; the median of ``--repeats`` per-batch times (after two warm-up batches) is reported.
TRUST's cost is about K x (one no-grad forward + one forward/backward) + one forward, against Tent's one
forward/backward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.methods.trust import TRUST, TrustNaive
from lowrank_lit.models.vmamba import TinyVMamba
from lowrank_lit.tta import SourceOnly, Tent


def per_batch(method, args: argparse.Namespace) -> float:
    torch.manual_seed(0)
    side = 8  # 8x8 digits: 4x4 tokens (stride 2) or 8x8 (stride 1)
    model = TinyVMamba(dim=args.dim, img_size=side, stem_stride=args.stem_stride)
    method.setup(model)
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(args.repeats + 2):
        x = torch.rand(args.batch, 1, side, side, generator=g)
        start = time.perf_counter()
        method.forward_and_adapt(x)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--stem-stride", type=int, default=2, choices=[1, 2])
    args = p.parse_args()
    methods = {
        "source (no update)": SourceOnly(),
        "Tent": Tent(lr=1e-3, norms="batchnorm"),
        "TRUST-naive": TrustNaive(lr=1e-3),
        f"TRUST K={args.k} sequential": TRUST(k=args.k, lr=1e-3, traversals="paper" if args.k <= 6 else "ranked"),
        f"TRUST K={args.k} parallel": TRUST(k=args.k, lr=1e-3, mode="parallel", traversals="paper" if args.k <= 6 else "ranked"),
        f"TRUST K={args.k} slerp": TRUST(k=args.k, lr=1e-3, merge="slerp", traversals="paper" if args.k <= 6 else "ranked"),
    }
    times = {name: per_batch(m, args) for name, m in methods.items()}
    print("| method | ms / batch | / Tent |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {1e3 * t:.1f} | {t / times['Tent']:.2f} |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
