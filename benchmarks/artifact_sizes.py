"""Sizes of the exported artifacts of the docs/artifacts.md examples, against the checkpoint and the whole model.

    python benchmarks/artifact_sizes.py            # the table of docs/artifacts.md (a few minutes on 2 cores)

Each example trains its config as the method page's quick run does (in a fresh folder under this run's output
folder), exports it with ``lowrank export`` in every format it supports, loads the native artifact back onto a
fresh base with ``lowrank load`` (which checks the base) and reports the bytes of each artifact, of ``last.ckpt``
and of the model's full-precision weights (every distinct tensor of its state dict, frozen parts included).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from timing import output_path, recorded

ROOT = Path(__file__).resolve().parent.parent

#: (name, config, extra fit arguments, export formats (format, extra export arguments))
EXAMPLES = [
    ("LoRA r = 4 on MiniLM (2 layers)", "configs/lope/lora.yaml", [],
     [("native", []), ("peft", []), ("hf", [])]),
    ("LoPE (3 + 1 experts) on MiniLM", "configs/lope/lope.yaml", [], [("native", [])]),
    ("NanoAdam fine-tuning (digits MLP)", "configs/nanoadam/digits_finetune.yaml", [], [("native", [])]),
    ("Q3R (digits MLP), truncated to 0.2 of the targets", "configs/q3r/mlp_digits.yaml", [],
     [("native", []), ("factors", ["--keep", "0.2"])]),
]


def lowrank(*args: str, cwd: Path) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"lowrank {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def model_bytes(config: Path) -> int:
    from lowrank_lit.bench import tensor_bytes
    from lowrank_lit.launch.build import build_from_config

    return tensor_bytes(build_from_config(config, data=False, callbacks=False, quiet=True).model)


def mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main() -> None:
    work = output_path("work").resolve()
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")
    print("| example | format | artifact | / last.ckpt | / model weights | last.ckpt | model weights |")
    print("|---|---|---|---|---|---|---|")
    for name, config, extra, formats in EXAMPLES:
        experiment = config.removeprefix("configs/").removesuffix(".yaml")
        lowrank("fit", "--config", config, "--test_after_fit=false", "--run_id", "a", *extra, cwd=work)
        run = work / "runs" / experiment / "a"
        ckpt = run / "checkpoints" / "last.ckpt"
        weights = model_bytes(ROOT / config)
        for fmt, args in formats:
            out = work / "exports" / experiment / fmt
            lowrank("export", "--ckpt_path", str(ckpt), "--out", str(out), "--format", fmt, *args, cwd=work)
            if fmt != "factors":
                lowrank("load", str(out), cwd=work)  # the base checks out and the artifact applies
            n = size(out)
            print(f"| {name} | {fmt}{' ' + ' '.join(args) if args else ''} | {mib(n)} | {n / size(ckpt):.2%} "
                  f"| {n / weights:.2%} | {mib(size(ckpt))} | {mib(weights)} |", flush=True)
    # GLVQ: the quantized model of the 2-bit config, packed, against the full-precision checkpoint
    lowrank("fit", "--config", "configs/glvq/mlp_digits_fp.yaml", "--test_after_fit=false", "--run_id", "fp", cwd=work)
    lowrank("test", "--config", "configs/glvq/mlp_digits_2bit.yaml", "--run_id", "q", cwd=work)
    packed = work / "runs" / "glvq" / "mlp_digits_2bit" / "q" / "quantized.safetensors"
    fp_ckpt = work / "runs" / "glvq" / "mlp_digits_fp" / "fp" / "checkpoints" / "last.ckpt"
    weights = model_bytes(ROOT / "configs/glvq/mlp_digits_fp.yaml")
    state = torch.load(work / "runs" / "glvq" / "mlp_digits_2bit" / "q" / "quantized.pt", weights_only=True)
    codes = sum(v.numel() for k, v in state.items() if k.endswith(".packed"))
    print(f"| GLVQ 2-bit (digits MLP, both hidden layers) | quantized.safetensors ({codes:,} bytes of packed codes) "
          f"| {mib(size(packed))} | {size(packed) / size(fp_ckpt):.2%} | {size(packed) / weights:.2%} "
          f"| {mib(size(fp_ckpt))} | {mib(weights)} |")


if __name__ == "__main__":
    with recorded(__file__):
        main()
