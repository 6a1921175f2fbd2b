"""``lowrank estimate``: what a config needs per GPU at full size, computed on the ``meta`` device.

The config's model is built at full size on the meta device (no memory; hub models from their folder's
``config.json``, no weights read: :func:`lowrank_lit.hub.architecture_only`). Then, per GPU:

* weights: every parameter and buffer at its dtype (``bf16-true``/``16-true`` precision: 2 bytes);
* gradients: the parameters the module's optimizer holds;
* optimizer state: the module's own optimizer says its size (``steady_state_bytes()``, e.g. LowRankAdam's projected
  moments) or takes one step on meta gradients and its state tensors are summed (NanoAdam's sparse moments count
  as they are);
* DDP gradient buckets: one more gradient-sized buffer under a DDP strategy;
* activations: the tensors autograd saves for backward in one ``training_step`` on the first training batch
  of the config's data (its per-device batch size), run on the meta device. Autocast does not reach the meta
  device, so under ``*-mixed`` precision they are counted at fp32: an upper bound (bf16 keeps most at half). Attention
  is counted as the math path keeps it (scores and probabilities); fused kernels (flash / memory-efficient SDPA on a
  GPU) keep less, so this line is an upper bound there too.
  Without the data (paths that do not exist) they are left out and the line says so.

Sharded (``trainer.strategy: ShardedStrategy``, configs/base/trainer_fsdp.yaml) over ``devices x num_nodes``
processes: parameters, gradients and optimizer state are divided by the world size (buffers are not sharded), the
activations are one process's. With ``activation_checkpointing`` each shard unit keeps its input only, and one unit
at a time holds its internal activations again in backward: activations = (outside the units) + (the units' inputs)
+ (the largest unit's internals). Other models are given the same two lines: "FSDP over N GPUs" for 2 and 8.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from jsonargparse.typing import PositiveFloat

from lowrank_lit.argtypes import PassThrough

__all__ = ["MemoryEstimate", "SavedTensors", "estimate", "main", "format_bytes", "optimizer_state_bytes"]

GiB = 1024**3


@dataclass
class MemoryEstimate:
    """Bytes per GPU of one config (see the module docstring for each line)."""

    parameters: int
    trainable: int
    weights: int
    gradients: int
    optimizer: int
    ddp_buckets: int
    activations: int | None
    devices: int
    strategy: str
    precision: str
    batch_size: int | None = None  # per device, as the data module is configured
    accumulate: int = 1  # accumulate_grad_batches
    notes: list[str] = field(default_factory=list)
    buffers: int = 0  # of ``weights``: not sharded
    sharded: bool = False  # a ShardedStrategy run over ``devices`` processes
    checkpointed_activations: int | None = None  # the activations with activation checkpointing of the shard units
    activation_checkpointing: bool = False  # the sharded strategy checkpoints its units' activations

    @property
    def total(self) -> int:
        if self.sharded:
            return self.sharded_total(self.devices, self.activation_checkpointing)
        return self.weights + self.gradients + self.optimizer + self.ddp_buckets + (self.activations or 0)

    def sharded_state(self, world: int) -> int:
        """Bytes of parameters, gradients and optimizer state per process under FSDP across ``world`` processes."""
        return (self.weights - self.buffers + self.gradients + self.optimizer) // world + self.buffers

    def sharded_total(self, world: int, checkpointing: bool = False) -> int:
        """The same under FSDP across ``world`` GPUs: weights, gradients and optimizer state sharded."""
        act = self.checkpointed_activations if checkpointing and self.checkpointed_activations is not None \
            else self.activations
        return self.sharded_state(world) + (act or 0)

    def report(self, gpu_gib: float = 80.0) -> str:
        rows = [("parameters", f"{self.parameters:,}"), ("trainable", f"{self.trainable:,}"),
                ("weights", format_bytes(self.weights)), ("gradients", format_bytes(self.gradients)),
                ("optimizer state", format_bytes(self.optimizer))]
        if self.ddp_buckets:
            rows.append(("DDP gradient buckets", format_bytes(self.ddp_buckets)))
        if self.sharded:
            rows.append((f"sharded over {self.devices}", format_bytes(self.sharded_state(self.devices))
                         + " (weights, gradients, optimizer state per process)"))
        rows.append(("activations", "not measured" if self.activations is None else format_bytes(self.activations)))
        if self.checkpointed_activations is not None:
            rows.append(("with activation checkpointing", format_bytes(self.checkpointed_activations)))
        rows.append(("total per GPU", format_bytes(self.total)))
        width = max(len(k) for k, _ in rows)
        lines = [f"{k.ljust(width)}  {v}" for k, v in rows]
        fits = self.total <= gpu_gib * GiB
        lines.append(f"{self.strategy}, {self.devices} device(s), {self.precision}: "
                     + (f"fits in {gpu_gib:g} GiB" if fits else f"does NOT fit in {gpu_gib:g} GiB")
                     + (" (without the activations)" if self.activations is None else ""))
        if not fits and not self.sharded:
            for world in sorted({max(self.devices, 2), 8}):
                lines.append(f"  FSDP over {world} GPUs (configs/base/trainer_fsdp.yaml): "
                             f"{format_bytes(self.sharded_total(world))} per GPU"
                             + (f", {format_bytes(self.sharded_total(world, True))} with activation checkpointing"
                                if self.checkpointed_activations is not None else ""))
        return "\n".join(lines + [f"note: {n}" for n in self.notes])


class SavedTensors:
    """A ``saved_tensors_hooks`` pack hook that counts the bytes autograd keeps for backward (each tensor once,
    parameters excluded: they are the weights). It holds the tensors it saw, so no id is reused while counting."""

    def __init__(self) -> None:
        self._seen: dict[int, torch.Tensor] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter):
            self._seen[id(t)] = t
        return t

    @property
    def bytes(self) -> int:
        return _nbytes(self._seen.values())


def format_bytes(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB."""
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 1024**2:.1f} MiB"


def _nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))


def optimizer_state_bytes(optimizer: torch.optim.Optimizer, params: set[int] | None = None) -> int:
    """Bytes of the tensors in ``optimizer.state`` (of the parameters whose ``id`` is in ``params``, or all)."""
    return _nbytes(v for p, st in optimizer.state.items() if params is None or id(p) in params for v in st.values())


def _instantiate(cfg: Any) -> tuple[pl.LightningModule, pl.LightningDataModule | None]:
    """The config's model (meta device, architecture only) and data module (on the CPU, not set up)."""
    from lowrank_lit.hub import architecture_only
    from lowrank_lit.launch.build import build_component

    with torch.device("meta"), architecture_only():
        model = build_component("model", pl.LightningModule, cfg.model)
    data = build_component("data", pl.LightningDataModule, cfg.data) if cfg.get("data") else None
    return model, data


def _optimizers(model: pl.LightningModule, trainer_cfg: Any) -> list[torch.optim.Optimizer]:
    """The module's own optimizers; a schedule that asks for the run's length gets ``max_steps`` (else 1000)."""
    from types import SimpleNamespace

    from lightning.pytorch.core.optimizer import _configure_optimizers

    steps = trainer_cfg.get("max_steps") or -1
    model._trainer = SimpleNamespace(estimated_stepping_batches=steps if steps > 0 else 1000, max_steps=steps,
                                     world_size=1, global_rank=0, is_global_zero=True)  # type: ignore[assignment]
    try:
        optimizers, _, _ = _configure_optimizers(model.configure_optimizers())  # Lightning's reading of the return
    finally:
        model._trainer = None
    return optimizers


def _optimizer_state(optimizers: list[torch.optim.Optimizer], notes: list[str]) -> tuple[int, list[torch.nn.Parameter]]:
    """(optimizer-state bytes, the parameters the optimizers hold).

    An optimizer that says its size (``steady_state_bytes()``) is asked; any other takes one step on meta gradients and
    its state is summed; one whose step reads values (not possible on the meta device) is counted as Adam-like.
    """
    params = list({id(p): p for o in optimizers for g in o.param_groups for p in g["params"]}.values())
    total = 0
    for o in optimizers:
        if hasattr(o, "steady_state_bytes"):
            total += o.steady_state_bytes()
            continue
        held = [p for g in o.param_groups for p in g["params"]]
        for p in held:
            p.grad = torch.zeros_like(p)
        try:
            with torch.no_grad():
                o.step()
            total += optimizer_state_bytes(o)
        except (RuntimeError, NotImplementedError):
            total += sum(2 * p.numel() * p.element_size() for p in held)
            notes.append(f"{type(o).__name__}'s step cannot run on the meta device: its state is counted as Adam's (two moments)")
    return total, params


class _UnitTensors(SavedTensors):
    """:class:`SavedTensors` that also attributes what is saved inside each shard unit, and counts each unit's input
    (what activation checkpointing keeps of it)."""

    def __init__(self, units: list[torch.nn.Module]) -> None:
        super().__init__()
        self.inside: dict[int, dict[int, torch.Tensor]] = {}
        self.inputs: dict[int, torch.Tensor] = {}
        self._current: int | None = None
        self._hooks = []
        for unit in units:
            self._hooks.append(unit.register_forward_pre_hook(self._enter))
            self._hooks.append(unit.register_forward_hook(self._leave))

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self._current = id(module)
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is not None:
            self.inputs[id(first)] = first

    def _leave(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        self._current = None

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if self._current is not None and not isinstance(t, torch.nn.Parameter):
            self.inside.setdefault(self._current, {})[id(t)] = t
        return super().pack(t)

    def checkpointed(self) -> int:
        inside = [_nbytes(d.values()) for d in self.inside.values()]
        return self.bytes - sum(inside) + _nbytes(self.inputs.values()) + max(inside, default=0)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


def _activations(model: pl.LightningModule, data: pl.LightningDataModule | None,
                 seen: SavedTensors | None = None) -> tuple[int | None, str | None]:
    """Bytes autograd saves in one training step on the first training batch (meta device)."""
    if data is None:
        return None, "no data module: activations not measured"
    from lightning.fabric.utilities.apply_func import move_data_to_device

    try:
        data.setup("fit")
        batch = next(iter(data.train_dataloader()))
    except (FileNotFoundError, OSError, ValueError) as exc:
        return None, f"activations not measured: the data could not be read ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    batch = move_data_to_device(batch, torch.device("meta"))
    seen = seen if seen is not None else SavedTensors()
    model.train()
    try:
        with torch.device("meta"), torch.autograd.graph.saved_tensors_hooks(seen.pack, lambda t: t), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # self.log without a trainer
            model.training_step(batch, 0)
    except Exception as exc:  # a value read (.item()) in the step, or no training step (an evaluation config)
        return None, f"activations not measured: the training step cannot run on the meta device ({str(exc).splitlines()[0]})"
    return seen.bytes, None


def estimate(args: Sequence[str]) -> MemoryEstimate:
    """Per-GPU memory of ``lowrank fit <args>`` (a ``--config`` and any overrides) at full size."""
    from lowrank_lit.launch.build import parse_command

    cfg = parse_command(args)
    model, data = _instantiate(cfg)
    trainer = cfg.trainer
    precision = str(trainer.get("precision") or "32-true")
    strategy_cfg = trainer.get("strategy") or "auto"
    path = strategy_cfg.get("class_path") if hasattr(strategy_cfg, "get") else strategy_cfg
    sharded = isinstance(path, str) and path.rsplit(".", 1)[-1] == "ShardedStrategy"
    init_args = strategy_cfg.get("init_args") if sharded and hasattr(strategy_cfg, "get") else None
    checkpointing = bool(init_args.get("activation_checkpointing")) if init_args is not None else False
    strategy = "ShardedStrategy (FSDP2)" if sharded else str(strategy_cfg)
    devices = trainer.get("devices")
    devices = int(devices) if str(devices).isdigit() and int(devices) > 0 else 1
    devices *= int(trainer.get("num_nodes") or 1) if sharded else 1
    notes: list[str] = []
    params = list(model.parameters())
    half = precision.startswith(("bf16-true", "16-true"))
    weights = sum(p.numel() * (2 if half and p.is_floating_point() else p.element_size()) for p in params)
    weights += _nbytes(model.buffers())
    state, trained = _optimizer_state(_optimizers(model, trainer), notes)
    grads = sum(p.numel() * (2 if half else p.element_size()) for p in trained)
    if precision.endswith("-mixed"):  # no autocast on the meta device: one dtype throughout (fp32, the upper bound)
        model.float()
    from lowrank_lit.sharding import shard_units

    seen = _UnitTensors(shard_units(model))
    try:
        activations, why = _activations(model, data, seen)
    finally:
        seen.remove()
    checkpointed = seen.checkpointed() if activations is not None and seen.inside else None
    if why:
        notes.append(why)
    elif precision.endswith("-mixed"):
        notes.append(f"autocast does not reach the meta device: under {precision} the activations are counted at fp32 "
                     "(an upper bound; bf16 keeps most of them at half)")
    ddp = grads if strategy.startswith("ddp") else 0
    batch = cfg.data.get("init_args", {}).get("batch_size") if cfg.get("data") else None
    return MemoryEstimate(sum(p.numel() for p in params), sum(p.numel() for p in trained), weights, grads, state, ddp,
                          activations, devices, strategy, precision, batch, int(trainer.get("accumulate_grad_batches") or 1),
                          notes, buffers=_nbytes(model.buffers()), sharded=sharded,
                          checkpointed_activations=checkpointed, activation_checkpointing=checkpointing)


def main(*, gpu_memory: PositiveFloat = 80.0, flags: PassThrough = []) -> int:  # noqa: B006
    """Memory per GPU of a config at full size, computed on the meta device (weights, gradients, optimizer state,
    DDP buckets, activations): ``lowrank estimate --config C.yaml [--config more.yaml] [--key=value ...]``.

    Args:
        gpu_memory: the GPU's memory in GiB, for the verdict line (default 80)
        flags: ``--config`` files and ``--key=value`` overrides, as for ``lowrank fit``
    """
    from lowrank_lit.launch.config_yaml import config_file_error, config_files

    argv = list(flags)

    files = config_files(argv)
    bad = config_file_error(files) if files else \
        "--config: give a config file, e.g. lowrank estimate --config configs/lope/llama_gpu.yaml"
    if bad:
        print(f"lowrank estimate: error: {bad}", file=sys.stderr)
        return 2
    _offline()
    try:
        result = estimate(argv)
    except ValueError as exc:  # jsonargparse wraps what the classes raise while being built on the meta device
        print(f"lowrank estimate: error: the config cannot be built on the meta device: {_root_message(exc)}", file=sys.stderr)
        return 2
    print(result.report(gpu_memory))
    return 0


def _offline() -> None:
    """Estimating reads local files only: the hub is switched off before anything looks a model up (huggingface_hub
    reads ``HF_HUB_OFFLINE`` once, when imported, so the imported constant is set too); a hub name that is not in
    the local cache then fails at once, not after half a minute of retries."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True


def _root_message(exc: BaseException) -> str:
    """The innermost useful line of an instantiation error (jsonargparse lists the union's errors)."""
    text = str(exc)
    if "couldn't connect to" in text or "offline mode" in text.lower() or "is not a local folder" in text:
        names = sorted(set(re.findall(r"'([\w.\-]+/[\w.\-]+)'", text)))
        named = f" {names[0]!r}" if names else ""
        return (f"the model or tokenizer{named} is neither a local folder nor in the local Hugging Face cache "
                "(lowrank estimate reads local files only): give the local folder that holds its config.json, as the "
                "config's header shows (e.g. --model.init_args.backbone=/models/...)")
    for line in text.splitlines():
        if line.strip().startswith("- ") and "Expected a <class 'NoneType'>" not in line:
            return line.strip()[2:]
    return text.splitlines()[0] if text else type(exc).__name__
