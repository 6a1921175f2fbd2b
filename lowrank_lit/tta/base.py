"""The test-time adaptation contract and the single-model methods: SourceOnly, Tent, EATA, CoTTA.

The contract (what :class:`~lowrank_lit.tta.TTAModule` calls, written down once in :class:`TTAMethod`):

* ``setup(model, source_batches)`` once, before the stream: take the source-trained model;
  ``source_batches`` is an endless iterator of clean ``(x, y)`` batches when the datamodule is a
  :class:`SourceData` (it has ``source_dataloader``), else None.
* ``forward_and_adapt(x) -> logits`` for every test batch, in stream order: predict, then adapt.
* ``last_cluster`` (``int | None``): the cluster the last batch was routed to; None for methods that
  do not route. ``num_models``: adapted copies held (1 for a single-model method).

Each single-model method owns one model and its optimizer and exposes the pieces a plug-in needs:
``predict(x)`` and ``adapt(x)`` separately, and ``get_state()``/``set_state()`` (adapted parameters,
optimizer state and the method's own buffers) so that several copies can share one network. A
plug-in that wraps another method (ReservoirTTA) subclasses :class:`TTAWrapper`, whose ``model``,
``params`` and ``optimizer`` are the wrapped method's.

* Tent (Wang et al., ICLR 2021): adapt the affine parameters of the norm layers by minimising the
  mean prediction entropy; BatchNorm uses the test batch's statistics.
* EATA (Niu et al., ICML 2022): Tent's loss on samples with entropy below ``e_margin`` (0.4 ln C)
  whose prediction is not redundant with the moving-average prediction (|cos| < ``d_margin``),
  weighted by ``exp(e_margin - E)``, plus a Fisher-weighted anchor to the source parameters
  (``fisher_alpha`` 2000). Fisher = mean squared gradient of the cross-entropy with the model's own
  argmax labels on clean source batches (``fisher_batches`` of them; inferred size).
* CoTTA (Wang et al., CVPR 2022): all parameters; an EMA teacher (``mt_alpha`` 0.999) whose
  prediction is averaged over ``n_aug`` augmentations when the source model's confidence is below
  ``ap``; soft cross-entropy student loss; stochastic restore of each weight to its source value with
  probability ``rst``. The prediction is the teacher's. Augmentations for small grey images (inferred):
  random shifts of up to 1 pixel, brightness/contrast jitter, Gaussian noise.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.argtypes import LearningRate

__all__ = ["TTAMethod", "TTAWrapper", "SourceData", "SourceOnly", "Tent", "EATA", "CoTTA", "norm_affine_params", "entropy"]

_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Prediction entropy per sample, ``(B, C) -> (B,)``."""
    logp = logits.log_softmax(dim=1)
    return -(logp.exp() * logp).sum(dim=1)


def norm_affine_params(model: nn.Module) -> list[nn.Parameter]:
    """The weight and bias of every BatchNorm/LayerNorm/GroupNorm layer (Tent's adapted parameters)."""
    params = [p for m in model.modules() if isinstance(m, _NORMS) for p in (m.weight, m.bias) if p is not None]
    if not params:
        raise ValueError(f"TTA: the model ({type(model).__name__}) has no BatchNorm/LayerNorm/GroupNorm affine parameters to adapt")
    return params


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


@runtime_checkable
class SourceData(Protocol):
    """A datamodule that can give clean source batches (EATA's Fisher, ReservoirTTA's source styles)."""

    def source_dataloader(self, batch_size: int | None = None, generator: torch.Generator | None = None) -> Iterable[Any]:
        ...


class TTAMethod:
    """Base class and contract (see the module docstring): adapt ``self.params`` of ``self.model`` with
    Adam, one step per test batch.

    Args:
        lr: Adam learning rate. Default: 1e-3.
        betas: Adam's coefficients. Default: (0.9, 0.999).
    """

    adapts = True
    #: BatchNorm normalises with the test batch's statistics (running statistics removed)
    batch_stats = True
    #: the cluster the last batch was routed to (routing plug-ins set it); None: no routing
    last_cluster: int | None = None

    @property
    def num_models(self) -> int:
        """Adapted copies this method holds (1 for a single-model method)."""
        return 1

    def __init__(self, lr: LearningRate = 1e-3, betas: tuple[float, float] = (0.9, 0.999)) -> None:
        if lr < 0:
            raise ValueError(f"{type(self).__name__}: lr={lr!r}; allowed: >= 0")
        self.lr, self.betas = lr, tuple(betas)
        self.model: nn.Module | None = None
        self.params: list[nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None

    # -- setup -------------------------------------------------------------------------------------
    def select_params(self, model: nn.Module) -> list[nn.Parameter]:
        return norm_affine_params(model)

    def setup(self, model: nn.Module, source_batches: Iterable[Any] | None = None) -> None:
        """Take ``model`` (already holding the source weights); ``source_batches`` are clean ``(x, y)`` batches."""
        self.model = model
        model.requires_grad_(False)
        self.params = self.select_params(model) if self.adapts else []
        for p in self.params:
            p.requires_grad_(True)
        for m in model.modules():  # Tent: BatchNorm normalises with the test batch's statistics
            if self.batch_stats and isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.train()
                m.track_running_stats = False
                m.running_mean = m.running_var = None
        self.optimizer = self.make_optimizer(self.params) if self.params else None

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer of the adapted parameters. Default: Adam(``lr``, ``betas``)."""
        return torch.optim.Adam(params, lr=self.lr, betas=self.betas)

    # -- one batch ---------------------------------------------------------------------------------
    def _check_batch(self, x: torch.Tensor) -> None:
        if len(x) < 2 and self.model is not None and _has_batchnorm(self.model):
            raise ValueError("TTA: batch size 1 with a BatchNorm model (batch statistics need >= 2 samples)")

    def loss(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """The adaptation loss of this batch; None skips the step."""
        raise NotImplementedError

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Logits without adapting."""
        assert self.model is not None, "call setup() first"
        self._check_batch(x)
        with torch.no_grad():
            return self.model(x)

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        """Predict ``x`` and take one adaptation step on it; returns the (pre-step) logits."""
        assert self.model is not None, "call setup() first"
        self._check_batch(x)
        if self.optimizer is None:
            return self.predict(x)
        with torch.enable_grad():
            logits = self.model(x)
            loss = self.loss(logits, x)
            if loss is not None:
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                self.after_step()
        return logits.detach()

    def adapt(self, x: torch.Tensor) -> None:
        self.forward_and_adapt(x)

    # -- domains -----------------------------------------------------------------------------------
    #: the domain index of the current batch (set by TTAModule before each batch)
    domain: int = 0

    def snapshot_source(self) -> None:
        """Remember the current (source) state; :meth:`reset` returns to it."""
        self._source_state = self.get_state()

    def reset(self) -> None:
        """Back to the source weights with a fresh optimizer (episodic per domain); needs :meth:`snapshot_source`."""
        state = getattr(self, "_source_state", None)
        if state is None:
            raise RuntimeError(f"{type(self).__name__}.reset: call snapshot_source() after setup() first")
        self.set_state(state)
        if self.optimizer is not None:
            self.optimizer.state.clear()  # Adam's moments and step counts start again

    def tables(self) -> dict[str, list[dict[str, Any]]]:
        """Extra per-run tables (file name -> rows) the module writes to the run directory."""
        return {}

    def after_step(self) -> None:
        """Hook after each optimizer step."""

    # -- copies ------------------------------------------------------------------------------------
    def extra_state(self) -> dict[str, Any]:
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        del state

    def get_params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def load_params(self, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, values, strict=True):
                p.copy_(v)

    def get_state(self) -> dict[str, Any]:
        """A detached copy of everything one adapted model consists of."""
        return {
            "params": self.get_params(),
            "optim": copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None,
            "extra": copy.deepcopy(self.extra_state()),
        }

    def stream_state(self) -> dict[str, Any]:
        """Everything needed to go on adapting this stream later, or to evaluate the adapted model: tensors,
        numbers and containers only (saved with :func:`lowrank_lit.artifacts.save_state`). Default: the adapted
        model's :meth:`get_state`; methods with more (a reservoir, a chosen traversal order) extend it."""
        return {"state": self.get_state()}

    def load_stream_state(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`stream_state` (after :meth:`setup` on the same source model)."""
        self.set_state(state["state"])

    def set_state(self, state: dict[str, Any], copy_state: bool = True) -> None:
        """Load a :meth:`get_state` result; ``copy_state=False`` lets the optimizer share its tensors (the
        caller then must not reuse ``state`` after the next step)."""
        self.load_params(state["params"])
        if self.optimizer is not None and state["optim"] is not None:
            self.optimizer.load_state_dict(copy.deepcopy(state["optim"]) if copy_state else state["optim"])
        self.load_extra_state(copy.deepcopy(state["extra"]) if copy_state else state["extra"])


class TTAWrapper(TTAMethod):
    """A plug-in around another method: the network, adapted parameters and optimizer are the wrapped method's.

    Subclasses call ``self.method.setup(...)`` in their ``setup`` and route, copy or average through
    :meth:`TTAMethod.get_state` / :meth:`TTAMethod.set_state`, which act on the wrapped method's state.

    Args:
        method: the wrapped single-model method (its ``lr`` and ``betas`` are this plug-in's).
    """

    def __init__(self, method: TTAMethod) -> None:
        if not isinstance(method, TTAMethod):
            raise ValueError(f"{type(self).__name__}: method={method!r}; allowed: any single-model TTAMethod (Tent, EATA, "
                             "CoTTA, SAR, RoTTA, LAME, SourceOnly, TRUST, TrustNaive, or your own subclass)")
        self.method = method
        self.lr, self.betas = method.lr, method.betas

    @property
    def model(self) -> nn.Module | None:  # type: ignore[override]
        return self.method.model

    @property
    def params(self) -> list[nn.Parameter]:  # type: ignore[override]
        return self.method.params

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:  # type: ignore[override]
        return self.method.optimizer

    def loss(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        return self.method.loss(logits, x)

    def extra_state(self) -> dict[str, Any]:
        return self.method.extra_state()

    def reset(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} adapts continually; reset_each_domain=true is not supported")

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.method.load_extra_state(state)


class SourceOnly(TTAMethod):
    """No adaptation: the source model's predictions.

    Args:
        batch_stats: BatchNorm uses each test batch's statistics (as every adapting method here does); False
            keeps the source model's running statistics (the plain source model). Default: True.
    """

    adapts = False

    def __init__(self, batch_stats: bool = True) -> None:
        super().__init__()
        self.batch_stats = batch_stats

    def loss(self, logits: torch.Tensor, x: torch.Tensor) -> None:
        return None


class Tent(TTAMethod):
    """Entropy minimisation of the norm affine parameters (one Adam step per batch).

    Args:
        lr: Adam learning rate. Default: 1e-3.
        betas: Adam's coefficients. Default: (0.9, 0.999).
        norms: ``all`` (BatchNorm, GroupNorm and LayerNorm affine parameters) or ``batchnorm`` (BatchNorm only,
            Tent's original choice for BN networks). Default: all.
    """

    NORMS = ("all", "batchnorm")

    def __init__(self, lr: LearningRate = 1e-3, betas: tuple[float, float] = (0.9, 0.999), norms: str = "all") -> None:
        super().__init__(lr, betas)
        if norms not in self.NORMS:
            raise ValueError(f"Tent: norms={norms!r}; allowed: {', '.join(self.NORMS)}")
        self.norms = norms

    def select_params(self, model: nn.Module) -> list[nn.Parameter]:
        if self.norms == "all":
            return norm_affine_params(model)
        params = [p for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) for p in (m.weight, m.bias) if p is not None]
        if not params:
            raise ValueError(f"Tent: norms='batchnorm' but {type(model).__name__} has no BatchNorm affine parameters")
        return params

    def loss(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return entropy(logits).mean()


class EATA(TTAMethod):
    """Efficient anti-forgetting TTA: reliable, non-redundant samples + Fisher anchor (see module docstring).

    Args:
        lr: Adam learning rate. Default: 1e-3.
        betas: Adam's coefficients. Default: (0.9, 0.999).
        e_margin: entropy threshold as a fraction of ln(num classes). Default: 0.4.
        d_margin: redundancy threshold on |cos(p, p_avg)|. Default: 0.4 (EATA's CIFAR-10 value).
        fisher_alpha: weight of the Fisher anchor. Default: 2000.
        fisher_batches: clean source batches for the Fisher estimate. Default: 8.
    """

    def __init__(self, lr: LearningRate = 1e-3, betas: tuple[float, float] = (0.9, 0.999), e_margin: float = 0.4,
                 d_margin: float = 0.4, fisher_alpha: float = 2000.0, fisher_batches: int = 8) -> None:
        super().__init__(lr, betas)
        if e_margin <= 0 or d_margin <= 0 or fisher_alpha < 0 or fisher_batches < 0:
            raise ValueError(f"EATA: e_margin={e_margin}, d_margin={d_margin}, fisher_alpha={fisher_alpha}, "
                             f"fisher_batches={fisher_batches}; allowed: > 0, > 0, >= 0, >= 0")
        self.e_margin_frac, self.d_margin, self.fisher_alpha, self.fisher_batches = e_margin, d_margin, fisher_alpha, fisher_batches
        self.p_avg: torch.Tensor | None = None
        self.fisher: list[torch.Tensor] = []
        self.anchor: list[torch.Tensor] = []

    def setup(self, model: nn.Module, source_batches: Iterable[Any] | None = None) -> None:
        super().setup(model, source_batches)
        self.anchor = self.get_params()
        self.fisher = [torch.zeros_like(p) for p in self.params]
        if source_batches is None or not self.fisher_batches or not self.fisher_alpha:
            return
        n = 0
        for x, _ in source_batches:
            with torch.enable_grad():
                logits = model(x)
                loss = F.cross_entropy(logits, logits.argmax(dim=1))
                grads = torch.autograd.grad(loss, self.params)
            for f, g in zip(self.fisher, grads, strict=True):
                f.add_(g.detach() ** 2)
            n += 1
            if n >= self.fisher_batches:
                break
        self.fisher = [f / max(n, 1) for f in self.fisher]

    def loss(self, logits: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        e0 = self.e_margin_frac * math.log(logits.shape[1])
        ent = entropy(logits)  # (B,)
        keep = ent < e0
        probs = logits.softmax(dim=1)
        if self.p_avg is not None and bool(keep.any()):
            cos = F.cosine_similarity(self.p_avg[None], probs, dim=1)
            keep = keep & (cos.abs() < self.d_margin)
        if not bool(keep.any()):
            return None
        sel = probs[keep].detach().mean(dim=0)
        self.p_avg = sel if self.p_avg is None else 0.9 * self.p_avg + 0.1 * sel
        weights = torch.exp(e0 - ent[keep].detach())
        loss = (ent[keep] * weights).mean()
        if self.fisher_alpha:
            loss = loss + self.fisher_alpha * sum((f * (p - a) ** 2).sum() for p, f, a in zip(self.params, self.fisher, self.anchor, strict=True))
        return loss

    def extra_state(self) -> dict[str, Any]:
        return {"p_avg": None if self.p_avg is None else self.p_avg.clone()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.p_avg = state.get("p_avg")


def _augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Light augmentations for small grey images: shift by up to 1 px, brightness/contrast jitter, noise."""
    dx, dy = (int(v) for v in torch.randint(-1, 2, (2,), generator=g))
    x = torch.roll(x, shifts=(dy, dx), dims=(2, 3))
    scale = 1.0 + 0.1 * (torch.rand(len(x), 1, 1, 1, generator=g) - 0.5)
    shift = 0.05 * (torch.rand(len(x), 1, 1, 1, generator=g) - 0.5)
    return x * scale + shift + 0.005 * torch.randn(x.shape, generator=g)


class CoTTA(TTAMethod):
    """Continual TTA with an EMA teacher, augmentation averaging and stochastic restore (all parameters).

    Args:
        lr: Adam learning rate. Default: 1e-3.
        betas: Adam's coefficients. Default: (0.9, 0.999).
        mt_alpha: EMA rate of the teacher. Default: 0.999.
        rst: probability of restoring each weight to its source value per step. Default: 0.01.
        ap: source-confidence threshold below which the teacher averages augmentations. Default: 0.92.
        n_aug: augmentations averaged. Default: 4 (card).
        seed: seed of the augmentations and the restore masks. Default: 0.
    """

    def __init__(self, lr: LearningRate = 1e-3, betas: tuple[float, float] = (0.9, 0.999), mt_alpha: float = 0.999,
                 rst: float = 0.01, ap: float = 0.92, n_aug: int = 4, seed: int = 0) -> None:
        super().__init__(lr, betas)
        if not (0 <= mt_alpha <= 1 and 0 <= rst <= 1 and n_aug >= 1):
            raise ValueError(f"CoTTA: mt_alpha={mt_alpha}, rst={rst}, n_aug={n_aug}; allowed: [0, 1], [0, 1], >= 1")
        self.mt_alpha, self.rst, self.ap, self.n_aug = mt_alpha, rst, ap, n_aug
        self.generator = torch.Generator().manual_seed(seed)

    def select_params(self, model: nn.Module) -> list[nn.Parameter]:
        return list(model.parameters())

    def setup(self, model: nn.Module, source_batches: Iterable[Any] | None = None) -> None:
        super().setup(model, source_batches)
        self.teacher = copy.deepcopy(model).requires_grad_(False)
        self.anchor = copy.deepcopy(model).requires_grad_(False)
        self.source = self.get_params()

    def _teacher_logits(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            conf = self.anchor(x).softmax(dim=1).max(dim=1).values.mean()
            out = self.teacher(x)
            if conf < self.ap:
                out = torch.stack([self.teacher(_augment(x, self.generator)) for _ in range(self.n_aug)]).mean(dim=0)
        return out

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        self._check_batch(x)
        return self._teacher_logits(x)

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        self._check_batch(x)
        teacher = self._teacher_logits(x)
        with torch.enable_grad():
            student = self.model(x)
            loss = -(teacher.softmax(dim=1) * student.log_softmax(dim=1)).sum(dim=1).mean()
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            self.optimizer.step()
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.model.parameters(), strict=True):
                t.mul_(self.mt_alpha).add_(s, alpha=1 - self.mt_alpha)
            if self.rst > 0:
                for p, src in zip(self.params, self.source, strict=True):
                    mask = torch.rand(p.shape, generator=self.generator) < self.rst
                    p.copy_(torch.where(mask, src, p))
        return teacher

    def extra_state(self) -> dict[str, Any]:
        return {"teacher": [p.detach().clone() for p in self.teacher.parameters()]}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "teacher" in state:
            with torch.no_grad():
                for p, v in zip(self.teacher.parameters(), state["teacher"], strict=True):
                    p.copy_(v)
