"""LoPE (paper 07): stages, poisoning expert, HyNoIse, discrete ops, parameter count, resume across the switch."""

from __future__ import annotations

import random

import pytest
import torch

from lowrank_lit.callbacks.rng import RNGStateCheckpoint
from lowrank_lit.data.text_tasks import TemplatedTextDataModule, corrupt_text
from lowrank_lit.methods.lope import HyNoIse, LoPEStageCallback, hynoise_embedding
from lowrank_lit.models.text import PromptTunedClassifier
from lowrank_lit.nn.lora import AsymmetricLoRALinear
from tests.helpers import quiet_trainer, text_batch


def _model(**adapter) -> PromptTunedClassifier:
    torch.manual_seed(0)
    args = {"r": 4, "n_experts": 3, "n_poison": 1} | adapter

    def factory(lin):
        return AsymmetricLoRALinear(lin, **args)

    return PromptTunedClassifier(num_layers=1, adapter=factory, measure_attention=False, lr_adapter=1e-2)


def _layers(model):
    return [m for m in model.modules() if isinstance(m, AsymmetricLoRALinear)]


def _data(**kw):
    return TemplatedTextDataModule(domains=["sentiment"], n_train=96, n_val=32, n_test=32, corrupt_fraction=0.2,
                                   label_noise=0.1, noisy_copy_rate=0.05, **kw)


# ------------------------------------------------------------------------------------ 1. identity, 8. count
def test_adapted_model_equals_base_at_init_and_count_per_layer():
    ids, mask = text_batch()
    base = PromptTunedClassifier(num_layers=1, measure_attention=False)
    model = _model()
    with torch.no_grad():
        model.head.weight.normal_()
        base.head.weight.copy_(model.head.weight)
    assert torch.equal(model(ids, mask)[0], base(ids, mask)[0])
    layers = _layers(model)
    assert len(layers) == 2  # query and value of the one layer
    r, d, N = 4, 384, 4
    assert all(sum(p.numel() for n, p in m.named_parameters() if "lora_" in n) == r * d + N * d * r + r * N for m in layers)
    assert model.parameter_counts()["adapter"] == 2 * (r * d + N * d * r + r * N)


# ------------------------------------------------------------------------------------ 3. stage I
@pytest.mark.e2e
def test_stage_one_trains_only_A_and_B_D():
    # the head and every B start at zero: the head moves at step 0, B_D at step 1, A from step 2 on
    model = _model()
    cb = LoPEStageCallback(stage1_steps=3)
    snap = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    quiet_trainer(max_steps=3, limit_val_batches=0, callbacks=[cb]).fit(model, _data())
    for m in _layers(model):
        assert m.lora_A.requires_grad and m.lora_B[3].requires_grad
        assert not any(m.lora_B[i].requires_grad for i in range(3)) and not m.lora_router.weight.requires_grad
    for n, p in model.named_parameters():
        if "lora_" not in n:
            continue
        changed = not torch.equal(p, snap[n])
        trained = n.endswith("lora_A") or n.endswith("lora_B.3")
        assert changed == trained, n  # the normal B's and the router are bit-identical


# ------------------------------------------------------------------------------------ 4. stage II
class _SnapshotAt(__import__("lightning").pytorch.Callback):
    """Copies of every adapter parameter at the first batch of ``step``."""

    def __init__(self, step):
        self.step, self.snap = step, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.snap = {n: p.detach().clone() for n, p in pl_module.named_parameters() if "lora_" in n}


@pytest.mark.e2e
def test_stage_two_freezes_B_D_but_uses_it():
    model = _model()
    cb, snap = LoPEStageCallback(stage1_steps=3), _SnapshotAt(3)
    quiet_trainer(max_steps=6, limit_val_batches=0, callbacks=[cb, snap]).fit(model, _data())
    assert cb.stage == 2
    for n, p in model.named_parameters():
        if "lora_B.3" in n:
            assert torch.equal(p, snap.snap[n]), n  # B_D frozen through stage II
        elif "lora_B.0" in n or "lora_router" in n:
            assert not torch.equal(p, snap.snap[n]), n  # normal experts and router train
    ids, mask = text_batch()
    model.eval()
    for m in _layers(model):
        m.set_mode("route")
    out = model(ids, mask)[0]
    with torch.no_grad():
        for m in _layers(model):
            m.lora_B[3].zero_()
    assert not torch.allclose(model(ids, mask)[0], out)  # B_D takes part in the stage-II forward


@pytest.mark.e2e
def test_resume_across_the_stage_switch_is_exact(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(max_steps, ckpt=None, save=False):
        torch.manual_seed(0)
        model = _model()
        cbs = [LoPEStageCallback(stage1_steps=3), RNGStateCheckpoint()]  # HyNoIse draws from the global RNG
        if save:
            cbs.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1))
        quiet_trainer(max_steps=max_steps, limit_val_batches=0, callbacks=cbs, enable_checkpointing=save,
                      deterministic=True).fit(model, _data(), ckpt_path=ckpt)
        return model

    full = run(5)
    run(2, save=True)  # stops in stage I, checkpoint at step 2
    ckpt = next(tmp_path.glob("*step=2*.ckpt"))
    resumed = run(5, ckpt=str(ckpt))
    for (n, a), (_, b) in zip(full.named_parameters(), resumed.named_parameters(), strict=True):
        assert torch.equal(a, b), n


# ------------------------------------------------------------------------------------ 5. inference masking
def test_inference_masks_B_D_and_compensation_sums():
    model = _model()
    cb = LoPEStageCallback(stage1_steps=1, compensate_k=0)
    cb.setup(None, model, "fit")
    with torch.no_grad():
        for m in _layers(model):
            for b in m.lora_B:
                b.normal_()
    cb._inference_mode(model)
    ids, mask = text_batch()
    model(ids, mask)
    for m in _layers(model):
        w = m.last_weights
        assert bool((w[..., 3] == 0).all())
        m.set_mode("route")
        model(ids, mask)
        raw = m.last_weights
        m.set_mode("mask")
        torch.testing.assert_close(w.sum(-1), 1 - raw[..., 3])
    LoPEStageCallback(stage1_steps=1, compensate_k=3).setup(None, model, "fit")
    model(ids, mask)
    for m in _layers(model):
        torch.testing.assert_close(m.last_weights.sum(-1), torch.ones(m.last_weights.shape[:-1]))


# ------------------------------------------------------------------------------------ 6. HyNoIse embedding
def test_hynoise_embedding_bounds_mask_and_reproducibility():
    E = torch.randn(2, 6, 8)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = hynoise_embedding(E, mask, 0.05, g1)
    assert torch.equal(a[0, 3:], E[0, 3:])  # no noise on padding
    assert float((a - E).abs().max()) <= 0.05 and float((a - E).abs().max()) > 0
    assert torch.equal(a, HyNoIse(0.05, g2)(E, mask))
    assert torch.equal(hynoise_embedding(E, mask, 0.0), E)


# ------------------------------------------------------------------------------------ 7. discrete ops
def test_discrete_ops():
    text = "the concert was absolutely wonderful tonight ."
    for seed in range(5):
        assert len(corrupt_text(text, 0.2, random.Random(seed), ["delete"])) < len(text)
        assert len(corrupt_text(text, 0.2, random.Random(seed), ["insert"])) > len(text)
        assert sorted(corrupt_text(text, 0.5, random.Random(seed), ["shuffle"]).split()) == sorted(text.split())
        assert corrupt_text(text, 0.0, random.Random(seed)) == text
    a = TemplatedTextDataModule(domains=["sentiment"], corrupt_fraction=0.2, noisy_copy_rate=0.05)
    b = TemplatedTextDataModule(domains=["sentiment"], corrupt_fraction=0.2, noisy_copy_rate=0.05)
    assert a.texts() == b.texts()
    texts = [t for t, _, _ in a.texts()["test"]]
    assert a.noisy_copies(texts, "test") == b.noisy_copies(texts, "test") != texts


# ------------------------------------------------------------------------------------ bad inputs
def test_bad_inputs():
    lin = torch.nn.Linear(16, 16)
    with pytest.raises(ValueError, match="n_poison=3"):
        AsymmetricLoRALinear(lin, n_experts=3, n_poison=3)
    with pytest.raises(ValueError, match="r=0"):
        AsymmetricLoRALinear(lin, r=0)
    with pytest.raises(ValueError, match="compensate_k=4"):
        AsymmetricLoRALinear(lin, n_experts=3, compensate_k=4)
    with pytest.raises(ValueError, match="compensate_beta=0"):
        LoPEStageCallback(compensate_beta=0)
    with pytest.raises(ValueError, match="emb_alpha=-0.1"):
        LoPEStageCallback(emb_alpha=-0.1)
    with pytest.raises(ValueError, match="stage1_steps=0"):
        LoPEStageCallback(stage1_steps=0)
    LoPEStageCallback(stage1_steps=0, allow_skip_stage1=True)
    with pytest.raises(ValueError, match="rate=1.5"):
        corrupt_text("a b", 1.5, random.Random(0))
    with pytest.raises(ValueError, match="per-token routing"):
        AsymmetricLoRALinear(lin).merge()
    with pytest.raises(ValueError, match="compensate_k=5"):
        LoPEStageCallback(compensate_k=5).setup(None, _model(), "fit")
    with pytest.raises(ValueError, match="no AsymmetricLoRALinear"):
        LoPEStageCallback().setup(None, PromptTunedClassifier(num_layers=1), "fit")
    with pytest.raises(ValueError, match="adapter_targets: pattern matches no module"):
        PromptTunedClassifier(num_layers=1, adapter=lambda lin: AsymmetricLoRALinear(lin), adapter_targets=["*.q_proj"])


# ------------------------------------------------------------------------------------ must show
LOPE_CELLS = ("lope_noisy", "lope_nomask_noisy", "hydralora_noisy", "lora_noisy")


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """LoPE, its no-mask ablation, HydraLoRA and LoRA trained on the PEFT suite's noisy variant, seeds 0-2
    (``$LOWRANK_PEFT_SUITE_RUNS`` reuses a sweep's)."""
    from tests.helpers import peft_suite_runs

    return peft_suite_runs(LOPE_CELLS, tmp_path_factory.mktemp("peft_suite"))


def _acc(bench: dict[str, list[dict[str, float]]], name: str) -> list[float]:
    return [r["test/acc"] for r in bench[name]]  # seeds 0, 1, 2 in order: pairs for the verdict rule


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "does not hold; PEFT suite noisy variant, seeds 0-2 (docs/peft_suite.md): LoPE (mask, K = all) 66.5 "
    "(70.1 / 59.8 / 69.6) against HydraLoRA 91.2 (91.0 / 92.7 / 90.0): difference -24.7 points, 95 % interval "
    "[-42.3, -7.2]"))
def test_must_show_lope_beats_hydralora(bench):
    """The paper's claim on clean test data after noisy training (3 seeds): LoPE >= HydraLoRA."""
    from lowrank_lit.stats import expect_verdict

    expect_verdict("holds", _acc(bench, "lope_noisy"), _acc(bench, "hydralora_noisy"), delta=0.01, claim="LoPE >= HydraLoRA")


@pytest.mark.slow
def test_must_show_hydralora_beats_lora(bench):
    """The paper's baseline ordering HydraLoRA >= LoRA after noisy training, judged by the verdict rule over seeds
    0-2 with delta = 1 point: inconclusive (91.2 against 85.1, per seed 91.0 / 92.7 / 90.0 against 80.9 / 87.9 /
    86.4; difference +6.2 points, 95 % interval [-2.4, +14.8]; three of the budget's five seeds)."""
    from lowrank_lit.stats import expect_verdict

    expect_verdict("inconclusive", _acc(bench, "hydralora_noisy"), _acc(bench, "lora_noisy"), delta=0.01,
                   claim="HydraLoRA >= LoRA")


@pytest.mark.slow
def test_must_show_lope_mask_beats_no_mask(bench):
    """Masking the poisoning expert at inference helps: LoPE (mask) > LoPE (no mask). Judged by the verdict rule over
    seeds 0-2 with delta = 1 point it is inconclusive: 66.5 (70.1 / 59.8 / 69.6) with the mask against 75.6 (77.6 /
    75.4 / 73.7) without it,
    difference -9.1 points, 95 % interval [-23.7, +5.6] (lower on every seed; masking B_D removes the expert that
    carries 40 % of the routing weight on every input)."""
    from lowrank_lit.stats import expect_verdict

    expect_verdict("inconclusive", _acc(bench, "lope_noisy"), _acc(bench, "lope_nomask_noisy"), delta=0.01,
                   claim="LoPE mask > no mask")


@pytest.mark.no_verdict("a mechanism asserted on every run (B_D's share on corrupted > on clean inputs), not a mean over seeds")
@pytest.mark.slow
def test_must_show_lope_routes_noisy_inputs_to_the_poisoning_expert(bench):
    """The paper's mechanism: B_D takes a larger routing share on inputs corrupted at the training rate (8 %) than
    on clean inputs, in every run (the 5 % HyNoIse copy is reported beside it in the table)."""
    shares = [(r["test/poison_share_clean"], r["test/poison_share_probe"]) for r in bench["lope_noisy"]]
    assert all(probe > clean for clean, probe in shares), shares


# ----------------------------------------------------------------------------------------- LoPE on a causal LM
def _alpaca(tmp_path, batch_size, n=12):
    """A tiny Llama folder, an Alpaca-style jsonl and the first training batch of it (with HyNoIse copies)."""
    from lowrank_lit.data.text_tasks import QADataModule
    from tests.rehearsal import fixtures as fx

    records = [{"instruction": r["question"], "input": r["context"], "output": r["answer"]} for r in fx.qa_records(n, 0)]
    path, llama = fx.write_jsonl(tmp_path / "alpaca.jsonl", records), fx.tiny_llama(tmp_path / "llama")
    dm = QADataModule(path, tokenizer=llama, question_field="instruction", context_field="input", answer_field="output",
                      noisy_copy_rate=0.3, max_length=64, batch_size=batch_size)
    dm.setup("fit")
    return path, llama, next(iter(dm.train_dataloader()))


def test_qa_datamodule_reads_alpaca_fields_and_serves_hynoise_copies(tmp_path):
    from lowrank_lit.data.text_tasks import QA_NOISY_KEYS, QADataModule

    path, llama, batch = _alpaca(tmp_path, 12)
    assert set(QA_NOISY_KEYS) <= set(batch)
    assert not torch.equal(batch["input_ids"], batch["noisy_input_ids"])  # the context and question are corrupted ...
    answers = [ids[lab != -100].tolist() for ids, lab in zip(batch["input_ids"], batch["labels"], strict=True)]
    noisy = [ids[lab != -100].tolist() for ids, lab in zip(batch["noisy_input_ids"], batch["noisy_labels"], strict=True)]
    assert answers == noisy  # ... the answer is not
    with pytest.raises(ValueError, match="no field 'question'.*set question_field"):
        QADataModule(path, tokenizer=llama, max_length=64).setup("fit")


def test_stage_one_on_a_causal_lm_trains_A_and_B_D_on_clean_plus_noisy_copies(tmp_path):
    from functools import partial

    from lowrank_lit.models.text import PromptTunedLM

    _, llama, batch = _alpaca(tmp_path, 4)
    model = PromptTunedLM(llama, adapter=partial(AsymmetricLoRALinear, r=4, n_experts=3, n_poison=1, router_in="lowrank"))
    cb = LoPEStageCallback(stage1_steps=2)
    cb.apply_stage(model, 1)
    seen = []
    model.embed_noise = lambda e, m: (seen.append(e.shape[0]), cb.noise(e, m))[1]
    model.train()
    model.training_step(batch, 0).backward()
    assert seen == [8]  # 4 clean + 4 noisy rows, embedding noise on
    layer = next(m for m in model.modules() if isinstance(m, AsymmetricLoRALinear))
    d = layer.poison_index[0]
    assert layer.lora_A.grad is not None and layer.lora_B[d].grad is not None
    assert all(b.grad is None for i, b in enumerate(layer.lora_B) if i != d) and layer.lora_router.weight.grad is None
    opt = model.configure_optimizers()["optimizer"]
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert {id(p) for p in model.adapter_parameters()} <= held  # every adapter parameter from the start


@pytest.mark.e2e
def test_the_mechanism_is_logged_per_run(tmp_path):
    """B_D's accuracy alone at the end of stage I, its routing share on stage-II batches, and the test accuracy with
    B_D masked, unmasked and alone, in one short run (2 + 2 steps); without the mask, test/acc is the unmasked one."""
    from lowrank_lit.report import Run
    from tests.helpers import CONFIGS, run_cli

    short = ["--trainer.max_steps=4", "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0",
             "--trainer.limit_test_batches=2", "--trainer.enable_progress_bar=false",
             "--trainer.callbacks.init_args.stage1_steps=2"]
    for name in ("lope", "lope_nomask"):
        assert run_cli("fit", "--config", CONFIGS / "lope" / f"{name}.yaml", *short, "--run_id=m", run_root=tmp_path) == 0
    got = {name: Run(str(tmp_path / "lope" / name / "m")) for name in ("lope", "lope_nomask")}
    for run in got.values():
        bd = [(int(r["step"]), float(r["probe/bd_alone_acc"])) for r in run.rows() if r.get("probe/bd_alone_acc")]
        assert len(bd) == 1 and bd[0][0] == 2 and 0.0 <= bd[0][1] <= 1.0, bd  # logged once, at the switch
        shares = run.history("train/poison_share")
        assert len(shares) == 2 and all(0.0 < v < 1.0 for v in shares), shares  # the two stage-II steps only
        for key in ("test/acc", "test/acc_unmasked", "test/acc_bd_alone"):
            assert 0.0 <= run.metrics[key] <= 1.0, (key, run.metrics)
    assert got["lope_nomask"].metrics["test/acc"] == got["lope_nomask"].metrics["test/acc_unmasked"]
    # without the diagnostics (what `lowrank bench lope` times): the same inference, nothing else in the test loop
    assert run_cli("fit", "--config", CONFIGS / "lope" / "lope.yaml", *short, "--run_id=bare",
                   "--trainer.callbacks.init_args.test_diagnostics=false", run_root=tmp_path) == 0
    bare = Run(str(tmp_path / "lope" / "lope" / "bare")).metrics
    assert bare["test/acc"] == got["lope"].metrics["test/acc"], (bare, got["lope"].metrics)
    assert not [k for k in bare if k.startswith(("test/acc_unmasked", "test/acc_bd_alone", "test/poison_share",
                                                 "test/expert_mass"))], bare


# ------------------------------------------------------------------------------------ stage-I forms (ours)
def test_stage_one_forms_change_what_the_loss_sees(monkeypatch):
    """The paper's stage I trains on originals and their noisy copies with true labels; ``noisy_only`` drops the
    originals, ``shuffled`` permutes the copies' labels within the batch (seeded by the step)."""
    import torch.nn.functional as F

    model = _model()
    ids, mask = text_batch()
    nids, nmask = ids.flip(1), mask  # stand-in noisy copies: any other token ids
    y = torch.tensor([0, 1, 1])
    batch = (ids, mask, y, torch.zeros(3, dtype=torch.long), nids, nmask)
    seen = []
    monkeypatch.setattr(model, "log", lambda *a, **k: None)
    monkeypatch.setattr(F, "cross_entropy", lambda logits, target: seen.append((logits.shape[0], target.clone())) or
                        logits.sum() * 0)
    model.train_on_noisy_copies = True
    for only, shuffle in ((False, False), (True, False), (False, True)):
        model.noisy_copies_only, model.shuffle_noisy_labels = only, shuffle
        model.training_step(batch, 0)
    (n0, t0), (n1, t1), (n2, t2) = seen
    assert n0 == 6 and torch.equal(t0, torch.cat([y, y]))
    assert n1 == 3 and torch.equal(t1, y)
    perm = torch.randperm(3, generator=torch.Generator().manual_seed(0))
    assert n2 == 6 and torch.equal(t2, torch.cat([y, y[perm]]))


def test_stage_one_poison_weight_scales_B_D():
    lin = torch.nn.Linear(6, 5)
    layer = AsymmetricLoRALinear(lin, r=2, n_experts=2, n_poison=1)
    with torch.no_grad():
        for b in layer.lora_B:
            b.normal_()
    x = torch.randn(4, 6)
    layer.set_mode("poison_only")
    full = layer(x) - lin(x)
    layer.poison_weight = 0.25
    torch.testing.assert_close(layer(x) - lin(x), 0.25 * full)
    torch.testing.assert_close(full, layer.scaling * (x @ layer.lora_A.T) @ layer.lora_B[2].T)


@pytest.mark.parametrize("kwargs, message", [
    ({"stage1_inputs": "clean"}, "stage1_inputs='clean'; allowed: original_and_noisy, noisy_only"),
    ({"stage1_labels": "random"}, "stage1_labels='random'; allowed: true, shuffled"),
    ({"stage1_poison_weight": 0.0}, r"stage1_poison_weight=0.0; allowed: a float in \(0, 1\]"),
])
def test_stage_one_forms_refuse_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LoPEStageCallback(**kwargs)


@pytest.mark.e2e
def test_logging_the_mechanism_leaves_the_training_run_unchanged(monkeypatch):
    """The stage-II share and the B_D-alone accuracy are measurements: a run that takes them (every step) ends with
    the same weights, bit for bit, as one that takes none (no draw from the training RNG: iterating the test loader
    for the accuracy would otherwise draw its worker seed)."""
    from lightning.pytorch import seed_everything

    import lowrank_lit.methods.lope as lope

    weights = []
    for measure in (True, False):
        if not measure:  # no accuracy at the switch, no share (never a multiple of 50 steps)
            monkeypatch.setattr(lope, "_accuracy_in_mode", lambda *a, **k: 0.0)
        seed_everything(0)
        model, data = _model(), _data()
        quiet_trainer(max_steps=4, limit_val_batches=0, log_every_n_steps=1 if measure else 50,
                      callbacks=[LoPEStageCallback(stage1_steps=2)]).fit(model, data)
        weights.append({n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad or "lora_" in n})
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])


@pytest.fixture(scope="module")
def equal_steps(bench, tmp_path_factory):
    """LoPE with stage II on the baselines' 1,000 steps (stage I's 500 on top), seeds 0-2, beside ``bench``."""
    from tests.helpers import peft_suite_runs

    return {**bench, **peft_suite_runs(("lope_noisy_stage2_full",), tmp_path_factory.mktemp("peft_suite_steps"))}


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "does not hold; PEFT suite noisy variant, seeds 0-2, stage II on 1,000 steps (docs/methods/lope.md, Equal "
    "task steps): LoPE (mask, K = all) 74.6 (77.1 / 79.0 / 67.7) against HydraLoRA 91.2 (91.0 / 92.7 / 90.0): "
    "difference -16.6 points, 95 % interval [-28.8, -4.4]"))
def test_must_show_lope_beats_hydralora_on_equal_stage2_steps(equal_steps):
    """The paper's claim with LoPE's router and normal experts trained as many steps as HydraLoRA: LoPE >= HydraLoRA."""
    from lowrank_lit.stats import expect_verdict

    expect_verdict("holds", _acc(equal_steps, "lope_noisy_stage2_full"), _acc(equal_steps, "hydralora_noisy"), delta=0.01,
                   claim="LoPE (stage II 1000 steps) >= HydraLoRA")


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "does not hold; the same runs, masked against unmasked at the end of training: 74.6 (77.1 / 79.0 / 67.7) against "
    "88.0 (91.1 / 89.8 / 83.2), difference -13.4 points, 95 % interval [-19.3, -7.5]; B_D alone already scores 73.7 % "
    "after stage I"))
def test_must_show_masking_the_poisoning_expert_helps_on_equal_stage2_steps(equal_steps):
    """Masking B_D at inference > keeping it, measured on the same runs (``test/acc`` against ``test/acc_unmasked``)."""
    from lowrank_lit.stats import expect_verdict

    runs = equal_steps["lope_noisy_stage2_full"]
    expect_verdict("holds", [r["test/acc"] for r in runs], [r["test/acc_unmasked"] for r in runs], delta=0.01,
                   claim="LoPE mask > no mask (stage II 1000 steps)")


#: stage-I forms of ours (not the paper's) meant to leave the task to the normal experts, each with stage II on the
#: baselines' 1,000 steps: the config, and the measured outcome of "masking B_D > keeping it" (docs/methods/lope.md)
STAGE1_FORMS = {
    "noisy_only": ("lope_noisy_noisyonly", (
        "does not hold; PEFT suite noisy variant, seeds 0-2, stage I on the HyNoIse copies alone, stage II 1,000 "
        "steps: masked 75.7 (79.1 / 82.5 / 65.6) against unmasked 85.0 (87.7 / 89.6 / 77.7), difference -9.3 points, "
        "95 % interval [-15.8, -2.8]; B_D alone 72.3 % after stage I")),
    "shuffled": ("lope_noisy_shuffled", (
        "does not hold; the same setting, the copies' labels shuffled in stage I: masked 71.3 (76.2 / 75.3 / 62.4) "
        "against unmasked 84.9 (86.5 / 86.4 / 81.8), difference -13.6 points, 95 % interval [-26.2, -1.0]; B_D alone "
        "74.4 % after stage I")),
    "halfweight": ("lope_noisy_halfweight", (
        "does not hold; the same setting, B_D at half weight in stage I: masked 73.2 (70.5 / 78.4 / 70.6) against "
        "unmasked 89.1 (88.5 / 93.9 / 84.9), difference -15.9 points, 95 % interval [-20.6, -11.2]; B_D alone 74.4 % "
        "after stage I")),
}


@pytest.fixture(scope="module")
def stage1_forms(tmp_path_factory):
    """The three stage-I forms over seeds 0-2 (``$LOWRANK_PEFT_SUITE_RUNS`` reuses a finished
    ``lowrank sweep sweeps/peft_suite_lope_steps.yaml``)."""
    from tests.helpers import peft_suite_runs

    return peft_suite_runs(tuple(name for name, _ in STAGE1_FORMS.values()), tmp_path_factory.mktemp("stage1_forms"))


@pytest.mark.slow
@pytest.mark.parametrize("form", [pytest.param(form, marks=pytest.mark.xfail(strict=True, raises=AssertionError,
                                                                             reason=reason))
                                  for form, (_, reason) in STAGE1_FORMS.items()])
def test_must_show_masking_helps_with_a_stage1_form_of_ours(stage1_forms, form):
    """A poisoning expert that holds noise rather than the task would make masking it help: masked > unmasked on
    the same runs. None of the three forms does (B_D alone still classifies the clean test split after stage I)."""
    from lowrank_lit.stats import expect_verdict

    runs = stage1_forms[STAGE1_FORMS[form][0]]
    expect_verdict("holds", [r["test/acc"] for r in runs], [r["test/acc_unmasked"] for r in runs], delta=0.01,
                   claim=f"LoPE mask > no mask, stage I {form}")
