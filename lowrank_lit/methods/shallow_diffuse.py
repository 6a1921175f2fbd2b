"""Shallow Diffuse: a watermark written into x_{t*} at a mid timestep, in the null space of the PMP Jacobian.

Li, Zhang, Qu, NeurIPS 2025 (arXiv 2410.21088). Official code: github.com/liwd190019/Shallow-Diffuse.

Instead of writing a key into the initial noise x_T (Tree-Ring), Shallow Diffuse writes it into ``x_{t*}`` at
``t* = 0.3 T``, where the posterior-mean predictor ``f_t(x) = E[x_0 | x_t]`` is locally linear with a low-rank
Jacobian: a generic key lies mostly in its null space, so the predicted clean image barely moves while the key
rides the DDIM noise term and comes back under DDIM inversion.

* :class:`DDIMSampler`: our own deterministic DDIM on the grid ``{0, T/S, 2T/S, ...}`` (S steps; state ``j`` sits at
  timestep ``j T / S``, the image is state 0 at ``abar_0``, not 1): ``x_s = sqrt(abar_s) f_t(x_t) + sqrt(1 - abar_s)
  eps(x_t, t)``; inversion ``s -> t`` uses the same formula with ``eps(x_s, t)`` (the current state, the target
  timestep), as the official code. ``sample`` / ``invert`` run between any two state indices.
* :class:`RingKey`: Fourier-space key of one channel. High-frequency (Shallow Diffuse): FFT without fftshift,
  a disk of radius R around ``(n/2, n/2)`` (the highest frequencies; centred exactly there so that the mask is
  symmetric under k -> -k; the official code's centre row is n/2 - 1 from a y-flip). Low-frequency (Tree-Ring):
  the fftshifted spectrum, the disk around DC. The key is the FFT of an ``N(0, I)`` array from a fixed generator
  state, with every ring of radius i = R..1 filled by one value (``W[0, i]``): constant-valued concentric rings.
  ``inject`` replaces the masked coefficients, ``distance`` is their mean absolute difference to the key,
  ``p_value`` the non-central chi-square test of the official code.
* :class:`ShallowDiffuse`: ``embed_server(x_T)`` (sample to t*, inject, sample to 0; channel averaging copies
  the other channels from the unwatermarked image when there are several), ``embed_user(x_0)`` (invert to t*,
  inject, sample back), ``detect(x_0)`` (invert to t*, score = -distance, and the p-value). Embedding stamps the
  step grid and t* into the key's metadata; detecting with a different grid or t* is refused. :func:`tree_ring` = the low-frequency
  key at ``t_frac = 1`` (x_T) without channel averaging.
* Analysis: :func:`pmp_jacobian` (``torch.func.jacrev``), :func:`rank_ratio`, :func:`null_space_fraction`.
* Attacks (:data:`ATTACKS`): 8-bit quantisation, Gaussian noise (0.01, 0.05), JPEG (Pillow, quality 75), 3x3 box
  blur, crop 75 % and resize back.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lowrank_lit.registry import register_method
from lowrank_lit.report import (
    artifact_path,
    log_image,
    markdown_table,
    may_write,
    mean_std,
    new_figure,
    read_runs,
    save_figure,
    save_rows,
)

__all__ = ["DDIMSampler", "RingKey", "ShallowDiffuse", "tree_ring", "pmp_jacobian", "rank_ratio", "null_space_fraction",
           "ATTACKS", "attack", "psnr", "NoiseDataModule", "ShallowDiffuseEval", "summary"]


class DDIMSampler:
    """Deterministic DDIM sampling and inversion (see the module docstring).

    Args:
        eps_model: a denoiser with ``eps(x, t)`` (:mod:`lowrank_lit.models.denoisers`).
        alphas_cumprod: ``(T,)``, decreasing in (0, 1].
        steps: DDIM steps S (T divisible by S). Default: 50.
    """

    def __init__(self, eps_model: Any, alphas_cumprod: torch.Tensor, steps: int = 50) -> None:
        ac = torch.as_tensor(alphas_cumprod, dtype=torch.float64)
        if ac.ndim != 1 or len(ac) < 2 or not bool((ac > 0).all() and (ac <= 1).all() and (ac[1:] < ac[:-1]).all()):
            raise ValueError("DDIMSampler: alphas_cumprod must be a 1-D sequence decreasing in (0, 1]")
        if not isinstance(steps, int) or steps < 1 or len(ac) % steps:
            raise ValueError(f"DDIMSampler: steps={steps!r}; allowed: a divisor of T={len(ac)}")
        self.eps_model, self.alphas_cumprod, self.steps = eps_model, ac, steps
        self.grid = tuple(range(0, len(ac), len(ac) // steps))  # timestep of state j

    def abar(self, j: int) -> float:
        return float(self.alphas_cumprod[self.grid[j]])

    def _move(self, x: torch.Tensor, a_from: float, a_to: float, eps: torch.Tensor) -> torch.Tensor:
        x0 = (x - math.sqrt(1 - a_from) * eps) / math.sqrt(a_from)
        return math.sqrt(a_to) * x0 + math.sqrt(1 - a_to) * eps

    def _check(self, i_from: int, i_to: int) -> None:
        for name, v in (("i_from", i_from), ("i_to", i_to)):
            if not 0 <= v < self.steps:
                raise ValueError(f"DDIMSampler: {name}={v}; allowed: 0..{self.steps - 1}")

    @torch.no_grad()
    def sample(self, x: torch.Tensor, i_from: int | None = None, i_to: int = 0) -> torch.Tensor:
        """Denoise from state ``i_from`` (default: the last, x_T) down to ``i_to``."""
        i_from = self.steps - 1 if i_from is None else i_from
        self._check(i_from, i_to)
        if i_to > i_from:
            raise ValueError(f"DDIMSampler.sample: i_to={i_to} > i_from={i_from}; sampling goes down")
        for j in range(i_from, i_to, -1):
            x = self._move(x, self.abar(j), self.abar(j - 1), self.eps_model.eps(x, self.grid[j]))
        return x

    @torch.no_grad()
    def invert(self, x: torch.Tensor, i_from: int = 0, i_to: int | None = None) -> torch.Tensor:
        """DDIM inversion from state ``i_from`` (default: the image) up to ``i_to`` (default: x_T)."""
        i_to = self.steps - 1 if i_to is None else i_to
        self._check(i_from, i_to)
        if i_to < i_from:
            raise ValueError(f"DDIMSampler.invert: i_to={i_to} < i_from={i_from}; inversion goes up")
        for j in range(i_from, i_to):
            x = self._move(x, self.abar(j), self.abar(j + 1), self.eps_model.eps(x, self.grid[j + 1]))
        return x


class RingKey:
    """A ring-shaped Fourier key on one channel (see the module docstring).

    Args:
        res: image side n (square).
        radius: ring radius R, 1 .. n/2 - 1.
        channel: the keyed channel. Default: 0.
        high_freq: True: unshifted spectrum around (n/2, n/2) (Shallow Diffuse); False: fftshifted, around DC (Tree-Ring).
            Default: True.
        key_rng: generator seed of the key. Default: 42.
    """

    def __init__(self, res: int, radius: int, channel: int = 0, high_freq: bool = True, key_rng: int = 42) -> None:
        if not isinstance(radius, int) or not 0 < radius < res / 2:
            raise ValueError(f"RingKey: radius={radius!r}; allowed: an integer in 1..{math.ceil(res / 2) - 1} (res={res})")
        if channel < 0:
            raise ValueError(f"RingKey: channel={channel!r}; allowed: >= 0")
        self.res, self.radius, self.channel, self.high_freq, self.key_rng = res, radius, channel, high_freq, key_rng
        yy, xx = torch.meshgrid(torch.arange(res), torch.arange(res), indexing="ij")
        c = res // 2
        dist2 = (yy - c) ** 2 + (xx - c) ** 2
        self.mask = dist2 <= radius**2  # (n, n), in the key's own (shifted or not) frame
        if not bool(self.mask.any()):
            raise ValueError("RingKey: empty mask")
        g = torch.Generator().manual_seed(key_rng)
        w = torch.fft.fft2(torch.randn(res, res, generator=g, dtype=torch.float64))
        if not high_freq:
            w = torch.fft.fftshift(w)
        key = w.clone()
        for i in range(radius, 0, -1):  # rings: the disk of radius i takes the single value w[0, i]
            key[dist2 <= i * i] = w[0, i]
        self.key = key
        self.meta: dict[str, Any] = {}

    def spectrum(self, x: torch.Tensor) -> torch.Tensor:
        """FFT of the keyed channel of ``x`` ``(B, C, n, n)``, shifted for the low-frequency key: ``(B, n, n)`` complex."""
        self._check(x)
        f = torch.fft.fft2(x[:, self.channel].to(torch.float64))
        return f if self.high_freq else torch.fft.fftshift(f, dim=(-2, -1))

    def _check(self, x: torch.Tensor) -> None:
        if x.ndim != 4 or x.shape[-1] != x.shape[-2]:
            raise ValueError(f"RingKey: x of shape {tuple(x.shape)}; allowed: (B, C, n, n), square")
        if x.shape[-1] != self.res:
            raise ValueError(f"RingKey: x side {x.shape[-1]} differs from the key's res={self.res}")
        if not 0 <= self.channel < x.shape[1]:
            raise ValueError(f"RingKey: channel={self.channel}; allowed: 0..{x.shape[1] - 1} for {x.shape[1]} channels")

    def inject(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with the masked Fourier coefficients of the keyed channel replaced by the key (real part kept)."""
        f = self.spectrum(x)
        f[:, self.mask] = self.key[self.mask]
        if not self.high_freq:
            f = torch.fft.ifftshift(f, dim=(-2, -1))
        out = x.clone()
        out[:, self.channel] = torch.fft.ifft2(f).real.to(x.dtype)
        return out

    def distance(self, x: torch.Tensor) -> torch.Tensor:
        """Mean ``|F[M] - W[M]|`` per image, ``(B,)``."""
        return (self.spectrum(x)[:, self.mask] - self.key[self.mask]).abs().mean(1)

    def p_value(self, x: torch.Tensor) -> torch.Tensor:
        """Non-central chi-square p-value per image (small: watermarked), as the official code."""
        from scipy.stats import ncx2

        f = self.spectrum(x)[:, self.mask]  # (B, m)
        w = self.key[self.mask]
        out = []
        for row in f:
            parts = torch.cat([row.real, row.imag])
            sigma = float(parts.std())
            lam = float((w.abs() ** 2).sum()) / sigma**2
            stat = float(((row - w).abs() ** 2).sum()) / sigma**2
            out.append(float(ncx2.cdf(stat, df=2 * len(w), nc=lam)))
        return torch.tensor(out)


class ShallowDiffuse:
    """Embed and detect a ring key at ``t* = t_frac T`` (see the module docstring).

    Args:
        sampler: the DDIM sampler.
        key: the ring key.
        t_frac: the injection time as a fraction of T, in (0, 1]; 1 = x_T. Default: 0.3.
        channel_average: copy the unkeyed channels from the unwatermarked image (server side, several channels).
            Default: True.
    """

    def __init__(self, sampler: DDIMSampler, key: RingKey, t_frac: float = 0.3, channel_average: bool = True) -> None:
        if not 0 < t_frac <= 1:
            raise ValueError(f"ShallowDiffuse: t_frac={t_frac!r}; allowed: (0, 1]")
        self.sampler, self.key, self.t_frac, self.channel_average = sampler, key, t_frac, channel_average
        self.i_star = min(sampler.steps - 1, max(1, round(t_frac * sampler.steps)))

    def _stamp(self) -> None:
        self.key.meta = {"grid": self.sampler.grid, "i_star": self.i_star}

    def _check_meta(self) -> None:
        meta = self.key.meta
        if meta and (meta.get("grid") != self.sampler.grid or meta.get("i_star") != self.i_star):
            raise ValueError(f"ShallowDiffuse.detect: the key was embedded on grid {meta.get('grid', '?')[:3]}... with "
                             f"i_star={meta.get('i_star')}; this sampler has {self.sampler.grid[:3]}... and i_star={self.i_star}")

    def embed_server(self, x_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(watermarked x_0, unwatermarked x_0)`` from the same initial noise."""
        self._stamp()
        x_star = self.sampler.sample(x_T, None, self.i_star)
        clean = self.sampler.sample(x_star, self.i_star, 0)
        marked = self.sampler.sample(self.key.inject(x_star), self.i_star, 0)
        if self.channel_average and marked.shape[1] > 1:
            keep = [c for c in range(marked.shape[1]) if c != self.key.channel]
            marked[:, keep] = clean[:, keep]
        return marked, clean

    def embed_user(self, x_0: torch.Tensor) -> torch.Tensor:
        """Watermark an existing image: invert to t*, inject, sample back."""
        self._stamp()
        x_star = self.sampler.invert(x_0, 0, self.i_star)
        return self.sampler.sample(self.key.inject(x_star), self.i_star, 0)

    def detect(self, x_0: torch.Tensor, p_value: bool = False) -> dict[str, torch.Tensor]:
        """``score`` (= -distance, higher: watermarked) of each image, and its ``p_value`` if asked."""
        self._check_meta()
        x_star = self.sampler.invert(x_0, 0, self.i_star)
        out = {"score": -self.key.distance(x_star)}
        if p_value:
            out["p_value"] = self.key.p_value(x_star)
        return out


def tree_ring(sampler: DDIMSampler, res: int, radius: int = 2, channel: int = 0, key_rng: int = 42) -> ShallowDiffuse:
    """Tree-Ring: the low-frequency (fftshifted) ring written into x_T, no channel averaging."""
    return ShallowDiffuse(sampler, RingKey(res, radius, channel, high_freq=False, key_rng=key_rng), t_frac=1.0,
                          channel_average=False)


# -- analysis ----------------------------------------------------------------------------------------

def pmp_jacobian(model: Any, x: torch.Tensor, t: int) -> torch.Tensor:
    """``(d, d)`` Jacobian of the PMP ``f_t`` at one image ``x`` ``(C, H, W)`` (``torch.func.jacrev``)."""
    shape = x.shape

    def f(v: torch.Tensor) -> torch.Tensor:
        return model.pmp(v.view(1, *shape), t).flatten()

    return torch.func.jacrev(f)(x.flatten())


def rank_ratio(J: torch.Tensor, tol: float = 1e-2) -> float:
    """Fraction of singular values above ``tol`` x the largest."""
    s = torch.linalg.svdvals(J.to(torch.float64))
    return float((s > tol * s[0]).float().mean())


def null_space_fraction(J: torch.Tensor, dx: torch.Tensor, tol: float = 1e-2) -> float:
    """Energy fraction of ``dx`` outside the top-r right singular space of ``J`` (r: singular values above
    ``tol`` x the largest)."""
    _, s, vh = torch.linalg.svd(J.to(torch.float64))
    v = vh[s > tol * s[0]]  # (r, d)
    d = dx.flatten().to(torch.float64)
    return float(1 - (v @ d).pow(2).sum() / d.pow(2).sum())


# -- attacks and metrics -------------------------------------------------------------------------------

def _to_uint8(x: torch.Tensor) -> torch.Tensor:
    """What a saved image holds: the pipeline's post-processing ``(x / 2 + 0.5).clamp(0, 1)`` to 8 bits (diffusers'
    ``VaeImageProcessor.postprocess`` then PIL), so pixels outside [-1, 1] are clipped as in any saved file."""
    return ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()


def _pil_round_trip(x: torch.Tensor, fmt: str, **save_kw: Any) -> torch.Tensor:
    """Save each channel of ``x (B, C, H, W)`` in [-1, 1] as an 8-bit image file in memory and read it back."""
    import numpy as np
    from PIL import Image

    out = torch.empty_like(x)
    u8 = _to_uint8(x)
    for i in range(x.shape[0]):
        for c in range(x.shape[1]):
            buf = io.BytesIO()
            Image.fromarray(u8[i, c].numpy(), mode="L").save(buf, format=fmt, **save_kw)
            buf.seek(0)
            back = np.asarray(Image.open(buf).convert("L"), dtype=np.float32)  # (H, W) in 0..255
            out[i, c] = torch.from_numpy(back).to(x) / 127.5 - 1
    return out


def _jpeg(x: torch.Tensor, quality: int = 75) -> torch.Tensor:
    return _pil_round_trip(x, "JPEG", quality=quality)


def _crop_resize(x: torch.Tensor, frac: float = 0.75) -> torch.Tensor:
    n = x.shape[-1]
    m = max(2, round(n * frac))
    a = (n - m) // 2
    return F.interpolate(x[..., a:a + m, a:a + m], size=(n, n), mode="bilinear", align_corners=False)


ATTACKS: dict[str, Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = {
    "clean": lambda x, g: x,
    "quantize8": lambda x, g: _to_uint8(x).to(x) / 127.5 - 1,
    "png": lambda x, g: _pil_round_trip(x, "PNG"),
    "jpeg90": lambda x, g: _jpeg(x, 90),
    "noise0.01": lambda x, g: x + 0.01 * torch.randn(x.shape, generator=g).to(x),
    "noise0.05": lambda x, g: x + 0.05 * torch.randn(x.shape, generator=g).to(x),
    "jpeg": lambda x, g: _jpeg(x),
    "blur": lambda x, g: F.avg_pool2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), 3, stride=1),
    "crop_resize": lambda x, g: _crop_resize(x),
}


def attack(x: torch.Tensor, name: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """Apply attack ``name`` (:data:`ATTACKS`) to images in [-1, 1]."""
    if name not in ATTACKS:
        raise ValueError(f"attack: name={name!r}; allowed: {', '.join(ATTACKS)}")
    return ATTACKS[name](x, generator or torch.Generator().manual_seed(0))


def psnr(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """PSNR per image for images in [-1, 1] (data range 2), ``(B,)``."""
    mse = (a - b).flatten(1).pow(2).mean(1).clamp_min(1e-20)
    return 10 * torch.log10(4.0 / mse)


# -- evaluation through `lowrank test` -------------------------------------------------------------------

PAPER = "Shallow Diffuse: Robust and Invisible Watermarking through Low-Dimensional Subspaces in Diffusion Models"
METHODS = ("shallow_diffuse", "tree_ring")


class _Noises(Dataset):
    def __init__(self, n: int, shape: tuple[int, ...], batch_size: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, *shape, generator=g)
        self.batch_size = batch_size

    def __len__(self) -> int:
        return math.ceil(len(self.x) / self.batch_size)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.x[i * self.batch_size:(i + 1) * self.batch_size]


class NoiseDataModule(pl.LightningDataModule):
    """``n`` seeded initial noises x_T of ``shape``, in batches (the watermark evaluation's inputs).

    Args:
        n: noises. Default: 100.
        shape: ``[C, H, W]``. Default: [1, 16, 16].
        batch_size: noises per batch. Default: 50.
        seed: generator seed. Default: 0.
    """

    def __init__(self, n: int = 100, shape: list[int] | None = None, batch_size: int = 50, seed: int = 0) -> None:
        super().__init__()
        if n < 2 or batch_size < 1:
            raise ValueError(f"NoiseDataModule: n={n}, batch_size={batch_size}; allowed: n >= 2, batch_size >= 1")
        self.n, self.shape, self.batch_size, self.seed = n, tuple(shape or (1, 16, 16)), batch_size, seed

    def test_dataloader(self) -> DataLoader:
        return DataLoader(_Noises(self.n, self.shape, self.batch_size, self.seed), batch_size=None)


@register_method("shallow_diffuse", kind="Analysis", paper=PAPER, summary="summary", bench="bench")
class ShallowDiffuseEval(pl.LightningModule):
    """Embed a watermark into images generated from each initial noise, attack them, detect (``lowrank test``).

    For every noise: the unwatermarked and the watermarked image from the same x_T (server side); every attack
    of ``attacks`` on both; detection scores. At the end: ``test/psnr`` (watermarked vs unwatermarked),
    ``test/out_of_range`` (share of watermarked pixels outside [-1, 1], which a saved image clips),
    ``test/flip_rate`` (the denoiser's nearest class changes; MoLRG's Bayes classifier, or ``classifier``),
    ``test/auc_<attack>`` and ``test/tpr1_<attack>`` (TPR at 1 % FPR, torchmetrics), ``test/null_fraction`` (energy of
    the injected change outside the top singular space of ``J_{t*}``, first image) and the rank ratio of ``J_t`` on
    a grid of t. Written to the run directory: ``watermark_scores.csv``, ``watermark_attacks.csv``,
    ``rank_ratio.csv``, ``roc.png`` and ``grid.png`` (clean / watermarked / x10 difference), also to W&B.

    Args:
        denoiser: the eps model (``lowrank_lit.models.denoisers.DigitsMoLRG``, ``DigitsGaussianPMP``, ``TrainedUNetEps``).
        method: ``shallow_diffuse`` (high-frequency ring at t_frac) or ``tree_ring`` (low-frequency ring at x_T).
            Default: shallow_diffuse.
        t_frac: injection time for Shallow Diffuse, (0, 1]. Default: 0.3.
        radius: ring radius; None: 3 (Shallow Diffuse) or 2 (Tree-Ring). Default: None.
        channel: keyed channel. Default: 0.
        key_rng: key generator seed. Default: 42.
        steps: DDIM steps. Default: 50.
        attacks: attack names (see ``ATTACKS``). Default: all.
        rank_ts: timesteps of the rank-ratio table. Default: [0, 100, 200, 300, 500, 700, 900].
        p_value: also compute the non-central chi-square p-values. Default: False.
        analysis: compute the dense Jacobian analysis (null-space fraction, rank ratios); off for large latents
            (Stable Diffusion's d = 16384). Default: True.
    """

    sharding_refusal: ClassVar[str | None] = "it evaluates watermarks of a trained denoiser (lowrank test); train the denoiser sharded with DiffusionTrainer"

    def __init__(self, denoiser: nn.Module, method: str = "shallow_diffuse", t_frac: float = 0.3, radius: int | None = None,
                 channel: int = 0, key_rng: int = 42, steps: int = 50, attacks: list[str] | None = None,
                 rank_ts: list[int] | None = None, p_value: bool = False, analysis: bool = True) -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"ShallowDiffuseEval: method={method!r}; allowed: {', '.join(METHODS)}")
        self.attacks = list(ATTACKS) if attacks is None else list(attacks)
        bad = [a for a in self.attacks if a not in ATTACKS]
        if bad:
            raise ValueError(f"ShallowDiffuseEval: attacks {bad}; allowed: {', '.join(ATTACKS)}")
        self.save_hyperparameters(ignore=["denoiser"], logger=False)
        self.denoiser = denoiser.eval().requires_grad_(False)
        res = denoiser.shape[-1]
        sampler = DDIMSampler(denoiser, denoiser.alphas_cumprod, steps)
        if method == "tree_ring":
            self.wm = tree_ring(sampler, res, 2 if radius is None else radius, channel, key_rng)
        else:
            self.wm = ShallowDiffuse(sampler, RingKey(res, 3 if radius is None else radius, channel, True, key_rng), t_frac)
        self.method, self.p_value, self.analysis = method, p_value, analysis
        self.rank_ts = list(rank_ts) if rank_ts is not None else [0, 100, 200, 300, 500, 700, 900]
        self.rows: list[dict[str, Any]] = []
        self.first: tuple[torch.Tensor, torch.Tensor] | None = None

    def _classes(self, x: torch.Tensor) -> torch.Tensor | None:
        fn = getattr(self.denoiser, "classify", None)
        return fn(x) if fn is not None else None

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        marked, clean = self.wm.embed_server(batch)
        if self.first is None:
            self.first = (clean[:8].cpu(), marked[:8].cpu())
        p = psnr(marked, clean)
        ca, cb = self._classes(marked), self._classes(clean)
        g = torch.Generator().manual_seed(1000 + batch_idx)
        for name in self.attacks:
            dw = self.wm.detect(attack(marked, name, g), self.p_value)
            dc = self.wm.detect(attack(clean, name, g), self.p_value)
            for i in range(len(batch)):
                row = {"batch": batch_idx, "index": i, "attack": name, "score_marked": float(dw["score"][i]),
                       "score_clean": float(dc["score"][i]), "psnr": float(p[i]),
                       "out_of_range": float((marked[i].abs() > 1).float().mean()),
                       "flip": float(ca[i] != cb[i]) if ca is not None else float("nan")}
                if self.p_value:
                    row["p_marked"], row["p_clean"] = float(dw["p_value"][i]), float(dc["p_value"][i])
                self.rows.append(row)

    def _analysis(self) -> tuple[float, list[dict[str, Any]]]:
        torch.manual_seed(0)
        x_T = torch.randn(1, *self.denoiser.shape)
        sampler, i_star = self.wm.sampler, self.wm.i_star
        x_star = sampler.sample(x_T, None, i_star)[0]
        dx = self.wm.key.inject(x_star[None])[0] - x_star
        with torch.enable_grad():
            J = pmp_jacobian(self.denoiser, x_star, sampler.grid[i_star])
            frac = null_space_fraction(J.detach(), dx)
            ranks = []
            for t in self.rank_ts:
                j = min(range(sampler.steps), key=lambda k: abs(sampler.grid[k] - t))
                xt = sampler.sample(x_T, None, j)[0]
                ranks.append({"t": sampler.grid[j], "rank_ratio": rank_ratio(pmp_jacobian(self.denoiser, xt, sampler.grid[j]).detach())})
        return frac, ranks

    def on_test_epoch_end(self) -> None:
        from torchmetrics.functional.classification import binary_auroc, binary_roc

        self.log("test/psnr", sum(r["psnr"] for r in self.rows if r["attack"] == self.attacks[0]) / max(1, sum(r["attack"] == self.attacks[0] for r in self.rows)))
        first = [r for r in self.rows if r["attack"] == self.attacks[0]]
        if first:  # share of watermarked pixels outside [-1, 1]: what a saved 8-bit image clips away
            self.log("test/out_of_range", sum(r["out_of_range"] for r in first) / len(first))
        flips = [r["flip"] for r in self.rows if r["attack"] == self.attacks[0] and r["flip"] == r["flip"]]
        if flips:
            self.log("test/flip_rate", sum(flips) / len(flips))
        self.attack_rows, curves = [], {}
        for name in self.attacks:
            rows = [r for r in self.rows if r["attack"] == name]
            scores = torch.tensor([r["score_marked"] for r in rows] + [r["score_clean"] for r in rows])
            labels = torch.tensor([1] * len(rows) + [0] * len(rows))
            auc = float(binary_auroc(scores, labels))
            fpr, tpr, _ = binary_roc(scores, labels)
            tpr1 = float(tpr[fpr <= 0.01].max())
            curves[name] = (fpr, tpr, auc)
            self.log(f"test/auc_{name}", auc)
            self.log(f"test/tpr1_{name}", tpr1)
            self.attack_rows.append({"attack": name, "auc": auc, "tpr_at_1fpr": tpr1})
        self.rank_rows = []
        if self.analysis:
            frac, self.rank_rows = self._analysis()
            self.log("test/null_fraction", frac)
            self.null_fraction = frac
        if may_write(self.trainer):
            self._save(curves)

    def _save(self, curves: dict[str, tuple[torch.Tensor, torch.Tensor, float]]) -> None:
        save_rows(self.trainer, self.rows, "watermark_scores.csv")
        save_rows(self.trainer, self.attack_rows, "watermark_attacks.csv")
        if self.rank_rows:  # the Jacobian analysis ran (analysis=true)
            save_rows(self.trainer, self.rank_rows, "rank_ratio.csv")
        fig, ax = new_figure(figsize=(5, 4))
        for name, (fpr, tpr, auc) in curves.items():
            ax.plot(fpr.numpy(), tpr.numpy(), label=f"{name} (AUC {auc:.3f})")
        n = len(self.rows) // max(len(curves), 1)  # images per attack
        ax.set_title(f"Watermark detection ROC ({self.method}, {n} images per attack)", fontsize=10)
        ax.set_xscale("symlog", linthresh=1e-2)
        ax.set_xlabel("false positive rate")
        ax.set_ylabel("true positive rate")
        ax.legend(fontsize=7)
        log_image(self.trainer, "watermark/roc", save_figure(fig, artifact_path(self.trainer, "roc.png")))
        assert self.first is not None
        clean, marked = self.first
        fig, axes = new_figure(3, len(clean), figsize=(1.2 * len(clean), 3.8), squeeze=False)
        for i in range(len(clean)):
            for r, (img, lo, hi) in enumerate(((clean[i], -1, 1), (marked[i], -1, 1), ((marked[i] - clean[i]) * 10, -1, 1))):
                axes[r, i].imshow(img[0].numpy(), cmap="gray", vmin=lo, vmax=hi)
                axes[r, i].axis("off")
        for r, label in enumerate(("clean", "watermarked", "difference x10")):
            axes[r, 0].set_title(label, fontsize=7, loc="left")
        fig.suptitle(f"{self.method}: the same initial noises without and with the key", fontsize=8)
        log_image(self.trainer, "watermark/grid", save_figure(fig, artifact_path(self.trainer, "grid.png")))


def _fmt(vals: dict[str, float], key: str, spec: str) -> str:
    v = vals.get(key, float("nan"))
    return "-" if v != v else format(v, spec)


def summary(roots: list[str], out: str | None = None) -> str:
    """PSNR, flips, AUC / TPR@1%FPR per attack, null-space fraction per run.

    Markdown: one row per run (method, denoiser, t_frac) with PSNR, flip rate, null-space fraction and the AUC
    (TPR at 1 % FPR) of every attack; ``out``: the rank-ratio-vs-t plot of the runs."""
    import csv

    rows, attacks, ranks = [], [], {}
    for run in read_runs(roots, "watermark_attacks.csv"):
        cfg = run.config["model"]["init_args"]
        vals = run.metrics
        per = {r["attack"]: (float(r["auc"]), float(r["tpr_at_1fpr"])) for r in run.rows("watermark_attacks.csv")}
        attacks += [a for a in per if a not in attacks]
        shape = ((run.config.get("data") or {}).get("init_args") or {}).get("shape") or ["?"]
        label = (cfg.get("method", "shallow_diffuse"), cfg["denoiser"]["class_path"].rsplit(".", 1)[-1],
                 "1.0" if cfg.get("method") == "tree_ring" else str(cfg.get("t_frac", 0.3)), f"{shape[-1]}")
        rows.append((label, vals, per))
        rr = run.path / "rank_ratio.csv"
        if rr.is_file() and rr.stat().st_size:
            with open(rr) as f:
                ranks[label[1]] = [(int(r["t"]), float(r["rank_ratio"])) for r in csv.DictReader(f)]
    if out:
        fig, ax = new_figure(figsize=(5, 3.5))
        for name, pts in ranks.items():
            ax.plot([t for t, _ in pts], [r for _, r in pts], marker="o", label=name)
        ax.set_xlabel("t")
        ax.set_ylabel("rank ratio of J_t")
        ax.set_yscale("log")
        ax.set_title("Rank ratio of the denoiser's Jacobian along t (low: a near-null space to watermark)", fontsize=8)
        ax.legend(fontsize=7)
        save_figure(fig, out)

    groups: dict[tuple[str, ...], list[tuple[dict[str, float], dict[str, tuple[float, float]]]]] = {}
    for label, vals, per in rows:  # runs of one setting (e.g. several seeds) share a row: mean, ± std when > 1
        groups.setdefault(label, []).append((vals, per))

    def cell(xs: list[float], spec: str) -> str:
        return mean_std([x for x in xs if x == x], spec)  # NaN (a metric the run lacks) left out

    table = []
    for label in sorted(groups, key=lambda lb: (lb[0], lb[1], lb[2], int(lb[3]) if lb[3].isdigit() else 0)):
        runs = groups[label]
        metric = [cell([v.get(k, float("nan")) for v, _ in runs], spec) for k, spec in
                  (("test/psnr", ".1f"), ("test/flip_rate", ".2f"), ("test/null_fraction", ".2f"), ("test/out_of_range", ".3f"))]
        aucs = []
        for a in attacks:
            got = [p[a] for _, p in runs if a in p]
            aucs.append(f"{cell([g[0] for g in got], '.3f')} ({cell([g[1] for g in got], '.2f')})" if got else "-")
        table.append([*label, len(runs), *metric, *aucs])
    return markdown_table(["method", "denoiser", "t_frac", "image side", "runs", "PSNR (dB)", "class flips",
                           "null-space fraction", "pixels outside [-1, 1]", *(f"AUC (TPR@1%) {a}" for a in attacks)], table)


def bench(ctx: Any) -> list[Any]:
    """Time per test batch (embed, attack, detect) of Shallow Diffuse against Tree-Ring on MoLRG (``lowrank bench shallow_diffuse``)."""
    from lowrank_lit.bench import ConfigBench

    return [ConfigBench("shallow_diffuse", "Shallow Diffuse embed + detect per batch", "Tree-Ring per batch",
                        "configs/shallow_diffuse/molrg_shallow_diffuse.yaml", "configs/shallow_diffuse/molrg_tree_ring.yaml",
                        "paper: injects at t = 0.3 T instead of T (fewer inversion steps); reported", verb="test",
                        steps=2, quick_steps=1, rounds=3)]
