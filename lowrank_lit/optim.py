"""Learning-rate schedules shared by the baseline and the methods."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from lowrank_lit.nn.targets import match_names
from lowrank_lit.sharding import from_owner, is_sharded, owners, whole_matrix_update

__all__ = ["WarmupCosineLR", "linear_warmup", "matrix_param_groups", "SeededOptimizer"]


def linear_warmup(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Learning rate ramped linearly over ``steps`` optimizer steps (``(step + 1) / steps``), then constant.

    ``steps = 0`` means no warm-up (the factor is 1 from the first step).
    """
    if steps < 0:
        raise ValueError(f"linear_warmup: steps={steps}; allowed: an integer >= 0")
    warmup = max(1, int(steps))
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))


class WarmupCosineLR(LRScheduler):
    """Linear warm-up to the optimizer's lr, then cosine decay to ``min_lr_ratio * lr``; stepped per optimizer step.

    ``total_steps=None`` means "the whole run": :class:`~lowrank_lit.models.classifier.ImageClassifier`
    calls :meth:`set_total_steps` with ``trainer.estimated_stepping_batches``, so the schedule follows
    ``trainer.max_epochs`` without editing the config.

    Args:
        optimizer: the wrapped optimizer.
        total_steps: optimizer steps of the whole schedule. Default: None (set by the module).
        warmup_fraction: fraction of ``total_steps`` spent warming up, in [0, 1). Default: 0.1.
        min_lr_ratio: final lr as a fraction of the peak, in [0, 1]. Default: 0.0.
        last_epoch: index of the last step (for resuming). Default: -1.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        total_steps: int | None = None,
        warmup_fraction: float = 0.1,
        min_lr_ratio: float = 0.0,
        last_epoch: int = -1,
    ) -> None:
        if total_steps is not None and total_steps < 1:
            raise ValueError(f"WarmupCosineLR: total_steps={total_steps}; allowed: an integer >= 1 or None")
        if not 0.0 <= warmup_fraction < 1.0:
            raise ValueError(f"WarmupCosineLR: warmup_fraction={warmup_fraction}; allowed: a float in [0, 1)")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"WarmupCosineLR: min_lr_ratio={min_lr_ratio}; allowed: a float in [0, 1]")
        self.total_steps = total_steps
        self.warmup_fraction = warmup_fraction
        self.min_lr_ratio = min_lr_ratio
        super().__init__(optimizer, last_epoch)

    def factor(self, step: int) -> float:
        """Multiplier of the peak lr at optimizer step ``step`` (1.0 while ``total_steps`` is unknown)."""
        if self.total_steps is None:
            return 1.0
        warmup = max(1, round(self.warmup_fraction * self.total_steps)) if self.warmup_fraction > 0 else 0
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def get_lr(self) -> list[float]:
        f = self.factor(self.last_epoch)
        return [base * f for base in self.base_lrs]

    def set_total_steps(self, total_steps: int) -> None:
        """Fix the schedule length and move the current lr onto the new schedule."""
        if total_steps < 1:
            raise ValueError(f"WarmupCosineLR: total_steps={total_steps}; allowed: an integer >= 1")
        self.total_steps = int(total_steps)
        self._last_lr = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr, strict=True):
            group["lr"] = lr


def matrix_param_groups(module: nn.Module, dense: tuple[str, ...] | list[str] = ()) -> list[dict]:
    """Split trainable parameters into the weight matrices a memory-lean optimizer compresses and the rest.

    Returns up to two param groups: the 2-D weights whose names match none of the ``dense`` patterns
    (fnmatch, case-sensitive, as :func:`lowrank_lit.nn.targets.match_names`; e.g. ``"*embed*"``, ``"head_tgt.*"``), tagged ``nano=True, lowrank=True``; and every other
    trainable parameter (biases, norms, embeddings, heads), tagged ``nano=False, lowrank=False``.
    NanoAdam and LowRankAdam read these flags; torch optimizers ignore them. Empty groups are dropped.
    """
    matrices, rest = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        is_dense = p.ndim != 2 or bool(match_names([name], dense))
        (rest if is_dense else matrices).append(p)
    groups = [{"params": matrices, "nano": True, "lowrank": True}, {"params": rest, "nano": False, "lowrank": False}]
    return [g for g in groups if g["params"]]


def adam_moments_(m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor, b1: float, b2: float) -> None:
    """Adam's moment update in place: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``.

    The one moment update of the framework's Adam-type optimizers (NanoAdam's sparse and dense paths,
    LowRankAdam); each keeps its own bias-correction form, as its paper writes it.
    """
    m.mul_(b1).add_(grad, alpha=1 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1 - b2)


def bias_corrections(b1: float, b2: float, n: int) -> tuple[float, float]:
    """Adam's bias-correction denominators ``(1 - b1^n, 1 - b2^n)`` after ``n`` updates."""
    return 1 - b1**n, 1 - b2**n


class SeededOptimizer(torch.optim.Optimizer):
    """Base of the framework's Adam-type optimizers that draw random numbers and keep non-float state.

    * ``self.generator`` is seeded with ``seed``, or with the run seed (``torch.initial_seed()``, the same
      on every DDP rank after ``seed_everything``) when ``seed`` is None; its state travels in
      ``state_dict()`` so a resumed run draws the same numbers.
    * ``load_state_dict`` keeps integer and boolean state tensors (index sets, masks) in their saved
      dtype, and string state (e.g. a projector's side) as it was: torch would cast every state tensor
      to its parameter's floating dtype and turn a string into the text of a generator object.
    * :meth:`step` handles the closure, skips parameters without a gradient, refuses sparse ones and
      counts ``state["step"]``; subclasses write :meth:`update` for one parameter.
    * Sharded parameters (FSDP2 DTensors, :class:`lowrank_lit.sharding.ShardedStrategy`): an update that reads the
      whole matrix runs whole on the rank that owns the parameter (:func:`lowrank_lit.sharding.whole_matrix_update`),
      so it equals the one-process update and the state lives on the owner; an :meth:`elementwise` one runs on each
      shard. Either way each rank holds about 1/world of the state.
    * :meth:`check_adam` validates the Adam hyperparameters of a param group; :meth:`state_bytes`
      reports the memory held in the state.
    """

    #: under sharding, ``state_dict()`` returns the whole state in the one-process format (read by ShardedStrategy)
    saves_whole_state = True

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], seed: int | None = None) -> None:
        self.generator = torch.Generator().manual_seed(torch.initial_seed() % 2**63 if seed is None else seed)
        self._owners: dict[int, int] | None = None  # sharded runs: the rank that updates each parameter
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                t = state.get("step", 0)
                if is_sharded(p) and self.elementwise(p, group):
                    self.update(p.to_local(), p.grad.to_local(), state, group, t)
                elif is_sharded(p):
                    self._sharded_update(p, state, group, t)
                else:
                    self.update(p, p.grad, state, group, t)
                state["step"] = t + 1
        return loss

    def elementwise(self, p: torch.Tensor, group: dict[str, Any]) -> bool:
        """Whether the update of ``p`` in ``group`` is elementwise (reads no other entry, draws nothing): a sharded
        parameter is then updated shard by shard, its state sharded with it. Default: False (whole matrix)."""
        return False

    def _sharded_update(self, p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], t: int) -> None:
        """A sharded parameter (FSDP2 DTensor) is updated whole on the rank that owns it
        (:func:`lowrank_lit.sharding.whole_matrix_update`): the update equals the one-process update, and the state of
        a parameter lives on its owner only."""
        whole_matrix_update(p, self._owner(p), lambda w, g: self.update(w, g, state, group, t), self.generator)

    def _owner(self, p: torch.Tensor) -> int:
        import torch.distributed as dist

        if self._owners is None:
            sharded = [q for g in self.param_groups for q in g["params"] if is_sharded(q)]
            self._owners = owners(sharded, dist.get_world_size())
        return self._owners[id(p)]

    def _whole_state(self, sd: dict[str, Any]) -> dict[str, Any]:
        """``sd`` (this rank's ``state_dict``) as a one-process optimizer would write it: each owned parameter's state
        from its owner, each elementwise state gathered whole. Every rank calls it (collectives)."""
        import torch.distributed as dist

        from lowrank_lit.sharding import dtensor_api

        DTensor = dtensor_api()[0]  # noqa: N806 - the class
        state = dict(sd["state"])
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if is_sharded(p):
                    own = state.get(index)
                    if self.elementwise(p, group):
                        local = p.to_local()
                        own = {k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape,
                                                     stride=p.stride()).full_tensor()
                               if isinstance(v, torch.Tensor) and v.shape == local.shape and v.ndim else v
                               for k, v in (own or {}).items()}
                    else:
                        owner = self._owner(p)
                        own = from_owner(own if dist.get_rank() == owner else None, owner)
                    if own is not None:
                        state[index] = own
                index += 1
        return {**sd, "state": state}

    def _shard_state(self) -> None:
        """After loading a whole state into a sharded optimizer: keep each elementwise state's local shard and the
        owned parameters' states (the others keep their step count only)."""
        import torch.distributed as dist

        from lowrank_lit.sharding import dtensor_api

        distribute_tensor = dtensor_api()[1]
        for group in self.param_groups:
            for p in group["params"]:
                if not is_sharded(p) or p not in self.state:
                    continue
                st = self.state[p]
                if self.elementwise(p, group):
                    for k, v in list(st.items()):
                        if isinstance(v, torch.Tensor) and v.shape == p.shape and v.ndim:
                            st[k] = distribute_tensor(v, p.device_mesh, p.placements,
                                                      src_data_rank=None).to_local()
                elif dist.get_rank() != self._owner(p):
                    self.state[p] = {k: v for k, v in st.items() if k == "step"}

    def update(self, p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], group: dict[str, Any], t: int) -> None:
        """Update parameter ``p`` in place at step ``t`` (0-based) from ``grad``."""
        raise NotImplementedError

    @staticmethod
    def check_adam(g: dict[str, Any], where: str) -> None:
        """``lr >= 0``, ``betas`` in [0, 1), ``eps > 0``, ``weight_decay >= 0`` (error names the argument)."""
        if not g["lr"] >= 0:
            raise ValueError(f"{where}: lr={g['lr']!r}; allowed: >= 0")
        b1, b2 = g["betas"]
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"{where}: betas={tuple(g['betas'])!r}; allowed: both in [0, 1)")
        if not g["eps"] > 0:
            raise ValueError(f"{where}: eps={g['eps']!r}; allowed: > 0")
        if not g["weight_decay"] >= 0:
            raise ValueError(f"{where}: weight_decay={g['weight_decay']!r}; allowed: >= 0")

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict and the generator's state; under sharding the whole state (every rank returns what a
        one-process run would save, so a consolidated checkpoint resumes on any number of processes)."""
        sd = super().state_dict()
        if any(is_sharded(p) for g in self.param_groups for p in g["params"]):
            sd = self._whole_state(sd)
        sd["generator_state"] = self.generator.get_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        exact = {pid: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()
                       if isinstance(v, str) or (isinstance(v, torch.Tensor) and not v.is_floating_point())}
                 for pid, st in state_dict["state"].items()}
        gen_state = state_dict.get("generator_state")
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "generator_state"})
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params, strict=True):
            for key, value in exact.get(pid, {}).items():
                self.state[p][key] = value.to(p.device) if isinstance(value, torch.Tensor) else value
        if gen_state is not None:
            self.generator.set_state(gen_state)
        if any(is_sharded(p) for p in params):
            self._shard_state()

    def state_bytes(self) -> int:
        """Bytes held in the optimizer state (every state tensor)."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values() if isinstance(v, torch.Tensor))
