"""The PEFT suite: every prompt / adapter method of the framework on one task a frozen encoder cannot solve.

The task is :class:`~lowrank_lit.data.compositional.CompositionalTextDataModule` (four families whose labels
follow word order, negation scope, parity and agreement; held-out words in the test split) on all six layers of
the pretrained all-MiniLM-L6-v2. One config per method in ``configs/peft_suite/``; one sweep runs them all over
three seeds; :func:`summary` turns the runs into the table and the accuracy-vs-parameters plot::

    lowrank sweep sweeps/peft_suite.yaml --no-wandb
    lowrank summarize peft_suite runs/peft_suite --out peft_suite.png

Rows ending in ``_noisy`` train on the noisy variant (10 % flipped labels, 20 % corrupted sentences; LoPE's
setting) and are scored on the same clean test split. Rows marked ``[beyond paper]`` add something no paper
here has (the load-balancing loss on PT-MoE's router).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from lowrank_lit.data.compositional import FAMILIES, CompositionalTextDataModule
from lowrank_lit.registry import register_study
from lowrank_lit.report import markdown_table, mean_std, new_figure, read_runs, save_figure

__all__ = ["LABELS", "collect", "summary", "method_of", "linear_probe", "fine_tune", "per_family"]

#: config name -> row label, in table order
LABELS: dict[str, str] = {
    "head": "head-only",
    "full_ft": "full fine-tuning",
    "peft_pt": "peft PromptTuning (16)",
    "pt": "PT (16, ours)",
    "deep_pt": "deep PT (1 per layer)",
    "ptv2": "P-tuning v2 (4 per layer)",
    "smop": "SMoP (2 x 8)",
    "ptmoe_n1": "PT-MoE N=1",
    "ptmoe": "PT-MoE N=2",
    "ptmoe_balanced": "PT-MoE N=4 + balance loss [beyond paper]",
    "capt": "CaPT",
    "capt_instance": "CaPT instance-only",
    "peft_lora": "peft LoRA (r=8)",
    "lora": "LoRA (r=8, ours)",
    "lora_noisy": "LoRA (r=4), noisy",
    "hydralora_noisy": "HydraLoRA (3 B's), noisy",
    "lope_noisy": "LoPE (mask, K=all), noisy",
    "lope_noisy_stage2_full": "LoPE (mask, K=all), noisy, stage II 1000 steps",
    "lope_noisy_noisyonly": "LoPE, stage I on noisy copies only, noisy [beyond paper]",
    "lope_noisy_shuffled": "LoPE, stage I labels shuffled, noisy [beyond paper]",
    "lope_noisy_halfweight": "LoPE, B_D at half weight in stage I, noisy [beyond paper]",
    "lope_nomask_noisy": "LoPE (no mask), noisy",
    "lope_k0_noisy": "LoPE (mask, K=0), noisy",
}
ACC = ("test/acc", *(f"test/acc_{f}" for f in FAMILIES))
ROUTING = ("test/routing_nmi", "test/routing_expert_purity", "test/routing_experts_used", "test/routing_purity")
NOISE = ("test/poison_share_clean", "test/poison_share_noisy", "test/poison_share_probe")
#: LoPE's mechanism per run (lowrank_lit.methods.lope): B_D alone after stage I, accuracy unmasked and B_D alone
MECHANISM = ("probe/bd_alone_acc", "test/acc_unmasked", "test/acc_bd_alone")


def method_of(run_config: dict[str, Any]) -> str:
    """The benchmark method of a run: its experiment name after ``peft_suite/`` (else the whole name)."""
    name = str(run_config.get("experiment") or "?")
    return name.split("/", 1)[1] if name.startswith("peft_suite/") else name


def trainable(metrics: dict[str, float]) -> int:
    """Trainable parameters a method adds to the frozen encoder: prompt + adapters + trained backbone weights
    (the 770-parameter head, common to all, left out)."""
    return int(sum(metrics.get(f"params/{k}", 0.0) for k in ("prompt", "adapter", "backbone")))


def collect(roots: Sequence[str]) -> dict[str, list[dict[str, float]]]:
    """Finished benchmark runs under ``roots`` (those with ``test/acc``), grouped by method, in :data:`LABELS` order
    (unknown methods last)."""
    groups: dict[str, list[dict[str, float]]] = {}
    for run in read_runs(roots, "metrics.csv"):
        if "test/acc" in run.metrics:
            groups.setdefault(method_of(run.config), []).append(run.metrics)
    if not groups:
        raise FileNotFoundError(f"no finished peft_suite run (with test/acc) under {', '.join(roots)}")
    order = list(LABELS)
    return dict(sorted(groups.items(), key=lambda kv: (order.index(kv[0]) if kv[0] in order else len(order), kv[0])))


def _values(runs: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in runs if key in r]


@register_study("peft_suite")
def summary(roots: list[str], out: str | None = None) -> str:
    """The PEFT suite table (accuracy per family, trainable parameters, step time / PT, peak memory) and the
    routing / noise table; ``--out``: accuracy vs trainable parameters (log x), every method labelled."""
    groups = collect(roots)
    pt_steps = _values(groups.get("pt", []), "cost/step_s")
    pt_step = statistics.median(pt_steps) if pt_steps else None
    header = ["method", "runs", "trainable params", *(k.split("/")[1].replace("acc_", "") for k in ACC[1:]),
              "overall", "step time / PT", "peak mem (MB)"]
    rows = []
    for name, runs in groups.items():
        steps = _values(runs, "cost/step_s")
        ratio = f"{statistics.median(steps) / pt_step:.2f}" if steps and pt_step else "-"
        mem = _values(runs, "cost/peak_mem_mb")
        rows.append([LABELS.get(name, name), len(runs), f"{trainable(runs[0]):,}",
                     *(mean_std(_values(runs, k), scale=100.0) for k in ACC[1:]), mean_std(_values(runs, "test/acc"), scale=100.0),
                     ratio, f"{statistics.median(mem):.0f}" if mem else "-"])
    text = markdown_table(header, rows)
    # routed methods with more than one expert (one expert is collapsed by construction)
    routed = {n: r for n, r in groups.items() if any("test/expert_share_1" in m for m in r)}
    if routed:
        rows = []
        for name, runs in routed.items():
            collapsed = sum(int(m.get("test/routing_collapsed", 0.0)) for m in runs)
            rows.append([LABELS.get(name, name), len(runs), *(mean_std(_values(runs, k), ".2f") for k in ROUTING),
                         f"{collapsed} of {len(runs)}"])
        text += "\n\nRouting (test split; NMI and expert purity are what a collapsed router cannot reach; purity is the "
        text += "old per-domain measure, 1.0 under collapse too):\n\n"
        text += markdown_table(["method", "runs", "NMI(domain, expert)", "expert purity", "experts used",
                                "domain purity", "collapsed runs"], rows)
    noisy = {n: r for n, r in groups.items() if any("test/poison_share_clean" in m for m in r)}
    if noisy:
        rows = [[LABELS.get(n, n), len(r), *(mean_std(_values(r, k), ".3f") for k in NOISE)]
                for n, r in noisy.items()]
        text += "\n\nLoPE's poisoning expert B_D, routing share (unmasked) on the clean test split, its 5 % HyNoIse copy and "
        text += "its copy at the training corruption rate (8 %):\n\n"
        text += markdown_table(["method", "runs", "B_D share clean", "B_D share HyNoIse 5 %", "B_D share probe 8 %"], rows)
    mechanism = {n: r for n, r in groups.items() if any("test/acc_unmasked" in m for m in r)}
    if mechanism:
        rows = [[LABELS.get(n, n), len(r), *(mean_std(_values(r, k), scale=100.0) for k in ("test/acc", *MECHANISM)),
                 mean_std(_values(r, "train/poison_share"), ".3f")] for n, r in mechanism.items()]
        text += "\n\nLoPE's mechanism per run: test accuracy as served (B_D masked unless the config keeps it), B_D alone "
        text += "at the end of stage I, and at the end of training unmasked and B_D alone; B_D's routing share on the "
        text += "last logged stage-II training batch:\n\n"
        text += markdown_table(["method", "runs", "accuracy", "B_D alone after stage I", "unmasked", "B_D alone",
                                "B_D share, end of stage II"], rows)
    if out:
        _plot(groups, out)
    return text


def _plot(groups: dict[str, list[dict[str, float]]], out: str) -> None:
    from matplotlib.lines import Line2D

    fig, ax = new_figure(figsize=(11.0, 5.5))
    keys = []
    for i, (name, runs) in enumerate(groups.items(), start=1):
        accs = [100.0 * a for a in _values(runs, "test/acc")]
        x, y = max(trainable(runs[0]), 1), statistics.fmean(accs)
        noisy = name.endswith("_noisy")
        ax.errorbar([x], [y], yerr=[statistics.stdev(accs) if len(accs) > 1 else 0.0], fmt="s" if noisy else "o",
                    capsize=3, color="tab:red" if noisy else "tab:blue")
        ax.annotate(str(i), (x, y), textcoords="offset points", xytext=(4, 2), fontsize=7)  # the legend names it
        keys.append(Line2D([], [], ls="", marker="s" if noisy else "o", color="tab:red" if noisy else "tab:blue",
                           label=f"{i}  {LABELS.get(name, name)}"))
    ax.legend(handles=keys, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=7, frameon=False)
    ax.set_xscale("log")
    ax.set_xlabel("trainable parameters (head excluded; 0 drawn at 1; log scale)")
    ax.set_ylabel("test accuracy, all families (%)")
    ax.set_title("PEFT suite: compositional text, all-MiniLM-L6-v2 (6 layers); squares: noisy training data")
    ax.grid(True, which="both", alpha=0.3)
    save_figure(fig, out)


# --------------------------------------------------------------------------------------- the benchmark's two bounds
def per_family(pred: torch.Tensor, y: torch.Tensor, domain: torch.Tensor) -> dict[str, float]:
    """Accuracy of each family (by its domain id) and ``overall``."""
    out = {f: float((pred[domain == i] == y[domain == i]).float().mean()) for i, f in enumerate(FAMILIES)}
    out["overall"] = float((pred == y).float().mean())
    return out


def _outputs(fn: Any, loader: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``fn({"input_ids", "attention_mask"})`` over a loader's batches, with their labels and domains, concatenated."""
    outs, ys, ds = [], [], []
    for ids, mask, y, d in loader:
        outs.append(fn({"input_ids": ids, "attention_mask": mask}))
        ys.append(y)
        ds.append(d)
    return torch.cat(outs), torch.cat(ys), torch.cat(ds)


def linear_probe(split_seed: int) -> dict[str, float]:
    """The frozen encoder's bound: logistic regression (scikit-learn) on the frozen all-MiniLM-L6-v2 sentence
    embeddings (all six layers, mean pooling) of the training split, scored per family on the test split.
    Seeded by ``split_seed`` (the training loader's shuffle order), so the same call gives the same numbers."""
    from sklearn.linear_model import LogisticRegression

    from lowrank_lit.models.text import SentenceEncoder

    torch.manual_seed(split_seed)
    enc = SentenceEncoder(trainable=False).eval()
    dm = CompositionalTextDataModule(split_seed=split_seed)
    dm.setup("fit")
    dm.setup("test")

    with torch.no_grad():
        xtr, ytr, _ = _outputs(enc, dm.train_dataloader())  # (n, 384) sentence embeddings
        xte, yte, dte = _outputs(enc, dm.test_dataloader())
    clf = LogisticRegression(max_iter=5000, C=1.0).fit(xtr.numpy(), ytr.numpy())
    return per_family(torch.as_tensor(clf.predict(xte.numpy())), yte, dte)


def fine_tune(seed: int, epochs: int = 10, lr: float = 5e-5) -> dict[str, float]:
    """The adaptation bound: every encoder weight and a linear head trained with AdamW (batch 32, ``epochs`` passes,
    data split ``seed``, init seed ``seed``), scored per family on the test split."""
    from lowrank_lit.models.text import SentenceEncoder

    torch.manual_seed(seed)
    enc = SentenceEncoder(trainable=True)
    head = torch.nn.Linear(enc.hidden_size, 2)
    dm = CompositionalTextDataModule(split_seed=seed)
    dm.setup("fit")
    dm.setup("test")
    opt = torch.optim.AdamW(list(enc.parameters()) + list(head.parameters()), lr=lr)
    for _ in range(epochs):
        enc.train()
        for ids, mask, y, _d in dm.train_dataloader():
            loss = torch.nn.functional.cross_entropy(head(enc({"input_ids": ids, "attention_mask": mask})), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    enc.eval()
    with torch.no_grad():
        preds, ys, ds = _outputs(lambda batch: head(enc(batch)).argmax(1), dm.test_dataloader())
    return per_family(preds, ys, ds)
