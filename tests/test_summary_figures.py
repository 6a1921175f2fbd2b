"""Every method summary draws a readable figure: a title, labelled axes and at least two distinct plotted values.

Each summary is fed small synthetic runs in the on-disk format its method writes (``config.yaml``, ``metrics.csv``
and the method's own tables); the figure it saves is checked by :func:`tests.helpers.figure_problems` (through the
``checked_figures`` fixture, which sees every ``savefig``). A new summary without a run builder here fails
``test_every_summary_has_a_builder``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from lowrank_lit.registry import scan_methods

SUMMARIES = sorted(m.slug for m in scan_methods() if m.summary)


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(rows)


def _run(root: Path, name: str, config: dict[str, Any], metrics: dict[str, float] | list[dict[str, Any]] | None = None,
         **tables: list[dict[str, Any]]) -> Path:
    """A finished run directory: its saved config, ``metrics.csv`` (one row, or the given rows) and method tables
    (``name_csv=rows`` -> ``name.csv``)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    rows = metrics if isinstance(metrics, list) else [{"step": 0, **(metrics or {})}]
    _write_csv(d / "metrics.csv", rows)
    for table, table_rows in tables.items():
        _write_csv(d / table.replace("_csv", ".csv"), table_rows)
    return d


def _model(**init_args: Any) -> dict[str, Any]:
    return {"model": {"class_path": "lowrank_lit.Module", "init_args": init_args}}


def _bayes_prefix(root: Path) -> list[str]:
    for kind, offset in (("PrefixTuningModule", 0.0), ("WeightTuningModule", 0.5)):
        for seed in (0, 1):
            cfg = {"seed_everything": seed, "data": {"init_args": {"source": "dirichlet"}},
                   "model": {"class_path": f"lowrank_lit.methods.bayes_prefix.{kind}",
                             "init_args": {"method": "soft", "predictor": {"init_args": {"torso": "lstm"}}}}}
            metrics = {"test/regret_t50": 1 + offset, "test/regret_t200": 2 + offset,
                       "test/bayes_noprefix_regret_t50": 3.0, "test/bayes_noprefix_regret_t200": 4.0}
            _run(root, f"{kind}{seed}", cfg, metrics, regret_csv=[{"model": (t + 1) * (0.1 + offset)} for t in range(5)])
    return [str(root)]


def _prompt_runs(prompt_path: str, metric: str) -> Callable[[Path], list[str]]:
    def build(root: Path) -> list[str]:
        for name, prompt, acc in (("head", None, 0.6), ("mine", {"class_path": prompt_path, "init_args": {}}, 0.8)):
            for seed in (0, 1):
                _run(root, f"{name}{seed}", {"seed_everything": seed, **_model(prompt=prompt)},
                     {metric: acc + 0.02 * seed})
        return [str(root)]
    return build


def _lope(root: Path) -> list[str]:
    for name, adapter, acc in (("lora", "lowrank_lit.nn.lora.LoRALinear", 0.9), ("hydra", "lowrank_lit.nn.lora.HydraLoRALinear", 0.7)):
        _run(root, name, _model(adapter={"class_path": adapter, "init_args": {}}), {"test/acc": acc})
    return [str(root)]


def _gaze_3dpe(root: Path) -> list[str]:
    for variant, err in (("cnn", 20.0), ("full", 12.0)):
        for seed in (0, 1):
            _run(root, f"{variant}{seed}", {"seed_everything": seed, **_model(variant=variant)},
                 {"val/angle_deg": 5.0, "test/angle_deg": err + seed, "test/light/angle_deg": err + seed,
                  "test/pose/angle_deg": err + 2 + seed})
    return [str(root)]


def _glvq(root: Path) -> list[str]:
    for method, err in (("glvq", 0.05), ("rtn", 0.2)):
        cfg = {"trainer": {"callbacks": [{"class_path": "lowrank_lit.methods.glvq.GLVQ", "init_args": {"method": method, "bits": 2}}]}}
        _run(root, method, cfg, {"test/acc": 0.9},
             quantization_csv=[{"rel_error": err, "bits_per_weight": 2.1}, {"rel_error": 2 * err, "bits_per_weight": 2.1}])
    return [str(root)]


def _icl_rank_retriever(root: Path) -> list[str]:
    for loss, sp in (("sedpo", 0.4), ("infonce", 0.2)):
        for seed in (0, 1):
            _run(root, f"{loss}{seed}", {"seed_everything": seed, **_model(loss=loss)},
                 {"test/spearman": sp + 0.01 * seed, "test/top1_acc": 0.5 + sp / 2, "test/spearman_knn": 0.1,
                  "test/top1_acc_knn": 0.55, "test/top1_acc_random": 0.3, "test/top1_acc_oracle": 0.9})
    return [str(root)]


def _is_lowrank(root: Path) -> list[str]:
    for name, opt in (("adamw", {"class_path": "torch.optim.AdamW"}),
                      ("galore", {"class_path": "lowrank_lit.methods.is_lowrank.LowRankAdam", "init_args": {"selector": "dominant"}}),
                      ("is", {"class_path": "lowrank_lit.methods.is_lowrank.LowRankAdam", "init_args": {"selector": "importance"}})):
        high = name == "galore"
        _run(root, name, {"seed_everything": 0, **_model(optimizer=opt)}, {"val/loss": 2.0},
             subspace_csv=[{"step": s, "overlap": "" if s == 0 else (0.9 if high else 0.3) + 0.01 * s, "erank": 4 + s}
                           for s in range(4)])
    return [str(root)]


def _lowrank_rnn_cl(root: Path) -> list[str]:
    for method in ("what_how", "vanilla"):
        for seed in (0, 1):
            good = method == "what_how"
            stages = [{"stage": 0, "trained": "go", "vocab": "2", "go": 0.9, "anti": 0.5 if good else 0.2, "dly": 0.3},
                      {"stage": 1, "trained": "anti", "vocab": "3", "go": 0.85 if good else 0.4, "anti": 0.9, "dly": 0.6}]
            _run(root, f"{method}{seed}", {"seed_everything": seed, **_model(method=method)}, {"val/acc": 0.9},
                 forgetting_csv=stages)
    return [str(root)]


def _masked_block_icl(root: Path) -> list[str]:
    import torch

    from lowrank_lit.methods.masked_block_icl import plot_weights

    d = _run(root, "unconstrained", _model(model={"init_args": {"regime": "unconstrained", "layers": 2}}),
             {"test/median_mse": 0.01, "test/median_mse_zero": 1.0, "test/median_improvement": 100.0})
    g = torch.Generator().manual_seed(0)
    plot_weights({"W_QK": [torch.randn(4, 4, generator=g) for _ in range(2)],
                  "W_VP": [torch.randn(4, 4, generator=g) for _ in range(2)]}, str(d / "weights.png"))
    return [str(root)]


def _nanoadam(root: Path) -> list[str]:
    for name, opt in (("adamw", {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}}),
                      ("nano", {"class_path": "lowrank_lit.methods.nanoadam.NanoAdam", "init_args": {"lr": 1e-3}})):
        for seed in (0, 1):
            nano = name == "nano"
            _run(root, f"{name}{seed}", {"seed_everything": seed, **_model(optimizer=opt)},
                 {"test/target_acc": 0.9, "test/source_acc": 0.8 if nano else 0.5, "test/drift": 2.0 if nano else 9.0})
    return [str(root)]


def _q3r(root: Path) -> list[str]:
    for folder, slope in (("mlp_digits", 0.1), ("mlp_digits_adamw", 0.4)):
        for seed in (0, 1):
            _run(root / folder, str(seed), {"seed_everything": seed}, {"test/acc": 0.95},
                 truncation_csv=[{"keep_fraction": k, "kept_params": int(1000 * k), "acc": 0.95 - slope * (1 - k)}
                                 for k in (1.0, 0.5, 0.25)])
    return [str(root / "mlp_digits"), str(root / "mlp_digits_adamw")]


def _tta_batches(domains: int, errors: Callable[[int, int], float]) -> list[dict[str, Any]]:
    return [{"recurrence": r, "domain": d, "error": errors(r, d), "entropy": 0.5, "cluster": d}
            for r in range(2) for d in range(domains) for _ in range(3)]


def _reservoir_tta(root: Path) -> list[str]:
    tent = {"class_path": "lowrank_lit.tta.methods.Tent"}
    for name, method, worse in (("tent", tent, 0.1), ("reservoir", {"class_path": "lowrank_lit.methods.reservoir_tta.ReservoirTTA",
                                                                    "init_args": {"method": tent}}, 0.0)):
        _run(root, name, _model(method=method), {"test/error": 0.3}, tta_batches_csv=_tta_batches(2, lambda r, d, worse=worse: 0.3 + worse * r))
    return [str(root)]


def _safe_meta_rl(root: Path) -> list[str]:
    for adapt, cost in (("safe", 0.1), ("unconstrained", 0.6)):
        rows = [{"task": t, "step": k, "J_r": 1.0 + k, "J_c": cost * k, "violation": int(cost * k > 0.5)}
                for t in range(2) for k in range(3)]
        _run(root, adapt, _model(env={"class_path": "lowrank_lit.envs.GridWorld"}, adapt=adapt),
             [{"step": s, "train/step_s": 0.01 * (s + 1)} for s in range(3)], adaptation_test_csv=rows)
    return [str(root)]


def _shallow_diffuse(root: Path) -> list[str]:
    for denoiser, ratio in (("UNet", 0.1), ("MLPDenoiser", 0.3)):
        cfg = {"data": {"init_args": {"shape": [1, 16, 16]}},
               **_model(method="shallow_diffuse", t_frac=0.3, denoiser={"class_path": f"lowrank_lit.models.{denoiser}"})}
        _run(root, denoiser, cfg, {"test/psnr": 30.0},
             watermark_attacks_csv=[{"attack": "none", "auc": 1.0, "tpr_at_1fpr": 1.0}, {"attack": "jpeg", "auc": 0.9, "tpr_at_1fpr": 0.5}],
             rank_ratio_csv=[{"t": t, "rank_ratio": ratio * (t + 1)} for t in (10, 50, 100)])
    return [str(root)]


def _skrull(root: Path) -> list[str]:
    for schedule, step_s in (("baseline", 0.2), ("skrull", 0.1)):
        cfg = {"data": {"init_args": {"mix": "long_tail", "planner": {"init_args": {"schedule": schedule}}}}}
        rows = [{"step": s, "train/loss": 3.0 - 0.1 * s, "train/step_s": step_s, "train/micro_batches": 2} for s in range(4)]
        rows.append({"step": 4, "val/loss": 2.5})
        _run(root, schedule, cfg, rows)
    return [str(root)]


def _strank(root: Path) -> list[str]:
    for name, loss in (("mse", {"class_path": "torch.nn.MSELoss"}),
                       ("strank", {"class_path": "lowrank_lit.methods.strank.STRankLoss", "init_args": {"mode": "list"}})):
        _run(root, name, {"seed_everything": 0, "data": {"init_args": {"setting": "imbalanced"}}, **_model(loss=loss)},
             {"test/spearman": 0.5}, predictions_csv=[{"x": x, "truth_0": x * x, "pred_0": x * x + (0.1 if name == "mse" else 0.0) * x}
                                                      for x in range(5)])
    return [str(root)]


def _trust(root: Path) -> list[str]:
    for name, acc in (("Tent", 0.5), ("TRUST", 0.7)):
        cfg = {"seed_everything": 0, "data": {"init_args": {"batch_size": 16, "corruptions": ["noise", "blur"]}},
               **_model(method={"class_path": f"lowrank_lit.methods.trust.{name}"}, model={"init_args": {"norm": "bn"}})}
        _run(root, name, cfg, {"test/acc_noise": acc, "test/acc_blur": acc - 0.1},
             tta_batches_csv=_tta_batches(2, lambda r, d, acc=acc: 1 - acc + 0.05 * d))
    return [str(root)]


BUILDERS: dict[str, Callable[[Path], list[str]]] = {
    "bayes_prefix": _bayes_prefix,
    "capt": _prompt_runs("lowrank_lit.methods.capt.CapsulePrompt", "test/acc"),
    "gaze_3dpe": _gaze_3dpe,
    "glvq": _glvq,
    "icl_rank_retriever": _icl_rank_retriever,
    "is_lowrank": _is_lowrank,
    "lope": _lope,
    "lowrank_rnn_cl": _lowrank_rnn_cl,
    "masked_block_icl": _masked_block_icl,
    "nanoadam": _nanoadam,
    "pt_moe": _prompt_runs("lowrank_lit.methods.pt_moe.DecomposedMoEPrompt", "test/mean_domain_acc"),
    "q3r": _q3r,
    "reservoir_tta": _reservoir_tta,
    "safe_meta_rl": _safe_meta_rl,
    "shallow_diffuse": _shallow_diffuse,
    "skrull": _skrull,
    "strank": _strank,
    "trust": _trust,
}


def test_every_summary_has_a_builder():
    assert set(BUILDERS) == set(SUMMARIES)


@pytest.mark.parametrize("slug", SUMMARIES)
def test_summary_figure_has_a_title_labelled_axes_and_content(slug, tmp_path, checked_figures):
    from lowrank_lit.launch.summarize import get_summary

    roots = BUILDERS[slug](tmp_path / "runs")
    out = tmp_path / f"{slug}.png"
    text = get_summary(slug).fn(roots, str(out))
    assert text.startswith("|") or "\n|" in text  # a markdown table came back
    assert out.is_file() and out.stat().st_size > 0, f"{slug}: no figure written to --out"
    drawn = {p: problems for p, problems in checked_figures.items() if not p.startswith(str(tmp_path / "runs"))}
    assert str(out) in drawn or slug == "masked_block_icl", drawn  # masked-block copies the figure its run drew
    assert all(not problems for problems in checked_figures.values()), checked_figures
