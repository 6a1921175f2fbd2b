"""Training-step time of Q3R + Adam over plain AdamW on the ViT-Tiny digits setup (same process).

    python benchmarks/q3r_overhead.py [--steps 40] [--period 5] [--batch-size 32]

Both models see the same batches; steps alternate between them so that machine noise hits both
alike. Prints the median step times and their ratio (the paper reports a small overhead; target
<= 1.15 at period 5). The Q3R step includes its SVD refresh every ``period`` steps.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.data import DigitsDataModule
from lowrank_lit.methods.q3r import AdamQ3R, Q3RRegularizer, resolve_targets
from lowrank_lit.models.vit import vit_tiny


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per model (after 5 warm-up steps)")
    parser.add_argument("--period", type=int, default=5, help="Q3R refresh period T")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dm = DigitsDataModule(image_size=32, channels=3, batch_size=args.batch_size)
    dm.setup("fit")
    batches = list(dm.train_dataloader())

    base = vit_tiny(global_pool="avg")
    q3r_model = vit_tiny(global_pool="avg")
    q3r_model.load_state_dict(base.state_dict())
    adamw = torch.optim.AdamW(base.parameters(), lr=1e-3, weight_decay=0.05)
    reg = Q3RRegularizer(resolve_targets(q3r_model, ["blocks.*.attn.qkv[3]"]), target_rank=0.1, lam=1.0,
                         period=args.period)
    adamq3r = AdamQ3R(q3r_model.parameters(), reg, lr=1e-3)

    def step(model, opt, x, y) -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        return time.perf_counter() - t0

    times = {"adamw": [], "q3r": []}
    for i in range(args.steps + 5):
        x, y = batches[i % len(batches)]
        a = step(base, adamw, x, y)
        b = step(q3r_model, adamq3r, x, y)
        if i >= 5:
            times["adamw"].append(a)
            times["q3r"].append(b)
    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    print(f"targets: {len(reg.targets)} q/k/v matrices 192x192, period {args.period}, batch {args.batch_size}, "
          f"{args.steps} steps, torch threads {torch.get_num_threads()}")
    print(f"median step  AdamW {med['adamw'] * 1e3:8.1f} ms   Q3R+Adam {med['q3r'] * 1e3:8.1f} ms   "
          f"ratio {med['q3r'] / med['adamw']:.3f}")
    print(f"mean step    AdamW {mean['adamw'] * 1e3:8.1f} ms   Q3R+Adam {mean['q3r'] * 1e3:8.1f} ms   "
          f"ratio {mean['q3r'] / mean['adamw']:.3f}  (includes the SVD refresh steps)")


if __name__ == "__main__":
    with recorded(__file__):
        main()
