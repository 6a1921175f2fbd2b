"""3DPE-Gaze (paper 10): the gaze module's variants and stages, the predictor's heads, real-data loading, every
config end to end, the summary, and the cross-domain reproduction (slow). The renderer and the losses are tested
in tests/methods/gaze_3dpe/test_heads.py and tests/methods/gaze_3dpe/test_components.py."""

from __future__ import annotations

import csv
import math

import pytest
import torch

from lowrank_lit.methods.gaze_3dpe import ConceptBank, FacePriorGazePredictor, ParamEncoder, ThreeDPEGaze

VARIANTS = ("cnn", "finetune", "3dgp", "3dgp_repel", "3dgp_align", "full")


def _encoder_ckpt(tmp_path) -> str:
    """A ParamEncoderModule checkpoint from a one-batch prior-domain run."""
    from tests.helpers import CONFIGS, run_cli

    assert run_cli("fit", "--config", CONFIGS / "gaze_3dpe" / "param_encoder_prior.yaml", "--trainer.max_epochs=1",
                   "--data.init_args.train_size=64", "--data.init_args.val_size=32", "--data.init_args.test_size=32",
                   "--data.init_args.batch_size=32", "--trainer.enable_progress_bar=false", run_root=tmp_path / "enc") == 0
    return str(tmp_path / "enc" / "gaze_3dpe" / "param_encoder_prior" / "seed0" / "checkpoints" / "last.ckpt")


def test_single_head_predictor_is_the_written_formula():
    torch.manual_seed(0)
    pred = FacePriorGazePredictor(16, 21, 8, heads=1)
    gamma, K = torch.randn(4, 16), torch.randn(4, 21, 3)
    q, k, v = pred.q(gamma), pred.k(K), pred.v(K)  # (4, 8), (4, 21, 8), (4, 21, 8)
    att = torch.softmax(torch.einsum("bd,bnd->bn", q, k) / math.sqrt(8), dim=1)
    want = torch.nn.functional.normalize(pred.out(torch.einsum("bn,bnd->bd", att, v)), dim=1)
    torch.testing.assert_close(pred(gamma, K), want)
    # heads split d: each head attends on its own slice
    pred4 = FacePriorGazePredictor(16, 21, 8, heads=4)
    q, k, v = pred4.q(gamma).view(4, 4, 2), pred4.k(K).view(4, 21, 4, 2), pred4.v(K).view(4, 21, 4, 2)
    att = torch.softmax(torch.einsum("bhd,bnhd->bhn", q, k) / math.sqrt(2), dim=2)
    f = torch.einsum("bhn,bnhd->bhd", att, v).reshape(4, 8)
    torch.testing.assert_close(pred4(gamma, K), torch.nn.functional.normalize(pred4.out(f), dim=1))
    with pytest.raises(ValueError, match="heads=3"):
        FacePriorGazePredictor(16, 21, 8, heads=3)


#: the smallest difference in mean angular error that matters to the cross-domain claims, in degrees
ANGLE_DELTA = 0.5

@pytest.mark.e2e
def test_variants_train_the_declared_parts(tmp_path):
    """cnn: every weight re-initialised; finetune: starts from the prior and changes it; 3DGP variants: encoder
    frozen in eval mode, only gamma / predictor / projection train; the concept losses join after stage 1."""
    torch.manual_seed(0)
    ckpt = _encoder_ckpt(tmp_path)
    prior = ParamEncoder(32)
    from lowrank_lit.methods.gaze_3dpe import _load_encoder

    _load_encoder(prior, ckpt)
    from lowrank_lit.data.heads import SyntheticHeadDataModule

    batch = next(iter(SyntheticHeadDataModule(batch_size=16, seed=0).train_dataloader()))
    bank = ConceptBank("random")
    for variant in VARIANTS:
        m = ThreeDPEGaze(ParamEncoder(32), ckpt, variant=variant, concepts=bank if variant.startswith("3dgp_") or variant == "full" else None)
        ref = prior.state_dict()
        same = {k: torch.equal(v, ref[k]) for k, v in m.encoder.state_dict().items()}
        if variant == "cnn":
            assert not same["features.0.weight"] and not same["head.1.weight"]  # re-initialised
        else:
            assert all(same.values())
        m.train()
        assert m.encoder.training == (variant in ("cnn", "finetune"))
        opt = m.configure_optimizers()
        before = {k: v.clone() for k, v in m.state_dict().items()}
        loss = m.training_step(batch, 0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        changed = {k for k, v in m.state_dict().items() if not torch.equal(v, before[k])}
        enc_changed = any(k.startswith("encoder.") for k in changed)
        assert enc_changed == (variant in ("cnn", "finetune")), variant
        if variant not in ("cnn", "finetune"):
            assert any(k.startswith("gamma_mlp.") for k in changed) and any(k.startswith("predictor.") for k in changed)
            # stage 1: L_angle only, the projection gets no gradient
            assert not any(k.startswith("proj.") for k in changed)


@pytest.mark.e2e
def test_stage_two_adds_the_concept_losses(tmp_path):
    from tests.helpers import CONFIGS, run_cli

    ckpt = _encoder_ckpt(tmp_path)
    for variant, parts in (("3dgp", set()), ("3dgp_align", {"train/align_loss"}), ("3dgp_repel", {"train/repel_loss"}),
                           ("full", {"train/align_loss", "train/repel_loss"})):
        assert run_cli("fit", "--config", CONFIGS / "gaze_3dpe" / f"{variant}.yaml", f"--model.init_args.encoder_ckpt={ckpt}",
                       "--trainer.max_epochs=2", "--trainer.log_every_n_steps=1", "--data.init_args.train_size=64",
                       "--data.init_args.val_size=32", "--data.init_args.test_size=32", "--data.init_args.batch_size=32",
                       "--run_id=smoke", "--trainer.enable_progress_bar=false", run_root=tmp_path / "runs") == 0
        run = tmp_path / "runs" / "gaze_3dpe" / variant / "smoke"
        with open(run / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("train/angle_loss")]
        for r in rows:
            logged = {k for k in ("train/align_loss", "train/repel_loss") if r.get(k)}
            assert logged == (parts if int(r["epoch"]) >= 1 else set()), (variant, r["epoch"], logged)
        with open(run / "metrics.csv") as f:
            header = next(csv.reader(f))
        assert {"test/angle_deg", "test/target_light/angle_deg", "test/target_glasses/glasses_on",
                "test/target_light/iod_err_low", "test/target_light/yaw_large"} <= set(header)
        assert (run / "gaze_grid.png").is_file()


@pytest.mark.e2e
@pytest.mark.parametrize("variant", ["cnn", "finetune"])
def test_baseline_configs_run(variant, tmp_path):
    from lowrank_lit.report import last_values
    from tests.helpers import CONFIGS, run_cli

    extra = [] if variant == "cnn" else [f"--model.init_args.encoder_ckpt={_encoder_ckpt(tmp_path)}"]
    assert run_cli("fit", "--config", CONFIGS / "gaze_3dpe" / f"{variant}.yaml", *extra, "--trainer.max_epochs=1",
                   "--data.init_args.train_size=64", "--data.init_args.val_size=32", "--data.init_args.test_size=32",
                   "--data.init_args.batch_size=32", "--run_id=smoke", "--trainer.enable_progress_bar=false",
                   run_root=tmp_path / "runs") == 0
    vals = last_values(tmp_path / "runs" / "gaze_3dpe" / variant / "smoke" / "metrics.csv")
    assert 0 < vals["test/angle_deg"] < 180
    assert "test/target_light/iod_err_low" not in vals  # no face prior, no IOD estimate


@pytest.mark.e2e
def test_summary_reads_the_runs(tmp_path):
    from lowrank_lit.launch.summarize import get_summary
    from tests.helpers import CONFIGS, run_cli

    ckpt = _encoder_ckpt(tmp_path)
    for variant in ("cnn", "full"):
        for seed in (0, 1):
            assert run_cli("fit", "--config", CONFIGS / "gaze_3dpe" / "full.yaml", f"--model.init_args.encoder_ckpt={ckpt}",
                           f"--model.init_args.variant={variant}", f"--seed_everything={seed}", "--trainer.max_epochs=1",
                           "--data.init_args.train_size=32", "--data.init_args.val_size=32", "--data.init_args.test_size=32",
                           "--data.init_args.batch_size=32", f"--run_id={variant}{seed}", "--trainer.enable_progress_bar=false",
                           run_root=tmp_path / "runs") == 0
    text = get_summary("gaze_3dpe").fn([str(tmp_path / "runs" / "gaze_3dpe")], out=str(tmp_path / "bars.png"))
    lines = [ln for ln in text.splitlines() if ln.startswith("| cnn") or ln.startswith("| full")]
    assert len(lines) == 6 and all("| 2 |" in ln for ln in lines[:2])
    assert (tmp_path / "bars.png").is_file()


def test_real_data_module_reads_a_csv_folder(tmp_path):
    from PIL import Image

    from lowrank_lit.data.gaze_folder import GazeCSVDataset, GazeFolderDataModule

    for i in range(4):
        Image.fromarray((torch.rand(40, 30, 3) * 255).byte().numpy()).save(tmp_path / f"f{i}.png")
    with open(tmp_path / "a.csv", "w") as f:
        f.write("path,pitch,yaw,glasses\n" + "".join(f"f{i}.png,0.1,{-0.2 * i},{i % 2}\n" for i in range(4)))
    with open(tmp_path / "b.csv", "w") as f:
        f.write("path,gx,gy,gz\n" + "".join(f"f{i}.png,0,0,{i + 1}\n" for i in range(4)))
    dm = GazeFolderDataModule(str(tmp_path), str(tmp_path / "a.csv"), str(tmp_path / "a.csv"), {"b": str(tmp_path / "b.csv")},
                              image_size=64, batch_size=4, num_workers=0)
    b = next(iter(dm.val_dataloader()))
    assert b["image"].shape == (4, 3, 64, 64) and torch.allclose(b["gaze"].norm(dim=1), torch.ones(4))
    assert b["glasses"].tolist() == [0, 1, 0, 1]
    tb = next(iter(dm.test_dataloader()[0]))
    torch.testing.assert_close(tb["gaze"], torch.tensor([[0.0, 0, 1]] * 4))
    assert tb["glasses"].tolist() == [-1] * 4
    # the module's test metrics work without the synthetic parameters
    m = ThreeDPEGaze(ParamEncoder(8), variant="cnn", test_domains=["b"])
    m.on_test_epoch_start()
    m.test_step(tb, 0)
    assert set(m._slices[0][0]) == {"err", "glasses"}
    with open(tmp_path / "bad.csv", "w") as f:
        f.write("path,x\nf0.png,1\n")
    with pytest.raises(ValueError, match="needed: path and gx, gy, gz"):
        GazeCSVDataset(str(tmp_path / "bad.csv"), str(tmp_path))
    with open(tmp_path / "zero.csv", "w") as f:
        f.write("path,gx,gy,gz\nf0.png,0,0,0\n")
    with pytest.raises(ValueError, match="zero-norm gaze"):
        GazeCSVDataset(str(tmp_path / "zero.csv"), str(tmp_path))[0]


def test_bad_inputs_name_the_argument(tmp_path):
    enc = ParamEncoder(8)
    with pytest.raises(ValueError, match="variant='resnet'.*allowed: cnn, finetune"):
        ThreeDPEGaze(enc, variant="resnet")
    with pytest.raises(ValueError, match="tau=0"):
        ThreeDPEGaze(enc, variant="3dgp", tau=0)
    with pytest.raises(ValueError, match="margin=1.5"):
        ThreeDPEGaze(enc, variant="3dgp", margin=1.5)
    with pytest.raises(FileNotFoundError, match="param_encoder_prior.yaml"):
        ThreeDPEGaze(enc, encoder_ckpt=str(tmp_path / "none.ckpt"))
    with pytest.raises(ValueError, match="allowed: \\(B, 3 or 1, H, W\\)"):
        enc(torch.zeros(2, 4, 64, 64))
    with pytest.raises(ValueError, match="non-finite"):
        enc(torch.full((1, 3, 64, 64), float("nan")))


# -- must show (card section 4) -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cross_domain_runs(tmp_path_factory):
    """The bounded attempt's setting over seeds 0-2 at the configs' budget (8192 source images, 5 epochs): the prior
    encoder trained until its held-out landmark error stops improving (param_encoder_prior_plateau.yaml) and the
    repulsion margin at the 0.7-quantile of the first SCAM batch's similarities; CNN (which does not use the prior),
    3DGP-only and full. The mean target error of each run."""
    from lowrank_lit.report import last_values
    from tests.helpers import CONFIGS, run_cli

    tmp = tmp_path_factory.mktemp("gaze")
    assert run_cli("fit", "--config", CONFIGS / "gaze_3dpe" / "param_encoder_prior_plateau.yaml", "--test_after_fit=false",
                   "--trainer.enable_progress_bar=false", run_root=tmp) == 0
    ckpt = tmp / "gaze_3dpe" / "param_encoder_prior_plateau" / "seed0" / "checkpoints" / "best.ckpt"
    err: dict[str, list[float]] = {}
    for seed in range(3):
        for variant in ("cnn", "3dgp", "full"):
            assert run_cli("fit", "--config", CONFIGS / "gaze_3dpe" / f"{variant}.yaml", f"--seed_everything={seed}",
                           f"--model.init_args.encoder_ckpt={ckpt}", "--model.init_args.margin_quantile=0.7",
                           f"--run_id=seed{seed}", "--trainer.enable_progress_bar=false", run_root=tmp) == 0
            vals = last_values(tmp / "gaze_3dpe" / variant / f"seed{seed}" / "metrics.csv")
            err.setdefault(variant, []).append(vals["test/angle_deg"])
    print(err)
    return err


@pytest.mark.slow
def test_must_show_cross_domain(cross_domain_runs):
    """The claim full < 3DGP-only < CNN (mean angular error over the two target domains), each step judged by the
    verdict rule over seeds 0-2. 3DGP-only below CNN holds at 2 threads (+1.31 degrees, 95 % interval [+0.08, +2.54])
    and is a tie at one thread (+0.11, [-0.01, +0.23]): the prior trained to its plateau differs with the thread
    count, and 3DGP-only with it (CNN, which does not use the prior, is the same to two decimals): its 90 % interval
    [+0.03, +0.19] lies within the 0.5 degrees that matter, so equivalent there; either accepted. Full below 3DGP-only
    is inconclusive in both (+0.95, [-0.41, +2.31]; +0.65, [-1.83, +3.13])."""
    from lowrank_lit.stats import expect_verdict

    err = cross_domain_runs  # lower is better: the difference is theirs - ours
    expect_verdict(("equivalent", "holds"), err["cnn"], err["3dgp"], delta=ANGLE_DELTA,
                   claim="3DGP-only below CNN (target error)")
    expect_verdict("inconclusive", err["3dgp"], err["full"], delta=ANGLE_DELTA, claim="full below 3DGP-only (target error)")
