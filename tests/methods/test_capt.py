"""CaPT (paper 16): the capsule recursion, special cases, padding, instance dependence, no label leak, bad inputs."""

from __future__ import annotations

import pytest
import torch

from lowrank_lit.methods.capt import CapsulePrompt
from lowrank_lit.models.text import (
    PromptedBackbone,
    PromptTunedClassifier,
    PromptTunedLM,
    load_backbone,
)
from lowrank_lit.nn.prompts import DeepPrompt, anchor_attention_share, masked_mean
from tests.helpers import CONFIGS, TINY_LLAMA, run_cli, run_dirs, text_batch
from tests.tolerances import F32, F32_LAYERS

SHORT = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=2",
         "--trainer.enable_progress_bar=false"]



def _bert(layers: int = 3):
    torch.manual_seed(0)
    return load_backbone("all-MiniLM-L6-v2", num_layers=layers)[0]


@pytest.fixture(scope="module")
def batch():
    return text_batch()


def _capsule(layers: int = 3, **kw) -> CapsulePrompt:
    cap = CapsulePrompt(num_layers=layers, hidden=384, **kw)
    with torch.no_grad():
        cap.prompt_capsule.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    return cap


def _record_layers(model):
    """Inputs and outputs of every layer, after the capsule hook has written the slot."""
    from lowrank_lit.models.text import find_layers

    ins, outs, handles = [], [], []
    for layer in find_layers(model):
        handles.append(layer.register_forward_pre_hook(
            lambda m, a, k: ins.append((k.get("hidden_states") if "hidden_states" in k else a[0]).detach()), with_kwargs=True))
        handles.append(layer.register_forward_hook(
            lambda m, a, o: outs.append((o[0] if isinstance(o, tuple) else o).detach())))
    return ins, outs, handles


# ------------------------------------------------------------------------------------ 1. counts, frozen
def test_trainable_count_is_L_times_H_and_backbone_gets_no_grad(batch):
    model = _bert()
    cap = _capsule()
    assert cap.trainable_count() == 3 * 384 == cap.expected_count()
    clf = PromptTunedClassifier(num_layers=6, prompt=CapsulePrompt(6, 384))
    assert clf.parameter_counts() == {"prompt": 2304, "adapter": 0, "head": 770, "backbone": 0}
    enc = PromptedBackbone(model, cap)
    enc(*batch).hidden.sum().backward()
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())


# ------------------------------------------------------------------------------------ 2. the recursion
def test_layer_inputs_follow_the_capsule_recursion(batch):
    model = _bert()
    cap = _capsule()
    enc = PromptedBackbone(model, cap)
    ins, outs, handles = _record_layers(model)
    ids, mask = batch
    enc(ids, mask)
    for h in handles:
        h.remove()
    E = model.embeddings(inputs_embeds=torch.cat([torch.zeros(3, 1, 384), model.embeddings.word_embeddings(ids)], 1))
    full = torch.cat([torch.ones(3, 1, dtype=mask.dtype), mask], 1)
    real = full.clone()
    real[:, 0] = 0
    torch.testing.assert_close(ins[0][:, 0], cap.prompt_capsule[0] + masked_mean(E, real), atol=F32, rtol=0)
    for i in (1, 2):  # S_i = p_i + Mean([S'_{i-1}; H_{i-1}]) over the capsule slot and the real tokens
        torch.testing.assert_close(ins[i][:, 0], cap.prompt_capsule[i] + masked_mean(outs[i - 1], full), atol=F32, rtol=0)
        torch.testing.assert_close(ins[i][:, 1:], outs[i - 1][:, 1:])  # only the slot is rewritten


# ------------------------------------------------------------------------------------ 3. special cases
def test_no_instance_term_equals_deep_prompt_m1_and_zero_prompt_equals_zero_deep_pt(batch):
    model = _bert()
    cap = _capsule(instance=False)
    deep = DeepPrompt(num_layers=3, prompt_len=1, hidden=384)
    with torch.no_grad():
        deep.prompt_deep.copy_(cap.prompt_capsule.unsqueeze(1))
    a = PromptedBackbone(model, cap)(*batch).hidden
    model2 = _bert()
    b = PromptedBackbone(model2, deep)(*batch).hidden
    torch.testing.assert_close(a, b, atol=F32, rtol=0)
    zero_cap, zero_deep = CapsulePrompt(3, 384, instance=False), DeepPrompt(3, 1, 384)
    with torch.no_grad():
        zero_deep.prompt_deep.zero_()
    torch.testing.assert_close(PromptedBackbone(_bert(), zero_cap)(*batch).hidden,
                               PromptedBackbone(_bert(), zero_deep)(*batch).hidden, atol=F32, rtol=0)


# ------------------------------------------------------------------------------------ 4. padding
def test_padding_invariance(batch):
    model = _bert()
    cap = _capsule()
    enc = PromptedBackbone(model, cap)
    ids, mask = batch
    ins_a, _, h1 = _record_layers(model)
    a = enc(ids, mask).hidden
    [h.remove() for h in h1]
    pad = torch.zeros(3, 4, dtype=ids.dtype)
    ins_b, _, h2 = _record_layers(model)
    b = enc(torch.cat([ids, pad], 1), torch.cat([mask, pad], 1)).hidden
    [h.remove() for h in h2]
    for x, y in zip(ins_a, ins_b, strict=True):
        torch.testing.assert_close(x[:, 0], y[:, 0], atol=F32_LAYERS, rtol=0)
    real = mask.bool()
    torch.testing.assert_close(a[real], b[:, :12][real], atol=F32_LAYERS, rtol=0)


# ------------------------------------------------------------------------------------ 5. instance dependence
def test_first_capsule_difference_is_the_difference_of_means(batch):
    model = _bert()
    cap = _capsule()
    ids, mask = batch
    E = torch.randn(2, 13, 384)
    full = torch.ones(2, 13)
    S = cap.layer_prompt(0, E, full)  # (2, 1, H)
    real = full.clone()
    real[:, 0] = 0
    mu = masked_mean(E, real)
    assert not torch.allclose(S[0], S[1])
    torch.testing.assert_close(S[0, 0] - S[1, 0], mu[0] - mu[1], atol=F32, rtol=0)
    del model, ids


# ------------------------------------------------------------------------------------ 6. no label leak
def test_answer_tokens_never_reach_the_capsule():
    torch.manual_seed(0)
    model, _ = load_backbone(causal=True, config=TINY_LLAMA)
    cap = CapsulePrompt(num_layers=2, hidden=32)
    lm = PromptTunedLM(backbone_config=TINY_LLAMA, prompt=cap)
    lm.lm.backbone.load_state_dict(model.state_dict())
    ids = torch.randint(5, 100, (2, 10))
    labels = torch.full_like(ids, -100)
    labels[:, 7:] = ids[:, 7:]
    inst = torch.zeros_like(ids)
    inst[:, :7] = 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels, "instance_mask": inst}
    caps = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, k: caps.append((k.get("hidden_states") if "hidden_states" in k else a[0])[:, 0].detach()), with_kwargs=True)
             for layer in lm.lm.layers]
    lm(batch)
    other = dict(batch, input_ids=ids.clone(), labels=labels.clone())
    other["input_ids"][:, 7:] = torch.randint(200, 300, (2, 3))
    other["labels"][:, 7:] = other["input_ids"][:, 7:]
    lm(other)
    [h.remove() for h in hooks]
    for a, b in zip(caps[:2], caps[2:], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    with pytest.raises(ValueError, match="instance_mask"):
        lm({k: v for k, v in batch.items() if k != "instance_mask"})
    with pytest.raises(ValueError, match="answer"):
        lm(dict(batch, instance_mask=torch.ones_like(ids)))


# ------------------------------------------------------------------------------------ 7. shapes, grads
def test_every_layer_sees_n_plus_one_tokens_and_every_p_gets_a_gradient(batch):
    model = _bert()
    cap = _capsule()
    enc = PromptedBackbone(model, cap)
    ins, _, handles = _record_layers(model)
    out = enc(*batch)
    [h.remove() for h in handles]
    assert all(x.shape[1] == 13 for x in ins) and out.hidden.shape == (3, 12, 384)
    masked_mean(out.hidden, batch[1]).pow(2).sum().backward()
    assert (cap.prompt_capsule.grad.abs().sum(-1) > 0).all()


def test_variants_run_and_prepend_uses_two_slots(batch):
    for variant in ("prepend", "conv", "proj"):
        n = 2 if variant == "prepend" else 1
        cap = CapsulePrompt(3, 384, variant=variant, n_capsules=n)
        out = PromptedBackbone(_bert(), cap)(*batch)
        assert out.mask.shape[1] == 12 + n and torch.isfinite(out.hidden).all()
    conv = CapsulePrompt(3, 384, variant="conv")  # identity-initialised conv: the same capsule as add
    add = CapsulePrompt(3, 384)
    h = torch.randn(2, 9, 384)
    torch.testing.assert_close(conv.layer_prompt(1, h, torch.ones(2, 9)), add.layer_prompt(1, h, torch.ones(2, 9)),
                               atol=F32, rtol=0)


def test_anchor_share_counts_real_queries_only():
    att = torch.zeros(1, 1, 4, 4)
    att[0, 0, :, 0] = 1.0  # every query attends to slot 0 only
    att[0, 0, 0] = torch.tensor([0.0, 1.0, 0.0, 0.0])  # the slot's own row must not count
    share = anchor_attention_share([att], torch.ones(1, 4), 1)
    assert share.tolist() == [1.0]


# ------------------------------------------------------------------------------------ bad inputs
def test_bad_inputs(batch):
    model = _bert()
    ids, mask = batch
    with pytest.raises(ValueError, match=r"num_layers=4 but the backbone has 3 layers"):
        PromptedBackbone(model, CapsulePrompt(4, 384))
    with pytest.raises(ValueError, match="hidden size is 384"):
        PromptedBackbone(model, CapsulePrompt(3, 256))
    enc = PromptedBackbone(model, _capsule())
    with pytest.raises(ValueError, match="no unmasked token"):
        enc(ids, torch.cat([mask[:2], torch.zeros_like(mask[:1])]))
    with pytest.raises(ValueError, match="attention_mask shape"):
        enc(ids, mask[:, :5])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        enc(torch.ones(1, 512, dtype=torch.long), torch.ones(1, 512, dtype=torch.long))
    with pytest.raises(ValueError, match="variant='mean'"):
        CapsulePrompt(3, 384, variant="mean")
    with pytest.raises(ValueError, match="n_capsules=2"):
        CapsulePrompt(3, 384, n_capsules=2)
    with pytest.raises(ValueError, match="init='ones'"):
        CapsulePrompt(3, 384, init="ones")
    trainable = _bert()
    trainable.requires_grad_(True)
    with pytest.raises(ValueError, match="strict_frozen"):
        PromptedBackbone(trainable, _capsule())


# ------------------------------------------------------------------------------------ must show
CAPT_CELLS = ("capt", "deep_pt", "ptv2", "capt_instance", "head", "pt")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """CaPT and its baselines on the PEFT suite, seeds 0-2 (``$LOWRANK_PEFT_SUITE_RUNS`` reuses a sweep's)."""
    from tests.helpers import peft_suite_runs

    return peft_suite_runs(CAPT_CELLS, tmp_path_factory.mktemp("peft_suite"))


def _per_seed(res: dict[str, list[dict[str, float]]], name: str, key: str = "test/acc") -> list[float]:
    return [r[key] for r in res[name]]  # seeds 0, 1, 2 in order: pairs for the verdict rule


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "does not hold; PEFT suite, seeds 0-2 (docs/peft_suite.md): CaPT 69.2 (70.1 / 68.8 / 68.7) against deep PT "
    "74.8 (75.7 / 76.6 / 72.2), difference -5.6 points, 95 % interval [-11.0, -0.3]; CaPT stays at chance on "
    "agreement (50.0) where deep PT reaches 62.7"))
def test_must_show_capt_beats_deep_pt(bench):
    """The paper's claim on the PEFT suite (3 seeds): CaPT >= deep prompt tuning with one token per layer."""
    from lowrank_lit.stats import expect_verdict

    expect_verdict("holds", _per_seed(bench, "capt"), _per_seed(bench, "deep_pt"), delta=0.01, claim="CaPT >= deep PT")


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "does not hold; PEFT suite, seeds 0-2 (docs/peft_suite.md): CaPT 69.2 +- 0.8 against P-tuning v2 87.1 +- 0.9 "
    "(18 points below, not 2; the interval lies below -13); P-tuning v2 solves parity and agreement (96.8, 99.5), "
    "CaPT does not (80.7, 50.0)"))
def test_must_show_capt_near_ptv2_with_a_quarter_of_its_parameters(bench):
    """CaPT within 2 points of P-tuning v2 (4 tokens per layer) with 1/4 of its parameters."""
    from lowrank_lit.stats import expect_verdict

    assert bench["capt"][0]["params/prompt"] * 4 == bench["ptv2"][0]["params/prompt"]
    expect_verdict("holds", _per_seed(bench, "capt"), _per_seed(bench, "ptv2"), margin=-0.02, delta=0.01,
                   claim="CaPT >= P-tuning v2 - 2 points")


@pytest.mark.slow
def test_must_show_capt_instance_only_beats_head_only(bench):
    """The training-free instance token helps: instance-only CaPT >= head-only. Judged by the verdict rule over seeds
    0-2 (three of the budget's five) with delta = 1 point: 57.6 +- 0.8 against 57.3 +- 0.4, a mean difference of 0.3
    points. Inconclusive: equivalence within 1 point would need the per-seed differences' spread below 0.42 points,
    which two runs whose own spreads are 0.8 and 0.4 reach only when their seed effects correlate at 0.98 or more."""
    from lowrank_lit.stats import expect_verdict

    expect_verdict("inconclusive", _per_seed(bench, "capt_instance"), _per_seed(bench, "head"), delta=0.01,
                   claim="instance-only CaPT >= head-only")


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "does not hold; PEFT suite, seeds 0-2 (docs/peft_suite.md): CaPT's capsule gets 0.216 of the real tokens' "
    "attention (0.221 / 0.215 / 0.211), PT's largest slot 0.318 (0.320 / 0.288 / 0.345): difference -0.102, "
    "95 % interval [-0.178, -0.026]"))
def test_must_show_capt_anchor_share(bench):
    """The capsule is an attention anchor: its share of real tokens' attention > the largest slot share of PT."""
    from lowrank_lit.stats import expect_verdict

    expect_verdict("holds", _per_seed(bench, "capt", "test/anchor_share"), _per_seed(bench, "pt", "test/max_slot_share"), delta=0.02,
                   claim="CaPT's anchor share > PT's largest slot share")


@pytest.mark.e2e
def test_cli_smoke_with_one_layer(tmp_path, capsys):
    from lowrank_lit.report import last_values

    rc = run_cli("fit", "--config", CONFIGS / "capt" / "templated_capt.yaml", "--model.init_args.num_layers=1",
                 "--model.init_args.prompt.init_args.num_layers=1", *SHORT, run_root=tmp_path)
    assert rc == 0
    values = last_values(run_dirs(tmp_path)[0] / "metrics.csv")
    assert values["params/prompt"] == 384 and 0.0 < values["test/anchor_share"] < 1.0
    # a capsule built for another depth is refused with the layer count
    assert run_cli("fit", "--config", CONFIGS / "capt" / "templated_capt.yaml", "--model.init_args.num_layers=1",
                   "--trainer.fast_dev_run=true", run_root=tmp_path / "bad") == 2
    assert "num_layers=2 but the backbone has 1 layers" in capsys.readouterr().err
