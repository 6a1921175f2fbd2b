"""Sharded training (FSDP2): the shard units of each model family, the strategy a config selects, one rule for all.

A run selects sharding with ``configs/base/trainer_fsdp.yaml`` (``trainer.strategy:``
:class:`ShardedStrategy`, Lightning's ``ModelParallelStrategy`` with a data-parallel mesh over every process). The
model is sharded by one rule, the same for every method (:func:`shard_module`):

* **shard units** are the blocks a model family declares once: a class registered with :func:`shard_unit`
  (``TinyVMamba``'s VSS blocks, timm's ViT ``Block``, the text encoder's layers) or named in a Hugging Face model's
  own ``_no_split_modules`` (``LlamaDecoderLayer``, ``BertLayer``, ...). Each unit is one ``fully_shard`` group:
  its parameters are gathered just before it runs and freed after.
* **everything else** (adapters and prompts outside a unit, heads, embeddings, a method's own parameters) belongs to
  the root group: the LightningModule itself, sharded last, whose ``training_step`` / ``validation_step`` /
  ``test_step`` / ``predict_step`` gather the root group (``register_fsdp_forward_method``). An adapter inside a
  unit is sharded with its unit; frozen and trainable parameters may share a group. A module with manual
  optimization (several forward/backward passes per step, e.g. Skrull's micro-batches) also shards each direct child
  that holds parameters, so each child's forward gathers them.

A LightningModule takes part by inheriting :class:`Shardable` (its ``configure_model`` applies the rule when the
strategy gives it a device mesh, and does nothing otherwise); one whose math needs something sharding cannot give
sets ``sharding_refusal``, and a sharded run of it stops before it starts with that reason in one line
(:func:`sharding_refusal`).

Optimizers whose update reads a whole matrix (LowRankAdam's projection, NanoAdam's smallest-weight selection, Q3R's
reweighting) stay exact under sharding: see :class:`lowrank_lit.optim.SeededOptimizer` and
:func:`whole_matrix_update`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

__all__ = [
    "ShardedStrategy", "Shardable", "shard_unit", "shard_units", "shard_module", "sharding_refusal", "is_sharded",
    "dtensor_api",
    "full_tensor", "owners", "from_owner", "whole_matrix_update", "local_bytes", "unsharded_copy",
]

_UNITS: set[str] = set()  # dotted class names
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")
_DROP = object()
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def shard_unit(cls: type | str) -> type | str:
    """Declare a class a shard unit of its model family: a class decorator, or called once beside the family with
    the class or its dotted name (``"timm.models.vision_transformer.Block"``: no import needed)."""
    _UNITS.add(cls if isinstance(cls, str) else _dotted(cls))
    return cls


def _dotted(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _hf_unit_names(module: nn.Module) -> set[str]:
    names: set[str] = set()
    for m in module.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    return names


def shard_units(module: nn.Module) -> list[nn.Module]:
    """The shard units inside ``module``, innermost first (the order ``fully_shard`` needs)."""
    hf = _hf_unit_names(module)
    named = [m for m in module.modules() if m is not module and type(m).__name__ in hf]
    counts: dict[type, int] = {}
    for m in named:
        counts[type(m)] = counts.get(type(m), 0) + 1
    # a Hugging Face name counts for the repeated blocks only: a singleton (BertEmbeddings) is reached through its
    # submodules by prompt and adapter code (``get_input_embeddings()(ids)``), so it stays in the root group
    repeated = {id(m) for m in named if counts[type(m)] > 1}
    units = [m for m in module.modules() if m is not module and (_dotted(type(m)) in _UNITS or id(m) in repeated)]
    return units[::-1]


def _wrap_checkpointing(module: nn.Module, units: list[nn.Module]) -> list[nn.Module]:
    """Activation checkpointing of each unit: its activations are recomputed in backward instead of kept."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    chosen = {id(u) for u in units}
    apply_activation_checkpointing(module, check_fn=lambda m: id(m) in chosen)
    wrapped = [m for m in module.modules() if type(m).__name__ == "CheckpointWrapper"]
    return wrapped[::-1]


def _check_mixed_precision(value: str, where: str) -> None:
    if value not in ("none", *_DTYPES):
        raise ValueError(f"{where}: mixed_precision={value!r}; allowed: none, bf16, fp16")


def shard_module(module: nn.Module, mesh: Any, mixed_precision: str = "none", activation_checkpointing: bool = False,
                 reshard_after_forward: bool = True) -> int:
    """Shard ``module`` (a LightningModule or any module) over ``mesh`` by the rule above; returns the number of units.

    Args:
        module: the root; sharded last, its step methods gather the root group.
        mesh: a 1-D device mesh (the data-parallel dimension).
        mixed_precision: ``none`` (fp32), ``bf16`` or ``fp16``: the dtype parameters are gathered and computed in;
            gradients are reduced in fp32 and the sharded parameters and optimizer state stay fp32.
        activation_checkpointing: recompute each unit's activations in backward.
        reshard_after_forward: free a unit's gathered parameters after its forward (gathered again in backward).
    """
    from torch.distributed.fsdp import (
        FSDPModule,
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    _check_mixed_precision(mixed_precision, "shard_module")
    if isinstance(module, FSDPModule):
        return 0  # already sharded (a second stage of the same trainer: validate or test after fit)
    units = shard_units(module)
    if activation_checkpointing and units:
        units = _wrap_checkpointing(module, units)
    policy = MixedPrecisionPolicy() if mixed_precision == "none" else MixedPrecisionPolicy(
        param_dtype=_DTYPES[mixed_precision], reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if getattr(module, "automatic_optimization", True) is False:
        # manual optimization may run several forward/backward passes in one step (micro-batches): each direct child
        # with parameters gathers them at each of its forwards, which the root group does once per step only
        done = {id(u) for u in units}
        for child in module.children():
            if id(child) not in done and any(True for _ in child.parameters()):
                fully_shard(child, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    for name in STEP_METHODS:
        if callable(getattr(module, name, None)):
            register_fsdp_forward_method(module, name)
    return len(units)


class ShardedStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as fully sharded data parallelism over every process (FSDP2).

    Each process holds 1/world of every parameter, gradient and optimizer state; the model is sharded by
    :func:`shard_module`. On the CPU it runs with gloo (the rehearsal); on GPUs with NCCL, the same code.

    Args:
        mixed_precision: ``none``, ``bf16`` or ``fp16``: the dtype the gathered parameters compute in
            (``MixedPrecisionPolicy``; gradients reduce in fp32, the shards and the optimizer state stay fp32).
            Keep ``trainer.precision`` at ``32-true`` with it. Default: none.
        activation_checkpointing: recompute each shard unit's activations in backward (memory for compute).
            Default: False.
        reshard_after_forward: free each unit's gathered parameters after its forward. Default: True.
        save_distributed_checkpoint: ``False`` (default): checkpoints are one consolidated file written by rank 0,
            the same file a one-process run writes, read by ``lowrank test/export/load`` on one process. ``True``:
            a folder of per-rank shards (torch distributed checkpoint), for models whose full state does not fit
            rank 0's CPU memory.
        process_group_backend: ``gloo`` or ``nccl``; default: the device's.
        timeout: collective timeout. Default: Lightning's (30 min).
    """

    def __init__(
        self,
        mixed_precision: Literal["none", "bf16", "fp16"] = "none",
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        _check_mixed_precision(mixed_precision, "ShardedStrategy")
        kwargs = {} if timeout is None else {"timeout": timeout}
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, **kwargs)
        self.mixed_precision = mixed_precision
        self.activation_checkpointing = activation_checkpointing
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        if self._layer_sync is not None:  # Lightning's ModelParallelStrategy would leave it out without a word
            raise ValueError("ShardedStrategy: trainer.sync_batchnorm=true is not applied to sharded runs; allowed: false "
                             "(BatchNorm then uses each process's batch statistics, as DDP without it does)")
        import torch.distributed.fsdp as fsdp

        if not hasattr(fsdp, "fully_shard"):  # FSDP2's public API: torch 2.6 on; the rest of the package runs on 2.4
            raise RuntimeError(f"ShardedStrategy: needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); this is "
                               f"torch {torch.__version__}: upgrade torch, or train with DDP")
        self._data_parallel_size = self.num_nodes * self.num_processes  # every process in one data-parallel mesh
        super().setup_environment()

    def setup(self, trainer: Any) -> None:
        reason = sharding_refusal(type(self.lightning_module))
        if reason:
            raise ValueError(reason)
        super().setup(trainer)
        if self._save_distributed_checkpoint and any(self._whole_state(o) for o in self.optimizers):
            raise ValueError("ShardedStrategy: save_distributed_checkpoint=true with LowRankAdam or NanoAdam; allowed: "
                             "false (their state is per whole matrix, saved in one consolidated checkpoint)")

    @staticmethod
    def _whole_state(optimizer: Any) -> bool:
        """Optimizers that write their own whole state under sharding (``saves_whole_state``: the framework's
        ``SeededOptimizer``s, whose state is per whole matrix, not per shard, which torch's sharded state-dict helpers
        cannot read)."""
        return bool(getattr(getattr(optimizer, "_optimizer", optimizer), "saves_whole_state", False))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._whole_state(optimizer):
            return getattr(optimizer, "_optimizer", optimizer).state_dict()  # the one-process format, every rank
        return super().optimizer_state(optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from pathlib import Path

        own = [self._whole_state(o) for o in self.optimizers]
        if not any(own):
            return super().load_checkpoint(checkpoint_path, weights_only)
        if not all(own):
            raise ValueError("ShardedStrategy: a LowRankAdam or NanoAdam beside another optimizer in one module does "
                             "not resume sharded; allowed: one kind of optimizer per module")
        if not Path(checkpoint_path).is_file():
            raise ValueError(f"ShardedStrategy: {checkpoint_path} is a folder of shards; LowRankAdam and NanoAdam "
                             "resume from a consolidated checkpoint (save_distributed_checkpoint: false)")
        optimizers = self.optimizers
        self.optimizers = []  # the model through Lightning; these optimizers read their whole state themselves
        try:
            checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        finally:
            self.optimizers = optimizers
        for optimizer, state in zip(optimizers, checkpoint.get("optimizer_states", []), strict=False):
            optimizer.load_state_dict(state)
        return checkpoint


def sharding_refusal(cls: type) -> str | None:
    """The one-line reason a LightningModule class does not run sharded, or None when it does."""
    reason = getattr(cls, "sharding_refusal", None)
    if not reason and getattr(cls, "ddp_find_unused_parameters", False):
        reason = "some parameters get no gradient on some ranks (FSDP2 reduces the same ones on every rank); use ddp"
    if reason:
        return f"{cls.__name__} does not run sharded (trainer.strategy: ShardedStrategy): {reason}"
    if not issubclass(cls, Shardable):
        return (f"{cls.__name__} does not run sharded (trainer.strategy: ShardedStrategy): it declares no shard rule "
                "(inherit lowrank_lit.sharding.Shardable); allowed strategies: auto, ddp")
    return None


class Shardable:
    """Mixin of a LightningModule that runs sharded: ``configure_model`` shards it by :func:`shard_module` when the
    strategy gives it a device mesh (a :class:`ShardedStrategy` run) and does nothing otherwise."""

    sharding_refusal: ClassVar[str | None] = None

    def configure_model(self) -> None:
        mesh = getattr(self, "device_mesh", None)
        if mesh is None:
            return
        strategy = self.trainer.strategy  # type: ignore[attr-defined]
        shard_module(self, mesh["data_parallel"],  # type: ignore[arg-type]
                     mixed_precision=getattr(strategy, "mixed_precision", "none"),
                     activation_checkpointing=getattr(strategy, "activation_checkpointing", False),
                     reshard_after_forward=getattr(strategy, "reshard_after_forward", True))


# ----------------------------------------------------------------------------------------------------------------
# whole-matrix math on sharded parameters


@functools.cache
def dtensor_api() -> tuple[Any, Any]:
    """``(DTensor, distribute_tensor)``: public in ``torch.distributed.tensor`` from torch 2.5, under
    ``torch.distributed._tensor`` in torch 2.4 (the lowest torch this package supports). Looked up once:
    :func:`is_sharded` asks it for every parameter at every optimizer step."""
    try:
        from torch.distributed.tensor import DTensor, distribute_tensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor, distribute_tensor
    return DTensor, distribute_tensor


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a DTensor (a sharded parameter or gradient)."""
    return isinstance(t, dtensor_api()[0])


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor (gathered from every rank) of a DTensor; a plain tensor as it is."""
    return t.full_tensor() if is_sharded(t) else t  # type: ignore[attr-defined]


def unsharded_copy(module: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A plain (unsharded) deep copy of a sharded ``module``, with whole parameters, on every rank.

    For what evaluates a changed copy of the trained model under sharding (truncated, quantized): each parameter is
    gathered (every rank, the same order), the FSDP classes and hooks are left out of the copy. ``memo`` as for
    ``copy.deepcopy`` (the caller leaves out the trainer).
    """
    import copy
    import functools
    from collections import OrderedDict

    from torch.distributed.fsdp import FSDPModule

    memo = dict(memo or {})
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(full_tensor(p.detach()).clone(), requires_grad=p.requires_grad)
    swapped: list[tuple[nn.Module, type]] = []
    for m in module.modules():
        if m.__dict__.get("_device_mesh") is not None:
            memo[id(m.__dict__["_device_mesh"])] = None  # the mesh holds process groups; the copy runs unsharded
        for value in m.__dict__.values():
            if isinstance(value, functools.partial):
                memo[id(value)] = value  # factories (optimizer, scheduler) are shared: they may hold the run's state
        if isinstance(m, FSDPModule):
            swapped.append((m, type(m)))
            for name in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                         "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
                memo[id(getattr(m, name))] = OrderedDict()
            for key, value in m.__dict__.items():
                if key.startswith("__composable_api_state_key"):
                    memo[id(value)] = OrderedDict()  # the FSDP state
                elif key in STEP_METHODS:
                    memo[id(value)] = _DROP  # the gathering wrapper of a step method
    try:
        for m, cls in swapped:
            m.__class__ = cls.__mro__[2]  # the class before fully_shard (FSDP<Class> puts FSDPModule, then Class)
        out = copy.deepcopy(module, memo)
    finally:
        for m, cls in swapped:
            m.__class__ = cls
    for m in out.modules():
        for key in [k for k, v in m.__dict__.items() if v is _DROP or k.startswith("__composable_api_state_key")]:
            del m.__dict__[key]
        m.__dict__.pop("_is_fsdp_managed_module", None)
        m.__dict__.pop("_fsdp_use_orig_params", None)
    return out


def local_bytes(tensors: Iterator[Any] | list[Any]) -> int:
    """Bytes this process holds of ``tensors`` (a DTensor counts its local shard)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]
            total += local.numel() * local.element_size()
    return total


def owners(params: list[torch.Tensor], world: int) -> dict[int, int]:
    """A rank for each parameter (by ``id``), balancing the elements each rank owns: the largest first, each to the
    rank that owns the fewest so far (ties to the lowest rank). The same on every rank (shapes only)."""
    load = [0] * world
    out: dict[int, int] = {}
    order = sorted(range(len(params)), key=lambda i: (-params[i].numel(), i))
    for i in order:
        rank = min(range(world), key=lambda r: (load[r], r))
        out[id(params[i])] = rank
        load[rank] += params[i].numel()
    return out


def from_owner(value: Any, owner: int) -> Any:
    """``value`` as the rank ``owner`` holds it, on every rank (a broadcast of one picklable object; every rank calls
    it)."""
    import torch.distributed as dist

    shared = [value]
    dist.broadcast_object_list(shared, src=owner)
    return shared[0]


def whole_matrix_update(p: torch.Tensor, owner: int, update: Callable[[torch.Tensor, Any], None],
                        generator: torch.Generator | None = None, with_grad: bool = True) -> None:
    """Run ``update(weight, grad)`` (in place on ``weight``) on the whole matrix of the sharded parameter ``p``, on the
    rank that owns it, and give every rank its shard of the result (``with_grad=False``: ``update(weight, None)``).

    The weight and gradient are gathered (all-gather of one matrix at a time), the owner runs the unsharded update
    (so its state, kept by ``update``, lives on the owner only: about 1/world of the total per rank), the result is
    scattered from the owner. ``generator``'s state is then taken from the owner, so random draws follow the
    sequence of a one-process run whatever rank draws them.
    """
    import torch.distributed as dist

    distribute_tensor = dtensor_api()[1]
    weight = p.full_tensor()  # type: ignore[attr-defined]
    grad = p.grad.full_tensor() if with_grad else None  # type: ignore[union-attr]
    rank = dist.get_rank()
    if rank == owner:
        update(weight, grad)
    if generator is not None:
        generator.set_state(from_owner(generator.get_state(), owner))
    new = distribute_tensor(weight, p.device_mesh, p.placements, src_data_rank=owner)  # type: ignore[attr-defined]
    p.to_local().copy_(new.to_local())  # type: ignore[attr-defined]
