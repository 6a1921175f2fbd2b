"""Skrull's scheduling simulation: iteration time of uniform CP, sorted batching, DACP only and GDS + DACP.

    python benchmarks/skrull_sim.py [--batches 5] [--global-batch 256] [--dp 4] [--cp 8] [--bucket 26000] [--calibrate]
                                    [--plot [--write-docs]] [--memory]

Global batches from a long-tail mix (90 % U[32, 1024], 10 % U[4K, 32K]) and a bimodal mix (50 % U[256, 2K], 50 %
U[16K, 64K]); cost model of Qwen2.5-0.5B (h 896, h_kv 128, 24 layers) on H100-like numbers (400 TFLOP/s x
eff(x) = x / (x + 512), 20 us launch per layer, 50 us + 160 GB/s per K/V all-gather); with ``--calibrate`` the
efficiency knee and launch overhead are fitted to a tiny transformer layer timed on this CPU at 16..4096 tokens
(peak scaled to the H100 number). Prints the mean iteration time over ``--batches`` global batches, the speed-up
over uniform CP, the largest token count any CP rank holds (never above the bucket) and the sharded count.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
from timing import output_path, recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.methods.skrull import (
    SkrullCostModel,
    baseline_plan,
    dacp_only_plan,
    plot_plan,
    simulate_iteration,
    skrull_plan,
    sorted_plan,
)

DOCS_FIGURE = Path(__file__).resolve().parent.parent / "docs" / "methods" / "skrull_plan.png"

MIXES = {
    "long-tail": lambda r: r.randint(32, 1024) if r.random() < 0.9 else r.randint(4096, 32768),
    "bimodal": lambda r: r.randint(256, 2048) if r.random() < 0.5 else r.randint(16384, 65536),
}


def calibrated_knee(hidden: int = 128) -> tuple[float, float]:
    """Fit eff's knee and the launch share on this CPU: time one transformer layer fwd+bwd at 16..4096 tokens."""
    layer = torch.nn.TransformerEncoderLayer(hidden, 4, 4 * hidden, batch_first=True)
    lengths = [16, 64, 256, 1024, 4096]
    times = []
    for S in lengths:
        x = torch.randn(1, S, hidden, requires_grad=True)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            layer(x).sum().backward()
            best = min(best, time.perf_counter() - start)
        times.append(best)
    cost = SkrullCostModel(hidden=hidden, kv_hidden=hidden, layers=1)
    cost.calibrate(lengths, times, knees=[0, 32, 64, 128, 256, 512, 1024, 2048])
    return cost.knee, cost.comp_fit[1] / cost.comp_fit[0]  # launch expressed in effective FLOPs


def measured_memory() -> str:
    """Activation bytes per token of the CPU run's transformer (2 layers, d 128), from the tensors saved for backward."""
    from lowrank_lit.methods.skrull import fit_memory, micro_batch_loss
    from lowrank_lit.nn.context_parallel import PackedCausalLM

    torch.manual_seed(0)
    model = PackedCausalLM(vocab_size=128, d_model=128, heads=4, layers=2, max_len=2048)

    def run(S: int) -> torch.Tensor:
        return micro_batch_loss(model, [torch.randint(0, 128, (S,))], S - 1)

    alpha, beta = fit_memory(run, (256, 1024))
    cost = SkrullCostModel(mem_alpha=alpha, mem_beta=max(beta, 0.0))
    return (f"measured activation memory (2-layer d 128 transformer, 256 and 1024 tokens): alpha {alpha / 1024:.1f} KiB/token, "
            f"beta {beta / 2**20:.2f} MiB; bucket for a 1 GiB activation budget: {cost.bucket_size(2**30)} tokens\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--cp", type=int, default=8)
    p.add_argument("--bucket", type=int, default=26000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibrate", action="store_true")
    p.add_argument("--plot", action="store_true",
                   help="Gantt chart of DP rank 0's micro-batches of the first long-tail batch (plan.png in the run's "
                   "folder, runs/benchmarks/skrull_sim/<time>/)")
    p.add_argument("--write-docs", action="store_true", help="with --plot: also refresh docs/methods/skrull_plan.png")
    p.add_argument("--memory", action="store_true", help="also measure activation bytes per token on this CPU")
    args = p.parse_args()
    if args.memory:
        print(measured_memory())
    cost = SkrullCostModel()
    if args.calibrate:
        knee, launch_flops = calibrated_knee()
        a = cost.comp_fit[0]
        cost.knee, cost.comp_fit = knee, (a, a * launch_flops)
        print(f"calibrated on this CPU: knee {knee:.0f} tokens, launch {1e6 * a * launch_flops:.1f} us per layer at H100 peak\n")
    print("| mix | schedule | iteration (s) | speed-up | max tokens per rank | sharded |")
    print("|---|---|---|---|---|---|")
    for mix, draw in MIXES.items():
        rng = random.Random(args.seed)
        totals: dict[str, list[float]] = {}
        for _ in range(args.batches):
            lengths = [draw(rng) for _ in range(args.global_batch)]
            plans = {
                "uniform CP (baseline)": (baseline_plan(lengths, args.bucket, args.cp, args.dp), False),
                "sorted batching": (sorted_plan(lengths, args.bucket, args.cp, args.dp), False),
                "DACP only": (dacp_only_plan(lengths, args.bucket, args.cp, args.dp, cost), True),
                "GDS + DACP (Skrull)": (skrull_plan(lengths, args.bucket, args.cp, args.dp, cost), True),
            }
            if args.plot and mix == "long-tail" and not totals:
                for out in [output_path("plan.png")] + ([DOCS_FIGURE] if args.write_docs else []):
                    plot_plan(lengths, {name: plan[0] for name, (plan, _) in plans.items() if name != "sorted batching"},
                              cost, args.cp, str(out), overlap={name: ov for name, (_, ov) in plans.items()})
            for name, (plan, overlap) in plans.items():
                r = simulate_iteration(lengths, plan, cost, args.cp, overlap=overlap)
                t = totals.setdefault(name, [0.0, 0.0, 0.0])
                t[0] += r["time"] / args.batches
                t[1] = max(t[1], r["max_tokens"])
                t[2] += r["sharded"] / args.batches
        base = totals["uniform CP (baseline)"][0]
        for name, (t, mx, sh) in totals.items():
            print(f"| {mix} | {name} | {t:.3f} | {base / t:.2f}x | {mx:.0f} | {sh:.0f} |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
