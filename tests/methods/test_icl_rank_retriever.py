"""SeDPO retriever: the loss properties, the pair builder, the LM scorer on a tiny GPT-2, the module, the data."""

from __future__ import annotations

import copy
import math
import random
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowrank_lit.data.icl import (
    ScoreCache,
    SyntheticICLDataModule,
    TextICLDataModule,
    make_icl_world,
    normalised_option_loss,
    sentiment_records,
)
from lowrank_lit.methods.icl_rank_retriever import (
    ICLRetrieverModule,
    LikelihoodScorer,
    PreferencePairBuilder,
    SyntheticOracleScorer,
    beam_retrieve,
    inbatch_infonce_loss,
    sedpo_loss,
    sedpo_loss_from_scores,
)
from lowrank_lit.models.mlp import MLP
from tests.helpers import CONFIGS, quiet_trainer, run_cli
from tests.tolerances import F32, F32_LAYERS

LOG2 = math.log(2.0)
TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 30522, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}


def _towers(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return MLP(20, 32, [16], "relu"), MLP(24, 32, [16], "relu")


def _module(**kw) -> ICLRetrieverModule:
    q, e = _towers()
    return ICLRetrieverModule(q, e, **kw)


def _small_dm(**kw) -> SyntheticICLDataModule:
    args = dict(n_pool=60, n_train=32, n_test=10, n_candidates=8, data_seed=0, batch_size=8, eval_batch_size=10)
    args.update(kw)
    return SyntheticICLDataModule(**args)


# ----------------------------------------------------------------------------- 1. init: log 2 and its gradient
def test_loss_is_log2_at_init_and_gradient_is_minus_beta_half_score_gap():
    m = _module(beta=0.7)
    torch.manual_seed(1)
    xq, xw, xl = torch.randn(6, 20), torch.randn(6, 24), torch.randn(6, 24)
    q, ew, el = m.encode_queries(xq), m.encode_exemplars(xw), m.encode_exemplars(xl)
    qr, ewr, elr = m.encode_queries(xq, True), m.encode_exemplars(xw, True), m.encode_exemplars(xl, True)
    per_pair = sedpo_loss(q, ew, el, qr, ewr, elr, beta=0.7, reduction="none")
    assert torch.allclose(per_pair, torch.full((6,), LOG2), atol=F32)
    params = [p for p in m.parameters() if p.requires_grad]
    g_loss = torch.autograd.grad(per_pair.sum(), params, retain_graph=True)
    gap = ((q * ew).sum(-1) - (q * el).sum(-1)).sum()
    g_gap = torch.autograd.grad(gap, params)
    for a, b in zip(g_loss, g_gap, strict=True):
        assert torch.allclose(a, -0.7 / 2 * b, atol=F32)


# ----------------------------------------------------------------------------- 2-4. invariances, symmetry, beta
def test_per_query_shift_leaves_loss_unchanged():
    torch.manual_seed(0)
    s_w, s_l, r_w, r_l = torch.randn(4, 10)
    base = sedpo_loss_from_scores(s_w, s_l, r_w, r_l, beta=2.0, reduction="none")
    c, c_ref = torch.randn(10), torch.randn(10)  # one constant per query (pair)
    moved = sedpo_loss_from_scores(s_w + c, s_l + c, r_w + c_ref, r_l + c_ref, beta=2.0, reduction="none")
    assert torch.allclose(base, moved, atol=F32)


def test_swap_maps_d_to_minus_d_and_sum_is_at_least_2log2():
    torch.manual_seed(0)
    s_w, s_l, r_w, r_l = torch.randn(4, 50)
    beta = 1.5
    d = beta * ((s_w - s_l) - (r_w - r_l))
    fwd = sedpo_loss_from_scores(s_w, s_l, r_w, r_l, beta, reduction="none")
    back = sedpo_loss_from_scores(s_l, s_w, r_l, r_w, beta, reduction="none")
    assert torch.allclose(fwd, -F.logsigmoid(d), atol=F32)
    assert torch.allclose(back, -F.logsigmoid(-d), atol=F32)
    assert bool((fwd + back >= 2 * LOG2 - 1e-6).all())
    zero = sedpo_loss_from_scores(torch.ones(1), torch.ones(1), torch.zeros(1), torch.zeros(1), beta, reduction="none")
    assert float(2 * zero) == pytest.approx(2 * LOG2)


def test_beta_limits():
    s_w = torch.tensor([1.0, 2.0], requires_grad=True)
    s_l, r = torch.tensor([0.0, 0.5]), torch.zeros(2)
    (g_small,) = torch.autograd.grad(sedpo_loss_from_scores(s_w, s_l, r, r, beta=1e-8), s_w)
    assert float(g_small.abs().max()) < 1e-8
    assert float(sedpo_loss_from_scores(s_w, s_l, r, r, beta=1e3)) < 1e-10  # d > 0, large beta: loss -> 0


# ----------------------------------------------------------------------------- 5. frozen reference
@pytest.mark.e2e
def test_reference_gets_no_grad_and_stays_bit_identical():
    m = _module(loss="hybrid")
    ref_before = copy.deepcopy(m.ref_query.state_dict()) | {f"e.{k}": v.clone() for k, v in m.ref_exemplar.state_dict().items()}
    trainer = quiet_trainer(max_steps=4, limit_val_batches=0)
    trainer.fit(m, datamodule=_small_dm())
    after = m.ref_query.state_dict() | {f"e.{k}": v for k, v in m.ref_exemplar.state_dict().items()}
    assert all(torch.equal(ref_before[k], after[k]) for k in ref_before)
    assert all(p.grad is None and not p.requires_grad for p in [*m.ref_query.parameters(), *m.ref_exemplar.parameters()])
    towers = dict(m.query_encoder.state_dict())
    assert any(not torch.equal(towers[k], m.ref_query.state_dict()[k]) for k in towers)  # the policy did move


def test_reference_that_requires_grad_is_frozen_with_a_warning():
    q, e = _towers()
    ref_q = copy.deepcopy(q)
    with pytest.warns(UserWarning, match="ref_query_encoder requires grad"):
        m = ICLRetrieverModule(q, e, ref_query_encoder=ref_q)
    assert not any(p.requires_grad for p in m.ref_query.parameters())


# ----------------------------------------------------------------------------- 6. pair builder
def _cands(losses, accs):
    return [{"id": i, "loss": lo, "one_shot_acc": a} for i, (lo, a) in enumerate(zip(losses, accs, strict=True))]


@pytest.mark.parametrize("seed", range(5))
def test_top_bottom_pairs_invariants(seed):
    rng = random.Random(seed)
    n = rng.randint(4, 30)
    losses = [rng.random() for _ in range(n)]
    accs = [float(rng.random() < 0.6) for _ in range(n)]
    builder = PreferencePairBuilder("top_bottom", top_k=rng.randint(1, 10))
    pairs = builder(_cands(losses, accs), generator=torch.Generator().manual_seed(seed))
    n_pair = min(int(sum(accs)), builder.top_k, n // 2)
    assert len(pairs) <= n_pair
    ranked = sorted(range(n), key=lambda i: losses[i])
    winners = [i for i in ranked if accs[i] > 0][:n_pair]
    losers = ranked[-n_pair:] if n_pair else []
    if not set(winners) & set(losers):  # no overlap: every pair is kept
        assert len(pairs) == n_pair
        assert {w["id"] for w, _ in pairs} == set(winners) and {lo["id"] for _, lo in pairs} == set(losers)
    for w, lo in pairs:
        assert w["one_shot_acc"] > 0
        assert w["loss"] < lo["loss"]


def test_overlapping_winners_and_losers_drop_bad_pairs():
    # only the two worst candidates are one-shot correct: winners and losers are the same two
    cands = _cands([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1])
    builder = PreferencePairBuilder("top_bottom", top_k=5)
    for seed in range(10):
        pairs = builder(cands, generator=torch.Generator().manual_seed(seed))
        assert all(w["loss"] < lo["loss"] and w["id"] != lo["id"] for w, lo in pairs)
        assert len(pairs) <= 1


def test_random_pairs_are_ordered():
    loss = torch.rand(12)
    pairs = PreferencePairBuilder("random", n_pairs=50).index_pairs(loss, torch.ones(12), torch.Generator().manual_seed(0))
    assert pairs.shape[1] == 2 and 40 <= pairs.shape[0] <= 50  # ties and i == j never occur with distinct losses
    assert bool((loss[pairs[:, 0]] < loss[pairs[:, 1]]).all())


# ----------------------------------------------------------------------------- 7. scorer
def test_normalised_option_losses_sum_to_one_and_acc_is_argmin():
    torch.manual_seed(0)
    nll = torch.rand(7, 4) * 3
    per_gold = torch.stack([normalised_option_loss(nll, torch.full((7,), g))[0] for g in range(4)], -1)
    assert torch.allclose(per_gold.sum(-1), torch.ones(7))
    gold = torch.randint(4, (7,))
    _, acc = normalised_option_loss(nll, gold)
    assert torch.equal(acc, (nll.argmin(-1) == gold).float())


@pytest.fixture(scope="module")
def tiny_scorer():
    return LikelihoodScorer(backbone_config=TINY_GPT2, tokenizer="all-MiniLM-L6-v2", batch_size=3)


def test_scorer_matches_hand_computed_answer_only_nll(tiny_scorer):
    s = tiny_scorer
    query = {"id": 0, "input": "review: the movie was dull . sentiment:", "options": [" negative", " positive"], "gold": 0}
    cands = [{"id": 1, "text": "review: the meal was great . sentiment: positive"},
             {"id": 2, "text": "review: the song was bad . sentiment: negative"}]
    out = s.score(query, cands)
    for cand, rec in zip(cands, out, strict=True):
        prompt = cand["text"] + "\n" + query["input"]
        p_ids = s.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        hand = []
        for option in query["options"]:
            o_ids = s.tokenizer(option, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([p_ids + o_ids])
            with torch.no_grad():
                logp = torch.log_softmax(s.model(input_ids=ids).logits[0].float(), -1)  # (s, V)
            # token t is predicted at position t - 1; only the option's tokens count
            hand.append(-sum(float(logp[len(p_ids) + j - 1, tok]) for j, tok in enumerate(o_ids)) / len(o_ids))
        assert rec["option_nll"] == pytest.approx(hand, rel=F32_LAYERS)
        assert rec["loss"] == pytest.approx(hand[0] / sum(hand), rel=F32_LAYERS)
        assert rec["one_shot_acc"] == float(hand[0] < hand[1])
        assert rec["utility"] == pytest.approx(-hand[0], rel=F32_LAYERS)
    # the prompt's own tokens carry no loss: changing a prompt token changes the NLL only through conditioning,
    # and padding in a mixed-length batch changes nothing
    alone = [s.score(query, [c])[0]["option_nll"] for c in cands]
    assert [r["option_nll"] for r in out] == [pytest.approx(a, rel=F32_LAYERS) for a in alone]


def test_scorer_truncates_long_prompt_from_the_left_keeping_the_answer():
    s = LikelihoodScorer(backbone_config=TINY_GPT2, tokenizer="all-MiniLM-L6-v2", max_length=12)
    with pytest.warns(UserWarning, match="cut .* tokens from the left"):
        ids, k = s.build("one two three four five six seven eight nine ten eleven twelve thirteen", " positive")
    assert len(ids) == 12 and ids[-k:] == s.tokenizer(" positive", add_special_tokens=False)["input_ids"]
    with pytest.raises(ValueError, match="max_length"):
        s.build("x", " positive " * 20)


def test_synthetic_oracle_scorer_interface():
    world = make_icl_world(0, n_pool=30, n_train=5, n_test=5)
    scorer = SyntheticOracleScorer(world)
    recs = scorer.score({"id": 2}, [{"id": i} for i in range(6)])
    ref = world.score("train", torch.tensor([2]), torch.arange(6)[None])
    assert [r["loss"] for r in recs] == pytest.approx(ref["loss"][0].tolist())
    assert [r["loss"] for r in recs] == pytest.approx([-u for u in ref["utility"][0].tolist()])
    norm = SyntheticOracleScorer(world, loss="normalised").score({"id": 2}, [{"id": i} for i in range(6)])
    logp = torch.log_softmax(world.logits("train", torch.tensor([2]), torch.arange(6)[None]), -1)[0]  # (6, K)
    y = int(world.splits["train"]["y"][2])
    assert [r["loss"] for r in norm] == pytest.approx((logp[:, y] / logp.sum(-1)).tolist(), rel=F32_LAYERS)


# ----------------------------------------------------------------------------- 8. InfoNCE == cross-entropy
def test_infonce_equals_cross_entropy_on_explicit_logits():
    torch.manual_seed(0)
    b, k, d = 4, 3, 5
    q, pos, hard = torch.randn(b, d), torch.randn(b, d), torch.randn(b, k, d)
    rows = []
    for i in range(b):
        others = [pos[j] for j in range(b) if j != i] + [hard[j, t] for j in range(b) for t in range(k)]
        rows.append(torch.stack([q[i] @ pos[i], *[q[i] @ o for o in others]]))  # [pos | in-batch | hard negatives]
    expected = F.cross_entropy(torch.stack(rows), torch.zeros(b, dtype=torch.long))
    assert float(inbatch_infonce_loss(q, pos, hard)) == pytest.approx(float(expected), rel=F32)


# ----------------------------------------------------------------------------- bad inputs
def test_bad_inputs_raise_named_errors():
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match="beta"):
        sedpo_loss(x, x, x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="beta"):
        _module(beta=-1.0)
    with pytest.raises(ValueError, match="same shape"):
        sedpo_loss(x, x, torch.randn(3, 5), x, x, x)
    with pytest.raises(ValueError, match="NaN"):
        sedpo_loss_from_scores(torch.tensor([float("nan")]), torch.zeros(1), torch.zeros(1), torch.zeros(1))
    with pytest.raises(ValueError, match="at least 2"):
        PreferencePairBuilder()([])
    with pytest.raises(ValueError, match="at least 2"):
        PreferencePairBuilder()([{"loss": 0.1, "one_shot_acc": 1}])
    with pytest.raises(KeyError, match="no 'loss' field"):
        PreferencePairBuilder()([{"loss": 0.1}, {"one_shot_acc": 1}])
    with pytest.raises(ValueError, match="NaN"):
        PreferencePairBuilder().index_pairs(torch.tensor([0.1, float("nan")]), torch.ones(2))
    with pytest.raises(ValueError, match="top_k"):
        PreferencePairBuilder(top_k=0)
    with pytest.raises(ValueError, match="mode"):
        PreferencePairBuilder(mode="pf=4")
    with pytest.raises(ValueError, match="loss"):
        _module(loss="dpo")
    with pytest.raises(ValueError, match="scorer_loss"):
        SyntheticICLDataModule(scorer_loss="mse")
    with pytest.raises(ValueError, match="n_candidates"):
        SyntheticICLDataModule(n_pool=10, n_candidates=11)


# ----------------------------------------------------------------------------- module, data, retrieval
@pytest.mark.e2e
def test_training_improves_pool_ranking_over_init():
    dm = _small_dm(n_pool=200, n_train=96, n_test=40, n_candidates=16)
    m = _module(loss="sedpo", pair_mode="random", n_pairs=8, lr=3e-3)
    before = quiet_trainer().test(m, datamodule=dm, verbose=False)[0]["test/spearman"]
    quiet_trainer(max_epochs=8, limit_val_batches=0).fit(m, datamodule=dm)
    after = quiet_trainer().test(m, datamodule=dm, verbose=False)[0]
    assert after["test/spearman"] > before + 0.2
    assert after["test/top1_acc_oracle"] >= after["test/top1_acc"]


@pytest.mark.e2e
def test_eval_metrics_match_direct_computation():
    from torchmetrics.functional import spearman_corrcoef

    dm = _small_dm()
    m = _module()
    res = quiet_trainer().test(m, datamodule=dm, verbose=False)[0]
    dm.setup()
    world = dm.world
    scores = m.encode_queries(world.query_features("test")) @ m.encode_pool(dm.pool_inputs()).T  # (Q, N)
    full = world.score("test", torch.arange(10), torch.arange(60).expand(10, 60))
    expected = spearman_corrcoef(scores.T.detach(), full["utility"].T).mean()
    assert res["test/spearman"] == pytest.approx(float(expected), abs=F32_LAYERS)
    top = scores.argmax(1)
    assert res["test/top1_acc"] == pytest.approx(float(full["one_shot_acc"][torch.arange(10), top].mean()))
    assert res["test/top1_acc_random"] == pytest.approx(float(full["one_shot_acc"].mean()), abs=F32)
    util = full["utility"]
    rows = torch.arange(10)
    assert res["test/top1_is_best"] == pytest.approx(float((util[rows, top] >= util.max(1).values).float().mean()))
    rank = (util > util[rows, top][:, None]).float().mean(1)  # (10,) share of the pool above the top-1
    assert res["test/top1_utility_rank"] == pytest.approx(float(rank.mean()), abs=F32)
    assert res["test/top1_distinct"] == pytest.approx(len(top.unique()) / 10)
    # a retriever that ranks by the utility itself: its top-1 is the best, nothing lies above it
    m.encode_queries = lambda x, reference=False: util  # type: ignore[method-assign]
    m.encode_pool = lambda pool, chunk=512: torch.eye(60)  # type: ignore[method-assign]
    best = quiet_trainer().test(m, datamodule=dm, verbose=False)[0]
    assert best["test/top1_is_best"] == 1.0 and best["test/top1_utility_rank"] == 0.0
    assert best["test/top1_acc"] == pytest.approx(res["test/top1_acc_oracle"])


def test_beam_retrieve_picks_distinct_top_exemplars():
    dm = _small_dm()
    dm.setup()
    m = _module()
    pool = dm.pool_inputs()
    query = dm.world.query_features("test")[:1]
    picked = beam_retrieve(m, query, pool, shots=3, beam=3)
    scores = (m.encode_queries(query) @ m.encode_pool(pool).T)[0]
    assert picked == scores.topk(3).indices.tolist()  # the query does not depend on the prefix: the top 3 in order
    assert beam_retrieve(m, query, pool_emb=m.encode_pool(pool), shots=3, beam=1) == picked
    # a prefix-aware query: compose() moves the query after each pick; beam search follows it
    calls = []

    def compose(chosen):
        calls.append(tuple(chosen))
        return query + 0.5 * len(chosen)

    picked2 = beam_retrieve(m, query, pool, shots=2, beam=2, compose=compose)
    assert len(set(picked2)) == 2 and () in calls and any(len(c) == 1 for c in calls)
    with pytest.raises(ValueError, match="shots"):
        beam_retrieve(m, query, pool, shots=0)


@pytest.mark.e2e
def test_infonce_and_hybrid_train(run_root):
    for loss in ("infonce", "hybrid"):
        m = _module(loss=loss, n_hard=3)
        quiet_trainer(max_steps=3, limit_val_batches=0).fit(m, datamodule=_small_dm())
        assert math.isfinite(float(quiet_trainer().test(m, datamodule=_small_dm(), verbose=False)[0]["test/spearman"]))


@pytest.mark.e2e
def test_init_from_checkpoint_loads_towers_and_reference(tmp_path):
    m = _module(loss="infonce")
    trainer = quiet_trainer(max_steps=3, limit_val_batches=0, enable_checkpointing=False)
    trainer.fit(m, datamodule=_small_dm())
    path = tmp_path / "infonce.ckpt"
    trainer.save_checkpoint(path)
    q, e = _towers(seed=5)
    m2 = ICLRetrieverModule(q, e, loss="sedpo", init_checkpoint=str(path))
    for k, v in m.query_encoder.state_dict().items():
        assert torch.equal(m2.query_encoder.state_dict()[k], v) and torch.equal(m2.ref_query.state_dict()[k], v)
    with pytest.raises(FileNotFoundError, match="init_checkpoint"):
        ICLRetrieverModule(*_towers(), init_checkpoint=str(tmp_path / "missing.ckpt"))


# ----------------------------------------------------------------------------- text data and the cache
class _CountingScorer:
    """A stand-in scorer: loss = 1 / (1 + shared words), counts the pairs it scores."""

    def __init__(self):
        self.calls = 0

    def score_matrix(self, queries, candidates, cand_index):
        self.calls += int(cand_index.numel())
        loss = torch.tensor([[1.0 / (1 + len(set(q["input"].split()) & set(candidates[int(j)]["text"].split())))
                              for j in row] for q, row in zip(queries, cand_index, strict=True)])
        return {"loss": loss, "one_shot_acc": (loss < 0.2).float(), "utility": -loss}


def test_text_datamodule_caches_scores_and_resumes(tmp_path):
    scorer = _CountingScorer()
    args = dict(n_pool=12, n_train=6, n_test=3, n_candidates=4, cache_dir=str(tmp_path / "cache"), data_seed=0)
    dm = TextICLDataModule(scorer, **args)
    dm.setup()
    assert scorer.calls == 6 * 4 + 3 * 12
    batch = next(iter(dm.train_dataloader()))
    assert batch["cands"]["input_ids"].shape[:2] == (6, 4) and batch["loss"].shape == (6, 4)
    again = _CountingScorer()
    dm2 = TextICLDataModule(again, **args)
    dm2.setup()
    assert again.calls == 0  # everything came from the cache
    for split in ("train", "test"):
        assert all(torch.equal(a, b) for a, b in zip(dm._splits[split].tensors, dm2._splits[split].tensors, strict=True))
    assert len(ScoreCache(str(tmp_path / "cache")).load()) == 6 * 4 + 3 * 12
    with pytest.raises(TypeError, match="score_matrix"):
        TextICLDataModule(object())


def test_text_records_are_well_formed():
    recs = sentiment_records(6, random.Random(0))
    assert [r["gold"] for r in recs] == [0, 1, 0, 1, 0, 1]
    assert all(r["text"] == r["input"] + r["options"][r["gold"]] for r in recs)


@pytest.mark.e2e
def test_text_retriever_trains_with_minilm_towers(tmp_path):
    from lowrank_lit.models.text import SentenceEncoder

    scorer = _CountingScorer()
    dm = TextICLDataModule(scorer, n_pool=10, n_train=8, n_test=4, n_candidates=4, data_seed=0, batch_size=4)
    enc = SentenceEncoder(num_layers=1)
    m = ICLRetrieverModule(enc, loss="hybrid", n_hard=2, lr=1e-4)
    assert m.ref_exemplar is None  # a shared tower has one reference
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quiet_trainer(max_steps=2, limit_val_batches=0).fit(m, datamodule=dm)
        res = quiet_trainer().test(m, datamodule=dm, verbose=False)[0]
    assert -1.0 <= res["test/spearman"] <= 1.0


@pytest.mark.e2e
def test_predict_scores_into_rank_shards_and_resumes(tmp_path):
    cache = tmp_path / "cache"
    cfg = CONFIGS / "icl_rank_retriever/text_minilm_score.yaml"
    extra = ["--data.init_args.n_pool=6", "--data.init_args.n_train=3", "--data.init_args.n_test=2",
             "--data.init_args.n_candidates=2", f"--data.init_args.cache_dir={cache}", "--trainer.enable_progress_bar=false"]
    assert run_cli("predict", "--config", cfg, *extra, run_root=tmp_path / "runs") == 0
    first = ScoreCache(str(cache)).load()
    assert len(first) == 3 * 2 + 2 * 6 and (cache / "scores.rank0.jsonl").is_file()
    lines = (cache / "scores.rank0.jsonl").read_text().splitlines()
    assert run_cli("predict", "--config", cfg, *extra, run_root=tmp_path / "runs2") == 0  # nothing left to score
    assert (cache / "scores.rank0.jsonl").read_text().splitlines() == lines


@pytest.fixture(scope="module")
def synthetic_runs():
    """InfoNCE, SeDPO and hybrid on the synthetic world, random states 0-9: the test metrics of each run."""
    import tempfile
    from pathlib import Path

    from lowrank_lit.report import last_values

    root_args = ["--trainer.enable_progress_bar=false", "--trainer.enable_checkpointing=false"]
    res: dict[str, list[dict[str, float]]] = {}
    for loss in ("infonce", "sedpo", "hybrid"):
        for seed in range(10):  # the seed budget (docs/reproduce.md, "How many seeds")
            with tempfile.TemporaryDirectory() as tmp:
                assert run_cli("fit", "--config", CONFIGS / f"icl_rank_retriever/synthetic_{loss}.yaml",
                               f"--seed_everything={seed}", *root_args, run_root=Path(tmp)) == 0
                (metrics,) = Path(tmp).rglob("metrics.csv")
                res.setdefault(loss, []).append(last_values(metrics))
    return res


def _per_seed(runs: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in runs]  # random states 0-9 in order: pairs for the verdict rule


@pytest.mark.slow
def test_must_show_ranking_trained_retrievers_order_the_pool(synthetic_runs):
    """Random states 0-9, Spearman gain over InfoNCE >= 0.3 by the verdict rule (delta 0.05): SeDPO holds (+0.560,
    95 % interval [+0.546, +0.574]); hybrid holds (+0.327, [+0.303, +0.351]; inconclusive at states 0-4 alone)."""
    from lowrank_lit.stats import expect_verdict

    sp = {k: _per_seed(v, "test/spearman") for k, v in synthetic_runs.items()}
    expect_verdict("holds", sp["sedpo"], sp["infonce"], margin=0.3, delta=0.05, claim="SeDPO Spearman >= InfoNCE + 0.3")
    expect_verdict("holds", sp["hybrid"], sp["infonce"], margin=0.3, delta=0.05, claim="hybrid Spearman >= InfoNCE + 0.3")


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "does not hold; the paper's headline is ICL accuracy with the retrieved examples; random states 0-9: one-shot "
    "accuracy of the retrieved top-1 SeDPO 0.312 +- 0.072 (0.192 / 0.242 / 0.396 / 0.318 / 0.264 / 0.306 / 0.308 / "
    "0.378 / 0.424 / 0.292) against InfoNCE 0.690 +- 0.058, difference -0.378, 95 % interval [-0.409, -0.347]; "
    "SeDPO's top-1 is never the best exemplar and 22 % of the pool scores higher (docs/methods/icl_rank_retriever.md, "
    "Not reproduced here)"))
def test_must_show_sedpo_retrieves_better_one_shot_examples_than_infonce(synthetic_runs):
    """The downstream claim: the SeDPO retriever's top-1 exemplar gives a higher one-shot accuracy than InfoNCE's."""
    from lowrank_lit.stats import expect_verdict

    acc = {k: _per_seed(v, "test/top1_acc") for k, v in synthetic_runs.items()}
    expect_verdict("holds", acc["sedpo"], acc["infonce"], delta=0.01, claim="SeDPO top-1 one-shot accuracy >= InfoNCE's")


def test_scorer_rejects_a_zero_context_length():
    with pytest.raises(ValueError, match="LikelihoodScorer: max_length=0; allowed: a positive integer"):
        LikelihoodScorer(backbone_config=TINY_GPT2, tokenizer="all-MiniLM-L6-v2", max_length=0)
