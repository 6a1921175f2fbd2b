"""Shared LoRA adapters (nn/lora.py): identity at init, peft parity, MoE-LoRA reduction, masking and compensation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowrank_lit.nn.lora import (
    AsymmetricLoRALinear,
    LoRALinear,
    dycompensate,
    inject_adapters,
    mark_only_adapters_trainable,
)
from tests.tolerances import F32, F32_LAYERS

#: our LoRA against peft's, compared as floats: CI runs these under ATEN_CPU_CAPABILITY=default and avx2 too (.ci/run)
pytestmark = pytest.mark.floats


def _linear(d_in: int = 16, d_out: int = 12) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(d_in, d_out)


def test_lora_is_identity_at_init_and_merges_exactly():
    base = _linear()
    x = torch.randn(5, 16)
    ref = base(x)
    lora = LoRALinear(base, r=4, alpha=8)
    assert torch.equal(lora(x), ref)
    with torch.no_grad():
        lora.lora_B.normal_()
    out = lora(x)
    torch.testing.assert_close(out, ref + 2.0 * x @ lora.lora_A.T @ lora.lora_B.T)
    lora.merge()
    torch.testing.assert_close(lora(x), out, atol=F32_LAYERS, rtol=F32_LAYERS)
    lora.unmerge()
    torch.testing.assert_close(lora.base.weight, _linear().weight, atol=F32, rtol=0)


def test_lora_matches_peft_on_bert_query_value():
    peft = pytest.importorskip("peft")
    from lowrank_lit.models.text import load_backbone
    from tests.helpers import text_batch

    ids, mask = text_batch()
    ours, _ = load_backbone(num_layers=1)
    ref = peft.get_peft_model(load_backbone(num_layers=1)[0],
                              peft.LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0))
    inject_adapters(ours, ["*.query", "*.value"], lambda lin: LoRALinear(lin, r=4, alpha=8))
    torch.manual_seed(1)
    for name in ("query", "value"):
        mine = getattr(ours.encoder.layer[0].attention.self, name)
        theirs = getattr(ref.base_model.model.encoder.layer[0].attention.self, name)
        with torch.no_grad():
            mine.lora_B.normal_(0, 0.1)
            theirs.lora_A["default"].weight.copy_(mine.lora_A)
            theirs.lora_B["default"].weight.copy_(mine.lora_B)
    ref.eval()
    torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).last_hidden_state,
                               ref(input_ids=ids, attention_mask=mask).last_hidden_state, atol=F32_LAYERS, rtol=0)


def test_asymmetric_with_one_expert_and_no_poison_is_plain_lora():
    x = torch.randn(3, 7, 16)
    asym = AsymmetricLoRALinear(_linear(), r=4, n_experts=1, n_poison=0, alpha=8, compensate_k=0)
    lora = LoRALinear(_linear(), r=4, alpha=8)
    with torch.no_grad():
        asym.lora_B[0].normal_()
        lora.lora_A.copy_(asym.lora_A)
        lora.lora_B.copy_(asym.lora_B[0])
    torch.testing.assert_close(asym(x), lora(x), atol=F32, rtol=0)


def test_asymmetric_identity_at_init_and_router_weights_are_a_distribution():
    base = _linear()
    x = torch.randn(2, 5, 16)
    layer = AsymmetricLoRALinear(base, r=4, n_experts=3, n_poison=1)
    assert torch.equal(layer(x), base(x))
    w = layer.last_weights
    assert w.shape == (2, 5, 4) and bool((w >= 0).all())
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 5))


def test_poison_only_mode_uses_only_the_poison_expert():
    layer = AsymmetricLoRALinear(_linear(), r=4, n_experts=3, n_poison=1)
    with torch.no_grad():
        for b in layer.lora_B:
            b.normal_()
    x = torch.randn(4, 16)
    layer.set_mode("poison_only")
    expected = layer.base(x) + layer.scaling * x @ layer.lora_A.T @ layer.lora_B[3].T
    torch.testing.assert_close(layer(x), expected, atol=F32, rtol=0)
    with pytest.raises(ValueError, match="mode='stage3'"):
        layer.set_mode("stage3")


def test_dycompensate_masking_and_top_k():
    torch.manual_seed(0)
    w = torch.softmax(torch.randn(6, 4), -1)
    outs = torch.randn(6, 4, 5)
    masked = dycompensate(w, outs, [3], k=0)
    torch.testing.assert_close(masked.sum(-1), 1 - w[:, 3])
    assert bool((masked[:, 3] == 0).all()) and torch.equal(masked[:, :3], w[:, :3])
    outs[:, 0] = outs[:, 3] * 2.0  # expert 0 points exactly along the poison expert
    outs[:, 1] = -outs[:, 3]  # expert 1 opposite: never compensated
    comp = dycompensate(w, outs, [3], k=1, beta=1.0)
    torch.testing.assert_close(comp.sum(-1), torch.ones(6))
    torch.testing.assert_close(comp[:, 0], w[:, 0] + w[:, 3])
    assert torch.equal(comp[:, 1:3], w[:, 1:3])  # only the top-1 most similar expert changes
    with pytest.raises(ValueError, match="k=4"):
        dycompensate(w, outs, [3], k=4)


def test_inject_and_freeze_by_pattern():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    names = inject_adapters(model, ["0"], lambda lin: AsymmetricLoRALinear(lin, r=2, n_experts=2, n_poison=1))
    assert names == ["0"] and isinstance(model[0], AsymmetricLoRALinear)
    n = mark_only_adapters_trainable(model)
    assert n == 2 * 8 + 3 * 8 * 2 + 2 * 3  # A, three B's, router (r -> 3)
    assert not model[2].weight.requires_grad and not model[0].base.weight.requires_grad
    with pytest.raises(ValueError, match="'1' is a ReLU"):
        inject_adapters(model, ["1"], lambda lin: LoRALinear(lin, r=2))
    with pytest.raises(ValueError, match="no module"):
        inject_adapters(model, ["*.query"], lambda lin: LoRALinear(lin, r=2))
    with pytest.raises(ValueError, match="r=9"):
        LoRALinear(nn.Linear(8, 8), r=9)


def test_layers_say_what_they_are_in_peft_terms_or_why_not():
    """The export protocol (lowrank_lit.nn.export): LoRA and the plain soft prompt answer ``to_peft``, the routed
    experts and the other prompts refuse with their reason; ``unwrap`` hands back the base, merged on request."""
    from lowrank_lit.methods.capt import CapsulePrompt
    from lowrank_lit.nn.export import ExportRefused, is_adapter, is_peft_exportable
    from lowrank_lit.nn.prompts import SoftPrompt

    torch.manual_seed(0)
    lora = LoRALinear(_linear(), r=2, alpha=6.0, dropout=0.1)
    with torch.no_grad():
        lora.lora_B.normal_()
    x = torch.randn(4, 16)
    want = lora.eval()(x)
    spec = lora.to_peft()
    assert spec.peft_type == "LORA" and spec.config == {"r": 2, "lora_alpha": 6.0, "lora_dropout": 0.1}
    assert torch.equal(spec.state["lora_A.weight"], lora.lora_A) and torch.equal(spec.state["lora_B.weight"], lora.lora_B)
    assert is_adapter(lora) and lora.unwrap(merge=False) is lora.base and not lora.merged
    base = lora.unwrap(merge=True)
    torch.testing.assert_close(base(x), want, atol=F32, rtol=0)  # the delta folded into the weight
    experts = AsymmetricLoRALinear(_linear(), r=2)
    for ask in (experts.to_peft, lambda: experts.unwrap(True)):
        with pytest.raises(ExportRefused, match="AsymmetricLoRALinear .HydraLoRA / LoPE experts"):
            ask()
    soft = SoftPrompt(prompt_len=3, hidden=8)
    assert is_peft_exportable(soft) and not is_adapter(soft)
    got = soft.to_peft()
    assert got.peft_type == "PROMPT_TUNING" and got.config == {"num_virtual_tokens": 3}
    assert torch.equal(got.state["prompt_embeddings"], soft.prompt_embeddings)
    with pytest.raises(ExportRefused, match="CapsulePrompt has no peft type"):
        CapsulePrompt(num_layers=2, hidden=8).to_peft()
