"""GLVQ's two codebooks side by side: the integer lattice (the default) and its half-step-shifted, symmetric coset.

    python benchmarks/glvq_codebook.py                  # seeds 0-4, 2 bits, one thread (about 8 min on 2 cores)
    python benchmarks/glvq_codebook.py --seeds 0 1 --bits 3

Part 1, Gaussian weights: the relative error ``||W - W_hat||^2 / ||W||^2`` of one 256 x 32 column group of N(0, 1)
weights (H = I, d = 8), best scalar lattice and GLVQ, for each codebook (float64, seed 0).

Part 2, the digits MLP of docs/methods/glvq.md: for each seed, ``configs/glvq/mlp_digits_fp.yaml`` trained with the
seed, then quantized by ``configs/glvq/mlp_digits_<bits>bit.yaml`` with GLVQ and with the best scalar lattice in
each codebook; the calibration error of each hidden layer and the test accuracy, per seed and mean, plus the
verdict of "symmetric >= integer" on the accuracy (lowrank_lit.stats.verdict, paired by seed).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import recorded  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CODEBOOKS = ("integer", "symmetric")


def gaussian_table() -> list[str]:
    from lowrank_lit.nn.glvq import quantize_group

    W = torch.randn(256, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    H = torch.eye(32, dtype=torch.float64)
    ref = float((W**2).sum())
    rows = ["| codebook | best scalar lattice | GLVQ |", "|---|---|---|"]
    for cb in CODEBOOKS:
        err = [quantize_group(W, H, 2, 8, m, codebook=cb).loss / ref for m in ("scalar", "glvq")]
        rows.append(f"| {cb} | {err[0]:.4f} | {err[1]:.4f} |")
    return rows


def _cli(*args: str, cwd: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": os.environ.get("WANDB_MODE", "offline"),
           "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", *args, "--run_root", str(cwd / "runs")], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"lowrank {' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def digits_runs(seeds: list[int], bits: int, tmp: Path) -> dict[tuple[str, str, int], tuple[list[float], float]]:
    from lowrank_lit.report import last_values

    out = {}
    for seed in seeds:
        _cli("fit", "--config", "configs/glvq/mlp_digits_fp.yaml", f"--seed_everything={seed}", "--run_id", f"fp{seed}",
             cwd=tmp)
        ckpt = tmp / "runs" / "glvq" / "mlp_digits_fp" / f"fp{seed}" / "checkpoints" / "last.ckpt"
        for method in ("glvq", "scalar"):
            for cb in CODEBOOKS:
                rid = f"{method}_{cb}_{seed}"
                _cli("test", "--config", f"configs/glvq/mlp_digits_{bits}bit.yaml", f"--ckpt_path={ckpt}",
                     f"--seed_everything={seed}", f"--trainer.callbacks.init_args.method={method}",
                     f"--trainer.callbacks.init_args.codebook={cb}", "--run_id", rid, cwd=tmp)
                run = tmp / "runs" / "glvq" / f"mlp_digits_{bits}bit" / rid
                with open(run / "quantization.csv") as f:
                    errs = [float(r["rel_error"]) for r in csv.DictReader(f)]
                acc = last_values(run / "metrics.csv", ["test/acc"])["test/acc"]
                out[(method, cb, seed)] = (errs, acc)
                print(f"seed {seed} {method} {cb}: errors {errs}, acc {acc:.4f}", file=sys.stderr, flush=True)
    return out


def digits_table(res: dict[tuple[str, str, int], tuple[list[float], float]], seeds: list[int]) -> list[str]:
    from lowrank_lit.report import mean_std
    from lowrank_lit.stats import verdict

    rows = ["| method | codebook | layer 1 error | layer 2 error | test accuracy, seeds " + " / ".join(map(str, seeds))
            + " | mean ± std |", "|---|---|---|---|---|---|"]
    for method in ("glvq", "scalar"):
        for cb in CODEBOOKS:
            runs = [res[(method, cb, s)] for s in seeds]
            e1, e2 = (statistics.fmean(r[0][i] for r in runs) for i in (0, 1))
            accs = [r[1] for r in runs]
            rows.append(f"| {method} | {cb} | {e1:.4f} | {e2:.4f} | {' / '.join(f'{a:.4f}' for a in accs)} | "
                        f"{mean_std(accs, '.4f')} |")
    if len(seeds) > 1:
        for method in ("glvq", "scalar"):
            v = verdict([res[(method, "symmetric", s)][1] for s in seeds], [res[(method, "integer", s)][1] for s in seeds],
                        delta=0.01)
            rows.append(f"\n{method}, accuracy symmetric >= integer: {v}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--bits", type=int, default=2, choices=(2, 3))
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("Gaussian weights, 2 bits, relative error:\n")
    print("\n".join(gaussian_table()))
    with tempfile.TemporaryDirectory() as tmp:
        res = digits_runs(args.seeds, args.bits, Path(tmp))
    print(f"\nDigits MLP, {args.bits} bits, one thread (calibration error of each hidden layer: mean over the seeds):\n")
    print("\n".join(digits_table(res, args.seeds)))
    return 0


if __name__ == "__main__":
    with recorded(__file__):
        code = main()
    sys.exit(code)
