"""SLURM detection, sbatch scripts, exact resume and DDP correctness (CPU, gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import MLP_CONFIG, ROOT, run_cli

SMALL = ["--trainer.limit_train_batches=4", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
         "--trainer.enable_model_summary=false", "--test_after_fit=false"]


def _weights(ckpt):
    return torch.load(ckpt, map_location="cpu", weights_only=False)["state_dict"]


def _only_run(folder):
    runs = [p for p in folder.iterdir() if p.is_dir()]
    assert len(runs) == 1, runs
    return runs[0]


# ----------------------------------------------------------------------------------------- sbatch
def _dry_run(*args):
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "submit", *args, "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_submit_dry_run_matches_counts():
    script = _dry_run("--config", "configs/baseline/vit_tiny_digits.yaml", "--nodes", "2", "--gpus-per-node", "4",
                      "--time", "02:00:00", "--partition", "gpu", "--account", "lab")
    assert "#SBATCH --nodes=2" in script
    assert "#SBATCH --ntasks-per-node=4" in script and "#SBATCH --gres=gpu:4" in script
    assert "#SBATCH --signal=SIGUSR1@90" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --account=lab" in script
    assert "TQDM_MINITERS" not in script and "export PYTHONUNBUFFERED=1" in script  # progress lines, not a bar
    launch = next(ln for ln in script.splitlines() if "lowrank_lit fit" in ln)
    assert launch.startswith("srun ")
    assert "--trainer.num_nodes=2" in launch and "--trainer.devices=4" in launch and "--trainer.strategy=ddp" in launch
    assert "--config configs/baseline/vit_tiny_digits.yaml" in launch


def test_submit_sweep_array():
    script = _dry_run("--sweep", "sweeps/baseline_mlp_digits.yaml", "--array", "4", "--trials-per-task", "2")
    assert "#SBATCH --array=0-3" in script and "#SBATCH --ntasks-per-node=1" in script
    launch = next(ln for ln in script.splitlines() if "lowrank_lit sweep" in ln)
    assert "--storage runs/sweeps/baseline_mlp_digits/study.journal" in launch
    assert '--seed "$SLURM_ARRAY_TASK_ID"' in launch and "--n-trials 2" in launch


def test_submit_without_sbatch_suggests_dry_run():
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "submit", "--config", str(MLP_CONFIG)], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "sbatch" in proc.stderr and "--dry-run" in proc.stderr


def test_submit_bad_time():
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "submit", "--config", str(MLP_CONFIG), "--time",
                           "two hours", "--dry-run"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and "--time='two hours'" in proc.stderr


# ----------------------------------------------------------------------------------------- SLURM environment
def test_trainer_selects_slurm_environment(run_root, monkeypatch):
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from lowrank_lit.launch.lightning_cli import LowrankCLI

    env = {"SLURM_JOB_ID": "9001", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2",
           "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "3", "SLURM_LOCALID": "1",
           "SLURM_NODELIST": "node[1-2]"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(sys, "argv", ["srun"])  # Lightning warns when not launched by srun
    cli = LowrankCLI(args=["--config", str(MLP_CONFIG), "--trainer.devices=2", "--trainer.num_nodes=2",
                           "--trainer.strategy=ddp", "--run_root", str(run_root)], run=False)
    cluster = cli.trainer.strategy.cluster_environment
    assert isinstance(cluster, SLURMEnvironment) and cluster.auto_requeue
    assert (cli.trainer.world_size, cli.trainer.global_rank, cli.trainer.local_rank, cli.trainer.node_rank) == (4, 3, 1, 1)
    assert cli.run_dir.run_id == "9001"
    assert cli.run_dir.path == run_root / "baseline" / "mlp_digits" / "9001"


# ----------------------------------------------------------------------------------------- resume
def test_resume_is_bit_identical(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run_cli("fit", "--config", MLP_CONFIG, "--trainer.max_epochs=3", *SMALL, run_root=full) == 0
    assert run_cli("fit", "--config", MLP_CONFIG, "--trainer.max_epochs=1", *SMALL, run_root=part) == 0
    interrupted = _only_run(part / "baseline" / "mlp_digits")
    after_one = _weights(interrupted / "checkpoints" / "last.ckpt")
    assert run_cli("fit", "--config", MLP_CONFIG, "--trainer.max_epochs=3", *SMALL, "--run_id", interrupted.name,
                   "--ckpt_path", "last", run_root=part) == 0
    reference = _weights(_only_run(full / "baseline" / "mlp_digits") / "checkpoints" / "last.ckpt")
    resumed = _weights(interrupted / "checkpoints" / "last.ckpt")
    assert any(not torch.equal(after_one[k], resumed[k]) for k in resumed)  # it did train further
    for k in reference:
        assert torch.equal(reference[k], resumed[k]), k


def test_reentering_a_run_without_ckpt_path_is_refused(run_root, capsys):
    assert run_cli("fit", "--config", MLP_CONFIG, "--trainer.max_epochs=1", *SMALL, run_root=run_root) == 0
    run = _only_run(run_root / "baseline" / "mlp_digits")
    before = (run / "checkpoints" / "last.ckpt").read_bytes()
    assert run_cli("fit", "--config", MLP_CONFIG, *SMALL, "--run_id", run.name, run_root=run_root) == 2
    assert "--ckpt_path last" in capsys.readouterr().err
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == before


# ----------------------------------------------------------------------------------------- DDP
@pytest.mark.parametrize("devices", [2])
def test_ddp_step_equals_single_process_step(tmp_path, devices):
    # Lightning always shuffles a training DistributedSampler (seed 0 here); running the single process
    # under the ddp strategy too gives it the same permutation, so its first batch of 64 is exactly
    # the union of the two ranks' first batches of 32
    common = ["fit", "--config", str(MLP_CONFIG), "--trainer.max_steps=1", "--trainer.limit_val_batches=0",
              "--trainer.accelerator=cpu", "--trainer.strategy=ddp", "--test_after_fit=false",
              "--model.init_args.backbone.init_args.dropout=0.0", "--trainer.enable_progress_bar=false"]
    env = {**os.environ, "PL_DISABLE_FORK": "0", "OMP_NUM_THREADS": "1"}
    env.pop("LOWRANK_RUN_DIR", None)
    single = subprocess.run([sys.executable, "-m", "lowrank_lit", *common, "--data.init_args.batch_size=64",
                             "--trainer.devices=1", "--run_root", str(tmp_path / "single")],
                            cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert single.returncode == 0, single.stderr[-2000:]
    ddp = subprocess.run([sys.executable, "-m", "lowrank_lit", *common, f"--data.init_args.batch_size={64 // devices}",
                          f"--trainer.devices={devices}",
                          "--run_root", str(tmp_path / "ddp")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert ddp.returncode == 0, ddp.stderr[-2000:]
    ddp_runs = [p for p in (tmp_path / "ddp" / "baseline" / "mlp_digits").iterdir()]
    assert len(ddp_runs) == 1  # both ranks wrote into rank 0's run directory
    ckpt_a = torch.load(_only_run(tmp_path / "single" / "baseline" / "mlp_digits") / "checkpoints" / "last.ckpt",
                        map_location="cpu", weights_only=False)
    ckpt_b = torch.load(ddp_runs[0] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt_a["global_step"] == ckpt_b["global_step"] == 1  # exactly one optimizer step each
    a, b = ckpt_a["state_dict"], ckpt_b["state_dict"]
    assert set(a) == set(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)
