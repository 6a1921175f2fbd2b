"""Reading runs back: one reader for every summary."""

from __future__ import annotations

import pytest
import yaml

from lowrank_lit.report import Run, read_runs


def _run(root, name, trainer, rows):
    d = root / "exp" / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"trainer": trainer, "seed_everything": 0}))
    (d / "metrics.csv").write_text("step,train/loss,val/acc\n" + "".join(f"{i},{a},{b}\n" for i, (a, b) in enumerate(rows)))
    return d


def test_read_runs_gives_config_final_metrics_history_and_debug(tmp_path):
    _run(tmp_path, "b", {"fast_dev_run": True}, [(1.0, "")])
    _run(tmp_path, "a", {"max_epochs": 3}, [(2.0, 0.5), (1.5, ""), (1.0, 0.75)])
    _run(tmp_path, "c", {"limit_train_batches": 0.1}, [(3.0, 0.1)])
    runs = read_runs([str(tmp_path)])
    assert [r.path.name for r in runs] == ["a", "b", "c"]
    a, b, c = runs
    assert a.metrics == {"step": 2.0, "train/loss": 1.0, "val/acc": 0.75}
    assert a.history("val/acc") == [0.5, 0.75] and a.config["trainer"]["max_epochs"] == 3
    assert (a.debug, b.debug, c.debug) == (False, True, True)
    assert str(a) == str(tmp_path / "exp" / "a") and Run(a).path == a.path  # a Run is path-like


def test_read_runs_names_roots_and_marker(tmp_path):
    with pytest.raises(FileNotFoundError, match="forgetting.csv"):
        read_runs([str(tmp_path)], "forgetting.csv")
    assert read_runs([str(tmp_path)], "forgetting.csv", required=False) == []
