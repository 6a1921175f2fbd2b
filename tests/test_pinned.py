"""Pinned short runs, torchtune style: a silent numeric change in any method fails here.

For one CPU config of every registered method, a few steps under seed 0 and the first three values
the method logs (training losses, or the quantization errors / post-adaptation entropies / bound-study
errors of the evaluation-only methods) are compared with the values pinned below. A method without an
entry fails `test_every_method_has_pinned_values`.

The pins must hold on any x86 CPU, thread count and test order. Beside each value is its measured
relative spread: the largest relative distance from the pin over fresh processes under torch's CPU
kernels ``ATEN_CPU_CAPABILITY=default | avx2 | avx512`` (and the native choice), 1 and 2 threads, and
MKL / oneDNN held to older instruction sets (``MKL_ENABLE_INSTRUCTIONS=SSE4_2`` or ``AVX2``,
``ONEDNN_MAX_CPU_ISA``), as a CPU without AVX-512 or AVX runs them. Each value is checked with
``rtol = max(RTOL_FLOOR, SPREAD_FACTOR x its spread)``. Most spreads are 0 or ~1e-7 (float32 rounding);
two runs amplify rounding: NanoAdam's top-k update picks different coordinates when MKL uses SSE4.2
kernels (3.8e-3 at step 2), and 3DPE-Gaze's second step (3.2e-4 between the default and vectorised kernels).

If a change is intended, rerun `python -m tests.test_pinned` and paste the printed values; rerun
`python -m tests.test_pinned --spread` (about 5 minutes) to measure the spreads again.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import CONFIGS, run_cli

#: pinned per-step values: CI runs these under ATEN_CPU_CAPABILITY=default and avx2 too (.ci/run)
pytestmark = pytest.mark.floats

FIT3 = ["--trainer.max_steps=3", "--trainer.max_epochs=-1", "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0",
        "--test_after_fit=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def _only(root: Path, name: str) -> Path:
    files = sorted(root.rglob(name))
    assert len(files) == 1, files
    return files[0]


def _column(path: Path, key: str, n: int = 3) -> list[float]:
    with open(path) as f:
        return [float(r[key]) for r in csv.DictReader(f) if r.get(key) not in ("", None)][:n]


def _train_losses(root: Path) -> list[float]:
    path = _only(root, "metrics.csv")
    header = path.read_text().splitlines()[0].split(",")
    return _column(path, "train/loss_step" if "train/loss_step" in header else "train/loss")


def _fit(config: str, *extra: str) -> Callable[[Path], list[float]]:
    def run(root: Path) -> list[float]:
        assert run_cli("fit", "--config", CONFIGS / config, *FIT3, *extra, run_root=root) == 0
        return _train_losses(root)

    return run


def _glvq(root: Path) -> list[float]:
    assert run_cli("fit", "--config", CONFIGS / "glvq/mlp_digits_fp.yaml", *FIT3, "--run_id", "fp", run_root=root / "fp") == 0
    ckpt = _only(root / "fp", "last.ckpt")
    assert run_cli("test", "--config", CONFIGS / "glvq/mlp_digits_2bit.yaml", "--ckpt_path", ckpt,
                   "--trainer.callbacks.init_args.calib_batches=2", "--trainer.callbacks.init_args.steps=20",
                   "--trainer.enable_progress_bar=false", run_root=root / "q") == 0
    quant = _only(root / "q", "quantization.csv")
    return _column(quant, "rel_error", 2) + _column(_only(root / "q", "metrics.csv"), "test/acc", 1)


def _reservoir(root: Path) -> list[float]:
    assert run_cli("fit", "--config", CONFIGS / "reservoir_tta/source_cnn_digits.yaml", *FIT3, run_root=root / "src") == 0
    ckpt = _only(root / "src", "last.ckpt")
    assert run_cli("test", "--config", CONFIGS / "reservoir_tta/csc_digits.yaml", f"--model.init_args.source_ckpt={ckpt}",
                   "--model.init_args.method.init_args.n_source_styles=20", "--data.init_args.recurrences=1",
                   "--trainer.limit_test_batches=3", "--trainer.enable_progress_bar=false", run_root=root / "tta") == 0
    # the mean prediction entropy after adaptation: continuous (a batch error rate moves in steps of 1/64 when
    # one borderline prediction flips between CPU instruction sets)
    return _column(_only(root / "tta", "tta_batches.csv"), "entropy")


def _trust(root: Path) -> list[float]:
    assert run_cli("fit", "--config", CONFIGS / "trust/source_vmamba_digits.yaml", *FIT3, run_root=root / "src") == 0
    ckpt = _only(root / "src", "last.ckpt")
    assert run_cli("test", "--config", CONFIGS / "trust/digits_c_trust.yaml", f"--model.init_args.source_ckpt={ckpt}",
                   "--data.init_args.batches_per_visit=1", "--trainer.enable_progress_bar=false", run_root=root / "tta") == 0
    return _column(_only(root / "tta", "tta_batches.csv"), "entropy")  # post-adaptation entropy, one per corruption


def _gaze(root: Path) -> list[float]:
    small = ["--data.init_args.train_size=96", "--data.init_args.val_size=32", "--data.init_args.test_size=32",
             "--data.init_args.batch_size=32"]
    assert run_cli("fit", "--config", CONFIGS / "gaze_3dpe/param_encoder_prior.yaml", *FIT3, *small, run_root=root / "enc") == 0
    ckpt = _only(root / "enc", "last.ckpt")
    assert run_cli("fit", "--config", CONFIGS / "gaze_3dpe/full.yaml", *FIT3, *small, f"--model.init_args.encoder_ckpt={ckpt}",
                   "--model.init_args.stage1_epochs=0", run_root=root / "gaze") == 0  # all three losses from step 1
    return _train_losses(root / "gaze")


def _safe_meta(root: Path) -> list[float]:
    assert run_cli("fit", "--config", CONFIGS / "safe_meta_rl/gridnav_safe.yaml", *FIT3, run_root=root) == 0
    return _column(_only(root, "metrics.csv"), "train/adapted_J_r")  # mean J_r after the safe step, per meta-step


def _lrc(root: Path) -> list[float]:
    assert run_cli("fit", "--config", CONFIGS / "lowrank_rnn_cl/what_how.yaml", *FIT3, "--data.init_args.batch_size=8",
                   "--model.init_args.what_trials=12", run_root=root) == 0
    return _train_losses(root)


def _shallow(root: Path) -> list[float]:
    assert run_cli("test", "--config", CONFIGS / "shallow_diffuse/molrg_shallow_diffuse.yaml", "--data.init_args.n=3",
                   "--model.init_args.attacks=[clean]", "--model.init_args.rank_ts=[300]", "--trainer.enable_progress_bar=false",
                   run_root=root) == 0
    return _column(_only(root, "watermark_scores.csv"), "score_marked")  # detection scores of the watermarked images


def _pinv(root: Path) -> list[float]:
    assert run_cli("test", "--config", CONFIGS / "pinv_bounds/synthetic_spectra.yaml", "--data.init_args.draws=1",
                   "--data.init_args.n_synthetic=50", "--model.init_args.plot=false", run_root=root) == 0
    return _column(_only(root, "pinv_bounds.csv"), "error")


#: slug -> (what it runs, the first three values it logs under seed 0, their measured relative spread)
PINNED: dict[str, tuple[Callable[[Path], list[float]], list[float], list[float]]] = {
    "baseline": (_fit("baseline/mlp_digits.yaml"), [2.312239646911621, 2.2648181915283203, 2.249929666519165],
                [0.0e+00, 0.0e+00, 0.0e+00]),
    "q3r": (_fit("q3r/mlp_digits.yaml"), [2.297163963317871, 2.275824546813965, 2.2768232822418213],
           [0.0e+00, 0.0e+00, 2.1e-07]),
    "strank": (_fit("strank/synthetic_imbalanced.yaml"), [27.964527130126953, 29.970651626586914, 33.225311279296875],
              [0.0e+00, 0.0e+00, 0.0e+00]),
    "nanoadam": (_fit("nanoadam/digits_finetune.yaml"), [1.9976024627685547, 1.8209714889526367, 1.530207872390747],
                [2.4e-04, 3.8e-03, 2.1e-03]),
    "is_lowrank": (_fit("is_lowrank/char_lm.yaml"), [4.8457207679748535, 4.631700038909912, 4.440855979919434],
                  [0.0e+00, 1.0e-07, 1.1e-07]),
    "glvq": (_glvq, [0.09417196264370405, 0.08925964040513432, 0.30444443225860596],
            [1.4e-08, 1.2e-08, 0.0e+00]),
    "reservoir_tta": (_reservoir, [2.294715166091919, 2.294339895248413, 2.294147253036499],
                     [1.0e-07, 3.1e-07, 3.1e-07]),
    "pt_moe": (_fit("pt_moe/templated_ptmoe.yaml"), [0.6931473016738892, 0.6936666965484619, 0.6939730644226074],
              [0.0e+00, 0.0e+00, 0.0e+00]),
    "capt": (_fit("capt/templated_capt.yaml"), [0.6931473016738892, 0.7058457732200623, 0.693983793258667],
            [0.0e+00, 8.4e-08, 8.6e-08]),
    "lope": (_fit("lope/lope.yaml"), [0.6931473016738892, 0.6915919780731201, 0.696110725402832],
            [0.0e+00, 0.0e+00, 8.6e-08]),
    "bayes_prefix": (_fit("bayes_prefix/pretrain_transformer.yaml"), [68.13843536376953, 64.33966064453125, 63.65904998779297],
                    [0.0e+00, 1.2e-07, 0.0e+00]),
    "icl_rank_retriever": (_fit("icl_rank_retriever/synthetic_hybrid.yaml"), [5.87391996383667, 5.630967140197754, 5.524951457977295],
                          [8.1e-08, 8.5e-08, 1.7e-07]),
    "masked_block_icl": (_fit("masked_block_icl/unconstrained.yaml"), [0.19583538174629211, 0.1905636042356491, 0.16884338855743408],
                        [7.6e-08, 7.8e-08, 8.8e-08]),
    "skrull": (_fit("skrull/sft_skrull.yaml", "--data.init_args.num_sequences=96"), [4.998631000518799, 4.6427154541015625, 4.273272514343262],
              [0.0e+00, 2.1e-07, 0.0e+00]),
    "gaze_3dpe": (_gaze, [3.3849081993103027, 3.7540431022644043, 3.181880474090576],
                 [9.8e-06, 3.2e-04, 2.3e-04]),
    "lowrank_rnn_cl": (_lrc, [0.7113839983940125, 0.6504708528518677, 0.494893342256546],
                      [8.4e-08, 0.0e+00, 6.0e-08]),
    "safe_meta_rl": (_safe_meta, [0.19899842143058777, 0.3053411841392517, 0.3575310707092285],
                    [0.0e+00, 0.0e+00, 0.0e+00]),
    "shallow_diffuse": (_shallow, [-17.882242553018266, -17.87409397155512, -17.92883842804052],
                       [1.3e-08, 1.5e-08, 7.9e-08]),
    "trust": (_trust, [2.260313034057617, 2.2700436115264893, 2.2647626399993896],
             [1.1e-07, 0.0e+00, 0.0e+00]),
    "pinv_bounds": (_pinv, [9.53239879025452, 3.793205535615428, 0.5225886098541057],
                   [2.0e-12, 2.9e-11, 4.9e-11]),
}


@pytest.mark.e2e
def test_every_method_has_pinned_values():
    from lowrank_lit import registry

    assert sorted(PINNED) == sorted(m.slug for m in registry.scan_methods())


#: the tolerance of a value: SPREAD_FACTOR times its measured spread, at least RTOL_FLOOR
SPREAD_FACTOR = 3.0
RTOL_FLOOR = 1e-5


def tolerances(spread: list[float]) -> list[float]:
    return [max(RTOL_FLOOR, SPREAD_FACTOR * s) for s in spread]


@pytest.mark.e2e
@pytest.mark.parametrize("slug", sorted(PINNED))
def test_first_logged_values_are_pinned(slug, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run, expected, spread = PINNED[slug]
    got = run(tmp_path / "runs")
    assert len(got) == 3 and all(math.isfinite(v) for v in got), got
    for i, (g, e, rtol) in enumerate(zip(got, expected, tolerances(spread), strict=True)):
        assert g == pytest.approx(e, rel=rtol), f"{slug}[{i}]: {got} vs {expected} (rtol {rtol:.1e})"


@pytest.mark.e2e
def test_tolerances_stay_tight():
    """A tolerance wide enough to hide a real change is a pin that pins nothing."""
    for slug, (_, _, spread) in PINNED.items():
        assert len(spread) == 3 and max(tolerances(spread)) <= 2e-2, slug


#: the conditions the spreads are measured under (environment of a fresh process)
SPREAD_CONDITIONS: dict[str, dict[str, str]] = {
    "native, 2 threads": {"OMP_NUM_THREADS": "2"},
    "native, 1 thread": {"OMP_NUM_THREADS": "1"},
    "default, 2 threads": {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "2"},
    "default, 1 thread": {"ATEN_CPU_CAPABILITY": "default", "OMP_NUM_THREADS": "1"},
    "avx2, 2 threads": {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "2"},
    "avx2, 1 thread": {"ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"},
    "avx512, 2 threads": {"ATEN_CPU_CAPABILITY": "avx512", "OMP_NUM_THREADS": "2"},
    "default + MKL/oneDNN SSE4, 2 threads": {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                                             "ONEDNN_MAX_CPU_ISA": "SSE41", "OMP_NUM_THREADS": "2"},
    "avx2 + MKL/oneDNN AVX2, 1 thread": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                                         "ONEDNN_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1"},
}


def _measure_spread() -> None:
    """Run every pinned config under each of SPREAD_CONDITIONS in a fresh process; print the spreads to paste."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, env in SPREAD_CONDITIONS.items():
            out = Path(tmp) / "values.json"
            subprocess.run([sys.executable, "-m", "tests.test_pinned", str(out)], check=True, capture_output=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", **env})
            results[name] = json.loads(out.read_text())
            print(f"measured: {name}", flush=True)
    for slug, (_, pinned, _) in sorted(PINNED.items()):
        spread = [max(abs(r[slug][i] - pinned[i]) for r in results.values()) / abs(pinned[i]) for i in range(3)]
        print(f'"{slug}": [{", ".join(f"{s:.1e}" for s in spread)}]')


if __name__ == "__main__":  # print the values to pin (and write them as JSON when a path is given)
    import json
    import sys
    import tempfile

    if sys.argv[1:] == ["--spread"]:
        _measure_spread()
        sys.exit(0)
    measured = {}
    for slug, (run, _, _) in sorted(PINNED.items()):
        with tempfile.TemporaryDirectory() as tmp:
            measured[slug] = run(Path(tmp) / "runs")
            print(f'"{slug}": {measured[slug]},', flush=True)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(measured, indent=1))
