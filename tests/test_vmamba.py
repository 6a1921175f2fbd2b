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
    linear_scan,
    selective_scan,
    selective_scan_ref,
    set_traversal,
)
from tests.tolerances import F32_LAYERS, F32_NET


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
    assert torch.allclose(selective_scan_ref(*args), loop, atol=F32_LAYERS)
    assert torch.allclose(selective_scan(*args, parallel=True), loop, atol=F32_LAYERS)
    assert torch.allclose(selective_scan(*args, parallel=False), loop, atol=F32_LAYERS)


def _decays(shape, seed):  # (a, x) of a linear recurrence: a in (0.5, 1) as exp(delta A) gives
    g = torch.Generator().manual_seed(seed)
    return torch.rand(*shape, generator=g) * 0.5 + 0.5, torch.randn(*shape, generator=g)


@pytest.mark.parametrize("L", [1, 2, 7, 16, 64, 100])
def test_linear_scan_equals_mambapy_pscan_forward_and_backward(L):
    from mambapy.pscan import pscan

    a, x = _decays((3, L, 5, 4), seed=L)
    w = torch.randn(3, L, 5, 4, generator=torch.Generator().manual_seed(100 + L))  # a generic upstream gradient
    out = {}
    for name, scan in (("ours", linear_scan), ("mambapy", pscan)):
        aa, xx = a.clone().requires_grad_(), x.clone().requires_grad_()
        h = scan(aa, xx)
        (h * w).sum().backward()
        out[name] = (h.detach(), aa.grad, xx.grad)
    for ours, theirs in zip(out["ours"], out["mambapy"], strict=True):
        torch.testing.assert_close(ours, theirs, rtol=F32_LAYERS, atol=F32_LAYERS)
    h = torch.zeros(3, 5, 4)  # and the recurrence itself
    for t in range(L):
        h = a[:, t] * h + x[:, t]
        torch.testing.assert_close(out["ours"][0][:, t], h, rtol=F32_LAYERS, atol=F32_LAYERS)


def test_linear_scan_gradients_in_float64_and_under_vmap():
    from torch.func import grad, vmap

    a, x = _decays((2, 6, 3), seed=1)
    assert torch.autograd.gradcheck(linear_scan, (a.double().requires_grad_(), x.double().requires_grad_()))
    a, x = _decays((4, 2, 9, 3), seed=2)  # 4 independent problems, vmapped over the first dimension

    def f(a, x):
        return (linear_scan(a, x) ** 2).sum()

    batched = vmap(grad(f, argnums=(0, 1)))(a, x)
    torch.testing.assert_close(vmap(linear_scan)(a, x), torch.stack([linear_scan(a[i], x[i]) for i in range(4)]))
    for i in range(4):
        ai, xi = a[i].clone().requires_grad_(), x[i].clone().requires_grad_()
        ga, gx = torch.autograd.grad(f(ai, xi), (ai, xi))
        torch.testing.assert_close(batched[0][i], ga)
        torch.testing.assert_close(batched[1][i], gx)
    with pytest.raises(ValueError, match=r"linear_scan: a \(2, 3\) and x \(2, 4\); allowed: one shape"):
        linear_scan(torch.ones(2, 3), torch.ones(2, 4))


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
    assert torch.allclose(got, manual, atol=F32_LAYERS)


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
        assert torch.allclose(m(x), base, atol=F32_LAYERS)


def test_parallel_and_loop_models_agree():
    m = _model()
    x = torch.rand(3, 1, 8, 8)
    fast = m(x)
    for ss in (mod for mod in m.modules() if isinstance(mod, SS2D)):
        ss.parallel = False
    assert torch.allclose(m(x), fast, atol=F32_LAYERS)


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


# ----------------------------------------------------------------------------------------- official VMamba weights
def _official_shapes(depths, dims, d_state=1, in_chans=3, num_classes=1000):
    """Parameter names and shapes of the official VMamba (channel-first ln2d model, v2 patch embed, v3 downsampling,
    ``forward_type="v05_noz"``, no SS2D biases), written from its module structure."""
    import math

    c0, n = dims[0], d_state
    s = {"patch_embed.0.weight": (c0 // 2, in_chans, 3, 3), "patch_embed.0.bias": (c0 // 2,),
         "patch_embed.2.weight": (c0 // 2,), "patch_embed.2.bias": (c0 // 2,),
         "patch_embed.5.weight": (c0, c0 // 2, 3, 3), "patch_embed.5.bias": (c0,),
         "patch_embed.7.weight": (c0,), "patch_embed.7.bias": (c0,)}
    for i, (depth, d) in enumerate(zip(depths, dims, strict=True)):
        r = math.ceil(d / 16)
        for j in range(depth):
            p = f"layers.{i}.blocks.{j}."
            s.update({p + "norm.weight": (d,), p + "norm.bias": (d,), p + "op.in_proj.weight": (d, d),
                      p + "op.conv2d.weight": (d, 1, 3, 3), p + "op.x_proj_weight": (4, r + 2 * n, d),
                      p + "op.dt_projs_weight": (4, d, r), p + "op.dt_projs_bias": (4, d), p + "op.A_logs": (4 * d, n),
                      p + "op.Ds": (4 * d,), p + "op.out_norm.weight": (d,), p + "op.out_norm.bias": (d,),
                      p + "op.out_proj.weight": (d, d), p + "norm2.weight": (d,), p + "norm2.bias": (d,),
                      p + "mlp.fc1.weight": (4 * d, d), p + "mlp.fc1.bias": (4 * d,), p + "mlp.fc2.weight": (d, 4 * d),
                      p + "mlp.fc2.bias": (d,)})
        if i < len(depths) - 1:
            s.update({f"layers.{i}.downsample.1.weight": (dims[i + 1], d, 3, 3), f"layers.{i}.downsample.1.bias": (dims[i + 1],),
                      f"layers.{i}.downsample.3.weight": (dims[i + 1],), f"layers.{i}.downsample.3.bias": (dims[i + 1],)})
    s.update({"classifier.norm.weight": (dims[-1],), "classifier.norm.bias": (dims[-1],),
              "classifier.head.weight": (num_classes, dims[-1]), "classifier.head.bias": (num_classes,)})
    return s


def test_official_vmamba_t_converts_key_for_key_at_full_size():
    """VMamba-T (vmamba_tiny_s1l8) on the meta device: every official key maps, none is left over, shapes equal."""
    from lowrank_lit.models.vmamba import convert_official_vmamba

    depths, dims = [2, 2, 8, 2], [96, 192, 384, 768]
    official = {k: torch.empty(shape, device="meta") for k, shape in _official_shapes(depths, dims).items()}
    with torch.device("meta"):
        ours = TinyVMamba(in_chans=3, num_classes=1000, dim=dims, depth=depths, d_state=1, img_size=224, stem_stride=4,
                          norm="ln2d", ssm_bias=False)
    converted = convert_official_vmamba({"model": official}, depths)
    own = ours.state_dict()
    assert set(converted) == set(own)
    assert {k: tuple(v.shape) for k, v in converted.items()} == {k: tuple(v.shape) for k, v in own.items()}
    n = sum(p.numel() for p in ours.parameters())
    assert n == sum(v.numel() for v in official.values()) == 30_249_064  # the paper's table: 30 M
    with pytest.raises(ValueError, match="match no official VMamba name"):
        convert_official_vmamba(official, [2, 2, 9, 2][:3])


def _official_forward(sd, x, depths):
    """The official VMamba forward (channel first, v05_noz) written against the official parameter names."""
    import torch.nn.functional as F

    from lowrank_lit.models.vmamba import cross_merge, cross_scan, selective_scan_ref

    def ln2d(h, key):
        return F.layer_norm(h.permute(0, 2, 3, 1), h.shape[1:2], sd[key + ".weight"], sd[key + ".bias"]).permute(0, 3, 1, 2)

    def ss2d(h, p):
        b, d, H, W = h.shape
        h = F.silu(F.conv2d(F.conv2d(h, sd[p + "in_proj.weight"][:, :, None, None]), sd[p + "conv2d.weight"], padding=1, groups=d))
        xs = cross_scan(h)  # (b, 4, d, H W)
        n, r = sd[p + "A_logs"].shape[1], sd[p + "dt_projs_weight"].shape[2]
        ys = []
        for k in range(4):
            dbl = torch.einsum("cd,bdl->bcl", sd[p + "x_proj_weight"][k], xs[:, k])
            dt, Bm, Cm = dbl.split([r, n, n], 1)
            delta = F.softplus(torch.einsum("dr,brl->bdl", sd[p + "dt_projs_weight"][k], dt) + sd[p + "dt_projs_bias"][k][:, None])
            A = -torch.exp(sd[p + "A_logs"].view(4, d, n)[k])
            y = selective_scan_ref(xs[:, k].transpose(1, 2), delta.transpose(1, 2), A, Bm.transpose(1, 2), Cm.transpose(1, 2),
                                   sd[p + "Ds"].view(4, d)[k])
            ys.append(y.transpose(1, 2))
        y = cross_merge(torch.stack(ys, 1), H, W).view(b, d, H, W)
        return F.conv2d(ln2d(y, p + "out_norm"), sd[p + "out_proj.weight"][:, :, None, None])

    h = F.conv2d(x, sd["patch_embed.0.weight"], sd["patch_embed.0.bias"], stride=2, padding=1)
    h = F.conv2d(F.gelu(ln2d(h, "patch_embed.2")), sd["patch_embed.5.weight"], sd["patch_embed.5.bias"], stride=2, padding=1)
    h = ln2d(h, "patch_embed.7")
    for i, depth in enumerate(depths):
        for j in range(depth):
            p = f"layers.{i}.blocks.{j}."
            h = h + ss2d(ln2d(h, p + "norm"), p + "op.")
            m = F.conv2d(ln2d(h, p + "norm2"), sd[p + "mlp.fc1.weight"][:, :, None, None], sd[p + "mlp.fc1.bias"])
            h = h + F.conv2d(F.gelu(m), sd[p + "mlp.fc2.weight"][:, :, None, None], sd[p + "mlp.fc2.bias"])
        if i < len(depths) - 1:
            h = F.conv2d(h, sd[f"layers.{i}.downsample.1.weight"], sd[f"layers.{i}.downsample.1.bias"], stride=2, padding=1)
            h = ln2d(h, f"layers.{i}.downsample.3")
    return F.linear(ln2d(h, "classifier.norm").mean((2, 3)), sd["classifier.head.weight"], sd["classifier.head.bias"])


def test_converted_tiny_official_weights_give_the_official_logits():
    from lowrank_lit.models.vmamba import convert_official_vmamba

    depths, dims = [1, 2], [8, 16]
    g = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(shape, generator=g) * 0.3 for k, shape in _official_shapes(depths, dims, num_classes=5).items()}
    for k in [k for k in sd if k.endswith("A_logs")]:
        sd[k] = torch.rand(sd[k].shape, generator=g)  # A = -exp(A_log) in (-e, -1)
    x = torch.randn(2, 3, 32, 32, generator=g)
    want = _official_forward(sd, x, depths)
    ours = TinyVMamba(in_chans=3, num_classes=5, dim=dims, depth=depths, d_state=1, img_size=32, stem_stride=4, norm="ln2d",
                      ssm_bias=False, parallel_scan=False).eval()
    ours.load_state_dict(convert_official_vmamba(sd, depths), strict=True)
    torch.testing.assert_close(ours(x), want, rtol=F32_NET, atol=F32_NET)


@pytest.mark.e2e
def test_convert_command_writes_a_source_checkpoint(tmp_path):
    from lowrank_lit.cli import main

    sd = {k: torch.zeros(shape) for k, shape in _official_shapes([1, 2], [8, 16], num_classes=5).items()}
    torch.save({"model": sd}, tmp_path / "official.pth")
    out = tmp_path / "ours.pth"
    assert main(["convert", "vmamba", "--src", str(tmp_path / "official.pth"), "--out", str(out), "--depths", "1", "2"]) == 0
    model = TinyVMamba(in_chans=3, num_classes=5, dim=[8, 16], depth=[1, 2], d_state=1, img_size=32, stem_stride=4,
                       norm="ln2d", ssm_bias=False)
    model.load_state_dict(torch.load(out, weights_only=True), strict=True)
    assert main(["convert", "vmamba", "--src", str(tmp_path / "official.pth"), "--out", str(out)]) == 2  # never overwrites
