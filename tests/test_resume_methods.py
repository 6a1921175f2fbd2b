"""Every method that trains resumes exactly: one config of each, interrupted in the middle of an epoch.

Each config runs a few batches twice through the real CLI (in this process): once uninterrupted, once
stopped by SIGTERM in the middle of its second epoch (the stop is taken at the next batch boundary and
``last.ckpt`` written) and then resumed with ``--run_id <id> --ckpt_path last``. The final weights
must be bit-identical: every stateful loader, rollout generator and sampler travels in the checkpoint.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback

from tests.helpers import CONFIGS, run_cli, run_dirs

#: slug -> config that trains it, extra flags keeping the run small (a few batches per epoch)
TRAINING_CONFIGS: dict[str, tuple[str, list[str]]] = {
    "baseline": ("baseline/mlp_digits.yaml", []),
    "q3r": ("q3r/mlp_digits.yaml", []),
    "strank": ("strank/synthetic_imbalanced.yaml", []),
    "nanoadam": ("nanoadam/digits_finetune.yaml", []),
    "is_lowrank": ("is_lowrank/char_lm.yaml", []),
    "glvq": ("glvq/mlp_digits_fp.yaml", []),
    "reservoir_tta": ("reservoir_tta/source_cnn_digits.yaml", []),
    "pt_moe": ("pt_moe/templated_ptmoe.yaml", []),
    "capt": ("capt/templated_capt.yaml", []),
    "lope": ("lope/lope.yaml", []),
    "bayes_prefix": ("bayes_prefix/pretrain_transformer.yaml", []),
    "icl_rank_retriever": ("icl_rank_retriever/synthetic_hybrid.yaml", []),
    "masked_block_icl": ("masked_block_icl/unconstrained.yaml", []),
    "skrull": ("skrull/sft_skrull.yaml", ["--data.init_args.num_sequences=96"]),
    "gaze_3dpe": ("gaze_3dpe/cnn.yaml", ["--data.init_args.train_size=192", "--data.init_args.val_size=32",
                                         "--data.init_args.test_size=32", "--data.init_args.batch_size=32"]),
    "lowrank_rnn_cl": ("lowrank_rnn_cl/what_how.yaml", ["--data.init_args.batch_size=8", "--model.init_args.what_trials=12"]),
    "safe_meta_rl": ("safe_meta_rl/gridnav_safe.yaml", []),
    "safe_meta_rl_neural": ("safe_meta_rl/pointnav_safe.yaml", []),
    "shallow_diffuse": ("shallow_diffuse/unet_digits_train.yaml", []),
    "trust": ("trust/source_vmamba_digits.yaml", []),
}
#: registered methods that train nothing (evaluation or analysis only)
EVALUATION_ONLY = {"pinv_bounds"}

BATCHES = 4  # per epoch
SMALL = [f"--trainer.limit_train_batches={BATCHES}", "--trainer.max_epochs=2", "--trainer.max_steps=-1",
         "--trainer.limit_val_batches=0", "--test_after_fit=false", "--trainer.enable_progress_bar=false",
         "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1"]


class SignalAtBatch(Callback):
    """Send SIGTERM to this process after the ``at``-th training batch (counted over the run, 1-based)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def _fragment(tmp_path: Path) -> Path:
    frag = tmp_path / "signal.yaml"
    frag.write_text("trainer:\n  callbacks+:\n    - class_path: tests.test_resume_methods.SignalAtBatch\n"
                    f"      init_args:\n        at: {BATCHES + 1}\n")
    return frag


def _last(root: Path) -> dict[str, Any]:
    runs = run_dirs(root)
    assert len(runs) == 1, runs
    return torch.load(runs[0] / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)


def test_every_training_method_has_a_resume_config():
    from lowrank_lit import registry

    slugs = {m.slug for m in registry.scan_methods()}
    covered = {k.split("_neural")[0] for k in TRAINING_CONFIGS} | EVALUATION_ONLY
    assert covered == slugs


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(TRAINING_CONFIGS))
def test_interrupted_mid_epoch_resumes_bit_identical(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config, extra = TRAINING_CONFIGS[name]
    args = ["fit", "--config", CONFIGS / config, *SMALL, *extra]
    assert run_cli(*args, run_root=tmp_path / "full") == 0
    reference = _last(tmp_path / "full")
    assert run_cli(*args, "--config", _fragment(tmp_path), run_root=tmp_path / "part") == 128 + signal.SIGTERM
    stopped = _last(tmp_path / "part")
    assert stopped["epoch"] == 1 and 0 < stopped["global_step"] < reference["global_step"], (stopped["epoch"], stopped["global_step"])
    run = run_dirs(tmp_path / "part")[0]
    # the command the interruption prints: the same config (its stop callback included), the run id, --ckpt_path last
    assert run_cli(*args, "--config", _fragment(tmp_path), "--run_id", run.name, "--ckpt_path", "last",
                   run_root=tmp_path / "part") == 0
    resumed = _last(tmp_path / "part")
    assert resumed["global_step"] == reference["global_step"]
    assert set(resumed["state_dict"]) == set(reference["state_dict"])
    differ = [k for k, v in reference["state_dict"].items() if not torch.equal(resumed["state_dict"][k], v)]
    assert not differ, f"{len(differ)} of {len(reference['state_dict'])} tensors differ, e.g. {differ[:3]}"
