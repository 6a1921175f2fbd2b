"""Training-step time and epoch time of the prompt methods on the frozen MiniLM, as ratios to PT (same run).

    python benchmarks/prompt_step_time.py [--layers 2] [--steps 30] [--repeats 5]

One training step = forward through the prompted frozen backbone, masked-mean head, cross-entropy, backward
and an AdamW step, on a batch of 32 templated sentences (12 tokens). The methods are timed in interleaved
rounds so machine noise hits all alike; the table shows the median ms per step, the seconds per epoch of
the CPU experiment (63 batches) and the ratio to prompt tuning with 16 tokens (PT m=16). The paper's claim
for CaPT is a lower training time than PT (one extra token per layer against 16 extra tokens).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from timing import recorded  # benchmarks/timing.py (the script folder is on sys.path)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _methods(layers: int) -> dict[str, object]:
    from lowrank_lit.methods.capt import CapsulePrompt
    from lowrank_lit.methods.pt_moe import DecomposedMoEPrompt
    from lowrank_lit.nn.prompts import DeepPrompt, SoftPrompt

    return {
        "PT m=16": lambda: SoftPrompt(16, 384),
        "head only": lambda: None,
        "CaPT": lambda: CapsulePrompt(layers, 384),
        "deep PT m=1": lambda: DeepPrompt(layers, 1, 384),
        "P-tuning v2 m=4": lambda: DeepPrompt(layers, 4, 384),
        "PT-MoE N=2 T=16": lambda: DecomposedMoEPrompt(2, 16, 13, 384),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="MiniLM layers kept (the CPU experiments use 2)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per method and round")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median reported)")
    opts = parser.parse_args()
    from lowrank_lit.data.text_tasks import TemplatedTextDataModule
    from lowrank_lit.models.text import PromptTunedClassifier

    torch.manual_seed(0)
    dm = TemplatedTextDataModule(n_train=320, n_val=32, n_test=32)
    dm.setup()
    batches = list(dm.train_dataloader())
    models = {}
    for name, make in _methods(opts.layers).items():
        model = PromptTunedClassifier(num_layers=opts.layers, prompt=make(), measure_attention=False)
        models[name] = (model, model.configure_optimizers())
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(opts.repeats):
        for name, (model, opt) in models.items():
            model.train()
            start = time.perf_counter()
            for i in range(opts.steps):
                ids, mask, y = batches[i % len(batches)][:3]
                logits, _ = model(ids, mask)
                loss = F.cross_entropy(logits, y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            times[name].append((time.perf_counter() - start) / opts.steps)
    base = statistics.median(times["PT m=16"])
    print(f"| method ({opts.layers} layers) | prompt params | ms / step | s / epoch (63 steps) | / PT m=16 |")
    print("|---|---|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        params = models[name][0].parameter_counts()["prompt"]
        print(f"| {name} | {params:,} | {1000 * med:.1f} | {63 * med:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
