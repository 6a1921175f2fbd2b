"""STRank (paper 13): the card's loss properties, baselines, data, batching and the must-show."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from lowrank_lit.data.groups import GroupBatchSampler, group_batches
from lowrank_lit.data.spatial import SyntheticSTDataModule, batch_effect_data
from lowrank_lit.methods.strank import (
    MSELog1pLoss,
    NegativeBinomialNLLLoss,
    NegativePearsonLoss,
    PairwiseMarginRankingLoss,
    PoissonNLLLoss,
    STRankLoss,
    group_permutations,
    strank_list_loss,
    strank_pair_loss,
)
from lowrank_lit.models.expression import groupwise_correlation
from tests.helpers import quiet_trainer
from tests.tolerances import F32, F64

D = torch.float64


def _batch(n=12, g=3, n_groups=3, seed=0, low=0):
    gen = torch.Generator().manual_seed(seed)
    pred = torch.randn(n, g, dtype=D, generator=gen)
    counts = torch.randint(low, 9, (n, g), generator=gen).to(D)
    groups = torch.arange(n) % n_groups
    return pred, counts, groups


def _grad(fn, pred, *args, **kw):
    pred = pred.clone().requires_grad_(True)
    fn(pred, *args, **kw).backward()
    return pred.grad


def _fixed_perms(groups, p=2, seed=0):
    return group_permutations(groups, p, torch.Generator().manual_seed(seed))


# -- pinned values -----------------------------------------------------------------------------------

def test_list_loss_hand_value():
    # one group, two spots, counts (1, 3), scores (0, log 3): pi = (1/4, 3/4)
    pred = torch.tensor([[0.0], [math.log(3.0)]], dtype=D)
    counts = torch.tensor([[1.0], [3.0]], dtype=D)
    expected = -(1 * math.log(0.25) + 3 * math.log(0.75)) / 2  # 1.1246702...
    loss = strank_list_loss(pred, counts, normalize_library=False)
    assert float(loss) == pytest.approx(expected, abs=F64)
    assert float(loss) == pytest.approx(1.1246702, abs=F32)


def test_entropy_term_adds_mean_entropy():
    pred, counts, groups = _batch()
    base = strank_list_loss(pred, counts, groups)
    s = pred + torch.log(counts.mean(1, keepdim=True) + 1e-6)
    ent = 0.0
    for k in groups.unique():
        pi = torch.softmax(s[groups == k], dim=0)
        ent = ent - (pi * pi.log()).sum()
    with_ent = strank_list_loss(pred, counts, groups, entropy_weight=0.5)
    assert float(with_ent - base) == pytest.approx(0.5 * float(ent) / counts.numel(), rel=F64)


# -- card section 5 -----------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["list", "pair"])
def test_1_shift_invariance_per_group_and_gene(mode):
    pred, counts, groups = _batch(seed=1)
    shift = torch.randn(3, pred.shape[1], dtype=D, generator=torch.Generator().manual_seed(5)) * 10  # (K, G)
    perms = _fixed_perms(groups)

    def loss(p):
        if mode == "list":
            return strank_list_loss(p, counts, groups)
        return strank_pair_loss(p, counts, groups, perms=perms)

    torch.testing.assert_close(loss(pred + shift[groups]), loss(pred), atol=F32, rtol=0)
    # a per-spot shift is not an invariance (the test can fail)
    spot_shift = torch.randn(len(pred), 1, dtype=D, generator=torch.Generator().manual_seed(6))
    assert abs(float(loss(pred + spot_shift) - loss(pred))) > 1e-3


@pytest.mark.parametrize("mode", ["list", "pair"])
def test_2_block_gradient_scales_with_count_scale(mode):
    pred, counts, groups = _batch(n=15, seed=2, low=1)
    perms = _fixed_perms(groups)
    a, k, g = 3.7, 1, 2

    def loss(p, c):
        if mode == "list":
            return strank_list_loss(p, c, groups, normalize_library=False)
        return strank_pair_loss(p, c, groups, perms=perms, normalize_library=False)

    scaled = counts.clone()
    block = (groups == k)
    scaled[block, g] *= a
    g0, g1 = _grad(loss, pred, counts), _grad(loss, pred, scaled)
    torch.testing.assert_close(g1[block, g], a * g0[block, g], atol=F64, rtol=F64)
    other = torch.ones_like(g0, dtype=torch.bool)
    other[block, g] = False
    torch.testing.assert_close(g1[other], g0[other], atol=F64, rtol=F64)
    assert g0[block, g].abs().max() > 1e-4  # the block has a gradient at all


def test_3_closed_form_list_gradient():
    pred, counts, _ = _batch(n=9, g=4, seed=3)
    grad = _grad(strank_list_loss, pred, counts, None, normalize_library=False)
    pi = torch.softmax(pred, dim=0)  # one group
    n, g = pred.shape
    torch.testing.assert_close(grad, (pi * counts.sum(0) - counts) / (n * g), atol=F64, rtol=F64)


def test_4_optimum_and_library_invariance():
    _, counts, groups = _batch(n=12, g=4, seed=4, low=1)
    lib = counts.mean(1, keepdim=True)
    f_star = torch.log(counts / lib)
    grad = _grad(strank_list_loss, f_star, counts, groups)
    assert grad.abs().max() < 1e-7  # the library offset's 1e-6 guard leaves ~1e-8
    lam = torch.rand(len(counts), 1, dtype=D, generator=torch.Generator().manual_seed(0)) * 5 + 0.5
    grad_scaled = _grad(strank_list_loss, f_star, counts * lam, groups)
    assert grad_scaled.abs().max() < 1e-7
    # away from the optimum the gradient is not small (the check has teeth)
    assert _grad(strank_list_loss, f_star + 0.3 * torch.randn_like(f_star), counts, groups).abs().max() > 1e-3


@pytest.mark.parametrize("mode", ["list", "pair"])
def test_5_group_isolation_and_its_failure_in_global_mode(mode):
    pred, counts, groups = _batch(n=16, seed=5, n_groups=2, low=1)
    only_a = counts * (groups == 0)[:, None]  # the loss of group A alone
    b = groups == 1

    def loss(p, perm):
        if mode == "list":
            return strank_list_loss(p, only_a, groups, normalize_library=False, perm=perm)
        perms = group_permutations(groups, 2, torch.Generator().manual_seed(0), perm=perm)
        return strank_pair_loss(p, only_a, groups, normalize_library=False, perm=perm, perms=perms)

    assert _grad(loss, pred, "group")[b].abs().max() == 0
    assert _grad(loss, pred, "global")[b].abs().max() > 1e-4


def test_6_pair_p2_equals_binomial_formula():
    pred, counts, groups = _batch(n=10, g=2, seed=6)
    perms = _fixed_perms(groups)
    a, b = perms[:, 0], perms[:, 1]
    s = pred + torch.log(counts.mean(1, keepdim=True) + 1e-6)
    sa, sb, ca, cb = s[a], s[b], counts[a], counts[b]
    explicit = -(ca * torch.nn.functional.logsigmoid(sa - sb) + cb * torch.nn.functional.logsigmoid(sb - sa))
    expected = explicit.sum() / (2 * counts.numel())  # mean over N * P * G entries
    torch.testing.assert_close(strank_pair_loss(pred, counts, groups, perms=perms), expected, atol=F64, rtol=F64)
    # permutations stay inside groups and are permutations
    for p in range(perms.shape[1]):
        assert torch.equal(groups[perms[:, p]], groups)
        assert sorted(perms[:, p].tolist()) == list(range(len(groups)))


@pytest.mark.parametrize("mode", ["list", "pair"])
def test_7_zero_column_and_one_spot_group(mode):
    pred, counts, groups = _batch(seed=7)
    counts[:, 1] = 0
    fn = strank_list_loss if mode == "list" else strank_pair_loss
    kw = {} if mode == "list" else {"perms": _fixed_perms(groups)}
    loss = fn(pred, counts, groups, **kw)
    assert torch.isfinite(loss)
    grad = _grad(fn, pred, counts, groups, **kw)
    assert grad[:, 1].abs().max() == 0 and grad[:, 0].abs().max() > 0
    with pytest.warns(UserWarning, match="fewer than 2 spots"):
        one = fn(pred[:1], counts[:1] + 1, torch.tensor([4]), **({} if mode == "list" else {}))
    assert float(one) == 0.0


@pytest.mark.parametrize("mode", ["list", "pair"])
def test_8_nonnegative_and_deterministic(mode):
    for seed in range(20):
        pred, counts, groups = _batch(n=20, seed=100 + seed)
        pred = pred * 5
        loss = STRankLoss(mode=mode, n_pairs=3)(pred, counts, groups)
        assert float(loss) >= 0
    pred, counts, groups = _batch(n=30, seed=8)

    def draw(seed):
        return strank_pair_loss(pred, counts, groups, n_pairs=4, generator=torch.Generator().manual_seed(seed))

    assert float(draw(3)) == float(draw(3))
    assert float(draw(3)) != float(draw(4))
    assert float(STRankLoss("pair", seed=1)(pred, counts, groups)) == float(STRankLoss("pair", seed=1)(pred, counts, groups))


# -- bad inputs (card section 6) ---------------------------------------------------------------------

@pytest.mark.parametrize("fn", [strank_list_loss, strank_pair_loss])
def test_bad_inputs(fn):
    pred, counts, groups = _batch()
    with pytest.raises(ValueError, match=r"pred \(12, 3\), counts \(12, 2\)"):
        fn(pred, counts[:, :2], groups)
    with pytest.raises(ValueError, match=r"groups must have shape \(12,\)"):
        fn(pred, counts, groups[:5])
    for bad in (-1.0, float("nan"), float("inf")):
        c = counts.clone()
        c[0, 0] = bad
        with pytest.raises(ValueError, match="counts must be finite and >= 0"):
            fn(pred, c, groups)
    with pytest.raises(TypeError, match="floating-point"):
        fn(pred.long(), counts, groups)
    with pytest.raises(ValueError, match="empty batch"):
        fn(pred[:0], counts[:0], groups[:0])
    with pytest.raises(TypeError, match="integer tensor"):
        fn(pred, counts, groups.double())
    with pytest.raises(ValueError, match="perm='x'; allowed: group, global"):
        fn(pred, counts, groups, perm="x")


def test_bad_options():
    with pytest.raises(ValueError, match="n_pairs=1; allowed: an integer >= 2"):
        STRankLoss(mode="pair", n_pairs=1)
    with pytest.raises(ValueError, match="mode='listwise'; allowed: list, pair"):
        STRankLoss(mode="listwise")
    with pytest.raises(ValueError, match="perm='slide'; allowed: group, global"):
        STRankLoss(perm="slide")
    pred, counts, groups = _batch()
    with pytest.raises(ValueError, match="n_pairs=1"):
        strank_pair_loss(pred, counts, groups, n_pairs=1)


# -- baselines -------------------------------------------------------------------------------------

def test_negative_binomial_matches_torch_distribution():
    pred, counts, _ = _batch(n=20, g=3, seed=9)
    loss = NegativeBinomialNLLLoss(n_genes=3, init_theta=2.5).double()
    theta = loss.log_theta.detach().exp()
    ref = -torch.distributions.NegativeBinomial(total_count=theta, logits=pred - theta.log()).log_prob(counts).mean()
    torch.testing.assert_close(loss(pred, counts), ref, atol=F64, rtol=F64)
    grad = torch.autograd.grad(loss(pred, counts), loss.log_theta)[0]
    assert grad.abs().max() > 0  # theta is learned
    with pytest.raises(ValueError, match="n_genes=3"):
        loss(pred[:, :2], counts[:, :2])


def test_pointwise_baselines():
    pred, counts, groups = _batch(seed=10)
    torch.testing.assert_close(MSELog1pLoss()(pred, counts, groups), ((pred - counts.log1p()) ** 2).mean())
    torch.testing.assert_close(PoissonNLLLoss()(pred, counts, groups), (pred.exp() - counts * pred).mean())
    y = counts.log1p()
    assert float(NegativePearsonLoss()(3 * y + 1, counts)) == pytest.approx(-1.0, abs=F32)
    assert float(NegativePearsonLoss()(-y, counts)) == pytest.approx(1.0, abs=F32)


def test_margin_ranking_within_groups():
    counts = torch.tensor([[0.0], [1], [2], [3], [10], [11], [12], [13]])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    ordered = counts[:, :1] * 5.0 - 50 * groups[:, None]  # right order inside each group, not across
    loss = PairwiseMarginRankingLoss(margin=1.0, seed=0)
    assert float(loss(ordered, counts, groups)) == 0.0
    assert float(loss(-ordered, counts, groups)) > 1.0


def test_groupwise_correlation_is_within_groups():
    x = torch.linspace(0, 1, 50)
    truth = torch.cat([x, x])[:, None]
    groups = torch.cat([torch.zeros(50), torch.ones(50)]).long()
    pred = torch.cat([x + 10, x - 10])[:, None]  # right trend in each slide, offsets across slides
    assert float(groupwise_correlation(pred, truth, groups, "spearman")) == pytest.approx(1.0)
    assert float(groupwise_correlation(pred, truth, torch.zeros(100).long(), "spearman")) < 0.6
    with pytest.warns(UserWarning, match="constant"):
        r = groupwise_correlation(torch.zeros(100, 1), truth, groups, "pearson")
    assert float(r) == 0.0


# -- data and batching -----------------------------------------------------------------------------

def test_batch_effect_generator():
    imb = batch_effect_data("imbalanced", n_spots=3000, seed=0)
    bal = batch_effect_data("balanced", n_spots=3000, seed=0)
    x1 = imb["x"][imb["groups"] == 1]
    assert x1.max() - x1.min() <= 0.2 + 1e-9
    assert bal["x"][bal["groups"] == 1].max() - bal["x"][bal["groups"] == 1].min() > 0.9
    mu, c, g = bal["mu"][:, 0], bal["counts"][:, 0], bal["groups"]
    assert mu.min() >= 0 and mu[g == 0].min() < 0.01  # shifted to min 0 on [0, 1]
    # slide 1 = 10 mu + 10 in expectation (negative-binomial mean m)
    assert c[g == 1].mean() == pytest.approx((10 * mu[g == 1] + 10).mean(), rel=0.03)  # tol: sampling error of the mean
    assert c[g == 0].mean() == pytest.approx(mu[g == 0].mean(), rel=0.1)  # tol: sampling error of the mean (small counts)
    np.testing.assert_array_equal(batch_effect_data(seed=3)["counts"], batch_effect_data(seed=3)["counts"])
    thinned = batch_effect_data("balanced", n_spots=3000, drop_rate=0.5, seed=0)["counts"]
    assert thinned.mean() == pytest.approx(bal["counts"].mean() * 0.5, rel=0.05)  # tol: binomial thinning, 3,000 spots
    multi = batch_effect_data(n_spots=100, n_slides=3, n_genes=4, slide_scale=[1, 10, 5], slide_offset=[0, 10, 2],
                              scale_sigma=0.5, offset_max=2.0, library_sigma=0.3, seed=1)
    assert multi["counts"].shape == (300, 4) and set(multi["groups"]) == {0, 1, 2}
    with pytest.raises(ValueError, match="setting='mixed'; allowed: balanced, imbalanced"):
        batch_effect_data("mixed")
    with pytest.raises(ValueError, match="one value per slide"):
        batch_effect_data(n_slides=3)


def test_synthetic_datamodule_splits():
    dm = SyntheticSTDataModule(n_spots=500, n_grid=400, data_seed=2)
    dm.setup()
    x, c, g = dm.splits["train"].tensors
    assert x.shape == (1000, 1) and c.shape == (1000, 1) and set(g.tolist()) == {0, 1}
    tx, tmu, tg = dm.splits["test"].tensors
    assert tx.shape == (400, 1) and float(tx.min()) == 0.0 and float(tx.max()) == 1.0 and int(tg.max()) == 0
    assert len(dm.splits["val"]) == 200
    with pytest.raises(ValueError, match="setting='x'; allowed: balanced, imbalanced"):
        SyntheticSTDataModule(setting="x")


def _check_batches(batches, groups, batch_size):
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(len(groups)))
    sizes = torch.bincount(groups)
    for b in batches:
        assert len(b) <= batch_size
        for k in groups[b].unique():
            n_in = int((groups[b] == k).sum())
            # a group is whole in the batch, or a chunk of a group larger than the batch
            assert n_in == sizes[k] or sizes[k] > batch_size


def test_group_batches_keep_groups_together():
    groups = torch.tensor([0] * 7 + [1] * 3 + [2] * 2 + [3] * 20 + [4] * 1)
    for gen in (None, torch.Generator().manual_seed(0)):
        _check_batches(group_batches(groups, 8, gen), groups, 8)
    assert group_batches(groups, 8, torch.Generator().manual_seed(0)) != group_batches(groups, 8, torch.Generator().manual_seed(1))


def test_group_batch_sampler_shards_whole_batches_across_ranks():
    from torch.utils.data import DistributedSampler, TensorDataset

    groups = torch.tensor([0] * 30 + [1] * 5 + [2] * 6 + [3] * 17)
    ds = TensorDataset(torch.zeros(len(groups)))
    per_rank = []
    for rank in range(3):
        s = GroupBatchSampler(DistributedSampler(ds, num_replicas=3, rank=rank), 8, groups=groups, seed=4)
        s.set_epoch(2)
        per_rank.append(list(s))
    assert len({len(b) for b in per_rank}) == 1  # every rank takes the same number of steps
    single = GroupBatchSampler(list(range(len(groups))), 8, groups=groups, seed=4)
    single.set_epoch(2)
    all_batches = list(single)
    flat = [tuple(b) for r in per_rank for b in r]
    assert set(flat) == {tuple(b) for b in all_batches}  # whole batches, none split, none lost
    _check_batches(all_batches, groups, 8)
    single.set_epoch(3)
    assert list(single) != all_batches
    fresh = GroupBatchSampler(list(range(len(groups))), 8, groups=groups, seed=4)
    first, second = list(fresh), list(fresh)  # without set_epoch each pass is the next epoch
    assert first != second and len(first) == len(second) == len(fresh)


def test_lightning_injects_its_distributed_sampler_into_group_batch_sampler():
    """Lightning's own DDP dataloader rewrite keeps the group batching and shards it by rank."""
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DistributedSampler

    dm = SyntheticSTDataModule(n_spots=300, batch_size=64, group_batches=True, data_seed=0)
    dm.setup()
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from torch.utils.data import BatchSampler, DataLoader

    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        loader = dm.train_dataloader()
    ds = loader.dataset
    ranks = []
    for rank in range(2):
        new = _update_dataloader(loader, DistributedSampler(ds, num_replicas=2, rank=rank, shuffle=True))
        assert isinstance(new.batch_sampler, GroupBatchSampler) and new.batch_sampler.rank == rank
        ranks.append([tuple(b) for b in new.batch_sampler])
        for _, _, g in new:
            assert len(g.unique()) == 1  # 300 spots per slide > 64: every batch is a chunk of one slide
    assert not set(ranks[0]) & set(ranks[1])
    assert len(ranks[0]) == len(ranks[1])


# -- must show (card section 4) --------------------------------------------------------------------

def _card_run(loss, setting, seed):
    import lightning.pytorch as pl

    from lowrank_lit.models.expression import GeneExpressionRegressor
    from lowrank_lit.models.mlp import MLP

    pl.seed_everything(seed, verbose=False)
    model = GeneExpressionRegressor(MLP(1, 1, [32, 32], "relu"), loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))
    dm = SyntheticSTDataModule(setting=setting, data_seed=seed)
    trainer = quiet_trainer(max_epochs=15, deterministic=True, limit_val_batches=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, dm)
        return trainer.test(model, dm, verbose=False)[0]["test/spearman"]


@pytest.mark.slow
def test_must_show_batch_effect_toy():
    """Over random states 0-9, judged by the verdict rule (paired by state), the outcomes in STRANK_VERDICTS:
    imbalanced, STRank above MSE holds and by more than 0.4 Spearman is inconclusive (delta 0.05) for STRank-list (+0.68, 95 % interval
    [+0.39, +0.97]: MSE's own Spearman ranges from -0.79 to +0.62 over the states); STRank above 0.7 (our bar, which
    asked it of every run on three states; state 5 of STRank-list gives 0.607); balanced, STRank within 0.1 of MSE
    (two one-sided claims)."""
    from lowrank_lit.stats import verdict

    losses = {
        "list": lambda: STRankLoss("list", normalize_library=False),
        "pair": lambda: STRankLoss("pair", normalize_library=False),
        "mse": MSELog1pLoss,
    }
    seeds = range(10)
    res = {(k, s): [_card_run(make(), s, seed) for seed in seeds]
           for k, make in losses.items() for s in ("imbalanced", "balanced")}
    got = {}
    for mode in ("list", "pair"):
        imb, bal, mse_imb, mse_bal = res[mode, "imbalanced"], res[mode, "balanced"], res["mse", "imbalanced"], res["mse", "balanced"]
        got[f"imbalanced: {mode} > MSE"] = verdict(imb, mse_imb, delta=0.05)
        got[f"imbalanced: {mode} >= MSE + 0.4"] = verdict(imb, mse_imb, margin=0.4, delta=0.05)
        got[f"imbalanced: {mode} > 0.7"] = verdict(imb, margin=0.7, delta=0.05)
        got[f"balanced: {mode} > MSE - 0.1"] = verdict(bal, mse_bal, margin=-0.1, delta=0.05)
        got[f"balanced: MSE > {mode} - 0.1"] = verdict(mse_bal, bal, margin=-0.1, delta=0.05)
    print(res, {k: str(v) for k, v in got.items()})
    assert {k: v.outcome for k, v in got.items()} == STRANK_VERDICTS, {k: str(v) for k, v in got.items()}


#: what docs/methods/strank.md states for the toy over random states 0-9
STRANK_VERDICTS = {
    "imbalanced: list > MSE": "holds",
    "imbalanced: list >= MSE + 0.4": "inconclusive",
    "imbalanced: list > 0.7": "holds",
    "balanced: list > MSE - 0.1": "holds",
    "balanced: MSE > list - 0.1": "holds",
    "imbalanced: pair > MSE": "holds",
    "imbalanced: pair >= MSE + 0.4": "inconclusive",
    "imbalanced: pair > 0.7": "holds",
    "balanced: pair > MSE - 0.1": "holds",
    "balanced: MSE > pair - 0.1": "holds",
}


def _write_slides(tmp_path, n_slides=3, spots=40, dim=6, genes=8):
    rng = np.random.default_rng(0)
    feats, cnts = [], []
    for k in range(n_slides):
        f = rng.normal(size=(spots, dim)).astype(np.float32)
        c = rng.poisson(3.0 * (k + 1), size=(spots, genes))
        c[:, 0] = rng.choice([0, 200], size=spots)  # one highly variable gene
        fp, cp = tmp_path / f"s{k}_feats.npy", tmp_path / f"s{k}_counts.{'csv' if k == 1 else 'npy'}"
        np.save(fp, f)
        if k == 1:
            np.savetxt(cp, c, delimiter=",")
        else:
            np.save(cp, c)
        feats.append(str(fp))
        cnts.append(str(cp))
    torch.save(torch.as_tensor(np.load(feats[2])), tmp_path / "s2_feats.pt")
    feats[2] = str(tmp_path / "s2_feats.pt")
    return feats, cnts


def test_spatial_transcriptomics_datamodule_from_files(tmp_path):
    from lowrank_lit.data.spatial import SpatialTranscriptomicsDataModule

    feats, cnts = _write_slides(tmp_path)
    dm = SpatialTranscriptomicsDataModule(feats, cnts, val_slides=[1], test_slides=[-1], n_genes=3, batch_size=16)
    dm.setup()
    x, c, g = dm.splits["train"].tensors
    assert x.shape == (40, 6) and c.shape == (40, 3) and set(g.tolist()) == {0}
    assert 0 in dm.genes.tolist()  # the high-variance gene is kept
    assert set(dm.splits["test"].tensors[2].tolist()) == {2} and set(dm.splits["val"].tensors[2].tolist()) == {1}
    for batch in dm.train_dataloader():
        assert len(batch[2].unique()) == 1
    no_val = SpatialTranscriptomicsDataModule(feats, cnts, n_genes=None)
    no_val.setup()
    assert no_val.val_dataloader() == [] and no_val.splits["train"].tensors[1].shape[1] == 8
    with pytest.raises(ValueError, match="overlap"):
        SpatialTranscriptomicsDataModule(feats, cnts, val_slides=[2], test_slides=[-1])
    with pytest.raises(ValueError, match="one file per slide"):
        SpatialTranscriptomicsDataModule(feats, cnts[:2])
    bad = SpatialTranscriptomicsDataModule([feats[0], str(tmp_path / "missing.npy")], cnts[:2])
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        bad.setup()


@pytest.mark.e2e
def test_real_slides_config_fits_on_user_files(tmp_path, run_root):
    from tests.helpers import CONFIGS, run_cli

    feats, cnts = _write_slides(tmp_path)
    rc = run_cli("fit", "--config", CONFIGS / "strank" / "real_slides.yaml", "--trainer.fast_dev_run=true",
                 f"--data.init_args.features=[{','.join(feats)}]", f"--data.init_args.counts=[{','.join(cnts)}]",
                 "--data.init_args.n_genes=4", "--model.init_args.backbone.init_args.in_features=6",
                 "--model.init_args.backbone.init_args.out_features=4", "--model.init_args.loss.init_args.n_pairs=8",
                 run_root=run_root)
    assert rc == 0
