"""Memory per GPU of the full-size training configs, from ``lowrank estimate`` (meta device, no weights read).

Hub models are built from ``config.json`` files with the public architecture values
(``tests/rehearsal/hub_configs/``) next to a small tokenizer; data are the rehearsal's fixtures in the real format
(their shapes are what matters: QADataModule pads every example to ``max_length``).

    python benchmarks/scale_estimates.py            # prints the markdown tables of docs/scale.md

The second table shards the same runs (configs/base/trainer_fsdp.yaml, activation checkpointing off and on) at the
paper's global batch: the fewest of 1, 2, 4, 8, ... GPUs and, for it, the largest per-GPU micro-batch that fits
80 GiB, the rest of the batch accumulated.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from timing import recorded  # noqa: E402  (benchmarks/timing.py: the script folder is on sys.path)

from lowrank_lit.launch.estimate import GiB, estimate, format_bytes  # noqa: E402
from tests.rehearsal import fixtures as fx  # noqa: E402

HUB = ROOT / "tests" / "rehearsal" / "hub_configs"


def _rows(tmp: Path) -> list[tuple[str, list[str]]]:
    tok = fx.bpe_tokenizer("PreTrainedTokenizerFast", {"bos_token": "<s>", "eos_token": "</s>"})
    llama1b = fx.architecture_folder(tmp / "Llama-3.2-1B-Instruct", HUB / "Llama-3.2-1B.json", tok)
    llama7b = fx.architecture_folder(tmp / "Llama-2-7b-hf", HUB / "Llama-2-7b-hf.json", tok)
    qa = fx.write_jsonl(tmp / "qa.jsonl", fx.qa_records(64))
    alpaca = fx.write_jsonl(tmp / "alpaca.jsonl", [{"instruction": r["question"], "input": r["context"], "output": r["answer"]}
                                                   for r in fx.qa_records(64)])
    text = fx.text_folder(tmp / "text", n_files=2, lines=2000)
    return [
        ("pt_moe/llama_1b_gpu", [f"--model.init_args.backbone={llama1b}", f"--data.init_args.tokenizer={llama1b}",
                                 f"--data.init_args.train_path={qa}", f"--data.init_args.val_path={qa}"]),
        ("lope/llama_gpu", [f"--model.init_args.backbone={llama7b}", f"--data.init_args.tokenizer={llama7b}",
                            f"--data.init_args.train_path={alpaca}", f"--data.init_args.val_path={alpaca}",
                            f"--data.init_args.test_path={alpaca}"]),
        ("pt_moe/llama_1b_gpu", [f"--model.init_args.backbone={llama1b}", f"--data.init_args.tokenizer={llama1b}",
                                 f"--data.init_args.train_path={qa}", f"--data.init_args.val_path={qa}",
                                 "--data.init_args.batch_size=16", "--trainer.accumulate_grad_batches=4"]),
        ("lope/llama_gpu", [f"--model.init_args.backbone={llama7b}", f"--data.init_args.tokenizer={llama7b}",
                            f"--data.init_args.train_path={alpaca}", f"--data.init_args.val_path={alpaca}",
                            f"--data.init_args.test_path={alpaca}", "--data.init_args.batch_size=1",
                            "--trainer.accumulate_grad_batches=32"]),
        ("is_lowrank/llama_gpu", [f"--data.init_args.root={text}", "--data.init_args.num_workers=0"]),
        ("nanoadam/llama_gpu", ["--model.init_args.init_from=null", f"--data.init_args.root={text}",
                                "--data.init_args.num_workers=0"]),
    ]


FSDP = ROOT / "configs" / "base" / "trainer_fsdp.yaml"


def _sharded(tmp: Path) -> None:
    print()
    print("| config | paper's batch | activation checkpointing | GPUs | per-GPU micro-batch x accumulation | "
          "sharded state per GPU | activations | total per GPU |")
    print("|---|---|---|---|---|---|---|---|")
    seen = set()
    for name, extra in _rows(tmp):
        if name in seen:
            continue
        seen.add(name)
        base = estimate(["--config", str(ROOT / "configs" / f"{name}.yaml"), *extra])
        paper = (base.batch_size or 1) * base.accumulate
        for checkpointing in (False, True):
            found = None
            for gpus in (1, 2, 4, 8, 16, 32):
                micro = max(1, min(base.batch_size or 1, paper // gpus))
                while found is None and micro >= 1:
                    e = estimate(["--config", str(ROOT / "configs" / f"{name}.yaml"), *extra, "--config", str(FSDP),
                                  f"--trainer.devices={gpus}", f"--data.init_args.batch_size={micro}",
                                  f"--trainer.strategy.init_args.activation_checkpointing={str(checkpointing).lower()}"])
                    if e.total <= 80 * GiB:
                        found = (gpus, micro, paper // (gpus * micro), e)
                    micro //= 2
                if found:
                    break
            on = "on" if checkpointing else "off"
            if found is None:
                print(f"| `{name}` | {paper} | {on} | > 32 | - | - | - | - |")
                continue
            gpus, micro, acc, e = found
            act = e.checkpointed_activations if checkpointing else e.activations
            print(f"| `{name}` | {paper} | {on} | {gpus} | {micro} x {acc} | {format_bytes(e.sharded_state(gpus))} | "
                  f"{'-' if act is None else format_bytes(act)} | {format_bytes(e.total)} |")


def main() -> None:
    print("| config | per-GPU batch x accumulation | parameters | trainable | weights | gradients | optimizer | "
          "activations (upper bound) | total per GPU | fits 80 GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in _rows(Path(tmp)):
            e = estimate(["--config", str(ROOT / "configs" / f"{name}.yaml"), *extra])
            act = "-" if e.activations is None else format_bytes(e.activations)
            print(f"| `{name}` | {e.batch_size} x {e.accumulate} | {e.parameters:,} | {e.trainable:,} | {format_bytes(e.weights)} | "
                  f"{format_bytes(e.gradients)} | {format_bytes(e.optimizer)} | {act} | {format_bytes(e.total)} | "
                  f"{'yes' if e.total <= 80 * GiB else 'no'} |")
        _sharded(Path(tmp))


if __name__ == "__main__":
    with recorded(__file__):
        main()
