"""Checkpoints are read without running code, broken ones are one line, and writes are atomic in place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lowrank_lit.checkpoint import CheckpointError, check_readable, checkpoint_step, load_checkpoint
from tests.helpers import MLP_CONFIG, run_cli

SMALL = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=3", "--trainer.limit_val_batches=1",
         "--test_after_fit=false", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


class _Payload:
    """Unpickling this calls ``os.system`` (what a malicious checkpoint does)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _malicious(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "x": _Payload(marker)}, path)
    return path, marker


def test_load_checkpoint_runs_no_code(tmp_path):
    path, marker = _malicious(tmp_path)
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        load_checkpoint(path, "model.init_args.pretrained")
    assert not marker.exists()


def test_method_loaders_run_no_code(tmp_path):
    """The two method arguments that read a checkpoint: Bayes prefix's ``pretrained`` and the ICL retriever's
    ``init_checkpoint``."""
    from lowrank_lit.methods.bayes_prefix import _load_predictor
    from lowrank_lit.methods.icl_rank_retriever import ICLRetrieverModule

    path, marker = _malicious(tmp_path)

    class _Predictor(torch.nn.Module):
        torso_kind = "lstm"

    with pytest.raises(CheckpointError, match="pretrained"):
        _load_predictor(_Predictor(), str(path), False, "PrefixTuningModule")
    with pytest.raises(CheckpointError, match="init_checkpoint"):
        ICLRetrieverModule.load_towers(object.__new__(ICLRetrieverModule), str(path))
    assert not marker.exists()


@pytest.mark.parametrize("size", [0, 100])
def test_truncated_checkpoint_is_one_line_naming_the_previous_good_one(tmp_path, size):
    good = tmp_path / "checkpoints" / "best.ckpt"
    good.parent.mkdir()
    torch.save({"global_step": 7}, good)
    bad = good.parent / "last.ckpt"
    bad.write_bytes(good.read_bytes()[:size])
    with pytest.raises(CheckpointError) as info:
        check_readable(bad, "--ckpt_path")
    msg = str(info.value)
    assert "\n" not in msg and str(bad) in msg and str(good) in msg
    assert ("empty" if size == 0 else "truncated") in msg
    assert checkpoint_step(good) == 7 and checkpoint_step(bad) == -1


@pytest.mark.e2e
def test_resuming_a_truncated_last_ckpt_is_one_line_and_touches_nothing(run_root, capsys):
    assert run_cli("fit", "--config", MLP_CONFIG, *SMALL, run_root=run_root) == 0
    run = next((run_root / "baseline" / "mlp_digits").iterdir())
    last = run / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:1000])
    before = {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert run_cli("fit", "--config", MLP_CONFIG, *SMALL, "--run_id", run.name, "--ckpt_path", "last", run_root=run_root) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(last) in err and "truncated" in err
    assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


@pytest.mark.e2e
def test_refused_reentry_touches_nothing(run_root, capsys):
    """Re-entering a run with checkpoints but without --ckpt_path is refused; its metrics.csv stays where it is."""
    assert run_cli("fit", "--config", MLP_CONFIG, *SMALL, run_root=run_root) == 0
    run = next((run_root / "baseline" / "mlp_digits").iterdir())
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    assert "metrics.csv" in before
    assert run_cli("fit", "--config", MLP_CONFIG, *SMALL, "--run_id", run.name, run_root=run_root) == 2
    assert "--ckpt_path last" in capsys.readouterr().err
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before


@pytest.mark.e2e
def test_last_ckpt_is_written_beside_itself_and_renamed(run_root, monkeypatch):
    """The temporary file lives in the checkpoint's own folder (a rename there is atomic), never in $TMPDIR,
    and a failed save leaves the previous last.ckpt intact."""
    import lightning.pytorch as pl

    assert run_cli("fit", "--config", MLP_CONFIG, *SMALL, run_root=run_root) == 0
    run = next((run_root / "baseline" / "mlp_digits").iterdir())
    last = run / "checkpoints" / "last.ckpt"
    good = last.read_bytes()
    written: list[str] = []
    real_replace = os.replace

    def spy(src, dst):
        written.append(str(src))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    assert run_cli("fit", "--config", MLP_CONFIG, *SMALL, "--trainer.max_epochs=2", "--run_id", run.name,
                   "--ckpt_path", "last", run_root=run_root) == 0
    assert written and all(Path(w).parent == last.parent for w in written)

    def broken_save(self, filepath, weights_only=False, storage_options=None):
        Path(filepath).write_bytes(b"partial")
        raise OSError("No space left on device")

    monkeypatch.setattr(pl.Trainer, "save_checkpoint", broken_save)
    good = last.read_bytes()
    with pytest.raises(OSError, match="No space"):
        run_cli("fit", "--config", MLP_CONFIG, *SMALL, "--trainer.max_epochs=3", "--run_id", run.name,
                "--ckpt_path", "last", run_root=run_root)
    assert last.read_bytes() == good
    check_readable(last)
