"""``lowrank bench``: the timing helpers, the registry of benchmarks, the command's errors, and a quick run of all."""

from __future__ import annotations

import pytest
import torch

from lowrank_lit.bench import BenchContext, BenchRow, ConfigBench, bench_table, ratio_row, tensor_bytes
from lowrank_lit.registry import scan_methods


def test_every_method_registers_a_benchmark():
    assert [m.slug for m in scan_methods() if m.bench is None] == ["baseline"]


def test_compare_times_round_robin_after_warmup():
    calls: list[str] = []
    ctx = BenchContext()
    times = ctx.compare({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=2)
    assert calls == ["a", "b"] * 5 and {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3}


def test_ratio_row_is_the_median_of_per_round_ratios():
    ctx = BenchContext()
    row = ratio_row(ctx, "m", "x", "y", {"m": [2.0, 3.0, 10.0], "b": [1.0, 1.0, 2.0]}, "m", "b", "claim", target=2.5)
    assert row.ratio == 3.0 and row.spread == (2.0, 5.0) and row.met == "no"
    assert BenchRow("m", "x", "y", 0.5, (0.4, 0.6), "c", 1.0).met == "yes"
    assert BenchRow("m", "x", "y", 0.5, (0.4, 0.6), "c").met == "-"
    table = bench_table([row])
    assert "| m | x | y | 3x | 2 - 5 | claim | no |" in table


def test_tensor_bytes_counts_each_tensor_once():
    lin = torch.nn.Linear(4, 3)  # 12 + 3 floats
    opt = torch.optim.Adam(lin.parameters())
    lin(torch.randn(2, 4)).sum().backward()
    opt.step()
    assert tensor_bytes(lin) == 15 * 4
    assert tensor_bytes(opt) == 2 * 15 * 4 + 2 * 4  # two moments per parameter and a step count each
    assert tensor_bytes(lin, lin, [lin.weight]) == 15 * 4


def test_context_sizes_and_rounds():
    assert BenchContext(quick=True).size(100, 5) == 5 and BenchContext().size(100, 5) == 100
    assert BenchContext(quick=True).rounds(10) == 3 and BenchContext(repeats=7, quick=True).rounds(10) == 7


@pytest.mark.e2e
@pytest.mark.parametrize("argv,message", [
    (["nosuch"], "SLUG: 'nosuch' has no benchmark"),
    (["--device", "tpu"], "--device: 'tpu' is not one of cpu, cuda"),
    (["--repeats", "0"], "--repeats='0'; allowed: an integer > 0"),
    (["--repeats", "x"], "--repeats='x'; allowed: an integer > 0"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    from lowrank_lit import cli

    assert cli.main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_cuda_on_a_machine_without_one_is_refused(capsys):
    from lowrank_lit import cli

    assert cli.main(["bench", "glvq", "--device", "cuda"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err


@pytest.mark.e2e
def test_config_bench_times_two_configs(monkeypatch):
    """A ConfigBench builds both configs as `lowrank fit` would and times their steps; the method override reaches
    the method's config only."""
    from lowrank_lit.launch import bench

    built = []
    original = bench._build

    def spy(config, overrides, verb):
        built.append((config, tuple(overrides)))
        return original(config, overrides, verb)

    monkeypatch.setattr(bench, "_build", spy)
    spec = ConfigBench("q3r", "Q3R step", "AdamW step", "configs/q3r/mlp_digits.yaml", "configs/q3r/mlp_digits_adamw.yaml",
                       "claim", 10.0, method_overrides=("--model.init_args.optimizer.init_args.lr=0.002",), quick_steps=3)
    row = bench.run_config_bench(BenchContext(quick=True, repeats=2), spec)
    assert built == [("configs/q3r/mlp_digits.yaml", ("--model.init_args.optimizer.init_args.lr=0.002",)),
                     ("configs/q3r/mlp_digits_adamw.yaml", ())]
    assert row.ratio > 0 and row.spread[0] <= row.ratio <= row.spread[1] and row.met in ("yes", "no")
    assert "ms per step" in row.note
    assert row.memory.startswith("held ") and row.memory.count("MiB") == 2  # weights + optimizer state, both sides


BENCHED = [m.slug for m in scan_methods() if m.bench]


@pytest.mark.e2e
@pytest.mark.parametrize("slug", BENCHED)
def test_quick_bench_of_every_method(slug, tmp_path):
    """`lowrank bench --quick SLUG --out FILE`: every registered method's benchmark runs and writes its rows to the
    page (no timing asserted: the ratios of a quick run are indicative only). One test per method, so that parallel
    workers share them."""
    from lowrank_lit import cli

    out = tmp_path / "performance.md"
    assert cli.main(["bench", "--quick", slug, "--out", str(out)]) == 0
    text = out.read_text()
    assert f"\n| {slug} |" in text and "lowrank bench --quick" in text and "--out" in text
