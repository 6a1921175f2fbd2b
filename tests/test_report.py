"""Reading runs back: one reader for every summary."""

from __future__ import annotations

import pytest
import yaml

from lowrank_lit.report import Run, including_debug_runs, read_runs


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
    with including_debug_runs():
        runs = read_runs([str(tmp_path)])
    assert [r.path.name for r in runs] == ["a", "b", "c"]
    a, b, c = runs
    assert a.metrics == {"step": 2.0, "train/loss": 1.0, "val/acc": 0.75}
    assert a.history("val/acc") == [0.5, 0.75] and a.config["trainer"]["max_epochs"] == 3
    assert (a.debug, b.debug, c.debug) == (False, True, True)
    assert (a.debug_reason, b.debug_reason, c.debug_reason) == (None, "fast_dev_run=True", "limit_train_batches=0.1")
    assert [r.path.name for r in read_runs([str(tmp_path)])] == ["a"]  # summaries never see a smoke by default
    assert str(a) == str(tmp_path / "exp" / "a") and Run(a).path == a.path  # a Run is path-like


def test_read_runs_names_roots_and_marker(tmp_path):
    with pytest.raises(FileNotFoundError, match="forgetting.csv"):
        read_runs([str(tmp_path)], "forgetting.csv")
    assert read_runs([str(tmp_path)], "forgetting.csv", required=False) == []


def _names_summary(roots, out=None):
    """A stand-in summary: the names of the runs it was given, one per line."""
    return "\n".join(r.path.name for r in read_runs(roots))


@pytest.mark.e2e
def test_summarize_leaves_debug_runs_out_and_lists_them(tmp_path, monkeypatch, capsys):
    from lowrank_lit import cli
    from lowrank_lit.launch import summarize

    monkeypatch.setitem(summarize.EXTRA_STUDIES, "names", f"{__name__}._names_summary")
    _run(tmp_path, "real", {"max_epochs": 3}, [(1.0, 0.5)])
    _run(tmp_path, "smoke", {"fast_dev_run": True}, [(1.0, "")])
    _run(tmp_path, "partial", {"limit_train_batches": 2, "limit_val_batches": 2}, [(1.0, 0.1)])
    _run(tmp_path, "budget", {"limit_val_batches": 20}, [(1.0, 0.2)])  # an evaluation budget, not a smoke
    assert cli.main(["summarize", "names", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.split() == ["budget", "real"] and "left out 2 debug run(s)" in err
    assert cli.main(["summarize", "names", str(tmp_path), "--include-debug"]) == 0
    assert capsys.readouterr().out.split() == ["budget", "partial", "real", "smoke"]
    assert cli.main(["summarize", "names", str(tmp_path), "--list-debug"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed == [f"{tmp_path / 'exp' / 'partial'}  (limit_train_batches=2)", f"{tmp_path / 'exp' / 'smoke'}  (fast_dev_run=True)"]
    for name in ("real", "budget"):
        (tmp_path / "exp" / name / "config.yaml").unlink()
        (tmp_path / "exp" / name / "metrics.csv").unlink()
    assert cli.main(["summarize", "names", str(tmp_path)]) == 2  # only debug runs: the error says so
    assert "except 2 debug run(s)" in capsys.readouterr().err


@pytest.mark.e2e
def test_debug_run_config_is_marked(tmp_path):
    from tests.helpers import MLP_CONFIG, run_cli

    assert run_cli("fit", "--config", MLP_CONFIG, "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1",
                   "--trainer.max_epochs=1", "--test_after_fit=false", "--trainer.enable_progress_bar=false",
                   "--run_id=partial", run_root=tmp_path) == 0
    (config,) = tmp_path.rglob("partial/config.yaml")
    first = config.read_text().splitlines()[0]
    assert first.startswith("# debug run (limit_train_batches=2)"), first
    assert Run(config.parent).debug


# ------------------------------------------------------------------ writing: the run-directory API
def _trainer(tmp_path, **overrides):
    from tests.helpers import writing_trainer

    return writing_trainer(tmp_path, **overrides)


def test_may_write_rank_zero_with_a_logger_outside_debug_runs(tmp_path, monkeypatch):
    from lowrank_lit.report import may_write, run_directory

    assert not may_write(None) and run_directory(None) is None
    trainer = _trainer(tmp_path)
    assert may_write(trainer) and run_directory(trainer) == str(tmp_path)
    assert not may_write(_trainer(tmp_path, logger=False))  # a bare Trainer(logger=False) writes nothing
    assert not may_write(_trainer(tmp_path, fast_dev_run=True))  # a smoke run leaves no results behind
    assert may_write(_trainer(tmp_path, limit_train_batches=2))  # a partial run writes (read back as debug)
    monkeypatch.setattr(type(trainer), "is_global_zero", property(lambda self: False))
    assert not may_write(trainer)


def test_may_write_is_false_during_the_sanity_check(tmp_path):
    from lowrank_lit.report import may_write

    trainer = _trainer(tmp_path)
    trainer.state.stage = "sanity_check"
    assert trainer.sanity_checking and not may_write(trainer)


def test_artifact_path_stays_in_the_run_directory(tmp_path):
    from lowrank_lit.report import artifact_path, save_rows

    trainer = _trainer(tmp_path / "run")
    path = artifact_path(trainer, "figs/a.png")
    assert path == str(tmp_path / "run" / "figs" / "a.png") and (tmp_path / "run" / "figs").is_dir()
    for bad in ("../a.csv", "/tmp/a.csv", "x/../../a.csv"):
        with pytest.raises(ValueError, match="name="):
            artifact_path(trainer, bad)
    assert save_rows(trainer, [{"a": 1, "b": 2}], "t.csv") == str(tmp_path / "run" / "t.csv")
    assert (tmp_path / "run" / "t.csv").read_text().splitlines() == ["a,b", "1,2"]


def test_mean_std_cells():
    from lowrank_lit.report import mean_std

    assert mean_std([]) == "-"
    assert mean_std([0.5]) == "0.5"
    assert mean_std([0.5, 0.7], scale=100.0) == "60.0 ± 14.1"
    assert mean_std([1.0, 2.0, 3.0], ".3f") == "2.000 ± 1.000"


def test_figures_have_titles_labels_and_content(tmp_path, checked_figures):
    """The figures the summaries and modules draw: the prompt-run bars (the paper's method marked, labels unbroken),
    Skrull's Gantt panels (one time axis), a one-pass TTA stream (error per corruption, not a single point)."""
    from lowrank_lit.methods.skrull import SkrullCostModel, baseline_plan, plot_plan, skrull_plan
    from lowrank_lit.studies.prompt_runs import prompt_runs_table
    from lowrank_lit.tta.module import plot_recurrence

    for name, prompt, accs in (("a", None, (0.6, 0.62)), ("b", "lowrank_lit.methods.capt.CapsulePrompt", (0.8, 0.84))):
        for seed, acc in enumerate(accs):
            d = tmp_path / "runs" / name / str(seed)
            d.mkdir(parents=True)
            cfg = {"model": {"init_args": {"prompt": None if prompt is None else {"class_path": prompt, "init_args": {}}}}}
            (d / "config.yaml").write_text(yaml.safe_dump(cfg))
            (d / "metrics.csv").write_text(f"step,test/acc\n0,{acc}\n")
    prompt_runs_table([str(tmp_path / "runs")], ("test/acc",), out=str(tmp_path / "bars.png"),
                      title="CaPT vs prompt baselines (MiniLM, 2 layers)", highlight="CapsulePrompt")
    lengths = [64, 900, 4000, 120, 2000, 30, 700, 5000]
    cost = SkrullCostModel()
    plans = {"baseline": baseline_plan(lengths, 4000, 2, 1)[0], "Skrull": skrull_plan(lengths, 4000, 2, 1, cost)[0]}
    plot_plan(lengths, plans, cost, 2, str(tmp_path / "gantt.png"))
    plot_recurrence({"Tent": {0: 0.3}}, str(tmp_path / "tta.png"), per_domain={"Tent": {"noise": 0.3, "blur": 0.2}})
    assert set(checked_figures) == {str(tmp_path / f) for f in ("bars.png", "gantt.png", "tta.png")}
    assert all(not problems for problems in checked_figures.values()), checked_figures
    degenerate = str(tmp_path / "flat.png")
    plot_recurrence({"Tent": {0: 0.3}}, degenerate)  # one recurrence, no per-corruption data: nothing to see
    assert any("distinct" in p for p in checked_figures[degenerate])


# ------------------------------------------------------------------------ whose runs a summary reads
def _config_run(root, experiment, run_id, config, files=None, seed=0, **top):
    """A run directory whose config.yaml is a real config file's content (as `lowrank fit` saves it), plus files."""
    from tests.helpers import CONFIGS

    cfg = yaml.safe_load((CONFIGS / config).read_text())
    cfg.update(experiment=experiment, run_id=run_id, seed_everything=seed, **top)
    d = root / experiment / run_id
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    for name, text in (files or {}).items():
        (d / name).write_text(text)
    return d


def _truncation(acc):
    return "keep_fraction,kept_params,acc\n" + "".join(f"{k},{int(1000 * k)},{acc}\n" for k in (1.0, 0.5))


@pytest.mark.e2e
def test_summarize_never_reads_another_methods_runs_and_says_so(tmp_path, capsys):
    from lowrank_lit import cli

    for seed in (0, 1):
        _config_run(tmp_path, "q3r/mlp_digits", f"s{seed}", "q3r/mlp_digits.yaml", {"truncation.csv": _truncation(0.9),
                    "metrics.csv": "step,test/acc\n1,0.9\n"}, seed)
    for slug in ("lope", "strank"):  # used to print a "HydraLoRA" row from these Q3R runs, or `error: 'loss'`
        assert cli.main(["summarize", slug, str(tmp_path)]) == 1
        err = capsys.readouterr().err.strip()
        assert err == (f"lowrank summarize {slug}: no {slug} runs under {tmp_path}; left out 2 run(s): 2 x runs of "
                       "another method (q3r)")


@pytest.mark.e2e
def test_summarize_q3r_gives_one_column_per_experiment_never_pooled(tmp_path, capsys):
    from lowrank_lit import cli

    for seed in (0, 1):
        _config_run(tmp_path, "q3r/mlp_digits", f"q{seed}", "q3r/mlp_digits.yaml", {"truncation.csv": _truncation(0.9)}, seed)
        _config_run(tmp_path, "q3r/mlp_digits_adamw", f"a{seed}", "q3r/mlp_digits_adamw.yaml",
                    {"truncation.csv": _truncation(0.5)}, seed)
    # a sweep inside one experiment: its swept value is a column of its own
    _config_run(tmp_path, "q3r/mlp_digits", "lam", "q3r/mlp_digits.yaml", {"truncation.csv": _truncation(0.7)},
                test_after_fit=False)
    assert cli.main(["summarize", "q3r", str(tmp_path)]) == 0  # one folder holding both experiments
    header = capsys.readouterr().out.splitlines()[0]
    assert header == ("| keep fraction | mlp_digits test_after_fit=False (n=1) | mlp_digits test_after_fit=True (n=2) | "
                      "mlp_digits_adamw (n=2) |")  # in the order of the run folders


@pytest.mark.e2e
def test_summarize_keeps_the_latest_of_repeated_evaluations_of_one_checkpoint(tmp_path, monkeypatch, capsys):
    import os

    from lowrank_lit import cli
    from lowrank_lit.launch import summarize

    monkeypatch.setitem(summarize.EXTRA_STUDIES, "names", f"{__name__}._names_summary")
    for i, run_id in enumerate(("first", "second", "third")):
        d = _config_run(tmp_path, "glvq/mlp_digits_2bit", run_id, "glvq/mlp_digits_2bit.yaml",
                        {"metrics.csv": "step,test/acc\n0,0.9\n"})
        os.utime(d / "metrics.csv", (1000 + i, 1000 + i))
    _config_run(tmp_path, "glvq/mlp_digits_2bit", "seed1", "glvq/mlp_digits_2bit.yaml", {"metrics.csv": "step\n0\n"}, 1)
    assert cli.main(["summarize", "names", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out.split() == ["seed1", "third"]  # another seed is another evaluation; of the three, the latest
    assert "left out 2 run(s): 2 x an earlier evaluation of runs/glvq/mlp_digits_fp/fp/checkpoints/last.ckpt" in err


@pytest.mark.e2e
def test_summarize_with_no_run_of_the_method_says_so_and_exits_1(tmp_path, capsys):
    from lowrank_lit import cli

    (tmp_path / "empty").mkdir()
    assert cli.main(["summarize", "glvq", str(tmp_path / "empty")]) == 1
    assert capsys.readouterr().err.strip() == f"lowrank summarize glvq: no glvq runs under {tmp_path / 'empty'}"
