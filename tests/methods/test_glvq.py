"""GLVQ (paper 08): the card's quantizer properties, the quantized layer, the CLI step and the must-show."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lowrank_lit.methods.glvq import GLVQ
from lowrank_lit.nn.glvq import (
    GLVQLinear,
    _cholesky_init,
    _decode,
    _encode,
    babai_round,
    mulaw,
    mulaw_inv,
    quantize_group,
    quantize_linear,
    rtn_quantize,
    salience_bit_allocation,
    select_groups,
    storage_bits,
)
from tests.tolerances import F32, F32_LAYERS, F32_NET, F64

D = torch.float64


def _rand(*shape, seed=0):
    return torch.randn(*shape, dtype=D, generator=torch.Generator().manual_seed(seed))


def test_1_diagonal_G_is_scalar_rounding():
    s = torch.tensor([0.5, 0.25, 1.0, 0.1], dtype=D)
    Y = _rand(4, 50) * 0.4
    Z = babai_round(torch.diag(s), Y, bits=3)
    expected = torch.round(Y / s[:, None]).clamp(-4, 3)
    assert torch.equal(Z, expected)


def test_2_lattice_points_are_fixed_points():
    G = _rand(6, 6, seed=1) + 3 * torch.eye(6, dtype=D)
    Z = torch.randint(-2, 2, (6, 40), generator=torch.Generator().manual_seed(0)).to(D)
    Zq = babai_round(G, G @ Z, bits=2)
    assert torch.equal(Zq, Z)
    torch.testing.assert_close(G @ Zq, G @ Z)


def test_3_babai_error_bound():
    for seed in range(20):
        G = _rand(5, 5, seed=seed)
        Y = _rand(5, 30, seed=100 + seed) * 5
        err = torch.linalg.vector_norm(Y - G @ babai_round(G, Y), dim=0)
        bound = 0.5 * torch.linalg.vector_norm(G, dim=0).sum()
        assert bool((err <= bound + 1e-9).all())


def test_4_orthogonal_G_gives_the_nearest_point():
    Q, _ = torch.linalg.qr(_rand(3, 3, seed=7))
    G = 0.7 * Q
    Y = _rand(3, 25, seed=8) * 2
    Z = babai_round(G, Y)
    offsets = torch.tensor(list(itertools.product(range(-2, 3), repeat=3)), dtype=D).T  # (3, 125)
    for j in range(Y.shape[1]):
        cand = Z[:, j : j + 1] + offsets
        dist = torch.linalg.vector_norm(G @ cand - Y[:, j : j + 1], dim=0)
        assert float(torch.linalg.vector_norm(G @ Z[:, j] - Y[:, j])) <= float(dist.min()) + 1e-12


def test_5_mulaw_invertible_odd_monotone():
    x = torch.linspace(-1, 1, 2001, dtype=D)
    for mu in (10.0, 50.0, 255.0):
        y = mulaw(x, mu)
        torch.testing.assert_close(mulaw_inv(y, mu), x, atol=F32, rtol=0)
        torch.testing.assert_close(mulaw(-x, mu), -y)
        assert bool((y[1:] > y[:-1]).all())
        assert float(mulaw(torch.tensor(1.0, dtype=D), mu)) == pytest.approx(1.0)


def test_6_codes_in_range_and_decode_linear_in_G():
    for bits in (1, 2, 3, 8):
        Z = babai_round(0.01 * torch.eye(4, dtype=D), _rand(4, 100) * 10, bits)
        assert Z.min() >= -(2 ** (bits - 1)) and Z.max() <= 2 ** (bits - 1) - 1
    G1, G2 = _rand(4, 4, seed=2), _rand(4, 4, seed=3)
    Z = torch.randint(-2, 2, (4, 16), generator=torch.Generator().manual_seed(1)).to(D)
    torch.testing.assert_close(_decode(G1 + G2, Z, 0.0, 1.0, (8, 8)), _decode(G1, Z, 0.0, 1.0, (8, 8)) + _decode(G2, Z, 0.0, 1.0, (8, 8)))


def test_7_gradient_wrt_G_matches_finite_differences():
    W, X = _rand(8, 8, seed=4), _rand(50, 8, seed=5)
    H = X.T @ X
    G0 = 0.3 * torch.eye(4, dtype=D) + 0.05 * _rand(4, 4, seed=6)
    Z = _encode(G0, W, 0.0, 1.0, 4, 3)

    def loss(G):
        E = W - _decode(G, Z, 0.0, 1.0, (8, 8))
        return torch.trace(E @ H @ E.T)

    G = G0.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(loss(G), G)
    eps = 1e-6
    fd = torch.zeros_like(G0)
    for i in range(4):
        for j in range(4):
            dG = torch.zeros_like(G0)
            dG[i, j] = eps
            fd[i, j] = (loss(G0 + dG) - loss(G0 - dG)) / (2 * eps)
    torch.testing.assert_close(grad, fd, rtol=F32_NET, atol=F32)


def test_8_keep_best_never_worse_than_the_scalar_init():
    for seed in range(3):
        W = torch.distributions.StudentT(3.0).sample((16, 16)).double() * 0.1
        X = _rand(64, 16, seed=seed)
        H = X.T @ X
        r = quantize_group(W, H, 2, 8, "glvq", steps=30)
        scalar = quantize_group(W, H, 2, 8, "scalar")
        assert r.loss <= r.init_loss + 1e-12
        assert r.init_loss == pytest.approx(scalar.loss)


def test_8b_layer_error_never_above_the_scalar_lattices():
    # two groups seeing the same inputs (H's cross blocks = its diagonal blocks): per group the "learned"
    # blocks err less (delta vs 1.5 delta) but their errors add up, the scalar ones cancel
    X = _rand(40, 2, seed=3).repeat(1, 2)  # (N, 4): columns 2, 3 repeat columns 0, 1
    H = X.T @ X
    W = _rand(6, 4, seed=4)
    delta = 0.1 * _rand(6, 2, seed=5)
    learned = [W[:, :2] - delta, W[:, 2:] - delta]
    scalar = [W[:, :2] - 1.5 * delta, W[:, 2:] + 1.5 * delta]

    def err(blocks):
        E = W - torch.cat(blocks, dim=1)
        return float(torch.trace(E @ H @ E.T))

    assert err([learned[0], scalar[1]]) < err(learned)  # per-group keep-best would keep `learned`
    choice = select_groups(W, H, [[learned[0], scalar[0]], [learned[1], scalar[1]]])
    assert choice == [1, 1] and err(scalar) < 1e-20
    assert select_groups(W, H, [[scalar[0], learned[0]], [scalar[1], learned[1]]]) == [0, 0]
    # the incremental search follows the plain one (full error re-evaluated for every trial switch)
    g = torch.Generator().manual_seed(7)
    W2 = torch.randn(12, 16, dtype=D, generator=g)
    X2 = torch.randn(64, 4, dtype=D, generator=g) @ torch.randn(4, 16, dtype=D, generator=g)
    H2 = X2.T @ X2
    opts = [[W2[:, 4 * k : 4 * k + 4] + 0.3 * torch.randn(12, 4, dtype=D, generator=g) for _ in range(3)] for k in range(4)]

    def full(choice):
        E = W2 - torch.cat([opts[k][c] for k, c in enumerate(choice)], dim=1)
        return float(torch.trace(E @ H2 @ E.T))

    ref, ref_err = min(([[j] * 4, full([j] * 4)] for j in range(3)), key=lambda t: t[1])
    improved = True
    while improved:
        improved = False
        for k in range(4):
            for c in range(3):
                trial = ref[:k] + [c] + ref[k + 1 :]
                if c != ref[k] and full(trial) < ref_err:
                    ref, ref_err, improved = trial, full(trial), True
    got = select_groups(W2, H2, opts)
    assert got == ref and full(got) <= min(full([j] * 4) for j in range(3))
    # the layer: GLVQ's reported output error <= the scalar lattice's, on correlated inputs at 2 and 3 bits
    torch.manual_seed(0)
    lin = nn.Linear(64, 16)
    Xc = torch.randn(200, 8) @ torch.randn(8, 64) + 0.05 * torch.randn(200, 64)
    for bits in (2, 3):
        _, g = quantize_linear(lin, Xc, bits, group_size=16, dim=8, steps=20)
        _, sc = quantize_linear(lin, Xc, bits, group_size=16, dim=8, method="scalar")
        assert g["rel_error"] <= sc["rel_error"] and 0 <= g["scalar_groups"] <= 4


def test_8c_cholesky_init_and_best_of_both_starts():
    # d-vectors with a known covariance: the card's G_0 is c * chol(cov) / 2^(b-1)
    L = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.8, 0.6, 0.0, 0.0], [0.5, 0.3, 0.4, 0.0], [0.1, 0.2, 0.3, 0.9]], dtype=D)
    Y = L @ _rand(4, 4000, seed=21)
    G = _cholesky_init(Y, 2, lambda G: float(((G - 0.6 * L) ** 2).sum()), 64)
    chol = torch.linalg.cholesky(torch.cov(Y))
    torch.testing.assert_close(G / G[0, 0], chol / chol[0, 0], atol=F32, rtol=0)  # the shape of chol(cov)
    assert torch.equal(G, torch.tril(G)) and 0.4 < float(G[0, 0]) < 0.8  # c picked on the loss: 2 * 0.6 / 2
    assert _cholesky_init(torch.zeros(4, 50, dtype=D), 2, lambda G: 0.0, 8) is None  # degenerate covariance
    # correlated d-vectors (each row of W repeats a pattern), every start kept-best
    W = (_rand(32, 1, seed=22) * torch.tensor([1.0, 0.9, 0.7, 0.4] * 8, dtype=D)) + 0.05 * _rand(32, 32, seed=23)
    X = _rand(128, 32, seed=24)
    H = X.T @ X
    runs = {init: quantize_group(W, H, 2, 4, "glvq", steps=40, init=init) for init in ("scalar", "cholesky", "both")}
    scalar = quantize_group(W, H, 2, 4, "scalar")
    assert all(r.loss <= scalar.loss + 1e-9 for r in runs.values())
    assert runs["both"].loss == pytest.approx(min(runs["scalar"].loss, runs["cholesky"].loss), rel=F64)
    assert runs["cholesky"].loss < 0.9 * scalar.loss  # the correlated group gains over the scalar lattice
    with pytest.raises(ValueError, match="init='svd'"):
        quantize_group(W, H, 2, 4, "glvq", init="svd")
    with pytest.raises(ValueError, match="init='svd'"):
        GLVQ(["fc"], init="svd")


def test_9_scale_equivariance():
    W = _rand(8, 8, seed=9) * 0.1
    G0 = 0.05 * torch.eye(4, dtype=D) + 0.01 * _rand(4, 4, seed=11)
    for c in (2.0, 0.5, 7.0):
        assert torch.equal(_encode(c * G0, c * W, 0.0, 1.0, 4, 3), _encode(G0, W, 0.0, 1.0, 4, 3))


def test_10_sdba_counts_and_mean_bits():
    sal = torch.tensor([5.0, 1.0, 3.0, 0.5, 2.0, 4.0])
    bits = salience_bit_allocation(sal, 3, error_of=lambda b: float(((b - 3) * (sal - 2.5)).neg().sum()))
    assert int((bits == 4).sum()) == int((bits == 2).sum()) > 0 and float(bits.float().mean()) == 3.0
    assert set(bits[torch.argsort(sal, descending=True)[:int((bits == 4).sum())]].tolist()) == {4}
    assert torch.equal(salience_bit_allocation(torch.ones(6), 3, error_of=lambda b: 0.0), torch.full((6,), 3))
    with pytest.raises(ValueError, match="avg_bits=1"):
        salience_bit_allocation(sal, 1)


def test_11_storage_formula_and_layer_report():
    torch.manual_seed(0)
    lin = nn.Linear(64, 16)
    q, rep = quantize_linear(lin, torch.randn(100, 64), bits=2, group_size=32, dim=8, steps=5)
    assert q.storage_bits() == 16 * 64 * 2 + 2 * (64 + 1) * 16
    assert rep["bits_per_weight"] == pytest.approx(q.storage_bits() / (16 * 64))
    assert storage_bits(16, 32, torch.tensor([1, 3]), 8) == 16 * 32 * 4 + 2 * 65 * 16


def test_rtn_levels():
    W = _rand(4, 64, seed=12)
    Wq = rtn_quantize(W, 2, 32)
    for r in range(4):
        for g in range(2):
            assert len(torch.unique(Wq[r, g * 32 : (g + 1) * 32])) <= 4


def test_quantized_state_dict_round_trip():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    X = torch.randn(200, 64)
    q, _ = quantize_linear(model[0], X, bits=3, group_size=32, dim=8, steps=10, compand=True)
    model[0] = q
    x = torch.randn(5, 64)
    out = model(x)
    fresh = nn.Sequential(GLVQLinear(64, 32, 32, 8), nn.ReLU(), nn.Linear(32, 10))
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh(x), out)


def test_bad_inputs():
    lin = nn.Linear(64, 10)
    X = torch.randn(50, 64)
    with pytest.raises(ValueError, match="dim=8 does not divide"):
        quantize_linear(nn.Linear(64, 3), X, 2, group_size=2, dim=8)
    with pytest.raises(ValueError, match="group_size=48 does not divide in_features=64"):
        quantize_linear(lin, X, 2, group_size=48)
    with pytest.raises(ValueError, match="bits=9; allowed: an integer in \\[1, 8\\]"):
        quantize_linear(lin, X, 9)
    with pytest.raises(ValueError, match="calibration X must be \\(N, in_features=64\\)"):
        quantize_linear(lin, X[:, :10], 2)
    with pytest.raises(ValueError, match="non-finite"):
        quantize_linear(lin, X * float("nan"), 2)
    q, _ = quantize_linear(lin, X, 2, steps=2)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_linear(q, X, 2)
    with pytest.raises(ValueError, match="method='gptq'"):
        GLVQ(targets=["x"], method="gptq")
    with pytest.raises(ValueError, match="bits=1 with sdba"):
        GLVQ(targets=["x"], bits=1, sdba=True)


def test_heavy_tailed_groups_gain_over_the_scalar_lattice():
    """Card section 4: on Student-t groups GLVQ's output error is well below the best scalar lattice's."""
    torch.manual_seed(0)
    W = torch.distributions.StudentT(3.0).sample((64, 32)).double() * 0.05
    X = torch.randn(512, 32).double() @ (torch.eye(32) + 0.3 * torch.randn(32, 32)).double()
    H = X.T @ X
    g = quantize_group(W, H, 2, 8, "glvq")
    s = quantize_group(W, H, 2, 8, "scalar")
    assert g.loss <= 0.75 * s.loss  # >= 25 % lower (measured: 0.58 x with 200 steps)


# -- the configs through the CLI -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp_ckpt(tmp_path_factory):
    from tests.helpers import fitted_checkpoint

    return fitted_checkpoint("glvq/mlp_digits_fp.yaml", tmp_path_factory.mktemp("glvq_fp"), "--trainer.max_epochs=2")


@pytest.mark.e2e
@pytest.mark.parametrize("variant", ["2bit", "3bit", "2bit_sdba", "2bit_scalar", "2bit_rtn"])
def test_quantization_config_runs(variant, fp_ckpt, run_root):
    import csv

    from tests.helpers import CONFIGS, run_cli

    rc = run_cli("test", "--config", CONFIGS / "glvq" / f"mlp_digits_{variant}.yaml", f"--ckpt_path={fp_ckpt}",
                 "--trainer.callbacks.init_args.steps=3", "--trainer.callbacks.init_args.calib_batches=2",
                 "--run_id", "smoke", run_root=run_root)
    assert rc == 0
    run = run_root / "glvq" / f"mlp_digits_{variant}" / "smoke"
    with open(run / "quantization.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["layer"] for r in rows] == ["backbone.net.0", "backbone.net.2"]
    if variant != "2bit_rtn":
        state = torch.load(run / "quantized.pt", weights_only=True)
        packed, bits = state["backbone.net.0.packed"], state["backbone.net.0.bits"]
        assert packed.dtype == torch.uint8 and "backbone.net.0.codes" not in state
        out = state["backbone.net.0.bias"].numel()
        assert packed.numel() == out * 32 * int(bits.sum()) // 8  # group_size 32: b bits per code, nothing more


# -- must show (card section 4) ---------------------------------------------------------------------

SEEDS = tuple(range(10))  # the seed budget (docs/reproduce.md, "How many seeds")


@pytest.fixture(scope="module")
def digits_mlp_runs(tmp_path_factory):
    """Seeds 0-9: the full-precision MLP trained with the seed, quantized at 2 and 3 bits by GLVQ, the best scalar
    lattice and RTN (calibrated on the seed's 512 training images): (per-layer relative error, test accuracy) per
    variant and seed. One thread, so the numbers do not depend on the machine's core count."""
    import csv

    from tests.helpers import CONFIGS, run_cli

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("glvq_seeds")
    res: dict[tuple[str, int], tuple[list[float], float]] = {}
    try:
        for seed in SEEDS:
            assert run_cli("fit", "--config", CONFIGS / "glvq" / "mlp_digits_fp.yaml", f"--seed_everything={seed}",
                           "--run_id", f"fp{seed}", run_root=root) == 0
            ckpt = root / "glvq" / "mlp_digits_fp" / f"fp{seed}" / "checkpoints" / "last.ckpt"
            for name, bits, method in (("glvq2", 2, "glvq"), ("scalar2", 2, "scalar"), ("rtn2", 2, "rtn"),
                                       ("glvq3", 3, "glvq"), ("scalar3", 3, "scalar"), ("rtn3", 3, "rtn")):
                rid = f"{name}_{seed}"
                assert run_cli("test", "--config", CONFIGS / "glvq" / f"mlp_digits_{bits}bit.yaml", f"--ckpt_path={ckpt}",
                               f"--seed_everything={seed}", f"--trainer.callbacks.init_args.method={method}",
                               "--run_id", rid, run_root=root) == 0
                run = root / "glvq" / f"mlp_digits_{bits}bit" / rid
                with open(run / "quantization.csv") as f:
                    errs = [float(r["rel_error"]) for r in csv.DictReader(f)]
                with open(run / "metrics.csv") as f:
                    acc = [float(r["test/acc"]) for r in csv.DictReader(f) if r.get("test/acc")][-1]
                res[(name, seed)] = (errs, acc)
    finally:
        torch.set_num_threads(threads)
    return res


def _accs(res, name: str) -> list[float]:
    return [res[(name, s)][1] for s in SEEDS]


@pytest.mark.slow
def test_must_show_digits_mlp(digits_mlp_runs):
    """GLVQ's calibration error <= the best scalar lattice's on every layer of every seed, clearly lower at 2 bits
    (the mean ratio per layer <= 0.9); test accuracy GLVQ against RTN at 3 bits judged by the verdict rule (paired
    over seeds 0-9, delta 1 point): equivalent (+0.0011, 95 % interval [-0.0023, +0.0046]), as docs/methods/glvq.md
    states."""
    from lowrank_lit.stats import expect_verdict

    res = digits_mlp_runs
    for seed in SEEDS:
        for b in ("2", "3"):
            assert all(g <= s for g, s in zip(res[("glvq" + b, seed)][0], res[("scalar" + b, seed)][0], strict=True)), res
    for layer in (0, 1):
        ratio = sum(res[("glvq2", s)][0][layer] / res[("scalar2", s)][0][layer] for s in SEEDS) / len(SEEDS)
        assert ratio <= 0.9, (layer, ratio, res)
    expect_verdict("equivalent", _accs(res, "glvq3"), _accs(res, "rtn3"), delta=0.01, claim="GLVQ >= RTN at 3 bits")


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "does not hold; digits MLP at 2 bits, seeds 0-9, one thread: test accuracy GLVQ 0.9618 +- 0.0065 against RTN "
    "0.9693 +- 0.0049 (RTN at 3.0 bits per weight, GLVQ 2.127), GLVQ behind on 9 of 10 seeds by 1-8 of 450 images, "
    "difference -0.0076, 95 % interval [-0.0126, -0.0025] (docs/methods/glvq.md, Not reproduced here)"))
def test_must_show_glvq_2bit_accuracy_at_least_rtn(digits_mlp_runs):
    """The paper's claim on the digits MLP at 2 bits, test accuracy GLVQ >= RTN, judged by the verdict rule (paired
    over seeds 0-9, one thread, delta 1 point): must hold."""
    from lowrank_lit.stats import expect_verdict

    res = digits_mlp_runs
    expect_verdict("holds", _accs(res, "glvq2"), _accs(res, "rtn2"), delta=0.01, claim="GLVQ >= RTN at 2 bits")


@pytest.mark.e2e
def test_char_lm_config_runs(tmp_path):
    import csv

    from tests.helpers import CONFIGS, run_cli

    assert run_cli("fit", "--config", CONFIGS / "is_lowrank" / "char_lm_adamw.yaml", "--trainer.max_steps=2",
                   "--trainer.limit_val_batches=1", "--data.init_args.max_bytes=20000", "--run_id", "fp", run_root=tmp_path) == 0
    ckpt = tmp_path / "is_lowrank" / "char_lm_adamw" / "fp" / "checkpoints" / "last.ckpt"
    assert run_cli("test", "--config", CONFIGS / "glvq" / "char_lm_2bit.yaml", f"--ckpt_path={ckpt}",
                   "--trainer.callbacks.init_args.steps=2", "--trainer.callbacks.init_args.calib_batches=1",
                   "--trainer.limit_test_batches=1", "--data.init_args.max_bytes=20000", "--run_id", "q", run_root=tmp_path) == 0
    with open(tmp_path / "glvq" / "char_lm_2bit" / "q" / "quantization.csv") as f:
        assert len(list(csv.DictReader(f))) == 14  # 2 layers x (q, k, v, o, gate, up, down)


@pytest.mark.parametrize("mu,offset", [((0.0, 255.0, 8.0), 0.0), ((0.0, 255.0, 8.0), 0.5), ((0.0, 0.0, 0.0), 0.0),
                                       ((0.0, 0.0, 0.0), 0.5)], ids=["companded", "companded-offset", "plain", "plain-offset"])
def test_batched_float32_decode_matches_the_float64_reference(mu, offset):
    """GLVQLinear decodes all groups with one batched matmul in float32 (with no companded group, the scales and the
    codebook offset folded into it); it must equal the per-group float64 reference to float32 rounding, with and
    without companding and the half-step offset."""
    from lowrank_lit.nn.glvq import GLVQLinear, decode_groups

    torch.manual_seed(0)
    layer = GLVQLinear(in_features=96, out_features=40, group_size=32, dim=8)
    n_groups, d, L = layer.codes.shape
    layer.set_codes(torch.randint(-2, 2, layer.codes.shape, dtype=torch.int8), 2)
    with torch.no_grad():
        layer.G.copy_(torch.randn(n_groups, d, d) * 0.3)
        layer.mu.copy_(torch.tensor(mu))  # group 0 never companded
        layer.scale.copy_(torch.tensor([0.5, 1.5, 0.02]))
        layer.offset.fill_(offset)
    layer._drop_cache()
    fast, ref = layer.weight_hat(), layer.weight_hat_reference()
    assert fast.dtype == torch.float32 and fast.shape == (40, 96)
    torch.testing.assert_close(fast.double(), ref, rtol=2e-6, atol=2e-6 * float(ref.abs().max()))  # tol: float32 decode, <= 16 ulps
    assert not torch.equal(fast[:, 32:64].double(), ref[:, :32].double())  # groups land in their own columns
    # the same through the function on float64 buffers is the reference itself
    exact = decode_groups(layer.G.double(), layer.codes, layer.mu.double(), layer.scale.double(), 40, 32, offset)
    torch.testing.assert_close(exact, ref, rtol=F64, atol=F64)


# -- bit-packed codes and the compact (decode-on-the-fly) mode ------------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
def test_packed_codes_round_trip_at_b_bits_per_code(bits):
    from lowrank_lit.nn.glvq import pack_codes, unpack_codes

    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (3, 8, 13), generator=g).to(torch.int8)  # 312 codes
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 39 * bits  # 8 codes in b bytes
    assert torch.equal(unpack_codes(packed, bits, codes.numel()), codes.reshape(-1))


def test_packed_layout_is_pinned():
    """2-bit codes -2, -1, 0, 1 are stored as 0, 1, 2, 3 in bits 0-1, 2-3, 4-5, 6-7 of a byte: 0b11100100."""
    from lowrank_lit.nn.glvq import pack_codes

    packed = pack_codes(torch.tensor([-2, -1, 0, 1, 1, 1, 1, 1], dtype=torch.int8), 2)
    assert packed.tolist() == [0b11100100, 0xFF]
    # 3-bit: u = 7, 0, 4, 4, 4, 4, 4, 4 at bits 0, 3, 6, ..., 21 of a 24-bit word
    assert pack_codes(torch.tensor([3, -4, 0, 0, 0, 0, 0, 0]), 3).tolist() == [0b00000111, 0b01001001, 0b10010010]


def _quantized_layer(compand: bool, bits: int = 2):
    from lowrank_lit.nn.glvq import quantize_linear

    torch.manual_seed(0)
    lin = nn.Linear(128, 48)
    layer, _ = quantize_linear(lin, torch.randn(256, 128), bits, 32, 8, "glvq", compand=compand, steps=3)
    return layer


@pytest.mark.parametrize("mixed", [False, True])
def test_compact_mode_equals_the_cached_mode_and_keeps_no_dense_weight(mixed):
    from lowrank_lit.nn.glvq import GLVQLinear

    layer = _quantized_layer(False)
    if mixed:  # SDBA's N-1 / N / N+1 bits: groups of different widths in one packed buffer
        bits = torch.tensor([1, 3, 2, 8])
        g = torch.Generator().manual_seed(1)
        layer.set_codes(torch.stack([torch.randint(-(2 ** (b - 1)), 2 ** (b - 1), layer.codes.shape[1:], generator=g)
                                     for b in bits.tolist()]).to(torch.int8), bits)
    x = torch.randn(5, 7, 128)
    cached = layer(x)
    compact = GLVQLinear(128, 48, 32, 8, compact=True, tile_groups=3)
    compact.load_state_dict(layer.state_dict())
    got = compact(x)
    assert got.shape == (5, 7, 48) and compact._cache is None
    torch.testing.assert_close(got, cached, rtol=F32_LAYERS, atol=F32_LAYERS)
    assert torch.equal(compact.codes, layer.codes)


def test_compact_layer_holds_about_b_bits_per_weight():
    from lowrank_lit.bench import tensor_bytes
    from lowrank_lit.nn.glvq import GLVQLinear

    layer = GLVQLinear(512, 512, 128, 8, bias=False, compact=True)
    layer.set_codes(torch.randint(-2, 2, layer.codes.shape, dtype=torch.int8), 2)
    layer(torch.randn(2, 512))
    held = tensor_bytes(layer)  # packed codes + G, mu, scale, bits
    assert held <= 0.07 * 512 * 512 * 4  # 2/32 = 0.0625 of fp32, plus 4 groups' 8 x 8 generators
    assert layer.packed.numel() == 512 * 512 * 2 // 8


def test_an_unpacked_state_of_an_earlier_version_loads_packed():
    from lowrank_lit.nn.glvq import GLVQLinear

    layer = _quantized_layer(True)
    old = {k: v for k, v in layer.state_dict().items() if k != "packed"}
    old["codes"] = layer.codes  # (groups, d, L) int8, as stored before codes were packed
    fresh = GLVQLinear(128, 48, 32, 8)
    fresh.load_state_dict(old)
    assert torch.equal(fresh.packed, layer.packed) and torch.equal(fresh.weight_hat(), layer.weight_hat())


def test_the_documented_reference_decoder_matches_ours(tmp_path):
    """docs/methods/glvq.md's numpy decoder (<= 50 lines) reads quantized.safetensors and gives our weights."""
    import re

    from lowrank_lit.nn.glvq import save_quantized
    from tests.helpers import ROOT

    text = (ROOT / "docs" / "methods" / "glvq.md").read_text()
    code = re.search(r"<!-- reference decoder -->\n```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 50
    namespace: dict = {}
    exec(compile(code, "reference_decoder", "exec"), namespace)
    model = nn.Sequential(_quantized_layer(True), nn.ReLU(), _quantized_layer(False))
    bits = torch.tensor([1, 3, 2, 8])
    g = torch.Generator().manual_seed(2)
    model[2].set_codes(torch.stack([torch.randint(-(2 ** (b - 1)), 2 ** (b - 1), model[2].codes.shape[1:], generator=g)
                                    for b in bits.tolist()]).to(torch.int8), bits)  # mixed widths, as SDBA gives
    model[2].offset.fill_(0.5)  # the symmetric codebook: points G (z + 1/2)
    path = str(tmp_path / "quantized.safetensors")
    save_quantized(model, path)
    for name in ("0", "2"):
        got = torch.from_numpy(namespace["decode_layer"](path, name))
        torch.testing.assert_close(got, model[int(name)].weight_hat_reference(), rtol=F64, atol=F64)
    assert float(model[0].mu.max()) > 0  # the companded path was exercised


# -- the codebook: integer (the default) or symmetric (a half-step offset) -----------------------------------------

def test_symmetric_codebook_with_a_diagonal_G_is_symmetric_scalar_rounding():
    """G = diag(s), 2 bits: the integer codebook has levels s * {-2, -1, 0, 1}; the symmetric one s * {-3/2, -1/2,
    1/2, 3/2}, each value going to its nearest level (ties aside)."""
    from lowrank_lit.nn.glvq import _decode

    s = torch.tensor([0.5, 2.0], dtype=torch.float64)
    G = torch.diag(s)
    Y = torch.tensor([[-1.2, -0.3, 0.1, 0.9, 5.0], [-9.0, -1.1, 0.2, 1.9, 2.4]], dtype=torch.float64)
    for offset, levels in ((0.0, [-2, -1, 0, 1]), (0.5, [-1.5, -0.5, 0.5, 1.5])):
        Z = babai_round(G, Y, bits=2, offset=offset)
        assert Z.min() >= -2 and Z.max() <= 1  # the stored codes keep the b-bit range
        got = _decode(G, Z, 0.0, 1.0, (5, 2), offset).reshape(5, 2).T  # (d, L) back from the row-major layout
        lv = torch.tensor(levels, dtype=torch.float64)
        want = torch.stack([s[i] * lv[(Y[i, :, None] / s[i] - lv).abs().argmin(dim=1)] for i in range(2)])
        torch.testing.assert_close(G @ (Z + offset), want)
        assert got.shape == (2, 5)


def test_symmetric_codebook_points_are_fixed_points_and_codes_stay_in_range():
    torch.manual_seed(0)
    G = torch.randn(4, 4, dtype=torch.float64) + 3 * torch.eye(4, dtype=torch.float64)
    Z = torch.randint(-4, 4, (4, 50)).double()
    Y = G @ (Z + 0.5)
    assert torch.equal(babai_round(G, Y, bits=3, offset=0.5), Z)


def test_symmetric_codebook_lowers_the_scalar_lattice_error_on_gaussian_weights():
    """The measured reason for the option: on N(0, 1) weights with H = I, 2 bits, the best scalar lattice's relative
    error is 0.1207 symmetric against 0.1469 integer (seed 0, 256 x 32 weights; float64 throughout, so no CPU kernel
    moves these by more than rounding: 1e-3 is the width of one step of the 64-point scale grid, not a spread)."""
    from lowrank_lit.nn.glvq import quantize_group

    W = torch.randn(256, 32, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    H = torch.eye(32, dtype=torch.float64)
    ref = float((W**2).sum())
    err = {cb: quantize_group(W, H, 2, 8, "scalar", codebook=cb).loss / ref for cb in ("integer", "symmetric")}
    assert err["symmetric"] < err["integer"], err
    assert abs(err["integer"] - 0.1469) < 1e-3 and abs(err["symmetric"] - 0.1207) < 1e-3, err


def test_a_symmetric_layer_round_trips_through_its_state_dict_and_an_old_state_reads_as_integer():
    from lowrank_lit.nn.glvq import GLVQLinear, quantize_linear

    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    X = torch.randn(64, 16)
    q, _ = quantize_linear(lin, X, 2, group_size=8, dim=4, method="scalar", codebook="symmetric")
    assert float(q.offset) == 0.5
    fresh = GLVQLinear(16, 8, 8, 4)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh.weight_hat(), q.weight_hat()) and float(fresh.offset) == 0.5
    old = {k: v for k, v in q.state_dict().items() if k != "offset"}  # written before the offset existed
    fresh = GLVQLinear(16, 8, 8, 4)
    fresh.load_state_dict(old)
    assert float(fresh.offset) == 0.0 and not torch.equal(fresh.weight_hat(), q.weight_hat())  # read as integer codes


def test_an_unknown_codebook_is_refused():
    from lowrank_lit.methods.glvq import GLVQ

    with pytest.raises(ValueError, match="GLVQ: codebook='e8'; allowed: integer, symmetric"):
        GLVQ(targets=["net.0"], codebook="e8")
