"""A procedural head renderer for cross-domain gaze estimation (the offline stand-in for FLAME + gaze datasets).

:func:`render_heads` ray-casts a batch of heads in torch (orthographic camera on the +z axis looking down -z,
image plane [-1.2, 1.2]^2): an ellipsoid face; two spherical eyeballs whose iris and pupil are where the
surface normal is close to the eye direction; eyelids (the visible band of the eyeball has half-height
``lid`` x eye radius, the rest is skin); a nose; a mouth curve on the face (curvature = smile); optional
glasses (two rings and a bridge in the plane in front of the eyes); Lambertian light plus ambient; skin albedo;
a background colour with a vertical gradient. All samples of a batch render at once (``(B, H*W)`` rays).

Parameters (:class:`HeadParams`): shape ``beta = (face width, face height, face depth, IOD, eye radius)``, head
pose ``theta = (yaw, pitch, roll)``, expression ``psi = (lid opening, smile, brow)``, lighting ``light = (azimuth,
elevation, intensity, ambient)``, eye rotation ``eye = (yaw, pitch)`` relative to the head, skin and background
colours, glasses. The gaze label is ``g = R(theta) eye_dir(eye)`` (unit, camera frame; zero = towards the camera).

Landmarks (:func:`landmarks`, the FLAME substitute): ``K = R(theta) (T + S beta + E psi)``: 21 points from linear
blendshapes of shape and expression, without eye rotation (as FLAME/DECA landmarks), so K is affine in
(beta, psi) for a fixed pose and the inter-ocular distance of K equals beta's IOD for every pose and expression.

Domains (:data:`DOMAINS`) differ in pose range, lighting, skin, background, glasses and expression; ``prior`` is
broad (the parameter encoder's pretraining domain), ``source`` is the training domain, ``target_light`` (dim,
side-lit, darker skin) and ``target_glasses`` (glasses, wider poses, other backgrounds) are never trained on.
:class:`SyntheticHeadDataModule` draws batches from seeded generators (the same batch on every rank and resume).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lowrank_lit.data.stream import SeededBatches, stream_loader
from lowrank_lit.seeding import run_seed

__all__ = ["HeadParams", "DOMAINS", "sample_params", "rotation", "gaze_from_angles", "angles_from_gaze", "landmarks",
           "render_heads", "head_gaze", "SyntheticHeadDataModule", "NUM_LANDMARKS"]


@dataclass
class HeadParams:
    """A batch of head parameters (each ``(B, k)``)."""

    beta: torch.Tensor  # (B, 5): face width, height, depth, IOD, eye radius
    theta: torch.Tensor  # (B, 3): yaw, pitch, roll (radians)
    psi: torch.Tensor  # (B, 3): lid opening in (0, 1], smile, brow
    light: torch.Tensor  # (B, 4): azimuth, elevation, intensity, ambient
    eye: torch.Tensor  # (B, 2): eye yaw, eye pitch relative to the head (radians)
    skin: torch.Tensor  # (B, 3): albedo
    background: torch.Tensor  # (B, 3): colour
    glasses: torch.Tensor  # (B, 1): 0 or 1

    def flat(self) -> torch.Tensor:
        """The parameters the prior encoder regresses: beta, theta, psi, light, ``(B, 15)``."""
        return torch.cat([self.beta, self.theta, self.psi, self.light], 1)

    def __len__(self) -> int:
        return self.beta.shape[0]


#: per domain: uniform ranges (low, high) of each drawn quantity, and the glasses probability
DOMAINS: dict[str, dict[str, Any]] = {
    "prior": {"yaw": (-0.6, 0.6), "pitch": (-0.4, 0.4), "roll": (-0.25, 0.25), "intensity": (0.3, 1.0), "ambient": (0.1, 0.5),
              "azimuth": (-1.2, 1.2), "elevation": (-0.6, 0.8), "skin": (0.25, 0.95), "background": (0.0, 1.0),
              "smile": (-0.4, 0.4), "lid": (0.35, 1.0), "glasses": 0.5},
    "source": {"yaw": (-0.4, 0.4), "pitch": (-0.25, 0.25), "roll": (-0.1, 0.1), "intensity": (0.7, 1.0), "ambient": (0.3, 0.5),
               "azimuth": (-0.3, 0.3), "elevation": (0.0, 0.5), "skin": (0.6, 0.95), "background": (0.6, 1.0),
               "smile": (-0.1, 0.1), "lid": (0.7, 1.0), "glasses": 0.0},
    "target_light": {"yaw": (-0.4, 0.4), "pitch": (-0.25, 0.25), "roll": (-0.1, 0.1), "intensity": (0.3, 0.6), "ambient": (0.08, 0.2),
                     "azimuth": (-1.2, -0.6), "elevation": (-0.5, 0.2), "skin": (0.25, 0.55), "background": (0.0, 0.35),
                     "smile": (-0.1, 0.1), "lid": (0.7, 1.0), "glasses": 0.0},
    "target_glasses": {"yaw": (-0.55, 0.55), "pitch": (-0.3, 0.3), "roll": (-0.2, 0.2), "intensity": (0.6, 1.0), "ambient": (0.25, 0.45),
                       "azimuth": (0.2, 0.9), "elevation": (0.0, 0.6), "skin": (0.4, 0.8), "background": (0.2, 0.6),
                       "smile": (-0.35, 0.35), "lid": (0.5, 0.9), "glasses": 1.0},
}
EYE_RANGE = (0.45, 0.35)  # |eye yaw|, |eye pitch| relative to the head
NUM_LANDMARKS = 21


def _u(g: torch.Generator, n: int, lo: float, hi: float) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, generator=g)


def sample_params(n: int, domain: str, generator: torch.Generator) -> HeadParams:
    """``n`` heads drawn from ``DOMAINS[domain]``."""
    if domain not in DOMAINS:
        raise ValueError(f"sample_params: domain={domain!r}; allowed: {', '.join(DOMAINS)}")
    d, g = DOMAINS[domain], generator
    beta = torch.stack([_u(g, n, 0.72, 0.85), _u(g, n, 0.95, 1.08), _u(g, n, 0.75, 0.9), _u(g, n, 0.52, 0.64),
                        _u(g, n, 0.11, 0.14)], 1)
    theta = torch.stack([_u(g, n, *d["yaw"]), _u(g, n, *d["pitch"]), _u(g, n, *d["roll"])], 1)
    psi = torch.stack([_u(g, n, *d["lid"]), _u(g, n, *d["smile"]), _u(g, n, -0.05, 0.05)], 1)
    light = torch.stack([_u(g, n, *d["azimuth"]), _u(g, n, *d["elevation"]), _u(g, n, *d["intensity"]), _u(g, n, *d["ambient"])], 1)
    eye = torch.stack([_u(g, n, -EYE_RANGE[0], EYE_RANGE[0]), _u(g, n, -EYE_RANGE[1], EYE_RANGE[1])], 1)
    tone = _u(g, n, *d["skin"])
    skin = torch.stack([tone, tone * _u(g, n, 0.75, 0.85), tone * _u(g, n, 0.6, 0.72)], 1)
    background = torch.stack([_u(g, n, *d["background"]) for _ in range(3)], 1)
    glasses = (torch.rand(n, generator=g) < d["glasses"]).float()[:, None]
    return HeadParams(beta, theta, psi, light, eye, skin, background, glasses)


def rotation(theta: torch.Tensor) -> torch.Tensor:
    """``(B, 3)`` yaw (about y), pitch (about x), roll (about z) -> ``R = R_y R_x R_z``, ``(B, 3, 3)``."""
    yaw, pitch, roll = theta.unbind(1)
    c, s = torch.cos, torch.sin
    one, zero = torch.ones_like(yaw), torch.zeros_like(yaw)
    ry = torch.stack([c(yaw), zero, s(yaw), zero, one, zero, -s(yaw), zero, c(yaw)], 1).view(-1, 3, 3)
    rx = torch.stack([one, zero, zero, zero, c(pitch), -s(pitch), zero, s(pitch), c(pitch)], 1).view(-1, 3, 3)
    rz = torch.stack([c(roll), -s(roll), zero, s(roll), c(roll), zero, zero, zero, one], 1).view(-1, 3, 3)
    return ry @ rx @ rz


def gaze_from_angles(angles: torch.Tensor) -> torch.Tensor:
    """``(B, 2)`` (pitch, yaw) -> unit gaze ``(B, 3)``: ``(cos p sin y, sin p, cos p cos y)`` (+z: towards the camera)."""
    p, y = angles.unbind(1)
    return torch.stack([torch.cos(p) * torch.sin(y), torch.sin(p), torch.cos(p) * torch.cos(y)], 1)


def angles_from_gaze(g: torch.Tensor) -> torch.Tensor:
    """Unit gaze ``(B, 3)`` -> ``(B, 2)`` (pitch, yaw); inverse of :func:`gaze_from_angles`.

    Raises:
        ValueError: a zero-norm gaze vector.
    """
    n = g.norm(dim=1, keepdim=True)
    if bool((n < 1e-12).any()):
        raise ValueError("angles_from_gaze: a gaze vector has zero norm")
    g = g / n
    return torch.stack([torch.asin(g[:, 1].clamp(-1, 1)), torch.atan2(g[:, 0], g[:, 2])], 1)


def _eye_centres(beta: torch.Tensor) -> torch.Tensor:
    """``(B, 2, 3)`` eyeball centres in the head frame (left, right)."""
    iod, r = beta[:, 3], beta[:, 4]
    y = 0.12 * beta[:, 1]
    z = 0.86 * beta[:, 2] - 0.35 * r
    return torch.stack([torch.stack([-iod / 2, y, z], 1), torch.stack([iod / 2, y, z], 1)], 1)


# -- landmarks (FLAME substitute): K = R(theta) (T + S beta + E psi) --------------------------------------------------
# rows: 0-1 eye centres, 2-5 left eye corners/top/bottom, 6-9 right, 10-11 brows, 12 nose bridge, 13 nose tip,
# 14-15 mouth corners, 16 upper lip, 17 lower lip, 18 chin, 19-20 face sides
def _blendshapes() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = torch.zeros(NUM_LANDMARKS, 3)
    S = torch.zeros(5, NUM_LANDMARKS, 3)  # per beta component
    E = torch.zeros(3, NUM_LANDMARKS, 3)  # per psi component
    for side, (c, first) in enumerate(((-1.0, 2), (1.0, 6))):
        S[3, side, 0] = c / 2  # eye centre x = +-IOD / 2
        S[1, side, 1] = 0.12
        S[2, side, 2] = 0.86
        for k in range(4):
            S[3, first + k, 0] = c / 2
            S[1, first + k, 1] = 0.12
            S[2, first + k, 2] = 0.86
        S[4, first, 0], S[4, first + 1, 0] = -1.0, 1.0  # corners at +- eye radius
        E[0, first + 2, 1], E[0, first + 3, 1] = 0.14, -0.14  # lids open with psi[0]
        S[1, 10 + side, 1] = 0.3
        S[3, 10 + side, 0] = c / 2
        S[2, 10 + side, 2] = 0.9
        E[2, 10 + side, 1] = 1.0  # brow raise
    S[2, 12, 2], S[1, 12, 1] = 0.95, 0.05
    S[2, 13, 2], S[1, 13, 1] = 1.12, -0.2
    for k, c in ((14, -1.0), (15, 1.0)):
        S[0, k, 0], S[1, k, 1], S[2, k, 2] = 0.3 * c, -0.5, 0.8
        E[1, k, 1] = 0.12  # smile lifts the corners
    S[1, 16, 1], S[2, 16, 2] = -0.45, 0.84
    S[1, 17, 1], S[2, 17, 2] = -0.56, 0.8
    E[1, 17, 1] = -0.03
    S[1, 18, 1], S[2, 18, 2] = -0.98, 0.2
    S[0, 19, 0], S[0, 20, 0] = -1.0, 1.0
    return T, S, E


_T, _S, _E = _blendshapes()


def landmarks(beta: torch.Tensor, theta: torch.Tensor, psi: torch.Tensor) -> torch.Tensor:
    """``K = R(theta) (T + S beta + E psi)``, ``(B, 21, 3)`` in the camera frame (no eye rotation)."""
    local = _T + torch.einsum("bk,knd->bnd", beta, _S.to(beta)) + torch.einsum("bk,knd->bnd", psi, _E.to(psi))
    return local @ rotation(theta).transpose(1, 2)


# -- renderer -------------------------------------------------------------------------------------------------------

def _sphere_hit(o: torch.Tensor, d: torch.Tensor, c: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Ray parameter of the first hit of rays ``o + s d`` (``(B, P, 3)``, unit d) with spheres ``(B, 3)``, ``(B,)``; inf: none."""
    oc = o - c[:, None]
    b = (oc * d).sum(-1)
    disc = b * b - ((oc * oc).sum(-1) - r[:, None] ** 2)
    s = -b - torch.sqrt(disc.clamp_min(0))
    return torch.where(disc > 0, s, torch.full_like(s, math.inf))


def render_heads(p: HeadParams, size: int = 64) -> torch.Tensor:
    """Images ``(B, 3, size, size)`` in [0, 1] of the heads ``p`` (see the module docstring)."""
    B = len(p)
    lin = torch.linspace(1.2, -1.2, size)
    yy, xx = torch.meshgrid(lin, -lin, indexing="ij")  # image row 0 = top (+y), column 0 = left (-x)
    R = rotation(p.theta)  # (B, 3, 3) head -> camera
    Rt = R.transpose(1, 2)
    o_cam = torch.stack([xx.flatten(), yy.flatten(), torch.full((size * size,), 5.0)], 1)  # (P, 3)
    d_cam = torch.tensor([0.0, 0.0, -1.0])
    o = o_cam[None] @ R  # (B, P, 3) = (R^T o)^T, ray origins in the head frame
    d = (d_cam @ R).expand(B, 3)[:, None].expand(B, size * size, 3)  # (B, P, 3)
    # face ellipsoid: scale to the unit sphere
    radii = p.beta[:, :3]  # (B, 3)
    os_, ds = o / radii[:, None], d / radii[:, None]
    a = (ds * ds).sum(-1)
    b = (os_ * ds).sum(-1)
    c = (os_ * os_).sum(-1) - 1
    disc = b * b - a * c
    s_face = torch.where(disc > 0, (-b - torch.sqrt(disc.clamp_min(0))) / a, torch.full_like(a, math.inf))
    eyes = _eye_centres(p.beta)  # (B, 2, 3)
    r_eye = p.beta[:, 4]
    s_eyes = torch.stack([_sphere_hit(o, d, eyes[:, k], r_eye) for k in range(2)], -1)  # (B, P, 2)
    nose_c = torch.stack([torch.zeros(B), -0.08 * p.beta[:, 1], 0.98 * p.beta[:, 2]], 1)
    s_nose = _sphere_hit(o, d, nose_c, 0.11 * p.beta[:, 0])
    s_all = torch.stack([s_face, s_eyes[..., 0], s_eyes[..., 1], s_nose], -1)  # (B, P, 4)
    s_min, which = s_all.min(-1)
    hit = torch.isfinite(s_min)
    pts = o + s_min.clamp(max=1e3)[..., None] * d  # (B, P, 3)
    # normals in the head frame
    n_face = pts / radii[:, None] ** 2
    n_eye = torch.where((which == 1)[..., None], pts - eyes[:, 0, None], pts - eyes[:, 1, None])
    n_nose = pts - nose_c[:, None]
    normal = torch.where((which == 0)[..., None], n_face, torch.where((which == 3)[..., None], n_nose, n_eye))
    normal = F.normalize(normal, dim=-1)
    # albedo
    albedo = p.skin[:, None].expand(B, size * size, 3).clone()
    on_eye = (which == 1) | (which == 2)
    eye_dir = R.new_zeros(B, 3)
    eye_dir[:] = gaze_from_angles(torch.stack([p.eye[:, 1], p.eye[:, 0]], 1))  # head frame
    cosang = (normal * eye_dir[:, None]).sum(-1)
    local_y = torch.where(which == 1, pts[..., 1] - eyes[:, 0, 1, None], pts[..., 1] - eyes[:, 1, 1, None])
    open_eye = on_eye & (local_y.abs() < p.psi[:, 0, None] * r_eye[:, None])  # lids cover the rest
    white = torch.tensor([0.92, 0.92, 0.9])
    iris = torch.tensor([0.25, 0.18, 0.1])
    pupil = torch.tensor([0.03, 0.03, 0.03])
    eye_col = torch.where((cosang > 0.93)[..., None], pupil, torch.where((cosang > 0.8)[..., None], iris, white))
    albedo = torch.where(open_eye[..., None], eye_col, albedo)
    # mouth: a dark curve on the face, y = m0 + smile x^2 / width
    x_rel = pts[..., 0] / p.beta[:, 0, None]
    mouth_y = -0.5 * p.beta[:, 1, None] + p.psi[:, 1, None] * x_rel**2 * 0.5
    mouth = (which == 0) & (pts[..., 2] > 0) & (x_rel.abs() < 0.32) & ((pts[..., 1] - mouth_y).abs() < 0.035)
    albedo = torch.where(mouth[..., None], torch.tensor([0.45, 0.12, 0.12]), albedo)
    brow_y = (0.3 + p.psi[:, 2, None]) * p.beta[:, 1, None]
    brow = (which == 0) & (pts[..., 2] > 0) & ((pts[..., 1] - brow_y).abs() < 0.03) & (
        ((pts[..., 0].abs() - p.beta[:, 3, None] / 2).abs()) < 0.13)
    albedo = torch.where(brow[..., None], albedo * 0.35, albedo)
    # shading: light direction in the camera frame
    az, el, inten, amb = p.light.unbind(1)
    L = torch.stack([torch.cos(el) * torch.sin(az), torch.sin(el), torch.cos(el) * torch.cos(az)], 1)  # (B, 3)
    n_cam = normal @ Rt  # (B, P, 3) = (R n)^T
    lambert = (n_cam * L[:, None]).sum(-1).clamp_min(0)
    shade = amb[:, None] + inten[:, None] * lambert
    col = (albedo * shade[..., None]).clamp(0, 1)
    # glasses: rings and a bridge in the plane just in front of the eyes (head frame)
    zg = eyes[:, 0, 2] + 1.6 * r_eye  # (B,)
    sg = (zg[:, None] - o[..., 2]) / d[..., 2]
    q = o + sg[..., None] * d  # points on the glasses plane
    rg = 1.7 * r_eye[:, None]
    ring = torch.zeros_like(hit)
    for k in range(2):
        dist = torch.sqrt((q[..., 0] - eyes[:, k, 0, None]) ** 2 + (q[..., 1] - eyes[:, k, 1, None]) ** 2)
        ring = ring | ((dist - rg).abs() < 0.025)
    bridge = (q[..., 0].abs() < p.beta[:, 3, None] / 2 - rg) & ((q[..., 1] - eyes[:, 0, 1, None]).abs() < 0.02)
    frame = (ring | bridge) & (p.glasses > 0.5) & (sg < s_min)
    col = torch.where(frame[..., None], torch.tensor([0.05, 0.05, 0.08]), col)
    # background with a vertical gradient
    bg = p.background[:, None] * (0.85 + 0.15 * (yy.flatten()[None, :, None] + 1.2) / 2.4)
    out = torch.where((hit | frame)[..., None], col, bg)
    return out.view(B, size, size, 3).permute(0, 3, 1, 2).contiguous()


class _FixedBatches(SeededBatches):
    """The same batches every epoch (seeded as epoch 0), rendered once and kept in memory."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.cache: dict[int, Any] = {}

    def __getitem__(self, i: int) -> Any:
        if i not in self.cache:
            epoch, self.epoch = self.epoch, 0
            self.cache[i] = super().__getitem__(i)
            self.epoch = epoch
        return self.cache[i]


class SyntheticHeadDataModule(pl.LightningDataModule):
    """Rendered heads for cross-domain gaze estimation; batches are dicts ``image (B, 3, S, S)``, ``gaze (B, 3)``,
    ``landmarks (B, 21, 3)``, ``params (B, 15)``, ``glasses (B,)``, ``domain (B,)`` (index into ``test_domains`` in
    test, else 0).

    Args:
        train_domain: the training domain. Default: source.
        test_domains: the held-out domains (each its own test dataloader). Default: [target_light, target_glasses].
        train_size, val_size, test_size: images per epoch / validation / test domain. Default: 16384, 1024, 2048.
        batch_size: images per batch. Default: 256.
        image_size: side. Default: 64.
        seed: data seed; None: the run seed. Default: None.
        strict_domains: refuse a test domain that is also the training domain. Default: True.
        fixed_train: the same training images every epoch, rendered once and cached (a fixed-size training set,
            like a dataset); False draws new heads every epoch. Default: True.
    """

    def __init__(self, train_domain: str = "source", test_domains: list[str] | None = None, train_size: int = 16384,
                 val_size: int = 1024, test_size: int = 2048, batch_size: int = 256, image_size: int = 64,
                 seed: int | None = None, strict_domains: bool = True, fixed_train: bool = True) -> None:
        super().__init__()
        self.test_domains = list(test_domains) if test_domains is not None else ["target_light", "target_glasses"]
        for name in [train_domain, *self.test_domains]:
            if name not in DOMAINS:
                raise ValueError(f"SyntheticHeadDataModule: domain {name!r}; allowed: {', '.join(DOMAINS)}")
        if strict_domains and train_domain in self.test_domains:
            raise ValueError(f"SyntheticHeadDataModule: test_domains includes the training domain {train_domain!r} "
                             "(strict_domains=True keeps targets unseen)")
        if min(train_size, val_size, test_size, batch_size, image_size) < 1:
            raise ValueError("SyntheticHeadDataModule: sizes must be >= 1")
        self.train_domain, self.batch_size, self.image_size, self.seed = train_domain, batch_size, image_size, seed
        self.train_size, self.val_size, self.test_size = train_size, val_size, test_size
        self.fixed_train = fixed_train
        self._train: Any = None

    def batch(self, domain: str, n: int, generator: torch.Generator, domain_index: int = 0) -> dict[str, torch.Tensor]:
        p = sample_params(n, domain, generator)
        return {"image": render_heads(p, self.image_size), "gaze": head_gaze(p),
                "landmarks": landmarks(p.beta, p.theta, p.psi), "params": p.flat(), "glasses": p.glasses[:, 0],
                "domain": torch.full((n,), domain_index)}

    def _stream(self, domain: str, size: int, salt: int, index: int = 0, fixed: bool = False) -> Any:
        seed = run_seed(self.seed) * 7919 + salt
        n_batches = max(1, size // self.batch_size)
        cls = _FixedBatches if fixed else SeededBatches
        return stream_loader(cls(lambda g: self.batch(domain, self.batch_size, g, index), n_batches, seed))

    def train_dataloader(self) -> Any:
        if self._train is None or not self.fixed_train:
            self._train = self._stream(self.train_domain, self.train_size, 1, fixed=self.fixed_train)
        return self._train

    def val_dataloader(self) -> Any:
        return self._stream(self.train_domain, self.val_size, 2)

    def test_dataloader(self) -> Any:
        return [self._stream(name, self.test_size, 3 + k, k) for k, name in enumerate(self.test_domains)]


def head_gaze(p: HeadParams) -> torch.Tensor:
    """``g = R(theta) eye_dir`` (camera frame, unit)."""
    eye_dir = gaze_from_angles(torch.stack([p.eye[:, 1], p.eye[:, 0]], 1))  # head frame
    return F.normalize(torch.einsum("bij,bj->bi", rotation(p.theta), eye_dir), dim=1)
