"""TRUST's K traversals as one batched forward/backward (``torch.func.vmap``) against one after another.

    python benchmarks/trust_vmap.py [--batch 64] [--repeats 5]

The cost of TRUST's parallel mode is K pseudo-label forward/backward passes from the same weights under K
traversals. Executed one after another it costs what sequential TRUST costs; batched, the K parameter copies and
the K traversal permutations (the SS2D ``perm`` buffers) are stacked and ``vmap(grad(loss))`` computes the K
gradients in one call. Digits TinyVMamba (randomly initialised, BatchNorm in train mode), the official code's six
traversals, batch ``--batch``; median of ``--repeats`` after one warm-up. The K gradients of both paths agree
(largest difference printed). mambapy's parallel scan is an ``autograd.Function`` without a vmap rule, so the
batched path uses our ``linear_scan`` (``parallel_scan=False``); the loop is timed with both scans. TRUST's
``batched=True`` parallel modes run this path (``lowrank bench trust`` times the whole per-batch step).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)
from torch.func import functional_call, grad, vmap

from lowrank_lit.methods.trust import PAPER_TRAVERSALS
from lowrank_lit.models.vmamba import TinyVMamba, set_traversal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    perms = list(PAPER_TRAVERSALS)
    k = len(perms)
    g = torch.Generator().manual_seed(0)
    x = torch.rand(args.batch, 1, 8, 8, generator=g)
    labels = torch.randint(0, 10, (k, args.batch), generator=g)  # (K, B) pseudo-labels, one row per traversal
    models = {}
    for scan in ("linear", "pscan"):
        torch.manual_seed(0)
        models[scan] = TinyVMamba(dim=32, img_size=8, stem_stride=2, parallel_scan=scan == "pscan").train()
    model = models["linear"]
    params = {n: torch.stack([p.detach()] * k) for n, p in model.named_parameters()}  # (K, ...) each
    buffers = {n: torch.tensor(perms) if n.endswith(".perm") else torch.stack([b.clone()] * k)
               for n, b in model.named_buffers()}

    def loss(p: dict, b: dict, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(functional_call(model, {**p, **b}, (x,)), y)

    batched = vmap(grad(loss))

    def one_after_another(m: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
        out = []
        for i, perm in enumerate(perms):
            set_traversal(m, perm)
            m.zero_grad()
            F.cross_entropy(m(x), labels[i]).backward()
            out.append({n: p.grad.clone() for n, p in m.named_parameters()})
        return out

    grads = batched(params, buffers, labels)
    ref = one_after_another(models["pscan"])
    diff = max(float((grads[n][i] - ref[i][n]).abs().max()) for i in range(k) for n in grads)
    timed = {"vmap, linear_scan": lambda: batched(params, buffers, labels),
             "loop over K, linear_scan": lambda: one_after_another(models["linear"]),
             "loop over K, mambapy pscan (today's path)": lambda: one_after_another(models["pscan"])}
    times: dict[str, list[float]] = {name: [] for name in timed}
    for i in range(args.repeats + 1):
        for name, fn in timed.items():
            start = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - start)
    base = statistics.median(times["loop over K, mambapy pscan (today's path)"])
    print(f"K = {k} traversals, batch {args.batch}, torch threads {torch.get_num_threads()}; "
          f"largest gradient difference batched vs loop: {diff:.1e}")
    print("| path | ms for the K gradients | / today's path |")
    print("|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {1e3 * statistics.median(ts):.0f} | {statistics.median(ts) / base:.2f} |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
