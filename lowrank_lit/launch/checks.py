"""What the command line checks and says, without importing Lightning or torch.

The pieces of ``lowrank``'s user interface that must answer fast or be shared by the launchers:
whether W&B may go online, the experiment name of a config, one-line parse errors with the closest
valid key, checks of the input files a run starts from, the resume command of an interrupted run,
and the list of known-harmless messages that every run is spared.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
import logging
import netrc
import os
import re
import shlex
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args
from urllib.parse import urlparse

from lowrank_lit.argtypes import input_path_args

__all__ = [
    "LIGHTNING_COMMANDS", "ConfigError", "YamlFileError", "load_yaml", "merge_config_layers", "appends_applied", "KNOWN_NOISE", "closest", "config_file_error", "yaml_syntax_error", "check_input_files", "check_values", "setup_error", "config_files", "experiment_from_configs", "first_line",
    "interrupted_message", "is_rank_zero", "one_line_error", "quiet_known_noise",
    "resume_command", "stdout_is_terminal", "wandb_online_allowed", "RunSpec", "NEEDS", "ConfigHeader", "config_header",
    "resolve_path_templates", "import_dotted",
]


#: the subcommands LightningCLI provides (a config's ``run.verb`` is one of them)
Verb = Literal["fit", "validate", "test", "predict"]
LIGHTNING_COMMANDS: tuple[str, ...] = get_args(Verb)


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


# --------------------------------------------------------------------------- run checks
def is_rank_zero() -> bool:
    return all(int(os.environ.get(k, "0") or 0) == 0 for k in ("LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


class ConfigError(Exception):
    """A config value was accepted by the parser but rejected by the class it configures."""


#: ckpt_path values Lightning resolves itself (not file names)
_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")
_INPUT_KEY_RE = re.compile(r"(^|\.)(ckpt_path|[a-z_]*_ckpt|init_from)$")


#: what a user may need beyond this checkout (a config's ``run.needs``)
Need = Literal["gpu", "your_files"]
NEEDS: tuple[str, ...] = get_args(Need)


@dataclass
class RunSpec:
    """How a config is run: its ``run:`` block, which the CLI parses like ``experiment`` and ``run_root``, and which
    ``lowrank fit`` (is this a training config?), its hints (what must run first), ``lowrank list`` and the tests read.

    Args:
        verb: the ``lowrank`` command that runs the config: ``fit`` trains; ``test`` evaluates (a test-time method, a
            bound, a quantized model); ``predict``; ``validate``.
        first: the command that makes what the config starts from (a source model, a pretrained encoder), e.g.
            ``lowrank fit --config configs/tta/source_bn_cnn_digits.yaml``; None: nothing.
        needs: what a user must have beyond this checkout: ``gpu``, ``your_files`` (data, weights or checkpoints you
            bring; CI rehearses such a config with fixtures).
        tested_by: the test that runs the config end to end when it cannot run as it is (it needs a checkpoint that
            test makes, or your files): ``tests/<file>.py`` or ``tests/rehearsal/test_rehearsal.py::test_x``; None:
            CI runs it as it is.
        args: what the command needs beyond ``--config`` (where your files are, a checkpoint), as you would type
            it, e.g. ``[--data.init_args.data_dir=/data/cifar10]``; ``lowrank list <slug>`` prints the whole command
            and the rehearsal replaces each path with a fixture's.
    """

    verb: Verb = "fit"
    first: str | None = None
    needs: list[Need] = field(default_factory=list)
    tested_by: str | None = None
    args: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ConfigHeader:
    """What a config's ``run:`` block (and its trainer's accelerator) says about running it.

    Attributes:
        command: ``run.verb`` (``fit``, ``test``, ...), or None when the file declares none (a fragment).
        first: ``run.first``, the command that makes what it starts from, or None.
        your_data: it reads files you bring (``your_files`` in ``run.needs``).
        gpu: it asks for a GPU (``gpu`` in ``run.needs``, or ``trainer.accelerator`` gpu / cuda).
        tested_by: ``run.tested_by``, the test that runs it end to end when it cannot run as it is, or None.
        args: ``run.args``, what its command needs beyond ``--config``.
    """

    command: str | None
    first: str | None
    your_data: bool
    gpu: bool
    tested_by: str | None = None
    args: tuple[str, ...] = ()

    def command_line(self, path: str | Path) -> list[str]:
        """The command that runs the config at ``path``, after ``lowrank``: ``[verb, --config, path, *args]``."""
        return [self.command or "fit", "--config", str(path), *self.args]

    def needs(self) -> str:
        """``"GPU, your files"``, ``"your files"``, ... or ``"-"``."""
        return ", ".join([*(["GPU"] if self.gpu else []), *(["your files"] if self.your_data else [])]) or "-"


def _top_level_block(text: str, key: str) -> str:
    """The lines of the top-level mapping ``key:`` of a YAML text (its key line and the indented lines after it)."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith(f"{key}:")), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in ("", " ", "#")), len(lines))
    return "\n".join(lines[start:end])


def config_header(path: str | Path) -> ConfigHeader:
    """Read :class:`ConfigHeader` from a config file's ``run:`` block and ``trainer.accelerator`` (only those two
    blocks are parsed, with PyYAML: ``lowrank list`` reads every config; no torch, no Lightning)."""
    import yaml

    text = Path(path).read_text()
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    run = (yaml.load(_top_level_block(text, "run"), Loader=loader) or {}).get("run") or {}
    trainer = (yaml.load(_top_level_block(text, "trainer"), Loader=loader) or {}).get("trainer") or {}
    needs = run.get("needs") or []
    gpu = "gpu" in needs or str(trainer.get("accelerator")) in ("gpu", "cuda")
    return ConfigHeader(run.get("verb"), run.get("first"), "your_files" in needs, gpu, run.get("tested_by"),
                        tuple(run.get("args") or ()))


def wrong_command(command: str, files: Sequence[str]) -> str | None:
    """The one-line error for ``lowrank fit`` on a config that evaluates (its ``run.verb`` is ``test`` or
    ``predict``: a test-time method, a detector, a bound), else None. ``validate``/``test``/``predict`` on a training
    config are fine (they evaluate its checkpoint)."""
    for f in files:
        try:
            header = config_header(f)
        except OSError:
            continue
        if header.command is None:
            continue
        if command == "fit" and header.command in ("test", "predict"):
            what = "evaluates" if header.command == "test" else "predicts"
            return f"{f} {what} (it does not train); run: lowrank {header.command} --config {f}"
        return None
    return None


_TEMPLATE_RE = re.compile(r"\{([a-z_][a-z0-9_]*)\}")


def resolve_path_templates(cfg: Any) -> dict[str, str]:
    """Fill the templates of the model's and the data's string arguments, in place, once, before anything is built
    (the CLI puts the templates back after building, so a run's config.yaml keeps what the user wrote and runs of
    several seeds stay one experiment).

    ``{seed}`` is the run's seed (``seed_everything``, which LightningCLI has fixed by now; 0 when seeding is off);
    ``{name}`` is the value of the init argument ``name`` of the same section (``{torso}`` in bayes_prefix's
    ``pretrained`` is ``model.init_args.predictor.init_args.torso``). A name that is neither stays as written.
    Per-seed checkpoints are the use: ``source_ckpt: runs/trust/source/seed{seed}/checkpoints/last.ckpt``.

    Returns:
        ``key -> the template as written`` of every argument that was filled.
    """
    seed = cfg.get("seed_everything")
    seed = seed if isinstance(seed, int) and not isinstance(seed, bool) else 0
    leaves = dict(cfg.items())
    filled = {}
    for key, value in leaves.items():
        section = key.split(".", 1)[0]
        if section not in ("model", "data") or not isinstance(value, str) or "{" not in value:
            continue

        def fill(match: re.Match[str], section: str = section) -> str:
            name = match.group(1)
            if name == "seed":
                return str(seed)
            found = [v for k, v in leaves.items() if k.startswith(section + ".") and k.endswith(f".init_args.{name}")
                     and isinstance(v, str | int | float) and not isinstance(v, bool)]
            return str(found[0]) if found else match.group(0)

        new = _TEMPLATE_RE.sub(fill, value)
        if new != value:
            cfg[key], filled[key] = new, value
    return filled


def check_input_files(cfg: Any) -> None:
    """Checkpoints a run starts from (``ckpt_path``, ``*_ckpt``, ``init_from``) must exist before anything runs
    (templates such as ``{seed}`` are filled first: :func:`resolve_path_templates`).

    Raises:
        ConfigError: naming the key, the missing file and, when a config says so in its ``run.first``,
            the command that makes it.
    """
    for key, value in cfg.items():
        if not isinstance(value, str) or not _INPUT_KEY_RE.search(key) or "://" in value:
            continue
        if key == "ckpt_path" and value in _CKPT_KEYWORDS:
            continue
        if not Path(value).exists():
            first = cfg.get("run.first")
            hint = f"; make it first with: {first}" if first else "; train that model first or fix the path"
            raise ConfigError(f"{key}={value!r} does not exist{hint}")


def import_dotted(path: str) -> Any:
    """The object a dotted path names: ``"torch.optim.AdamW"`` -> the class (its module is imported)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _class_args(cfg: Any) -> list[tuple[str, type]]:
    """``(prefix, class)`` of every class a config builds: ``("data.init_args", MyData)``,
    ``("model.init_args.optimizer.init_args", torch.optim.AdamW)``; classes that cannot be imported are left out."""
    found = []
    for key, value in cfg.items():
        if not (key == "class_path" or key.endswith(".class_path")) or not isinstance(value, str) or "." not in value:
            continue
        try:
            cls = import_dotted(value)
        except Exception:  # noqa: BLE001 - the parser has already said what it could not import
            continue
        if isinstance(cls, type):
            found.append((key[: -len("class_path")] + "init_args", cls))
    return found


def _leaves(value: Any, key: str) -> list[tuple[str, Any]]:
    """``(key, value)`` of a config value, lists as ``key[i]`` and mappings as ``key.name``."""
    if isinstance(value, list | tuple):
        return [pair for i, v in enumerate(value) for pair in _leaves(v, f"{key}[{i}]")]
    if isinstance(value, dict):
        return [pair for k, v in value.items() for pair in _leaves(v, f"{key}.{k}")]
    return [(key, value)]


def _is_torch_optimizer(cls: type) -> bool:
    import torch

    return issubclass(cls, torch.optim.Optimizer) and cls.__module__.startswith("torch.")


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def check_values(cfg: Any, subcommand: str | None = None) -> None:
    """Values that would fail only after the run started, or fail with a message that names no argument: checked
    before a run directory exists.

    * files and folders you bring exist: every init argument typed :data:`~lowrank_lit.argtypes.InputPath`
      (``data.init_args.train_path``, ``features``, ``test_csvs``, ...), found by its type in the class's signature
      (our own learning rates are typed :data:`~lowrank_lit.argtypes.LearningRate` and refused while parsing);
    * the ``lr`` of a torch optimizer (``torch.optim.AdamW``, which types it ``float | Tensor``) is > 0;
    * ``trainer.max_epochs`` / ``trainer.max_steps`` are -1 (no limit) or >= 0, and not 0 for ``fit`` (``subcommand``);
    * a config that asks for a GPU (``trainer.accelerator: gpu``/``cuda``) runs where one is visible;
    * ``trainer.precision`` 16-mixed runs on a GPU (on the CPU Lightning would run bf16-mixed instead, while the
      run's config said 16-mixed).

    Raises:
        ConfigError: one line naming the argument, its value and what is allowed.
    """
    trainer = cfg.get("trainer")
    accel = str((trainer.get("accelerator") if trainer is not None else None) or "").lower()
    if accel in ("gpu", "cuda"):  # first: on a machine without a GPU nothing else about the run matters
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"trainer.accelerator={accel!r}, but no GPU is visible here "
                              "(torch.cuda.is_available() is False); allowed here: cpu or auto "
                              "(--trainer.accelerator=cpu, or rehearse the config: pytest -m rehearsal)")
    precision = str(trainer.get("precision") if trainer is not None else None)
    if precision in ("16-mixed", "16") and (accel == "cpu" or (accel in ("", "auto") and not _cuda_visible())):
        # Lightning would run bf16-mixed instead while config.yaml and every summary said 16-mixed
        raise ConfigError(f"trainer.precision={precision!r} needs a GPU (float16 autocast); on the CPU allowed: "
                          "32-true, 64-true, bf16-mixed, bf16-true")
    for prefix, cls in _class_args(cfg):
        for arg in input_path_args(cls):  # typed InputPath: a file or folder the user brings
            key = f"{prefix}.{arg}"
            for k, v in _leaves(cfg.get(key), key):
                if isinstance(v, str) and "://" not in v and not Path(v).exists():
                    raise ConfigError(f"{k}={v!r}: no such file or folder (a file you bring: give its path, "
                                      f"--{k.split('[')[0]}=...)")
        if _is_torch_optimizer(cls):  # torch's own optimizers: their lr is not typed, and they refuse 0 only when built
            value = cfg.get(f"{prefix}.lr")
            if isinstance(value, int | float) and not isinstance(value, bool) and value <= 0:
                raise ConfigError(f"{prefix}.lr={value!r}; allowed: a number > 0 (a learning rate)")
    if trainer is not None:
        for name in ("max_epochs", "max_steps"):
            value = trainer.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value < -1:
                raise ConfigError(f"trainer.{name}={value}; allowed: -1 (no limit), 0 or a positive integer")
            if subcommand == "fit" and value == 0 and not isinstance(value, bool):
                # Lightning would stop before the first step and report the run as finished (and test an untrained model)
                raise ConfigError(f"trainer.{name}=0 trains nothing; allowed for fit: -1 (no limit) or a positive "
                                  "integer (to evaluate a checkpoint without training: lowrank test --ckpt_path ...)")


def setup_error(exc: BaseException, cfg: Any) -> str:
    """One line for an error raised while a run was being set up (before its first batch): the exception's first
    line, prefixed with the argument whose value it quotes when there is one (a missing file, a bad channel)."""
    line = first_line(exc)
    quoted = set(re.findall(r"'([^']+)'", line)) | set(re.findall(r"\"([^\"]+)\"", line))
    for key, value in cfg.items() if cfg is not None else []:
        if key.startswith(("data.", "model.")):
            for k, v in _leaves(value, key):
                if isinstance(v, str) and v in quoted:
                    return f"{k}={v!r}: {line}"
    return line


def first_line(exc: BaseException) -> str:
    return next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)


#: messages every run printed that say nothing about the run (matched at the start of the text)
KNOWN_NOISE = (
    "💡 Tip: For seamless",  # Lightning's advertisement for litlogger / litmodels
    "`weights_only` was not set",  # Lightning, at every checkpoint save; lowrank checkpoints hold full state
    r".*isinstance\(treespec, LeafSpec\)",  # Lightning's use of a deprecated torch pytree API
    # the run directory already holds config.yaml (and wandb/); metrics.csv of an earlier attempt is kept as
    # metrics.<n>.csv by the run directory before the CSV logger starts, so nothing is deleted
    "Experiment logs directory .* exists and is not empty",
    # Lightning's device summary on stderr at every Trainer: the run's start lines on stdout say what it runs on
    # (``devices: ...``), so a command refused at setup prints its one error line only
    "GPU available: ", "TPU available: ", "HPU available: ",
    # Lightning's lines around loading a resumed checkpoint: the run prints "resumed at step N" itself, and a checkpoint
    # refused while loading prints its one error line only
    "Restoring states from the checkpoint path at ", "Restored all states from the checkpoint at ",
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


# --------------------------------------------------------------------------- errors
_KEY_RE = re.compile(r'Parser key "([^"]+)"')
_CLASS_RE = re.compile(r"Problem with given class_path '([^']+)'")
_OPTION_RE = re.compile(r"Option '([^']+)' is not accepted")
_EXPECTED_RE = re.compile(r"Expected an? <class '([^']+)'>")
_GOT_RE = re.compile(r"(?:Given|Got) value: (.*)$")
_LITERAL_RE = re.compile(r"Expected an? typing\.Literal\[(.*?)\]")
_UNRECOGNIZED_RE = re.compile(r"unrecognized arguments: (\S+)")
_NOT_ACCEPTED_RE = re.compile(r"does not accept option '([^']+)'")
_RESTRICTED_RE = re.compile(r"Not of type (\w+): (.+)$")
_NESTED_RE = re.compile(r"NestedArg\(key='[^']*', val='(.*)'\)")
#: what jsonargparse's restricted types allow, in words
_RESTRICTED = {"PositiveInt": "an integer > 0", "NonNegativeInt": "an integer >= 0", "PositiveFloat": "a number > 0",
               "NonNegativeFloat": "a number >= 0", "ClosedUnitInterval": "a number in [0, 1]",
               "OpenUnitInterval": "a number in (0, 1)"}
_IMPORT_FAIL_RE = re.compile(r"No module named|has no attribute|cannot import|Import path|not a (class|subclass)|does not exist")


def _option_names(parser: Any) -> list[str]:
    """Every ``--dotted.key`` a (sub)command parser accepts, from its defaults (jsonargparse's public API)."""
    try:
        keys = parser.get_defaults().keys()
    except Exception:  # a parser whose defaults cannot be built names no keys: no "did you mean" hint
        return []
    return [f"--{k}" for k in keys]


def closest(name: str, candidates: Sequence[str], cutoff: float = 0.6) -> str | None:
    """The candidate most similar to ``name`` (difflib ratio >= ``cutoff``), else None: for "did you mean" hints."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=cutoff)
    return match[0] if match else None


def _init_arg_names(class_path: str) -> list[str]:
    """Argument names of a class's ``__init__`` (empty when it cannot be imported)."""
    try:
        cls = import_dotted(class_path)
        return [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")]
    except Exception:  # noqa: BLE001 - only a hint
        return []


def one_line_error(exc: BaseException, parser: Any = None) -> str:
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
    if m := _NOT_ACCEPTED_RE.search(lines[0]):  # a key in a config file that no argument has
        name = m.group(1)
        match = closest(f"--{name}", _option_names(parser)) if parser is not None else None
        hint = f"; did you mean {match.lstrip('-')}?" if match else "; `--help` lists the keys"
        return f"unknown key {name!r} in a config file{hint}"
    if m := _UNRECOGNIZED_RE.search(lines[0]):
        name = m.group(1).split("=", 1)[0]
        match = closest(name, _option_names(parser)) if parser is not None else None
        return f"unknown key {name.lstrip('-')!r}" + (f"; did you mean {match}?" if match else "; `--help` lists the keys")
    if lines[0].startswith('Parser key "config"') and len(lines) > 1:
        return f"--config: {lines[1]}"
    literal = next(((i, lit) for i, ln in enumerate(lines) if (lit := _LITERAL_RE.search(ln))), None)
    if literal is not None:  # a typed choice (in any branch of a union): the library checked it, we name the choices
        at, lit = literal
        parts = [m.group(1) for ln in lines[:at] if (m := _KEY_RE.search(ln))]
        choices = ", ".join(c.strip().strip("'\"") for c in lit.group(1).split(","))
        value = _GOT_RE.search(lines[at])
        return f"{'.init_args.'.join(parts)}{f'={value.group(1)!r}' if value else ''}; allowed: {choices}"
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
            match = closest(m.group(1), _init_arg_names(cls)) if cls else None
            hint = f"; did you mean --{key.rsplit('.', 1)[0]}.{match}?" if match else ""
            if key.startswith("trainer.callbacks.init_args.") and not match:
                hint = (f"; --trainer.callbacks.init_args.* sets the last callback given so far ({cls}): give the flag "
                        "before the --config that adds that callback")
            return f"unknown key {key!r}{owner}{hint}"
    if key_parts == ["seed_everything"] or (not key_parts and "seed_everything" in lines[0]):
        got = next((g.group(1) for ln in lines if (g := _GOT_RE.search(ln))), None)
        seed = f"={got!r}" if got is not None else ""
        return (f"--seed_everything{seed}: allowed: an integer seed, true (a random seed, saved in the run's config) "
                "or false (no seeding)")
    got = next((g.group(1) for ln in lines if (g := _GOT_RE.search(ln))), None)
    if got is not None and (nested := _NESTED_RE.fullmatch(got)):  # a value given to a class's argument
        got = nested.group(1)
    if key_parts and (m := next((r for ln in lines if (r := _RESTRICTED_RE.search(ln))), None)):  # PositiveInt, ...
        said = m.group(2)  # a type of ours (lowrank_lit.argtypes) says what it allows itself
        if got is None and (conform := re.match(r"(.+) does not conform to restriction", said)):
            got = conform.group(1)
        allowed = said.removeprefix("allowed: ") if said.startswith("allowed: ") else _RESTRICTED.get(
            m.group(1), f"{m.group(1)} ({said})")
        given = f"={got!r}" if got is not None else ""
        return f"{'.init_args.'.join(key_parts)}{given}; allowed: {allowed}"
    expected = [m for ln in lines if (m := _EXPECTED_RE.search(ln)) and m.group(1) != "NoneType"]
    if key_parts and expected:
        m = expected[0]
        got_text = f", got {got!r}" if got is not None else ""
        return f"{'.init_args.'.join(key_parts)}: expected {m.group(1)}{got_text}"
    return lines[0]


def yaml_syntax_error(path: str | os.PathLike, exc: Exception) -> str:
    """``"<path>: line L, column C: YAML syntax error: <problem>"`` for a YAML parse error of the file ``path``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or getattr(exc, "context", None) or first_line(exc)
    return f"{os.fspath(path)}:{where}: YAML syntax error: {problem}"


class YamlFileError(ValueError):
    """A YAML file a command reads that cannot be used as it is; the message is one line naming the file (and line)."""


@functools.cache
def _strict_loader() -> type:
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the later one without a word)."""
    import yaml

    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    class StrictLoader(base):  # type: ignore[misc, valid-type]
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                self.flatten_mapping(node)
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:  # an unhashable key: PyYAML's own error follows
                        continue
                    line = key_node.start_mark.line + 1
                    if first is not None:
                        raise YamlFileError(f"line {line}: key {key!r} is given twice in one mapping (first at line "
                                            f"{first}); YAML would keep only the later value: remove one")
                    seen[key] = line
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def load_yaml(path: str | os.PathLike, what: str, mapping: bool = True) -> Any:
    """Read a YAML file a command was given: one line naming ``what`` (the argument, e.g. ``--config``) and the file
    for a missing file, a folder, a syntax error (line and column), a key given twice in one mapping (both lines), and,
    with ``mapping``, an empty file or one that holds a list or a scalar instead of a mapping.

    Raises:
        YamlFileError: the one line.
    """
    import yaml

    p = Path(path)
    name = os.fspath(path)
    if p.is_dir():
        example = next(iter(sorted(p.glob("*.yaml"))), None)
        hint = f", e.g. {what} {example}" if example else ""
        raise YamlFileError(f"{what}: {name!r} is a folder; allowed: a YAML file{hint}")
    if not p.is_file():
        raise YamlFileError(f"{what}: file {name!r} does not exist")
    try:
        data = yaml.load(p.read_text(), Loader=_strict_loader())  # noqa: S506 - a safe loader
    except YamlFileError as exc:
        raise YamlFileError(f"{what}: {name}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        raise YamlFileError(f"{what}: {yaml_syntax_error(name, exc)}") from None
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        raise YamlFileError(f"{what}: {name}: not a readable YAML file ({first_line(exc)})") from None
    if mapping and data is None:
        raise YamlFileError(f"{what}: {name} is empty; allowed: a YAML mapping of keys (e.g. trainer:, model:, data:)")
    if mapping and not isinstance(data, dict):
        kind = "list" if isinstance(data, list) else f"{type(data).__name__} ({str(data)[:40]!r})"
        raise YamlFileError(f"{what}: {name}: line 1: the file holds a YAML {kind}; allowed: a mapping of keys "
                            "(e.g. trainer:, model:, data:)")
    return data


def merge_config_layers(layers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Compose config layers in order, by the rule ``lowrank`` applies to a ``--config`` stack; the one merge of
    ``--config`` files (the sweep's check), grid fragments (``lowrank matrix``) and anything else that layers configs.

    A later scalar or list replaces an earlier one; mappings merge key by key; ``key+: [a, b]`` (or ``key+: a``)
    appends to ``key`` when an earlier layer set it, and otherwise stays ``key+`` (concatenated with an earlier
    ``key+``) so that the parser appends it to what it holds when the merged layer is given to it; a later plain
    ``key`` drops an earlier ``key+``. The layers are not changed.
    """
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if isinstance(key, str) and key.endswith("+"):
                items = list(value) if isinstance(value, list) else [value]
                plain = key[:-1]
                if plain in out:
                    old = out[plain]
                    out[plain] = [*(old if isinstance(old, list) else [] if old is None else [old]), *items]
                else:
                    out[key] = [*out.get(key, []), *items]
            elif isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge_config_layers([out[key], value])
            else:
                out[key] = merge_config_layers([value]) if isinstance(value, dict) else value
                out.pop(f"{key}+", None)
    return out


def appends_applied(config: dict[str, Any]) -> dict[str, Any]:
    """A merged config as the parser holds it once every remaining ``key+`` is appended to the parser's default (an
    empty list): ``key+`` becomes ``key``. For checks of key names against what a stack of configs sets."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = key[:-1] if isinstance(key, str) and key.endswith("+") else key
        out[name] = appends_applied(value) if isinstance(value, dict) else value
    return out


def config_file_error(files: Sequence[str]) -> str | None:
    """One line for the first ``--config`` that is not a readable YAML mapping (missing, a folder, a syntax error with
    its file, line and column, a duplicated key, empty, a list), else None. Reads the files as text only: no
    Lightning, no torch."""
    for f in files:
        try:
            load_yaml(f, "--config")
        except YamlFileError as exc:
            return str(exc)
    return None


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
