"""The gap adaptation can close on the compositional text benchmark: head-only vs full fine-tuning, per family.

Head-only: logistic regression (scikit-learn) on the frozen all-MiniLM-L6-v2 sentence embeddings (all six layers,
mean pooling) of the training split. Full fine-tuning: every encoder weight and a linear head, AdamW, batch 32,
``--epochs`` passes over the training split. Both are scored on the test split (held-out words), per family, for
each ``--seeds`` value (the data's ``split_seed`` and the fine-tuning seed).

    python benchmarks/compositional_ceiling.py --seeds 0 1 2
    python benchmarks/compositional_ceiling.py --methods head --seeds 0 1 2     # the head-only bound alone (minutes)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.data.compositional import FAMILIES
from lowrank_lit.report import markdown_table
from lowrank_lit.studies.peft_suite import fine_tune, linear_probe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument(
        "--methods", nargs="+", choices=["head", "fine_tune"], default=["head", "fine_tune"],
        help="which bounds to measure: head (head-only, frozen features) and/or fine_tune (full fine-tuning)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    res: dict[str, list[dict[str, float]]] = {}
    for seed in args.seeds:
        t0 = time.time()
        if "head" in args.methods:
            res.setdefault("head-only (frozen)", []).append(linear_probe(seed))
        if "fine_tune" in args.methods:
            res.setdefault("full fine-tuning", []).append(fine_tune(seed, args.epochs, args.lr))
        print(f"seed {seed}: {time.time() - t0:.0f} s", flush=True)
    cols = [*FAMILIES, "overall"]

    def cell(runs: list[dict[str, float]], key: str) -> str:
        xs = [100 * r[key] for r in runs]
        return f"{statistics.fmean(xs):.1f} ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"

    print(markdown_table(["method", *cols], [[name, *(cell(runs, c) for c in cols)] for name, runs in res.items()]))
    for name, runs in res.items():
        print(f"{name}, overall per seed: " + " / ".join(f"{100 * r['overall']:.1f}" for r in runs))


if __name__ == "__main__":
    with recorded(__file__):
        main()
