"""Optimizer-state memory and step time of the memory-lean optimizers, as ratios to AdamW (same run).

    python benchmarks/optimizer_memory.py [--hidden 256] [--layers 4] [--steps 60] [--gap 50]

One byte-level Llama (``lowrank_lit.models.lm.llama``, d = --hidden, MLP 4d) on stdlib text; every
optimizer gets :func:`lowrank_lit.optim.matrix_param_groups` (attention/MLP matrices compressed,
embeddings/head/norms dense) and trains its own copy of the model on the same batches, steps
interleaved so machine noise hits all alike. Reports, per optimizer: state bytes of the compressed
matrices and of the whole model (moments, indices, projectors), and the median and mean time of a
full training step (forward + backward + step; the mean includes the SVD refresh every --gap steps).
Targets: NanoAdam (density 0.05) matrix state <= 0.15x AdamW; LowRankAdam rank r matrix state
<= (r / min(m, n) + small)x; importance step time <= 1.1x GaLore.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.data.text import CharTextDataModule
from lowrank_lit.launch.estimate import optimizer_state_bytes
from lowrank_lit.methods.is_lowrank import LowRankAdam
from lowrank_lit.methods.nanoadam import NanoAdam
from lowrank_lit.models.lm import llama
from lowrank_lit.optim import matrix_param_groups

DENSE = ["*embed*", "*lm_head*"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per optimizer (after 3 warm-up steps)")
    parser.add_argument("--gap", type=int, default=50, help="projector refresh period of the low-rank optimizers")
    args = parser.parse_args()

    torch.manual_seed(0)
    base = llama(vocab_size=128, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                 intermediate_size=4 * args.hidden, context=args.context)
    dm = CharTextDataModule(max_bytes=500_000, context=args.context, batch_size=args.batch_size)
    dm.setup()
    batches = [b for _, b in zip(range(args.steps + 3), dm.train_dataloader(), strict=False)]
    makers = {
        "AdamW": lambda g: torch.optim.AdamW(g, lr=1e-3),
        "NanoAdam d=0.05": lambda g: NanoAdam(g, lr=1e-3, density=0.05, mask_interval=100),
    }
    for r in (8, 32):
        makers[f"GaLore r={r}"] = lambda g, r=r: LowRankAdam(g, lr=1e-3, rank=r, update_proj_gap=args.gap, selector="dominant")
        makers[f"importance r={r}"] = lambda g, r=r: LowRankAdam(g, lr=1e-3, rank=r, update_proj_gap=args.gap, selector="importance", seed=0)
    runs = {}
    for name, make in makers.items():
        model = copy.deepcopy(base)
        groups = matrix_param_groups(model, dense=DENSE)
        runs[name] = (model, make(groups), {id(p) for p in groups[0]["params"]}, [])
    shapes = {tuple(p.shape) for p in matrix_param_groups(base, dense=DENSE)[0]["params"]}
    for i, (x, y) in enumerate(batches):
        for model, opt, _, times in runs.values():
            t0 = time.perf_counter()
            logits = model(x).logits
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if i >= 3:
                times.append(time.perf_counter() - t0)
    ref_model, ref_opt, ref_ids, ref_times = runs["AdamW"]
    ref_mat, ref_all = optimizer_state_bytes(ref_opt, ref_ids), optimizer_state_bytes(ref_opt)
    ref_med, ref_mean = statistics.median(ref_times), statistics.mean(ref_times)
    print(f"model: Llama d={args.hidden}, {args.layers} layers, {sum(p.numel() for p in base.parameters()) / 1e6:.2f}M parameters; "
          f"compressed matrix shapes {sorted(shapes)}; {args.steps} timed steps")
    print("| optimizer | matrix state | ratio | all state | ratio | median step | ratio | mean step | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (_, opt, ids, times) in runs.items():
        mat, tot = optimizer_state_bytes(opt, ids), optimizer_state_bytes(opt)
        med, mean = statistics.median(times), statistics.mean(times)
        print(f"| {name} | {mat / 2**20:.2f} MiB | {mat / ref_mat:.3f} | {tot / 2**20:.2f} MiB | {tot / ref_all:.3f} | "
              f"{med * 1e3:.1f} ms | {med / ref_med:.2f} | {mean * 1e3:.1f} ms | {mean / ref_mean:.2f} |")
    for r in (8, 32):
        g, i = runs[f"GaLore r={r}"][3], runs[f"importance r={r}"][3]
        print(f"importance / GaLore step time, r={r}: median {statistics.median(i) / statistics.median(g):.3f}, "
              f"mean {statistics.mean(i) / statistics.mean(g):.3f}")
    print("bound r/min(m,n): " + ", ".join(f"r={r}: {r / min(s):.3f} ({s})" for r in (8, 32) for s in sorted(shapes)))


if __name__ == "__main__":
    with recorded(__file__):
        main()
