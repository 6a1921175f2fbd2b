"""The `lowrank` command line: list, help, print_config round trip, run directories, W&B, errors."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.helpers import MLP_CONFIG, PRESETS, ROOT, run_cli, run_dirs

SHORT = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]


def _run(args, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "lowrank_lit", *map(str, args)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


# ----------------------------------------------------------------------------------------- list / help
def test_list_shows_every_registered_method():
    from lowrank_lit import registry

    registry.load_all()
    methods = registry.registered_methods()
    assert methods, "nothing registered"
    out = _run(["list"]).stdout
    for m in methods:
        row = next((ln for ln in out.splitlines() if ln.split()[:1] == [m.slug]), None)
        assert row is not None, f"{m.slug} missing from `lowrank list`"
        assert m.kind in row and m.paper in row
        for cfg in m.configs():
            assert cfg in row


def test_list_shows_baseline_configs():
    out = _run(["list"]).stdout
    assert "configs/baseline/mlp_digits.yaml" in out


# `lowrank --help` imports nothing heavy; `lowrank list` imports Lightning (which itself imports
# transformers' lazy top-level module) but none of the model libraries our methods use lazily.
@pytest.mark.parametrize(
    ("argv", "heavy"),
    [(["--help"], ("lightning", "timm", "transformers", "diffusers")), (["list"], ("timm", "diffusers"))],
)
def test_light_commands_do_not_import_heavy_libraries(argv, heavy):
    code = (
        "import sys, contextlib, io\n"
        "from lowrank_lit.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()): main({argv!r})\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_unknown_command_is_one_line_error(capsys):
    from lowrank_lit.cli import main

    assert main(["fitt"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'fitt'" in err and "fit" in err and "list" in err


# ----------------------------------------------------------------------------------------- print_config
def test_print_config_round_trips(tmp_path, run_root, capsys):
    from lowrank_lit.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--config", str(MLP_CONFIG), "--model.init_args.backbone.init_args.hidden=[32]", "--print_config"])
    printed = capsys.readouterr().out
    cfg = yaml.safe_load(printed)
    assert cfg["model"]["init_args"]["backbone"]["init_args"]["hidden"] == [32]
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    assert run_cli("fit", "--config", path, *SHORT, run_root=run_root) == 0
    (run,) = run_dirs(run_root)
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["init_args"]["backbone"]["init_args"]["hidden"] == [32]
    assert saved["seed_everything"] == 0


def test_seed_is_drawn_and_written_back(run_root):
    assert run_cli("fit", "--config", MLP_CONFIG, "--seed_everything=true", *SHORT, run_root=run_root) == 0
    (run,) = run_dirs(run_root)
    seed = yaml.safe_load((run / "config.yaml").read_text())["seed_everything"]
    assert isinstance(seed, int) and not isinstance(seed, bool)


# ----------------------------------------------------------------------------------------- run directories
def _snapshot(folder):
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*")) if p.is_file()
    }


def test_two_runs_get_separate_directories(run_root):
    assert run_cli("fit", "--config", MLP_CONFIG, *SHORT, run_root=run_root) == 0
    (first,) = run_dirs(run_root)
    assert first.parent == run_root / "baseline" / "mlp_digits"
    assert {"config.yaml", "metrics.csv", "checkpoints/last.ckpt"} <= set(_snapshot(first))
    before = _snapshot(first)
    assert run_cli("fit", "--config", MLP_CONFIG, *SHORT, run_root=run_root) == 0
    dirs = run_dirs(run_root)
    assert len(dirs) == 2 and first in dirs
    assert _snapshot(first) == before


def test_failed_run_leaves_previous_runs_alone(run_root):
    assert run_cli("fit", "--config", MLP_CONFIG, *SHORT, run_root=run_root) == 0
    (first,) = run_dirs(run_root)
    before = _snapshot(first)
    assert run_cli("fit", "--config", MLP_CONFIG, "--data.init_args.channels=2", *SHORT, run_root=run_root) == 2
    assert _snapshot(first) == before
    assert [p for p in first.parent.iterdir()] == [first]  # the failed run left no empty directory


def test_config_is_logged_once_nested(tmp_path, run_root):
    record_dir = tmp_path / "record"
    preset = tmp_path / "recording.yaml"
    preset.write_text(yaml.safe_dump({"trainer": {"logger+": [
        {"class_path": "tests.helpers.RecordingLogger", "init_args": {"save_dir": str(record_dir)}}]}}))
    assert run_cli("fit", "--config", MLP_CONFIG, "--config", preset, *SHORT, run_root=run_root) == 0
    calls = json.loads((record_dir / "hparams_calls.json").read_text())
    assert len(calls) == 1, f"config logged {len(calls)} times"
    (config,) = calls
    assert set(config) >= {"trainer", "model", "data", "seed_everything"}
    assert config["model"]["init_args"]["backbone"]["class_path"] == "lowrank_lit.models.mlp.MLP"
    assert "lr" not in config and "num_classes" not in config  # no flat duplicates at the root


def test_wandb_offline_without_network_or_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        HOME=str(tmp_path / "home"),  # no ~/.netrc, no wandb settings
        WANDB_BASE_URL="http://127.0.0.1:9",  # nothing listens there
        HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9",
        HF_HUB_OFFLINE="1",
    )
    run_root = tmp_path / "runs"
    proc = _run(["fit", "--config", MLP_CONFIG, "--config", PRESETS / "wandb.yaml", *SHORT,
                 "--run_root", run_root], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = run_dirs(run_root)
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1, list((run / "wandb").iterdir())
    assert (offline[0] / "files" / "lowrank_config.yaml").is_file()
    assert "baseline-mlp_digits-" in offline[0].name  # stable id derived from the run directory


# ----------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--model.init_args.bogus_key=1"], "model.init_args.bogus_key"),
        (["--model.init_args.backbone.init_args.widht=3"], "model.init_args.backbone.init_args.widht"),
        (["--trainer.max_epochs=abc"], "trainer.max_epochs"),
        (["--config", "does/not/exist.yaml"], "does/not/exist.yaml"),
        (["--data.init_args.image_size=0"], "image_size"),
    ],
)
def test_bad_input_gives_one_line_error(extra, needle, run_root, capsys):
    rc = run_cli("fit", "--config", MLP_CONFIG, *extra, run_root=run_root)
    err_lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2
    assert err_lines and err_lines[-1].startswith("lowrank fit: error:")
    assert needle in err_lines[-1]
    assert not any("Traceback" in ln for ln in err_lines)


def test_unknown_key_in_config_file(tmp_path, run_root, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  init_args:\n    bogus_key: 3\n")
    assert run_cli("fit", "--config", MLP_CONFIG, "--config", bad, run_root=run_root) == 2
    assert "unknown key 'model.init_args.bogus_key'" in capsys.readouterr().err


def test_console_script_error_exit_code():
    proc = _run(["fit", "--config", MLP_CONFIG, "--trainer.max_epochs=abc"])
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1] == "lowrank fit: error: trainer.max_epochs: expected int, got 'abc'"
    assert "Traceback" not in proc.stderr
