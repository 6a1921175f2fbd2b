"""Bad inputs a researcher gives in the first hours: each is refused by the real command line in one line.

Every case runs ``python -m lowrank_lit ...`` in a fresh folder that already holds a finished run, and asserts a
non-zero exit, exactly one non-empty line on stderr with no traceback, that the line names the argument, and that no
file or folder under the folder (the run root included) was created, removed or changed (listing and hashes before
and after). docs/cli.md lists these lines.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import CONFIGS, ROOT

MLP = str(CONFIGS / "baseline" / "mlp_digits.yaml")
Q3R = str(CONFIGS / "q3r" / "mlp_digits.yaml")

_NO_GPU = pytest.mark.skipif("__import__('torch').cuda.is_available()", reason="checks the message on a machine without a GPU")
_NOT_ROOT = pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0,
                               reason="a read-only folder is writable by root: the refusal is checked as another user")


def _folder(tmp: Path) -> None:
    """What a user's working folder holds: a finished run, and the files the cases name."""
    import torch

    old = tmp / "runs" / "baseline" / "mlp_digits" / "old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "metrics.csv").write_text("epoch,step,val/acc\n0,10,0.9\n")
    (old / "config.yaml").write_text("seed_everything: 0\n")
    (tmp / "empty.ckpt").touch()
    (tmp / "afile").write_text("not a folder\n")
    (tmp / "broken.yaml").write_text("trainer:\n  max_epochs: [1\n bad: : x\n")
    (tmp / "somefolder").mkdir()
    # a GLVQ test run's quantized model (not a training checkpoint)
    glvq = tmp / "runs" / "glvq" / "mlp_digits_2bit" / "q"
    glvq.mkdir(parents=True)
    (glvq / "config.yaml").write_text((CONFIGS / "glvq" / "mlp_digits_2bit.yaml").read_text())
    torch.save({"backbone.net.0.weight": torch.zeros(2, 2)}, glvq / "quantized.pt")
    # a LoRA run's checkpoint: another model class than the Q3R config builds
    lora = tmp / "runs" / "lope" / "lora" / "r"
    (lora / "checkpoints").mkdir(parents=True)
    (lora / "config.yaml").write_text("model:\n  class_path: lowrank_lit.models.text.PromptTunedClassifier\n")
    torch.save({"state_dict": {}, "epoch": 0, "global_step": 1}, lora / "checkpoints" / "last.ckpt")
    (tmp / "dup.yaml").write_text("trainer:\n  max_epochs: 1\n  max_epochs: 2\n")
    (tmp / "empty.yaml").write_text("# nothing here\n")
    (tmp / "list.yaml").write_text("- trainer\n- model\n")
    (tmp / "dupsweep.yaml").write_text("method: grid\nmethod: random\nmetric: {name: val/loss}\n")
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o555)


def _snapshot(tmp: Path) -> dict[str, str]:
    """Every file (its sha256) and folder (``<dir>``) below ``tmp``."""
    out = {}
    for p in sorted(tmp.rglob("*")):
        rel = str(p.relative_to(tmp))
        out[rel] = "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# (argv, what the one stderr line must contain: the argument it names); relative names are files of _folder
CASES = [
    # config files
    pytest.param(["fit", "--config", "does/not/exist.yaml"], "--config: file 'does/not/exist.yaml' does not exist", id="missing-config"),
    pytest.param(["fit", "--config", str(CONFIGS / "baseline")], "--config: ", id="folder-as-config"),
    pytest.param(["fit", "--config", "broken.yaml"], "--config: broken.yaml: line 3, column 5: YAML syntax error", id="yaml-syntax"),
    pytest.param(["estimate", "--config", "configs/nope.yaml"], "--config: file 'configs/nope.yaml' does not exist", id="estimate-missing-config"),
    # keys and values
    pytest.param(["fit", "--config", MLP, "--model.init_args.bogus_key=1"], "model.init_args.bogus_key", id="unknown-key"),
    pytest.param(["fit", "--config", MLP, "--model.init_args.backbone.init_args.widht=3"],
                 "model.init_args.backbone.init_args.widht", id="unknown-nested-key"),
    pytest.param(["fit", "--config", MLP, "--trainer.max_epoch=3"], "did you mean --trainer.max_epochs", id="key-typo"),
    pytest.param(["fit", "--config", MLP, "--trainer.max_epochs=abc"], "trainer.max_epochs", id="epochs-not-int"),
    pytest.param(["fit", "--config", MLP, "--data.init_args.image_size=0"], "image_size", id="image-size-0"),
    pytest.param(["fit", "--config", MLP, "--seed_everything=abc"], "--seed_everything='abc': allowed: an integer seed", id="seed-abc"),
    pytest.param(["fit", "--config", MLP, "--model.init_args.optimizer.init_args.lr=-1e-3"],
                 "model.init_args.optimizer.init_args.lr=-0.001; allowed: a number > 0", id="negative-lr"),
    pytest.param(["fit", "--config", MLP, "--model.init_args.optimizer.init_args.lr=0"],
                 "model.init_args.optimizer.init_args.lr=0", id="zero-lr"),
    # our learning rates are typed (lowrank_lit.argtypes.LearningRate): the parser refuses them
    pytest.param(["fit", "--config", str(CONFIGS / "masked_block_icl" / "compute_limited.yaml"), "--model.init_args.lr=0"],
                 "model.init_args.lr='0'; allowed: a number > 0 (a learning rate)", id="typed-lr-zero"),
    pytest.param(["test", "--config", str(CONFIGS / "tta" / "digits_rotta.yaml"), "--model.init_args.method.init_args.lr=abc"],
                 "model.init_args.method.init_args.lr='abc'; allowed: a number > 0", id="typed-lr-not-a-number"),
    pytest.param(["fit", "--config", MLP, "--trainer.max_epochs=-3"],
                 "trainer.max_epochs=-3; allowed: -1 (no limit), 0 or a positive integer", id="negative-epochs"),
    pytest.param(["fit", "--config", MLP, "--trainer.max_epochs=0"], "trainer.max_epochs=0 trains nothing", id="zero-epochs"),
    pytest.param(["fit", "--config", MLP, "--trainer.max_steps=0"], "trainer.max_steps=0 trains nothing", id="zero-steps"),
    # typed choices: the library checks them against the signature, the line names the choices
    pytest.param(["fit", "--config", MLP, "--run.verb=train"], "run.verb='train'; allowed: fit, validate, test, predict",
                 id="run-verb"),
    pytest.param(["test", "--config", str(CONFIGS / "tta" / "digits_lame.yaml"), "--model.init_args.method.init_args.affinity=cosine"],
                 "model.init_args.method.init_args.affinity='cosine'; allowed: rbf, knn, linear", id="lame-affinity"),
    pytest.param(["test", "--config", str(CONFIGS / "glvq" / "mlp_digits_2bit.yaml"), "--trainer.callbacks.init_args.codebook=e8"],
                 "trainer.callbacks.init_args.codebook='e8'; allowed: integer, symmetric", id="glvq-codebook"),
    pytest.param(["fit", "--config", str(CONFIGS / "peft_suite" / "lope_noisy_noisyonly.yaml"),
                  "--trainer.callbacks.init_args.stage1_inputs=clean"],
                 "stage1_inputs='clean'; allowed: original_and_noisy, noisy_only", id="lope-stage1-inputs"),
    # checkpoints
    pytest.param(["fit", "--config", MLP, "--ckpt_path", "empty.ckpt"], "--ckpt_path='empty.ckpt' is empty", id="fit-empty-ckpt"),
    pytest.param(["test", "--config", MLP, "--ckpt_path", "empty.ckpt"], "--ckpt_path='empty.ckpt' is empty", id="test-empty-ckpt"),
    pytest.param(["validate", "--config", MLP, "--ckpt_path", "empty.ckpt"], "--ckpt_path='empty.ckpt' is empty",
                 id="validate-empty-ckpt"),
    pytest.param(["test", "--config", MLP, "--ckpt_path", "somefolder"], "--ckpt_path='somefolder' is a folder", id="folder-as-ckpt"),
    pytest.param(["test", "--config", Q3R, "--ckpt_path", "runs/lope/lora/r/checkpoints/last.ckpt"],
                 "was trained as PromptTunedClassifier", id="ckpt-of-another-model"),
    # run directories
    pytest.param(["fit", "--config", MLP, "--run_root", "afile"], "--run_root='afile': 'afile' is a file", id="run-root-is-a-file"),
    pytest.param(["fit", "--config", MLP, "--run_root", "ro/runs"], "--run_root='ro/runs'", id="read-only-run-root",
                 marks=_NOT_ROOT),
    pytest.param(["fit", "--config", MLP, "--run_id", "実験-α"], "--run_id='実験-α'; allowed: ASCII letters", id="unicode-run-id"),
    pytest.param(["fit", "--config", MLP, "--run_id", "../../../escape"], "--run_id='../../../escape'; allowed", id="escaping-run-id"),
    pytest.param(["fit", "--config", MLP, "--experiment", "my exp/α β"], "--experiment='my exp/α β'; allowed", id="experiment-spaces"),
    # data you bring, GPUs
    pytest.param(["fit", "--config", str(CONFIGS / "strank" / "real_slides.yaml")], "--data.init_args.features=",
                 id="real-slides-without-paths"),
    pytest.param(["fit", "--config", str(CONFIGS / "capt" / "user_text_csv.yaml"), "--data.init_args.train_path=/nope/train.csv"],
                 "data.init_args.train_path='/nope/train.csv': no such file or folder", id="capt-user-csv"),
    pytest.param(["fit", "--config", str(CONFIGS / "strank" / "real_slides.yaml"), "--data.init_args.features=[a.npy, b.npy]",
                  "--data.init_args.counts=[a.npy, b.npy]"], "data.init_args.features[0]='a.npy': no such file or folder",
                 id="real-slides-missing-files"),
    pytest.param(["fit", "--config", str(CONFIGS / "gaze_3dpe" / "real_gpu.yaml")], "trainer.accelerator='gpu', but no GPU",
                 id="gaze-real-gpu", marks=_NO_GPU),
    pytest.param(["test", "--config", str(CONFIGS / "trust" / "vmamba_tiny_imagenetc_gpu.yaml")],
                 "trainer.accelerator='gpu', but no GPU", id="gpu-config-on-cpu", marks=_NO_GPU),
    pytest.param(["estimate", "--config", str(CONFIGS / "lope" / "llama_gpu.yaml")], "--model.init_args.backbone=",
                 id="estimate-offline-hub-name"),
    # components refusing their arguments at setup
    pytest.param(["fit", "--config", Q3R, "--trainer.callbacks.init_args.targets=[backbone.nope]"],
                 "Q3R: targets: pattern matches no module: 'backbone.nope' (module names: backbone,", id="q3r-target"),
    pytest.param(["test", "--config", str(CONFIGS / "shallow_diffuse" / "gaussian_shallow_diffuse.yaml"),
                  "--model.init_args.channel=3"], "RingKey: channel=3; allowed: 0..0 for 1 channels", id="shallow-diffuse-channel"),
    pytest.param(["test", "--config", str(CONFIGS / "shallow_diffuse" / "gaussian_shallow_diffuse.yaml"),
                  "--model.init_args.radius=0"], "RingKey: radius=0; allowed: an integer in 1..", id="shallow-diffuse-radius-0"),
    # our commands
    pytest.param(["sweep", str(ROOT / "sweeps" / "q3r.yaml"), "--n-trials", "0"], "--n-trials=0; allowed: a positive integer",
                 id="sweep-zero-trials"),
    pytest.param(["sweep", MLP], "is not a sweep file", id="sweep-on-a-plain-config"),
    pytest.param(["sweep", str(ROOT / "sweeps" / "q3r.yaml"), "--run-root", "afile"], "--run-root='afile'", id="sweep-run-root-file"),
    pytest.param(["sweep", str(ROOT / "sweeps" / "q3r.yaml"), "--run-root", "ro/runs"], "--run-root='ro/runs'",
                 id="sweep-read-only-run-root", marks=_NOT_ROOT),
    pytest.param(["export", "--ckpt_path", "runs/glvq/mlp_digits_2bit/q/quantized.pt", "--out", "exp"],
                 "is not a Lightning training checkpoint", id="export-quantized-pt"),
    pytest.param(["export", "--ckpt_path", "runs/lope/lora/r/checkpoints/last.ckpt", "--out", "ro/exp"], "--out='ro/exp'",
                 id="export-read-only-out", marks=_NOT_ROOT),
    pytest.param(["submit", "--config", MLP, "--nodes", "0"], "--nodes=0", id="submit-zero-nodes"),
    pytest.param(["summarize", "q3r", "nope"], "'nope' does not exist", id="summarize-missing-root"),
    pytest.param(["nope"], "unknown command 'nope'", id="unknown-command"),
    # seeds, names that cannot be file names
    pytest.param(["fit", "--config", MLP, "--seed_everything=-1"], "--seed_everything=-1: allowed: an integer seed in "
                 "0..4294967295", id="seed-negative"),
    pytest.param(["fit", "--config", MLP, "--seed_everything=4294967296"], "--seed_everything=4294967296: allowed",
                 id="seed-too-large"),
    pytest.param(["fit", "--config", MLP, "--run_id", "x" * 300], "(300 characters)'; allowed: at most 128 characters",
                 id="run-id-too-long"),
    pytest.param(["fit", "--config", MLP, "--experiment", "a/" + "x" * 300], "a folder name of 300 characters; allowed",
                 id="experiment-too-long"),
    # files a command reads: a key given twice, an empty file, a list
    pytest.param(["fit", "--config", MLP, "--config", "dup.yaml"],
                 "--config: dup.yaml: line 3: key 'max_epochs' is given twice in one mapping (first at line 2)", id="yaml-duplicate-key"),
    pytest.param(["fit", "--config", "empty.yaml"], "--config: empty.yaml is empty; allowed: a YAML mapping", id="yaml-empty"),
    pytest.param(["fit", "--config", "list.yaml"], "--config: list.yaml: line 1: the file holds a YAML list", id="yaml-list"),
    pytest.param(["sweep", "dupsweep.yaml"], "dupsweep.yaml: line 2: key 'method' is given twice", id="sweep-duplicate-key"),
    pytest.param(["matrix", "--config", MLP, "--grid", "empty.yaml", "--check"], "--grid: empty.yaml is empty",
                 id="grid-empty"),
    # numeric options of every verb, a negative value after a space included
    pytest.param(["estimate", "--config", MLP, "--gpu-memory=0"], "--gpu_memory='0'; allowed: a number > 0", id="estimate-gpu-memory-0"),
    pytest.param(["estimate", "--config", MLP, "--gpu-memory", "-8"], "--gpu_memory='-8'; allowed: a number > 0",
                 id="estimate-gpu-memory-negative"),
    pytest.param(["sweep", str(ROOT / "sweeps" / "q3r.yaml"), "--n-trials", "-3"], "--n-trials=-3; allowed: a positive integer",
                 id="sweep-negative-trials"),
    pytest.param(["sweep", str(ROOT / "sweeps" / "q3r.yaml"), "--seed", "-1"], "--seed='-1'; allowed: an integer in 0..4294967295",
                 id="sweep-negative-seed"),
    pytest.param(["submit", "--config", MLP, "--array", "-2", "--dry-run"], "--array='-2'; allowed: an integer > 0",
                 id="submit-negative-array"),
    pytest.param(["submit", "--config", MLP, "--cpus-per-task", "0", "--dry-run"], "--cpus_per_task='0'; allowed: an integer > 0",
                 id="submit-zero-cpus"),
    pytest.param(["matrix", "--config", MLP, "--grid", str(ROOT / "grids" / "adapter_optimizers.yaml"), "--limit", "-1",
                  "--check"], "--limit='-1'; allowed: an integer >= 0", id="matrix-negative-limit"),
    pytest.param(["export", "--ckpt_path", "runs/lope/lora/r/checkpoints/last.ckpt", "--out", "exp", "--format", "factors",
                  "--keep", "0"], "--keep='0'; allowed: a number in (0, 1]", id="export-keep-0"),
    pytest.param(["export", "--ckpt_path", "runs/lope/lora/r/checkpoints/last.ckpt", "--out", "exp", "--keep", "0.5"],
                 "--keep applies to --format factors only", id="export-keep-without-factors"),
    pytest.param(["export", "--ckpt_path", "runs/lope/lora/r/checkpoints/last.ckpt", "--out", "exp", "--format", "npz"],
                 "--format: 'npz'; allowed: native, peft, hf, factors", id="export-unknown-format"),
    pytest.param(["convert", "vmamba", "--src", "afile", "--out", "o.pth", "--depths", "2", "0"],
                 "--depths=2 0; allowed: one integer >= 1 per stage", id="convert-zero-depth"),
    # what the run would do differently from what it says
    pytest.param(["fit", "--config", MLP, "--trainer.precision=16-mixed"], "trainer.precision='16-mixed' needs a GPU",
                 id="fp16-on-cpu", marks=_NO_GPU),
    pytest.param(["fit", "--config", MLP, "--data.init_args.batch_size=0"], "batch_size=0; allowed: an integer >= 1",
                 id="batch-size-0"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(("argv", "needle"), CASES)
def test_bad_input_is_one_line_and_touches_nothing(argv, needle, tmp_path):
    _folder(tmp_path)
    before = _snapshot(tmp_path)
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    if argv[0] == "estimate":
        env.pop("HF_HUB_OFFLINE")  # estimate goes offline by itself (no half minute of hub retries)
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", *argv], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    assert needle in lines[0], lines[0]
    assert not any(ln.startswith("run ") for ln in proc.stdout.splitlines()), proc.stdout  # names no run directory
    assert _snapshot(tmp_path) == before  # nothing created, removed or changed


# ------------------------------------------------------------------------------------ resuming with another config
#: a short run (3 steps) of the baseline and one of Q3R, each with a checkpoint and its config.yaml
SHORT = ["--trainer.max_steps=3", "--trainer.limit_val_batches=1", "--test_after_fit=false"]
Q3R_ADAMW = str(CONFIGS / "q3r" / "mlp_digits_adamw.yaml")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tests.helpers import run_cli

    root = tmp_path_factory.mktemp("trained")
    assert run_cli("fit", "--config", MLP, *SHORT, "--run_id", "r", run_root=root / "runs") == 0
    assert run_cli("fit", "--config", Q3R, *SHORT, "--run_id", "q", run_root=root / "runs") == 0
    return root


RESUME_CASES = [
    pytest.param([MLP, "--run_id", "r", "--ckpt_path", "last", "--model.init_args.optimizer.init_args.lr=0.5"],
                 "model.init_args.optimizer.init_args.lr 0.001 -> 0.5", id="resume-changed-lr"),
    pytest.param([MLP, "--run_id", "r", "--ckpt_path", "last", "--model.init_args.backbone.init_args.hidden=[64]"],
                 "model.init_args.backbone.init_args.hidden [256, 128] -> [64]", id="resume-changed-architecture"),
    pytest.param([MLP, "--run_id", "r", "--ckpt_path", "last", "--model.init_args.backbone.init_args.hidden=[64]",
                  "--resume_changes=apply"], "does not load into what this config builds (RuntimeError: ",
                 id="resume-apply-what-cannot-load"),
    pytest.param([MLP, "--run_id", "r", "--ckpt_path", "last", "--resume_changes=maybe"],
                 "resume_changes='maybe'; allowed: refuse, apply", id="resume-changes-choice"),
    pytest.param([Q3R_ADAMW, "--ckpt_path", "runs/q3r/mlp_digits/q/checkpoints/last.ckpt"],
                 "trainer.callbacks ['TruncationEval', 'Q3R'] -> ['TruncationEval']", id="resume-another-methods-checkpoint"),
    pytest.param([MLP, "--ckpt_path", "runs/q3r/mlp_digits/q/checkpoints/last.ckpt"], "data.init_args.",
                 id="resume-another-models-checkpoint"),
]


@pytest.mark.e2e
@pytest.mark.parametrize(("args", "needle"), RESUME_CASES)
def test_a_resume_with_another_config_is_one_line_and_touches_nothing(args, needle, tmp_path, trained):
    import shutil

    shutil.copytree(trained, tmp_path, dirs_exist_ok=True)
    before = _snapshot(tmp_path)
    argv = ["fit", "--config", *args, "--trainer.max_steps=6", "--test_after_fit=false"]
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", *argv], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}, timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
    assert needle in lines[0], lines[0]
    assert _snapshot(tmp_path) == before
