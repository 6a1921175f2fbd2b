"""Run-directory ids: SLURM job ids, array tasks, interactive jobs, re-entry and W&B online detection."""

from __future__ import annotations

import pytest

from lowrank_lit.launch.checks import wandb_online_allowed
from lowrank_lit.launch.config_yaml import experiment_from_configs
from lowrank_lit.launch.run_dir import resolve_run_dir, slurm_run_id
from lowrank_lit.report import keep_previous


def test_fresh_ids_never_reuse_a_directory(tmp_path):
    a = resolve_run_dir(tmp_path, "exp/one")
    b = resolve_run_dir(tmp_path, "exp/one")
    assert a.path != b.path and a.path.parent == b.path.parent == tmp_path / "exp" / "one"
    assert not a.resumed and not b.resumed


def test_slurm_job_id_is_the_run_id(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert slurm_run_id() == "4242"
    first = resolve_run_dir(tmp_path, "exp")
    assert first.run_id == "4242" and not first.resumed
    (first.path / "metrics.csv").write_text("step\n1\n")
    again = resolve_run_dir(tmp_path, "exp")  # the requeued job
    assert again.path == first.path and again.resumed
    assert (first.path / "metrics.csv").is_file()  # nothing moved until the re-entry is accepted
    keep_previous(again.path, "metrics.csv")  # what the run's CSV logger does at its first save
    # Lightning's CSVLogger would delete metrics.csv; the previous attempt's metrics are kept aside
    assert (first.path / "metrics.1.csv").read_text() == "step\n1\n"
    assert first.wandb_id == again.wandb_id == "exp-4242"


def test_slurm_array_task(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4300")
    monkeypatch.setenv("SLURM_JOB_NAME", "sweep")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "4299")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm_run_id() == "4299_3"


@pytest.mark.parametrize("name", ["bash", "interactive"])
def test_interactive_allocation_gets_fresh_ids(name, tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NAME", name)
    assert slurm_run_id() is None
    assert resolve_run_dir(tmp_path, "exp").path != resolve_run_dir(tmp_path, "exp").path


def test_ddp_worker_inherits_rank0_directory(tmp_path, monkeypatch):
    rank0 = resolve_run_dir(tmp_path, "exp")
    monkeypatch.setenv("LOWRANK_RUN_DIR", str(rank0.path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_run_dir(tmp_path, "exp").path == rank0.path


@pytest.mark.parametrize("bad", ["../escape", "a/../b", "with space", ""])
def test_bad_experiment_names(bad, tmp_path):
    with pytest.raises(ValueError, match="experiment="):
        resolve_run_dir(tmp_path, bad)


def test_bad_run_id(tmp_path):
    with pytest.raises(ValueError, match="run_id="):
        resolve_run_dir(tmp_path, "exp", run_id="a/b")


@pytest.mark.parametrize(
    ("env", "online"),
    [
        ({}, False),
        ({"WANDB_MODE": "online"}, True),
        ({"WANDB_API_KEY": "x" * 40}, True),
        ({"WANDB_API_KEY": "x" * 40, "WANDB_MODE": "offline"}, False),
        ({"WANDB_API_KEY": "x" * 40, "WANDB_MODE": "disabled"}, False),
    ],
)
def test_wandb_online_detection(env, online, tmp_path):
    assert wandb_online_allowed({"HOME": str(tmp_path), **env}) is online


def test_wandb_key_in_netrc(tmp_path):
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert wandb_online_allowed({"HOME": str(tmp_path)})
    assert not wandb_online_allowed({"HOME": str(tmp_path), "WANDB_BASE_URL": "https://wandb.example.org"})


@pytest.mark.parametrize(
    ("paths", "expected"),
    [
        (["configs/baseline/mlp_digits.yaml"], "baseline/mlp_digits"),
        (["configs/base/trainer_cpu.yaml", "/abs/repo/configs/q3r/vit.yaml"], "q3r/vit"),
        (["callbacks/wandb.yaml"], "wandb"),
        ([], "default"),
    ],
)
def test_experiment_name_from_configs(paths, expected):
    assert experiment_from_configs(paths) == expected
