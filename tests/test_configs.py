"""Every config runs through the real CLI; every fragment and preset composes with a config."""

from __future__ import annotations

import pytest

from tests.helpers import CONFIGS, MLP_CONFIG, PRESETS, config_subcommand, experiment_configs, run_cli

CONFIG_FILES = experiment_configs()
PARSE_ONLY_FILES = experiment_configs(parse_only=True)
CPU_FRAGMENTS = ["base/trainer_cpu.yaml", "debug/fast_dev_run.yaml", "debug/overfit.yaml", "debug/limit.yaml"]
GPU_FRAGMENTS = ["base/trainer_gpu.yaml", "base/trainer_ddp.yaml", "base/trainer_fsdp.yaml"]
PRESET_FILES = sorted(PRESETS.glob("*.yaml"))


def test_fragment_lists_cover_every_fragment():
    found = {str(p.relative_to(CONFIGS)) for d in ("base", "debug") for p in (CONFIGS / d).glob("*.yaml")}
    assert found == set(CPU_FRAGMENTS + GPU_FRAGMENTS)


@pytest.mark.e2e
@pytest.mark.parametrize("config", CONFIG_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_config_fast_dev_run(config, run_root):
    sub = config_subcommand(config)  # `lowrank test` for analysis configs, `fit` for training ones
    assert run_cli(sub, "--config", config, "--trainer.fast_dev_run=true", run_root=run_root) == 0


@pytest.mark.e2e
@pytest.mark.parametrize("config", PARSE_ONLY_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_parse_only_config_parses(config, capsys):
    """Configs for real data / GPUs: the real CLI parses them (every key and type checked)."""
    from lowrank_lit.cli import main

    with pytest.raises(SystemExit) as exc:
        main([config_subcommand(config), "--config", str(config), "--print_config"])
    assert exc.value.code in (0, None)
    assert "class_path" in capsys.readouterr().out


@pytest.mark.parametrize("config", PARSE_ONLY_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_config_that_cannot_run_as_it_is_names_the_test_that_runs_it(config):
    """``run.tested_by``: ``tests/rehearsal/test_rehearsal.py::test_x`` or ``tests/<file>.py``; the named test exists
    and runs this file."""
    import re

    from lowrank_lit.launch.config_yaml import config_header
    from tests.helpers import ROOT

    line = config_header(config).tested_by
    rel = str(config.relative_to(CONFIGS))
    m = re.fullmatch(r"(tests/rehearsal/test_rehearsal\.py)::(\w+)", line) if "rehearsal" in line else \
        re.fullmatch(r"(tests/\S+\.py)", line)
    assert m, f"{rel}: run.tested_by={line!r}; allowed: 'tests/rehearsal/test_rehearsal.py::test_x' or " \
              "'tests/<file>.py'"
    source = (ROOT / m.group(1)).read_text()
    if "rehearsal" in line:
        body = source.split(f"def {m.group(2)}(", 1)
        assert len(body) == 2, f"{rel}: no test {m.group(2)} in {m.group(1)}"
        assert rel in body[1].split("\ndef ", 1)[0] or rel in source.split(f"def {m.group(2)}(", 1)[0][-400:], \
            f"{rel}: {m.group(2)} does not run it"
    else:  # by name, or as an f-string prefix plus a quoted variant (f"mlp_digits_{variant}.yaml" with "2bit_sdba")
        stem = config.stem
        named = stem in source or any(f"{stem[:i]}{{" in source and f'"{stem[i:]}"' in source for i in range(1, len(stem)))
        assert named, f"{rel}: {m.group(1)} does not mention {stem}"


@pytest.mark.e2e
@pytest.mark.parametrize("fragment", CPU_FRAGMENTS)
def test_cpu_fragment_composes(fragment, run_root):
    rc = run_cli("fit", "--config", MLP_CONFIG, "--config", CONFIGS / fragment, "--trainer.fast_dev_run=true",
                 run_root=run_root)
    assert rc == 0


@pytest.mark.e2e
@pytest.mark.parametrize("fragment", GPU_FRAGMENTS)
def test_gpu_fragment_parses(fragment, capsys):
    from lowrank_lit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(MLP_CONFIG), "--config", str(CONFIGS / fragment), "--print_config"])
    assert exc.value.code in (0, None)
    assert "accelerator: gpu" in capsys.readouterr().out


@pytest.mark.e2e
@pytest.mark.parametrize("preset", PRESET_FILES, ids=lambda p: p.name)
def test_callback_preset_composes(preset, run_root):
    rc = run_cli("fit", "--config", MLP_CONFIG, "--config", preset, "--trainer.fast_dev_run=true", run_root=run_root)
    assert rc == 0


def test_presets_append_instead_of_replacing(run_root):
    """Composing two presets keeps both callbacks (they use `callbacks+:`)."""
    from lowrank_lit.launch.lightning_cli import LowrankCLI

    cli = LowrankCLI(
        args=["--config", str(MLP_CONFIG), "--config", str(PRESETS / "checkpoint.yaml"),
              "--config", str(PRESETS / "early_stopping.yaml"), "--config", str(PRESETS / "lr_monitor.yaml"),
              "--run_root", str(run_root)],
        run=False,
    )
    names = {type(cb).__name__ for cb in cli.trainer.callbacks}
    assert {"ModelCheckpoint", "EarlyStopping", "LearningRateMonitor"} <= names


def test_every_config_starts_with_a_comment_and_its_command_lives_in_its_run_block():
    """A config says what it runs in a comment; its command is its ``run:`` block (``lowrank list <slug>`` prints
    it), never a ``# Run:`` / ``# First:`` comment that copies it. A fragment, which has no ``run:``, shows in a
    comment the command it is added to."""
    from lowrank_lit.launch.config_yaml import config_header

    for path in [*CONFIGS.rglob("*.yaml"), *PRESET_FILES]:
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# "), f"{path}: must start with a comment saying what it runs"
        copies = [ln for ln in lines if ln.startswith(("# Run:", "# First:"))]
        assert not copies, f"{path}: {copies[0]!r} copies run.verb / run.first / run.args; keep them in run: only"
        if config_header(path).command is None:
            assert any("lowrank " in ln for ln in lines if ln.startswith("#")), f"{path}: a fragment names no command"


def test_every_experiment_config_declares_how_it_is_run():
    """The ``run:`` block, which code reads: a verb, known keys and needs; ``args`` are ``--key=value`` arguments; a
    ``first`` command names a config that exists; a config that says it needs your files names the rehearsal that
    runs it."""
    import yaml

    from lowrank_lit.launch.config_yaml import NEEDS, RunSpec
    from tests.helpers import ROOT

    allowed = set(RunSpec.__dataclass_fields__)
    for path in [*experiment_configs(), *PARSE_ONLY_FILES]:
        rel = path.relative_to(ROOT)
        run = yaml.safe_load(path.read_text()).get("run")
        assert isinstance(run, dict) and run.get("verb") in ("fit", "validate", "test", "predict"), \
            f"{rel}: no run.verb; allowed: fit, validate, test, predict"
        assert set(run) <= allowed, f"{rel}: run keys {sorted(set(run) - allowed)}; allowed: {sorted(allowed)}"
        assert set(run.get("needs") or []) <= set(NEEDS), f"{rel}: run.needs={run.get('needs')}; allowed: {NEEDS}"
        bad_args = [a for a in run.get("args") or [] if not (isinstance(a, str) and a.startswith("--") and "=" in a)]
        assert not bad_args, f"{rel}: run.args {bad_args}; allowed: --key=value strings"
        if run.get("first"):
            first = run["first"].split("--config", 1)[1].split()[0]
            assert (ROOT / first).is_file(), f"{rel}: run.first names {first}, which does not exist"
        if "your_files" in (run.get("needs") or []):
            assert "tests/rehearsal/" in str(run.get("tested_by")), f"{rel}: needs your files but names no rehearsal"


@pytest.mark.e2e
def test_a_run_block_with_a_wrong_verb_is_refused_in_one_line(tmp_path, capsys):
    from tests.helpers import MLP_CONFIG, run_cli

    bad = tmp_path / "bad.yaml"
    bad.write_text(MLP_CONFIG.read_text().replace("  verb: fit", "  verb: train"))
    assert run_cli("fit", "--config", bad, "--trainer.fast_dev_run=true", run_root=tmp_path / "runs") == 2
    err = capsys.readouterr().err
    assert "run.verb" in err and "train" in err, err
    assert not (tmp_path / "runs").exists()
