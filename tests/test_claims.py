"""A run directory belongs to one live run: two starts on one run id, a killed run's claim, the claim's own rules."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowrank_lit.launch.run_dir import CLAIM_FILE, RunDirError, claim_run_dir, release_claims, resolve_run_dir
from tests.helpers import MLP_CONFIG, ROOT

FIT = ["fit", "--config", str(MLP_CONFIG), "--trainer.max_epochs=3", "--test_after_fit=false", "--run_id", "X",
       "--run_root", "runs"]
ENV = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
#: 0.25 s after every batch (about 17 s over three epochs): the first run is still live when the second reaches its
#: claim, even when the second process starts seconds later on a machine busy with other tests and other pairs
SLOW = ["--trainer.callbacks+=tests.helpers.SlowBatches", "--trainer.callbacks.init_args.seconds=0.25"]


def _start(cwd: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "lowrank_lit", *FIT, *extra], cwd=cwd, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.e2e
def test_two_runs_started_together_on_one_run_id_one_runs_alone_the_other_is_refused(tmp_path):
    """Ten times: two `lowrank fit --run_id X` processes started at once (three epochs slowed by 0.25 s a batch, so
    the first is still live when the second starts on a loaded machine); one runs and its files are byte-identical
    to a solo run's, the other is refused in one line naming the live run (host, pid) and writes nothing. The pairs
    run in two waves of five, each pair in its own folder (the solo run beside the first wave)."""
    solo = tmp_path / "solo"
    solo.mkdir()
    solo_proc = _start(solo, *SLOW)
    outcomes = {}
    for wave in (range(5), range(5, 10)):
        pairs = {}
        for i in wave:
            (tmp_path / f"pair{i}").mkdir()
            pairs[i] = [_start(tmp_path / f"pair{i}", *SLOW), _start(tmp_path / f"pair{i}", *SLOW)]
        for i, pair in pairs.items():
            outcomes[i] = [(p, *p.communicate(timeout=300)) for p in pair]
    _, err = solo_proc.communicate(timeout=300)
    assert solo_proc.returncode == 0, err[-2000:]
    want = _files(solo / "runs" / "baseline" / "mlp_digits" / "X")
    assert CLAIM_FILE not in want and "checkpoints/last.ckpt" in want  # the claim is gone once the run ends
    for i, results in sorted(outcomes.items()):
        codes = sorted(p.returncode for p, _, _ in results)
        assert codes == [0, 2], (i, [(p.returncode, e[-1500:]) for p, _, e in results])
        loser = next(r for r in results if r[0].returncode == 2)
        lines = [ln for ln in loser[2].splitlines() if ln.strip()]
        assert len(lines) == 1 and "is in use by a live run (host " in lines[0] and ", pid " in lines[0], loser[2]
        assert _files(tmp_path / f"pair{i}" / "runs" / "baseline" / "mlp_digits" / "X") == want, f"pair {i}"


@pytest.mark.e2e
def test_a_killed_runs_claim_never_blocks_its_resume(tmp_path):
    """kill -9 leaves the claim file behind; the resume command takes it over (the pid is dead on this host)."""
    proc = _start(tmp_path, "--trainer.max_epochs=30")
    run = tmp_path / "runs" / "baseline" / "mlp_digits" / "X"
    deadline = time.time() + 120
    while not (run / "checkpoints" / "last.ckpt").is_file() and time.time() < deadline:
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    claim = json.loads((run / CLAIM_FILE).read_text())
    assert claim["pid"] == proc.pid and claim["host"] == socket.gethostname()  # left behind by the killed run
    again = subprocess.run([sys.executable, "-m", "lowrank_lit", *FIT, "--trainer.max_epochs=2", "--ckpt_path", "last"],
                           cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert not (run / CLAIM_FILE).exists()


@pytest.mark.e2e
def test_claim_rules(tmp_path, monkeypatch):
    """A live claim is refused naming host and pid; a dead pid's claim is taken over; another host's claim is live
    unless it is an earlier attempt of this SLURM job; DDP workers and other nodes do not claim."""
    run = tmp_path / "r"
    run.mkdir()
    live = {"host": socket.gethostname(), "pid": os.getppid(), "start": None, "slurm_job": None, "slurm_restart": 0}
    (run / CLAIM_FILE).write_text(json.dumps(live))
    with pytest.raises(RunDirError, match=rf"in use by a live run \(host {socket.gethostname()}, pid {os.getppid()}\)"):
        claim_run_dir(run)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (run / CLAIM_FILE).write_text(json.dumps({**live, "pid": int(dead.stdout)}))
    claim_run_dir(run)  # the pid is gone: taken over
    assert json.loads((run / CLAIM_FILE).read_text())["pid"] == os.getpid()
    release_claims()
    assert not (run / CLAIM_FILE).exists()
    (run / CLAIM_FILE).write_text(json.dumps({**live, "host": "other-node", "pid": 1}))
    with pytest.raises(RunDirError, match="host other-node, pid 1"):
        claim_run_dir(run)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    (run / CLAIM_FILE).write_text(json.dumps({**live, "host": "other-node", "pid": 1, "slurm_job": "77"}))
    claim_run_dir(run)  # the requeued job resumes on another node: its earlier attempt is gone
    release_claims()
    # a DDP worker (LOCAL_RANK > 0) re-enters rank zero's directory without claiming it
    monkeypatch.setenv("LOWRANK_RUN_DIR", str(run))
    monkeypatch.setenv("LOCAL_RANK", "1")
    (run / CLAIM_FILE).write_text(json.dumps(live))
    assert resolve_run_dir(tmp_path, "exp", "r", claim=True).path == run  # no refusal: workers share the claim


@pytest.mark.e2e
def test_a_finished_fixed_id_run_started_again_is_reused_and_says_so(tmp_path, capsys):
    """A page's "Try it" block run twice: its prerequisite (a run id fixed in its config file) finished with the same
    config is reused, not refused and not trained again; another length, or the id given on the command line, is
    refused as before."""
    from tests.helpers import run_cli

    fixed = tmp_path / "fixed.yaml"
    fixed.write_text("run_id: fp\n")
    args = ("fit", "--config", MLP_CONFIG, "--config", fixed, "--trainer.max_epochs=1", "--test_after_fit=false")
    assert run_cli(*args, run_root=tmp_path) == 0
    run = tmp_path / "baseline" / "mlp_digits" / "fp"
    before = _files(run)
    capsys.readouterr()
    assert run_cli(*args, run_root=tmp_path) == 0
    assert "run baseline/mlp_digits/fp already finished with this config: reused" in capsys.readouterr().out
    assert _files(run) == before
    assert run_cli(*args[:5], "--trainer.max_epochs=2", *args[6:], run_root=tmp_path) == 2
    assert "already has checkpoints; pass --ckpt_path last" in capsys.readouterr().err
    assert run_cli(*args, "--run_id", "fp", run_root=tmp_path) == 2  # given on purpose: resume it or pick another id
    assert "already has checkpoints; pass --ckpt_path last" in capsys.readouterr().err
