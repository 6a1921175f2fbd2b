"""Methods across papers: LoRA on a GLVQ-quantized base (compress -> adapt -> merge)."""

from __future__ import annotations

import csv

import pytest
import torch
from torch import nn

from lowrank_lit.nn.lora import LoRALinear, inject_adapters, mark_only_adapters_trainable
from tests.helpers import ROOT, run_cli


def _quantized(bits: int = 2) -> tuple[nn.Linear, nn.Module, torch.Tensor]:
    from lowrank_lit.nn.glvq import quantize_linear

    torch.manual_seed(0)
    lin = nn.Linear(64, 32)
    X = torch.randn(256, 64)
    q, _ = quantize_linear(lin, X, bits, 32, 8, "glvq", steps=5)
    return lin, q, X


def test_lora_on_a_glvq_base_starts_as_the_quantized_layer_and_keeps_its_codes():
    _, q, X = _quantized()
    model = nn.Sequential(q, nn.ReLU(), nn.Linear(32, 4))
    want = model(X).detach()
    assert inject_adapters(model, ["0"], lambda layer: LoRALinear(layer, r=4, alpha=8.0)) == ["0"]
    assert isinstance(model[0], LoRALinear) and model[0].base is q
    torch.testing.assert_close(model(X), want)  # B = 0: the adapter starts as the quantized layer
    assert mark_only_adapters_trainable(model) == 4 * 64 + 32 * 4
    codes = q.packed.clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        model(X).pow(2).mean().backward()
        opt.step()
    assert torch.equal(q.packed, codes) and model[0].lora_B.abs().sum() > 0  # adapters moved, codes did not
    with pytest.raises(ValueError, match="has no float weight to fold into; dequantize"):
        model[0].merge()


def test_merge_requantize_folds_the_adapter_and_quantizes_again():
    from lowrank_lit.nn.glvq import GLVQLinear
    from lowrank_lit.studies.compress_adapt_merge import merge_requantize

    _, q, X = _quantized(bits=3)
    adapted = LoRALinear(q, r=4, alpha=8.0)
    with torch.no_grad():
        adapted.lora_B.normal_(0, 0.05)
    merged, report = merge_requantize(adapted, X, bits=3, group_size=32, dim=8, steps=5)
    assert isinstance(merged, GLVQLinear) and merged.bits.tolist() == [3, 3]
    want = q.weight_hat() + adapted.delta_weight()  # what was folded
    got = merged.weight_hat()
    assert float((got - want).norm() / want.norm()) < 0.25 and report["rel_error"] < 0.05
    assert float((got - q.weight_hat()).norm()) > 0.1 * float(adapted.delta_weight().norm())  # the delta is in it
    with pytest.raises(ValueError, match="is not a LoRALinear"):
        merge_requantize(q, X, 2)


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["glvq_lora_merge.yaml", "rtn_lora_merge.yaml"])
def test_compress_adapt_merge_configs_run(config, tmp_path):
    """Both configs end to end on a briefly trained full-precision model: every stage logged, codes frozen."""
    assert run_cli("fit", "--config", ROOT / "configs" / "glvq" / "mlp_digits_fp.yaml", "--trainer.max_epochs=2",
                   "--test_after_fit=false", run_root=tmp_path / "runs") == 0
    fp_ckpt = tmp_path / "runs" / "glvq" / "mlp_digits_fp" / "fp" / "checkpoints" / "last.ckpt"
    assert run_cli("fit", "--config", ROOT / "configs" / "compose" / config, f"--trainer.callbacks.init_args.fp_ckpt={fp_ckpt}",
                   "--trainer.max_epochs=1", "--trainer.callbacks.init_args.steps=3", "--run_id", "smoke",
                   run_root=tmp_path / "runs") == 0
    (path,) = (tmp_path / "runs" / "compose").rglob("compose.csv")
    row = next(csv.DictReader(path.open()))
    assert {"acc_fp", "acc_quantized", "acc_adapted", "acc_merged"} <= set(row)
    assert row.get("codes_unchanged", "1.0") == "1.0"


#: seeds of the compress -> adapt -> merge study (each run about 30 s)
MERGE_SEEDS = (0, 1, 2, 3, 4)  # 5 of the budget's 10 (docs/reproduce.md, "How many seeds"): not yet rerun at 10


@pytest.mark.slow
def test_must_show_compress_adapt_merge_on_the_digits_mlp(tmp_path):
    """Our acceptance criterion for the composition, each part judged by the verdict rule paired over seeds 0-4:
    GLVQ-2 + LoRA r=4 >= GLVQ-2 + 0.01 and >= fp - 0.01; the merged, re-quantized model within 0.01 of the adapted
    one (two one-sided claims); RTN-2 measured as the reference (docs/compose.md has the verdicts and intervals)."""
    from lowrank_lit.stats import verdict

    assert run_cli("fit", "--config", ROOT / "configs" / "glvq" / "mlp_digits_fp.yaml", run_root=tmp_path / "runs") == 0
    fp_ckpt = tmp_path / "runs" / "glvq" / "mlp_digits_fp" / "fp" / "checkpoints" / "last.ckpt"
    got: dict[str, list[dict[str, float]]] = {"glvq": [], "rtn": []}
    for method in got:
        for seed in MERGE_SEEDS:
            assert run_cli("fit", "--config", ROOT / "configs" / "compose" / f"{method}_lora_merge.yaml",
                           f"--seed_everything={seed}", f"--trainer.callbacks.init_args.fp_ckpt={fp_ckpt}",
                           "--run_id", f"s{seed}", run_root=tmp_path / "runs") == 0
            path = tmp_path / "runs" / "compose" / f"{method}_lora_merge" / f"s{seed}" / "compose.csv"
            got[method].append({k: float(v) for k, v in next(csv.DictReader(path.open())).items()})

    def col(key: str) -> list[float]:
        return [r[key] for r in got["glvq"]]

    assert all(r["codes_unchanged"] == 1.0 for r in got["glvq"])
    adapted, merged = col("acc_adapted"), col("acc_merged")
    verdicts = {
        "adapters recover >= 1 point": verdict(adapted, col("acc_quantized"), margin=0.01, delta=0.01),
        "adapted >= fp - 1 point": verdict(adapted, col("acc_fp"), margin=-0.01, delta=0.01),
        "merged > adapted - 1 point": verdict(merged, adapted, margin=-0.01, delta=0.01),
        "merged < adapted + 1 point": verdict(adapted, merged, margin=-0.01, delta=0.01),
    }
    print(got, {k: str(v) for k, v in verdicts.items()})
    assert verdicts.keys() == MERGE_VERDICTS.keys()
    assert all(v.outcome in MERGE_VERDICTS[k] for k, v in verdicts.items()), {k: str(v) for k, v in verdicts.items()}


#: what docs/compose.md states for the study above (seeds 0-4, delta 1 point): the adapters recover the quantization
#: loss, but by 1 point or more is inconclusive; merged within 1 point of adapted: the CPU kernels disagree (native:
#: merging costs 1.6 points, [0.9, 2.3], inconclusive; the default kernels at 1 thread: 0.6, [0.3, 0.9], holds),
#: either accepted
MERGE_VERDICTS = {
    "adapters recover >= 1 point": ("inconclusive",),
    "adapted >= fp - 1 point": ("holds",),
    "merged > adapted - 1 point": ("inconclusive", "holds"),
    "merged < adapted + 1 point": ("holds",),
}


@pytest.mark.e2e
def test_reservoir_around_trust_runs_and_opens_a_copy_per_corruption(tmp_path):
    """configs/compose/reservoir_trust.yaml on random source weights: the reservoir wraps TRUST, routes, and saves its
    stream state (TRUST's traversal order inside each copy's state)."""
    assert run_cli("test", "--config", ROOT / "configs" / "compose" / "reservoir_trust.yaml",
                   "--model.init_args.source_ckpt=null", "--model.init_args.method.init_args.n_source_styles=50",
                   "--trainer.limit_test_batches=14", "--run_id", "r", run_root=tmp_path) == 0
    run = tmp_path / "compose" / "reservoir_trust" / "r"
    from lowrank_lit.report import last_values

    values = last_values(run / "metrics.csv")
    assert values["test/models"] >= 2 and 0.0 <= values["test/error"] <= 1.0
    assert (run / "stream_state" / "state.safetensors").is_file()
