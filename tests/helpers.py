"""Shared test helpers: paths, an in-process CLI runner and a recording logger."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
PRESETS = ROOT / "callbacks"
MLP_CONFIG = CONFIGS / "baseline" / "mlp_digits.yaml"
FRAGMENT_DIRS = ("base", "debug")


def experiment_configs(parse_only: bool = False) -> list[Path]:
    """Experiment configs under configs/ (fragments in base/ and debug/ excluded).

    A config that cannot run as it is (it needs data, a model or a checkpoint) names the test that runs it in its
    ``run.tested_by`` key: ``tests/rehearsal/test_rehearsal.py::test_x`` (with fixtures, under ``pytest -m
    rehearsal``) or ``tests/<file>.py`` (with the checkpoint that test makes). Those are parsed by the real CLI in the
    unit run (``parse_only=True`` lists them); the rest run as they are.
    """
    from lowrank_lit.launch.config_yaml import config_header

    files = sorted(p for p in CONFIGS.rglob("*.yaml") if p.relative_to(CONFIGS).parts[0] not in FRAGMENT_DIRS)
    return [p for p in files if (config_header(p).tested_by is not None) == parse_only]


def config_subcommand(config: Path) -> str:
    """The ``lowrank`` subcommand of a config's ``run.verb``, else ``fit``."""
    from lowrank_lit.launch.config_yaml import config_header

    return config_header(config).command or "fit"


def run_cli(*args: Any, run_root: Path) -> int:
    """Run ``lowrank <args>`` in this process with runs written under ``run_root``."""
    from lowrank_lit.cli import main

    return main([str(a) for a in args] + ["--run_root", str(run_root)])


def fitted_checkpoint(config: str, run_root: Path, *overrides: str) -> Path:
    """Fit ``configs/<config>`` (a config with a fixed ``run_id``, e.g. a source model) under ``run_root`` with
    ``overrides`` and no test after fit; returns its ``checkpoints/last.ckpt``."""
    import yaml

    path = CONFIGS / config
    assert run_cli("fit", "--config", path, *overrides, "--test_after_fit=false", run_root=run_root) == 0
    cfg = yaml.safe_load(path.read_text())
    return run_root / cfg["experiment"] / cfg["run_id"] / "checkpoints" / "last.ckpt"


def quiet_trainer(**overrides: Any) -> Any:
    """A Lightning ``Trainer`` for tests: CPU, no logger, no checkpoints, no progress bar, no model summary.

    Every keyword overrides those defaults (``quiet_trainer(max_epochs=2, callbacks=[cb])``).
    """
    import lightning.pytorch as pl

    kwargs: dict[str, Any] = {"accelerator": "cpu", "logger": False, "enable_checkpointing": False,
                              "enable_progress_bar": False, "enable_model_summary": False}
    kwargs.update(overrides)
    return pl.Trainer(**kwargs)


def run_dirs(run_root: Path) -> list[Path]:
    """Run directories (``<run_root>/<experiment...>/<run_id>``) that hold a config.yaml."""
    return sorted(p.parent for p in run_root.rglob("config.yaml") if "wandb" not in p.parts)


class RecordingLogger(Logger):
    """A real Lightning logger that writes every ``log_hyperparams`` call to ``<save_dir>/hparams_calls.json``.

    Args:
        save_dir: where the record goes.
    """

    def __init__(self, save_dir: str = ".") -> None:
        super().__init__()
        self._save_dir = save_dir
        self.calls: list[Any] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> str:
        return "0"

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        self.calls.append(params if isinstance(params, dict) else dict(vars(params)))
        os.makedirs(self._save_dir, exist_ok=True)
        with open(os.path.join(self._save_dir, "hparams_calls.json"), "w") as f:
            json.dump(self.calls, f, default=str)

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass


class SlowBatches(Callback):
    """Sleeps ``seconds`` after every training batch: subprocess tests that signal a run at a given batch
    then stop it there even on a busy machine."""

    def __init__(self, seconds: float = 0.02) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


class RankDependentDraws(Callback):
    """Draws ``global_rank + 1`` random numbers before every training batch, so each DDP rank's RNG (and so its
    dropout masks) follows its own sequence: resuming with rank 0's states on every rank would change the run."""

    def on_train_batch_start(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
        import torch

        torch.rand(trainer.global_rank + 1)


#: A tiny random Llama config (MiniLM's vocabulary size, so its tokenizer works) for decoder-path tests.
TINY_LLAMA = {"model_type": "llama", "vocab_size": 30522, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def text_batch(max_length: int = 12) -> tuple[Any, Any]:
    """``(input_ids, attention_mask)`` of three short sentences, MiniLM-tokenised and right-padded."""
    from lowrank_lit.hub import load_tokenizer

    enc = load_tokenizer()(["the pizza was delicious .", "we talked about tennis and rice today .", "the movie was bad ."],
                           padding="max_length", max_length=max_length, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def writing_trainer(run_dir: Any, **overrides: Any) -> Any:
    """A :func:`quiet_trainer` that keeps results: a CSV logger writing into ``run_dir``, which is its run directory."""
    from lightning.pytorch.loggers import CSVLogger

    kwargs: dict[str, Any] = {"default_root_dir": str(run_dir), "logger": CSVLogger(str(run_dir), name="", version="")}
    kwargs.update(overrides)
    return quiet_trainer(**kwargs)


def peft_suite_runs(names: tuple[str, ...], root: Path, seeds: tuple[int, ...] = (0, 1, 2)) -> dict[str, list[dict[str, float]]]:
    """The last metrics of the PEFT suite's cells ``names`` x ``seeds`` (``configs/peft_suite/<name>.yaml``).

    Cells already finished under ``$LOWRANK_PEFT_SUITE_RUNS`` (a finished ``lowrank sweep sweeps/peft_suite.yaml``,
    e.g. the nightly's run root) are read from there; the others run here under ``root``.
    """
    from lowrank_lit.report import read_runs
    from lowrank_lit.studies.peft_suite import method_of

    def finished() -> dict[tuple[str, int], dict[str, float]]:
        roots = [r for r in (os.environ.get("LOWRANK_PEFT_SUITE_RUNS"), str(root)) if r and Path(r).is_dir()]
        found = {}
        for run in read_runs(roots, "metrics.csv", required=False) if roots else []:
            if "test/acc" in run.metrics:  # read_runs leaves debug runs out
                found[method_of(run.config), int(run.config.get("seed_everything", -1))] = run.metrics
        return found

    have = finished()
    for name in names:
        for seed in seeds:
            if (name, seed) not in have:
                assert run_cli("fit", "--config", CONFIGS / "peft_suite" / f"{name}.yaml", f"--seed_everything={seed}",
                               "--trainer.enable_progress_bar=false", run_root=root) == 0
    have = finished()
    return {name: [have[name, seed] for seed in seeds] for name in names}


def figure_problems(fig: Any) -> list[str]:
    """What a reader would miss in a figure: a title (an axes title or the figure's), both axes of every axes that
    draws data labelled (an axis label, a labelled axis it shares, or category tick labels), and at least two
    distinct plotted values (a flat or single-point plot says nothing)."""
    import re as _re

    problems = []
    suptitle = fig._suptitle.get_text() if fig._suptitle is not None else ""
    if not suptitle and not any(ax.get_title(loc) for ax in fig.axes for loc in ("left", "center", "right")):
        problems.append("no title")
    values: set[float] = set()
    for i, ax in enumerate(ax for ax in fig.axes if ax.lines or ax.patches or ax.collections or ax.images):
        for axis in ("x", "y"):
            label = getattr(ax, f"get_{axis}label")()
            group = getattr(ax, f"get_shared_{axis}_axes")().get_siblings(ax)
            shared = any(getattr(o, f"get_{axis}label")() for o in group)
            categories = any(_re.search(r"[A-Za-z]", t.get_text()) for t in getattr(ax, f"get_{axis}ticklabels")())
            if not (label or shared or categories or ax.images):
                problems.append(f"axes {i}: no {axis} label")
        for line in ax.lines:
            values.update(round(float(v), 9) for v in line.get_ydata() if v == v)
        bars = [p for p in ax.patches if hasattr(p, "get_width")]
        if bars:
            vertical = len({round(p.get_width(), 9) for p in bars}) == 1
            values.update(round(float(p.get_height() if vertical else p.get_width()), 9) for p in bars)
        if ax.images or ax.collections:
            values.update({0.0, 1.0})  # an image or a scatter: its spread is its content
    if len(values) < 2:
        problems.append(f"fewer than two distinct plotted values ({sorted(values)})")
    return problems
