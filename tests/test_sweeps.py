"""Sweep files parse, every swept key is accepted by the real CLI, and the offline runner works."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowrank_lit.launch.sweep_spec import SweepError, check_keys, load_sweep, static_check
from lowrank_lit.launch.sweep_study import run_sweep
from tests.helpers import ROOT

SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))
TINY = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.mark.parametrize("sweep", SWEEPS, ids=lambda p: p.name)
def test_sweep_file_is_valid(sweep):
    spec = load_sweep(sweep)
    assert spec.raw["program"] == "lowrank_lit/__main__.py"
    assert spec.raw["command"][:4] == ["${env}", "${interpreter}", "-m", "lowrank_lit"]
    assert spec.raw["command"][4] in ("fit", "test")  # training sweeps, or analysis studies run by `test`
    assert spec.raw["command"][-1] == "${args}"
    check_keys(spec)  # every value / both bounds parsed by the real `lowrank fit` parser


def _sweep(tmp_path, params, method="grid"):
    """A sweep file over the MLP baseline with the given `parameters` block (YAML text)."""
    spec = {
        "program": "lowrank_lit/__main__.py",
        "method": method,
        "metric": {"name": "val/loss", "goal": "minimize"},
        "parameters": yaml.safe_load(params),
        "command": ["${env}", "${interpreter}", "-m", "lowrank_lit", "fit", "--config",
                    str(ROOT / "configs/baseline/mlp_digits.yaml"), "${args}"],
    }
    path = tmp_path / "s.yaml"
    text = yaml.safe_dump(spec, sort_keys=False)
    path.write_text(text.replace("'1e-4'", "1e-4"))  # keep YAML 1.1's string reading of 1e-4 visible
    return path


def test_unknown_swept_key_is_one_line_error(tmp_path):
    path = _sweep(tmp_path, "model.init_args.optimizer.init_args.lrr:\n  values: [0.1]\n")
    with pytest.raises(SweepError) as exc:
        check_keys(load_sweep(path))
    msg = str(exc.value)
    assert "\n" not in msg and "parameters.model.init_args.optimizer.init_args.lrr" in msg


def test_wrongly_typed_swept_value(tmp_path):
    path = _sweep(tmp_path, "trainer.max_epochs:\n  values: [two]\n")
    with pytest.raises(SweepError, match="trainer.max_epochs: expected int"):
        check_keys(load_sweep(path))


@pytest.mark.parametrize(
    ("params", "method", "needle"),
    [
        ("model.init_args.optimizer.init_args.lr:\n  distribution: normalish\n  min: 0.1\n  max: 1.0\n", "random",
         "distribution='normalish'"),
        ("model.init_args.optimizer.init_args.lr:\n  distribution: uniform\n  min: 1.0\n  max: 0.1\n", "random",
         "must be below max"),
        ("model.init_args.optimizer.init_args.lr:\n  distribution: log_uniform_values\n  min: 1e-4\n  max: 0.1\n",
         "random", "min must be a number (write 1.0e-4"),
        ("model.init_args.optimizer.init_args.lr:\n  distribution: uniform\n  min: 0.1\n  max: 1.0\n", "grid",
         "grid sweeps need `values`"),
        ("trainer.max_epochs:\n  values: [1]\n", "hyperband", "method='hyperband'"),
    ],
)
def test_bad_sweep_files(tmp_path, params, method, needle):
    with pytest.raises(SweepError) as exc:
        load_sweep(_sweep(tmp_path, params, method))
    assert needle in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.e2e
def test_cli_reports_bad_sweep_in_one_line(tmp_path):
    path = _sweep(tmp_path, "model.init_args.bogus:\n  values: [1]\n")
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "sweep", str(path), "--check", "--parse"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "model.init_args.bogus" in lines[0]


@pytest.mark.e2e
def test_offline_sweep_records_trials_and_survives_a_crash(tmp_path):
    # trial with hidden=[0] crashes (MLP rejects it); the other two complete
    path = _sweep(tmp_path, "model.init_args.backbone.init_args.hidden:\n  values: [[16], [0], [32]]\n")
    study, results = run_sweep(path, run_root=tmp_path / "runs", wandb=False, extra_args=TINY, check=False)
    states = sorted(r.state for r in results)
    assert states == ["COMPLETE", "COMPLETE", "FAIL"]
    failed = next(r for r in results if r.state == "FAIL")
    assert failed.params["model.init_args.backbone.init_args.hidden"] == [0]
    assert len(study.trials) == 3
    assert study.best_value == min(r.value for r in results if r.value is not None)


@pytest.mark.e2e
def test_sweep_cli_prints_table_and_writes_best_config(tmp_path):
    path = _sweep(tmp_path, "model.init_args.optimizer.init_args.lr:\n  distribution: log_uniform_values\n"
                            "  min: 1.0e-3\n  max: 1.0e-1\n", method="random")
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "sweep", str(path), "--n-trials", "3",
                           "--run-root", str(runs), "--study-name", "demo", *TINY],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("| COMPLETE |") == 3
    best = runs / "sweeps" / "demo" / "best.yaml"
    cfg = yaml.safe_load(best.read_text())
    lr = cfg["model"]["init_args"]["optimizer"]["init_args"]["lr"]
    assert 1e-3 <= lr <= 1e-1 and f"lr={lr}" in proc.stdout
    # every trial was an offline W&B run grouped by the study
    assert len(list(runs.rglob("offline-run-*"))) == 3


@pytest.mark.e2e
def test_two_workers_split_a_grid(tmp_path):
    path = _sweep(tmp_path, "model.init_args.optimizer.init_args.lr:\n  values: [0.001, 0.002, 0.003, 0.004]\n")
    storage = tmp_path / "study.journal"
    cmd = [sys.executable, "-m", "lowrank_lit", "sweep", str(path), "--storage", str(storage), "--study-name", "g",
           "--run-root", str(tmp_path / "runs"), "--no-wandb", *TINY]
    procs = [subprocess.Popen([*cmd, "--seed", str(i)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-1000:] for o in outs]
    import optuna
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(study_name="g", storage=optuna.storages.JournalStorage(JournalFileBackend(str(storage))))
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    lrs = sorted(t.params["model.init_args.optimizer.init_args.lr"] for t in done)
    assert lrs == [0.001, 0.002, 0.003, 0.004]  # each grid point exactly once
    ran = [ln for out, _ in outs for ln in out.splitlines() if ln.startswith("trial ")]
    assert len(ran) == 4  # and no worker ran a point twice


@pytest.mark.e2e
def test_worker_threads_split_a_grid_in_one_process(tmp_path, monkeypatch, capsys):
    """`run_sweep(workers=2)` (what `lowrank matrix --jobs 2` calls): two trials at once from one process, each grid
    point once, and the trials' run directories where the sweep fixed them."""
    path = _sweep(tmp_path, "model.init_args.optimizer.init_args.lr:\n  values: [0.001, 0.002, 0.003, 0.004]\n")
    monkeypatch.chdir(ROOT)
    study, results = run_sweep(path, storage=str(tmp_path / "study.journal"), study_name="g", run_root=tmp_path / "runs",
                               wandb=False, extra_args=list(TINY), check=False, workers=2)
    assert sorted(r.params["model.init_args.optimizer.init_args.lr"] for r in results) == [0.001, 0.002, 0.003, 0.004]
    assert all(r.state == "COMPLETE" for r in results), [r.error for r in results]
    assert len({r.run_dir for r in results}) == 4 and all(Path(r.run_dir).is_dir() for r in results)
    assert len({t.user_attrs["worker"] for t in study.trials}) == 1  # one process


# ----------------------------------------------------------------------------------------- static check
@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ("trainr.max_epochs:\n  values: [1]\n", "'trainr' is not a lowrank fit key; did you mean trainer?"),
        ("model.init_args.optimizer.init_args.lrr:\n  values: [0.1]\n", "did you mean 'lr'?"),
        ("model.init_args.backbone.init_args.hiden:\n  values: [[8]]\n", "did you mean 'hidden'?"),
    ],
)
def test_static_check_catches_typos_without_lightning(tmp_path, params, needle):
    with pytest.raises(SweepError) as exc:
        static_check(load_sweep(_sweep(tmp_path, params)))
    assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_static_check_notes_keys_left_at_defaults(tmp_path):
    spec = load_sweep(_sweep(tmp_path, "trainer.gradient_clip_val:\n  values: [1.0]\ntrainer.max_epochs:\n  values: [2]\n"))
    notes = static_check(spec)
    assert len(notes) == 1 and notes[0].startswith("trainer.gradient_clip_val: not set in")


def test_static_check_missing_config_file(tmp_path):
    path = _sweep(tmp_path, "trainer.max_epochs:\n  values: [1]\n")
    path.write_text(path.read_text().replace("configs/baseline/mlp_digits.yaml", "configs/baseline/nope.yaml"))
    with pytest.raises(SweepError, match="nope.yaml' does not exist"):
        static_check(load_sweep(path))


def test_top_level_keys_match_the_real_parser():
    """The keys the static check reads without Lightning are the real parser's (written by the command named)."""
    from lowrank_lit.launch.config_yaml import fit_keys
    from lowrank_lit.launch.lightning_cli import parser_fit_keys

    real = parser_fit_keys()
    assert "trainer" in real and "experiment" in real and "config" not in real
    assert list(fit_keys()) == real, "lowrank_lit/launch/fit_keys.json is stale: python -m lowrank_lit.launch.lightning_cli"


# ----------------------------------------------------------------------------------------- stop and continue
def _slow_trials(tmp_path):
    """Trials that print a line per batch and take ~0.1 s per batch, so a signal lands inside a trial."""
    frag = tmp_path / "slow.yaml"
    frag.write_text("trainer:\n  callbacks+:\n    - class_path: lowrank_lit.callbacks.LogProgress\n      init_args:\n"
                    "        every_n_steps: 1\n    - class_path: tests.helpers.SlowBatches\n      init_args:\n"
                    "        seconds: 0.1\n")
    return ["--trainer.max_epochs=2", "--trainer.limit_train_batches=10", "--trainer.limit_val_batches=1",
            "--trainer.enable_model_summary=false", "--config", str(frag)]


def _sweep_cli(path, runs, extra, signal_in_trial=None, sig=None):
    """``lowrank sweep`` in a subprocess; send ``sig`` once trial number ``signal_in_trial`` is training."""
    import time

    cmd = [sys.executable, "-m", "lowrank_lit", "sweep", str(path), "--study-name", "st", "--run-root", str(runs),
           "--no-wandb", *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if signal_in_trial is not None:
        logs = runs / "sweeps" / "st" / "logs"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            mine = list(logs.glob(f"st-t{signal_in_trial:04d}-*.log")) if logs.is_dir() else []
            if mine and "batch 3/10" in mine[0].read_text():
                break
            time.sleep(0.05)
        else:
            proc.kill()
            raise AssertionError("trial never started")
        proc.send_signal(sig)
        t0 = time.monotonic()
    out, err = proc.communicate(timeout=300)
    if signal_in_trial is not None:
        assert time.monotonic() - t0 < 30
    return proc.returncode, out, err


def _study(runs):
    import optuna
    from optuna.storages.journal import JournalFileBackend

    journal = runs / "sweeps" / "st" / "study.journal"
    return optuna.load_study(study_name="st", storage=optuna.storages.JournalStorage(JournalFileBackend(str(journal))))


def _no_trial_process_left(runs):
    import os

    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = open(f"/proc/{pid}/cmdline").read()
            except OSError:
                continue
            assert str(runs) not in cmdline or "sweep" in cmdline, f"orphaned trial {pid}: {cmdline}"


@pytest.mark.e2e
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_stopped_grid_sweep_continues_to_a_complete_grid(tmp_path, sig):
    """Ctrl+C / SIGTERM in trial 2 of a 4-point grid (no --storage): one line, the trial stopped and recorded as
    interrupted, table and best.yaml written; the same command again runs the interrupted point (resuming its run)
    and the last point, and never repeats a finished one."""
    import signal

    import optuna

    path = _sweep(tmp_path, "model.init_args.optimizer.init_args.lr:\n  values: [0.001, 0.002, 0.003, 0.004]\n")
    runs, extra = tmp_path / "runs", _slow_trials(tmp_path)
    rc, out, err = _sweep_cli(path, runs, extra, signal_in_trial=2, sig=getattr(signal, sig))
    assert rc == 128 + getattr(signal, sig), err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert f"stopped by {sig}" in err and "continue it with: lowrank sweep" in err
    assert "| INTERRUPTED |" in out and out.count("| COMPLETE |") == 2
    assert (runs / "sweeps" / "st" / "best.yaml").is_file() and "INTERRUPTED" in (runs / "sweeps" / "st" / "trials.md").read_text()
    _no_trial_process_left(runs)
    study = _study(runs)
    states = [t.state for t in study.trials]
    assert states.count(optuna.trial.TrialState.RUNNING) == 0 and states.count(optuna.trial.TrialState.COMPLETE) == 2
    interrupted = study.trials[2]
    assert interrupted.user_attrs["interrupted"] is True
    assert (tmp_path / interrupted.user_attrs["run_dir"] / "checkpoints" / "last.ckpt").is_file()

    rc, out, err = _sweep_cli(path, runs, extra)
    assert rc == 0, err[-2000:]
    ran = [ln for ln in out.splitlines() if ln.startswith("trial ")]
    assert len(ran) == 2, ran  # the interrupted point again, then the one never started
    study = _study(runs)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(t.params["model.init_args.optimizer.init_args.lr"] for t in done) == [0.001, 0.002, 0.003, 0.004]
    rerun = next(t for t in done if t.user_attrs.get("rerun_of") == 2)
    assert rerun.user_attrs["run_dir"] == interrupted.user_attrs["run_dir"]  # continued from its last.ckpt
    assert "rerun of 2" in out
    rc, out, _ = _sweep_cli(path, runs, extra)  # a finished grid runs nothing
    assert rc == 0 and not [ln for ln in out.splitlines() if ln.startswith("trial ")]


@pytest.mark.e2e
def test_stopped_random_sweep_counts_finished_trials_and_draws_new_points(tmp_path):
    """run_cap counts finished trials: a stop in trial 1 and a restart end with exactly run_cap finished trials,
    the interrupted one rerun with its parameters, and no point of the first start drawn again."""
    import signal

    import optuna

    path = _sweep(tmp_path, "model.init_args.optimizer.init_args.lr:\n  distribution: log_uniform_values\n"
                            "  min: 1.0e-3\n  max: 1.0e-1\n", method="random")
    path.write_text(path.read_text() + "run_cap: 3\n")
    runs, extra = tmp_path / "runs", _slow_trials(tmp_path)
    rc, _, err = _sweep_cli(path, runs, extra, signal_in_trial=1, sig=signal.SIGTERM)
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    first = _study(runs).trials
    rc, out, err = _sweep_cli(path, runs, extra)
    assert rc == 0, err[-2000:]
    study = _study(runs)
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 3
    lrs = [t.params["model.init_args.optimizer.init_args.lr"] for t in done]
    assert len(set(lrs)) == 3
    assert first[1].params["model.init_args.optimizer.init_args.lr"] in lrs  # the interrupted point, rerun
    assert sum(t.params == first[0].params for t in study.trials) == 1  # the finished one never again


@pytest.mark.e2e
def test_orphaned_running_trial_is_rerun(tmp_path):
    """A trial left RUNNING by a killed worker on this host (kill -9) is recorded as interrupted and run again."""
    import optuna

    from lowrank_lit.launch.sweep_spec import optuna_storage
    from lowrank_lit.launch.sweep_study import default_storage, suggest

    path = _sweep(tmp_path, "model.init_args.optimizer.init_args.lr:\n  values: [0.001, 0.002]\n")
    runs = tmp_path / "runs"
    journal = default_storage(runs, "st")
    journal.parent.mkdir(parents=True)
    study = optuna.create_study(study_name="st", storage=optuna_storage(str(journal)))
    study.enqueue_trial({"model.init_args.optimizer.init_args.lr": 0.002})
    trial = study.ask()
    suggest(trial, load_sweep(path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    import socket

    trial.set_user_attr("worker", f"{socket.gethostname()}:{dead.pid}")
    study, results = run_sweep(path, run_root=runs, study_name="st", wandb=False, extra_args=TINY, check=False)
    assert study.trials[0].user_attrs["interrupted"] is True
    assert sorted(r.params["model.init_args.optimizer.init_args.lr"] for r in results) == [0.001, 0.002]
    assert all(r.state == "COMPLETE" for r in results)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "flags",
    [["--trainer.max_epochs=5"], ["--trainer.max_epochs", "5"], ["--trainer=configs/x.yaml"]],
    ids=["equals", "space", "parent"],
)
def test_command_line_flag_on_a_swept_key_is_refused(tmp_path, flags):
    """``lowrank sweep s.yaml --trainer.max_epochs=5`` when the file sweeps trainer.max_epochs: the swept value would
    win in every trial, so the sweep refuses in one line naming the flag and the swept key, and runs nothing."""
    path = _sweep(tmp_path, "trainer.max_epochs:\n  values: [1, 2]\n")
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "sweep", str(path), "--run-root", str(tmp_path / "r"),
                           "--no-wandb", *flags], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"--{flags[0][2:].split('=')[0]} sets 'trainer.max_epochs'" in lines[0] and "values [1, 2]" in lines[0]
    assert not (tmp_path / "r").exists()


def test_command_line_flag_on_an_unswept_key_is_passed_on(tmp_path):
    from lowrank_lit.launch.sweep_spec import flag_clashes

    spec = load_sweep(_sweep(tmp_path, "trainer.max_epochs:\n  values: [1, 2]\n"))
    assert flag_clashes(spec, ["--trainer.max_steps=5", "--config", "callbacks/wandb.yaml", "--trainer.max_epochsx=1"]) == []


#: a sampler seed whose first pick of a two-point grid is its first point
GOOD_FIRST = next(s for s in range(100) if __import__("numpy").random.default_rng(s).integers(2) == 0)


@pytest.mark.e2e
def test_early_terminate_prunes_a_bad_trial_before_its_last_epoch(tmp_path):
    """`early_terminate: {type: hyperband}` offline: every trial reports val/loss after each validation round; a trial
    far behind a finished one (lr 1e-6 vs 1e-2) is stopped by optuna's HyperbandPruner after round 1 of 3, recorded as
    PRUNED in the study and the table, and is not run again."""
    import csv
    from pathlib import Path

    runs = tmp_path / "runs"
    early = "early_terminate:\n  type: hyperband\n  min_iter: 1\n  max_iter: 2\n  eta: 3\n"
    extra = ["--trainer.max_epochs=3", "--test_after_fit=false"]
    path = _sweep(tmp_path, "model.init_args.optimizer.init_args.lr:\n  values: [1.0e-2, 1.0e-6]\n")
    path.write_text(path.read_text() + early)
    code, out, err = _sweep_cli(path, runs, [*extra, "--seed", str(GOOD_FIRST)])  # the good trial runs first
    assert code == 0, out + err
    assert "| PRUNED (after validation round 1) |" in out, out
    study = _study(runs)
    states = {t.params["model.init_args.optimizer.init_args.lr"]: t for t in study.get_trials()}
    assert states[1e-2].state.name == "COMPLETE" and sorted(states[1e-2].intermediate_values) == [1, 2, 3]
    bad = states[1e-6]
    assert bad.state.name == "PRUNED" and bad.user_attrs["pruned_at"] == 1 and list(bad.intermediate_values) == [1]
    with open(next(Path(bad.user_attrs["run_dir"]).glob("metrics.csv"))) as f:
        epochs = {int(r["epoch"]) for r in csv.DictReader(f) if r.get("val/loss")}
    assert epochs == {0}  # stopped after its first epoch of three
    code, out, _ = _sweep_cli(path, runs, [*extra, "--seed", str(GOOD_FIRST)])  # nothing left to run: the pruned trial counts as done
    assert code == 0 and len(study.get_trials()) == len(_study(runs).get_trials())


def test_bad_early_terminate_is_one_line_error(tmp_path):
    path = _sweep(tmp_path, "trainer.max_epochs:\n  values: [1]\n")
    path.write_text(path.read_text() + "early_terminate:\n  type: median\n")
    with pytest.raises(SweepError, match=r"early_terminate=.*allowed: \{type: hyperband"):
        load_sweep(path)


def test_trial_experiment_is_decided_before_the_trial_starts(tmp_path):
    """The sweep tells each trial its experiment (so its run directory is known before it starts), decided as the
    CLI decides it: the last --experiment flag, else the last config file's `experiment:` key, else the config path.
    The sweep asks the CLI's own parser (one decision, not a copy)."""
    from lowrank_lit.launch.lightning_cli import command_experiment as trial_experiment

    named = tmp_path / "named.yaml"
    named.write_text("experiment: mine/x\n")
    plain = "configs/baseline/mlp_digits.yaml"
    assert trial_experiment(["fit", "--config", plain]) == "baseline/mlp_digits"
    assert trial_experiment(["fit", "--config", plain, "--config", str(named)]) == "mine/x"
    assert trial_experiment(["fit", "--config", plain, "--config", str(named), "--experiment", "e1",
                             "--experiment=e2"]) == "e2"


# ----------------------------------------------------------------------------------------- many workers, one database
@pytest.fixture
def postgres_url():
    """A PostgreSQL 15 server in a temporary folder on a loopback port, run as an unprivileged user (the server
    refuses root), stopped after the test; skipped with the reason where the binaries or the driver are absent."""
    import shutil
    import socket
    import tempfile

    missing = [b for b in ("initdb", "pg_ctl", "postgres") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"PostgreSQL binaries not on PATH: {', '.join(missing)}")
    pytest.importorskip("psycopg2", reason="the PostgreSQL driver (pip install 'lowrank-lit[postgres]') is absent")
    folder = Path(tempfile.mkdtemp(prefix="lowrank-pg-", dir="/tmp"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        if shutil.which("runuser") is None:
            pytest.skip("running as root and no runuser to start PostgreSQL as an unprivileged user")
        import pwd

        nobody = pwd.getpwnam("nobody")
        os.chown(folder, nobody.pw_uid, nobody.pw_gid)
        as_user = ["runuser", "-u", "nobody", "--"]
    data = folder / "data"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([*as_user, "initdb", "-D", str(data), "-U", "lowrank", "--auth=trust", "-E", "UTF8"], check=True,
                   capture_output=True, cwd=folder)
    subprocess.run([*as_user, "pg_ctl", "-D", str(data), "-l", str(folder / "server.log"), "-w", "-o",
                    f"-p {port} -h 127.0.0.1 -k {folder}", "start"], check=True, capture_output=True, cwd=folder)
    try:
        yield f"postgresql://lowrank@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, "pg_ctl", "-D", str(data), "-m", "immediate", "stop"], capture_output=True, cwd=folder)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.e2e
def test_four_workers_share_one_study_in_postgresql_and_survive_a_killed_worker(tmp_path, postgres_url):
    """4 `lowrank sweep` workers on one grid study in a real PostgreSQL server; one is killed (SIGKILL, with its
    trial's process) mid-trial: its trial is recorded as interrupted and run again by the others, every grid point
    completes exactly once, no worker runs a point another holds, and trials.md lists exactly the study's trials."""
    import signal
    import time

    import optuna

    lrs = [0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008]
    path = _sweep(tmp_path, f"model.init_args.optimizer.init_args.lr:\n  values: {lrs}\n")
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "lowrank_lit", "sweep", str(path), "--storage", postgres_url, "--study-name", "pg",
           "--run-root", str(runs), "--no-wandb", *_slow_trials(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOWRANK_SWEEP_HEARTBEAT": "2", "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([*cmd, "--seed", str(i)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env, start_new_session=True) for i in range(4)]
    from lowrank_lit.launch.sweep_study import optuna_storage

    storage = optuna_storage(postgres_url)
    victim = procs[0]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait until the victim's trial is training
        try:
            study = optuna.load_study(study_name="pg", storage=storage)
        except KeyError:
            time.sleep(0.5)
            continue
        mine = [t for t in study.get_trials(deepcopy=False) if t.state == optuna.trial.TrialState.RUNNING
                and t.user_attrs.get("worker", "").endswith(f":{victim.pid}")]
        logs = list((runs / "sweeps" / "pg" / "logs").glob(f"pg-t{mine[0].number:04d}-*.log")) if mine else []
        if logs and "batch 3/10" in logs[0].read_text():
            break
        time.sleep(0.2)
    else:
        raise AssertionError("the first worker never started a trial")
    os.killpg(victim.pid, signal.SIGKILL)  # the worker and its trial's fit, as a crashed node would
    victim.wait(timeout=60)
    outs = [p.communicate(timeout=900) for p in procs[1:]]
    assert all(p.returncode == 0 for p in procs[1:]), [o[1][-1500:] for o in outs]
    study = optuna.load_study(study_name="pg", storage=storage)
    trials = study.get_trials(deepcopy=False)
    done = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert sorted(t.params["model.init_args.optimizer.init_args.lr"] for t in done) == lrs  # each point once
    (killed,) = [t for t in trials if t.user_attrs.get("interrupted")]
    assert killed.number == mine[0].number and killed.state == optuna.trial.TrialState.FAIL
    assert [t.user_attrs.get("rerun_of") for t in done].count(killed.number) == 1  # run again, once
    assert not [t for t in trials if t.state in (optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING)]
    table = (runs / "sweeps" / "pg" / "trials.md").read_text()
    rows = [ln for ln in table.splitlines() if ln.startswith("| ") and not ln.startswith("| trial") and "---" not in ln]
    listed = [t for t in trials if not (t.state == optuna.trial.TrialState.PRUNED and "pruned_at" not in t.user_attrs)]
    assert len(rows) == len(listed), table
