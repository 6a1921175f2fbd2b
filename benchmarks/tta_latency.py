"""Per-batch latency of Tent + ReservoirTTA (7 models) over plain Tent on the digits corruption stream (same run).

    python benchmarks/tta_latency.py [--batches 72] [--source-ckpt PATH] [--no-ensembling]
                                     [--widths 32 32 32] [--image-size 16]

Both adapt the same GroupNorm CNN on the same CSC stream (6 corruptions, 12 batches of 64 per visit);
batches alternate between the two so machine noise hits both alike. By the first recurrence's end the
reservoir holds 7 models (source + one per corruption); the timing starts after that. Without
``--source-ckpt`` the CNN is randomly initialised (latency does not depend on the weights). The
reservoir's one-off setup (1000 source styles for the threshold) is reported separately.
Prints the median per-batch latencies and their ratio (target <= 1.5x). ``--no-ensembling`` predicts
with the routed copy (its adaptation forward pass gives the prediction: one forward pass less per batch).
``--widths`` / ``--image-size`` time a larger CNN on larger images (random weights; the stream's
digits are upsampled to that size) to see how the fixed per-batch costs scale.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.data.corruptions import DigitsCorruptionDataModule
from lowrank_lit.methods.reservoir_tta import ReservoirTTA
from lowrank_lit.models.cnn import GroupNormCNN
from lowrank_lit.tta import Tent, load_backbone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=72, help="timed batches per method (after the first recurrence)")
    parser.add_argument("--source-ckpt", default=None)
    parser.add_argument("--no-ensembling", action="store_true", help="predict with the routed copy instead of the q-weighted average")
    parser.add_argument("--widths", type=int, nargs="+", default=[32, 32, 32], help="GroupNormCNN conv widths")
    parser.add_argument("--image-size", type=int, default=16, help="side of the (upsampled) digits")
    args = parser.parse_args()
    dm = DigitsCorruptionDataModule(recurrences=1 + -(-args.batches // 72), image_size=args.image_size)
    dm.setup()
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = GroupNormCNN(widths=args.widths)
        if args.source_ckpt:
            load_backbone(m, args.source_ckpt)
        models.append(m)
    tent = Tent()
    tent.setup(models[0], None)
    res = ReservoirTTA(Tent(), ["blocks.0.0", "blocks.1.0"], ensembling=not args.no_ensembling)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    res.setup(models[1], (b for _ in range(100) for b in dm.source_dataloader(generator=gen)))
    setup_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {"Tent": [], "Tent + ReservoirTTA": []}
    stream = list(dm.test_dataloader())
    for i, (x, *_rest) in enumerate(stream[: 72 + args.batches]):
        for name, method in (("Tent", tent), ("Tent + ReservoirTTA", res)):
            t = time.perf_counter()
            method.forward_and_adapt(x)
            if i >= 72:
                times[name].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"reservoir models after the first recurrence: {res.num_models}; one-off setup (1000 source styles): {setup_s:.1f} s")
    for k, v in med.items():
        print(f"{k:22s} median {v * 1e3:7.2f} ms per batch of 64 (mean {statistics.mean(times[k]) * 1e3:.2f} ms)")
    print(f"ratio: {med['Tent + ReservoirTTA'] / med['Tent']:.2f}x (target <= 1.5x)")


if __name__ == "__main__":
    with recorded(__file__):
        main()
