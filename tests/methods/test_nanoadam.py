"""NanoAdam (paper 12): the card's optimizer properties, the split-digits setup and the must-show."""

from __future__ import annotations

import copy
import statistics
import warnings

import pytest
import torch
from torch import nn

from lowrank_lit.methods.nanoadam import (
    NanoAdam,
    bottom_k_mask,
    grad_weight_correlation,
    kept_count,
    select_indices,
)
from lowrank_lit.optim import matrix_param_groups
from tests.helpers import quiet_trainer
from tests.tolerances import F32


def _problem(seed=0, shape=(12, 10)):
    g = torch.Generator().manual_seed(seed)
    w = nn.Parameter(torch.randn(*shape, generator=g))
    targets = [torch.randn(shape[1], 3, generator=g) for _ in range(30)]
    return w, targets


def _loss(w, t):
    return (w @ t).tanh().pow(2).sum() + (w**2).sum() * 0.01


def _run(opt_fn, steps=12, seed=0, shape=(12, 10)):
    w, targets = _problem(seed, shape)
    opt = opt_fn([w])
    snaps = [w.detach().clone()]
    for t in range(steps):
        opt.zero_grad()
        _loss(w, targets[t % len(targets)]).backward()
        opt.step()
        snaps.append(w.detach().clone())
    return w, opt, snaps


def test_1_exactly_k_entries_change_and_2_they_are_the_smallest():
    k = kept_count(120, 0.1)
    assert k == 12
    w, targets = _problem()
    opt = NanoAdam([w], lr=1e-2, density=0.1, mask_interval=5)
    for t in range(11):
        before = w.detach().clone()
        if t % 5 == 0:  # the set chosen at this refresh: the k smallest |theta| now
            expected = torch.sort(torch.topk(before.abs().reshape(-1), k, largest=False).indices).values
        opt.zero_grad()
        _loss(w, targets[t]).backward()
        opt.step()
        changed = torch.nonzero((w.detach() != before).reshape(-1)).flatten()
        assert len(changed) == k, t
        assert torch.equal(changed, expected), t


def test_3_selection_is_gradient_free():
    w, _ = _problem(1)
    assert w.grad is None
    idx = select_indices(w, 7)
    assert torch.equal(idx, torch.nonzero(bottom_k_mask(w, 7).reshape(-1)).flatten())
    w.grad = torch.randn_like(w) * 100
    assert torch.equal(select_indices(w, 7), idx)


def test_ties_are_broken_by_flat_index():
    w = torch.tensor([[1.0, -1.0, 1.0], [0.5, 1.0, -0.5]])
    assert select_indices(w, 3).tolist() == [0, 3, 5]  # 0.5, -0.5, then the first of the four 1's
    assert select_indices(w, 2, "largest").tolist() == [0, 1]


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_4_full_density_equals_adam_and_adamw(wd):
    a, _, _ = _run(lambda p: NanoAdam(p, lr=3e-2, density=1.0, mask_interval=1000, weight_decay=wd), steps=25)
    ref_cls = torch.optim.AdamW if wd else torch.optim.Adam
    b, _, _ = _run(lambda p: ref_cls(p, lr=3e-2, weight_decay=wd), steps=25)
    torch.testing.assert_close(a, b, atol=F32, rtol=0)
    c, _, _ = _run(lambda p: torch.optim.Adam(p, lr=3e-2, weight_decay=0.05), steps=25)  # a different optimizer differs
    assert (a - c).abs().max() > 1e-4


def test_5_refresh_only_on_schedule():
    w, targets = _problem(2)
    opt = NanoAdam([w], lr=5e-2, density=0.2, mask_interval=4)
    sets = []
    for t in range(10):
        opt.zero_grad()
        _loss(w, targets[t]).backward()
        opt.step()
        sets.append(opt.masks()[w].clone())
    assert opt.state[w]["refreshes"] == 3  # t = 0, 4, 8
    for t in range(10):
        if t % 4:
            assert torch.equal(sets[t], sets[t - 1]), t  # constant between refreshes although weights moved
    assert not torch.equal(sets[4], sets[3]) or not torch.equal(sets[8], sets[7])


def test_density_schedule_changes_k_and_refreshes():
    w, targets = _problem(3)
    opt = NanoAdam([w], lr=1e-2, density=0.2, final_density=0.05, density_schedule="linear", density_interval=3,
                   total_steps=9, mask_interval=100)
    ks = []
    for t in range(10):
        opt.zero_grad()
        _loss(w, targets[t]).backward()
        opt.step()
        ks.append(opt.state[w]["k"])
    assert ks[0] == 24 and ks[3] == 18 and ks[6] == 12 and ks[9] == 6
    assert ks[1] == ks[2] == 24
    assert opt.state[w]["refreshes"] == 4


def test_6_compact_state_size_and_dense_mask_mode_agree():
    a, oa, _ = _run(lambda p: NanoAdam(p, lr=2e-2, density=0.1, mask_interval=5, compact_state=True), steps=14)
    b, ob, _ = _run(lambda p: NanoAdam(p, lr=2e-2, density=0.1, mask_interval=5, compact_state=False), steps=14)
    torch.testing.assert_close(a, b, atol=F32, rtol=0)
    st = oa.state[a]
    assert st["exp_avg"].numel() == st["exp_avg_sq"].numel() == st["idx"].numel() == 12
    assert ob.state[b]["exp_avg"].numel() == 120
    assert oa.state_bytes() < ob.state_bytes() / 3
    for ko in (True,):
        c, _, _ = _run(lambda p, ko=ko: NanoAdam(p, lr=2e-2, density=0.1, mask_interval=5, keep_overlap=ko), steps=14)
        d, _, _ = _run(lambda p, ko=ko: NanoAdam(p, lr=2e-2, density=0.1, mask_interval=5, keep_overlap=ko, compact_state=False), steps=14)
        torch.testing.assert_close(c, d, atol=F32, rtol=0)
        assert (c - a).abs().max() > 0  # carrying moments is a different trajectory


def test_7_nano_false_groups_follow_adam_and_1d_tensors_are_dense():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    groups = matrix_param_groups(model, dense=("2.*",))  # the last layer plays the new head
    assert [len(g["params"]) for g in groups] == [1, 3]
    assert groups[0]["params"][0] is model[0].weight and groups[0]["nano"] and not groups[1]["nano"]
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    # nano=False groups (and 1-D tensors) follow torch's Adam exactly
    torch.manual_seed(0)
    m1 = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    m2 = copy.deepcopy(m1)
    m1[0].weight.requires_grad_(False)
    m2[0].weight.requires_grad_(False)
    o1 = NanoAdam([{"params": [m1[0].bias, m1[2].weight, m1[2].bias], "nano": False}], lr=1e-2)
    o2 = torch.optim.Adam([m2[0].bias, m2[2].weight, m2[2].bias], lr=1e-2)
    for _ in range(8):
        for m, o in ((m1, o1), (m2, o2)):
            o.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    for p1, p2 in zip(m1.parameters(), m2.parameters(), strict=True):
        torch.testing.assert_close(p1, p2, atol=F32, rtol=0)


def test_8_state_dict_round_trip_reproduces_the_next_step():
    for selector in ("smallest", "random"):
        w, opt, _ = _run(lambda p, s=selector: NanoAdam(p, lr=2e-2, density=0.1, mask_interval=3, selector=s, seed=5), steps=7)
        sd = copy.deepcopy(opt.state_dict())
        w2 = nn.Parameter(w.detach().clone())
        opt2 = NanoAdam([w2], lr=2e-2, density=0.1, mask_interval=3, selector=selector, seed=99)
        opt2.load_state_dict(sd)
        assert opt2.state[w2]["idx"].dtype == torch.int64
        _, targets = _problem(0)
        for t in range(7, 12):  # crosses a refresh (t = 9): the random selector's generator state matters
            for p, o in ((w, opt), (w2, opt2)):
                o.zero_grad()
                _loss(p, targets[t]).backward()
                o.step()
        torch.testing.assert_close(w, w2, atol=0, rtol=0)


def test_random_selector_is_seeded():
    a, _, _ = _run(lambda p: NanoAdam(p, lr=1e-2, density=0.1, mask_interval=2, selector="random", seed=1), steps=5)
    b, _, _ = _run(lambda p: NanoAdam(p, lr=1e-2, density=0.1, mask_interval=2, selector="random", seed=1), steps=5)
    c, _, _ = _run(lambda p: NanoAdam(p, lr=1e-2, density=0.1, mask_interval=2, selector="random", seed=2), steps=5)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_bad_inputs():
    w = nn.Parameter(torch.randn(4, 4))
    cases = [
        (dict(density=0.0), "density=0.0; allowed: \\(0, 1\\]"),
        (dict(density=1.5), "density=1.5"),
        (dict(mask_interval=0), "mask_interval=0; allowed: an integer >= 1"),
        (dict(density_interval=0), "density_interval=0"),
        (dict(lr=-1.0), "lr=-1.0"),
        (dict(betas=(0.9, 1.0)), "betas=\\(0.9, 1.0\\)"),
        (dict(eps=0.0), "eps=0.0"),
        (dict(selector="median"), "selector='median'; allowed: smallest, random, largest"),
        (dict(density_schedule="step"), "density_schedule='step'; allowed: constant, linear, cosine"),
        (dict(final_density=0.01), "final_density=0.01 needs density_schedule linear or cosine"),
        (dict(density_schedule="linear", final_density=0.01), "needs total_steps"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            NanoAdam([w], **kw)
    emb = nn.Embedding(10, 4, sparse=True)
    opt = NanoAdam(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    tiny = nn.Parameter(torch.randn(3, 3))
    opt = NanoAdam([tiny], density=0.01)
    tiny.grad = torch.ones_like(tiny)
    with pytest.warns(UserWarning, match="clamped to 1"):
        opt.step()
    assert opt.state[tiny]["k"] == 1


def test_grad_weight_correlation_sign():
    lin = nn.Linear(50, 40, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.linspace(0.01, 1, 2000).reshape(40, 50))
    lin.weight.grad = 1.0 / lin.weight.detach()  # large gradients on small weights
    assert grad_weight_correlation(lin)["weight"] == pytest.approx(-1.0)
    lin.weight.grad = lin.weight.detach() ** 2
    assert grad_weight_correlation(lin)["weight"] == pytest.approx(1.0)


def test_split_digits_data():
    from lowrank_lit.data.digits import DigitsSplitDataModule

    dm = DigitsSplitDataModule()
    dm.setup()
    for name in ("source_train", "target_train", "source_test", "target_test"):
        y = dm.sets[name].tensors[1]
        assert set(y.tolist()) == set(range(5)), name
    n = sum(len(s) for s in dm.sets.values())
    assert n == 1797
    assert float(dm.sets["target_train"].tensors[0].max()) == 1.0  # pixels / 16
    with pytest.raises(ValueError, match="overlap"):
        DigitsSplitDataModule(source_classes=[0, 1, 5], target_classes=[5, 6])


# -- must show (card 12 section 4) ------------------------------------------------------------------

def _finetune(optimizer, seed, split_seed=0):
    import lightning.pytorch as pl

    from lowrank_lit.data.digits import DigitsSplitDataModule
    from lowrank_lit.models.finetune import SplitClassFinetune

    pl.seed_everything(seed, verbose=False)
    model = SplitClassFinetune(optimizer)
    dm = DigitsSplitDataModule(split_seed=split_seed)
    trainer = quiet_trainer(max_steps=300, deterministic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, dm)
        res = trainer.test(model, dm, verbose=False)
    out = {**res[0], **res[1]}
    return out["test/target_acc"], out["test/source_acc"], out["test/drift"]


@pytest.mark.slow
def test_must_show_split_digits():
    """Our acceptance criterion, over the 10 random states of sweeps/nanoadam_states.yaml (lr 1e-2, the
    digits split drawn with each state): mean target-accuracy gap AdamW - NanoAdam <= 1.5 points;
    source accuracy >= 30 points above AdamW on the mean; body drift <= 0.6x AdamW's on the mean;
    drift(smallest) < drift(random) < drift(largest) in >= 8 of 10 states. The first three judged by the verdict
    rule, paired by state, with delta = 1 point: the target accuracy within 1.5 points of AdamW's is inconclusive
    (-0.98 points, 95 % interval [-1.92, -0.04] contains -1.5); the forgetting and the drift criteria hold."""
    from lowrank_lit.stats import expect_verdict

    states = range(10)

    def runs(opt):
        return [_finetune(opt, s, split_seed=None) for s in states]

    adamw = runs(lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0))
    nano = {sel: runs(lambda p, sel=sel: NanoAdam(p, lr=1e-2, density=0.05, mask_interval=50, selector=sel))
            for sel in ("smallest", "random", "largest")}

    small = nano["smallest"]
    report = {"adamw": adamw, **nano}
    def col(rs, i):
        return [r[i] for r in rs]

    print(report)
    expect_verdict("inconclusive", col(small, 0), col(adamw, 0), margin=-0.015, delta=0.01, claim="target accuracy >= AdamW - 1.5 points")
    expect_verdict("holds", col(small, 1), col(adamw, 1), margin=0.30, delta=0.01, claim="source accuracy >= AdamW + 30 points")
    expect_verdict("holds", [0.6 * a for a in col(adamw, 2)], col(small, 2), delta=0.05 * statistics.fmean(col(adamw, 2)), claim="body drift <= 0.6x AdamW's")
    ordered = sum(s[2] < r[2] < g[2] for s, r, g in zip(small, nano["random"], nano["largest"], strict=True))
    assert ordered >= 8, report


@pytest.mark.e2e
def test_grad_weight_correlation_callback_logs_every_n_steps(run_root):
    import csv

    from tests.helpers import CONFIGS, run_cli

    rc = run_cli("fit", "--config", CONFIGS / "nanoadam" / "digits_finetune.yaml", "--trainer.max_steps=5",
                 "--model.init_args.pretrain_epochs=1", "--trainer.callbacks.init_args.every_n_steps=2",
                 "--run_id", "gwc", run_root=run_root)
    assert rc == 0
    with open(run_root / "nanoadam" / "digits_finetune" / "gwc" / "metrics.csv") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("gwc/mean")]
    assert steps == [0, 2, 4]
