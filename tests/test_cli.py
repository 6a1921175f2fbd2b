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
@pytest.mark.e2e
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


@pytest.mark.e2e
def test_list_shows_baseline_configs():
    out = _run(["list"]).stdout
    assert "configs/baseline/mlp_digits.yaml" in out


HEAVY = ("torch", "lightning", "timm", "transformers", "diffusers", "lowrank_lit.methods")


# the commands a user types to look around answer without torch, Lightning or any method module
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("argv", "heavy"),
    [
        (["--help"], HEAVY),
        (["list"], HEAVY),
        (["list", "--markdown"], HEAVY),
        (["list", "trust"], HEAVY),
        (["fit", "--config", "configs/trust/digits_c_trust.yaml"], HEAVY),
        (["fit", "--config", "missing.yaml"], HEAVY),
        (["sweep", "sweeps/q3r.yaml", "--check"], HEAVY),
        (["sweep", "sweeps/baseline_mlp_digits.yaml", "--check"], HEAVY),
        (["fit"], HEAVY),  # no config: a hint, before anything is imported
    ],
)
def test_light_commands_do_not_import_heavy_libraries(argv, heavy):
    code = (
        "import sys, contextlib, io\n"
        "from lowrank_lit.cli import main\n"
        f"with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()): main({argv!r})\n"
        f"print(sorted(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.e2e
def test_unknown_command_is_one_line_error(capsys):
    from lowrank_lit.cli import main

    assert main(["fitt"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "'fitt'" in err and "fit" in err and "list" in err


# ----------------------------------------------------------------------------------------- print_config
@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_failed_run_leaves_previous_runs_alone(run_root):
    assert run_cli("fit", "--config", MLP_CONFIG, *SHORT, run_root=run_root) == 0
    (first,) = run_dirs(run_root)
    before = _snapshot(first)
    assert run_cli("fit", "--config", MLP_CONFIG, "--data.init_args.channels=2", *SHORT, run_root=run_root) == 2
    assert _snapshot(first) == before
    assert [p for p in first.parent.iterdir()] == [first]  # the failed run left no empty directory


@pytest.mark.e2e
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


@pytest.mark.e2e
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
    # off a terminal W&B's closing lines come plain, on stderr (not coloured on stdout from its exit hook)
    assert "\x1b[" not in proc.stdout + proc.stderr and "wandb sync" in proc.stderr and "wandb sync" not in proc.stdout


@pytest.mark.e2e
def test_wandb_with_a_key_and_no_route_out_goes_on_offline(tmp_path):
    """A SLURM compute node without network: an API key is set, W&B would go online, its server cannot be reached.
    The run waits at most LOWRANK_WANDB_INIT_TIMEOUT seconds, says so in one line with the sync command, and trains
    offline to the end under the same W&B run id."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), WANDB_API_KEY="a" * 40, WANDB_BASE_URL="http://192.0.2.1",  # TEST-NET-1
               LOWRANK_WANDB_INIT_TIMEOUT="5", HF_HUB_OFFLINE="1")
    run_root = tmp_path / "runs"
    proc = _run(["fit", "--config", MLP_CONFIG, "--config", PRESETS / "wandb.yaml", *SHORT, "--run_root", run_root],
                env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run,) = run_dirs(run_root)
    notes = [ln for ln in proc.stderr.splitlines() if ln.startswith("W&B: no online run at http://192.0.2.1")]
    assert len(notes) == 1, proc.stderr[-3000:]
    assert "(waited at most 5 s" in notes[0] and f"wandb sync {run / 'wandb'}/offline-run-*" in notes[0]
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and "baseline-mlp_digits-" in offline[0].name
    assert (offline[0] / "files" / "lowrank_config.yaml").is_file() and (run / "metrics.csv").is_file()


def test_wandb_init_timeout_is_a_number_of_seconds(monkeypatch):
    from lowrank_lit.loggers import WANDB_INIT_TIMEOUT, wandb_init_timeout

    monkeypatch.delenv("LOWRANK_WANDB_INIT_TIMEOUT", raising=False)
    assert wandb_init_timeout() == WANDB_INIT_TIMEOUT
    monkeypatch.setenv("LOWRANK_WANDB_INIT_TIMEOUT", "2.5")
    assert wandb_init_timeout() == 2.5
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv("LOWRANK_WANDB_INIT_TIMEOUT", bad)
        with pytest.raises(ValueError, match="LOWRANK_WANDB_INIT_TIMEOUT=.*; allowed: a number of seconds > 0"):
            wandb_init_timeout()


# ----------------------------------------------------------------------------------------- bad input
# (the one-line refusals of bad inputs: tests/test_bad_inputs.py)
@pytest.mark.e2e
def test_unknown_key_in_config_file(tmp_path, run_root, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  init_args:\n    bogus_key: 3\n")
    assert run_cli("fit", "--config", MLP_CONFIG, "--config", bad, run_root=run_root) == 2
    assert "unknown key 'model.init_args.bogus_key'" in capsys.readouterr().err


@pytest.mark.e2e
def test_console_script_error_exit_code():
    proc = _run(["fit", "--config", MLP_CONFIG, "--trainer.max_epochs=abc"])
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1] == "lowrank fit: error: trainer.max_epochs: expected int, got 'abc'"
    assert "Traceback" not in proc.stderr


# ----------------------------------------------------------------------------------------- errors that help
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        # no prefix matching: an abbreviation is an unknown key with the full name suggested
        (["--trainer.max_epoch=3"], "unknown key 'trainer.max_epoch'; did you mean --trainer.max_epochs?"),
        (["--trainer.max_epochz=3"], "unknown key 'trainer.max_epochz'; did you mean --trainer.max_epochs?"),
        (["--model.init_args.num_clases=3"], "did you mean --model.init_args.num_classes?"),
        (["--model.init_args.backbone.init_args.hiden=[8]"], "did you mean --model.init_args.backbone.init_args.hidden?"),
        (["--model.class_path=x.y.NoSuchModel"], "cannot import 'x.y.NoSuchModel' (model.class_path): No module named 'x'"),
        (["--model.init_args.backbone.class_path=lowrank_lit.models.mlp.NoMLP"],
         "cannot import 'lowrank_lit.models.mlp.NoMLP' (model.init_args.backbone.class_path)"),
    ],
)
def test_errors_name_the_closest_valid_key(extra, expected, run_root, capsys):
    assert run_cli("fit", "--config", MLP_CONFIG, *extra, run_root=run_root) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and expected in err[0], err
    assert not run_root.exists() or not any(run_root.rglob("config.yaml"))


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("config", "first"),
    [
        ("configs/glvq/mlp_digits_2bit.yaml", "lowrank fit --config configs/glvq/mlp_digits_fp.yaml"),
        ("configs/reservoir_tta/csc_digits.yaml", "lowrank fit --config configs/reservoir_tta/source_cnn_digits.yaml"),
    ],
)
def test_config_needing_an_earlier_run_names_it(config, first, run_root, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no runs/ of an earlier run here
    assert run_cli("test", "--config", ROOT / config, run_root=run_root) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "does not exist" in err[0] and err[0].endswith(f"make it first with: {first}"), err
    assert not run_root.exists()  # no orphan run directory


@pytest.mark.e2e
def test_known_harmless_messages_are_silenced(tmp_path):
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = _run(["fit", "--config", MLP_CONFIG, "--config", PRESETS / "wandb.yaml", *SHORT, "--run_root", tmp_path], env=env)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    for noise in ("Tip: For seamless", "LeafSpec", "weights_only", "anonymous setting", "exists and is not empty"):
        assert noise not in text, noise
    run = run_dirs(tmp_path)[0]
    assert f"run baseline/mlp_digits/{run.name}: {run}" in proc.stdout  # where the run is, at the start
    assert f"run baseline/mlp_digits/{run.name} finished: {run}" in proc.stdout  # and at the end
    assert list((run / "wandb").glob("offline-run-*"))


@pytest.mark.e2e
def test_log_lines_when_stdout_is_not_a_terminal(tmp_path):
    """In a log file the Rich bar prints nothing until the end: plain lines per epoch instead."""
    proc = _run(["fit", "--config", MLP_CONFIG, "--trainer.max_epochs=2", "--run_root", tmp_path])
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch ")]
    assert [ln.split()[1] for ln in lines] == ["1/2", "2/2"], proc.stdout
    for key in ("step 20", "train/loss", "val/acc", "val/loss", "elapsed"):
        assert key in lines[0]
    assert "left ~" in lines[0]
    assert "it/s" not in proc.stdout  # no Rich bar (its lines end in a rate)


@pytest.mark.e2e
@pytest.mark.parametrize(
    "argv",
    [["list"], ["list", "--markdown"], ["--help"], ["sweep", "sweeps/q3r.yaml", "--check"]],
    ids=["list", "list-markdown", "help", "sweep-check"],
)
def test_output_into_a_closed_pipe_ends_quietly(argv):
    """``lowrank list | head -1``: the reader closes the pipe before the command writes; no traceback, status 141."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowrank_lit", *argv], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def _evaluation_configs() -> list[str]:
    from tests.helpers import CONFIGS, config_subcommand

    return sorted(str(p.relative_to(ROOT)) for p in CONFIGS.rglob("*.yaml") if config_subcommand(p) in ("test", "predict"))


@pytest.mark.e2e
@pytest.mark.parametrize("config", _evaluation_configs())
def test_fit_on_an_evaluation_config_names_the_right_command(config, tmp_path, capsys, monkeypatch):
    """``lowrank fit`` on a test-only config (TRUST, Shallow Diffuse, the pinv bounds, ...): one line naming the
    command its header gives, before Lightning is imported, and no run directory."""
    from lowrank_lit.cli import main
    from tests.helpers import config_subcommand

    monkeypatch.chdir(ROOT)
    assert main(["fit", "--config", config, "--run_root", str(tmp_path / "runs")]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert err == [f"lowrank fit: error: {config} {'evaluates' if config_subcommand(ROOT / config) == 'test' else 'predicts'}"
                   f" (it does not train); run: lowrank {config_subcommand(ROOT / config)} --config {config}"]
    assert not (tmp_path / "runs").exists()


@pytest.mark.e2e
def test_list_of_one_method_gives_command_needs_and_first(capsys):
    from lowrank_lit.cli import main

    assert main(["list", "trust"]) == 0
    rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert "lowrank test" in rows["configs/trust/digits_c_trust.yaml"]
    assert rows["configs/trust/digits_c_trust.yaml"].endswith("lowrank fit --config configs/trust/source_vmamba_digits.yaml")
    assert "lowrank fit" in rows["configs/trust/source_vmamba_digits.yaml"]
    gpu = rows["configs/trust/vmamba_tiny_imagenetc_gpu.yaml"]
    assert "GPU, your files" in gpu
    # the whole command, with what run.args says it needs beyond --config
    assert ("lowrank test --config configs/trust/vmamba_tiny_imagenetc_gpu.yaml "
            "--data.init_args.data_dir=/data/ImageNet-C '--model.init_args.source_ckpt=<ckpt>'") in gpu
    assert main(["list"]) == 0
    trust = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("trust "))
    assert " fit, test " in trust
    assert main(["list", "nosuch"]) == 2 and "slug='nosuch'" in capsys.readouterr().err


@pytest.mark.e2e
def test_log_lines_of_an_evaluation_when_stdout_is_not_a_terminal(tmp_path):
    """``lowrank test`` into a log file: a start line with the batch count, periodic batch lines, a result line."""
    proc = _run(["fit", "--config", MLP_CONFIG, "--trainer.max_epochs=1", "--run_root", tmp_path, "--run_id=a",
                 "--test_after_fit=false"])
    assert proc.returncode == 0, proc.stderr
    (ckpt,) = tmp_path.rglob("a/checkpoints/last.ckpt")
    proc = _run(["test", "--config", MLP_CONFIG, "--ckpt_path", ckpt, "--run_root", tmp_path, "--run_id=b",
                 "--trainer.callbacks+=lowrank_lit.callbacks.LogProgress",
                 "--trainer.callbacks.init_args.every_n_steps=2", "--trainer.callbacks.init_args.every_n_seconds=0"])
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("test")]
    total = int(lines[0].split(": ")[1].split()[0])
    assert lines[0] == f"test: {total} batches" and total > 2
    batch_lines = [ln for ln in lines if ln.startswith("test  batch ")]
    assert [ln.split()[2] for ln in batch_lines] == [f"{i}/{total}" for i in range(2, total, 2)], proc.stdout
    assert all("left ~" in ln for ln in batch_lines)
    assert lines[-1].startswith("test: test/acc ") and f"({total} batches in " in lines[-1]


@pytest.mark.e2e
def test_callback_flag_reaches_the_last_callback_given_before_it(tmp_path):
    """``--trainer.callbacks.init_args.*`` sets the last callback listed at that point of the command line: before a
    preset that appends a callback it reaches the experiment's (Q3R's ``lam``); after it, the preset's, and a key that
    callback lacks is an error saying how to order the flags (never silently applied elsewhere)."""
    q3r, preset = "configs/q3r/mlp_digits.yaml", "callbacks/early_stopping.yaml"
    before = _run(["fit", "--config", q3r, "--trainer.callbacks.init_args.lam=2.5", "--config", preset, "--print_config"])
    assert before.returncode == 0, before.stderr
    cfg = yaml.safe_load(before.stdout)
    by_class = {c["class_path"].rsplit(".", 1)[1]: c.get("init_args", {}) for c in cfg["trainer"]["callbacks"]}
    assert by_class["Q3R"]["lam"] == 2.5 and by_class["EarlyStopping"]["patience"] == 10
    after = _run(["fit", "--config", q3r, "--config", preset, "--trainer.callbacks.init_args.lam=2.5", "--print_config"])
    assert after.returncode == 2
    assert ("unknown key 'trainer.callbacks.init_args.lam' (not an argument of lightning.pytorch.callbacks.EarlyStopping); "
            "--trainer.callbacks.init_args.* sets the last callback given so far") in after.stderr


def test_time_left_is_paced_from_the_first_batch_on():
    """A 30 s start-up then 1 s per batch for 100 batches: after 10 batches the estimate is 90 s, not the ~360 s the
    whole elapsed time gives; before the first batch ends it falls back to the elapsed time; none at 0 % or 100 %."""
    from lowrank_lit.callbacks.progress import time_left

    start, first = 0.0, (31.0, 0.01)  # the first batch ends at 31 s, 1 % done
    assert time_left(40.0, 0.10, start, first) == pytest.approx(90.0)
    assert time_left(40.0, 0.10, start, None) == pytest.approx(360.0)
    assert time_left(5.0, 0.0, start, None) is None and time_left(130.0, 1.0, start, first) is None


@pytest.mark.e2e
def test_fit_ending_mid_epoch_is_validated_on_its_final_weights(tmp_path):
    """``max_steps`` ends fit inside epoch 2 (20 batches per epoch): the last val/* values are from step 30, not the
    stale ones of the epoch-1 validation; a fit ending at an epoch end is not validated twice."""
    import csv

    for run_id, extra in (("mid", ["--trainer.max_steps=30", "--trainer.max_epochs=-1"]), ("end", ["--trainer.max_epochs=2"])):
        proc = _run(["fit", "--config", MLP_CONFIG, *extra, "--test_after_fit=false", "--run_root", tmp_path,
                     f"--run_id={run_id}"])
        assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r: list(csv.DictReader(open(next(tmp_path.rglob(f"{r}/metrics.csv"))))) for r in ("mid", "end")}
    val_steps = {r: [int(x["step"]) for x in rows[r] if x.get("val/loss")] for r in rows}
    assert val_steps["mid"] == [19, 30], val_steps
    assert len(val_steps["end"]) == 2, val_steps  # one per epoch, none extra


@pytest.mark.e2e
def test_bare_fit_gives_a_hint(capsys):
    from lowrank_lit.cli import main

    assert main(["fit"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lowrank fit: error: no --config given; run e.g. lowrank fit --config ") and "lowrank list" in err


@pytest.mark.e2e
def test_fit_help_is_built_once_then_cached(tmp_path):
    """The first `lowrank fit --help` imports Lightning and every method; the next reads the cache and imports
    neither (the same text)."""
    env = {**os.environ, "LOWRANK_CACHE_DIR": str(tmp_path)}
    first = _run(["fit", "--help"], env=env)
    assert first.returncode == 0 and "--trainer.max_epochs" in first.stdout and "Traceback" not in first.stderr
    code = ("import sys, contextlib, io\nfrom lowrank_lit.cli import main\nbuf = io.StringIO()\n"
            "with contextlib.redirect_stdout(buf): main(['fit', '--help'])\n"
            "sys.stderr.write(repr(sorted(m for m in ('torch', 'lightning') if m in sys.modules)))\n"
            "sys.stdout.write(buf.getvalue())\n")
    second = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert second.stderr.strip().splitlines()[-1] == "[]" and second.stdout == first.stdout


@pytest.mark.e2e
def test_config_file_key_typo_names_the_closest_key(tmp_path):
    typo = tmp_path / "typo.yaml"
    typo.write_text("trainer:\n  max_epoch: 3\n")
    proc = _run(["fit", "--config", MLP_CONFIG, "--config", typo, "--run_root", tmp_path / "runs"])
    assert proc.returncode == 2
    assert "unknown key 'trainer.max_epoch' in a config file; did you mean trainer.max_epochs?" in proc.stderr


@pytest.mark.e2e
def test_class_help_lists_subclasses_from_every_method():
    """`--model.help PromptTunedClassifier` lists CaPT's CapsulePrompt and PT-MoE's prompt among the prompt's subclasses
    (their modules are imported for help)."""
    proc = _run(["fit", "--model.help", "lowrank_lit.models.text.PromptTunedClassifier"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "lowrank_lit.methods.capt.CapsulePrompt" in proc.stdout and "lowrank_lit.methods.pt_moe.DecomposedMoEPrompt" in proc.stdout


def test_one_command_table_drives_the_dispatch_the_help_and_the_docs():
    """``lowrank --help`` and docs/cli.md list every verb of ``COMMANDS``; each verb's target exists (not called)."""
    import importlib

    from lowrank_lit.cli import COMMANDS, LIGHTNING_COMMANDS, commands_markdown, top_help

    text = top_help()
    for name in (*LIGHTNING_COMMANDS, *COMMANDS):
        assert f"\n  {name} " in text, name
    assert commands_markdown() in (ROOT / "docs" / "cli.md").read_text(), "regenerate docs/cli.md's command table"
    for name, command in COMMANDS.items():
        module, _, function = command.target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), name


@pytest.mark.e2e
def test_a_verb_imports_only_its_own_module():
    """``lowrank list`` loads no other verb's module (``launch.sweep``, ``launch.export``, ...)."""
    from lowrank_lit.cli import COMMANDS

    others = sorted({c.target.partition(":")[0] for c in COMMANDS.values()} - {"lowrank_lit.cli"})
    code = ("import sys, contextlib, io\nfrom lowrank_lit.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()): main(['list'])\n"
            f"print(sorted(m for m in {others!r} if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_path_templates_are_filled_in_one_place():
    """``{seed}`` is the run seed, ``{name}`` an init argument of the same section; other text and sections stay."""
    from jsonargparse import Namespace

    from lowrank_lit.launch.checks import resolve_path_templates

    cfg = Namespace(seed_everything=3, model=Namespace(class_path="m.M", init_args=Namespace(
        pretrained="runs/pre_{torso}/seed{seed}/last.ckpt", note="{unknown} stays",
        predictor=Namespace(class_path="m.P", init_args=Namespace(torso="lstm")))),
        data=Namespace(class_path="d.D", init_args=Namespace(root="data/{torso}")),
        trainer=Namespace(callbacks=Namespace(filename="{epoch}-{seed}")))
    assert resolve_path_templates(cfg) == {"model.init_args.pretrained": "runs/pre_{torso}/seed{seed}/last.ckpt"}
    assert cfg.model.init_args.pretrained == "runs/pre_lstm/seed3/last.ckpt"
    assert cfg.model.init_args.note == "{unknown} stays" and cfg.data.init_args.root == "data/{torso}"  # not its section
    assert cfg.trainer.callbacks.filename == "{epoch}-{seed}"  # only model and data arguments are filled
    off = Namespace(seed_everything=False, model=Namespace(init_args=Namespace(source_ckpt="s{seed}.ckpt")))
    resolve_path_templates(off)
    assert off.model.init_args.source_ckpt == "s0.ckpt"  # seeding off: seed 0, as before
