"""What a resume may change: the one place that compares a resumed run's command line with the run it continues.

A resume (``lowrank fit ... --ckpt_path last``, a requeued SLURM job, or ``--ckpt_path`` naming another run's
checkpoint) restores the weights, the optimizer state (learning rate and weight decay included), the schedulers and the
state of every stateful callback from the checkpoint. A hyperparameter changed on the command line would therefore be
ignored while ``config.yaml`` recorded it. So before anything in the run directory changes, the resumed config is
compared with the config the checkpoint was trained with (the ``config.yaml`` of the run that wrote it):

* the keys of :data:`MAY_CHANGE` (how long to train, evaluation and logging, where it runs, the names of the run)
  and callbacks that only observe (:data:`OBSERVERS`) may change, and apply;
* any other difference is refused in one line listing each key with both values (:func:`check_resume`), unless the
  command asks for it with ``--resume_changes=apply``: the new config then builds the model, data and callbacks,
  the checkpoint's state loads into them, and the new optimizer hyperparameters are set on the restored optimizer
  (:class:`~lowrank_lit.callbacks.resume.ApplyResumeChanges`); ``config.yaml`` records the new config and the earlier
  one is kept as ``config.<n>.yaml``.

A checkpoint with no ``config.yaml`` beside it (written outside ``lowrank``) is checked against what it holds: the
model class of its hyperparameters and the callbacks whose state it carries.

docs/cli.md ("Resuming a run") renders :data:`MAY_CHANGE` as its table (a test keeps them equal).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

__all__ = ["MAY_CHANGE", "OBSERVERS", "ResumeChanges", "RESUME_CHANGES", "Change", "config_changes", "check_resume",
           "saved_config", "saved_config_path", "may_change_markdown"]

#: what ``--resume_changes`` allows: ``refuse`` (the default) or ``apply``
ResumeChanges = Literal["refuse", "apply"]
RESUME_CHANGES: tuple[str, ...] = get_args(ResumeChanges)

#: config keys (and everything below them) a resume may change, with why it is safe: none of them is restored from
#: the checkpoint or changes what the restored state means
MAY_CHANGE: dict[str, str] = {
    "trainer.max_epochs": "how long to train",
    "trainer.max_steps": "how long to train",
    "trainer.max_time": "how long to train",
    "trainer.min_epochs": "how long to train",
    "trainer.min_steps": "how long to train",
    "trainer.logger": "logging",
    "trainer.log_every_n_steps": "logging",
    "trainer.enable_progress_bar": "logging",
    "trainer.enable_model_summary": "logging",
    "trainer.profiler": "logging",
    "trainer.val_check_interval": "evaluation",
    "trainer.check_val_every_n_epoch": "evaluation",
    "trainer.limit_val_batches": "evaluation",
    "trainer.limit_test_batches": "evaluation",
    "trainer.limit_predict_batches": "evaluation",
    "trainer.num_sanity_val_steps": "evaluation",
    "test_after_fit": "evaluation",
    "checkpoint_every_n_steps": "checkpoints",
    "trainer.devices": "where it runs",
    "trainer.num_nodes": "where it runs",
    "trainer.accelerator": "where it runs",
    "trainer.strategy": "where it runs",
    "data.init_args.num_workers": "where it runs",
    "trainer.default_root_dir": "the run's names",
    "ckpt_path": "the run's names",
    "run_id": "the run's names",
    "run_root": "the run's names",
    "experiment": "the run's names",
    "config": "the run's names",
    "run": "the run's names",
    "resume_changes": "the run's names",
}

#: callbacks that only observe a run (progress, summaries, checkpoint files, learning-rate logs): added, removed or
#: changed on a resume without a word (by class, subclasses included)
OBSERVERS: tuple[str, ...] = (
    "lightning.pytorch.callbacks.ProgressBar",
    "lightning.pytorch.callbacks.ModelSummary",
    "lightning.pytorch.callbacks.LearningRateMonitor",
    "lightning.pytorch.callbacks.DeviceStatsMonitor",
    "lightning.pytorch.callbacks.ModelCheckpoint",
    "lowrank_lit.callbacks.ResumeCheckpoint",
    "lowrank_lit.callbacks.LogProgress",
)

_ABSENT = "<absent>"


@dataclass(frozen=True)
class Change:
    """One key whose value differs between the checkpoint's config (``old``) and the resumed one (``new``)."""

    key: str
    old: Any
    new: Any

    def __str__(self) -> str:
        return f"{self.key} {_show(self.old)} -> {_show(self.new)}"


def _show(value: Any) -> str:
    text = value if value is _ABSENT else repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _may_change(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") or key.startswith(k + "[") for k in MAY_CHANGE)


@functools.cache
def _observer_classes() -> tuple[type, ...]:
    """The classes of :data:`OBSERVERS` that import here."""
    from lowrank_lit.registry import import_dotted

    found = []
    for path in OBSERVERS:
        try:
            found.append(import_dotted(path))
        except Exception:  # noqa: BLE001 - an observer that does not import here observes nothing
            continue
    return tuple(found)


def _is_observer(class_path: Any) -> bool:
    from lowrank_lit.registry import import_dotted

    if not isinstance(class_path, str):
        return False
    try:
        cls = import_dotted(class_path)
    except Exception:  # noqa: BLE001 - a class that does not import is compared by its path
        return False
    return isinstance(cls, type) and issubclass(cls, _observer_classes())


def _flatten(value: Any, key: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{key}.{k}" if key else str(k), out)
    else:
        out[key] = value


def _stateful_callbacks(config: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(class name, init args)`` of the config's callbacks that are not :data:`OBSERVERS`, in order."""
    entries = (config.get("trainer") or {}).get("callbacks") or []
    entries = entries if isinstance(entries, list) else [entries]
    out = []
    for e in entries:
        path = e.get("class_path") if isinstance(e, dict) else e
        if not _is_observer(path):
            out.append((str(path).rsplit(".", 1)[-1], (e.get("init_args") or {}) if isinstance(e, dict) else {}))
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any]) -> list[Change]:
    """The differences between two resolved configs (as ``config.yaml`` holds them) that a resume may not make:
    every leaf key outside :data:`MAY_CHANGE`, and the callbacks other than :data:`OBSERVERS` (by class and
    init arguments)."""
    old_flat: dict[str, Any] = {}
    new_flat: dict[str, Any] = {}
    _flatten(old, "", old_flat)
    _flatten(new, "", new_flat)
    changes = []
    for key in sorted(set(old_flat) | set(new_flat), key=lambda k: (k.count("."), k)):
        if _may_change(key) or key == "trainer.callbacks" or key.startswith("trainer.callbacks."):  # compared below
            continue
        a, b = old_flat.get(key, _ABSENT), new_flat.get(key, _ABSENT)
        if a != b:
            changes.append(Change(key, a, b))
    old_cbs, new_cbs = _stateful_callbacks(old), _stateful_callbacks(new)
    if old_cbs != new_cbs:
        old_names, new_names = [n for n, _ in old_cbs], [n for n, _ in new_cbs]
        if old_names != new_names:
            changes.append(Change("trainer.callbacks", old_names, new_names))
        else:
            for i, ((name, a_args), (_, b_args)) in enumerate(zip(old_cbs, new_cbs, strict=True)):
                a_flat: dict[str, Any] = {}
                b_flat: dict[str, Any] = {}
                _flatten(a_args, "", a_flat)
                _flatten(b_args, "", b_flat)
                for k in sorted(set(a_flat) | set(b_flat)):
                    if a_flat.get(k, _ABSENT) != b_flat.get(k, _ABSENT):
                        changes.append(Change(f"trainer.callbacks[{i}]({name}).init_args.{k}",
                                              a_flat.get(k, _ABSENT), b_flat.get(k, _ABSENT)))
    return changes


def saved_config_path(ckpt_path: str | os.PathLike) -> Path | None:
    """The ``config.yaml`` of the run that wrote ``ckpt_path`` (beside it, or in the run directory above
    ``checkpoints/``), None when there is none."""
    folder = Path(ckpt_path).resolve().parent
    run = folder.parent if folder.name == "checkpoints" else folder
    path = run / "config.yaml"
    return path if path.is_file() else None


def saved_config(ckpt_path: str | os.PathLike) -> tuple[Path | None, dict[str, Any] | None]:
    """``(path, config)`` of the run that wrote ``ckpt_path`` (:func:`saved_config_path`); ``(None, None)`` when there
    is none.

    Raises:
        ConfigError: the file is there but not readable (a resume could not check what changed).
    """
    import yaml

    from lowrank_lit.launch.messages import ConfigError

    path = saved_config_path(ckpt_path)
    if path is None:
        return None, None
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--ckpt_path={str(ckpt_path)!r}: the config of the run that wrote it ({path}) is not readable "
                          f"({type(exc).__name__}); resuming cannot check what changed") from None
    return path, config if isinstance(config, dict) else {}


def _checkpoint_changes(ckpt_path: str, new: dict[str, Any]) -> list[Change]:
    """What a checkpoint without a ``config.yaml`` says about itself, against the new config: the model class of its
    hyperparameters and the callbacks whose state it holds."""
    import torch

    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - an unreadable one is refused by the checkpoint checks and by Lightning
        return []
    if not isinstance(ckpt, dict):
        return []
    changes = []
    theirs = (ckpt.get("hyper_parameters") or {}).get("_class_path")
    ours = (new.get("model") or {}).get("class_path")
    if isinstance(theirs, str) and isinstance(ours, str) and theirs != ours:
        changes.append(Change("model.class_path", theirs, ours))
    held = sorted({str(k).split("{", 1)[0] for k in (ckpt.get("callbacks") or {})})
    ours_cbs = {n for n, _ in _stateful_callbacks(new)}
    observer_names = {cls.__qualname__ for cls in _observer_classes()}
    missing = [n for n in held if n not in ours_cbs and n not in observer_names]
    if missing:
        changes.append(Change("trainer.callbacks", missing, sorted(ours_cbs)))
    return changes


def check_resume(ckpt_path: str, new: dict[str, Any], *, own_run: bool, mode: str = "refuse",
                 saved: tuple[Path | None, dict[str, Any] | None] | None = None) -> list[Change]:
    """Compare the config a resume runs with (``new``, resolved as ``config.yaml`` holds it) with the config of the
    run that wrote ``ckpt_path``.

    Args:
        ckpt_path: the checkpoint the resume loads.
        new: the resumed run's resolved config.
        own_run: the checkpoint belongs to the run directory being re-entered (``--ckpt_path last``, a requeue).
        mode: ``refuse`` raises on any change outside :data:`MAY_CHANGE`; ``apply`` returns them.
        saved: :func:`saved_config` of ``ckpt_path`` when the caller has read it already.

    Returns:
        The changes (empty when there are none; only ``apply`` returns a non-empty list).

    Raises:
        ConfigError: one line listing each differing key with the checkpoint's and the new value.
    """
    from lowrank_lit.launch.messages import ConfigError

    if mode not in RESUME_CHANGES:
        raise ConfigError(f"--resume_changes={mode!r}; allowed: {', '.join(RESUME_CHANGES)}")
    path, old = saved if saved is not None else saved_config(ckpt_path)
    changes = config_changes(old, new) if old is not None else _checkpoint_changes(ckpt_path, new)
    if not changes or mode == "apply":
        return changes
    shown = "; ".join(str(c) for c in changes[:6]) + (f"; and {len(changes) - 6} more" if len(changes) > 6 else "")
    whose = "this run was trained with" if own_run else f"the run that wrote it was trained with ({path or 'the checkpoint'})"
    raise ConfigError(
        f"--ckpt_path={ckpt_path!r}: the resumed config changes {len(changes)} key(s) {whose}, which the checkpoint "
        f"would silently restore or cannot load: {shown}; drop the change(s), or add --resume_changes=apply to apply "
        "them (recorded in config.yaml; the earlier config is kept as config.<n>.yaml); what may change: docs/cli.md"
    )


def may_change_markdown() -> str:
    """The table of docs/cli.md's "Resuming a run": what a resume may change, grouped by why."""
    groups: dict[str, list[str]] = {}
    for key, why in MAY_CHANGE.items():
        groups.setdefault(why, []).append(f"`{key}`")
    rows = ["| may change on a resume | keys |", "|---|---|"]
    rows += [f"| {why} | {', '.join(keys)} |" for why, keys in groups.items()]
    observers = ", ".join(f"`{p.rsplit('.', 1)[-1]}`" for p in OBSERVERS)
    rows.append(f"| callbacks that only observe | {observers} (added, removed or changed) |")
    return "\n".join(rows) + "\n"
