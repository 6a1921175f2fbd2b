"""Every config runs through the real CLI; every fragment and preset composes with a config."""

from __future__ import annotations

import pytest

from tests.helpers import CONFIGS, MLP_CONFIG, PRESETS, config_subcommand, experiment_configs, run_cli

CONFIG_FILES = experiment_configs()
PARSE_ONLY_FILES = experiment_configs(parse_only=True)
CPU_FRAGMENTS = ["base/trainer_cpu.yaml", "debug/fast_dev_run.yaml", "debug/overfit.yaml", "debug/limit.yaml"]
GPU_FRAGMENTS = ["base/trainer_gpu.yaml", "base/trainer_ddp.yaml"]
PRESET_FILES = sorted(PRESETS.glob("*.yaml"))


def test_fragment_lists_cover_every_fragment():
    found = {str(p.relative_to(CONFIGS)) for d in ("base", "debug") for p in (CONFIGS / d).glob("*.yaml")}
    assert found == set(CPU_FRAGMENTS + GPU_FRAGMENTS)


@pytest.mark.parametrize("config", CONFIG_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_config_fast_dev_run(config, run_root):
    sub = config_subcommand(config)  # `lowrank test` for analysis configs, `fit` for training ones
    assert run_cli(sub, "--config", config, "--trainer.fast_dev_run=true", run_root=run_root) == 0


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
    """``# ci: rehearsal (... <file>::<test>)`` or ``# ci: run by <file> (...)``: the named test exists and runs this file."""
    import re

    from tests.helpers import CI_MARK, ROOT

    line = next(ln for ln in config.read_text().splitlines() if ln.startswith(CI_MARK))
    rel = str(config.relative_to(CONFIGS))
    m = re.search(r"(tests/rehearsal/test_rehearsal\.py)::(\w+)\)$", line) if "rehearsal" in line else \
        re.match(r"# ci: run by (tests/\S+\.py) \(", line)
    assert m, f"{rel}: header {line!r}; allowed: '# ci: rehearsal (...tests/rehearsal/test_rehearsal.py::test_x)' or " \
              "'# ci: run by tests/<file>.py (...)'"
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


@pytest.mark.parametrize("fragment", CPU_FRAGMENTS)
def test_cpu_fragment_composes(fragment, run_root):
    rc = run_cli("fit", "--config", MLP_CONFIG, "--config", CONFIGS / fragment, "--trainer.fast_dev_run=true",
                 run_root=run_root)
    assert rc == 0


@pytest.mark.parametrize("fragment", GPU_FRAGMENTS)
def test_gpu_fragment_parses(fragment, capsys):
    from lowrank_lit.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["fit", "--config", str(MLP_CONFIG), "--config", str(CONFIGS / fragment), "--print_config"])
    assert exc.value.code in (0, None)
    assert "accelerator: gpu" in capsys.readouterr().out


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


def test_every_config_starts_with_a_run_comment():
    for path in [*CONFIGS.rglob("*.yaml"), *PRESET_FILES]:
        lines = path.read_text().splitlines()
        assert lines[0].startswith("# "), f"{path}: must start with a comment saying what it runs"
        assert any("lowrank " in ln for ln in lines if ln.startswith("#")), f"{path}: header lacks the command"
