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
    pytest.param(["fit", "--config", str(CONFIGS / "peft_bench" / "lope_noisy_noisyonly.yaml"),
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
    assert _snapshot(tmp_path) == before  # nothing created, removed or changed
