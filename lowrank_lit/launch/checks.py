"""What is checked before a run starts, without importing Lightning (torch only where a value needs it).

Values that would fail only after the run started (files you bring, a torch optimizer's ``lr``, epochs, a GPU the
config asks for), the checkpoints a run starts from, the path templates filled before anything is built, and where
the command runs (may W&B go online? rank zero? a terminal?).
"""

from __future__ import annotations

import netrc
import os
import re
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lowrank_lit.argtypes import input_path_args
from lowrank_lit.launch.messages import ConfigError, first_line
from lowrank_lit.registry import import_dotted

__all__ = ["wandb_online_allowed", "is_rank_zero", "stdout_is_terminal", "resolve_path_templates", "check_input_files",
           "check_values", "setup_error"]


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


def is_rank_zero() -> bool:
    return all(int(os.environ.get(k, "0") or 0) == 0 for k in ("LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def stdout_is_terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


#: ckpt_path values Lightning resolves itself (not file names)
_CKPT_KEYWORDS = ("last", "best", "hpc", "registry")
_INPUT_KEY_RE = re.compile(r"(^|\.)(ckpt_path|[a-z_]*_ckpt|init_from)$")
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
