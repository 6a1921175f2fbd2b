"""TRUST (paper 19): adaptation properties, ranking, merging, per-domain reset, bad inputs, configs, must-show.

The scan, cross-scan/merge, permutation-routing and equal-group properties (card section 5, items 1-4) are
tested on the backbone in tests/test_vmamba.py.
"""

from __future__ import annotations

import csv
import json
import math
import warnings

import pytest
import torch
from torch import nn

from lowrank_lit.data.corruptions import StreamDataset, corrupt
from lowrank_lit.methods.trust import (
    PAPER_TRAVERSALS,
    TRUST,
    TrustNaive,
    merge_mean,
    merge_slerp,
    merge_slerp_per_tensor,
    rank_traversals,
    traversal_entropies,
    trust_params,
)
from lowrank_lit.models.vmamba import PERMUTATIONS, SS2D, TinyVMamba, set_traversal
from lowrank_lit.tta import Tent, TTAModule
from tests.helpers import quiet_trainer
from tests.tolerances import F32, F32_LAYERS


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    m = TinyVMamba(dim=8, d_state=2, **kw)
    with torch.no_grad():  # non-trivial running statistics: a method that used them would differ
        for bn in (mod for mod in m.modules() if isinstance(mod, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return m


def _x(n=16, seed=0):
    return torch.rand(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


def _setup(method, seed=0, **kw):
    model = _model(seed, **kw)
    method.setup(model)
    return model


# -- 5. only the declared parameters change; running statistics unused -----------------------------

def test_only_declared_parameters_change_and_running_stats_are_unused():
    m = _model()
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    trust = TRUST(k=3, lr=1e-2, traversals="paper")
    trust.setup(m)
    declared = {id(p) for p in trust_params(m)}
    names = {n for n, p in m.named_parameters() if id(p) in declared}
    assert not any(".out_norm." in n for n in names) and any(".ss2d.A_log" in n for n in names)
    assert {n for n in names if "norm" in n and ".ss2d." not in n} == {n for n, _ in m.named_parameters()
                                                                       if ("norm" in n and ".ss2d." not in n)}
    trust.forward_and_adapt(_x())
    changed = {n for n, p in m.named_parameters() if not torch.equal(p, before[n])}
    assert changed and changed <= names
    assert not any(n.startswith(("stem.", "head.")) or ".mlp." in n or ".out_norm." in n for n in changed)
    assert all(bn.running_mean is None for bn in m.modules() if isinstance(bn, nn.BatchNorm2d))
    # the same run on a copy whose running statistics differ gives the same logits
    m2 = _model()
    with torch.no_grad():
        for bn in (mod for mod in m2.modules() if isinstance(mod, nn.BatchNorm2d)):
            bn.running_mean.fill_(5.0)
    t2 = TRUST(k=3, lr=1e-2, traversals="paper")
    t2.setup(m2)
    t1 = TRUST(k=3, lr=1e-2, traversals="paper")
    t1.setup(_model())
    x = _x(seed=1)
    torch.testing.assert_close(t1.forward_and_adapt(x), t2.forward_and_adapt(x))


# -- 6. weight averaging ------------------------------------------------------------------------------

@pytest.mark.parametrize("perm", [(0, 1, 2, 3), (1, 2, 3, 0)])
def test_k1_trust_equals_naive_under_that_permutation(perm):
    t, n = TRUST(k=1, lr=1e-2, traversals=[list(perm)]), TrustNaive(lr=1e-2, traversal=perm)
    mt, mn = _setup(t), _setup(n)
    for s in range(3):  # over several batches (Adam state carried)
        x = _x(seed=s)
        torch.testing.assert_close(t.forward_and_adapt(x), n.forward_and_adapt(x), rtol=F32_LAYERS, atol=F32)
    for a, b in zip(mt.parameters(), mn.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=F32_LAYERS, atol=F32)


def test_sequential_carries_weights_and_parallel_averages_independent_steps():
    perms = [(0, 1, 2, 3), (3, 1, 2, 0)]
    x = _x()
    # parallel: the mean of two naive steps taken from the same start
    par = TRUST(k=2, lr=1e-2, mode="parallel", traversals=[list(p) for p in perms], batched=False)
    mp = _setup(par)
    par.forward_and_adapt(x)
    singles = []
    for p in perms:
        n = TrustNaive(lr=1e-2, traversal=p)
        _setup(n)
        n.forward_and_adapt(x)
        singles.append(n.get_params())
    for a, b in zip(par.get_params(), merge_mean(singles), strict=True):
        torch.testing.assert_close(a, b, rtol=F32_LAYERS, atol=F32)
    # sequential: the second snapshot continues from the first (one naive model stepping under both)
    seq = TRUST(k=2, lr=1e-2, mode="sequential", traversals=[list(p) for p in perms])
    _setup(seq)
    seq.forward_and_adapt(x)
    n = TrustNaive(lr=1e-2, traversal=perms[0])
    _setup(n)
    n.forward_and_adapt(x)
    first = n.get_params()
    n.traversal = perms[1]
    n.forward_and_adapt(x)
    for a, b in zip(seq.get_params(), merge_mean([first, n.get_params()]), strict=True):
        torch.testing.assert_close(a, b, rtol=F32_LAYERS, atol=F32)
    assert not all(torch.allclose(a, b) for a, b in zip(seq.get_params(), par.get_params(), strict=True))
    del mp


def test_parallel_resets_to_source_and_parallel_batch_to_the_batch_start():
    perms = [(0, 1, 2, 3), (3, 1, 2, 0)]
    x1, x2 = _x(seed=1), _x(seed=2)

    def naive_from(params, perm, x):  # one naive step (fresh Adam) from the given weights
        n = TrustNaive(lr=1e-2, traversal=perm)
        _setup(n)
        n.load_params(params)
        n.forward_and_adapt(x)
        return n.get_params()

    par = TRUST(k=2, lr=1e-2, mode="parallel", traversals=[list(p) for p in perms], batched=False)
    _setup(par)
    par.snapshot_source()
    source = par.get_params()
    par.forward_and_adapt(x1)
    merged1 = par.get_params()
    torch.testing.assert_close(merged1, merge_mean([naive_from(source, p, x1) for p in perms]), rtol=F32_LAYERS, atol=F32)
    par.forward_and_adapt(x2)
    # batch 2: the first traversal continues from batch 1's merge with a fresh Adam (the official reset follows
    # every traversal), the second starts again from the source weights
    want = merge_mean([naive_from(merged1, perms[0], x2), naive_from(source, perms[1], x2)])
    torch.testing.assert_close(par.get_params(), want, rtol=F32_LAYERS, atol=F32)
    # parallel_batch: both traversals of batch 2 start from batch 1's merge and the Adam state it ended with
    pb = TRUST(k=2, lr=1e-2, mode="parallel_batch", traversals=[list(p) for p in perms], batched=False)
    _setup(pb)
    pb.forward_and_adapt(x1)
    torch.testing.assert_close(pb.get_params(), merged1, rtol=F32_LAYERS, atol=F32)  # batch 1 is the same for both
    state1 = pb.get_state()
    pb.forward_and_adapt(x2)
    singles = []
    for p in perms:
        one = TRUST(k=1, lr=1e-2, traversals=[list(p)])
        _setup(one)
        one.set_state(state1)
        one.forward_and_adapt(x2)
        singles.append(one.get_params())
    torch.testing.assert_close(pb.get_params(), merge_mean(singles), rtol=F32_LAYERS, atol=F32)
    assert not all(torch.allclose(a, b, atol=F32_LAYERS) for a, b in zip(par.get_params(), pb.get_params(), strict=True))


@pytest.mark.parametrize("mode,merge,steps,norm", [("parallel", "mean", 1, "ln2d"), ("parallel", "slerp", 2, "bn"),
                                                   ("parallel_batch", "mean", 1, "bn"),
                                                   ("parallel_batch", "slerp", 2, "ln2d")])
def test_batched_traversals_equal_the_loop(mode, merge, steps, norm):
    """The vmapped K traversals against one after another, over three batches (weights, Adam state, entropies,
    predictions), both on linear_scan so that only the batching differs.

    With BatchNorm every path from an SS2D's ``out_proj.bias`` to the logits passes a BatchNorm that removes a
    per-channel constant, so its gradient is zero up to rounding and Adam turns that rounding into steps of up to
    ``lr``: those biases are compared only under LayerNorm."""
    runs = {}
    for batched in (True, False):
        m = TRUST(k=6, lr=1e-2, steps=steps, mode=mode, merge=merge, traversals="paper", batched=batched)
        _setup(m, parallel_scan=False, norm=norm)
        m.snapshot_source()
        preds = [m.forward_and_adapt(_x(seed=s)) for s in range(3)]
        runs[batched] = (m, preds, list(m.last_entropies))
    (mb, pb, eb), (ml, pl, el) = runs[True], runs[False]
    names = {id(p): n for n, p in ml.model.named_parameters()}
    keep = [i for i, p in enumerate(ml.params) if norm != "bn" or not names[id(p)].endswith("ss2d.out_proj.bias")]
    assert len(keep) == len(ml.params) - (2 if norm == "bn" else 0)  # the two blocks' out_proj biases
    got, want = mb.get_params(), ml.get_params()
    torch.testing.assert_close([got[i] for i in keep], [want[i] for i in keep], rtol=F32_LAYERS, atol=F32_LAYERS)
    torch.testing.assert_close(pb, pl, rtol=F32_LAYERS, atol=F32_LAYERS)
    torch.testing.assert_close(eb, el, rtol=F32_LAYERS, atol=F32_LAYERS)
    sb, sl = mb.optimizer.state_dict()["state"], ml.optimizer.state_dict()["state"]
    assert sb.keys() == sl.keys() and (mode == "parallel" or len(sb) == len(mb.params))
    for i in set(sl) & set(keep):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sb[i][key], sl[i][key], rtol=F32_LAYERS, atol=F32_LAYERS)
    assert not all(torch.equal(a, b) for a, b in zip(mb.get_params(), mb._source_state["params"], strict=True))


def test_batched_traversals_fall_back_to_the_loop_on_unequal_adam_steps():
    m = TRUST(k=2, lr=1e-2, mode="parallel", traversals="paper")
    _setup(m)
    m.snapshot_source()  # the source: a fresh Adam
    m.forward_and_adapt(_x(seed=1))
    assert m._batched_traversals(_x(seed=2), m._source_state) is not None  # every row fresh
    n = TRUST(k=2, lr=1e-2, mode="parallel", traversals="paper")
    _setup(n)
    n.optimizer.zero_grad()
    sum(p.sum() for p in n.params).backward()
    n.optimizer.step()  # the current state has one Adam step, the source none
    n.snapshot_source()
    n.optimizer.state.clear()
    assert n._batched_traversals(_x(seed=2), n._source_state) is None


def test_merges():
    a = [torch.randn(3, 4), torch.randn(5)]
    for t, b in zip(merge_mean([a, a, a]), a, strict=True):
        assert torch.equal(t, b)
    for merge in (merge_slerp, merge_slerp_per_tensor):
        for t, b in zip(merge([a, a], [1.0, 3.0]), a, strict=True):
            torch.testing.assert_close(t, b)
        with pytest.raises(ValueError, match="one positive weight each"):
            merge([a, a], [1.0, 0.0])
    # per tensor, two orthogonal unit vectors, equal weights: the midpoint on the circle (norm 1, 45 degrees)
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    mid = merge_slerp_per_tensor([[e1], [e2]], [1.0, 1.0])[0]
    torch.testing.assert_close(mid, torch.tensor([1.0, 1.0]) / math.sqrt(2))
    # weight 3:1 -> t = 1/4 of the way from e1 (22.5 degrees)
    q = merge_slerp_per_tensor([[e1], [e2]], [3.0, 1.0])[0]
    torch.testing.assert_close(q, torch.tensor([math.cos(math.pi / 8), math.sin(math.pi / 8)]))
    # three snapshots: the running weights give each the same share as a three-way mean would for parallel vectors
    v = [torch.tensor([1.0, 1.0])]
    torch.testing.assert_close(merge_slerp_per_tensor([v, [2 * v[0]], [4 * v[0]]], [1.0, 1.0, 2.0])[0],
                               torch.tensor([2.75, 2.75]))


def test_merge_slerp_is_the_official_shared_angle_form():
    """Two and three models, computed by hand: one angle from the mean cosine, normalised weights, c_0 unused."""
    f = [torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0, 0.0])]
    g = [torch.tensor([0.0, 1.0]), torch.tensor([2.0, 0.0, 0.0])]  # cosines 0 and 1: mean 1/2, angle pi/3
    om = math.pi / 3
    ca, cb = math.sin(0.25 * om) / math.sin(om), math.sin(0.75 * om) / math.sin(om)  # c_1 = 3 / (1 + 3)
    out = merge_slerp([f, g], [1.0, 3.0])
    torch.testing.assert_close(out[0], torch.tensor([ca, cb]), atol=F32, rtol=0)
    torch.testing.assert_close(out[1], torch.tensor([ca + 2 * cb, 0.0, 0.0]), atol=F32, rtol=0)
    # the per-tensor form differs on the same input (the second tensor is interpolated linearly there)
    assert not torch.allclose(merge_slerp_per_tensor([f, g], [1.0, 3.0])[1], out[1], atol=1e-3)  # tol: the forms differ by O(0.1) here
    # three models, weights 2:1:1 -> c = (1/2, 1/4, 1/4); step 1 as above with c_1 = 1/4, step 2 with c_2 = 1/4
    h = [torch.tensor([-1.0, 0.0]), torch.tensor([0.0, 0.0, 3.0])]
    c1 = 0.25
    s1 = [math.sin((1 - c1) * om) / math.sin(om), math.sin(c1 * om) / math.sin(om)]
    m0, m1 = [s1[0], s1[1]], [s1[0] + 2 * s1[1], 0.0, 0.0]  # after step 1
    n0, n1 = math.hypot(*m0), abs(m1[0])
    cos2 = ((-m0[0]) / n0 + 0.0 / n1) / 2  # tensor 0 against (-1, 0); tensor 1 is orthogonal to (0, 0, 3)
    om2 = math.acos(cos2)
    a2, b2 = math.sin(0.75 * om2) / math.sin(om2), math.sin(0.25 * om2) / math.sin(om2)
    out3 = merge_slerp([f, g, h], [2.0, 1.0, 1.0])
    torch.testing.assert_close(out3[0], torch.tensor([a2 * m0[0] - b2, a2 * m0[1]]), atol=F32, rtol=0)
    torch.testing.assert_close(out3[1], torch.tensor([a2 * m1[0], 0.0, 3 * b2]), atol=F32, rtol=0)
    # identical snapshots: angle 0 -> the linear form, which leaves them unchanged
    for t, b in zip(merge_slerp([f, f, f], [1.0, 1.0, 1.0]), f, strict=True):
        torch.testing.assert_close(t, b, atol=F32, rtol=0)


def test_slerp_trust_runs_and_differs_from_mean():
    x = _x()
    outs = {}
    for merge in ("mean", "slerp", "slerp_per_tensor"):
        t = TRUST(k=3, lr=5e-2, merge=merge, traversals="paper")
        _setup(t)
        outs[merge] = t.forward_and_adapt(x)
        assert len(t.last_entropies) == 3 and all(e > 0 for e in t.last_entropies)
    assert not torch.allclose(outs["mean"], outs["slerp"])
    assert not torch.allclose(outs["slerp"], outs["slerp_per_tensor"])


# -- 7. ranking ---------------------------------------------------------------------------------------

def test_rank_traversals_sorted_distinct_and_matches_brute_force():
    m = _model().eval()
    with torch.no_grad():
        m.head.weight.mul_(30.0)  # confident predictions: the 24 entropies are well apart
    x = _x(32)
    ranked = rank_traversals(m, [(x, None)], k=5)
    perms = [p for p, _ in ranked]
    ents = [e for _, e in ranked]
    assert len(set(perms)) == 5 and ents == sorted(ents)
    brute = []
    for p in PERMUTATIONS:
        set_traversal(m, p)
        with torch.no_grad():
            lp = m(x).log_softmax(1)
        brute.append((float(-(lp.exp() * lp).sum(1).mean()), p))
    set_traversal(m, (0, 1, 2, 3))
    brute.sort(key=lambda ep: (round(ep[0], 6), ep[1]))
    assert perms == [p for _, p in brute[:5]]
    assert [round(e, 5) for e in ents] == [round(e, 5) for e, _ in brute[:5]]
    assert all(int(v) == i for mod in m.modules() if isinstance(mod, SS2D) for i, v in enumerate(mod.perm))  # restored


def test_rank_traversals_breaks_ties_by_permutation_order():
    m = _model().eval()
    with torch.no_grad():  # equal groups: every permutation gives the same logits, all entropies tie
        for ss in (mod for mod in m.modules() if isinstance(mod, SS2D)):
            for p in (ss.x_proj, ss.dt_proj_weight, ss.dt_proj_bias, ss.A_log, ss.D):
                p.copy_(p[:1].expand_as(p))
    ranked = rank_traversals(m, [_x()], k=24)
    assert [p for p, _ in ranked] == list(PERMUTATIONS)
    assert len({round(e, 6) for _, e in ranked}) == 1


def test_ranked_traversals_are_recorded_per_domain():
    t = TRUST(k=2, lr=1e-3)
    m = _setup(t)
    t.snapshot_source()
    x = _x()
    expected = [p for p, _ in rank_traversals(m, [x], 2)]
    t.forward_and_adapt(x)
    assert t.order == expected and len(t.rankings) == 24
    t.reset()
    t.domain = 1
    t.forward_and_adapt(_x(seed=3))
    assert [r["domain"] for r in t.rankings] == [0] * 24 + [1] * 24
    assert list(t.tables()) == ["trust_traversals.csv"]


# -- 8. reset per domain --------------------------------------------------------------------------------

def _stream(domains, n_batches=2, batch=16):
    x = _x(n_batches * batch * len(domains), seed=5)
    out = []
    for d, name in enumerate(domains):
        for b in range(n_batches):
            xb = corrupt(x[(d * n_batches + b) * batch:(d * n_batches + b + 1) * batch], name, torch.Generator().manual_seed(b))
            out.append((xb, torch.randint(0, 10, (batch,), generator=torch.Generator().manual_seed(b)),
                        torch.full((batch,), d), torch.zeros(batch, dtype=torch.long)))
    return out


def _run(method, batches, reset):
    from torch.utils.data import DataLoader

    model = _model()
    module = TTAModule(model, method, reset_each_domain=reset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer(inference_mode=False).test(module, DataLoader(StreamDataset(batches), batch_size=None), verbose=False)
    return module


@pytest.mark.e2e
@pytest.mark.parametrize("make", [lambda: TRUST(k=2, lr=1e-2), lambda: Tent(lr=1e-2, norms="batchnorm")])
def test_a_new_domain_starts_from_the_source_with_a_fresh_optimizer(make):
    both = _stream(["gaussian_noise", "contrast"])
    second = [b for b in both if int(b[2][0]) == 1]
    joint = _run(make(), both, reset=True)
    alone = _run(make(), second, reset=True)
    errors_joint = [r["error"] for r in joint.rows if r["domain"] == 1]
    assert errors_joint == [r["error"] for r in alone.rows]
    for a, b in zip(joint.method.get_params(), alone.method.get_params(), strict=True):
        torch.testing.assert_close(a, b)
    continual = _run(make(), both, reset=False)
    assert not all(torch.allclose(a, b) for a, b in zip(continual.method.get_params(), alone.method.get_params(), strict=True))


def test_reset_restores_source_weights_and_clears_adam():
    t = TRUST(k=2, lr=1e-2, traversals="paper")
    _setup(t)
    t.snapshot_source()
    src = t.get_params()
    t.forward_and_adapt(_x())
    assert t.optimizer.state and not all(torch.equal(a, b) for a, b in zip(t.get_params(), src, strict=True))
    t.reset()
    assert not t.optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(t.get_params(), src, strict=True))


# -- bad inputs (card section 6) ------------------------------------------------------------------------

def test_bad_inputs():
    for kw, msg in [({"k": 0}, r"k=0; allowed: an integer in 1..24"), ({"k": 25}, r"k=25; allowed"),
                    ({"lr": 0.0}, r"lr=0.0; allowed: > 0"), ({"steps": 0}, r"steps=0; allowed: an integer >= 1"),
                    ({"merge": "median"}, r"merge='median'; allowed: mean, slerp, slerp_per_tensor"),
                    ({"mode": "batch"}, r"mode='batch'; allowed: sequential, parallel, parallel_batch"),
                    ({"traversals": "best"}, r"traversals='best'; allowed: ranked, paper"),
                    ({"k": 7, "traversals": "paper"}, r"k <= 6"),
                    ({"k": 2, "traversals": [[0, 1, 2, 2], [0, 1, 2, 3]]}, r"permutation of 0, 1, 2, 3"),
                    ({"k": 2, "traversals": [[0, 1, 2, 3]]}, r"exactly k=2"),
                    ({"eval_traversal": [0, 1, 2]}, r"permutation of 0, 1, 2, 3"),
                    ({"batched": "yes"}, r"batched='yes'; allowed: true, false")]:
        with pytest.raises(ValueError, match=msg):
            TRUST(**kw)
    with pytest.raises(ValueError, match=r"lr=-1.0; allowed"):
        TrustNaive(lr=-1.0)
    with pytest.raises(ValueError, match="steps=0"):
        TrustNaive(steps=0)
    with pytest.raises(ValueError, match="k=0; allowed: an integer in 1..24"):
        rank_traversals(_model(), [_x()], 0)
    with pytest.raises(ValueError, match="no SS2D module"):
        TRUST().setup(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)))
    with pytest.raises(ValueError, match="no SS2D module"):
        rank_traversals(nn.Linear(2, 2), [torch.zeros(2, 2)], 1)
    t = TRUST(k=2, traversals="paper")
    _setup(t)
    with pytest.raises(ValueError, match="batch size 1 with a BatchNorm model"):
        t.forward_and_adapt(_x(1))
    with pytest.raises(ValueError, match="differs from the trained grid"):
        t.forward_and_adapt(torch.rand(4, 1, 16, 16))
    # GroupNorm: batch size 1 is fine
    g = TRUST(k=2, traversals="paper")
    _setup(g, norm="gn")
    assert g.forward_and_adapt(_x(1)).shape == (1, 10)
    with pytest.raises(ValueError, match="norms='layer'; allowed: all, batchnorm"):
        Tent(norms="layer")
    with pytest.raises(ValueError, match="traversal_entropies: batches is empty"):
        traversal_entropies(_model(), [])
    assert PAPER_TRAVERSALS[0] == (0, 1, 2, 3) and len(set(PAPER_TRAVERSALS)) == 6


# -- configs through the CLI (source checkpoint made here) ----------------------------------------------

@pytest.fixture(scope="module")
def source_root(tmp_path_factory):
    from tests.helpers import CONFIGS, run_cli

    root = tmp_path_factory.mktemp("trust_source")
    for src in ("source_vmamba_digits", "source_vmamba_digits_ln"):
        rc = run_cli("fit", "--config", CONFIGS / "trust" / f"{src}.yaml", "--trainer.max_epochs=1",
                     "--test_after_fit=false", run_root=root)
        assert rc == 0
    return root


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["digits_c_trust", "digits_c_naive", "digits_c_tent", "digits_c_source", "digits_c_trust_ln"])
def test_tta_config_runs(name, source_root, run_root):
    from tests.helpers import CONFIGS, run_cli

    src = "source_vmamba_digits_ln" if name.endswith("_ln") else "source_vmamba_digits"
    ckpt = source_root / "trust" / src / "seed{seed}" / "checkpoints" / "last.ckpt"
    rc = run_cli("test", "--config", CONFIGS / "trust" / f"{name}.yaml", f"--model.init_args.source_ckpt={ckpt}",
                 "--data.init_args.batches_per_visit=2", "--run_id", "smoke", run_root=run_root)
    assert rc == 0
    run = run_root / "trust" / name / "smoke"
    with open(run / "tta_batches.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 5 * 2
    with open(run / "metrics.csv") as f:
        header = next(csv.reader(f))
    assert {"test/acc_gaussian_noise", "test/acc_shift", "test/acc_domains"} <= set(header)
    assert (run / "trust_traversals.csv").is_file() == name.startswith("digits_c_trust")


# -- must show (card section 4) -----------------------------------------------------------------------

@pytest.mark.slow
def test_must_show_digits_c(tmp_path):
    """Our acceptance criterion over seeds 0-9, the seed budget (source TinyVMamba trained and stream drawn with each
    seed): mean accuracy over the five corruptions of TRUST and TRUST-naive >= source + 0.15, and TRUST >=
    TRUST-naive - 0.02, each judged by the verdict rule paired by seed with delta = 1 point. All three hold (+0.306,
    95 % interval [+0.289, +0.324]; +0.309, [+0.293, +0.325]; -0.002, [-0.009, +0.004]); at seeds 0-2 the third was
    inconclusive."""
    from lowrank_lit.report import last_values
    from lowrank_lit.stats import expect_verdict
    from tests.helpers import CONFIGS, run_cli

    acc: dict[str, list[float]] = {}
    for seed in range(10):  # the seed budget (docs/reproduce.md, "How many seeds")
        assert run_cli("fit", "--config", CONFIGS / "trust" / "source_vmamba_digits.yaml", f"--seed_everything={seed}",
                       f"--run_id=seed{seed}", "--test_after_fit=false", run_root=tmp_path) == 0
        ckpt = tmp_path / "trust" / "source_vmamba_digits" / "seed{seed}" / "checkpoints" / "last.ckpt"
        for name in ("source", "naive", "trust"):
            assert run_cli("test", "--config", CONFIGS / "trust" / f"digits_c_{name}.yaml", f"--seed_everything={seed}",
                           f"--model.init_args.source_ckpt={ckpt}", f"--run_id=seed{seed}", run_root=tmp_path) == 0
            vals = last_values(tmp_path / "trust" / f"digits_c_{name}" / f"seed{seed}" / "metrics.csv")
            acc.setdefault(name, []).append(vals["test/acc_domains"])
    print(acc)
    expect_verdict("holds", acc["trust"], acc["source"], margin=0.15, delta=0.01, claim="TRUST >= source + 0.15")
    expect_verdict("holds", acc["naive"], acc["source"], margin=0.15, delta=0.01, claim="TRUST-naive >= source + 0.15")
    expect_verdict("holds", acc["trust"], acc["naive"], margin=-0.02, delta=0.01, claim="TRUST >= TRUST-naive - 0.02")


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "does not hold; LayerNorm TinyVMamba, batch 64, seeds 0-9: TRUST (sequential, mean) 0.520 +- 0.095 against Tent "
    "0.562 +- 0.057, lower on 8 of 10 seeds, difference -0.043, 95 % interval [-0.077, -0.008] against the margin "
    "+0.01 (docs/methods/trust.md, Not reproduced here)"))
def test_must_show_layernorm_trust_beats_tent(tmp_path):
    """The paper's claim on a LayerNorm VMamba (no batch statistics to exploit): TRUST >= Tent + 0.01 on the
    mean accuracy over the five corruptions, seeds 0-9 (the seed budget), batch 64, judged by the verdict rule with
    delta = 1 point: must hold."""
    from lowrank_lit.report import last_values
    from lowrank_lit.stats import expect_verdict
    from tests.helpers import CONFIGS, run_cli

    acc: dict[str, list[float]] = {}
    tent = {"class_path": "lowrank_lit.tta.Tent", "init_args": {"lr": 1e-3, "norms": "all"}}
    for seed in range(10):  # the seed budget (docs/reproduce.md, "How many seeds")
        assert run_cli("fit", "--config", CONFIGS / "trust" / "source_vmamba_digits_ln.yaml", f"--seed_everything={seed}",
                       f"--run_id=seed{seed}", "--test_after_fit=false", run_root=tmp_path) == 0
        ckpt = tmp_path / "trust" / "source_vmamba_digits_ln" / "seed{seed}" / "checkpoints" / "last.ckpt"
        for name, extra in (("trust", []), ("tent", [f"--model.init_args.method={json.dumps(tent)}"])):
            assert run_cli("test", "--config", CONFIGS / "trust" / "digits_c_trust_ln.yaml", f"--seed_everything={seed}",
                           f"--model.init_args.source_ckpt={ckpt}", f"--run_id={name}{seed}", *extra, run_root=tmp_path) == 0
            vals = last_values(tmp_path / "trust" / "digits_c_trust_ln" / f"{name}{seed}" / "metrics.csv")
            acc.setdefault(name, []).append(vals["test/acc_domains"])
    print(acc)
    expect_verdict("holds", acc["trust"], acc["tent"], margin=0.01, delta=0.01, claim="TRUST >= Tent + 0.01 (LayerNorm VMamba)")


def test_imagenet_c_stream_from_a_folder(tmp_path):
    from PIL import Image

    from lowrank_lit.data.imagenet_c import ImageNetCDataModule

    for c in ("fog", "snow"):
        for k, wnid in enumerate(("n01", "n02")):
            folder = tmp_path / c / "5" / wnid
            folder.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (40, 30), (40 * k, 10 * i, 0)).save(folder / f"{i}.png")
    dm = ImageNetCDataModule(str(tmp_path), corruptions=["fog", "snow"], batch_size=4, img_size=16, resize=20, num_workers=0,
                             recurrences=2)
    dm.setup("test")
    batches = list(dm.test_dataloader())
    assert [(int(b[2][0]), int(b[3][0]), len(b[1])) for b in batches] == [(0, 0, 4), (0, 0, 2), (1, 0, 4), (1, 0, 2),
                                                                           (0, 1, 4), (0, 1, 2), (1, 1, 4), (1, 1, 2)]
    assert batches[0][0].shape == (4, 3, 16, 16) and sorted(torch.cat([b[1] for b in batches[:2]]).tolist()) == [0, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="has no fog/3 folder"):
        ImageNetCDataModule(str(tmp_path), corruptions=["fog"], severity=3).setup("test")
    with pytest.raises(ValueError, match="severity=6; allowed: 1..5"):
        ImageNetCDataModule(str(tmp_path), severity=6)
