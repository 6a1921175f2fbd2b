"""Shallow Diffuse (paper 18): DDIM, ring keys, PMP denoisers, consistency, Tree-Ring limit, detection, must-show."""

from __future__ import annotations

import math

import pytest
import torch

from lowrank_lit.methods.shallow_diffuse import (
    ATTACKS,
    DDIMSampler,
    RingKey,
    ShallowDiffuse,
    attack,
    null_space_fraction,
    pmp_jacobian,
    rank_ratio,
    tree_ring,
)
from lowrank_lit.models.denoisers import (
    DigitsGaussianPMP,
    DigitsMoLRG,
    GaussianPMP,
    MixtureLowRankGaussianPMP,
    linear_alphas_cumprod,
)
from tests.tolerances import F32, F64


class _ConstEps:
    def __init__(self, shape, seed=0):
        self.e = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)

    def eps(self, x, t):
        return self.e.expand_as(x)


@pytest.fixture(scope="module")
def gauss():
    return DigitsGaussianPMP(16)


# -- 1. DDIM -------------------------------------------------------------------------------------------

def test_ddim_step_and_inversion_are_exact_inverses_for_constant_eps():
    ac = linear_alphas_cumprod()
    s = DDIMSampler(_ConstEps((1, 1, 4, 4)), ac, 50)
    x = torch.randn(1, 1, 4, 4, dtype=torch.float64)
    for j in (1, 15, 49):
        back = s.invert(s.sample(x, j, j - 1), j - 1, j)
        assert torch.allclose(back, x, atol=F64)
    assert s.grid[:3] == (0, 20, 40) and s.grid[-1] == 980 and len(s.grid) == 50


def test_gaussian_key_barely_moves_the_image(gauss):
    s = DDIMSampler(gauss, gauss.alphas_cumprod, 50)
    x_T = torch.randn(4, 1, 16, 16, generator=torch.Generator().manual_seed(0))
    sd = ShallowDiffuse(s, RingKey(16, 3), 0.3)
    x_star = s.sample(x_T, None, sd.i_star)
    delta = sd.key.inject(x_star) - x_star
    moved = s.sample(x_star + delta, sd.i_star, 0) - s.sample(x_star, sd.i_star, 0)
    assert float(moved.norm() / delta.norm()) <= 0.05


# -- 2-3. keys -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("high", [True, False])
def test_inject_touches_only_the_mask_and_its_mirror(high):
    key = RingKey(16, 3, high_freq=high)
    x = torch.randn(2, 1, 16, 16, dtype=torch.float64)
    before, after = key.spectrum(x), key.spectrum(key.inject(x))
    m = key.mask
    idx = torch.arange(16)
    if high:
        mirror = m[(-idx) % 16][:, (-idx) % 16]
    else:  # in the shifted frame, k -> -k maps index i to (16 - i) mod 16 around the centre
        mirror = m[(16 - idx) % 16][:, (16 - idx) % 16]
    outside = ~(m | mirror)
    assert torch.allclose(before[:, outside], after[:, outside], atol=F32)
    # both masks are symmetric under k -> -k and the ring key takes one value per ring, so Re() keeps exactly the
    # key's real part there: the distance left is the mean |Im W|, the same for every image
    left = float(key.key[m].imag.abs().mean())
    assert torch.allclose(key.distance(key.inject(x)), torch.full((2,), left, dtype=torch.float64), atol=F64)
    assert left < float(key.distance(x).min())


def test_symmetric_key_on_symmetric_mask_is_recovered_exactly_and_idempotent():
    key = RingKey(16, 3, high_freq=True)
    # the high-frequency mask around (8, 8) is symmetric under k -> -k; a real, symmetric key is Hermitian there
    key.key = key.key.real.to(torch.complex128)
    x = torch.randn(3, 1, 16, 16, dtype=torch.float64)
    once = key.inject(x)
    assert float(key.distance(once).max()) < 1e-5
    assert torch.allclose(key.inject(once), once, atol=F64)


def test_key_rings_are_constant_and_reproducible():
    k1, k2 = RingKey(16, 3, key_rng=7), RingKey(16, 3, key_rng=7)
    assert torch.equal(k1.key, k2.key) and not torch.equal(k1.key, RingKey(16, 3, key_rng=8).key)
    yy, xx = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    d2 = (yy - 8) ** 2 + (xx - 8) ** 2
    for i in range(1, 4):
        ring = (d2 <= i * i) & (d2 > (i - 1) ** 2)
        vals = k1.key[ring]
        assert torch.allclose(vals, vals[:1].expand_as(vals))
    assert k1.key[8, 8] == k1.key[d2 <= 0][0]


# -- 4-5. PMP --------------------------------------------------------------------------------------------

def test_gaussian_pmp_closed_form_jacobian_and_rank(gauss):
    x = torch.randn(1, 1, 16, 16, dtype=torch.float64)
    cov = (gauss.evecs * gauss.evals) @ gauss.evecs.T
    for t in (0, 300, 900):
        a = float(gauss.alphas_cumprod[t])
        gain = math.sqrt(a) * cov @ torch.linalg.inv(a * cov + (1 - a) * torch.eye(256, dtype=torch.float64))
        closed = gauss.mean + gain @ (x.flatten() - math.sqrt(a) * gauss.mean)
        assert torch.allclose(gauss.pmp(x, t).flatten(), closed, atol=F64)
        J = pmp_jacobian(gauss, x[0], t)
        assert torch.allclose(J, gain, atol=F32)
    assert rank_ratio(pmp_jacobian(gauss, x[0], 0)) == 1.0


def test_consistency_bound_and_null_space_of_a_high_frequency_key(gauss):
    x = torch.randn(1, 1, 16, 16, dtype=torch.float64)
    t = 300
    J = pmp_jacobian(gauss, x[0], t)
    key = RingKey(16, 3)
    delta = (key.inject(x) - x)[0].flatten()
    moved = gauss.pmp(x + delta.view(1, 1, 16, 16), t).flatten() - gauss.pmp(x, t).flatten()
    _, s, vh = torch.linalg.svd(J)
    v = vh[s > 1e-2 * s[0]]
    assert float(moved.norm()) <= float((v @ delta).norm()) * float(s[0]) + 1e-6 + float(s[s <= 1e-2 * s[0]].max()) * float(delta.norm())
    assert null_space_fraction(J, delta) >= 0.9
    low = (RingKey(16, 2, high_freq=False).inject(x) - x)[0]
    assert null_space_fraction(J, low) < null_space_fraction(J, delta)


def test_molrg_pmp_matches_the_explicit_mixture():
    g = torch.Generator().manual_seed(0)
    d, r = 16, 2
    means = torch.randn(3, d, generator=g, dtype=torch.float64)
    bases = torch.linalg.qr(torch.randn(3, d, r, generator=g, dtype=torch.float64))[0]
    var = torch.rand(3, r, generator=g, dtype=torch.float64) + 0.5
    w = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    m = MixtureLowRankGaussianPMP(means, bases, var, w, (1, 4, 4), delta=1e-2)
    x = torch.randn(2, 1, 4, 4, generator=g, dtype=torch.float64)
    t = 400
    a = float(m.alphas_cumprod[t])
    comps, logs = [], []
    for k in range(3):
        cov = bases[k] @ torch.diag(var[k]) @ bases[k].T + 1e-2 * torch.eye(d, dtype=torch.float64)
        c = a * cov + (1 - a) * torch.eye(d, dtype=torch.float64)
        comp = GaussianPMP(means[k], cov, (1, 4, 4))
        comps.append(comp.pmp(x, t).flatten(1))
        dist = torch.distributions.MultivariateNormal(math.sqrt(a) * means[k], c)
        logs.append(dist.log_prob(x.flatten(1)) + math.log(w[k]))
    resp = torch.softmax(torch.stack(logs, 1), 1)
    expected = (resp[..., None] * torch.stack(comps, 1)).sum(1)
    assert torch.allclose(m.pmp(x, t).flatten(1), expected, atol=F64)


# -- 6. Tree-Ring limit ------------------------------------------------------------------------------------

def test_tree_ring_injects_into_x_T(gauss):
    s = DDIMSampler(gauss, gauss.alphas_cumprod, 50)
    tr = tree_ring(s, 16, 2)
    assert tr.i_star == 49 and not tr.key.high_freq
    x_T = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    marked, _ = tr.embed_server(x_T)
    assert torch.allclose(marked, s.sample(tr.key.inject(x_T), 49, 0), atol=F32)


# -- 7. detection ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def molrg():
    return DigitsMoLRG(16)


def test_detection_auc_is_one_on_clean_images(molrg):
    from torchmetrics.functional.classification import binary_auroc

    s = DDIMSampler(molrg, molrg.alphas_cumprod, 50)
    sd = ShallowDiffuse(s, RingKey(16, 3), 0.3)
    x_T = torch.randn(50, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    marked, clean = sd.embed_server(x_T)
    sw, sc = sd.detect(marked, p_value=True), sd.detect(clean, p_value=True)
    labels = torch.cat([torch.ones(50), torch.zeros(50)]).long()
    assert float(sw["score"].min()) > float(sc["score"].max())  # perfectly separated: AUC = 1
    assert float(binary_auroc(torch.cat([sw["score"], sc["score"]]), labels)) == pytest.approx(1.0, abs=F32)
    assert float(sw["p_value"].median()) < float(sc["p_value"].median())
    user = sd.embed_user(clean[:5])
    assert float(sd.detect(user)["score"].min()) > float(sc["score"].max())


# -- bad inputs --------------------------------------------------------------------------------------------

def test_bad_inputs(gauss):
    ac = linear_alphas_cumprod()
    with pytest.raises(ValueError, match="decreasing in \\(0, 1\\]"):
        DDIMSampler(gauss, ac.flip(0), 50)
    with pytest.raises(ValueError, match="steps=7; allowed: a divisor of T=1000"):
        DDIMSampler(gauss, ac, 7)
    s = DDIMSampler(gauss, ac, 50)
    for kw, msg in [({"t_frac": 0.0}, r"t_frac=0.0; allowed: \(0, 1\]"), ({"t_frac": 1.5}, r"t_frac=1.5")]:
        with pytest.raises(ValueError, match=msg):
            ShallowDiffuse(s, RingKey(16, 3), **kw)
    for args, msg in [((16, 0), "radius=0"), ((16, 8), "radius=8; allowed: an integer in 1..7")]:
        with pytest.raises(ValueError, match=msg):
            RingKey(*args)
    key = RingKey(16, 3, channel=2)
    with pytest.raises(ValueError, match="channel=2; allowed: 0..0"):
        key.inject(torch.zeros(1, 1, 16, 16))
    with pytest.raises(ValueError, match="square"):
        RingKey(16, 3).inject(torch.zeros(1, 1, 16, 8))
    with pytest.raises(ValueError, match="differs from the key's res=16"):
        RingKey(16, 3).inject(torch.zeros(1, 1, 8, 8))
    sd = ShallowDiffuse(s, RingKey(16, 3), 0.3)
    other = ShallowDiffuse(DDIMSampler(gauss, ac, 25), sd.key, 0.3)
    with pytest.raises(ValueError, match="embedded on grid"):
        _with_key(sd, other).detect(torch.zeros(1, 1, 16, 16))
    with pytest.raises(ValueError, match="name='rotate'"):
        attack(torch.zeros(1, 1, 16, 16), "rotate")
    with pytest.raises(ValueError, match="i_from=60; allowed: 0..49"):
        s.sample(torch.zeros(1, 1, 16, 16), 60, 0)
    assert set(ATTACKS) >= {"clean", "quantize8", "png", "noise0.01", "noise0.05", "jpeg", "jpeg90", "blur", "crop_resize"}


def test_saved_file_attacks_are_what_a_saved_image_holds():
    """PNG is lossless on 8 bits: the round trip through a real PNG file equals ``quantize8`` exactly, and both clip
    what lies outside [-1, 1] as the pipeline's post-processing does; JPEG loses more at quality 75 than at 90."""
    g = torch.Generator().manual_seed(0)
    x = 1.3 * torch.randn(3, 2, 16, 16, generator=g).clamp(-2, 2)  # some pixels outside [-1, 1]
    png, q8 = attack(x, "png"), attack(x, "quantize8")
    assert torch.equal(png, q8)
    inside = x.abs() <= 1
    assert float((q8 - x)[inside].abs().max()) <= 1 / 127.5 / 2 + 1e-6  # half an 8-bit step
    assert torch.equal(q8[~inside], x[~inside].sign())  # clipped to the range a saved image has
    err = {q: float((attack(x.clamp(-1, 1), name) - x.clamp(-1, 1)).abs().mean()) for q, name in ((75, "jpeg"), (90, "jpeg90"))}
    assert 0 < err[90] < err[75]


def _with_key(embedded: ShallowDiffuse, other: ShallowDiffuse) -> ShallowDiffuse:
    """``other``'s sampler with the key metadata ``embedded`` wrote (a grid mismatch at detection)."""
    embedded.embed_user(torch.zeros(1, 1, 16, 16))  # stamps the key with the embedding grid
    other.key = embedded.key
    return other


# -- configs --------------------------------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.parametrize("name", ["molrg_shallow_diffuse", "molrg_tree_ring", "gaussian_shallow_diffuse"])
def test_config_runs(name, run_root, checked_figures):
    import csv

    from tests.helpers import CONFIGS, run_cli

    rc = run_cli("test", "--config", CONFIGS / "shallow_diffuse" / f"{name}.yaml", "--data.init_args.n=6",
                 "--data.init_args.batch_size=3", "--model.init_args.attacks=[clean,jpeg]", "--model.init_args.rank_ts=[0,300]",
                 "--run_id=smoke", run_root=run_root)
    assert rc == 0
    run = run_root / "shallow_diffuse" / name / "smoke"
    with open(run / "watermark_attacks.csv") as f:
        assert [r["attack"] for r in csv.DictReader(f)] == ["clean", "jpeg"]
    assert (run / "grid.png").is_file() and (run / "roc.png").is_file()
    roc = [p for p in checked_figures if p.endswith("roc.png")]
    assert roc and all(not checked_figures[p] for p in checked_figures), checked_figures  # titled, labelled, drawn


@pytest.mark.e2e
def test_unet_training_and_evaluation_configs(run_root):
    from tests.helpers import CONFIGS, run_cli

    assert run_cli("fit", "--config", CONFIGS / "shallow_diffuse" / "unet_digits_train.yaml", "--trainer.max_steps=2",
                   "--trainer.max_epochs=-1", "--trainer.limit_val_batches=1", "--run_id=unet", run_root=run_root) == 0
    ckpt = run_root / "shallow_diffuse" / "unet_digits_train" / "unet" / "checkpoints" / "last.ckpt"
    assert run_cli("test", "--config", CONFIGS / "shallow_diffuse" / "unet_shallow_diffuse.yaml", f"--model.init_args.denoiser.init_args.ckpt={ckpt}",
                   "--data.init_args.n=4", "--data.init_args.batch_size=4", "--model.init_args.attacks=[clean]",
                   "--model.init_args.rank_ts=[300]", "--model.init_args.steps=10", "--run_id=smoke", run_root=run_root) == 0


# -- must show (card section 4) -------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.no_verdict("one evaluation over 100 initial noises (seed 0) against fixed bars (20 dB, AUC 0.99): no seeds to judge over")
def test_must_show_molrg(tmp_path):
    """Our acceptance criterion (MoLRG denoiser, 100 initial noises, seed 0): Shallow Diffuse PSNR >= Tree-Ring +
    20 dB, clean AUC >= 0.99, null-space fraction >= 0.9 and above Tree-Ring's, class flips <= 5 %."""
    from lowrank_lit.report import last_values
    from tests.helpers import CONFIGS, run_cli

    vals = {}
    for name in ("molrg_shallow_diffuse", "molrg_tree_ring"):
        assert run_cli("test", "--config", CONFIGS / "shallow_diffuse" / f"{name}.yaml", "--run_id=must", run_root=tmp_path) == 0
        vals[name] = last_values(tmp_path / "shallow_diffuse" / name / "must" / "metrics.csv")
    sd, tr = vals["molrg_shallow_diffuse"], vals["molrg_tree_ring"]
    print({k: {m: v[m] for m in ("test/psnr", "test/flip_rate", "test/null_fraction", "test/auc_clean")} for k, v in vals.items()})
    assert sd["test/psnr"] >= tr["test/psnr"] + 20
    assert sd["test/auc_clean"] >= 0.99
    assert sd["test/null_fraction"] >= 0.9 and sd["test/null_fraction"] > tr["test/null_fraction"]
    assert sd["test/flip_rate"] <= 0.05
