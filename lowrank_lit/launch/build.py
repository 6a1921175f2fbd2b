"""Build what a config describes, as ``lowrank fit`` / ``lowrank test`` would, without a trainer or a run directory.

:func:`build_from_config` parses a config file with the real ``lowrank <verb>`` parser (so every check and default
of the command applies), seeds as the command does (``seed_everything`` before anything is instantiated, so the
randomly initialised parts equal those of the run the config describes) and instantiates the model, the data
module and the configured callbacks. :func:`build_component` instantiates one ``class_path`` / ``init_args``
section. ``lowrank bench`` times the models it builds; ``lowrank export`` / ``lowrank load`` rebuild a run's base.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Built", "build_component", "parse_command", "build_from_config"]


@dataclass
class Built:
    """What a config builds: the model, the data module (None without a ``data`` section), the callbacks other
    than checkpointing, and the parsed config (a ``jsonargparse.Namespace``)."""

    model: Any
    data: Any
    callbacks: list[Any]
    config: Any


def build_component(key: str, base: type, value: Any) -> Any:
    """Instantiate one ``{class_path, init_args}`` section as a subclass of ``base`` (``key`` names it in errors)."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(base, key, fail_untyped=False, required=True)
    return parser.instantiate_classes(parser.parse_object({key: value}))[key]


def parse_command(args: Sequence[str], verb: str = "fit") -> Any:
    """The config of ``lowrank <verb> <args>`` as the real parser reads it (every check and default), not built."""
    from lowrank_lit.launch.lightning_cli import build_parser

    return build_parser(verb).parse_args(list(args))


def build_from_config(config: str | Path, overrides: Sequence[str] = (), verb: str = "fit", quiet: bool = False,
                      data: bool = True, callbacks: bool = True) -> Built:
    """The model (and data module, callbacks) of ``lowrank <verb> --config config overrides``.

    Args:
        config: a config file; a relative path is read from the checkout (``configs/...``) when it exists there.
        overrides: dotted command-line overrides (``--model.init_args.lr=0.1``).
        verb: the Lightning command whose parser checks the config (fit, validate, test, predict).
        quiet: hide the ``UserWarning`` s of construction (e.g. "no pretrained checkpoint": a cost benchmark wants
            random weights).
        data: build the data module. callbacks: build the configured callbacks (checkpointing left out).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lowrank_lit.registry import project_root

    path = Path(config)
    if not path.is_absolute() and not path.exists() and (project_root() / path).exists():
        path = project_root() / path
    cfg = parse_command(["--config", str(path), *overrides], verb)
    if cfg.get("seed_everything") is not None:
        pl.seed_everything(int(cfg.seed_everything), verbose=False)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", UserWarning)
        model = build_component("model", pl.LightningModule, cfg.model)
        dm = build_component("data", pl.LightningDataModule, cfg.data) if data and cfg.get("data") else None
        cbs = [build_component("callback", pl.Callback, c) for c in (cfg.trainer.get("callbacks") or [])] \
            if callbacks else []
    return Built(model, dm, [c for c in cbs if not isinstance(c, ModelCheckpoint)], cfg)
