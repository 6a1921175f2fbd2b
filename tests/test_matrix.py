"""`lowrank matrix`: the cross product of config fragments over seeds, run as a grid sweep, one table."""

from __future__ import annotations

import csv
import shlex

import pytest
import yaml

from lowrank_lit.launch.config_yaml import appends_applied, merge_config_layers
from lowrank_lit.launch.matrix import GridError, cell_name, load_grid
from tests.helpers import ROOT

BASE = str(ROOT / "configs" / "baseline" / "mlp_digits.yaml")
FAST = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1",
        "--trainer.limit_test_batches=2"]


def _grid(tmp_path, axes, seeds=(0,), metrics=("test/acc",)):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump({"metrics": list(metrics), "seeds": list(seeds), "axes": axes}, sort_keys=False))
    return path


def test_cells_are_the_cross_product_named_by_axis_and_component(tmp_path):
    grid = load_grid(_grid(tmp_path, {"opt": {"adam": {}, "sgd": {"model.init_args.optimizer.class_path": "torch.optim.SGD"}},
                                      "width": {"w8": {}, "w16": {}, "w32": {}}}))
    cells = grid.cells()
    assert len(cells) == 6 and cell_name(cells[0]) == "opt.adam__width.w8" and cell_name(cells[-1]) == "opt.sgd__width.w32"
    assert grid.axes["opt"]["sgd"] == {"model": {"init_args": {"optimizer": {"class_path": "torch.optim.SGD"}}}}


def test_fragments_merge_in_order_and_callback_lists_add_up():
    a = {"trainer": {"callbacks+": [{"class_path": "A"}], "max_epochs": 2}, "model": {"init_args": {"lr": 1}}}
    b = {"trainer": {"callbacks+": [{"class_path": "B"}]}, "model": {"init_args": {"lr": 2, "wd": 0}}}
    assert merge_config_layers([a, b]) == {"trainer": {"callbacks+": [{"class_path": "A"}, {"class_path": "B"}],
                                                       "max_epochs": 2},
                                           "model": {"init_args": {"lr": 2, "wd": 0}}}


def test_one_merge_rule_for_config_stacks_sweeps_and_grids():
    """``key+`` appends to a key an earlier layer set, stays ``key+`` for the parser otherwise, and a later plain key
    drops it; the sweep's check and the matrix use this one function."""
    from lowrank_lit.launch import matrix, sweep_spec

    base = {"trainer": {"callbacks": [{"class_path": "A"}], "max_epochs": 1}}
    frag = {"trainer": {"callbacks+": {"class_path": "B"}}}
    layers = [base, frag]
    assert merge_config_layers(layers) == {"trainer": {"callbacks": [{"class_path": "A"}, {"class_path": "B"}],
                                                       "max_epochs": 1}}
    assert base["trainer"]["callbacks"] == [{"class_path": "A"}]  # the layers are not changed
    assert merge_config_layers([frag, {"trainer": {"callbacks": []}}]) == {"trainer": {"callbacks": []}}
    assert merge_config_layers([frag, frag]) == {"trainer": {"callbacks+": [{"class_path": "B"}] * 2}}
    assert appends_applied(merge_config_layers([frag])) == {"trainer": {"callbacks": [{"class_path": "B"}]}}
    assert matrix.merge_config_layers is sweep_spec.merge_config_layers is merge_config_layers


@pytest.mark.parametrize(("bad", "match"), [
    ({"axes": {}}, "axes must map"), ({"axes": {"a": {"x": {}}}, "metrics": []}, "metrics must be"),
    ({"axes": {"a": {"x y": {}}}, "metrics": ["m"]}, "names are letters"),
    ({"axes": {"a": {"x": "nope.yaml"}}, "metrics": ["m"]}, "fragment file 'nope.yaml' does not exist"),
    ({"axes": {"a": {"x": {}}}, "metrics": ["m"], "goal": "up"}, "goal='up'; allowed: minimize, maximize"),
])
def test_a_bad_grid_file_is_named(tmp_path, bad, match):
    path = tmp_path / "g.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(GridError, match=match):
        load_grid(path)


@pytest.mark.e2e
def test_matrix_runs_skips_finished_cells_names_incompatible_pairs_and_reproduces_a_cell(tmp_path, monkeypatch, capsys):
    from lowrank_lit.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    # SGD alone builds, betas alone build (Adam has them), together they do not: the pair is named before training
    grid = _grid(tmp_path, {"opt": {"adam": {}, "sgd": {"model.init_args.optimizer": {"class_path": "torch.optim.SGD",
                                                                                      "init_args": {"lr": 0.1}}}},
                            "betas": {"default": {}, "slow": {"model.init_args.optimizer.init_args.betas": [0.5, 0.9]}}},
                 metrics=("test/acc", "val/loss"))
    assert main(["matrix", "--config", BASE, "--grid", str(grid), "--root", "m", *FAST]) == 0
    out, err = capsys.readouterr()
    assert "opt.sgd__betas.slow: incompatible: opt=sgd and betas=slow do not fit together" in err
    assert "4 cells x 1 seeds: 3 cells build, 1 incompatible" in out
    runs = sorted(p.parent for p in (tmp_path / "m").rglob("metrics.csv"))
    assert len(runs) == 3  # one run folder per runnable cell, under the matrix root
    rows = list(csv.DictReader((tmp_path / "m" / "matrix.csv").open()))
    assert [(r["opt"], r["betas"], r["status"]) for r in rows] == [
        ("adam", "default", "done"), ("adam", "slow", "done"), ("sgd", "default", "done"), ("sgd", "slow", "incompatible")]
    assert (tmp_path / "m" / "matrix_test_acc.png").is_file() and (tmp_path / "m" / "matrix_val_loss.png").is_file()

    # the same command again runs nothing new
    assert main(["matrix", "--config", BASE, "--grid", str(grid), "--root", "m", *FAST]) == 0
    assert sorted(p.parent for p in (tmp_path / "m").rglob("metrics.csv")) == runs
    again = list(csv.DictReader((tmp_path / "m" / "matrix.csv").open()))
    assert [r["test/acc"] for r in again] == [r["test/acc"] for r in rows]

    # a cell's command reproduces its numbers bit for bit (into another root)
    command = shlex.split(rows[1]["command"])
    assert command[:2] == ["lowrank", "fit"] and "--seed_everything=0" in command
    root = command.index("--run_root")
    command[root + 1] = "again"
    assert main(command[1:]) == 0
    (rerun,) = list((tmp_path / "again").rglob("metrics.csv"))
    (first,) = [r / "metrics.csv" for r in runs if "opt.adam__betas.slow" in str(r)]
    from lowrank_lit.report import last_values

    assert last_values(rerun)["test/acc"] == last_values(first)["test/acc"] == float(rows[1]["test/acc"])
    assert last_values(rerun)["val/loss"] == last_values(first)["val/loss"]


@pytest.mark.e2e
@pytest.mark.parametrize("path", sorted((ROOT / "grids").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_grid_file_builds_every_cell(path, tmp_path, monkeypatch):
    """A shipped grid has its base config, and every cell builds (model, data, callbacks, optimizer)."""
    from lowrank_lit.launch.matrix import check_cells, prepare

    monkeypatch.chdir(ROOT)
    grid = load_grid(path)
    assert grid.config and (ROOT / grid.config).is_file()
    files = prepare(grid, grid.config, tmp_path, path.stem)
    assert check_cells(grid, grid.config, tmp_path, files) == {}


@pytest.mark.e2e
def test_check_builds_the_cells_and_names_the_slurm_array_command(tmp_path, monkeypatch, capsys):
    from lowrank_lit.cli import main

    monkeypatch.chdir(tmp_path)
    grid = _grid(tmp_path, {"opt": {"adam": {}, "sgd": {"model.init_args.optimizer": {"class_path": "torch.optim.SGD",
                                                                                      "init_args": {"lr": 0.1}}}}})
    assert main(["matrix", "--config", BASE, "--grid", str(grid), "--root", "m", "--check"]) == 0
    out = capsys.readouterr().out
    assert "2 cells x 1 seeds: 2 cells build, 0 incompatible" in out and not (tmp_path / "m").exists()  # nothing written
    assert main(["matrix", "--config", BASE, "--grid", str(grid), "--root", "m", "--limit", "0"]) == 0  # writes, runs nothing
    out = capsys.readouterr().out
    assert not list((tmp_path / "m").rglob("metrics.csv"))
    line = next(ln for ln in out.splitlines() if ln.startswith("on SLURM"))
    submit = shlex.split(line.split(": ", 1)[1].split(";")[0])
    submit[submit.index("--array") + 1] = "2"
    assert main([*submit[1:], "--dry-run"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --array=0-1" in script and "--run-root m" in script and "--storage m/matrix.journal" in script


@pytest.mark.e2e
def test_seeds_selects_a_subset_and_refuses_others(tmp_path, monkeypatch, capsys):
    from lowrank_lit.cli import main

    monkeypatch.chdir(tmp_path)
    grid = _grid(tmp_path, {"opt": {"adam": {}}}, seeds=(0, 1, 2))
    assert main(["matrix", "--config", BASE, "--grid", str(grid), "--seeds", "7", "--check"]) == 2
    assert "--seeds: [7] are not seeds of" in capsys.readouterr().err
    assert main(["matrix", "--config", BASE, "--grid", str(grid), "--seeds", "1", "--check"]) == 0
    assert "1 cells x 1 seeds" in capsys.readouterr().out


def test_pivot_puts_one_axis_in_the_columns(tmp_path):
    from lowrank_lit.launch.matrix import pivot_table

    grid = load_grid(_grid(tmp_path, {"m": {"a": {}, "b": {}}, "s": {"x": {}, "y": {}}}, metrics=("test/error",)))
    rows = [{"m": m, "s": s, "test/error": e, "test/error min-max": r}
            for m, s, e, r in (("a", "x", 0.1, "0.05-0.15"), ("a", "y", 0.2, ""), ("b", "x", 0.3, ""), ("b", "y", None, ""))]
    text = pivot_table(grid, rows, "s")
    assert text.splitlines()[0] == "| m | test/error s=x | test/error s=y |"
    assert "| a | 0.100 (0.05-0.15) | 0.200 |" in text and "| b | 0.300 | - |" in text
    with pytest.raises(GridError, match="not an axis"):
        pivot_table(grid, rows, "z")


def test_each_seed_is_its_own_study_of_the_cells_not_finished_on_disk(tmp_path):
    """A subset of seeds, a restart or an edited grid never reopens a study with another parameter space: per seed,
    the sweep holds the cells without a finished run of that seed, and its study name carries their digest."""
    from lowrank_lit.launch.matrix import prepare, sweep_files

    grid = load_grid(_grid(tmp_path, {"opt": {"a": {}, "b": {}}}, seeds=(0, 1)))
    files = prepare(grid, BASE, tmp_path / "m", "g")
    first = sweep_files(grid, BASE, tmp_path / "m", "g", files, set())
    assert [(s, c) for s, _, _, c in first] == [(0, 2), (1, 2)]
    run = tmp_path / "m" / "g" / "opt.a" / "r0"  # a finished run of cell opt.a, seed 1
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("seed_everything: 1\n")
    (run / "metrics.csv").write_text("step,test/acc\n0,0.5\n")
    again = sweep_files(grid, BASE, tmp_path / "m", "g", files, set())
    assert [(s, c) for s, _, _, c in again] == [(0, 2), (1, 1)]
    assert again[0][2] == first[0][2] and again[1][2] != first[1][2]  # seed 1's parameter space changed: a new study
    assert yaml.safe_load(again[1][1].read_text())["parameters"]["config"]["values"] == [str(files["opt.b"])]
