"""``lowrank``: the command line of lowrank_lit.

Training subcommands are Lightning's own (:class:`LowrankCLI` is a ``LightningCLI`` in subclass
mode for both model and data)::

    lowrank fit --config configs/baseline/mlp_digits.yaml [--config callbacks/wandb.yaml] [--model.init_args.lr=...]
    lowrank validate|test|predict --config ... [--ckpt_path ...]
    lowrank fit --config configs/baseline/mlp_digits.yaml --print_config

and a few of ours, which do not import Lightning until they need it::

    lowrank list                       registered methods, their kind, paper and configs

Every run writes to ``<run_root>/<experiment>/<run_id>/`` (see :mod:`lowrank_lit.launch.run_dir`):
the resolved ``config.yaml``, CSV metrics, checkpoints and, with ``callbacks/wandb.yaml``, the
W&B files (offline unless an API key is configured or ``WANDB_MODE=online``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
import netrc
import os
import re
import shlex
import signal
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

__all__ = ["LowrankCLI", "main", "wandb_online_allowed", "experiment_from_configs"]  # noqa: F822 (built lazily)

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")

_TOP_HELP = """\
usage: lowrank <command> [options]

Lightning commands (LightningCLI; `lowrank <command> --help` lists every option):
  fit        train a model:   lowrank fit --config configs/baseline/mlp_digits.yaml
  validate   run the validation loop on a checkpoint (--ckpt_path)
  test       run the test loop (--ckpt_path)
  predict    run prediction (--ckpt_path)

lowrank_lit commands:
  list       show the registered methods, their kind, paper and configs (--markdown: README table)
  sweep      run a W&B sweep file offline with optuna: lowrank sweep sweeps/<slug>.yaml [--n-trials N]
  submit     write and submit an sbatch script: lowrank submit --config C.yaml --nodes 2 --gpus-per-node 4

Compose configs with repeated --config (later files win), e.g. a preset from callbacks/:
  lowrank fit --config configs/baseline/mlp_digits.yaml --config callbacks/wandb.yaml
Override single keys with dotted flags: --trainer.max_epochs=5 --model.init_args.num_classes=10
Runs are written to runs/<experiment>/<run_id>/ (--run_root, --experiment, --run_id).
"""


# --------------------------------------------------------------------------- W&B helpers
def wandb_online_allowed(environ: dict[str, str] | None = None) -> bool:
    """Whether W&B may go online: ``WANDB_MODE=online``, or an API key with no offline mode set.

    The key is looked up in ``WANDB_API_KEY`` and in ``~/.netrc`` (what ``wandb login`` writes) for
    the host of ``WANDB_BASE_URL`` (default ``api.wandb.ai``). Nothing here touches the network.
    """
    env = os.environ if environ is None else environ
    mode = env.get("WANDB_MODE", "").strip().lower()
    if mode == "online":
        return True
    if mode in ("offline", "dryrun", "disabled"):
        return False
    if env.get("WANDB_API_KEY"):
        return True
    host = urlparse(env.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    netrc_path = env.get("NETRC") or os.path.join(env.get("HOME", os.path.expanduser("~")), ".netrc")
    try:
        return netrc.netrc(netrc_path).authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def experiment_from_configs(config_paths: Sequence[Any] | None) -> str:
    """Experiment name from the ``--config`` files: ``configs/baseline/mlp_digits.yaml`` -> ``baseline/mlp_digits``.

    The first file under a ``configs/`` folder that is not a ``base/`` or ``debug/`` fragment wins;
    otherwise the stem of the first file; with no file at all, ``default``.
    """
    paths = [Path(str(getattr(p, "relative", p))) for p in (config_paths or [])]
    for p in paths:
        parts = p.with_suffix("").parts
        if "configs" in parts:
            rel = parts[len(parts) - 1 - parts[::-1].index("configs") + 1 :]
            if rel and rel[0] not in ("base", "debug"):
                return "/".join(rel)
    return paths[0].stem if paths else "default"


# --------------------------------------------------------------------------- LightningCLI
def _is_rank_zero() -> bool:
    return all(int(os.environ.get(k, "0") or 0) == 0 for k in ("LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def _stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


class ConfigError(Exception):
    """A config value was accepted by the parser but rejected by the class it configures."""


#: ckpt_path values Lightning resolves itself (not file names)
_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")
_INPUT_KEY_RE = re.compile(r"(^|\.)(ckpt_path|[a-z_]*_ckpt|init_from)$")
_FIRST_RE = re.compile(r"^#\s*First:\s*(lowrank\s+\S+\s+--config\s+\S+)")


def prerequisite_command(config_paths: Sequence[Any] | None) -> str | None:
    """The ``# First: lowrank fit --config ...`` line of the first ``--config`` file that has one."""
    for p in config_paths or []:
        path = Path(str(getattr(p, "relative", p)))
        try:
            header = path.read_text().splitlines()
        except OSError:
            continue
        for line in header:
            if not line.startswith("#"):
                break
            if m := _FIRST_RE.match(line):
                return m.group(1)
    return None


def check_input_files(cfg: Any) -> None:
    """Checkpoints a run starts from (``ckpt_path``, ``*_ckpt``, ``init_from``) must exist before anything runs.

    Raises:
        ConfigError: naming the key, the missing file and, when a config says so in a ``# First:`` line,
            the command that makes it.
    """
    missing = []
    for key, value in cfg.items():
        if not isinstance(value, str) or not _INPUT_KEY_RE.search(key) or "://" in value:
            continue
        if key == "ckpt_path" and value in _CKPT_KEYWORDS:
            continue
        if not Path(value).exists():
            missing.append((key, value))
    if missing:
        key, value = missing[0]
        first = prerequisite_command(cfg.get("config"))
        hint = f"; make it first with: {first}" if first else "; train that model first or fix the path"
        raise ConfigError(f"{key}={value!r} does not exist{hint}")


def _first_line(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)


#: messages every run printed that say nothing about the run (matched at the start of the text)
KNOWN_NOISE = (
    "💡 Tip: For seamless",  # Lightning's advertisement for litlogger / litmodels
    "`weights_only` was not set",  # Lightning, at every checkpoint save; lowrank checkpoints hold full state
    r".*isinstance\(treespec, LeafSpec\)",  # Lightning's use of a deprecated torch pytree API
    # the run directory already holds config.yaml (and wandb/); metrics.csv of an earlier attempt is kept as
    # metrics.<n>.csv by the run directory before the CSV logger starts, so nothing is deleted
    "Experiment logs directory .* exists and is not empty",
)


class _DropKnownNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(re.match(pattern, text) for pattern in KNOWN_NOISE)


def quiet_known_noise() -> None:
    """Silence the messages in :data:`KNOWN_NOISE` (warnings and Lightning's log lines); idempotent."""
    for pattern in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _DropKnownNoise) for f in handler.filters):
                handler.addFilter(_DropKnownNoise())


def _build_cli_class() -> type:
    """Define :class:`LowrankCLI` lazily so ``lowrank list``/``--help`` never import Lightning."""
    import lightning.pytorch as pl
    from jsonargparse import Namespace
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from lowrank_lit.callbacks.config import RunConfigCallback
    from lowrank_lit.callbacks.resume import ResumeCheckpoint
    from lowrank_lit.callbacks.rng import RNGStateCheckpoint
    from lowrank_lit.launch.run_dir import ENV_RUN_DIR, RunDir, resolve_run_dir, slurm_run_id

    quiet_known_noise()

    def _import(class_path: str) -> type:
        module, _, name = class_path.rpartition(".")
        return getattr(importlib.import_module(module), name)

    class LowrankCLI(LightningCLI):
        """LightningCLI with run directories, CSV + optional W&B logging and config logging.

        Model and data are given by ``class_path`` (subclass mode). The module owns its optimizer
        (``auto_configure_optimizers=False``): pass it as ``model.init_args.optimizer``.
        After parsing, the run directory ``<run_root>/<experiment>/<run_id>`` is created and
        ``trainer.default_root_dir``, the CSV logger and any W&B logger are pointed at it.
        """

        run_dir: RunDir | None = None
        #: the run directory of the most recent run in this process (for the closing message)
        last_run_dir: RunDir | None = None

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("subclass_mode_model", True)
            kwargs.setdefault("subclass_mode_data", True)
            kwargs.setdefault("auto_configure_optimizers", False)
            kwargs.setdefault("save_config_callback", RunConfigCallback)
            # a directory is only re-entered by the same SLURM job or an explicit --run_id
            kwargs.setdefault("save_config_kwargs", {"overwrite": True})
            # no prefix matching: --trainer.max_epoch must not silently mean --trainer.max_epochs
            kwargs.setdefault(
                "parser_kwargs",
                {"exit_on_error": False, "allow_abbrev": False, **{c: {"allow_abbrev": False} for c in LIGHTNING_COMMANDS}},
            )
            # RNG states travel with every checkpoint, so resuming is exact (added to every run)
            kwargs.setdefault("trainer_defaults", {"callbacks": [RNGStateCheckpoint()]})
            super().__init__(pl.LightningModule, pl.LightningDataModule, *args, **kwargs)

        def parse_arguments(self, parser: Any, args: Any) -> None:
            """Parse as LightningCLI does; a parse error becomes one line naming the key (and the closest valid one)."""
            from jsonargparse import ArgumentError

            try:
                super().parse_arguments(parser, args)
            except ArgumentError as exc:
                argv = sys.argv[1:] if args is None else list(args)
                sub = self._subcommand_parsers.get(argv[0]) if argv and isinstance(argv[0], str) else None
                raise ConfigError(_one_line_error(exc, sub)) from exc

        def add_arguments_to_parser(self, parser: Any) -> None:
            parser.add_argument(
                "--experiment",
                type=str | None,
                default=None,
                help="Experiment name, the folder under run_root (default: derived from the first --config, "
                "configs/baseline/mlp_digits.yaml -> baseline/mlp_digits).",
            )
            parser.add_argument("--run_root", type=str, default="runs", help="Folder holding all run directories.")
            parser.add_argument(
                "--run_id",
                type=str | None,
                default=None,
                help="Re-enter this run directory (resume). Default: the SLURM job id, else a new unique id.",
            )
            parser.add_argument(
                "--checkpoint_every_n_steps",
                type=int,
                default=0,
                help="Also write checkpoints/last.ckpt every this many optimizer steps (it is always written at every "
                "epoch end and when the run is interrupted by SIGINT, SIGTERM or SIGUSR1). 0: epoch ends only.",
            )
            parser.add_argument(
                "--test_after_fit",
                type=bool,
                default=False,
                help="After `fit`, run the test loop on the final weights (metrics land in the same run).",
            )

        def after_fit(self) -> None:
            cfg = self.config[self.subcommand] if self.subcommand else self.config
            if cfg.get("test_after_fit") and not self.trainer.interrupted:
                self.trainer.test(self.model, datamodule=self.datamodule, verbose=True)

        def before_instantiate_classes(self) -> None:
            cfg = self.config[self.subcommand] if self.subcommand else self.config
            check_input_files(cfg)  # before a run directory exists: a missing input leaves nothing behind
            experiment = cfg.experiment or experiment_from_configs(cfg.get("config"))
            run_dir = resolve_run_dir(cfg.run_root, experiment, cfg.run_id)
            os.environ[ENV_RUN_DIR] = str(run_dir.path)  # inherited by DDP worker processes
            self.run_dir = run_dir
            cfg.experiment = experiment
            cfg.trainer.default_root_dir = str(run_dir.path)
            type(self).last_run_dir = run_dir
            try:
                cfg.trainer.logger = self._loggers(cfg.trainer.get("logger"), run_dir)
                cfg.trainer.callbacks = self._callbacks(cfg.trainer.get("callbacks"), cfg, self.subcommand)
                if self.subcommand == "fit":
                    self._resume_point(cfg, run_dir)
            except BaseException:
                self._remove_if_new(run_dir)
                raise
            if _is_rank_zero():
                print(f"run {run_dir.experiment}/{run_dir.run_id}: {run_dir.path}" + (" (re-entered)" if run_dir.resumed else ""),
                      flush=True)

        @staticmethod
        def _remove_if_new(run_dir: RunDir) -> None:
            """Remove a run directory this run created when nothing was written into it."""
            if not run_dir.resumed and run_dir.path.is_dir() and not any(run_dir.path.iterdir()):
                run_dir.path.rmdir()

        @staticmethod
        def _resume_point(cfg: Namespace, run_dir: RunDir) -> None:
            """Re-entering a run directory never restarts training over its checkpoints, and never silently.

            ``--ckpt_path last`` resolves to the run's ``checkpoints/last.ckpt`` (an error naming the run
            directory when there is none). A requeued SLURM job resumes from Lightning's
            ``hpc_ckpt_*.ckpt`` (ckpt_path stays None) or, when there is none, from ``checkpoints/last.ckpt``.
            Re-entering with ``--run_id`` needs an explicit ``--ckpt_path`` once the run has checkpoints.
            """
            ckpts = run_dir.path / "checkpoints"
            last = ckpts / "last.ckpt"
            if cfg.get("ckpt_path") == "last":
                if not run_dir.resumed:
                    raise ConfigError(
                        f"--ckpt_path last: {run_dir.path} is a new run directory with nothing to resume; "
                        "pass --run_id <id> of the run to continue (its directory is printed when it starts)"
                    )
                if not last.is_file():
                    raise ConfigError(
                        f"--ckpt_path last: no checkpoint to resume in {run_dir.path} (no checkpoints/last.ckpt); "
                        "drop --ckpt_path to start this run over, or pick another --run_id"
                    )
                cfg.ckpt_path = str(last)
                return
            if cfg.get("ckpt_path") is not None or not run_dir.resumed:
                return
            has_ckpts = ckpts.is_dir() and any(ckpts.glob("*.ckpt"))
            if slurm_run_id() == run_dir.run_id and not cfg.get("run_id"):
                if not any(run_dir.path.glob("hpc_ckpt_*.ckpt")) and last.is_file():
                    cfg.ckpt_path = str(last)
                return
            if has_ckpts:
                raise ConfigError(
                    f"run directory {run_dir.path} already has checkpoints; pass --ckpt_path last to resume it "
                    "or drop --run_id to start a new run"
                )

        @staticmethod
        def _callbacks(value: Any, cfg: Namespace, subcommand: str | None) -> list:
            """Add what every run needs: ``checkpoints/last.ckpt`` kept current (fit) and log-friendly progress.

            * :class:`~lowrank_lit.callbacks.ResumeCheckpoint` writes ``last.ckpt`` at every epoch end, every
              ``--checkpoint_every_n_steps`` steps and on interruption; a configured ``ModelCheckpoint``
              keeps its best/top-k files but leaves ``last.ckpt`` to it (one writer, so resuming is exact).
            * With stdout not a terminal and no progress bar configured, :class:`~lowrank_lit.callbacks.LogProgress`
              prints plain lines instead of the Rich bar (which shows nothing in a log file).
            """
            trainer_cfg = cfg.trainer
            entries = [] if value is None else list(value) if isinstance(value, list) else [value]
            classes = [_import(e.class_path) for e in entries]
            checkpointing = trainer_cfg.get("enable_checkpointing") is not False
            if subcommand == "fit" and checkpointing and not any(issubclass(c, ResumeCheckpoint) for c in classes):
                for entry, cls in zip(entries, classes, strict=True):
                    args = entry.get("init_args") or Namespace()
                    if issubclass(cls, ModelCheckpoint) and args.get("save_last") and args.get("dirpath") is None:
                        args.save_last = False  # last.ckpt has one writer: ResumeCheckpoint
                        entry.init_args = args
                every = cfg.get("checkpoint_every_n_steps") or 0
                entries.append(
                    Namespace(
                        class_path="lowrank_lit.callbacks.ResumeCheckpoint",
                        init_args=Namespace(every_n_train_steps=int(every)),
                    )
                )
            wants_bar = trainer_cfg.get("enable_progress_bar") is not False
            if wants_bar and not any(issubclass(c, ProgressBar) for c in classes) and not _stdout_is_terminal():
                entries.append(Namespace(class_path="lowrank_lit.callbacks.LogProgress", init_args=Namespace()))
            return entries

        def instantiate_classes(self) -> None:
            """Build model, data and trainer; a bad argument becomes a one-line :class:`ConfigError`.

            A run directory created for this run is removed again when nothing could be built.
            """
            try:
                super().instantiate_classes()
            except Exception as exc:
                if self.run_dir is not None:
                    self._remove_if_new(self.run_dir)
                root = exc
                while root.__cause__ is not None:
                    root = root.__cause__
                if isinstance(root, (ValueError, TypeError, ImportError, AttributeError)):
                    raise ConfigError(f"{type(root).__name__}: {_first_line(root)}") from exc
                raise

        def _loggers(self, value: Any, run_dir: RunDir) -> Any:
            if value is False:  # logging explicitly switched off
                return False
            entries = [] if value in (None, True) else list(value) if isinstance(value, list) else [value]
            csv = [e for e in entries if issubclass(_import(e.class_path), CSVLogger)]
            if not csv:
                csv = [Namespace(class_path="lightning.pytorch.loggers.CSVLogger", init_args=Namespace())]
            others = [e for e in entries if e not in csv]
            # CSV first: trainer.log_dir (config.yaml) and checkpoints/ then live in the run directory itself
            csv[0].init_args.update(Namespace(save_dir=str(run_dir.path), name="", version=""))
            for entry in others:
                if issubclass(_import(entry.class_path), WandbLogger):
                    self._configure_wandb(entry.init_args, run_dir)
            return [csv[0], *others]

        @staticmethod
        def _configure_wandb(args: Namespace, run_dir: RunDir) -> None:
            args.save_dir = str(run_dir.path)
            if os.environ.get("WANDB_MODE", "").lower() != "disabled":
                args.offline = bool(args.get("offline")) or not wandb_online_allowed()
            args.id = args.get("id") or run_dir.wandb_id
            args.name = args.get("name") or f"{run_dir.experiment}/{run_dir.run_id}"
            args.group = args.get("group") or os.environ.get("WANDB_RUN_GROUP") or run_dir.experiment
            args.resume = args.get("resume") or "allow"  # a requeued SLURM job continues the same W&B run
            if args.get("project") in (None, "lightning_logs"):
                args.project = "lowrank_lit"

    return LowrankCLI


class _ParserReady(Exception):
    def __init__(self, cli: Any) -> None:
        self.cli = cli


def build_parser(subcommand: str = "fit") -> Any:
    """The real ``lowrank <subcommand>`` argument parser, without parsing or instantiating anything.

    ``build_parser("fit").parse_args(["--config", "x.yaml", "--model.init_args.lr=0.1"])`` checks a
    command line exactly as ``lowrank fit`` would (raising ``jsonargparse.ArgumentError``).
    """
    if subcommand not in LIGHTNING_COMMANDS:
        raise ValueError(f"build_parser: subcommand={subcommand!r}; allowed: {', '.join(LIGHTNING_COMMANDS)}")
    base = __getattr__("LowrankCLI")

    class _ParserOnly(base):  # type: ignore[misc, valid-type]
        def parse_arguments(self, parser: Any, args: Any) -> None:
            raise _ParserReady(self)

    try:
        _ParserOnly(args=[subcommand])
    except _ParserReady as ready:
        return ready.cli._parser(subcommand)
    raise RuntimeError("LightningCLI did not reach argument parsing")


def __getattr__(name: str) -> Any:
    if name == "LowrankCLI":
        cls = _build_cli_class()
        globals()["LowrankCLI"] = cls
        return cls
    raise AttributeError(name)


# --------------------------------------------------------------------------- our commands
def methods_markdown() -> str:
    """The README's method table, generated from the registry."""
    from lowrank_lit import registry

    rows = ["| slug | kind | paper | configs |", "|---|---|---|---|"]
    for m in registry.scan_methods():
        configs = "<br>".join(f"`{c}`" for c in m.configs()) or "-"
        rows.append(f"| `{m.slug}` | {m.kind} | {m.paper} | {configs} |")
    return "\n".join(rows) + "\n"


def cmd_list(argv: Sequence[str]) -> int:
    """``lowrank list [--markdown]``: one row per registered method."""
    import argparse

    from lowrank_lit import registry

    parser = argparse.ArgumentParser(prog="lowrank list", description="List the registered methods.")
    parser.add_argument("--markdown", action="store_true", help="print the README's markdown table")
    opts = parser.parse_args(list(argv))
    if opts.markdown:
        print(methods_markdown(), end="")
        return 0
    methods = registry.scan_methods()  # from the source files: no torch, no Lightning
    if not methods:
        print("no methods registered")
        return 0
    rows = [("slug", "kind", "paper", "configs")]
    rows += [(m.slug, m.kind, m.paper, ", ".join(m.configs()) or "-") for m in methods]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3])
    return 0


def cmd_sweep(argv: Sequence[str]) -> int:
    """``lowrank sweep``: run a W&B sweep file offline with optuna."""
    from lowrank_lit.launch.sweep import main as sweep_main

    return sweep_main(list(argv))


def cmd_submit(argv: Sequence[str]) -> int:
    """``lowrank submit``: write and submit an sbatch script."""
    from lowrank_lit.launch.slurm import main as submit_main

    return submit_main(list(argv))


COMMANDS: dict[str, Callable[[Sequence[str]], int]] = {"list": cmd_list, "sweep": cmd_sweep, "submit": cmd_submit}


# --------------------------------------------------------------------------- errors
_KEY_RE = re.compile(r'Parser key "([^"]+)"')
_CLASS_RE = re.compile(r"Problem with given class_path '([^']+)'")
_OPTION_RE = re.compile(r"Option '([^']+)' is not accepted")
_EXPECTED_RE = re.compile(r"Expected an? <class '([^']+)'>")
_GOT_RE = re.compile(r"(?:Given|Got) value: (.*)$")


_UNRECOGNIZED_RE = re.compile(r"unrecognized arguments: (\S+)")
_IMPORT_FAIL_RE = re.compile(r"No module named|has no attribute|cannot import|Import path|not a (class|subclass)|does not exist")


def _option_names(parser: Any) -> list[str]:
    """Every ``--dotted.key`` a (sub)command parser accepts."""
    return [s for action in getattr(parser, "_actions", []) for s in action.option_strings if s.startswith("--")]


def _did_you_mean(name: str, candidates: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {match[0]}?" if match else ""


def _init_arg_names(class_path: str) -> list[str]:
    """Argument names of a class's ``__init__`` (empty when it cannot be imported)."""
    try:
        module, _, name = class_path.rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]
    except Exception:  # noqa: BLE001 - only a hint
        return []


def _one_line_error(exc: BaseException, parser: Any = None) -> str:
    """Condense a nested jsonargparse error into one line naming the full config key.

    ``Parser key "model": ... class_path 'X': Option 'bogus' is not accepted`` becomes
    ``unknown key 'model.init_args.bogus' (not an argument of X)`` plus the closest argument of X;
    ``unrecognized arguments: --trainer.max_epoch=3`` becomes ``unknown key 'trainer.max_epoch'; did you
    mean --trainer.max_epochs?`` (candidates from ``parser``, the subcommand's parser); a class_path that
    cannot be imported becomes ``cannot import 'x.y.Z': ...``; a type error becomes
    ``trainer.max_epochs: expected int, got 'abc'``. Anything else keeps its first line.
    """
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    if m := _UNRECOGNIZED_RE.search(lines[0]):
        name = m.group(1).split("=", 1)[0]
        hint = _did_you_mean(name, _option_names(parser)) if parser is not None else ""
        return f"unknown key {name.lstrip('-')!r}" + (hint or "; `--help` lists the keys")
    if lines[0].startswith('Parser key "config"') and len(lines) > 1:
        return f"--config: {lines[1]}"
    key_parts: list[str] = []
    cls = None
    for i, ln in enumerate(lines):
        if m := _KEY_RE.search(ln):
            key_parts.append(m.group(1))
        if m := _CLASS_RE.search(ln):
            cls = m.group(1)
            detail = lines[i + 1] if i + 1 < len(lines) else ""
            if _IMPORT_FAIL_RE.search(detail) and not _KEY_RE.search(detail):
                where = ".init_args.".join(key_parts)
                return f"cannot import {cls!r} ({where}.class_path): {detail}"
        if m := _OPTION_RE.search(ln):
            key = ".init_args.".join([*key_parts, m.group(1)])
            owner = f" (not an argument of {cls})" if cls else ""
            names = _init_arg_names(cls) if cls else []
            hint = _did_you_mean(m.group(1), names)
            if hint:
                hint = f"; did you mean --{key.rsplit('.', 1)[0]}.{hint.split('mean ', 1)[1]}"
            return f"unknown key {key!r}{owner}{hint}"
    if key_parts and (m := _EXPECTED_RE.search(text)):
        got = next((g.group(1) for ln in lines if (g := _GOT_RE.search(ln))), None)
        got_text = f", got {got!r}" if got is not None else ""
        return f"{'.init_args.'.join(key_parts)}: expected {m.group(1)}{got_text}"
    return lines[0]


def main(args: Sequence[str] | None = None) -> int:
    """Entry point of ``lowrank`` and ``python -m lowrank_lit``; returns the exit status."""
    argv = list(sys.argv[1:] if args is None else args)
    if not argv or argv[0] in ("-h", "--help"):
        print(_TOP_HELP, end="")
        return 0
    if argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    if argv[0] not in LIGHTNING_COMMANDS:
        print(
            f"lowrank: error: unknown command {argv[0]!r}; choose from {', '.join((*LIGHTNING_COMMANDS, *COMMANDS))}",
            file=sys.stderr,
        )
        return 2
    missing = [c for c in config_files(argv[1:]) if not Path(c).is_file()]
    if missing:  # answered before Lightning is imported
        print(f"lowrank {argv[0]}: error: --config: file {missing[0]!r} does not exist", file=sys.stderr)
        return 2
    from jsonargparse import ArgumentError
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    cli_class = __getattr__("LowrankCLI")
    cli_class.last_run_dir = None
    try:
        # args=None lets LightningCLI read sys.argv itself (it warns when both are given)
        cli_class(args=None if args is None else argv)
    except ArgumentError as exc:
        print(f"lowrank {argv[0]}: error: {_one_line_error(exc)}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"lowrank {argv[0]}: error: {exc}", file=sys.stderr)
        return 2
    except SIGTERMException as exc:
        run_dir = cli_class.last_run_dir
        if _is_rank_zero():
            print(interrupted_message(argv, run_dir, exc), file=sys.stderr, flush=True)
        code = exc.code if isinstance(exc.code, int) and exc.code else 128 + int(signal.SIGTERM)
        return code
    run_dir = cli_class.last_run_dir
    if run_dir is not None and _is_rank_zero():
        print(f"run {run_dir.experiment}/{run_dir.run_id} finished: {run_dir.path}", flush=True)
    return 0


def config_files(argv: Sequence[str]) -> list[str]:
    """The values of ``--config``/``-c`` in a command line (both ``--config x`` and ``--config=x``)."""
    files = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def resume_command(argv: Sequence[str], run_id: str) -> str:
    """The command that resumes a run: ``argv`` without ``--run_id``/``--ckpt_path``, plus both for this run."""
    keep: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        if arg in ("--run_id", "--ckpt_path"):
            skip_next = True
            continue
        if arg.startswith(("--run_id=", "--ckpt_path=")):
            continue
        keep.append(arg)
    return shlex.join(["lowrank", *keep, "--run_id", run_id, "--ckpt_path", "last"])


def interrupted_message(argv: Sequence[str], run_dir: Any, exc: BaseException) -> str:
    """What an interrupted run prints: where it stopped, what was saved, and the exact resume command."""
    what = str(exc) if str(exc) and not str(exc).isdigit() else "interrupted"
    if run_dir is None:
        return f"lowrank {argv[0]}: {what}"
    ckpt = run_dir.path / "checkpoints" / "last.ckpt"
    lines = [f"lowrank {argv[0]}: {what}; run directory {run_dir.path}"]
    if ckpt.is_file():
        lines.append(f"  checkpoint: {ckpt}")
        lines.append(f"  resume with: {resume_command(argv, run_dir.run_id)}")
    else:
        lines.append("  no checkpoint was written (interrupted before the first training batch ended)")
    return "\n".join(lines)
