"""Loggers: Lightning's, with the settings lowrank runs need."""

from __future__ import annotations

import os
import sys
from typing import Any

from lightning.pytorch.loggers import CSVLogger as _LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as _LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from lowrank_lit.report import keep_previous

__all__ = ["CSVLogger", "WandbLogger"]


#: seconds an online W&B run waits for the server before it goes on offline (``LOWRANK_WANDB_INIT_TIMEOUT`` overrides)
WANDB_INIT_TIMEOUT = 30.0


def wandb_init_timeout() -> float:
    """The bounded wait of an online W&B start: ``LOWRANK_WANDB_INIT_TIMEOUT`` seconds (a number > 0), default
    :data:`WANDB_INIT_TIMEOUT`."""
    text = os.environ.get("LOWRANK_WANDB_INIT_TIMEOUT", "")
    try:
        value = float(text) if text else WANDB_INIT_TIMEOUT
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError(f"LOWRANK_WANDB_INIT_TIMEOUT={text!r}; allowed: a number of seconds > 0")
    return value


class WandbLogger(_LightningWandbLogger):
    """Lightning's :class:`~lightning.pytorch.loggers.WandbLogger` that never stops a run for want of a network.

    * An online start waits at most :func:`wandb_init_timeout` seconds for the W&B server (W&B's ``init_timeout``
      setting, unless you pass ``settings``). When the server cannot be reached (a SLURM compute node without a route
      out, a proxy, an outage), the run goes on offline: one line on stderr says so and gives the ``wandb sync``
      command that uploads it later. The W&B run keeps its id, so the synced run is the same run.
    * Lightning always passes ``anonymous=None`` to ``wandb.init``, and W&B (0.19 and newer) answers every
      run with "The anonymous setting has no effect and will be removed". This class passes it only when
      you set it.

    Every argument is Lightning's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)

    @property
    def experiment(self) -> Any:
        if self._experiment is not None or self._offline or getattr(rank_zero_only, "rank", 0) != 0:
            return super().experiment
        import wandb

        timeout = wandb_init_timeout()
        unreachable = server_unreachable(timeout)  # W&B's own waits (login, resume status) are not all bounded
        if unreachable is not None:
            return self._go_offline(unreachable, timeout)
        if "settings" not in self._wandb_init:
            self._wandb_init["settings"] = wandb.Settings(init_timeout=timeout)
        try:
            return super().experiment
        except (wandb.errors.CommError, wandb.errors.UsageError, TimeoutError, ConnectionError) as exc:
            wandb.teardown()  # the failed start still holds the run id
            self._experiment = None
            self._wandb_init.pop("settings", None)
            return self._go_offline(next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__),
                                    timeout)

    def _go_offline(self, why: str, timeout: float) -> Any:
        self._offline = True
        self._wandb_init["mode"] = "offline"
        folder = os.path.join(self._save_dir or ".", "wandb")
        print(f"W&B: no online run at {_server()} (waited at most {timeout:g} s: {why[:160]}); this run logs offline to "
              f"{folder}; upload it later with: wandb sync {folder}/offline-run-*", file=sys.stderr, flush=True)
        return super().experiment


def _server() -> str:
    return os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"


def server_unreachable(timeout: float) -> str | None:
    """Why the W&B server (``WANDB_BASE_URL``, or the HTTPS proxy when one is set) cannot be reached: a TCP connection
    is tried for at most ``timeout`` seconds. None when it answers."""
    import socket
    from urllib.parse import urlparse

    target = urlparse(_server())
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy") if target.scheme == "https" else \
        os.environ.get("HTTP_PROXY") or os.environ.get("http_proxy")
    where = urlparse(proxy) if proxy else target
    host = where.hostname or "api.wandb.ai"
    port = where.port or (443 if where.scheme == "https" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except OSError as exc:  # DNS, unreachable network, refused, timed out
        return f"{'the proxy ' if proxy else ''}{host}:{port}: {exc.strerror or type(exc).__name__}"


class _KeepingWriter(ExperimentWriter):
    """Lightning's CSV experiment writer, except that an earlier ``metrics.csv`` in the folder is neither deleted nor
    overwritten: the first save of this run moves it to ``metrics.<n>.csv`` (and writes ``hparams.yaml`` then too), so
    a run refused before its first logged step leaves the folder as it was."""

    def __init__(self, log_dir: str) -> None:
        self._kept = False
        self._hparams_saved = True  # nothing to write until log_hparams
        super().__init__(log_dir=log_dir)

    def _check_log_dir_exists(self) -> None:  # Lightning's deletes metrics.csv here, before anything is logged
        pass

    def log_hparams(self, params: dict[str, Any]) -> None:
        self.hparams.update(params)
        self._hparams_saved = False

    def save(self) -> None:
        if not self._kept and (self.metrics or self.hparams):
            keep_previous(self.log_dir, self.NAME_METRICS_FILE)
            self._kept = True
        if not self._hparams_saved:  # once per change, not at every flush of the metrics
            from lightning.pytorch.core.saving import save_hparams_to_yaml

            save_hparams_to_yaml(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), self.hparams)
            self._hparams_saved = True
        super().save()


class CSVLogger(_LightningCSVLogger):
    """Lightning's :class:`~lightning.pytorch.loggers.CSVLogger`, which every ``lowrank`` run writes ``metrics.csv``
    with: an earlier attempt's ``metrics.csv`` in a re-entered run directory is kept as ``metrics.<n>.csv`` when this
    attempt first saves (not deleted when the logger starts), so a resume refused while it loads its checkpoint
    changes nothing. Every argument is Lightning's."""

    @property
    def experiment(self) -> Any:
        if self._experiment is None and getattr(rank_zero_only, "rank", 0) == 0:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _KeepingWriter(log_dir=self.log_dir)
        return super().experiment
