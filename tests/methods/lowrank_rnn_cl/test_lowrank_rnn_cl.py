"""What/how continual learning (paper 15): the stream module's stages, freezing (property 3), configs end to end,
resume in the middle of the stream, and the reproduction (slow). Properties 1, 2, 4-7 are in
tests/methods/lowrank_rnn_cl/test_components.py."""

from __future__ import annotations

import csv

import pytest
import torch

from lowrank_lit.methods.lowrank_rnn_cl import ComposedLowRankRNN, EpochHMM, WhatHowModule


def _fit(tmp_path, name: str, *extra: str, run_id: str = "smoke") -> object:
    from tests.helpers import CONFIGS, run_cli

    assert run_cli("fit", "--config", CONFIGS / "lowrank_rnn_cl" / f"{name}.yaml", "--data.init_args.steps_per_stage=6",
                   "--data.init_args.batch_size=8", "--model.init_args.eval_trials=16", "--trainer.log_every_n_steps=1",
                   f"--run_id={run_id}", "--trainer.enable_progress_bar=false", *extra, run_root=tmp_path) == 0
    return tmp_path / "lowrank_rnn_cl" / name / run_id


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["what_how", "oracle", "vanilla"])
def test_config_runs_and_writes_the_forgetting_matrix(name, tmp_path):
    run = _fit(tmp_path, name)
    with open(run / "forgetting.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["trained"] for r in rows] == ["DelayPro", "DelayAnti", "MemoryPro"]
    assert set(rows[0]) >= {"DelayPro", "DelayAnti", "MemoryPro", "MemoryAnti", "vocab"}
    if name != "vanilla":
        assert [int(r["vocab"]) for r in rows] == [3, 4, 5]
    assert (run / "forgetting.png").is_file()
    assert (run / "inferred_epochs.png").is_file() == (name == "what_how")


@pytest.mark.e2e
def test_freeze_reused_keeps_earlier_components_bit_identical(tmp_path):
    """Train stage 0 and 1 of the oracle stream by hand: after stage 1 the components and W_out used by stage 0 are
    bit-identical and stage 0's outputs unchanged; without freezing they move."""
    import lightning.pytorch as pl

    from lowrank_lit.methods.lowrank_rnn_cl import CognitiveStreamDataModule

    for freeze in (True, False):
        torch.manual_seed(0)
        m = WhatHowModule(ComposedLowRankRNN(n_units=16, max_components=6, seed=0), method="oracle", freeze_reused=freeze,
                          eval_trials=8)
        dm = CognitiveStreamDataModule(tasks=["DelayPro", "DelayAnti"], steps_per_stage=5, batch_size=8, seed=0)
        snaps = {}

        class Snap(pl.Callback):
            def __init__(self, store: dict) -> None:
                self.store = store

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if batch_idx == 5:  # the first step of stage 1 (before its update)
                    self.store["U"], self.store["Wout"] = pl_module.how.U.detach().clone(), pl_module.how.W_out.detach().clone()

        trainer = pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[Snap(snaps)], default_root_dir=tmp_path)
        trainer.fit(m, datamodule=dm)
        used = [m.epoch_slot[e] for e in (0, 1, 3)]  # F, S, R_pro: the components DelayPro uses
        same = torch.equal(m.how.U[used], snaps["U"][used]) and torch.equal(m.how.W_out, snaps["Wout"])
        assert same == freeze
        new = m.epoch_slot[4]  # R_anti, trained in stage 1
        assert not torch.equal(m.how.U[new], snaps["U"][new])


@pytest.mark.e2e
def test_checkpoint_carries_the_what_system_and_the_stage(tmp_path):
    """A checkpoint in the middle of the stream (step 9 of 12, inside stage 1) holds the what system, the stage and
    the forgetting rows so far; loading it into a fresh module restores them (the batches resume through the
    project's resumable loader, tests/test_resume.py)."""
    common = ["--data.init_args.tasks=[DelayPro, DelayAnti]", "--data.init_args.eval_tasks=[DelayPro, DelayAnti]"]
    part = _fit(tmp_path, "what_how", *common, "--trainer.max_steps=9", run_id="part")
    ckpt = torch.load(part / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    st = ckpt["what_how"]
    assert st["stage"] == 1 and len(st["matrix"]) == 1 and st["what"]["K"] == 4
    fresh = WhatHowModule(ComposedLowRankRNN(), EpochHMM())
    fresh.load_state_dict(ckpt["state_dict"])
    fresh.on_load_checkpoint(ckpt)
    assert fresh.stage == 1 and fresh.what.vocab_size == 4 and set(fresh.what.trans) == {"DelayPro", "DelayAnti"}
    assert bool(fresh.frozen[:3].all()) and not bool(fresh.frozen[3]) and bool(fresh.out_frozen)


def test_bad_inputs():
    from lowrank_lit.methods.lowrank_rnn_cl import CognitiveStreamDataModule

    with pytest.raises(ValueError, match="method='ewc'; allowed: what_how, oracle, vanilla"):
        WhatHowModule(method="ewc")
    with pytest.raises(ValueError, match="task 'Go'; allowed: DelayPro"):
        CognitiveStreamDataModule(tasks=["Go"])
    hmm = EpochHMM()
    with pytest.raises(KeyError, match="unknown task 'MemoryAnti'"):
        hmm.filter(torch.zeros(5, 3), 0.0, "MemoryAnti")


# -- must show (card section 4) -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stream_runs(tmp_path_factory):
    """what+how (the paper's), what+how with our hold loss, and vanilla over seeds 0-9 at the configs' budget:
    the forgetting matrix (rows after each stage) and the last logged metrics of each run."""
    from lowrank_lit.report import last_values
    from tests.helpers import CONFIGS, run_cli

    tmp = tmp_path_factory.mktemp("task_stream")
    res: dict[str, list[tuple[list[dict[str, str]], dict[str, float]]]] = {}
    for seed in range(10):  # the seed budget (docs/reproduce.md, "How many seeds")
        for name, cfg, extra in (("what_how", "what_how", []), ("hold", "what_how", ["--model.init_args.hold_weight=1.0"]),
                                 ("vanilla", "vanilla", [])):
            run_id = f"{name}-seed{seed}"
            assert run_cli("fit", "--config", CONFIGS / "lowrank_rnn_cl" / f"{cfg}.yaml", f"--seed_everything={seed}",
                           f"--run_id={run_id}", "--trainer.enable_progress_bar=false", *extra, run_root=tmp) == 0
            run = tmp / "lowrank_rnn_cl" / cfg / run_id
            with open(run / "forgetting.csv") as f:
                res.setdefault(name, []).append((list(csv.DictReader(f)), last_values(run / "metrics.csv")))
    return res


@pytest.mark.slow
def test_must_show_task_stream(stream_runs):
    """Our acceptance criterion over seeds 0-9 (the seed budget), the parts that hold: vocabulary 3 -> 4 -> 5; what+how
    keeps every trained task within 0.05 of its post-training accuracy; vanilla drops DelayPro by >= 0.5 (every
    run); MemoryAnti zero-shot of vanilla below 0.2 (holds by the verdict rule: 0.064 +- 0.038) and of what+how
    >= vanilla + 0.25: holds by the rule with delta 0.05 (+0.414, 95 % interval [+0.252, +0.576])."""
    from lowrank_lit.stats import expect_verdict

    trained = ["DelayPro", "DelayAnti", "MemoryPro"]
    for name in ("what_how", "hold"):
        for rows, _ in stream_runs[name]:
            assert [int(r["vocab"]) for r in rows] == [3, 4, 5]
            for k, t in enumerate(trained):
                assert float(rows[-1][t]) >= float(rows[k][t]) - 0.05, (name, t)
    for rows, _ in stream_runs["vanilla"]:
        assert float(rows[0]["DelayPro"]) - float(rows[-1]["DelayPro"]) >= 0.5
    zs = {n: [float(rows[-1]["MemoryAnti"]) for rows, _ in r] for n, r in stream_runs.items()}
    print(zs)
    expect_verdict("holds", [0.2 - z for z in zs["vanilla"]], delta=0.05, claim="vanilla MemoryAnti zero-shot < 0.2")
    expect_verdict("holds", zs["what_how"], zs["vanilla"], margin=0.25, delta=0.05, claim="what+how MemoryAnti >= vanilla + 0.25")


@pytest.mark.slow
def test_must_show_memory_anti_with_the_hold_loss(stream_runs):
    """Our remedy (not the paper's): with the state-holding loss on MemoryPro's delay, MemoryAnti zero-shot >= 0.6
    and the memory epoch's state stays within 0.2 (relative) of the stimulus state (every run). The zero-shot bar
    judged by the verdict rule holds (0.93 on every seed of 0-9)."""
    from lowrank_lit.stats import expect_verdict

    expect_verdict("holds", [float(rows[-1]["MemoryAnti"]) for rows, _ in stream_runs["hold"]], margin=0.6, delta=0.05,
                   claim="MemoryAnti zero-shot with the hold loss >= 0.6")
    key = "state/after_2_MemoryPro/MemoryAnti/hold_distance"
    assert max(m[key] for _, m in stream_runs["hold"]) <= 0.2
    assert min(m[key] for _, m in stream_runs["what_how"]) > 0.5  # the diagnosed cause, without the loss


@pytest.mark.slow
def test_must_show_memory_anti_zero_shot(stream_runs):
    """The paper's claim at our bar, MemoryAnti zero-shot >= 0.6 for what+how as the paper trains it, judged by the
    verdict rule over seeds 0-9 with delta 0.05: inconclusive (mean 0.478, 95 % interval [0.31, 0.65] contains 0.6;
    docs/methods/lowrank_rnn_cl.md, Not reproduced here). Red the day the seeds decide it."""
    from lowrank_lit.stats import expect_verdict

    zero_shot = [float(rows[-1]["MemoryAnti"]) for rows, _ in stream_runs["what_how"]]
    expect_verdict("inconclusive", zero_shot, margin=0.6, delta=0.05, claim="what+how MemoryAnti zero-shot >= 0.6")
