"""The resume contract (what a resume may change), the restored optimizer taking a changed config, the strict YAML
reader, negative numbers after a space, and the count of unfinished runs."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml

from lowrank_lit.launch.config_yaml import YamlFileError, load_yaml
from lowrank_lit.launch.messages import ConfigError
from lowrank_lit.launch.resume_contract import (
    MAY_CHANGE,
    Change,
    check_resume,
    config_changes,
    may_change_markdown,
)
from tests.helpers import ROOT, quiet_trainer

SAVED = {
    "seed_everything": 0,
    "trainer": {"max_epochs": 1, "devices": 1, "logger": [{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                                           "init_args": {"save_dir": "runs/a"}}],
                "callbacks": [{"class_path": "lowrank_lit.callbacks.ResumeCheckpoint", "init_args": {"every_n_train_steps": 0}},
                              {"class_path": "lowrank_lit.methods.q3r.Q3R", "init_args": {"lam": 0.1}}],
                "precision": None},
    "model": {"class_path": "lowrank_lit.models.classifier.ImageClassifier",
              "init_args": {"num_classes": 10, "optimizer": {"class_path": "torch.optim.AdamW", "init_args": {"lr": 0.001}}}},
    "data": {"class_path": "lowrank_lit.data.digits.DigitsDataModule", "init_args": {"batch_size": 64, "num_workers": 0}},
    "ckpt_path": None, "run_id": "a",
}


def _new(**edits):
    cfg = json.loads(json.dumps(SAVED))
    for key, value in edits.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def test_keys_that_may_change_are_not_changes():
    new = _new(**{"trainer.max_epochs": 5, "trainer.devices": 2, "ckpt_path": "x.ckpt", "run_id": "b",
                  "data.init_args.num_workers": 4})
    new["trainer"]["logger"][0]["init_args"]["save_dir"] = "elsewhere"
    new["trainer"]["callbacks"].insert(0, {"class_path": "lowrank_lit.callbacks.LogProgress", "init_args": {}})
    assert config_changes(SAVED, new) == []


def test_every_other_difference_is_listed_with_both_values():
    new = _new(**{"model.init_args.optimizer.init_args.lr": 0.5, "data.init_args.batch_size": 32,
                  "seed_everything": 1, "trainer.precision": "bf16-mixed"})
    changes = {c.key: (c.old, c.new) for c in config_changes(SAVED, new)}
    assert changes == {"model.init_args.optimizer.init_args.lr": (0.001, 0.5), "data.init_args.batch_size": (64, 32),
                       "seed_everything": (0, 1), "trainer.precision": (None, "bf16-mixed")}


def test_a_stateful_callback_added_removed_or_changed_is_a_change():
    removed = _new()
    removed["trainer"]["callbacks"].pop()
    assert config_changes(SAVED, removed) == [Change("trainer.callbacks", ["Q3R"], [])]
    changed = _new()
    changed["trainer"]["callbacks"][1]["init_args"]["lam"] = 0.2
    assert [str(c) for c in config_changes(SAVED, changed)] == ["trainer.callbacks[0](Q3R).init_args.lam 0.1 -> 0.2"]
    added = _new()
    added["model"]["init_args"]["extra"] = 1
    assert [c.key for c in config_changes(SAVED, added)] == ["model.init_args.extra"]


def _run(tmp_path: Path, config: dict) -> Path:
    run = tmp_path / "runs" / "x" / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save({"state_dict": {}, "global_step": 1}, run / "checkpoints" / "last.ckpt")
    return run / "checkpoints" / "last.ckpt"


def test_check_resume_refuses_in_one_line_and_apply_returns_the_changes(tmp_path):
    ckpt = _run(tmp_path, SAVED)
    new = _new(**{"model.init_args.optimizer.init_args.lr": 0.5})
    with pytest.raises(ConfigError) as err:
        check_resume(str(ckpt), new, own_run=True)
    line = str(err.value)
    assert "\n" not in line and "model.init_args.optimizer.init_args.lr 0.001 -> 0.5" in line
    assert "--resume_changes=apply" in line
    assert check_resume(str(ckpt), new, own_run=True, mode="apply") == [
        Change("model.init_args.optimizer.init_args.lr", 0.001, 0.5)]
    assert check_resume(str(ckpt), _new(**{"trainer.max_epochs": 9}), own_run=True) == []
    with pytest.raises(ConfigError, match="--resume_changes='maybe'; allowed: refuse, apply"):
        check_resume(str(ckpt), new, own_run=True, mode="maybe")


def test_a_checkpoint_without_a_config_is_checked_against_what_it_holds(tmp_path):
    ckpt = tmp_path / "loose.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"_class_path": "lowrank_lit.models.text.PromptTunedClassifier"},
                "callbacks": {"Q3R{'lam': 0.1}": {}, "ResumeCheckpoint{'dirpath': 'x'}": {}}}, ckpt)
    no_q3r = _new()
    no_q3r["trainer"]["callbacks"].pop()
    with pytest.raises(ConfigError) as err:
        check_resume(str(ckpt), no_q3r, own_run=False)
    assert "model.class_path 'lowrank_lit.models.text.PromptTunedClassifier' -> " in str(err.value)
    assert "trainer.callbacks ['Q3R'] -> []" in str(err.value)


def test_the_docs_table_is_the_contract():
    page = (ROOT / "docs" / "cli.md").read_text()
    assert may_change_markdown() in page
    assert all(f"`{k}`" in page for k in MAY_CHANGE)


# ----------------------------------------------------------------------------- the restored optimizer takes the change
def _module(lr: float, wd: float, scheduled: bool):
    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def training_step(self, batch, i):
            return self.lin(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=wd)
            if not scheduled:
                return opt
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(16, 4))
            return torch.utils.data.DataLoader(data, batch_size=4)

    return M()


@pytest.mark.e2e
@pytest.mark.parametrize("scheduled", [False, True])
def test_apply_sets_the_new_hyperparameters_on_the_restored_optimizer(tmp_path, scheduled):
    """Without ApplyResumeChanges the restored optimizer keeps lr 0.1 and weight decay 0.0 (what Lightning restores);
    with it, the new config's values hold, and a scheduled lr keeps its place in the schedule (scaled by new/old)."""
    from lowrank_lit.callbacks.resume import ApplyResumeChanges

    ckpt = tmp_path / "a.ckpt"
    first = quiet_trainer(max_epochs=1)
    first.fit(_module(0.1, 0.0, scheduled))
    first.save_checkpoint(ckpt)
    restored_lr = torch.load(ckpt, weights_only=False)["optimizer_states"][0]["param_groups"][0]["lr"]

    class Seen(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            self.group = dict(trainer.optimizers[0].param_groups[0])
            self.base = list(trainer.lr_scheduler_configs[0].scheduler.base_lrs) if scheduled else None

    plain, applied = Seen(), Seen()
    quiet_trainer(max_epochs=2, callbacks=[plain]).fit(_module(0.4, 0.01, scheduled), ckpt_path=str(ckpt))
    apply = ApplyResumeChanges()
    quiet_trainer(max_epochs=2, callbacks=[apply, applied]).fit(_module(0.4, 0.01, scheduled), ckpt_path=str(ckpt))
    assert plain.group["lr"] == pytest.approx(restored_lr) and plain.group["weight_decay"] == 0.0
    assert applied.group["weight_decay"] == 0.01
    if scheduled:  # one epoch of StepLR(gamma=0.5): 0.1 -> 0.05 restored; the new base 0.4 at the same place: 0.2
        assert restored_lr == pytest.approx(0.05) and applied.group["lr"] == pytest.approx(0.2)
        assert applied.base == [0.4] and applied.group["initial_lr"] == 0.4
    else:
        assert applied.group["lr"] == 0.4
    assert any("weight_decay 0.0 -> 0.01" in a for a in apply.applied)


# ----------------------------------------------------------------------------- files a command reads
@pytest.mark.parametrize(("text", "needle"), [
    ("trainer:\n  max_epochs: 1\n  max_epochs: 2\n", "x.yaml: line 3: key 'max_epochs' is given twice in one mapping (first at line 2)"),
    ("a: 1\nb:\n  c: 1\na: 2\n", "line 4: key 'a' is given twice"),
    ("", "x.yaml is empty; allowed: a YAML mapping"),
    ("# only a comment\n", "x.yaml is empty"),
    ("- a\n- b\n", "x.yaml: line 1: the file holds a YAML list; allowed: a mapping"),
    ("just text\n", "holds a YAML str"),
    ("a: [1\n", "YAML syntax error"),
])
def test_load_yaml_refuses_in_one_line(tmp_path, text, needle):
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(YamlFileError) as err:
        load_yaml(path, "--config")
    assert needle in str(err.value) and str(err.value).startswith("--config: ") and "\n" not in str(err.value)


def test_load_yaml_keeps_merge_keys_and_the_same_key_in_two_mappings(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("base: &b\n  lr: 1\nx:\n  <<: *b\n  wd: 2\ny:\n  lr: 3\n")
    assert load_yaml(path, "--config") == {"base": {"lr": 1}, "x": {"lr": 1, "wd": 2}, "y": {"lr": 3}}


def test_a_negative_number_after_a_space_is_the_value():
    from lowrank_lit.launch.verbs import _join_negative_numbers, parser_for

    def verb(*, gpu_memory: float = 1.0, flag: bool = False, name: str = "") -> int:
        """A verb.

        Args:
            gpu_memory: a number
            flag: a flag
            name: a word
        """
        return 0

    parser = parser_for(verb, "lowrank x")
    assert _join_negative_numbers(parser, ["--gpu-memory", "-8", "--flag", "--name", "-x"]) == [
        "--gpu-memory=-8", "--flag", "--name", "-x"]
    assert _join_negative_numbers(parser, ["--gpu_memory", "-1.5e3"]) == ["--gpu_memory=-1.5e3"]


# ----------------------------------------------------------------------------- unfinished runs
def test_summaries_leave_out_unfinished_runs_and_say_why(tmp_path):
    from lowrank_lit.launch.summarize import _unfinished_note
    from lowrank_lit.report import UNFINISHED_FILE, read_runs, unfinished_runs

    for name, ended in (("done", None), ("crashed", "crashed: RuntimeError: boom"), ("killed", "")):
        run = tmp_path / name
        run.mkdir()
        (run / "config.yaml").write_text("trainer: {}\n")
        (run / "metrics.csv").write_text("step,test/acc\n1,0.5\n")
        if ended is not None:
            (run / UNFINISHED_FILE).write_text(json.dumps({"stage": "fit", **({"ended": ended} if ended else {})}))
    assert [r.path.name for r in read_runs([str(tmp_path)])] == ["done"]
    unfinished = unfinished_runs([str(tmp_path)])
    assert {r.path.name: r.unfinished for r in unfinished} == {"crashed": "crashed: RuntimeError: boom",
                                                                "killed": "killed or still running"}
    note = _unfinished_note(unfinished)
    assert note == "; left out 2 unfinished run(s) (1 x crashed, 1 x killed or still running); --list-debug names them"


class CrashAtStep(pl.Callback):
    """Raises after the second optimizer step (a crash, not an input error)."""

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == 2:
            raise RuntimeError("crashed on purpose at step 2")


@pytest.mark.e2e
def test_a_run_holds_unfinished_json_until_it_ends_well(tmp_path, monkeypatch):
    """A run that ends well leaves no unfinished.json; one that crashes after its first batch keeps its traceback and
    records how it ended there."""
    from tests.helpers import MLP_CONFIG, run_cli, run_dirs

    short = ["--trainer.max_steps=3", "--trainer.limit_val_batches=1", "--test_after_fit=false"]
    assert run_cli("fit", "--config", MLP_CONFIG, *short, run_root=tmp_path / "ok") == 0
    (run,) = run_dirs(tmp_path / "ok")
    assert not (run / "unfinished.json").exists()
    crash = tmp_path / "crash.yaml"
    crash.write_text("trainer:\n  callbacks+:\n    - class_path: tests.test_resume_contract.CrashAtStep\n")
    with pytest.raises(RuntimeError, match="crashed on purpose"):
        run_cli("fit", "--config", MLP_CONFIG, "--config", crash, *short, run_root=tmp_path / "bad")
    (run,) = run_dirs(tmp_path / "bad")
    info = json.loads((run / "unfinished.json").read_text())
    assert info["stage"] == "fit" and info["ended"] == "crashed: RuntimeError: crashed on purpose at step 2"
