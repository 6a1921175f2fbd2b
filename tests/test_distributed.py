"""SLURM detection, sbatch scripts, exact resume and DDP correctness (CPU, gloo)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import MLP_CONFIG, ROOT, run_cli
from tests.tolerances import F32

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


@pytest.mark.e2e
def test_submit_dry_run_matches_counts():
    script = _dry_run("--config", "configs/baseline/vit_tiny_digits.yaml", "--config", "configs/base/trainer_gpu.yaml",
                      "--nodes", "2", "--gpus-per-node", "4", "--time", "02:00:00", "--partition", "gpu", "--account", "lab")
    assert "#SBATCH --nodes=2" in script
    assert "#SBATCH --ntasks-per-node=4" in script and "#SBATCH --gres=gpu:4" in script
    assert "#SBATCH --signal=SIGUSR1@90" in script and "#SBATCH --requeue" in script
    assert "#SBATCH --partition=gpu" in script and "#SBATCH --account=lab" in script
    assert "TQDM_MINITERS" not in script and "export PYTHONUNBUFFERED=1" in script  # progress lines, not a bar
    launch = next(ln for ln in script.splitlines() if "lowrank_lit fit" in ln)
    assert launch.startswith("srun --kill-on-bad-exit=1 ")
    assert "--trainer.num_nodes=2" in launch and "--trainer.devices=4" in launch and "--trainer.strategy=ddp" in launch
    assert "--config configs/baseline/vit_tiny_digits.yaml" in launch and "--trainer.accelerator=gpu" in launch
    # srun does not inherit --cpus-per-task since Slurm 22.05: the script hands it on before srun starts the ranks
    assert script.index("export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK") < script.index("\nsrun ")


@pytest.mark.e2e
def test_submit_cpu_config_asks_for_no_gpu(tmp_path):
    script = _dry_run("--config", "configs/baseline/vit_tiny_digits.yaml", "--run-root", str(tmp_path))
    assert "--gres" not in script and "--trainer.accelerator=cpu" in script
    sweep = _dry_run("--sweep", "sweeps/baseline_mlp_digits.yaml", "--array", "2", "--run-root", str(tmp_path))
    assert "--gres" not in sweep
    launch = next(ln for ln in sweep.splitlines() if "lowrank_lit sweep" in ln)
    assert launch.startswith("srun --kill-on-bad-exit=1 ") and "--trainer.accelerator=cpu" in launch
    # asking a CPU config for GPUs per node is said on stderr, not silently turned into CPU processes
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "submit", "--config", "configs/baseline/vit_tiny_digits.yaml",
                           "--gpus-per-node", "4", "--run-root", str(tmp_path), "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "--gres" not in proc.stdout
    assert "runs on the CPU (trainer.accelerator: cpu), so the job asks for no GPU and runs 4 CPU processes" in proc.stderr


@pytest.mark.e2e
def test_submitted_script_runs_and_its_log_lands(tmp_path):
    """The script `lowrank submit` writes, run by a stand-in `sbatch` (SLURM's --output file, opened before the
    script starts, and SLURM_JOB_ID) and `srun` (runs its command): the log folder exists at submit time, the run
    trains in runs/<experiment>/<job id>/ and its lines land in the log."""
    import stat

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        "#!/bin/bash\n"
        "script=$1; out=$(sed -n 's/^#SBATCH --output=//p' \"$script\"); name=$(sed -n 's/^#SBATCH --job-name=//p' \"$script\")\n"
        "out=${out//%x/$name}; out=${out//%j/4242}\n"
        "[ -d \"$(dirname \"$out\")\" ] || { echo \"sbatch: error: log folder $(dirname \"$out\") missing\" >&2; exit 1; }\n"
        "SLURM_JOB_ID=4242 SLURM_JOB_NAME=$name bash \"$script\" > \"$out\" 2>&1\n"
        "echo \"Submitted batch job 4242\"\n")
    (bin_dir / "srun").write_text("#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec \"$@\"\n")
    for f in ("sbatch", "srun"):
        (bin_dir / f).chmod((bin_dir / f).stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    env.pop("LOWRANK_RUN_DIR", None)
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "submit", "--config", str(MLP_CONFIG), "--run-root",
                           str(runs), "--", "--trainer.max_epochs=1", "--test_after_fit=false"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and "Submitted batch job 4242" in proc.stdout, proc.stdout + proc.stderr
    (log,) = (runs / "baseline" / "mlp_digits" / "slurm").glob("*-4242.out")
    text = log.read_text()
    assert "run baseline/mlp_digits/4242 finished" in text and "epoch 1/1" in text, text[-2000:]
    assert (runs / "baseline" / "mlp_digits" / "4242" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.e2e
def test_submit_sweep_array():
    script = _dry_run("--sweep", "sweeps/baseline_mlp_digits.yaml", "--array", "4", "--trials-per-task", "2")
    assert "#SBATCH --array=0-3" in script and "#SBATCH --ntasks-per-node=1" in script
    launch = next(ln for ln in script.splitlines() if "lowrank_lit sweep" in ln)
    assert "--storage runs/sweeps/baseline_mlp_digits/study.journal" in launch
    assert '--seed "$SLURM_ARRAY_TASK_ID"' in launch and "--n-trials 2" in launch


@pytest.mark.e2e
def test_submit_without_sbatch_suggests_dry_run():
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "submit", "--config", str(MLP_CONFIG)], cwd=ROOT,
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "sbatch" in proc.stderr and "--dry-run" in proc.stderr


@pytest.mark.e2e
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
@pytest.mark.e2e
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


@pytest.mark.e2e
def test_reentering_a_run_without_ckpt_path_is_refused(run_root, capsys):
    assert run_cli("fit", "--config", MLP_CONFIG, "--trainer.max_epochs=1", *SMALL, run_root=run_root) == 0
    run = _only_run(run_root / "baseline" / "mlp_digits")
    before = (run / "checkpoints" / "last.ckpt").read_bytes()
    assert run_cli("fit", "--config", MLP_CONFIG, *SMALL, "--run_id", run.name, run_root=run_root) == 2
    assert "--ckpt_path last" in capsys.readouterr().err
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == before


# ----------------------------------------------------------------------------------------- DDP
@pytest.mark.e2e
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
        torch.testing.assert_close(a[k], b[k], atol=F32, rtol=0)


# ----------------------------------------------------------------------------------------- DDP stops
def _stop_fragment(root):
    """Progress at every step, slow batches (time to send a signal) and rank-dependent random draws."""
    frag = root / "ddp.yaml"
    root.mkdir(parents=True, exist_ok=True)
    frag.write_text("trainer:\n  callbacks+:\n    - class_path: lowrank_lit.callbacks.LogProgress\n      init_args:\n"
                    "        every_n_steps: 1\n    - class_path: tests.helpers.SlowBatches\n"
                    "    - class_path: tests.helpers.RankDependentDraws\n")
    return frag


def _ddp_fit(root, *extra, signal_at=None, target="rank0", strategy=("--trainer.strategy=ddp",)):
    """``lowrank fit`` on 2 gloo processes in its own process group; send SIGTERM at a progress line to
    rank 0 (the launching process), rank 1 (its child) or the whole group (as SLURM does). ``strategy``: the
    arguments that select the strategy (DDP by default; the sharded tests pass the FSDP fragment).

    Returns (exit status, stdout, stderr, seconds from the signal to the exit of every process)."""
    import signal
    import time

    frag = _stop_fragment(root)
    env = {**os.environ, "PL_DISABLE_FORK": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.pop("LOWRANK_RUN_DIR", None)
    cmd = [sys.executable, "-m", "lowrank_lit", "fit", "--config", str(MLP_CONFIG), "--config", str(frag),
           "--trainer.max_epochs=4", *strategy, "--trainer.devices=2", "--trainer.accelerator=cpu",
           "--test_after_fit=false", "--run_root", str(root), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    out, sent = [], None
    for line in proc.stdout:
        out.append(line)
        if signal_at and sent is None and line.startswith(signal_at):
            if target == "group":
                os.killpg(proc.pid, signal.SIGTERM)
            elif target == "rank1":
                children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
                os.kill(int(children[0]), signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"DDP run still running 60 s after SIGTERM to {target}") from None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # every rank of the group has exited
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"a rank outlived rank 0 by 20 s after SIGTERM to {target}")
    waited = time.monotonic() - sent if sent else 0.0
    return proc.returncode, "".join(out), proc.stderr.read(), waited


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_reference")
    rc, _, err, _ = _ddp_fit(root)
    assert rc == 0, err[-2000:]
    ckpt = torch.load(_only_run(root / "baseline" / "mlp_digits") / "checkpoints" / "last.ckpt", map_location="cpu",
                      weights_only=True)
    return ckpt


@pytest.mark.e2e
@pytest.mark.parametrize("target", ["rank0", "rank1", "group"])
def test_ddp_stop_saves_once_and_resumes_bit_identical(tmp_path, target, ddp_reference):
    """A SIGTERM to either rank or to the whole group stops both ranks after the same batch within seconds,
    writes last.ckpt once, and the resumed 2-process run ends bit-identical to an uninterrupted one
    (DistributedSampler epoch and each rank's own random states restored)."""
    import re
    import shlex
    import signal

    rc, out, err, waited = _ddp_fit(tmp_path, signal_at="epoch 2/4  batch 4/10", target=target)
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    assert waited < 15, waited
    run = _only_run(tmp_path / "baseline" / "mlp_digits")
    stopped = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert 10 < stopped["global_step"] < 20, stopped["global_step"]  # mid-epoch 2, not its boundary
    assert len(stopped["lowrank_rng_states"]["per_rank"]) == 2
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]
    resume = shlex.split(re.search(r"resume with: (.*)", err).group(1))
    assert resume[-4:] == ["--run_id", run.name, "--ckpt_path", "last"]
    if target != "rank0":
        return  # the resume itself is checked once
    rc, out, err, _ = _ddp_fit(tmp_path, "--run_id", run.name, "--ckpt_path", "last")
    assert rc == 0, err[-2000:]
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == ddp_reference["global_step"] == 40
    for key, value in ddp_reference["state_dict"].items():
        assert torch.equal(final["state_dict"][key], value), key


# ----------------------------------------------------------------------------------------- end-of-fit hooks under DDP
#: every method with an end-of-fit hook: its config, what keeps it short, and the file the hook writes
END_OF_FIT = {
    "q3r": ("q3r/mlp_digits.yaml", ["--trainer.max_epochs=1", "--trainer.limit_train_batches=4"], "truncation.csv"),
    "is_lowrank": ("is_lowrank/char_lm.yaml", ["--trainer.max_steps=4", "--trainer.limit_val_batches=1"], "subspace.csv"),
    "lowrank_rnn_cl": ("lowrank_rnn_cl/what_how.yaml", ["--data.init_args.steps_per_stage=4",
                                                        "--model.init_args.eval_trials=16"], "forgetting.csv"),
    "glvq": ("compose/glvq_lora_merge.yaml", ["--trainer.max_epochs=1", "--trainer.limit_train_batches=3"], "compose.csv"),
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(END_OF_FIT))
def test_end_of_fit_hooks_complete_on_two_ddp_processes(name, tmp_path, monkeypatch):
    """The evaluations that run after training (Q3R's truncation, IS-LowRank's subspace table, the forgetting matrix,
    GLVQ's compress-adapt-merge) run to the end under DDP with 2 gloo processes and write their file once."""
    monkeypatch.chdir(tmp_path)
    config, extra, written = END_OF_FIT[name]
    if name == "glvq":  # the full-precision model it quantizes, at its config's path (relative to the working folder)
        from tests.helpers import fitted_checkpoint

        fitted_checkpoint("glvq/mlp_digits_fp.yaml", tmp_path / "runs", "--trainer.max_epochs=1")
    env = {**os.environ, "PL_DISABLE_FORK": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.pop("LOWRANK_RUN_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "fit", "--config", str(ROOT / "configs" / config), *extra,
                           "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.accelerator=cpu",
                           "--trainer.enable_progress_bar=false", "--run_root", str(tmp_path / "ddp")],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = [p.parent for p in (tmp_path / "ddp").rglob("config.yaml")]
    rows = (run / written).read_text().splitlines()
    assert len(rows) >= 2, rows  # a header and the hook's rows
    assert not (run / "unfinished.json").exists()
    assert proc.stdout.count("finished: ") == 1  # one process reports


# ----------------------------------------------------------------------------------------- two nodes, as srun runs them
#: a stand-in ``srun`` that starts the command once per task of a 2-node x 1-task allocation on the loopback address,
#: with the variables SLURM sets for each task, and records the tasks' process ids (SLURM signals every task)
FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
pids=()
for i in 0 1; do
  SLURM_NTASKS=2 SLURM_NNODES=2 SLURM_NTASKS_PER_NODE=1 SLURM_PROCID=$i SLURM_LOCALID=0 SLURM_NODEID=$i \
  SLURM_JOB_NODELIST=localhost SLURM_NODELIST=localhost SLURMD_NODENAME=node$i "$@" &
  pids+=($!)
done
echo "${pids[@]}" > "$FAKE_SRUN_PIDS"
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def _two_node_job(tmp_path, script, signal_at=None):
    """Run an sbatch script as a 2-node job would (``SLURM_JOB_ID`` set, the stand-in ``srun``, a recording
    ``scontrol``); at ``signal_at`` send SIGUSR1 to every task, as SLURM does before the time limit."""
    import signal
    import time

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'scontrol.calls'}\n")
    for f in ("srun", "scontrol"):
        (bin_dir / f).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT), "SLURM_JOB_ID": str(4000 + os.getpid() % 900),
           "SLURM_JOB_NAME": "two-nodes", "FAKE_SRUN_PIDS": str(tmp_path / "tasks.pids")}
    env.pop("LOWRANK_RUN_DIR", None)
    proc = subprocess.Popen(["bash", str(script)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    out, sent = [], False
    for line in proc.stdout:
        out.append(line)
        if signal_at and not sent and line.startswith(signal_at):
            for pid in (tmp_path / "tasks.pids").read_text().split():
                os.kill(int(pid), signal.SIGUSR1)
            sent = True
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("".join(out)[-3000:]) from None
    time.sleep(0.5)
    assert not signal_at or sent, "".join(out)[-3000:]
    return proc.returncode, "".join(out), env["SLURM_JOB_ID"]


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_sbatch_launch_line_trains_on_two_nodes_and_a_requeue_resumes_on_both(tmp_path, strategy, ddp_reference):
    """The script ``lowrank submit --nodes 2 --gpus-per-node 1`` writes (DDP, or ``--strategy fsdp``), run as srun
    runs it on 2 nodes x 1 task on the loopback address: SIGUSR1 to every task stops both after the same batch,
    requeues the job once and writes last.ckpt; the requeued job re-enters the same run directory on both nodes
    and ends with the weights of an uninterrupted 2-process run."""
    import signal

    frag = _stop_fragment(tmp_path)
    extra = ["--trainer.max_epochs=4", "--test_after_fit=false"]
    if strategy == "fsdp":
        extra.append("--trainer.strategy.init_args.mixed_precision=none")
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "submit", "--config", str(MLP_CONFIG), "--config",
                           str(frag), "--nodes", "2", "--gpus-per-node", "1", "--accelerator", "cpu", "--strategy",
                           strategy, "--run-root", str(tmp_path / "runs"), "--dry-run", "--", *extra],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / "job.sbatch"
    script.write_text(proc.stdout)
    rc, out, job = _two_node_job(tmp_path, script, signal_at="epoch 2/4  batch 4/10")
    assert rc == 128 + signal.SIGUSR1, out[-3000:]
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", job]  # once, by rank 0
    run = tmp_path / "runs" / "baseline" / "mlp_digits" / job
    stopped = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert 10 < stopped["global_step"] < 20, stopped["global_step"]
    rc, out, _ = _two_node_job(tmp_path, script)  # the requeued job
    assert rc == 0, out[-3000:]
    assert f"resumed at step {stopped['global_step']}" in out
    assert sorted(p.name for p in (tmp_path / "runs" / "baseline" / "mlp_digits").iterdir()) == [job]
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    if strategy == "fsdp":
        rc, _, err, _ = _ddp_fit(tmp_path / "reference", strategy=("--config", str(ROOT / "configs" / "base" /
                                 "trainer_fsdp.yaml"), "--trainer.strategy.init_args.mixed_precision=none"))
        assert rc == 0, err[-2000:]
        reference = torch.load(_only_run(tmp_path / "reference" / "baseline" / "mlp_digits") / "checkpoints" /
                               "last.ckpt", map_location="cpu", weights_only=True)
    else:
        reference = ddp_reference
    assert final["global_step"] == reference["global_step"] == 40
    for key, value in reference["state_dict"].items():
        assert torch.equal(final["state_dict"][key], value), key
