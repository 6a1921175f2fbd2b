"""Noise-prediction denoisers behind one interface: ``eps(x, t)`` and ``pmp(x, t)`` for images ``(B, C, H, W)``.

Variance-preserving diffusion ``x_t = sqrt(abar_t) x_0 + sqrt(1 - abar_t) eps``; the posterior-mean predictor
(PMP) is ``f_t(x) = E[x_0 | x_t = x] = (x - sqrt(1 - abar_t) eps(x, t)) / sqrt(abar_t)``.

* :class:`GaussianPMP`: data ``N(mu, Sigma)``; ``f_t(x) = mu + sqrt(abar) Sigma (abar Sigma + (1 - abar) I)^-1 (x - sqrt(abar) mu)``
  in closed form (linear in x, Jacobian = that matrix).
* :class:`MixtureLowRankGaussianPMP` (MoLRG): data = a mixture of K low-rank Gaussians ``N(mu_k, U_k diag(s_k) U_k^T
  + delta I)`` (fitted per class of scikit-learn's digits: top-``rank`` PCA + ``delta``); the exact PMP is the
  responsibility-weighted mix of the per-component Gaussian PMPs, responsibilities = softmax of the components'
  log-likelihoods of ``x_t``. Computed in float64 through the eigen-structure (no d x d inverses per call).
* :class:`UNetEps`: a ``diffusers`` ``UNet2DModel`` (trained with :class:`DiffusionTrainer` by ``lowrank fit``).

:func:`linear_alphas_cumprod` gives the schedule (linear beta 1e-4 .. 0.02, T = 1000).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import nn

from lowrank_lit.checkpoint import load_checkpoint
from lowrank_lit.hub import from_pretrained
from lowrank_lit.sharding import Shardable

__all__ = ["linear_alphas_cumprod", "GaussianPMP", "MixtureLowRankGaussianPMP", "UNetEps", "DiffusionTrainer", "digits_images",
           "DigitsMoLRG", "DigitsGaussianPMP", "TrainedUNetEps", "StableDiffusionEps"]


def linear_alphas_cumprod(T: int = 1000, beta_start: float = 1e-4, beta_end: float = 0.02) -> torch.Tensor:
    """``abar_t = prod_{s <= t} (1 - beta_s)`` for a linear beta schedule, ``(T,)`` float64."""
    if T < 2 or not 0 < beta_start < beta_end < 1:
        raise ValueError(f"linear_alphas_cumprod: T={T}, beta_start={beta_start}, beta_end={beta_end}; allowed: T >= 2, "
                         "0 < beta_start < beta_end < 1")
    return torch.cumprod(1 - torch.linspace(beta_start, beta_end, T, dtype=torch.float64), 0)


def digits_images(size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's digits in [-1, 1], bilinearly resized to ``size`` x ``size``: ``(1797, 1, size, size)``, labels."""
    from sklearn.datasets import load_digits

    b = load_digits()
    x = torch.as_tensor(b.images, dtype=torch.float32)[:, None] / 16.0
    if size != 8:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x * 2 - 1, torch.as_tensor(b.target)


def _abar(alphas_cumprod: torch.Tensor, t: int | torch.Tensor) -> float:
    return float(alphas_cumprod[int(t)])


class _PMPBase(nn.Module):
    """eps from the PMP: ``eps = (x - sqrt(abar) f) / sqrt(1 - abar)``."""

    shape: tuple[int, int, int]

    def pmp_flat(self, x: torch.Tensor, abar: float) -> torch.Tensor:
        raise NotImplementedError

    def pmp(self, x: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        a = _abar(self.alphas_cumprod, t)
        flat = x.reshape(x.shape[0], -1).to(torch.float64)
        return self.pmp_flat(flat, a).to(x.dtype).view_as(x)

    def eps(self, x: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        a = _abar(self.alphas_cumprod, t)
        return (x - math.sqrt(a) * self.pmp(x, t)) / math.sqrt(1 - a)

    def forward(self, x: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        return self.eps(x, t)


def _moments(images: torch.Tensor, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(d,)`` and covariance + ``ridge`` I ``(d, d)`` of flattened images, float64."""
    flat = images.flatten(1).to(torch.float64)
    return flat.mean(0), torch.cov(flat.T) + ridge * torch.eye(flat.shape[1], dtype=torch.float64)


class GaussianPMP(_PMPBase):
    """Exact PMP of Gaussian data ``N(mu, Sigma)`` (see the module docstring).

    Args:
        mean: ``(d,)``.
        cov: ``(d, d)`` symmetric positive semi-definite.
        shape: image shape ``(C, H, W)`` with ``C H W = d``.
        alphas_cumprod: ``(T,)`` schedule. Default: :func:`linear_alphas_cumprod`.
    """

    def __init__(self, mean: torch.Tensor, cov: torch.Tensor, shape: tuple[int, int, int],
                 alphas_cumprod: torch.Tensor | None = None) -> None:
        super().__init__()
        d = mean.numel()
        if cov.shape != (d, d) or math.prod(shape) != d:
            raise ValueError(f"GaussianPMP: mean {tuple(mean.shape)}, cov {tuple(cov.shape)}, shape {shape}; allowed: (d,), (d, d), C H W = d")
        evals, evecs = torch.linalg.eigh(cov.to(torch.float64))
        self.register_buffer("mean", mean.to(torch.float64).flatten())
        self.register_buffer("evals", evals.clamp_min(0))
        self.register_buffer("evecs", evecs)
        self.register_buffer("alphas_cumprod", (alphas_cumprod if alphas_cumprod is not None else linear_alphas_cumprod()).to(torch.float64))
        self.shape = tuple(shape)

    @classmethod
    def fit(cls, images: torch.Tensor, alphas_cumprod: torch.Tensor | None = None, ridge: float = 1e-3) -> GaussianPMP:
        return cls(*_moments(images, ridge), tuple(images.shape[1:]), alphas_cumprod)

    def gain(self, abar: float) -> torch.Tensor:
        """``sqrt(abar) Sigma (abar Sigma + (1 - abar) I)^-1`` = the Jacobian of the PMP, ``(d, d)``."""
        g = math.sqrt(abar) * self.evals / (abar * self.evals + 1 - abar)
        return (self.evecs * g) @ self.evecs.T

    def pmp_flat(self, x: torch.Tensor, abar: float) -> torch.Tensor:
        return self.mean + (x - math.sqrt(abar) * self.mean) @ self.gain(abar).T


class MixtureLowRankGaussianPMP(_PMPBase):
    """Exact PMP of a mixture of low-rank Gaussians (see the module docstring).

    Args:
        means: ``(K, d)``.
        bases: ``(K, d, r)`` orthonormal columns.
        variances: ``(K, r)`` variances along the bases.
        weights: ``(K,)`` mixture weights.
        shape: image shape ``(C, H, W)``.
        delta: isotropic variance added to every component. Default: 1e-3.
        alphas_cumprod: ``(T,)`` schedule. Default: :func:`linear_alphas_cumprod`.
    """

    def __init__(self, means: torch.Tensor, bases: torch.Tensor, variances: torch.Tensor, weights: torch.Tensor,
                 shape: tuple[int, int, int], delta: float = 1e-3, alphas_cumprod: torch.Tensor | None = None) -> None:
        super().__init__()
        K, d = means.shape
        if bases.shape[:2] != (K, d) or variances.shape != (K, bases.shape[2]) or weights.shape != (K,) or math.prod(shape) != d:
            raise ValueError("MixtureLowRankGaussianPMP: means (K, d), bases (K, d, r), variances (K, r), weights (K,) "
                             f"and C H W = d expected; got {tuple(means.shape)}, {tuple(bases.shape)}, {tuple(variances.shape)}, "
                             f"{tuple(weights.shape)}, {shape}")
        if delta <= 0:
            raise ValueError(f"MixtureLowRankGaussianPMP: delta={delta!r}; allowed: > 0")
        f64 = torch.float64
        self.register_buffer("means", means.to(f64))
        self.register_buffer("bases", bases.to(f64))
        self.register_buffer("variances", variances.to(f64).clamp_min(0))
        self.register_buffer("log_weights", torch.log(weights.to(f64) / weights.sum()))
        self.register_buffer("alphas_cumprod", (alphas_cumprod if alphas_cumprod is not None else linear_alphas_cumprod()).to(f64))
        self.delta, self.shape = float(delta), tuple(shape)

    @classmethod
    def fit(cls, images: torch.Tensor, labels: torch.Tensor, rank: int = 12, delta: float = 1e-3,
            alphas_cumprod: torch.Tensor | None = None) -> MixtureLowRankGaussianPMP:
        """One component per label: its mean, top-``rank`` principal directions and variances, its frequency."""
        flat = images.flatten(1).to(torch.float64)
        means, bases, variances, weights = [], [], [], []
        for k in sorted(set(labels.tolist())):
            xk = flat[labels == k]
            mu = xk.mean(0)
            _, s, vh = torch.linalg.svd(xk - mu, full_matrices=False)
            means.append(mu)
            bases.append(vh[:rank].T)
            variances.append(s[:rank] ** 2 / max(len(xk) - 1, 1))
            weights.append(float(len(xk)))
        return cls(torch.stack(means), torch.stack(bases), torch.stack(variances), torch.tensor(weights), tuple(images.shape[1:]),
                   delta, alphas_cumprod)

    def responsibilities(self, x: torch.Tensor, abar: float) -> torch.Tensor:
        """``(B, K)`` posterior component probabilities of ``x_t = x`` (flattened, float64)."""
        return torch.softmax(self._parts(x, abar)[0], dim=1)

    def _parts(self, x: torch.Tensor, abar: float) -> tuple[torch.Tensor, torch.Tensor]:
        d = x.shape[1]
        c = abar * self.delta + 1 - abar  # variance off the subspace
        lam = abar * self.variances + c  # (K, r) variances along the bases
        r = x[:, None, :] - math.sqrt(abar) * self.means[None]  # (B, K, d)
        proj = torch.einsum("bkd,kdr->bkr", r, self.bases)  # (B, K, r)
        quad = (r * r).sum(-1) / c - (proj**2 * (1 / c - 1 / lam)[None]).sum(-1)  # r^T Cov^-1 r
        logdet = torch.log(lam).sum(-1) + (d - lam.shape[1]) * math.log(c)  # (K,)
        loglik = self.log_weights[None] - 0.5 * (quad + logdet[None])  # (B, K)
        # per-component PMP: mu_k + sqrt(abar) Sigma_k Cov_k^-1 r
        g_off = math.sqrt(abar) * self.delta / c
        g_on = math.sqrt(abar) * (self.variances + self.delta) / lam  # (K, r)
        post = self.means[None] + g_off * r + torch.einsum("kdr,bkr->bkd", self.bases, (g_on - g_off)[None] * proj)
        return loglik, post

    def pmp_flat(self, x: torch.Tensor, abar: float) -> torch.Tensor:
        loglik, post = self._parts(x, abar)
        w = torch.softmax(loglik, dim=1)  # (B, K)
        return (w[..., None] * post).sum(1)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        """The most probable component of clean images ``x`` (the mixture's Bayes classifier at t = 0)."""
        return self.responsibilities(x.reshape(x.shape[0], -1).to(torch.float64), _abar(self.alphas_cumprod, 0)).argmax(1)


class _EpsNetwork(nn.Module):
    """A network predicting eps: the PMP follows as ``f_t(x) = (x - sqrt(1 - abar) eps(x, t)) / sqrt(abar)``."""

    alphas_cumprod: torch.Tensor

    def eps(self, x: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pmp(self, x: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        a = _abar(self.alphas_cumprod, t)
        return (x - math.sqrt(1 - a) * self.eps(x, t)) / math.sqrt(a)

    def forward(self, x: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        return self.eps(x, t)


class UNetEps(_EpsNetwork):
    """A ``diffusers`` ``UNet2DModel`` predicting eps (1 channel, 16 px, blocks (32, 64) by default).

    Args:
        sample_size: image side. Default: 16.
        channels: image channels. Default: 1.
        block_out_channels: widths per resolution. Default: (32, 64).
    """

    def __init__(self, sample_size: int = 16, channels: int = 1, block_out_channels: tuple[int, ...] = (32, 64)) -> None:
        super().__init__()
        from diffusers import UNet2DModel

        n = len(block_out_channels)
        self.unet = UNet2DModel(sample_size=sample_size, in_channels=channels, out_channels=channels, layers_per_block=1,
                                block_out_channels=tuple(block_out_channels), down_block_types=("DownBlock2D",) * n,
                                up_block_types=("UpBlock2D",) * n, norm_num_groups=8)
        self.register_buffer("alphas_cumprod", linear_alphas_cumprod(), persistent=False)
        self.shape = (channels, sample_size, sample_size)

    def eps(self, x: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        tt = torch.as_tensor(t, device=x.device).expand(x.shape[0]) if torch.as_tensor(t).ndim == 0 else t
        return self.unet(x, tt).sample



def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class DiffusionTrainer(Shardable, pl.LightningModule):
    """Trains an eps-prediction network with ``|| eps - eps_theta(sqrt(abar) x_0 + sqrt(1 - abar) eps, t) ||^2``,
    t uniform in 0..T-1. Logs ``train/loss`` and ``val/loss``; batches ``(x_0, ...)`` in [-1, 1].

    Args:
        model: the eps network (:class:`UNetEps`).
        optimizer: optimizer factory. Default: AdamW lr 1e-3.
        from_unit: the batches are in [0, 1] (``DigitsDataModule(normalize=False)``); map them to [-1, 1]. Default: True.
    """

    def __init__(self, model: nn.Module, optimizer: OptimizerCallable = _default_optimizer, from_unit: bool = True) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "optimizer"], logger=False)
        self.model, self.optimizer_factory, self.from_unit = model, optimizer, from_unit

    def _loss(self, x0: torch.Tensor) -> torch.Tensor:
        x0 = x0 * 2 - 1 if self.from_unit else x0
        ac = self.model.alphas_cumprod.to(x0.device)
        t = torch.randint(0, len(ac), (x0.shape[0],), device=x0.device)
        a = ac[t].to(x0.dtype).view(-1, 1, 1, 1)
        noise = torch.randn_like(x0)
        return F.mse_loss(self.model.eps(a.sqrt() * x0 + (1 - a).sqrt() * noise, t), noise)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch[0])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch[0]), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.model.parameters())


class DigitsMoLRG(MixtureLowRankGaussianPMP):
    """:class:`MixtureLowRankGaussianPMP` fitted to scikit-learn's digits (one component per class).

    Args:
        size: image side (bilinear resize of the 8 x 8 digits). Default: 16.
        rank: principal directions per class. Default: 12.
        delta: isotropic variance. Default: 1e-3.
    """

    def __init__(self, size: int = 16, rank: int = 12, delta: float = 1e-3) -> None:
        x, y = digits_images(size)
        fitted = MixtureLowRankGaussianPMP.fit(x, y, rank, delta)
        super().__init__(fitted.means, fitted.bases, fitted.variances, fitted.log_weights.exp(), fitted.shape, delta)


class DigitsGaussianPMP(GaussianPMP):
    """:class:`GaussianPMP` fitted to scikit-learn's digits (mean and covariance + ``ridge`` I).

    Args:
        size: image side. Default: 16.
        ridge: added to the covariance diagonal. Default: 1e-3.
    """

    def __init__(self, size: int = 16, ridge: float = 1e-3) -> None:
        x, _ = digits_images(size)
        super().__init__(*_moments(x, ridge), tuple(x.shape[1:]))


class TrainedUNetEps(UNetEps):
    """:class:`UNetEps` with the weights of a :class:`DiffusionTrainer` checkpoint (``lowrank fit`` run).

    Args:
        ckpt: the checkpoint file; None: random weights (smoke tests). Default: None.
        sample_size, channels, block_out_channels: as :class:`UNetEps` (must match the trained model).
    """

    def __init__(self, ckpt: str | None = None, sample_size: int = 16, channels: int = 1,
                 block_out_channels: tuple[int, ...] = (32, 64)) -> None:
        super().__init__(sample_size, channels, block_out_channels)
        if ckpt is not None:
            import os

            if not os.path.isfile(ckpt):
                raise FileNotFoundError(f"TrainedUNetEps: ckpt={ckpt!r} does not exist (train it with configs/shallow_diffuse/unet_digits_train.yaml)")
            state = load_checkpoint(ckpt, "TrainedUNetEps: ckpt")["state_dict"]
            self.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})
        self.eval().requires_grad_(False)


class StableDiffusionEps(_EpsNetwork):
    """Stable Diffusion's latent UNet as an eps model with a fixed text condition (empty prompt by default), from a
    local ``diffusers`` folder (nothing is downloaded). Images are the 4 x (res/8) x (res/8) latents.

    Args:
        model_dir: a local Stable Diffusion 2.1(-base) folder (``unet/``, ``text_encoder/``, ``tokenizer/``, ``scheduler/``).
        prompt: the text condition of every eps call (the paper inverts with the empty prompt). Default: "".
        resolution: image side in pixels. Default: 512.
        dtype: ``float16`` or ``float32`` for the UNet. Default: float16.
    """

    def __init__(self, model_dir: str, prompt: str = "", resolution: int = 512, dtype: str = "float16") -> None:
        super().__init__()
        import os

        if not os.path.isdir(model_dir):
            raise FileNotFoundError(f"StableDiffusionEps: model_dir={model_dir!r} is not a local diffusers folder")
        from diffusers import DDIMScheduler, UNet2DConditionModel
        from transformers import CLIPTextModel, CLIPTokenizer

        dt = getattr(torch, dtype)
        self.unet = from_pretrained(UNet2DConditionModel, model_dir, subfolder="unet", torch_dtype=dt, local_files_only=True)
        tok = CLIPTokenizer.from_pretrained(model_dir, subfolder="tokenizer", local_files_only=True)
        enc = from_pretrained(CLIPTextModel, model_dir, subfolder="text_encoder", local_files_only=True)
        ids = tok([prompt], padding="max_length", max_length=tok.model_max_length, return_tensors="pt").input_ids
        with torch.no_grad():
            self.register_buffer("cond", enc(ids)[0].to(dt))
        sched = DDIMScheduler.from_pretrained(model_dir, subfolder="scheduler", local_files_only=True)
        self.register_buffer("alphas_cumprod", sched.alphas_cumprod.to(torch.float64))
        self.shape = (4, resolution // 8, resolution // 8)
        self.requires_grad_(False)

    def eps(self, x: torch.Tensor, t: int | torch.Tensor) -> torch.Tensor:
        cond = self.cond.to(x.device).expand(x.shape[0], -1, -1)
        out = self.unet(x.to(self.cond.dtype), torch.as_tensor(t, device=x.device), encoder_hidden_states=cond).sample
        return out.to(x.dtype)
