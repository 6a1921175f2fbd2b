"""3DPE-Gaze building blocks (paper 10): losses, zones, concepts, predictor, frozen prior (card section 5)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lowrank_lit.data.heads import gaze_from_angles, sample_params
from lowrank_lit.methods.gaze_3dpe import (
    ZONE_EDGES,
    ZONES,
    ConceptBank,
    FacePriorGazePredictor,
    ParamEncoder,
    ThreeDPEGaze,
    angular_loss,
    domain_phrase_indices,
    domain_repel_loss,
    gaze_align_loss,
    gaze_zone,
)
from tests.tolerances import F32, F32_LAYERS


def test_angular_loss_limits_scaling_and_gradient():
    g = F.normalize(torch.randn(8, 3), dim=1)
    assert float(angular_loss(g, g)) < 1e-3
    assert float(angular_loss(-g, g)) == pytest.approx(math.pi, abs=1e-3)  # tol: the loss clamps the cosine to 1 - 1e-7, so acos stops 4.5e-4 short of pi
    assert float(angular_loss(3.7 * g + 0, g)) == pytest.approx(float(angular_loss(g, g)), abs=F32)
    pred = g.clone().requires_grad_(True)
    angular_loss(pred, g).backward()
    assert torch.isfinite(pred.grad).all()


def test_align_and_repel_losses():
    torch.manual_seed(0)
    zone_emb = F.normalize(torch.randn(9, 16), dim=1)
    z = torch.zeros(4, 16)  # equal similarities to every zone
    assert float(gaze_align_loss(z, zone_emb, torch.tensor([0, 3, 5, 8]))) == pytest.approx(math.log(9), abs=F32)
    target = torch.tensor([2])
    far = F.normalize(torch.randn(1, 16), dim=1)
    near = F.normalize(far + 5 * zone_emb[2:3], dim=1)
    assert float(gaze_align_loss(near, zone_emb, target)) < float(gaze_align_loss(far, zone_emb, target))
    dom = F.normalize(torch.randn(3, 2, 16), dim=2)
    z = F.normalize(torch.randn(3, 16), dim=1)
    low = -torch.ones(3, 2, 16) * 0  # zero similarity
    assert float(domain_repel_loss(z, low, 0.2)) == 0.0
    zz = F.normalize(dom[:, 0] + 0.3 * torch.randn(3, 16), dim=1).requires_grad_(True)  # close to the first phrase
    assert bool(((zz * dom[:, 0]).sum(1) > 0.2).all())  # above the margin
    assert float(domain_repel_loss(zz.detach(), dom, 0.2)) > 0
    loss = domain_repel_loss(zz, dom[:, :1], 0.2)  # the gradient of that phrase's term alone
    assert float(loss) > 0
    loss.backward()
    step = F.normalize(zz - 0.1 * zz.grad, dim=1)
    assert float((step * dom[:, 0]).sum(1).mean()) < float((zz * dom[:, 0]).sum(1).mean())
    with pytest.raises(ValueError, match="tau=0"):
        gaze_align_loss(z, zone_emb, target.expand(3), tau=0)
    with pytest.raises(ValueError, match="margin=1.5"):
        domain_repel_loss(z, dom, 1.5)


def test_zones_are_deterministic_and_cover_every_zone():
    yaws = (-2 * ZONE_EDGES[0], 0.0, 2 * ZONE_EDGES[0])
    pitches = (2 * ZONE_EDGES[1], 0.0, -2 * ZONE_EDGES[1])
    ang = torch.tensor([[p, y] for p in pitches for y in yaws])
    zones = gaze_zone(gaze_from_angles(ang))
    assert zones.tolist() == list(range(9)) and len(ZONES) == 9
    assert torch.equal(gaze_zone(gaze_from_angles(ang)), zones)
    with pytest.raises(ValueError, match="scheme='5x5'"):
        gaze_zone(gaze_from_angles(ang), "5x5")


def test_predictor_is_permutation_invariant_and_checks_landmarks():
    torch.manual_seed(0)
    pred = FacePriorGazePredictor(32, 21, 16)
    gamma, K = torch.randn(5, 32), torch.randn(5, 21, 3)
    out = pred(gamma, K)
    assert out.shape == (5, 3) and torch.allclose(out.norm(dim=1), torch.ones(5), atol=F32)
    perm = torch.randperm(21)
    assert torch.allclose(pred(gamma, K[:, perm]), out, atol=F32)
    with pytest.raises(ValueError, match="landmarks of shape \\(5, 20, 3\\); allowed: \\(B, n_landmarks=21, 3\\)"):
        pred(gamma, K[:, :20])


def test_concepts_random_and_minilm():
    bank = ConceptBank("random", dim=64)
    assert bank.zone_emb.shape == (9, 64) and torch.allclose(bank.zone_emb @ bank.zone_emb.T, torch.eye(9), atol=F32_LAYERS)
    idx = domain_phrase_indices(sample_params(6, "prior", torch.Generator().manual_seed(0)).flat())
    assert idx.shape == (6, 4) and int(idx.max()) < bank.domain_emb.shape[0]
    with pytest.raises(ValueError, match="text_encoder='clip'; allowed: minilm, random"):
        ConceptBank("clip")
    mini = ConceptBank("minilm")
    assert mini.dim == 384 and torch.allclose(mini.zone_emb.norm(dim=1), torch.ones(9), atol=F32_LAYERS)
    sims = mini.zone_emb @ mini.zone_emb.T
    assert float(sims[0, 2]) < 0.999  # distinct phrases, distinct anchors


def test_frozen_prior_and_concepts_stay_bit_identical():
    torch.manual_seed(0)
    model = ThreeDPEGaze(ParamEncoder(8), variant="full", concepts=ConceptBank("random", dim=32), stage1_epochs=0, gamma_dim=32)
    enc_before = {k: v.clone() for k, v in model.encoder.state_dict().items()}
    bank_before = model.concepts.zone_emb.clone()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    p = sample_params(8, "source", torch.Generator().manual_seed(0))
    from lowrank_lit.data.heads import head_gaze, render_heads

    batch = {"image": render_heads(p), "gaze": head_gaze(p), "params": p.flat()}
    model.train()
    model.log = lambda *a, **k: None  # no trainer attached
    for _ in range(2):
        opt.zero_grad()
        model.training_step(batch, 0).backward()
        assert all(q.grad is None for q in model.encoder.parameters())
        opt.step()
    assert all(torch.equal(v, model.encoder.state_dict()[k]) for k, v in enc_before.items())
    assert torch.equal(bank_before, model.concepts.zone_emb) and not model.encoder.training
    with pytest.raises(ValueError, match="variant='vit'"):
        ThreeDPEGaze(ParamEncoder(8), variant="vit")
    with pytest.raises(ValueError, match="allowed: \\(B, 3 or 1, H, W\\)"):
        model.encoder(torch.zeros(2, 2, 64, 64))
    with pytest.raises(ValueError, match="non-finite"):
        model.encoder(torch.full((1, 3, 64, 64), float("nan")))


def test_margin_from_the_similarity_quantile_is_chosen_once_and_kept():
    """margin_quantile q: at the first step with L_repel the margin becomes the q-quantile of that batch's
    similarities (so 1 - q of the pairs are repelled), logged with the active share; it is a buffer (checkpointed)
    and not chosen again. The fixed margin is left alone without q."""
    from lowrank_lit.data.heads import head_gaze, render_heads
    from lowrank_lit.methods.gaze_3dpe import domain_phrase_indices

    torch.manual_seed(0)
    model = ThreeDPEGaze(ParamEncoder(8), variant="3dgp_repel", concepts=ConceptBank("random", dim=32), stage1_epochs=0,
                         gamma_dim=32, margin_quantile=0.7)
    p = sample_params(16, "source", torch.Generator().manual_seed(0))
    batch = {"image": render_heads(p), "gaze": head_gaze(p), "params": p.flat()}
    logged = {}
    model.log = lambda name, value, **k: logged.__setitem__(name, float(value))
    model.train()
    with torch.no_grad():
        out = model(batch["image"])
        z = F.normalize(model.proj(out["gamma"]), dim=1)
        sims = torch.einsum("bd,bkd->bk", z, model.concepts.domain_emb[domain_phrase_indices(out["params"])])
    model.training_step(batch, 0)
    assert float(model.repel_margin) == pytest.approx(float(torch.quantile(sims.flatten(), 0.7)), abs=F32)
    assert logged["train/repel_active"] == pytest.approx(float((sims > model.repel_margin).float().mean()))
    assert 0.2 <= logged["train/repel_active"] <= 0.34  # 30 % of 64 pairs, up to ties
    assert logged["train/repel_loss"] > 0
    chosen = float(model.repel_margin)
    model.training_step({**batch, "image": batch["image"].flip(-1)}, 1)
    assert float(model.repel_margin) == chosen
    assert {"repel_margin", "margin_chosen"} <= set(model.state_dict())
    fixed = ThreeDPEGaze(ParamEncoder(8), variant="3dgp_repel", concepts=ConceptBank("random", dim=32), stage1_epochs=0,
                         gamma_dim=32, margin=0.2)
    fixed.log = lambda *a, **k: None
    fixed.training_step(batch, 0)
    assert float(fixed.repel_margin) == pytest.approx(0.2)
    for q in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match=f"margin_quantile={q!r}; allowed: None or in \\(0, 1\\)"):
            ThreeDPEGaze(ParamEncoder(8), variant="full", margin_quantile=q)


def test_landmark_error_is_zero_for_the_truth_and_grows_with_the_parameter_error():
    from lowrank_lit.methods.gaze_3dpe import landmark_error

    p = sample_params(32, "prior", torch.Generator().manual_seed(0)).flat()
    assert float(landmark_error(p, p)) == 0.0
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(p.shape, generator=g)
    small, large = (float(landmark_error(p + s * noise, p)) for s in (0.01, 0.1))
    assert 0 < small < large


def test_angular_loss_rejects_a_zero_target():
    pred = torch.tensor([[0.0, 0.0, -1.0], [0.1, 0.0, -1.0]])
    target = torch.tensor([[0.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="angular_loss: target row 1 is the zero vector"):
        angular_loss(pred, target)
