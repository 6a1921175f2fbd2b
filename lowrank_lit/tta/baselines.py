"""The test-time adaptation baselines researchers compare against, beside Tent / EATA / CoTTA: SAR, RoTTA, LAME.

The test-batch-statistics baseline (AdaBN: BatchNorm normalises with each test batch's mean and variance, nothing
is trained) is :class:`~lowrank_lit.tta.SourceOnly` with ``batch_stats=True``; the plain source model is
``batch_stats=False``.

* SAR (Niu et al., ICLR 2023, "Towards stable test-time adaptation in dynamic wild world"): Tent's entropy on the
  reliable samples only (entropy below ``e_margin`` x ln C, 0.4), minimised with sharpness-aware minimisation: a
  first gradient ``g`` at ``w``, an ascent to ``w + rho g / ||g||`` (``rho`` 0.05, the norm over all adapted
  parameters), a second gradient there on the samples that pass the filter twice, then an SGD step (momentum 0.9)
  from ``w`` with that gradient. Model recovery: an exponential moving average of the second loss (0.9 old +
  0.1 new); when it falls below ``reset_constant`` (0.2) the adapted parameters and the optimizer go back to the
  source state. Adapted: the norm layers' affine parameters (the paper also leaves the deepest blocks' norms
  frozen on ResNet/ViT; our small CNNs adapt every norm layer, inferred). Defaults: the paper's ImageNet-C values
  (SGD lr 0.00025 for batch 64).
* RoTTA (Yuan et al., CVPR 2023, "Robust test-time adaptation in dynamic scenarios"), as its public code has it:
  (1) robust batch norm (:class:`RobustBatchNorm`): in train mode each BatchNorm normalises with global
  statistics that follow the batch by an exponential moving average (``alpha`` 0.05) and stores them; in eval mode
  it normalises with the stored statistics and changes nothing. Each test batch is predicted by the teacher in
  eval mode, so the statistics never follow the test stream; teacher and student run in train mode only inside
  the update on the memory bank (teacher: the stored images; student: their strong augmentations). (2) A
  category-balanced memory bank (CSTU, ``memory_size`` 64): each test sample is offered with the teacher's
  pseudo-label and uncertainty ``-sum p log(p + 1e-6)``, scored at age 0; a class below its share (N / C)
  displaces, when the bank is full, the highest-scoring instance of the majority classes, a class at its share
  displaces its own highest-scoring instance, in both cases only if that score exceeds the newcomer's (ties go to
  the last in class order, then insertion order); score = ``lambda_t`` / (1 + exp(-age / N)) + ``lambda_u`` H /
  ln C. After each offer every stored instance ages by one, the newcomer too. (3) Every ``update_frequency`` (64)
  samples the student trains on the bank (class order, then insertion order): the teacher's soft labels on the
  stored images against the student's on strongly augmented ones, each instance weighted by its timeliness
  exp(-age / N) / (1 + exp(-age / N)); Adam lr 1e-3 on the norm affine parameters; then the teacher's parameters
  follow the student's by an EMA (``nu`` 0.001; its statistics are its own). The prediction is the teacher's.
  Strong augmentation for small grey images (inferred): shifts up to 2 px, brightness/contrast jitter, Gaussian
  noise.
* LAME (Boudiaf et al., CVPR 2022, "Parameter-free online test-time adaptation"): no parameter changes; the
  frozen model's class probabilities ``Y`` of a batch are replaced by the assignments ``Z`` minimising
  ``sum_i KL(z_i || y_i) - sum_ij W_ij z_i . z_j`` (a Laplacian term on an affinity ``W`` of the L2-normalised
  penultimate features), found by the paper's bound updates ``z_i <- softmax(log y_i + sum_j W_ij z_j)`` until the
  objective changes by less than ``tol`` relative. The affinity, as in the paper's public code: ``rbf`` (the
  default there and in its best overall configuration) ``W_ij = exp(-||f_i - f_j||^2 / (2 sigma^2))`` with sigma
  the mean over the batch of each sample's distance to its ``knn``-th nearest point counting itself (the code's
  ``sigma`` setting is unused), the diagonal included; ``knn``: ``W_ij = 1`` for the ``knn`` nearest other samples;
  ``linear``: ``W = F F^T``. ``knn`` 5. The features are the input of the model's last ``nn.Linear`` (the
  classifier head). BatchNorm keeps the source model's statistics.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.argtypes import LearningRate
from lowrank_lit.tta.base import _NORMS, TTAMethod, entropy

__all__ = ["SAR", "RoTTA", "RobustBatchNorm", "LAME", "laplacian_adjust", "knn_affinity", "rbf_affinity",
           "linear_affinity", "AFFINITIES"]


class SAR(TTAMethod):
    """Sharpness-aware, reliable entropy minimisation with model recovery (see the module docstring).

    Args:
        lr: SGD learning rate. Default: 0.00025 (the paper's, batch 64).
        momentum: SGD momentum. Default: 0.9.
        e_margin: reliability threshold as a fraction of ln(num classes). Default: 0.4.
        rho: radius of the sharpness-aware ascent. Default: 0.05.
        reset_constant: recover the source state when the loss EMA falls below it. Default: 0.2.
        ema_decay: weight of the old value in the loss EMA. Default: 0.9.
    """

    def __init__(self, lr: LearningRate = 0.00025, momentum: float = 0.9, e_margin: float = 0.4, rho: float = 0.05,
                 reset_constant: float = 0.2, ema_decay: float = 0.9) -> None:
        super().__init__(lr)
        if not (0 <= momentum < 1 and e_margin > 0 and rho > 0 and reset_constant >= 0 and 0 <= ema_decay < 1):
            raise ValueError(f"SAR: momentum={momentum}, e_margin={e_margin}, rho={rho}, reset_constant={reset_constant}, "
                             f"ema_decay={ema_decay}; allowed: [0, 1), > 0, > 0, >= 0, [0, 1)")
        self.momentum, self.e_margin_frac, self.rho = momentum, e_margin, rho
        self.reset_constant, self.ema_decay = reset_constant, ema_decay
        self.ema: float | None = None
        self.recoveries = 0

    def make_optimizer(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

    def setup(self, model: nn.Module, source_batches: Iterable[Any] | None = None) -> None:
        super().setup(model, source_batches)
        self._recovery = self.get_state()  # the source state model recovery returns to

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        assert self.model is not None and self.optimizer is not None, "call setup() first"
        self._check_batch(x)
        with torch.enable_grad():
            logits = self.model(x)  # (B, C)
            e0 = self.e_margin_frac * math.log(logits.shape[1])
            ent = entropy(logits)
            keep = ent < e0  # reliable samples
            if not bool(keep.any()):
                return logits.detach()
            self.optimizer.zero_grad(set_to_none=True)
            ent[keep].mean().backward()
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            with torch.no_grad():  # ascend to the sharpest point within rho
                eps = [g * (self.rho / (norm + 1e-12)) for g in grads]
                for p, e in zip(self.params, eps, strict=True):
                    p.add_(e)
            self.optimizer.zero_grad(set_to_none=True)
            ent2 = entropy(self.model(x))[keep]  # the whole batch through the network, the reliable samples' entropy
            keep2 = ent2 < e0
            loss2 = ent2[keep2].mean() if bool(keep2.any()) else None
            if loss2 is not None:
                loss2.backward()
            with torch.no_grad():  # back to w; the step uses the gradient at w + eps
                for p, e in zip(self.params, eps, strict=True):
                    p.sub_(e)
            if loss2 is None:
                return logits.detach()
            self.optimizer.step()
        value = float(loss2.detach())
        self.ema = value if self.ema is None else self.ema_decay * self.ema + (1 - self.ema_decay) * value
        if self.ema < self.reset_constant:  # collapsed to confident predictions: recover the source model
            self.set_state(self._recovery)
            self.optimizer.state.clear()
            self.ema = None
            self.recoveries += 1
        return logits.detach()

    def extra_state(self) -> dict[str, Any]:
        return {"ema": self.ema, "recoveries": self.recoveries}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.ema, self.recoveries = state.get("ema"), int(state.get("recoveries", 0))


class RobustBatchNorm(nn.Module):
    """RoTTA's robust BatchNorm: normalise with global statistics that follow each training batch by an EMA.

    In train mode a forward computes the batch's mean and (biased) variance per channel, mixes them into the
    global statistics (``(1 - alpha) global + alpha batch``; gradients flow through the batch part), normalises
    with the mix and stores it (detached). In eval mode it normalises with the stored statistics and changes
    nothing. Starts from the wrapped BatchNorm's running statistics and affine parameters.

    Args:
        bn: the source BatchNorm (1d/2d/3d) with running statistics.
        alpha: weight of the batch statistics. Default: 0.05.
    """

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, alpha: float = 0.05) -> None:
        super().__init__()
        if bn.running_mean is None or bn.running_var is None:
            raise ValueError("RobustBatchNorm: the BatchNorm has no running statistics to start from")
        if not 0 <= alpha <= 1:
            raise ValueError(f"RobustBatchNorm: alpha={alpha}; allowed: [0, 1]")
        c = bn.num_features
        self.weight = nn.Parameter(bn.weight.detach().clone() if bn.affine else torch.ones(c))
        self.bias = nn.Parameter(bn.bias.detach().clone() if bn.affine else torch.zeros(c))
        self.register_buffer("mean", bn.running_mean.detach().clone())
        self.register_buffer("var", bn.running_var.detach().clone())
        self.eps, self.alpha = bn.eps, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        if self.training:
            mean = (1 - self.alpha) * self.mean + self.alpha * x.mean(dims)  # (C,)
            var = (1 - self.alpha) * self.var + self.alpha * x.var(dims, unbiased=False)
            with torch.no_grad():
                self.mean.copy_(mean)
                self.var.copy_(var)
        else:
            mean, var = self.mean, self.var
        x = (x - mean.view(shape)) / torch.sqrt(var.view(shape) + self.eps)
        return x * self.weight.view(shape) + self.bias.view(shape)


def _replace_batchnorm(model: nn.Module, alpha: float) -> int:
    count = 0
    for name, child in list(model.named_children()):
        if isinstance(child, nn.modules.batchnorm._BatchNorm):
            setattr(model, name, RobustBatchNorm(child, alpha))
            count += 1
        else:
            count += _replace_batchnorm(child, alpha)
    return count


def _strong_augment(x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Per-image shifts up to 2 px, brightness/contrast jitter and Gaussian noise (images in [0, 1])."""
    out = torch.empty_like(x)
    shifts = torch.randint(-2, 3, (len(x), 2), generator=g)
    for i in range(len(x)):
        out[i] = torch.roll(x[i], shifts=(int(shifts[i, 0]), int(shifts[i, 1])), dims=(-2, -1))
    mean = out.mean(dim=tuple(range(1, x.dim())), keepdim=True)
    contrast = 1.0 + 0.4 * (torch.rand(mean.shape, generator=g) - 0.5)
    bright = 0.2 * (torch.rand(mean.shape, generator=g) - 0.5)
    out = (out - mean) * contrast + mean + bright
    return out + 0.03 * torch.randn(x.shape, generator=g)


class RoTTA(TTAMethod):
    """Robust BN, a category-balanced memory bank and a timeliness-weighted teacher-student (module docstring).

    Args:
        lr: Adam learning rate of the student. Default: 1e-3.
        betas: Adam's coefficients. Default: (0.9, 0.999).
        memory_size: bank capacity N. Default: 64.
        update_frequency: test samples between student updates. Default: 64.
        nu: EMA rate of the teacher. Default: 0.001.
        alpha: robust BN's weight of the batch statistics. Default: 0.05.
        lambda_t: weight of the age in the displacement score. Default: 1.0.
        lambda_u: weight of the uncertainty in the displacement score. Default: 1.0.
        seed: seed of the strong augmentations. Default: 0.
    """

    batch_stats = False  # robust BN replaces the batch statistics

    def __init__(self, lr: LearningRate = 1e-3, betas: tuple[float, float] = (0.9, 0.999), memory_size: int = 64,
                 update_frequency: int = 64, nu: float = 0.001, alpha: float = 0.05, lambda_t: float = 1.0,
                 lambda_u: float = 1.0, seed: int = 0) -> None:
        super().__init__(lr, betas)
        if memory_size < 1 or update_frequency < 1 or not 0 <= nu <= 1 or not 0 <= alpha <= 1:
            raise ValueError(f"RoTTA: memory_size={memory_size}, update_frequency={update_frequency}, nu={nu}, alpha={alpha}; "
                             "allowed: >= 1, >= 1, [0, 1], [0, 1]")
        self.memory_size, self.update_frequency, self.nu, self.alpha = memory_size, update_frequency, nu, alpha
        self.lambda_t, self.lambda_u = lambda_t, lambda_u
        self.generator = torch.Generator().manual_seed(seed)
        self.num_classes = 0
        self.bank: list[dict[str, Any]] = []  # each: x (C, H, W), label, uncertainty, age
        self.seen = 0

    def select_params(self, model: nn.Module) -> list[nn.Parameter]:
        params = [p for m in model.modules() if isinstance(m, (RobustBatchNorm, *_NORMS)) for p in (m.weight, m.bias)
                  if p is not None]
        if not params:
            raise ValueError(f"RoTTA: the model ({type(model).__name__}) has no norm layers to adapt")
        return params

    def setup(self, model: nn.Module, source_batches: Iterable[Any] | None = None) -> None:
        _replace_batchnorm(model, self.alpha)
        super().setup(model, source_batches)
        self.teacher = copy.deepcopy(model).requires_grad_(False)

    # -- the memory bank ---------------------------------------------------------------------------
    def _score(self, item: dict[str, Any]) -> float:
        return (self.lambda_t / (1 + math.exp(-item["age"] / self.memory_size))
                + self.lambda_u * item["uncertainty"] / math.log(self.num_classes))

    def _in_class_order(self) -> list[int]:
        """Indices of the bank in the published memory's order: by class, then by insertion."""
        return sorted(range(len(self.bank)), key=lambda i: self.bank[i]["label"])

    def _displace(self, classes: set[int], newcomer: float) -> bool:
        """Remove the highest-scoring instance of ``classes`` (the last of equal scores, in class order) if it scores
        above ``newcomer``; with no instance of ``classes`` there is nothing to displace and the newcomer enters."""
        best, best_score = None, -math.inf
        for i in self._in_class_order():
            if self.bank[i]["label"] in classes:
                s = self._score(self.bank[i])
                if s >= best_score:
                    best, best_score = i, s
        if best is None:
            return True
        if best_score <= newcomer:
            return False
        self.bank.pop(best)
        return True

    def insert(self, x: torch.Tensor, label: int, uncertainty: float) -> bool:
        """Offer one sample to the bank (CSTU); returns whether it was stored. The newcomer is scored at age 0; after
        the offer every stored instance ages by one, the newcomer included."""
        new = {"x": x, "label": int(label), "uncertainty": float(uncertainty), "age": 0}
        share = self.memory_size / self.num_classes
        counts: dict[int, int] = {}
        for item in self.bank:
            counts[item["label"]] = counts.get(item["label"], 0) + 1
        if counts.get(new["label"], 0) < share:
            if len(self.bank) < self.memory_size:
                ok = True
            else:
                top = max(counts.values())
                ok = self._displace({c for c, n in counts.items() if n == top}, self._score(new))
        else:
            ok = self._displace({new["label"]}, self._score(new))
        if ok:
            self.bank.append(new)
        for item in self.bank:
            item["age"] += 1
        return ok

    def memory(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored images ``(M, C, H, W)`` and their ages ``(M,)``, in class order, then insertion order."""
        order = self._in_class_order()
        return (torch.stack([self.bank[i]["x"] for i in order]),
                torch.tensor([float(self.bank[i]["age"]) for i in order]))

    def _update_student(self) -> None:
        assert self.model is not None and self.optimizer is not None
        xs, ages = self.memory()  # (M, C, H, W), (M,)
        weight = torch.exp(-ages / self.memory_size) / (1 + torch.exp(-ages / self.memory_size))  # timeliness
        self.model.train()
        self.teacher.train()  # robust BN: the statistics follow the bank, never the test stream
        try:
            with torch.no_grad():
                target = self.teacher(xs).softmax(dim=1)
            with torch.enable_grad():
                student = self.model(_strong_augment(xs, self.generator))
                loss = (-(target * student.log_softmax(dim=1)).sum(dim=1) * weight).mean()
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
        finally:
            self.model.eval()
            self.teacher.eval()
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.model.parameters(), strict=True):
                t.mul_(1 - self.nu).add_(s, alpha=self.nu)

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        self.teacher.eval()
        with torch.no_grad():
            return self.teacher(x)

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "call setup() first"
        self.model.eval()
        self.teacher.eval()
        with torch.no_grad():
            logits = self.teacher(x)  # (B, C); eval mode: the robust BN statistics stay where the bank put them
            p = logits.softmax(dim=1)
            unc = -(p * (p + 1e-6).log()).sum(dim=1)  # the published uncertainty
        self.num_classes = logits.shape[1]
        labels = logits.argmax(dim=1)
        for i in range(len(x)):
            self.insert(x[i].detach().clone(), int(labels[i]), float(unc[i]))
            self.seen += 1
            if self.seen % self.update_frequency == 0 and self.bank:
                self._update_student()
        return logits

    # -- state ---------------------------------------------------------------------------------------
    @staticmethod
    def _robust_stats(model: nn.Module) -> list[torch.Tensor]:
        """The global statistics buffers of every :class:`RobustBatchNorm` of ``model``, in order."""
        return [b for m in model.modules() if isinstance(m, RobustBatchNorm) for b in (m.mean, m.var)]

    def _stats(self, model: nn.Module) -> list[torch.Tensor]:
        return [b.detach().clone() for b in self._robust_stats(model)]

    def _load_stats(self, model: nn.Module, values: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for b, v in zip(self._robust_stats(model), values, strict=True):
                b.copy_(v)

    def extra_state(self) -> dict[str, Any]:
        if self.model is None:
            return {}
        bank = [{"x": i["x"], "label": i["label"], "uncertainty": i["uncertainty"], "age": i["age"]} for i in self.bank]
        return {"teacher": [p.detach().clone() for p in self.teacher.parameters()], "teacher_stats": self._stats(self.teacher),
                "student_stats": self._stats(self.model), "bank": bank, "seen": self.seen, "num_classes": self.num_classes,
                "generator": self.generator.get_state()}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if not state:
            return
        with torch.no_grad():
            for p, v in zip(self.teacher.parameters(), state["teacher"], strict=True):
                p.copy_(v)
        assert self.model is not None
        self._load_stats(self.teacher, state["teacher_stats"])
        self._load_stats(self.model, state["student_stats"])
        self.bank = [dict(i) for i in state["bank"]]
        self.seen, self.num_classes = int(state["seen"]), int(state["num_classes"])
        self.generator.set_state(state["generator"])


def knn_affinity(features: torch.Tensor, k: int) -> torch.Tensor:
    """``(N, D) -> (N, N)``: ``W_ij = 1`` when ``j`` is one of the ``k`` nearest neighbours of ``i`` by cosine
    similarity (``i`` itself excluded), else 0."""
    f = F.normalize(features, dim=1)
    sim = f @ f.T
    sim.fill_diagonal_(-math.inf)
    k = min(k, len(f) - 1)
    w = torch.zeros_like(sim)
    if k > 0:
        w.scatter_(1, sim.topk(k, dim=1).indices, 1.0)
    return w


def rbf_affinity(features: torch.Tensor, k: int) -> torch.Tensor:
    """``(N, D) -> (N, N)``: ``W_ij = exp(-||f_i - f_j||^2 / (2 sigma^2))`` on the L2-normalised features, sigma the
    mean over ``i`` of the distance from ``f_i`` to its ``k``-th nearest point, ``f_i`` itself counted first (LAME's
    public code). The diagonal is 1. With every such distance 0 (e.g. one sample) sigma is taken as 1e-12: identical
    points get 1, distinct ones 0."""
    f = F.normalize(features, dim=1)
    dist = torch.cdist(f, f)  # (N, N)
    kth = dist.topk(min(k, len(f)), dim=1, largest=False).values[:, -1]  # (N,)
    sigma = kth.mean().clamp_min(1e-12)
    return torch.exp(-dist.pow(2) / (2 * sigma**2))


def linear_affinity(features: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """``(N, D) -> (N, N)``: ``W = F F^T`` of the L2-normalised features (cosine similarities, diagonal 1); ``k`` is
    unused (the signature of the other affinities)."""
    f = F.normalize(features, dim=1)
    return f @ f.T


#: LAME's affinities by name: ``features (N, D), k -> W (N, N)``
AFFINITIES = {"rbf": rbf_affinity, "knn": knn_affinity, "linear": linear_affinity}


def laplacian_adjust(probs: torch.Tensor, affinity: torch.Tensor, max_iter: int = 100, tol: float = 1e-8) -> torch.Tensor:
    """LAME's assignments: minimise ``sum_i KL(z_i || y_i) - sum_ij W_ij z_i . z_j`` over the simplex by the bound
    updates ``z_i <- softmax(log y_i + sum_j W_ij z_j)`` from ``z = y``; stop when the objective changes by at most
    ``tol`` relative. ``probs (N, C)``, ``affinity (N, N)`` -> ``(N, C)``."""
    log_y = probs.clamp_min(1e-30).log()
    z = probs.clone()

    def energy(z: torch.Tensor) -> float:
        return float((z * (z.clamp_min(1e-30).log() - log_y)).sum() - (z * (affinity @ z)).sum())

    prev = energy(z)
    for _ in range(max_iter):
        z = (log_y + affinity @ z).softmax(dim=1)
        e = energy(z)
        if abs(e - prev) <= tol * max(abs(prev), 1e-30):
            break
        prev = e
    return z


class LAME(TTAMethod):
    """Laplacian-adjusted maximum-likelihood estimation of the frozen model's outputs (module docstring).

    Args:
        affinity: ``"rbf"`` (the published default), ``"knn"`` or ``"linear"``.
        knn: the neighbour count of the affinity (rbf: whose distance sets sigma; knn: the neighbours linked).
            Default: 5.
        max_iter: bound updates at most. Default: 100.
        tol: relative change of the objective that stops the updates. Default: 1e-8.
    """

    adapts = False
    batch_stats = False  # the source model's statistics: LAME changes outputs only

    def __init__(self, affinity: Literal["rbf", "knn", "linear"] = "rbf", knn: int = 5, max_iter: int = 100,
                 tol: float = 1e-8) -> None:
        super().__init__()
        if affinity not in AFFINITIES:
            raise ValueError(f"LAME: affinity={affinity!r}; allowed: {', '.join(AFFINITIES)}")
        if knn < 1 or max_iter < 1 or tol < 0:
            raise ValueError(f"LAME: knn={knn}, max_iter={max_iter}, tol={tol}; allowed: >= 1, >= 1, >= 0")
        self.affinity, self.knn, self.max_iter, self.tol = affinity, knn, max_iter, tol
        self._features: torch.Tensor | None = None

    def setup(self, model: nn.Module, source_batches: Iterable[Any] | None = None) -> None:
        super().setup(model, source_batches)
        heads = [m for m in model.modules() if isinstance(m, nn.Linear)]
        if not heads:
            raise ValueError(f"LAME: the model ({type(model).__name__}) has no nn.Linear head whose input are the features")

        def grab(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
            self._features = inputs[0].detach().flatten(1)

        heads[-1].register_forward_hook(grab)

    def loss(self, logits: torch.Tensor, x: torch.Tensor) -> None:
        return None

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """The adjusted output: LAME adapts outputs only, so predicting is all it does (a plug-in that predicts
        through its copies, such as ReservoirTTA's ensemble, gets the adjustment too)."""
        logits = super().predict(x)  # (B, C), the frozen model's
        assert self._features is not None
        w = AFFINITIES[self.affinity](self._features, self.knn)  # (B, B)
        z = laplacian_adjust(logits.softmax(dim=1), w, self.max_iter, self.tol)
        return z.clamp_min(1e-30).log()  # logits whose softmax is z

    def forward_and_adapt(self, x: torch.Tensor) -> torch.Tensor:
        return self.predict(x)
