"""Sweep files parse, every swept key is accepted by the real CLI, and the offline runner works."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from lowrank_lit.launch.sweep import (
    TOP_LEVEL_KEYS,
    SweepError,
    check_keys,
    load_sweep,
    run_sweep,
    static_check,
)
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


def test_cli_reports_bad_sweep_in_one_line(tmp_path):
    path = _sweep(tmp_path, "model.init_args.bogus:\n  values: [1]\n")
    proc = subprocess.run([sys.executable, "-m", "lowrank_lit", "sweep", str(path), "--check", "--parse"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "model.init_args.bogus" in lines[0]


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
    from lowrank_lit.launch.lightning_cli import build_parser

    parser = build_parser("fit")
    real = {a.dest.split(".")[0] for a in parser._actions if a.dest not in ("help", "config", "print_config")}
    assert set(TOP_LEVEL_KEYS) == real - {"optimizer", "lr_scheduler"}
