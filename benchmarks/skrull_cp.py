"""Real context parallelism on 2 gloo processes: all-sharded vs DACP vs GDS + DACP on a tiny causal transformer.

    python benchmarks/skrull_cp.py [--batches 20] [--warmup 5] [--global-batch 32] [--bucket 8192]

Two processes (CP = 2, one thread each) run forward + backward (and the gradient all-reduce) of
``PackedCausalLM`` (2 layers, d 128, 4 heads) over global batches of lengths 90 % U[16, 256], 10 % U[1024, 2048].
Sharded sequences are split in two chunks whose K/V are all-gathered per layer; local sequences run whole on one
rank. Prints the median wall time per global batch over ``--batches`` timed batches after ``--warmup``, tokens/s,
and the ratio to all-sharded.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

from lowrank_lit.data.packed import draw_lengths
from lowrank_lit.methods.skrull import dacp_plan, gds_plan
from lowrank_lit.nn.context_parallel import PackedCausalLM, all_reduce_grads, cp_loss_backward


def schedules(lens: list[int], bucket: int, cp: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    idx = list(range(len(lens)))
    return {
        "all sharded": [(idx, [-1] * len(idx))],
        "DACP": [(idx, dacp_plan(lens, bucket, cp))],
        "GDS + DACP": [(mb, dacp_plan([lens[k] for k in mb], bucket, cp)) for mb in gds_plan(lens, bucket, cp, 1, 0)],
    }


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = PackedCausalLM(vocab_size=128, d_model=128, heads=4, layers=2, max_len=2048)
    g = torch.Generator().manual_seed(0)
    batches = []
    for b in range(args.warmup + args.batches):
        lens = draw_lengths(args.global_batch, "long_tail", b)
        batches.append(([torch.randint(0, 128, (n,), generator=g) for n in lens], lens))
    results = {}
    for name in ("all sharded", "DACP", "GDS + DACP"):
        times = []
        for b, (seqs, lens) in enumerate(batches):
            plan = schedules(lens, args.bucket, world)[name]
            total = sum(n - 1 for n in lens)
            dist.barrier()
            start = time.perf_counter()
            for mb, place in plan:
                cp_loss_backward(model, [seqs[k] for k in mb], place, rank, world, total_tokens=total)
            all_reduce_grads(model)
            model.zero_grad(set_to_none=True)
            dist.barrier()
            if b >= args.warmup:
                times.append(time.perf_counter() - start)
        tokens = statistics.fmean(sum(lens) for _, lens in batches[args.warmup:])
        results[name] = (statistics.median(times), tokens)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--bucket", type=int, default=8192)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "res.pt")
        mp.spawn(worker, args=(2, port, args, out), nprocs=2, join=True)
        results = torch.load(out)
    base = results["all sharded"][0]
    print("| schedule | median s / global batch | tokens/s | speed-up vs all sharded |")
    print("|---|---|---|---|")
    for name, (t, tokens) in results.items():
        print(f"| {name} | {t:.3f} | {tokens / t:.0f} | {base / t:.2f}x |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
