"""The gap adaptation can close on the compositional text benchmark: head-only vs full fine-tuning, per family.

Head-only: logistic regression (scikit-learn) on the frozen all-MiniLM-L6-v2 sentence embeddings (all six layers,
mean pooling) of the training split. Full fine-tuning: every encoder weight and a linear head, AdamW, batch 32,
``--epochs`` passes over the training split. Both are scored on the test split (held-out words), per family, for
each ``--seeds`` value (the data's ``split_seed`` and the fine-tuning seed).

    python benchmarks/compositional_ceiling.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lowrank_lit.data.compositional import FAMILIES, CompositionalTextDataModule
from lowrank_lit.models.text import SentenceEncoder
from lowrank_lit.report import markdown_table


def _per_family(pred: torch.Tensor, y: torch.Tensor, d: torch.Tensor) -> dict[str, float]:
    out = {f: float((pred[d == i] == y[d == i]).float().mean()) for i, f in enumerate(FAMILIES)}
    out["overall"] = float((pred == y).float().mean())
    return out


def _batches(dm: CompositionalTextDataModule, split: str):
    return dm.train_dataloader() if split == "train" else dm.test_dataloader()


def head_only(seed: int) -> dict[str, float]:
    from sklearn.linear_model import LogisticRegression

    enc = SentenceEncoder(trainable=False).eval()
    dm = CompositionalTextDataModule(split_seed=seed)
    dm.setup("fit")
    dm.setup("test")

    def feats(split: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        xs, ys, ds = [], [], []
        with torch.no_grad():
            for ids, mask, y, d in _batches(dm, split):
                xs.append(enc({"input_ids": ids, "attention_mask": mask}))  # (B, 384)
                ys.append(y)
                ds.append(d)
        return torch.cat(xs), torch.cat(ys), torch.cat(ds)

    xtr, ytr, _ = feats("train")
    xte, yte, dte = feats("test")
    clf = LogisticRegression(max_iter=5000, C=1.0).fit(xtr.numpy(), ytr.numpy())
    return _per_family(torch.as_tensor(clf.predict(xte.numpy())), yte, dte)


def fine_tune(seed: int, epochs: int, lr: float) -> dict[str, float]:
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
    preds, ys, ds = [], [], []
    with torch.no_grad():
        for ids, mask, y, d in dm.test_dataloader():
            preds.append(head(enc({"input_ids": ids, "attention_mask": mask})).argmax(1))
            ys.append(y)
            ds.append(d)
    return _per_family(torch.cat(preds), torch.cat(ys), torch.cat(ds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    res: dict[str, list[dict[str, float]]] = {"head-only (frozen)": [], "full fine-tuning": []}
    for seed in args.seeds:
        t0 = time.time()
        res["head-only (frozen)"].append(head_only(seed))
        res["full fine-tuning"].append(fine_tune(seed, args.epochs, args.lr))
        print(f"seed {seed}: {time.time() - t0:.0f} s", flush=True)
    cols = [*FAMILIES, "overall"]

    def cell(runs: list[dict[str, float]], key: str) -> str:
        xs = [100 * r[key] for r in runs]
        return f"{statistics.fmean(xs):.1f} ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else f"{xs[0]:.1f}"

    print(markdown_table(["method", *cols], [[name, *(cell(runs, c) for c in cols)] for name, runs in res.items()]))
    for name, runs in res.items():
        print(f"{name}, overall per seed: " + " / ".join(f"{100 * r['overall']:.1f}" for r in runs))


if __name__ == "__main__":
    main()
