"""Loggers: Lightning's, with the settings lowrank runs need."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger

__all__ = ["WandbLogger"]


class WandbLogger(_LightningWandbLogger):
    """Lightning's :class:`~lightning.pytorch.loggers.WandbLogger`, minus the ``anonymous`` setting.

    Lightning always passes ``anonymous=None`` to ``wandb.init``, and W&B (0.19 and newer) answers every
    run with "The anonymous setting has no effect and will be removed". This class passes it only when
    you set it. Every argument is Lightning's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
