"""The procedural head renderer, landmarks and gaze conventions (shared by 3DPE-Gaze)."""

from __future__ import annotations

import pytest
import torch

from lowrank_lit.data.heads import (
    DOMAINS,
    SyntheticHeadDataModule,
    angles_from_gaze,
    gaze_from_angles,
    head_gaze,
    landmarks,
    render_heads,
    rotation,
    sample_params,
)
from tests.tolerances import F32, F32_LAYERS


def test_renderer_is_deterministic_and_gaze_is_unit():
    a = render_heads(sample_params(6, "source", torch.Generator().manual_seed(3)))
    b = render_heads(sample_params(6, "source", torch.Generator().manual_seed(3)))
    assert torch.equal(a, b) and a.shape == (6, 3, 64, 64) and a.min() >= 0 and a.max() <= 1
    p = sample_params(32, "prior", torch.Generator().manual_seed(0))
    assert torch.allclose(head_gaze(p).norm(dim=1), torch.ones(32), atol=F32)


def test_iris_follows_gaze_with_a_frontal_head():
    p = sample_params(64, "source", torch.Generator().manual_seed(1))
    p.theta.zero_()
    p.psi[:, 0] = 1.0  # eyes fully open
    p.light[:, 2:] = torch.tensor([0.8, 0.4])
    img = render_heads(p, 128)  # enough pixels per pupil for a centroid
    dark = (img.max(1).values < 0.1).float()  # (B, 128, 128): pupil pixels (nothing else that dark in the eye band)
    dark[:, :51] = 0
    dark[:, 67:] = 0
    cols = torch.arange(128).float()
    cx = (dark.sum(1) * cols).sum(1) / dark.sum((1, 2)).clamp_min(1)
    gx = head_gaze(p)[:, 0]
    r = torch.corrcoef(torch.stack([cx, gx]))[0, 1]
    assert float(r) > 0.9


def test_landmarks_affine_rotation_and_iod():
    g = torch.Generator().manual_seed(0)
    p1, p2 = sample_params(5, "prior", g), sample_params(5, "prior", g)
    theta = p1.theta
    mix = landmarks(0.3 * p1.beta + 0.7 * p2.beta, theta, 0.3 * p1.psi + 0.7 * p2.psi)
    assert torch.allclose(mix, 0.3 * landmarks(p1.beta, theta, p1.psi) + 0.7 * landmarks(p2.beta, theta, p2.psi), atol=F32)
    k0 = landmarks(p1.beta, torch.zeros_like(theta), p1.psi)
    k1 = landmarks(p1.beta, theta, p1.psi)
    assert torch.allclose(torch.cdist(k0, k0), torch.cdist(k1, k1), atol=F32_LAYERS)
    for th, ps in ((theta, p1.psi), (p2.theta, p2.psi), (torch.zeros_like(theta), torch.zeros_like(p1.psi))):
        k = landmarks(p1.beta, th, ps)
        assert torch.allclose((k[:, 0] - k[:, 1]).norm(dim=1), p1.beta[:, 3], atol=F32)
    R = rotation(theta)
    assert torch.allclose(R @ R.transpose(1, 2), torch.eye(3).expand(5, 3, 3), atol=F32)


def test_gaze_angle_round_trip_and_bad_inputs():
    ang = torch.stack([torch.linspace(-1.2, 1.2, 50), torch.linspace(-2.5, 2.5, 50)], 1)
    assert torch.allclose(angles_from_gaze(gaze_from_angles(ang)), ang, atol=F32)
    with pytest.raises(ValueError, match="zero norm"):
        angles_from_gaze(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="domain='mars'"):
        sample_params(2, "mars", torch.Generator())
    with pytest.raises(ValueError, match="includes the training domain 'source'"):
        SyntheticHeadDataModule(test_domains=["source"])
    assert {"prior", "source", "target_light", "target_glasses"} <= set(DOMAINS)


def test_datamodule_batches_are_seeded():
    dm = SyntheticHeadDataModule(train_size=16, val_size=8, test_size=8, batch_size=8, seed=0)
    b1 = next(iter(dm.train_dataloader()))
    b2 = next(iter(SyntheticHeadDataModule(train_size=16, val_size=8, test_size=8, batch_size=8, seed=0).train_dataloader()))
    assert torch.equal(b1["image"], b2["image"]) and b1["landmarks"].shape == (8, 21, 3) and b1["params"].shape == (8, 15)
    tests = dm.test_dataloader()
    assert len(tests) == 2 and int(next(iter(tests[1]))["domain"][0]) == 1
