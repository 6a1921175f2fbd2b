"""Prompting as Bayesian conditioning: exact predictors, the predictor's prefix plumbing, tuning modules, regret."""

from __future__ import annotations

import itertools
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lowrank_lit.data.coins import CoinFlipDataModule, CoinSource, bayes_log_predictive
from lowrank_lit.methods.bayes_prefix import (
    MetaPretrainModule,
    PrefixTuningModule,
    RegretCurveCallback,
    SequencePredictor,
    WeightTuningModule,
    cumulative_regret,
    exact_prefix_regret,
    sequence_log_loss,
)
from tests.helpers import CONFIGS, quiet_trainer, run_cli, writing_trainer
from tests.tolerances import F32, F32_LAYERS, F64


def _dm(source="categorical", **kw):
    args = dict(length=20, batch_size=16, batches_per_epoch=4, eval_length=30, eval_sequences=32, data_seed=0)
    args.update(kw)
    return CoinFlipDataModule(source, **args)


def _pred(torso="lstm", seed=0):
    torch.manual_seed(seed)
    return SequencePredictor(torso, vocab=2, embed=16, heads=2)


# ----------------------------------------------------------------------------- exact predictors
def test_dirichlet_after_counts_2_5():
    seq = torch.tensor([[0, 1, 1, 0, 1, 1, 1, 0]])  # row 7 conditions on 2 zeros and 5 ones
    p = bayes_log_predictive(CoinSource("dirichlet"), seq).exp()[0, 7]
    assert torch.allclose(p, torch.tensor([3 / 9, 6 / 9], dtype=torch.float64))


#: the smallest regret difference (nats over 50 tosses) that matters to these claims: a tenth of the 0.5-nat bar
REGRET_DELTA = 0.05

@pytest.mark.parametrize("kind", ["dirichlet", "categorical", "mixture"])
def test_predictors_are_normalised(kind):
    src = CoinSource(kind)
    seqs = src.sample(8, 12, torch.Generator().manual_seed(0))
    assert torch.allclose(bayes_log_predictive(src, seqs).exp().sum(-1), torch.ones(8, 12, dtype=torch.float64))


def test_mixture_equals_brute_force_bayes():
    src = CoinSource("mixture", biases=((0.2, 0.8), (0.7, 0.3), (0.5, 0.5)), weights=(0.5, 0.3, 0.2))
    biases, w = [(0.2, 0.8), (0.7, 0.3), (0.5, 0.5)], [0.5, 0.3, 0.2]
    for seq in itertools.product([0, 1], repeat=5):
        x = torch.tensor([seq])
        got = bayes_log_predictive(src, x).exp()[0]
        for t in range(5):
            joint = [wk * math.prod(b[s] for s in seq[:t]) for wk, b in zip(w, biases, strict=True)]
            pred = [sum(j * b[v] for j, b in zip(joint, biases, strict=True)) / sum(joint) for v in (0, 1)]
            assert got[t].tolist() == pytest.approx(pred, rel=F64)


@pytest.mark.parametrize("kind", ["dirichlet", "mixture"])
def test_bayes_prefix_order_invariance_and_empty_prefix(kind):
    src = CoinSource(kind)
    seqs = src.sample(4, 10, torch.Generator().manual_seed(1))
    a = bayes_log_predictive(src, seqs, torch.tensor([0, 1, 1, 1]))
    b = bayes_log_predictive(src, seqs, torch.tensor([1, 1, 0, 1]))
    assert torch.allclose(a, b, atol=F64)
    assert torch.equal(bayes_log_predictive(src, seqs, torch.zeros(0, dtype=torch.long)), bayes_log_predictive(src, seqs))


def test_exact_baselines_match_the_papers_values():
    """Single coin: no prefix ~1.48 nats at t = 50, best hard prefix (1 zero, 5 ones) ~0.57; mixture: best ~1.26."""
    single = CoinSource("categorical").sample(2000, 50, torch.Generator().manual_seed(0))
    res = exact_prefix_regret(CoinSource("dirichlet"), CoinSource("categorical"), single, 6, at=50)
    assert float(res["none"][49]) == pytest.approx(1.48, abs=0.05)  # tol: the paper's values, read off its figure to 2 digits; 2,000 sampled sequences
    assert float(res["best"][49]) == pytest.approx(0.57, abs=0.05)  # tol: as above
    assert sorted(res["best_prefix"]) == [0, 1, 1, 1, 1, 1]
    assert float(res["best"][49]) == pytest.approx(min(res["losses"]))
    mix = CoinSource("mixture").sample(2000, 50, torch.Generator().manual_seed(0))
    res = exact_prefix_regret(CoinSource("dirichlet"), CoinSource("mixture"), mix, 6, at=50)
    assert float(res["best"][49]) == pytest.approx(1.26, abs=0.06)  # tol: as above
    assert sorted(res["best_prefix"]) == [0, 0, 0, 1, 1, 1]


# ----------------------------------------------------------------------------- the predictor
@pytest.mark.parametrize("torso", ["lstm", "transformer"])
def test_shapes_and_empty_prefix_bit_identical(torso):
    m = _pred(torso)
    x = torch.randint(2, (3, 9))
    base = m(x)
    assert base.shape == (3, 9, 2)
    assert torch.equal(m(x, prefix_inputs=torch.zeros(0, 2)), base)
    assert m(x, prefix_inputs=torch.rand(5, 2)).shape == (3, 9, 2)
    tuner = PrefixTuningModule(m, method="soft", prefix_len=0, untrained=True)  # freezes m
    assert torch.equal(tuner.predict_logits(x), m(x))
    soft = PrefixTuningModule(m, method="soft", prefix_len=4, untrained=True)
    assert soft.predict_logits(x).shape == (3, 9, 2)


@pytest.mark.parametrize("torso", ["lstm", "transformer"])
def test_causality(torso):
    m = _pred(torso)
    tuner = PrefixTuningModule(m, method="real", prefix_len=3, untrained=True)
    x = torch.randint(2, (2, 12))
    for j in (0, 5, 11):
        y = x.clone()
        y[:, j] = 1 - y[:, j]
        a, b = tuner.predict_logits(x), tuner.predict_logits(y)
        assert torch.allclose(a[:, : j + 1], b[:, : j + 1], atol=F32)  # rows <= j predict x_1..x_{j+1}: they see x_{<=j-1}
        if j < 11:
            assert not torch.allclose(a[:, j + 1:], b[:, j + 1:])


def test_loss_is_the_summed_cross_entropy():
    m = _pred()
    x = torch.randint(2, (4, 7))
    logits = m(x)
    logp = torch.log_softmax(logits, -1)
    manual = -sum(float(logp[b, t, x[b, t]]) for b in range(4) for t in range(7)) / 4
    assert float(sequence_log_loss(logits, x)) == pytest.approx(manual, rel=F32_LAYERS)
    ref = torch.log_softmax(torch.randn(4, 7, 2), -1)
    curve = cumulative_regret(logp, x, ref)
    step = (ref.gather(-1, x[..., None]) - logp.gather(-1, x[..., None])).squeeze(-1).double().mean(0)
    assert torch.allclose(curve, step.cumsum(0), atol=F32)


# ----------------------------------------------------------------------------- tuning changes only what it should
def _snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["soft", "real", "simplex", "hard"])
def test_prefix_tuning_changes_only_the_prefix(method):
    m = _pred()
    before = _snapshot(m)
    tuner = PrefixTuningModule(m, method=method, prefix_len=3, untrained=True, lr=0.05, hard_batches=2)
    start = {k: v.clone() for k, v in tuner.state_dict().items() if not k.startswith("predictor.")}
    quiet_trainer(max_steps=4, limit_val_batches=0).fit(tuner, datamodule=_dm())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    moved = [k for k, v in tuner.state_dict().items() if not k.startswith("predictor.") and not torch.equal(start[k], v)]
    assert moved, "the prefix did not change"
    if method == "simplex":
        assert torch.allclose(tuner.prefix_inputs().sum(-1), torch.ones(3))


@pytest.mark.e2e
def test_hard_search_returns_the_argmin_of_the_evaluated_losses():
    m = _pred()
    tuner = PrefixTuningModule(m, method="hard", prefix_len=3, untrained=True, hard_batches=3)
    dm = _dm()
    quiet_trainer(max_steps=3, limit_val_batches=0).fit(tuner, datamodule=dm)
    dm.setup()
    batches = [dm._train[i] for i in range(3)]
    losses = torch.stack([torch.stack([sequence_log_loss(m(b, F.one_hot(c, 2).float()), b) for b in batches]).mean()
                          for c in tuner.candidates])
    assert torch.allclose(tuner.hard_losses / tuner.hard_count, losses.double(), atol=F32_LAYERS)
    assert torch.equal(tuner.hard_choice, tuner.candidates[int(losses.argmin())])


@pytest.mark.e2e
@pytest.mark.parametrize("method,prefixes", [("full", ("embedding.", "torso.", "unembedding.")),
                                             ("embedding", ("embedding.",)), ("unembedding", ("unembedding.",)),
                                             ("emb_unemb", ("embedding.", "unembedding.")), ("lora", ("torso.",))])
def test_weight_tuning_changes_only_its_subset(method, prefixes):
    m = _pred("transformer")
    before = _snapshot(m)
    with pytest.warns(UserWarning, match="no pretrained checkpoint"):
        tuner = WeightTuningModule(m, method=method, lr=0.05)
    quiet_trainer(max_steps=3, limit_val_batches=0).fit(tuner, datamodule=_dm())
    after = m.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k.replace(".weight", ".base.weight")
                                                                      if k.replace(".weight", ".base.weight") in after else k])}
    if method == "lora":
        assert not changed  # the base weights stay; only lora_A / lora_B move
        assert any("lora_B" in k and bool(v.abs().sum() > 0) for k, v in after.items())
    else:
        assert changed and all(k.startswith(prefixes) for k in changed), changed
        assert any(k.startswith(p) for k in changed for p in prefixes)


@pytest.mark.e2e
def test_pretrained_checkpoint_is_loaded(tmp_path):
    m = _pred()
    pre = MetaPretrainModule(m)
    trainer = quiet_trainer(max_steps=2, limit_val_batches=0)
    trainer.fit(pre, datamodule=_dm("dirichlet"))
    path = tmp_path / "pre.ckpt"
    trainer.save_checkpoint(path)
    fresh = _pred(seed=3)
    PrefixTuningModule(fresh, pretrained=str(path), method="soft")
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in fresh.state_dict().items())
    with pytest.raises(FileNotFoundError, match="pretrained"):
        PrefixTuningModule(_pred(), pretrained=str(tmp_path / "none_{torso}.ckpt"))


@pytest.mark.e2e
def test_meta_training_gives_small_regret_against_dirichlet_bayes():
    torch.manual_seed(0)
    dm = CoinFlipDataModule("dirichlet", length=50, batch_size=64, batches_per_epoch=150, eval_length=50,
                            eval_sequences=256, data_seed=0)
    untrained = MetaPretrainModule(SequencePredictor("lstm", embed=32), lr=3e-3, regret_at=(50,), baseline_prefix_len=0)
    before = quiet_trainer().test(untrained, datamodule=dm, verbose=False)[0]["test/regret_t50"]
    trained = MetaPretrainModule(SequencePredictor("lstm", embed=32), lr=3e-3, regret_at=(50,), baseline_prefix_len=0)
    quiet_trainer(max_epochs=1, limit_val_batches=0, gradient_clip_val=1.0).fit(trained, datamodule=dm)
    after = quiet_trainer().test(trained, datamodule=dm, verbose=False)[0]["test/regret_t50"]
    assert after < 1.0 and after < before / 5, (before, after)


@pytest.mark.e2e
def test_regret_callback_writes_csv_and_png(tmp_path):
    tuner = PrefixTuningModule(_pred(), method="soft", prefix_len=2, untrained=True)
    trainer = writing_trainer(tmp_path, callbacks=[RegretCurveCallback()])
    trainer.test(tuner, datamodule=_dm(), verbose=False)
    lines = (tmp_path / "regret.csv").read_text().splitlines()
    assert lines[0] == "t,bayes_best,bayes_none,model" and len(lines) == 31
    assert (tmp_path / "regret.png").stat().st_size > 0


def test_datamodule_batches_are_reproducible_per_index_and_epoch():
    dm = _dm("dirichlet")
    dm.setup()
    a, b = dm._train[1], dm._train[1]
    assert torch.equal(a, b) and not torch.equal(dm._train[0], a)
    dm._train.epoch = 1
    assert not torch.equal(dm._train[1], a)


# ----------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_named_errors():
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="prefix_len"):
            PrefixTuningModule(_pred(), prefix_len=bad, untrained=True)
    with pytest.raises(ValueError, match="hard_cap.*soft or real"):
        PrefixTuningModule(_pred(), method="hard", prefix_len=20, untrained=True)
    for method in ("full", "lora"):
        with pytest.raises(ValueError, match="untrained"):
            WeightTuningModule(_pred("transformer"), method=method, untrained=True)
    with pytest.raises(ValueError, match="LSTM"):
        WeightTuningModule(_pred("lstm"), method="lora", untrained=False, pretrained=None)
    with pytest.raises(ValueError, match="bias"):
        CoinSource("categorical", bias=(0.3, 0.3))
    with pytest.raises(ValueError, match="weights"):
        CoinSource("mixture", weights=(0.9, 0.9))
    with pytest.raises(ValueError, match="alpha"):
        CoinSource("dirichlet", alpha=(1.0, -1.0))
    with pytest.raises(ValueError, match="one-hot"):
        _pred()(torch.full((2, 3, 2), 0.5))
    with pytest.raises(ValueError, match="vocabulary"):
        _pred()(F.one_hot(torch.randint(3, (2, 4)), 3))
    with pytest.raises(ValueError, match=r"\[0, 2\)"):
        bayes_log_predictive(CoinSource("dirichlet"), torch.tensor([[0, 2]]))
    with pytest.raises(ValueError, match="eval_length"):
        CoinFlipDataModule(eval_length=0)
    with pytest.raises(ValueError, match="source|kind"):
        CoinFlipDataModule(source="dice")
    with pytest.raises(ValueError, match="method"):
        PrefixTuningModule(_pred(), method="prompt", untrained=True)


@pytest.mark.e2e
def test_configs_tune_a_pretrained_checkpoint(tmp_path):
    """The pretrain config's checkpoint drives a tuning config through the CLI (placeholders filled in)."""
    pre = ["--trainer.max_steps=2", "--test_after_fit=false", "--trainer.enable_progress_bar=false", "--run_id", "seed0"]
    assert run_cli("fit", "--config", CONFIGS / "bayes_prefix/pretrain_lstm.yaml", *pre, run_root=tmp_path) == 0
    ckpt = str(tmp_path / "bayes_prefix/pretrain_{torso}/seed{seed}/checkpoints/last.ckpt")
    args = ["--trainer.max_steps=2", "--data.init_args.eval_sequences=16", "--trainer.enable_progress_bar=false",
            f"--model.init_args.pretrained={ckpt}"]
    assert run_cli("fit", "--config", CONFIGS / "bayes_prefix/prefix_real.yaml", *args, run_root=tmp_path) == 0
    (regret,) = (tmp_path / "bayes_prefix/prefix_real").rglob("regret.csv")
    assert regret.read_text().startswith("t,bayes_best,bayes_none,model")


@pytest.mark.slow
@pytest.mark.parametrize("torso", ["lstm", "transformer"])
def test_must_show_prefixes_vs_weight_tuning(torso):
    """One torso per test (each about half of the whole), 3 seeds: HardPT within 0.15 of the exact best hard
    prefix; SoftPT and FullWT below half of it (single coin); on the two-coin mixture every prefix method > 0.5
    nats and FullWT below every prefix method. One pretraining per seed is shared by its ten tuning runs. Each check
    is judged by the verdict rule paired by seed; "within 0.15" as two one-sided claims. All hold but two ties: the
    LSTM's SoftPT above 0.5 nats on the mixture (0.597 +- 0.049 over three seeds: the interval [0.47, 0.72] contains
    0.5), and the Transformer's HardPT not more than 0.15 above the exact best hard prefix (one thread: HardPT
    0.569 / 0.602 / 0.627 against 0.596 / 0.589 / 0.544, interval [-0.161, +0.116] for best - HardPT against -0.15)."""
    from lowrank_lit.report import last_values
    from lowrank_lit.stats import expect_verdict

    quiet = ["--trainer.enable_progress_bar=false"]
    res: dict[tuple[str, str], list[float]] = {}
    exact: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for seed in (0, 1, 2):
            assert run_cli("fit", "--config", CONFIGS / f"bayes_prefix/pretrain_{torso}.yaml", f"--seed_everything={seed}",
                           "--run_id", f"seed{seed}", "--test_after_fit=false", *quiet, run_root=root) == 0
            ckpt = root / f"bayes_prefix/pretrain_{torso}/seed{seed}/checkpoints/last.ckpt"
            for target in ("categorical", "mixture"):
                for cfg in ("prefix_hard", "prefix_soft", "prefix_real", "prefix_simplex", "weights_full"):
                    run_id = f"{torso}-{target}-{seed}"
                    assert run_cli("fit", "--config", CONFIGS / f"bayes_prefix/{cfg}.yaml", f"--seed_everything={seed}",
                                   f"--model.init_args.pretrained={ckpt}", f"--data.init_args.source={target}",
                                   f"--model.init_args.predictor.init_args.torso={torso}", "--run_id", run_id,
                                   *quiet, run_root=root) == 0
                    (metrics,) = (root / f"bayes_prefix/{cfg}/{run_id}").rglob("metrics.csv")
                    values = last_values(metrics)
                    res.setdefault((target, cfg), []).append(values["test/regret_t50"])
                    if cfg == "prefix_hard":  # the exact predictor's regret: one per seed (every config reports it)
                        exact.setdefault(target, []).append(values["test/bayes_besthard_regret_t50"])
    print(torso, res, exact)
    best = exact["categorical"]  # per seed: the exact predictor with the best hard prefix (seed order as res)
    assert all(len(v) == 3 for v in (*res.values(), *exact.values())), "one value per seed, paired by seed"
    hard = res["categorical", "prefix_hard"]
    expect_verdict("holds", hard, best, margin=-0.15, delta=REGRET_DELTA, claim=f"{torso}: HardPT > best hard prefix - 0.15")
    # the Transformer's HardPT moves with the thread count (0.599 at one thread, 0.652 in the two-thread sweep):
    # "not more than 0.15 above" is inconclusive at one thread ([-0.161, +0.116] against -0.15, seeds 0-2; the 90 %
    # interval [-0.117, +0.071] is not inside -0.15 +- 0.05)
    upper = ("inconclusive", "holds") if torso == "transformer" else "holds"
    expect_verdict(upper, best, hard, margin=-0.15, delta=REGRET_DELTA, claim=f"{torso}: HardPT < best hard prefix + 0.15")
    half = [b / 2 for b in best]  # lower regret is better: half - ours > 0
    expect_verdict("holds", half, res["categorical", "prefix_soft"], delta=REGRET_DELTA, claim=f"{torso}: SoftPT below half of best hard")
    expect_verdict("holds", half, res["categorical", "weights_full"], delta=REGRET_DELTA, claim=f"{torso}: FullWT below half of best hard")
    for cfg in ("prefix_hard", "prefix_soft", "prefix_real", "prefix_simplex"):
        above = "inconclusive" if (torso, cfg) == ("lstm", "prefix_soft") else "holds"
        expect_verdict(above, res["mixture", cfg], margin=0.5, delta=REGRET_DELTA, claim=f"{torso}: {cfg} above 0.5 nats on the mixture")
        expect_verdict("holds", res["mixture", cfg], res["mixture", "weights_full"], delta=REGRET_DELTA,
                       claim=f"{torso}: FullWT below {cfg} on the mixture")
