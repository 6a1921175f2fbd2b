"""Interrupted runs resume where they stopped: last.ckpt at every epoch end, every N steps and on a signal.

The end-to-end tests interrupt a real ``lowrank fit`` subprocess with a signal in the middle of an
epoch, resume it with the command it prints (the README's ``--run_id <id> --ckpt_path last``) and
compare with an uninterrupted run of the same seed: the weights must be identical.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from lowrank_lit.callbacks import ResumeCheckpoint
from lowrank_lit.data.loader import ResumableDataLoader
from tests.helpers import MLP_CONFIG, ROOT, quiet_trainer, run_cli, run_dirs

EPOCHS = ["--trainer.max_epochs=5"]


def _step_lines(tmp_path: Path) -> Path:
    """A config fragment printing a progress line after every step (so the test knows where the run is)."""
    frag = tmp_path / "step_lines.yaml"
    frag.write_text(
        "trainer:\n  callbacks+:\n    - class_path: lowrank_lit.callbacks.LogProgress\n"
        "      init_args:\n        every_n_steps: 1\n"
    )
    return frag


def _slow_batches(tmp_path: Path) -> Path:
    """20 ms per batch, so the signal sent at a batch line lands within a few batches on a busy machine."""
    frag = tmp_path / "slow.yaml"
    frag.write_text("trainer:\n  callbacks+:\n    - class_path: tests.helpers.SlowBatches\n")
    return frag


def _lowrank(args: list[str], run_root: Path, signal_at: str | None = None, sig: int = signal.SIGINT,
             env: dict[str, str] | None = None):
    """Run ``lowrank`` as a subprocess; send ``sig`` when a stdout line starts with ``signal_at``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **(env or {})}
    cmd = [sys.executable, "-m", "lowrank_lit", *args, "--run_root", str(run_root)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sent = False
    out = []
    assert proc.stdout is not None
    for line in proc.stdout:
        out.append(line)
        if signal_at and not sent and line.startswith(signal_at):
            proc.send_signal(sig)
            sent = True
    err = proc.stderr.read() if proc.stderr else ""
    proc.wait(timeout=300)
    assert not signal_at or sent, f"never saw {signal_at!r}:\n{''.join(out)}"
    return proc.returncode, "".join(out), err


def _only_run(folder: Path) -> Path:
    runs = run_dirs(folder)
    assert len(runs) == 1, runs
    return runs[0]


def _state(run: Path) -> dict:
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    return {"step": ckpt["global_step"], "epoch": ckpt["epoch"], "weights": ckpt["state_dict"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("reference")
    rc, out, err = _lowrank(["fit", "--config", str(MLP_CONFIG), *EPOCHS], root)
    assert rc == 0, err
    return _state(_only_run(root)), re.search(r"test/acc (\S+)", out).group(1)


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1], ids=lambda s: signal.Signals(s).name)
def test_interrupted_run_resumes_to_the_uninterrupted_result(sig, tmp_path, reference):
    ref_state, ref_acc = reference
    frag = _step_lines(tmp_path)
    args = ["fit", "--config", str(MLP_CONFIG), "--config", str(frag), "--config", str(_slow_batches(tmp_path)), *EPOCHS]
    # stop in the middle of epoch 2 (20 batches per epoch): the batch in flight finishes, then last.ckpt is written
    rc, out, err = _lowrank(args, tmp_path / "runs", signal_at="epoch 2/5  batch 7/20", sig=sig)
    name = signal.Signals(sig).name
    assert rc == 128 + sig, (rc, err)
    assert f"interrupted by {name}" in err
    err_before = err
    run = _only_run(tmp_path / "runs")
    assert str(run) in err and str(run) in out  # where the run is: at the start and after the interruption
    stopped = _state(run)
    assert 20 < stopped["step"] < 40, stopped["step"]  # mid-epoch, not at the last epoch boundary
    resume = re.search(r"resume with: (.*)", err).group(1)
    assert resume.endswith(f"--run_id {run.name} --ckpt_path last")
    assert json.loads((run / "unfinished.json").read_text())["ended"] == f"interrupted by {name}"  # left out of summaries
    rc, out, err = _lowrank(shlex.split(resume)[1:], tmp_path / "runs")  # exactly the printed command
    assert rc == 0, err
    assert f"resumed at step {stopped['step']}, in epoch 2" in out  # the epoch as the progress and the interruption count it
    assert f"at step {stopped['step']}, in epoch 2" in err_before
    final = _state(run)
    assert not (run / "unfinished.json").exists()
    assert final["step"] == ref_state["step"] == 100
    for key, value in ref_state["weights"].items():
        assert torch.equal(final["weights"][key], value), key
    assert re.search(r"test/acc (\S+)", out).group(1) == ref_acc


def _slurm_env(tmp_path: Path) -> dict[str, str]:
    """A one-task SLURM batch job (Lightning detects SLURM) with a fake ``scontrol`` that records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.calls'}\n")
    fake.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "777", "SLURM_JOB_NAME": "train",
            "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
            "SLURM_NODELIST": "localhost"}


@pytest.mark.e2e
def test_slurm_requeue_resumes_the_newest_checkpoint_and_tests_the_final_weights(tmp_path, reference):
    """SIGUSR1 (SLURM's warning before the time limit) stops at a batch boundary, writes last.ckpt and requeues;
    the requeued command resumes from the newest checkpoint of the run, not an older hpc_ckpt_*, and the test
    after fit sees the final weights (the test/acc of an uninterrupted run)."""
    ref_state, ref_acc = reference
    env = _slurm_env(tmp_path)
    args = ["fit", "--config", str(MLP_CONFIG), "--config", str(_step_lines(tmp_path)),
            "--config", str(_slow_batches(tmp_path)), *EPOCHS]
    root = tmp_path / "runs"
    rc, out, err = _lowrank(args, root, signal_at="epoch 2/5  batch 7/20", sig=signal.SIGUSR1, env=env)
    assert rc == 128 + signal.SIGUSR1, err
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "777"]
    run = root / "baseline" / "mlp_digits" / "777"
    first = _state(run)
    assert 20 < first["step"] < 40
    # an older checkpoint beside it, as Lightning's own handler writes before training starts
    (run / "hpc_ckpt_1.ckpt").write_bytes((run / "checkpoints" / "last.ckpt").read_bytes())
    rc, out, err = _lowrank(args, root, signal_at="epoch 4/5  batch 7/20", sig=signal.SIGTERM, env=env)  # requeued
    assert rc == 128 + signal.SIGTERM, err
    second = _state(run)
    assert second["step"] > 60
    rc, out, err = _lowrank(args, root, env=env)  # requeued again: runs to the end
    assert rc == 0, err
    assert f"resuming from {run / 'checkpoints' / 'last.ckpt'}" in out
    assert f"resumed at step {second['step']}, in epoch 4" in out
    final = _state(run)
    assert final["step"] == ref_state["step"]
    for key, value in ref_state["weights"].items():
        assert torch.equal(final["weights"][key], value), key
    assert re.search(r"test/acc (\S+)", out).group(1) == ref_acc
    assert sorted(p.name for p in run.glob("metrics*.csv")) == ["metrics.1.csv", "metrics.2.csv", "metrics.csv"]


@pytest.mark.e2e
def test_checkpoint_preset_keeps_last_at_every_epoch(tmp_path):
    """With callbacks/checkpoint.yaml (best by val/loss), last.ckpt still follows every epoch."""
    args = ["fit", "--config", str(MLP_CONFIG), "--config", str(ROOT / "callbacks" / "checkpoint.yaml"), *EPOCHS]
    rc, _, err = _lowrank(args, tmp_path / "runs", signal_at="epoch 4/5", sig=signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, err
    run = _only_run(tmp_path / "runs")
    assert _state(run)["step"] >= 80  # at least the end of epoch 4, whatever val/loss did
    assert sorted(p.name for p in (run / "checkpoints").glob("last*.ckpt")) == ["last.ckpt"]
    assert len(list((run / "checkpoints").glob("best-*.ckpt"))) == 1


@pytest.mark.e2e
def test_ckpt_path_last_without_checkpoint_is_an_error(run_root, capsys):
    """`--ckpt_path last` never silently trains from scratch, and leaves no orphan directory."""
    assert run_cli("fit", "--config", MLP_CONFIG, "--ckpt_path", "last", run_root=run_root) == 2
    err = capsys.readouterr().err
    assert "--ckpt_path last" in err and "--run_id" in err and len(err.strip().splitlines()) == 1
    assert not any(p.is_dir() for p in (run_root / "baseline" / "mlp_digits").glob("*"))
    empty = run_root / "baseline" / "mlp_digits" / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    (empty / "config.yaml").write_text("seed_everything: 0\n")
    assert run_cli("fit", "--config", MLP_CONFIG, "--run_id", "empty", "--ckpt_path", "last", run_root=run_root) == 2
    err = capsys.readouterr().err
    assert "no checkpoint to resume" in err and str(empty) in err
    assert sorted(p.name for p in empty.iterdir()) == ["checkpoints", "config.yaml"]  # nothing touched


# ----------------------------------------------------------------------------------------- loader
def _batches(loader, n=None):
    it = iter(loader)
    return [x.clone() for (x,) in (it if n is None else (next(it) for _ in range(n)))]


@pytest.mark.parametrize("use_generator", [False, True])
def test_resumable_loader_replays_the_epoch_and_keeps_the_rng(use_generator):
    data = TensorDataset(torch.arange(50.0))

    def make():
        gen = torch.Generator().manual_seed(3) if use_generator else None
        return ResumableDataLoader(data, batch_size=4, shuffle=True, generator=gen)

    torch.manual_seed(0)
    plain = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                        generator=torch.Generator().manual_seed(3) if use_generator else None)
    expected = _batches(plain)
    torch.manual_seed(0)
    first = make()
    seen = _batches(first, n=5)
    assert all(torch.equal(a, b) for a, b in zip(seen, expected[:5], strict=True))  # same order as a DataLoader
    state = first.state_dict()
    assert state["consumed"] == 5
    second = make()
    second.load_state_dict(state)
    rng_before = torch.get_rng_state()
    rest = _batches(second)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the replay does not move the global RNG
    assert len(rest) == len(expected) - 5
    assert all(torch.equal(a, b) for a, b in zip(rest, expected[5:], strict=True))
    # a finished epoch resumes as a fresh epoch
    assert second.state_dict() == {"epoch_rng": None, "consumed": 0, "sampler_epoch": None}


def test_resumable_loader_rejects_bad_state():
    loader = ResumableDataLoader(TensorDataset(torch.zeros(4)), batch_size=2)
    with pytest.raises(ValueError, match="consumed"):
        loader.load_state_dict({"epoch_rng": None})
    with pytest.raises(ValueError, match="consumed=-1"):
        loader.load_state_dict({"epoch_rng": torch.get_rng_state(), "consumed": -1})


# ----------------------------------------------------------------------------------------- callback
class _Recording(ResumeCheckpoint):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.saved: list[tuple[int, int, bool]] = []

    def _save(self, trainer, at_epoch_end):
        key = (trainer.current_epoch, trainer.global_step, at_epoch_end)
        if not self.saved or self.saved[-1] != key:
            self.saved.append(key)
        return None


@pytest.mark.e2e
def test_every_n_train_steps_and_epoch_ends(tmp_path):
    from lightning.pytorch.demos.boring_classes import BoringModel

    cb = _Recording(dirpath=str(tmp_path), every_n_train_steps=3)
    trainer = quiet_trainer(max_epochs=2, limit_train_batches=5, limit_val_batches=1, callbacks=[cb], enable_checkpointing=True, default_root_dir=str(tmp_path))
    trainer.fit(BoringModel())
    assert cb.saved == [(0, 3, False), (0, 5, True), (1, 6, False), (1, 9, False), (1, 10, True)]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [({"every_n_train_steps": -1}, "every_n_train_steps"), ({"stop_signals": ["SIGKILL"]}, "SIGINT, SIGTERM, SIGUSR1"),
     ({"filename": "a/b"}, "filename")],
)
def test_resume_checkpoint_bad_arguments(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ResumeCheckpoint(**kwargs)
