"""Scale rehearsal: every GPU / real-data config runs its header command end to end on CPU.

Each test writes a tiny model of the config's family with the family's own writer (``save_pretrained``, a
checkpoint in the format the config loads) and fixture data in the on-disk format the header documents, runs the
header command through the real CLI with only path overrides, the CPU and a step limit (plus the sizes of
architectures the config itself defines), and checks the logged metric and the run's files. Configs that train
also reload their checkpoint with ``lowrank test --ckpt_path``. DDP configs run as 2 gloo processes.

``python -m pytest -m rehearsal`` (a few minutes on 2 cores); docs/scale.md lists what each proves.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lowrank_lit.report import Run, last_values
from tests.helpers import CONFIGS, ROOT, run_cli
from tests.rehearsal import fixtures as fx

pytestmark = pytest.mark.rehearsal

QUIET = ["--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]
CPU = ["--trainer.accelerator=cpu", "--trainer.devices=1", *QUIET]
#: two gloo processes, and a check that they end with the same weights
DDP = ["--trainer.accelerator=cpu", "--trainer.devices=2", *QUIET, "--trainer.callbacks+=tests.rehearsal.fixtures.RankAgreement"]
#: a few optimizer steps with one validation pass
FIT_STEPS = ["--trainer.max_steps=2", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
             "--trainer.val_check_interval=2", "--trainer.check_val_every_n_epoch=null", "--trainer.log_every_n_steps=1"]


def _command(config: str, label: str = "Run") -> list[str]:
    commands = fx.header_commands(CONFIGS / config)
    assert label in commands, f"{config}: no '# {label}: lowrank ...' line in its header"
    return commands[label]


def _only_run(root: Path) -> Path:
    runs = [p.parent for p in root.rglob("config.yaml") if "wandb" not in p.parts]
    assert len(runs) == 1, runs
    return runs[0]


def _rehearse(config: str, paths: dict[str, str], extra: list[str], run_root: Path, label: str = "Run",
              processes: int = 1) -> Path:
    """Run the header command of ``config`` with fixture paths; returns its run directory."""
    args = fx.with_overrides(_command(config, label), paths, extra)
    if processes == 1:
        assert run_cli(*args, run_root=run_root) == 0
    else:  # Lightning's subprocess launcher starts the other ranks (gloo on CPU)
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-m", "lowrank_lit", *args, "--run_root", str(run_root)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return _only_run(run_root)


def _finite(run: Path, *keys: str) -> dict[str, float]:
    metrics = Run(run).metrics
    for key in keys:
        assert key in metrics and math.isfinite(metrics[key]), (key, sorted(metrics))
    return metrics


def _reload(config: str, run: Path, paths: dict[str, str], extra: list[str], run_root: Path, sub: str = "test") -> Path:
    """``lowrank test --ckpt_path <run>/checkpoints/last.ckpt`` (or ``validate``) through the same config and paths."""
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()
    fit = _command(config)
    args = [sub, *fx.with_overrides(fit[1:], paths, extra), f"--ckpt_path={ckpt}", "--test_after_fit=false"]
    assert run_cli(*args, run_root=run_root) == 0
    return _only_run(run_root)


# ----------------------------------------------------------------------------------------- STRank, CaPT
def test_strank_real_slides(tmp_path):
    rng = np.random.default_rng(0)
    feats, counts = [], []
    for k in range(3):
        f, c = tmp_path / f"s{k}_feats.npy", tmp_path / f"s{k}_counts.npy"
        np.save(f, rng.normal(size=(300, 512)).astype(np.float32))  # CONCH-width embeddings
        np.save(c, rng.poisson(rng.gamma(2.0, 2.0, size=(1, 80)), size=(300, 80)))  # 80 genes, 50 kept
        feats.append(str(f))
        counts.append(str(c))
    paths = {"data.init_args.features": "[" + ", ".join(feats) + "]", "data.init_args.counts": "[" + ", ".join(counts) + "]"}
    run = _rehearse("strank/real_slides.yaml", paths, [*CPU, *FIT_STEPS], tmp_path / "runs")
    _finite(run, "val/spearman", "test/spearman")
    assert (run / "predictions.csv").is_file()
    _finite(_reload("strank/real_slides.yaml", run, paths, [*CPU, "--trainer.limit_test_batches=2"], tmp_path / "re"),
            "test/spearman")


def test_capt_user_text_csv(tmp_path):
    import csv

    def write(name: str, n: int, seed: int) -> str:
        path = tmp_path / name
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label", "domain"])
            for i, s in enumerate(fx.sentences(n, seed)):
                w.writerow([s, ["neg", "pos"][i % 2], ["news", "reviews"][i % 3 == 0]])
        return str(path)

    paths = {"data.init_args.train_path": write("train.csv", 64, 0), "data.init_args.val_path": write("val.csv", 32, 1),
             "data.init_args.test_path": write("test.csv", 32, 2)}
    run = _rehearse("capt/user_text_csv.yaml", paths, [*CPU, *FIT_STEPS, "--trainer.limit_test_batches=1"],
                    tmp_path / "runs")
    _finite(run, "val/acc", "test/acc")
    _reload("capt/user_text_csv.yaml", run, paths, [*CPU, "--trainer.limit_test_batches=1"], tmp_path / "re")


# ----------------------------------------------------------------------------------------- Q3R, ReservoirTTA
@pytest.fixture
def cifar10(tmp_path, monkeypatch):
    """The CIFAR-10 python pickles; torchvision's md5 check of the release files is the one thing bypassed."""
    monkeypatch.setattr("torchvision.datasets.cifar.check_integrity", lambda *args, **kwargs: True)
    return fx.cifar10_python(tmp_path / "cifar10")


@pytest.mark.parametrize("config", ["q3r/vit_tiny_cifar10.yaml", "q3r/vit_tiny_cifar10_adamw.yaml"])
def test_q3r_vit_tiny_cifar10(tmp_path, cifar10, config):
    paths = {"data.init_args.data_dir": cifar10}
    extra = [*CPU, *FIT_STEPS, "--trainer.limit_test_batches=1", "--data.init_args.val_size=20"]
    run = _rehearse(config, paths, extra, tmp_path / "runs", )
    _finite(run, "train/loss_step", "val/acc", "test/acc")
    if "adamw" not in config:
        assert (run / "truncation.csv").is_file()
    _reload(config, run, paths, [*CPU, "--trainer.limit_test_batches=1", "--data.init_args.val_size=20"], tmp_path / "re")


def test_reservoir_tta_csc_cifar10c(tmp_path, cifar10):
    # the source model: the header's "First:" step (a CIFAR-10 ViT-Tiny run), then the TTA stream on its checkpoint
    source = _rehearse("q3r/vit_tiny_cifar10_adamw.yaml", {"data.init_args.data_dir": cifar10},
                       [*CPU, *FIT_STEPS, "--test_after_fit=false", "--data.init_args.val_size=20"], tmp_path / "src",
                       )
    from lowrank_lit.data.cifar_c import CIFAR10C_CORRUPTIONS

    data = fx.cifar10_c(tmp_path / "CIFAR-10-C", CIFAR10C_CORRUPTIONS)
    paths = {"data.init_args.data_dir": data, "data.init_args.cifar10_dir": cifar10,
             "model.init_args.source_ckpt": str(source / "checkpoints" / "last.ckpt")}
    extra = [*CPU, "--data.init_args.recurrences=1", "--data.init_args.batch_size=10",
             "--model.init_args.method.init_args.n_source_styles=20", "--model.init_args.method.init_args.buffer_size=16"]
    run = _rehearse("reservoir_tta/csc_cifar10c.yaml", paths, extra, tmp_path / "runs")
    _finite(run, "test/error")
    assert (run / "tta_batches.csv").is_file()


def _grid_components(grid: str, axis: str, tmp_path: Path) -> dict[str, Path]:
    """Each component of a grid axis as a config fragment file (what `lowrank matrix` layers onto the base)."""
    import yaml

    from lowrank_lit.launch.matrix import load_grid

    out = {}
    for name, fragment in load_grid(ROOT / "grids" / grid).axes[axis].items():
        out[name] = tmp_path / f"{axis}.{name}.yaml"
        out[name].write_text(yaml.safe_dump(fragment or {}))
    return out


def test_tta_table_cifar10c(tmp_path, cifar10):
    """Every method of grids/tta_cifar10c.yaml, the reservoir plug-in and every stream order on the CIFAR-10-C
    release layout, through the header command of configs/tta/cifar10c_tent.yaml."""
    source = _rehearse("q3r/vit_tiny_cifar10_adamw.yaml", {"data.init_args.data_dir": cifar10},
                       [*CPU, *FIT_STEPS, "--test_after_fit=false", "--data.init_args.val_size=20"], tmp_path / "src")
    from lowrank_lit.data.cifar_c import CIFAR10C_CORRUPTIONS

    data = fx.cifar10_c(tmp_path / "CIFAR-10-C", CIFAR10C_CORRUPTIONS)
    paths = {"data.init_args.data_dir": data, "data.init_args.cifar10_dir": cifar10,
             "model.init_args.source_ckpt": str(source / "checkpoints" / "last.ckpt")}
    small = [*CPU, "--data.init_args.recurrences=1", "--data.init_args.batch_size=10",
             "--data.init_args.corruptions=[gaussian_noise, fog, contrast]"]
    methods = _grid_components("tta_cifar10c.yaml", "method", tmp_path)
    plugins = _grid_components("tta_cifar10c.yaml", "plugin", tmp_path)
    cells = [("method", m, [], "csc") for m in methods]
    cells += [("stream", s, [], s) for s in ("cdc", "mixed", "correlated", "gradual")]
    cells.append(("plugin", "reservoir", ["--config", str(plugins["reservoir"]),
                                          "--model.init_args.plugin.init_args.n_source_styles=4",
                                          "--model.init_args.plugin.init_args.buffer_size=16"], "csc"))
    for axis, name, more, stream in cells:
        frag = ["--config", str(methods[name])] if axis == "method" else []
        run = _rehearse("tta/cifar10c_tent.yaml", paths, [*small, *frag, *more, f"--data.init_args.setting={stream}"],
                        tmp_path / "runs" / f"{axis}_{name}")
        metrics = _finite(run, "test/error", "cost/step_s", "test/state_mb")
        if stream == "mixed":
            assert metrics["test/domains_per_batch"] > 1


def test_tta_table_imagenetc(tmp_path):
    """Every method of grids/tta_imagenetc.yaml (TRUST included) and every stream order on the ImageNet-C release
    layout with a tiny VMamba, through the header command of configs/tta/imagenetc_tent.yaml."""
    from lowrank_lit.data.imagenet_c import IMAGENET_C_CORRUPTIONS

    data = fx.imagenet_c(tmp_path / "ImageNet-C", IMAGENET_C_CORRUPTIONS[:3], classes=3, per_class=2, severities=(1, 2, 3, 4, 5))
    model = ["--model.init_args.model.init_args.dim=[8, 16, 32, 64]", "--model.init_args.model.init_args.depth=[1, 1, 2, 1]",
             "--model.init_args.model.init_args.img_size=32", "--data.init_args.img_size=32", "--data.init_args.resize=36"]
    from lowrank_lit.models.vmamba import TinyVMamba

    torch.manual_seed(0)
    ckpt = tmp_path / "vmamba.pth"
    torch.save(TinyVMamba(in_chans=3, num_classes=1000, dim=[8, 16, 32, 64], depth=[1, 1, 2, 1], d_state=1, img_size=32,
                          stem_stride=4, norm="ln2d", ssm_bias=False).state_dict(), ckpt)
    paths = {"data.init_args.data_dir": data, "model.init_args.source_ckpt": str(ckpt)}
    small = [*CPU, *model, "--data.init_args.batch_size=3", "--data.init_args.num_workers=0",
             f"--data.init_args.corruptions=[{', '.join(IMAGENET_C_CORRUPTIONS[:3])}]"]
    for name, frag in _grid_components("tta_imagenetc.yaml", "method", tmp_path).items():
        run = _rehearse("tta/imagenetc_tent.yaml", paths, [*small, "--config", str(frag)], tmp_path / "runs" / name)
        _finite(run, "test/error", "test/state_mb")
    for name, frag in _grid_components("tta_imagenetc.yaml", "stream", tmp_path).items():
        run = _rehearse("tta/imagenetc_tent.yaml", paths, [*small, "--config", str(frag)], tmp_path / "runs" / f"stream_{name}")
        _finite(run, "test/error", "test/label_entropy", "test/domains_per_batch")
        if name == "mixed":
            assert last_values(run / "metrics.csv")["test/domains_per_batch"] > 1


# ----------------------------------------------------------------------------------------- IS-LowRank -> NanoAdam
TINY_LLAMA = ["--model.init_args.backbone.init_args.hidden_size=32", "--model.init_args.backbone.init_args.num_layers=2",
              "--model.init_args.backbone.init_args.num_heads=4", "--model.init_args.backbone.init_args.intermediate_size=64",
              "--model.init_args.backbone.init_args.context=32", "--data.init_args.context=32",
              "--data.init_args.batch_size=4", "--data.init_args.num_workers=0"]


def test_is_lowrank_then_nanoadam_llama(tmp_path):
    text = fx.text_folder(tmp_path / "text")
    paths = {"data.init_args.root": text, "data.init_args.pattern": "**/*.txt"}
    extra = [*CPU, *FIT_STEPS, *TINY_LLAMA, "--model.init_args.optimizer.init_args.rank=8",
             "--model.init_args.optimizer.init_args.update_proj_gap=1"]
    run = _rehearse("is_lowrank/llama_gpu.yaml", paths, extra, tmp_path / "pre")
    _finite(run, "train/loss", "val/loss")
    assert (run / "subspace.csv").is_file()
    _reload("is_lowrank/llama_gpu.yaml", run, paths, [*CPU, *TINY_LLAMA, "--trainer.limit_test_batches=1"], tmp_path / "re")
    # NanoAdam fine-tunes the checkpoint the pretraining run wrote (its header's init_from)
    paths = {"model.init_args.init_from": str(run / "checkpoints" / "last.ckpt"), "data.init_args.root": text}
    tuned = _rehearse("nanoadam/llama_gpu.yaml", paths, [*CPU, *FIT_STEPS, *TINY_LLAMA], tmp_path / "tune")
    _finite(tuned, "train/loss", "val/loss")


def test_tiny_fixture_models_load_with_their_auto_classes(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name, writer in (("llama", fx.tiny_llama), ("qwen2", fx.tiny_qwen2), ("gpt_neo", fx.tiny_gpt_neo)):
        path = writer(tmp_path / name)
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert model.config.model_type == name and tok.eos_token_id is not None
        ids = tok("The river runs north", return_tensors="pt").input_ids
        assert torch.isfinite(model(ids).logits).all()


# ----------------------------------------------------------------------------------------- PT-MoE, Skrull, SeDPO
def _pt_moe_paths(tmp_path: Path) -> dict[str, str]:
    """A tiny Llama (hidden 64) at the config's model path and QA train / dev files."""
    model = fx.tiny_llama(tmp_path / "Llama-3.2-1B-Instruct", hidden=64)
    return {"data.init_args.train_path": fx.write_jsonl(tmp_path / "qa" / "train.jsonl", fx.qa_records(48, 0)),
            "data.init_args.val_path": fx.write_jsonl(tmp_path / "qa" / "dev.jsonl", fx.qa_records(16, 1)),
            "model.init_args.backbone": model, "data.init_args.tokenizer": model}


def test_pt_moe_llama_1b(tmp_path):
    paths = _pt_moe_paths(tmp_path)
    extra = [*CPU, *FIT_STEPS, "--model.init_args.prompt.init_args.hidden=64", "--data.init_args.batch_size=8"]
    run = _rehearse("pt_moe/llama_1b_gpu.yaml", paths, extra, tmp_path / "runs")
    _finite(run, "train/loss_step", "val/loss", "val/token_acc")
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    # what trains only: the prompt; the frozen Llama is read from its folder again
    assert any(".prompt." in k for k in ckpt["state_dict"]) and not any(".layers." in k for k in ckpt["state_dict"])
    _finite(_reload("pt_moe/llama_1b_gpu.yaml", run, paths, [*CPU, "--trainer.limit_val_batches=1", extra[-2]], tmp_path / "re",
                    sub="validate"), "val/loss")


def test_skrull_sft_jsonl_ddp(tmp_path):
    model = fx.tiny_qwen2(tmp_path / "Qwen2.5-0.5B")
    rng = np.random.default_rng(0)
    records = [{"text": " ".join(fx.sentences(int(rng.integers(1, 12)), seed=i))} for i in range(64)]
    paths = {"data.init_args.jsonl": fx.write_jsonl(tmp_path / "sft.jsonl", records),
             "model.init_args.model.init_args.name_or_path": model, "data.init_args.tokenizer": model}
    extra = [*DDP, "--trainer.max_steps=2", "--trainer.log_every_n_steps=1", "--data.init_args.global_batch_size=8",
             "--model.init_args.model.init_args.dtype=float32"]
    run = _rehearse("skrull/sft_jsonl_gpu.yaml", paths, extra, tmp_path / "runs", processes=2)
    _finite(run, "train/loss")
    fx.ranks_agree(run)


def test_icl_gptneo_score_ddp_then_sedpo_fit(tmp_path):
    import random

    from lowrank_lit.data.icl import sentiment_records
    from lowrank_lit.methods.icl_rank_retriever import ScoreCache

    rng = random.Random(0)
    files = {name: fx.write_jsonl(tmp_path / "task" / f"{name}.jsonl", sentiment_records(n, rng, start_id=start))
             for name, n, start in (("pool", 60, 0), ("train", 6, 1000), ("test", 3, 2000))}
    cache = str(tmp_path / "task" / "score_cache")
    data = {"data.init_args.pool_path": files["pool"], "data.init_args.train_path": files["train"],
            "data.init_args.test_path": files["test"], "data.init_args.cache_dir": cache}
    neo = fx.tiny_gpt_neo(tmp_path / "gpt-neo-2.7B")
    # stage 1 on 2 ranks: each scores its shard of the (query, candidate) jobs into its own cache file
    _rehearse("icl_rank_retriever/gptneo_score_gpu.yaml", {**data, "model.init_args.scorer.init_args.backbone": neo},
              ["--trainer.accelerator=cpu", "--trainer.devices=2", *QUIET], tmp_path / "score",
              processes=2)
    shards = [{(r["query_id"], r["candidate_id"]) for r in map(json.loads, (Path(cache) / f"scores.rank{k}.jsonl").open())}
              for k in (0, 1)]
    assert shards[0] and shards[1] and not shards[0] & shards[1]  # the ranks scored disjoint shards
    assert len(ScoreCache(cache).load()) == 6 * 50 + 3 * 60  # every job scored once
    # stage 2: the BERT towers train on the cached scores (no scorer loaded)
    bert = fx.tiny_bert(tmp_path / "bert-base-uncased")
    paths = {**data, "data.init_args.tokenizer": bert, "model.init_args.query_encoder.init_args.backbone": bert,
             "model.init_args.exemplar_encoder.init_args.backbone": bert}
    run = _rehearse("icl_rank_retriever/gptneo_gpu.yaml", paths, [*CPU, *FIT_STEPS, "--trainer.limit_test_batches=1"],
                    tmp_path / "runs")
    _finite(run, "train/loss_step", "test/spearman")
    _reload("icl_rank_retriever/gptneo_gpu.yaml", run, paths, [*CPU, "--trainer.limit_test_batches=1"], tmp_path / "re")


# ----------------------------------------------------------------------------------------- TRUST, Shallow Diffuse
TINY_VMAMBA = ["--model.init_args.model.init_args.dim=[8, 16, 32, 64]", "--model.init_args.model.init_args.depth=[1, 1, 2, 1]",
               "--model.init_args.model.init_args.img_size=32", "--data.init_args.img_size=32", "--data.init_args.resize=36"]


def test_trust_vmamba_tiny_imagenet_c(tmp_path):
    from lowrank_lit.cli import main
    from lowrank_lit.data.imagenet_c import IMAGENET_C_CORRUPTIONS
    from tests.test_vmamba import _official_shapes

    data = fx.imagenet_c(tmp_path / "ImageNet-C", IMAGENET_C_CORRUPTIONS, classes=3, per_class=2)
    # the source checkpoint: weights in the official release's layout, converted as the header says
    g = torch.Generator().manual_seed(0)
    official = {k: torch.randn(shape, generator=g) * 0.05 for k, shape in _official_shapes([1, 1, 2, 1], [8, 16, 32, 64]).items()}
    torch.save({"model": official}, tmp_path / "vssm1_tiny.pth")
    assert main(["convert", "vmamba", "--src", str(tmp_path / "vssm1_tiny.pth"), "--out", str(tmp_path / "vmamba_t.pth"),
                 "--depths", "1", "1", "2", "1"]) == 0
    paths = {"data.init_args.data_dir": data, "model.init_args.source_ckpt": str(tmp_path / "vmamba_t.pth")}
    run = _rehearse("trust/vmamba_tiny_imagenetc_gpu.yaml", paths, [*CPU, *TINY_VMAMBA], tmp_path / "runs")
    _finite(run, "test/error")
    rows = Run(run).rows("tta_batches.csv")
    assert len({r["domain"] for r in rows}) == len(IMAGENET_C_CORRUPTIONS)  # every corruption was visited


def test_shallow_diffuse_sd21(tmp_path):
    model_dir = fx.tiny_stable_diffusion(tmp_path / "stable-diffusion-2-1-base")
    assert {"unet", "vae", "text_encoder", "tokenizer", "scheduler"} <= {p.name for p in Path(model_dir).iterdir()}
    paths = {"model.init_args.denoiser.init_args.model_dir": model_dir}
    run = _rehearse("shallow_diffuse/sd21_gpu.yaml", paths, [*CPU, "--data.init_args.n=4", "--data.init_args.batch_size=2",
                    "--model.init_args.steps=5"], tmp_path / "runs")
    metrics = _finite(run, "test/auc_clean", "test/tpr1_clean")
    assert 0.0 <= metrics["test/auc_clean"] <= 1.0
    assert (run / "watermark_scores.csv").is_file() and (run / "roc.png").is_file()


# ----------------------------------------------------------------------------------------- 3DPE-Gaze
def test_gaze_3dpe_real_ddp(tmp_path):
    # the parameter encoder at the config's width, from the prior-domain pretraining config (a few batches)
    enc = _rehearse("gaze_3dpe/param_encoder_prior.yaml", {}, [*CPU, "--trainer.max_epochs=1", "--trainer.limit_train_batches=2",
                    "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1", "--model.init_args.encoder.init_args.width=64",
                    "--data.init_args.train_size=64", "--data.init_args.val_size=32", "--data.init_args.test_size=32"],
                    tmp_path / "enc")
    csvs = fx.gaze_folder(tmp_path / "gaze", {"eth_xgaze_train": 16, "eth_xgaze_val": 8, "mpiifacegaze": 8, "eyediap": 8})
    paths = {"data.init_args.root": str(tmp_path / "gaze"), "data.init_args.train_csv": csvs["eth_xgaze_train"],
             "data.init_args.val_csv": csvs["eth_xgaze_val"],
             "data.init_args.test_csvs": f"{{mpiifacegaze: {csvs['mpiifacegaze']}, eyediap: {csvs['eyediap']}}}",
             "model.init_args.encoder_ckpt": str(enc / "checkpoints" / "last.ckpt")}
    extra = [*DDP, "--trainer.max_epochs=2", "--model.init_args.stage1_epochs=1", "--trainer.limit_train_batches=1",
             "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1", "--data.init_args.batch_size=4",
             "--data.init_args.num_workers=0", "--trainer.log_every_n_steps=1"]
    run = _rehearse("gaze_3dpe/real_gpu.yaml", paths, extra, tmp_path / "runs", processes=2)
    _finite(run, "test/angle_deg", "test/mpiifacegaze/angle_deg", "test/eyediap/angle_deg")
    fx.ranks_agree(run)


# ----------------------------------------------------------------------------------------- LoPE
def _lope_paths(tmp_path: Path) -> dict[str, str]:
    """A tiny Llama at the config's model path and Alpaca-style train / dev / test files."""
    model = fx.tiny_llama(tmp_path / "Llama-2-7b-hf")
    alpaca = [{"instruction": r["question"], "input": r["context"], "output": r["answer"]} for r in fx.qa_records(64, 0)]
    return {"model.init_args.backbone": model, "data.init_args.tokenizer": model,
            "data.init_args.train_path": fx.write_jsonl(tmp_path / "train.jsonl", alpaca[:40]),
            "data.init_args.val_path": fx.write_jsonl(tmp_path / "dev.jsonl", alpaca[40:52]),
            "data.init_args.test_path": fx.write_jsonl(tmp_path / "test.jsonl", alpaca[52:])}


def test_lope_llama(tmp_path):
    paths = _lope_paths(tmp_path)
    # 4 steps: stage I (A and B_D, noisy copies, embedding noise) for 2, then stage II
    extra = [*CPU, "--trainer.max_epochs=-1", "--trainer.max_steps=4", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
             "--trainer.limit_test_batches=1", "--trainer.log_every_n_steps=1", "--trainer.callbacks.init_args.stage1_steps=2",
             "--data.init_args.batch_size=8", "--data.init_args.max_length=64"]
    run = _rehearse("lope/llama_gpu.yaml", paths, extra, tmp_path / "runs")
    metrics = _finite(run, "train/loss_step", "val/loss", "test/loss", "test/poison_share_clean", "test/poison_share_noisy")
    assert 0.0 <= metrics["test/poison_share_clean"] <= 1.0
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    trained = [k for k in state if ".lora_" in k]
    assert trained and all(".lora_" in k or not k.startswith("lm.") for k in state)  # adapters only: the Llama is re-read
    _reload("lope/llama_gpu.yaml", run, paths, [*CPU, "--trainer.limit_test_batches=1", "--data.init_args.max_length=64"],
            tmp_path / "re")


# ----------------------------------------------------------------------------------------- sharded (FSDP2), 2 gloo ranks
#: the FSDP fragment on two CPU processes (fp32: bf16 matmuls on the CPU are slow and change nothing rehearsed)
SHARDED = ["--config", str(ROOT / "configs" / "base" / "trainer_fsdp.yaml"), "--trainer.accelerator=cpu",
           "--trainer.devices=2", "--trainer.strategy.init_args.mixed_precision=none", *QUIET]


def _consolidated(run: Path) -> dict[str, torch.Tensor]:
    """The sharded run's last.ckpt: one file whose tensors have the whole model's shapes (not 1/world shards)."""
    ckpt = run / "checkpoints" / "last.ckpt"
    assert ckpt.is_file(), ckpt
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def test_sharded_is_lowrank_then_nanoadam_llama(tmp_path):
    text = fx.text_folder(tmp_path / "text")
    paths = {"data.init_args.root": text, "data.init_args.pattern": "**/*.txt"}
    extra = [*SHARDED, *FIT_STEPS, *TINY_LLAMA, "--model.init_args.optimizer.init_args.rank=8",
             "--model.init_args.optimizer.init_args.update_proj_gap=1"]
    run = _rehearse("is_lowrank/llama_gpu.yaml", paths, [*extra, "--trainer.callbacks+=tests.rehearsal.fixtures.ShardBytes"],
                    tmp_path / "pre", processes=2)
    _finite(run, "train/loss", "val/loss")
    # memory per rank, measured on the tensors, against lowrank estimate's sharded line at this size
    from lowrank_lit.launch.estimate import estimate

    measured = json.loads((run / "shard_bytes.json").read_text())["ranks"]
    est = estimate(fx.with_overrides(_command("is_lowrank/llama_gpu.yaml"), paths, extra)[1:])
    assert est.sharded and est.devices == 2
    for rank, (weights, grads, state) in enumerate(measured):
        total = weights + grads + state
        assert abs(total / est.sharded_state(2) - 1) < 0.10, (rank, measured, est.sharded_state(2))
    state = _consolidated(run)
    (embed,) = [v for k, v in state.items() if k.endswith("embed_tokens.weight")]
    assert embed.shape[1] == 32 and embed.shape[0] > 32  # the whole table (vocabulary x hidden 32), not a shard
    _reload("is_lowrank/llama_gpu.yaml", run, paths, [*CPU, *TINY_LLAMA, "--trainer.limit_test_batches=1"], tmp_path / "re")
    paths = {"model.init_args.init_from": str(run / "checkpoints" / "last.ckpt"), "data.init_args.root": text}
    tuned = _rehearse("nanoadam/llama_gpu.yaml", paths, [*SHARDED, *FIT_STEPS, *TINY_LLAMA], tmp_path / "tune", processes=2)
    _finite(tuned, "train/loss", "val/loss")
    _reload("nanoadam/llama_gpu.yaml", tuned, paths, [*CPU, *TINY_LLAMA, "--trainer.limit_test_batches=1"], tmp_path / "re2")


def test_sharded_pt_moe_llama_1b(tmp_path):
    paths = _pt_moe_paths(tmp_path)
    extra = [*SHARDED, *FIT_STEPS, "--model.init_args.prompt.init_args.hidden=64", "--data.init_args.batch_size=8"]
    run = _rehearse("pt_moe/llama_1b_gpu.yaml", paths, extra, tmp_path / "runs", processes=2)
    _finite(run, "train/loss_step", "val/loss")
    state = _consolidated(run)
    assert any(".prompt." in k for k in state) and not any(".layers." in k for k in state)  # trained part only
    _finite(_reload("pt_moe/llama_1b_gpu.yaml", run, paths, [*CPU, "--trainer.limit_val_batches=1", extra[-2]],
                    tmp_path / "re", sub="validate"), "val/loss")


def test_sharded_lope_llama(tmp_path):
    paths = _lope_paths(tmp_path)
    extra = [*SHARDED, "--trainer.max_epochs=-1", "--trainer.max_steps=4", "--trainer.limit_train_batches=2",
             "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=1", "--trainer.log_every_n_steps=1",
             "--trainer.callbacks.init_args.stage1_steps=2", "--data.init_args.batch_size=8",
             "--data.init_args.max_length=64", "--test_after_fit=false"]
    run = _rehearse("lope/llama_gpu.yaml", paths, extra, tmp_path / "runs", processes=2)
    _finite(run, "train/loss_step", "val/loss")
    state = _consolidated(run)
    assert [k for k in state if ".lora_" in k]
    _reload("lope/llama_gpu.yaml", run, paths, [*CPU, "--trainer.limit_test_batches=1", "--data.init_args.max_length=64"],
            tmp_path / "re")
