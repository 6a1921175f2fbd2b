"""The pure-torch VMamba: scans, cross-scan/merge, traversal permutations (shared by TRUST)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowrank_lit.models.vmamba import (
    PERMUTATIONS,
    SS2D,
    TinyVMamba,
    cross_merge,
    cross_scan,
    selective_scan,
    selective_scan_ref,
    set_traversal,
)


def _scan_inputs(b=2, L=16, d=3, n=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(b, L, d, generator=g)
    delta = F.softplus(torch.randn(b, L, d, generator=g))
    A = -torch.exp(torch.randn(d, n, generator=g))
    B, C = torch.randn(b, L, n, generator=g), torch.randn(b, L, n, generator=g)
    return u, delta, A, B, C, torch.randn(d, generator=g)


def _loop(u, delta, A, B, C, D):  # the recurrence written out, one scalar state at a time
    b, L, d = u.shape
    y = torch.zeros(b, L, d)
    for i in range(b):
        for c in range(d):
            h = torch.zeros(A.shape[1])
            for t in range(L):
                h = torch.exp(delta[i, t, c] * A[c]) * h + delta[i, t, c] * B[i, t] * u[i, t, c]
                y[i, t, c] = (h * C[i, t]).sum() + D[c] * u[i, t, c]
    return y


@pytest.mark.parametrize("L", [16, 12])
def test_scans_equal_the_loop(L):
    args = _scan_inputs(L=L)
    loop = _loop(*args)
    assert torch.allclose(selective_scan_ref(*args), loop, atol=1e-5)
    assert torch.allclose(selective_scan(*args, parallel=True), loop, atol=1e-5)


def test_cross_merge_of_cross_scan_is_4x_and_identity_scan():
    x = torch.randn(2, 3, 4, 5)
    assert torch.allclose(cross_merge(cross_scan(x), 4, 5), 4 * x)
    u, delta, A, B, _, _ = _scan_inputs()
    assert torch.allclose(selective_scan(u, delta, A, B, torch.zeros_like(B), torch.ones(3)), u)


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    return TinyVMamba(**kw).eval()


def test_identity_traversal_reproduces_the_default_model():
    m = _model()
    x = torch.rand(4, 1, 8, 8)
    base = m(x)
    set_traversal(m, (0, 1, 2, 3))
    assert torch.equal(m(x), base)
    set_traversal(m, (1, 0, 2, 3))
    assert not torch.allclose(m(x), base)


def test_non_involution_routes_group_k_to_direction_pi_k():
    torch.manual_seed(0)
    ss = SS2D(6, d_state=3).eval()
    x = torch.randn(2, 6, 4, 4)
    perm = (1, 2, 3, 0)  # not an involution: pi^-1 != pi
    ss.set_traversal(perm)
    got = ss(x)
    # manual routing: direction j is scanned by the group g with perm[g] = j, outputs merged per direction
    u = F.silu(ss.conv2d(ss.in_proj(x)))
    xs = cross_scan(u)
    outs = []
    for j in range(4):
        g = perm.index(j)
        seq = xs[:, j].transpose(1, 2)
        dt, Bm, Cm = (seq @ ss.x_proj[g].T).split([ss.dt_rank, ss.d_state, ss.d_state], -1)
        delta = F.softplus(dt @ ss.dt_proj_weight[g].T + ss.dt_proj_bias[g])
        outs.append(selective_scan_ref(seq, delta, -torch.exp(ss.A_log[g]), Bm, Cm, ss.D[g]).transpose(1, 2))
    y = cross_merge(torch.stack(outs, 1), 4, 4).view(2, 6, 16).transpose(1, 2)
    manual = ss.out_proj(ss.out_norm(y)).transpose(1, 2).view(2, 6, 4, 4)
    assert torch.allclose(got, manual, atol=1e-5)


def test_equal_groups_make_every_permutation_identical():
    m = _model()
    with torch.no_grad():
        for ss in (mod for mod in m.modules() if isinstance(mod, SS2D)):
            for p in (ss.x_proj, ss.dt_proj_weight, ss.dt_proj_bias, ss.A_log, ss.D):
                p.copy_(p[:1].expand_as(p))
    x = torch.rand(3, 1, 8, 8)
    base = m(x)
    for perm in PERMUTATIONS:
        set_traversal(m, perm)
        assert torch.allclose(m(x), base, atol=1e-5)


def test_parallel_and_loop_models_agree():
    m = _model()
    x = torch.rand(3, 1, 8, 8)
    fast = m(x)
    for ss in (mod for mod in m.modules() if isinstance(mod, SS2D)):
        ss.parallel = False
    assert torch.allclose(m(x), fast, atol=1e-5)


def test_bad_inputs():
    m = _model()
    with pytest.raises(ValueError, match="permutation of 0, 1, 2, 3"):
        set_traversal(m, (0, 1, 1, 2))
    with pytest.raises(ValueError, match="no SS2D"):
        set_traversal(torch.nn.Linear(2, 2), (0, 1, 2, 3))
    with pytest.raises(ValueError, match="trained grid"):
        m(torch.rand(2, 1, 16, 16))
    with pytest.raises(ValueError, match="norm"):
        TinyVMamba(norm="ln")


def test_hierarchical_vmamba_stages_and_stem():
    m = TinyVMamba(in_chans=3, dim=[8, 16], depth=[1, 2], d_state=1, img_size=32, stem_stride=4).eval()
    assert len(m.blocks) == 3 and list(m.downsample) == ["1"]
    assert m(torch.rand(2, 3, 32, 32)).shape == (2, 10)
    assert sum(isinstance(mod, SS2D) for mod in m.modules()) == 3 and set_traversal(m, (3, 2, 1, 0)) == 3
    assert [mod.dim for mod in m.modules() if isinstance(mod, SS2D)] == [8, 16, 16]
    with pytest.raises(ValueError, match="as many stage depths"):
        TinyVMamba(dim=[8, 16], depth=[1])
    with pytest.raises(ValueError, match="stem_stride=3; allowed: 1, 2, 4"):
        TinyVMamba(stem_stride=3)
