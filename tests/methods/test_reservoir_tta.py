"""ReservoirTTA (paper 11) and the TTA base methods: the card's properties, data, CLI smoke and must-show."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import nn

from lowrank_lit.data.corruptions import CORRUPTIONS, corrupt, corruption_stream
from lowrank_lit.methods.reservoir_tta import ReservoirTTA, StyleExtractor
from lowrank_lit.models.cnn import GroupNormCNN
from lowrank_lit.tta import EATA, CoTTA, SourceOnly, Tent, entropy, purity
from lowrank_lit.tta.base import norm_affine_params as norm_params
from tests.helpers import quiet_trainer
from tests.tolerances import F32, F32_LAYERS, F32_NET

LAYERS = ["blocks.0.0", "blocks.1.0"]


def _model(seed=0):
    torch.manual_seed(seed)
    return GroupNormCNN(widths=[8, 8], groups=2)


def _batches(n, seed=0, shift=0.0, size=16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(size, 1, 8, 8, generator=g) + shift, torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


def _reservoir(base, n_styles=60, **kw):
    res = ReservoirTTA(base, LAYERS, n_source_styles=n_styles, **kw)
    res.setup(_model(), iter(_batches(n_styles + 20, seed=1)))
    return res


def _params(method):
    return [p.detach().clone() for p in method.params]


# -- card section 5 -----------------------------------------------------------------------------------

def test_1_single_model_reservoir_equals_the_base_method():
    tent = Tent(lr=1e-2)
    tent.setup(_model(), None)
    res = _reservoir(Tent(lr=1e-2), max_models=1, buffer_size=4)
    stream = _batches(4, seed=2) + _batches(4, seed=3, shift=3.0)
    for x, _ in stream:
        a = tent.forward_and_adapt(x)
        b = res.forward_and_adapt(x)
        torch.testing.assert_close(a, b, atol=F32, rtol=0)
        for p, q in zip(_params(tent), _params(res.method), strict=True):
            torch.testing.assert_close(p, q, atol=F32, rtol=0)
    assert res.num_models == 1


def test_2_only_the_routed_copy_changes():
    res = _reservoir(Tent(lr=1e-2), max_models=4)
    for x, _ in _batches(2, seed=5, shift=5.0):  # opens a second domain
        res.forward_and_adapt(x)
    assert res.num_models == 2
    before = copy.deepcopy(res.copies)
    x, _ = _batches(1, seed=6)[0]  # a source-like batch: routed to copy 0
    res.forward_and_adapt(x)
    k = res.last_cluster
    assert k == 0
    for j, (old, new) in enumerate(zip(before, res.copies, strict=True)):
        same = all(torch.equal(a, b) for a, b in zip(old["params"], new["params"], strict=True))
        same_opt = str(old["optim"]["state"]) == str(new["optim"]["state"])
        assert same == (j != k) and same_opt == (j != k), j


def test_3_ensemble_weights():
    res = _reservoir(Tent(lr=1e-2), max_models=4)
    for x, _ in _batches(2, seed=5, shift=5.0):
        res.forward_and_adapt(x)
    q = torch.tensor([0.25, 0.75])
    ens = res.ensemble(q)
    for i, v in enumerate(ens):
        torch.testing.assert_close(v, 0.25 * res.copies[0]["params"][i] + 0.75 * res.copies[1]["params"][i])
    for i, v in enumerate(res.ensemble(torch.tensor([0.0, 1.0]))):
        assert torch.equal(v, res.copies[1]["params"][i])
    x, _ = _batches(1, seed=9, shift=5.0)[0]
    res.forward_and_adapt(x)
    assert float(res.last_q.sum()) == pytest.approx(1.0)


def test_4_style_vector():
    ext = StyleExtractor(_model(), LAYERS)
    x = torch.rand(16, 1, 8, 8)
    s = ext(x)
    assert s.shape == (16,)  # 8 + 8 channels
    torch.testing.assert_close(ext(x[torch.randperm(16)]), s, atol=F32_LAYERS, rtol=0)
    assert torch.isfinite(ext(torch.ones(16, 1, 8, 8))).all()  # constant images: log(0 + eps)
    assert StyleExtractor(_model(), LAYERS, fmt="meanvar")(x).shape == (32,)
    with pytest.raises(RuntimeError, match="blocks.0.0"):
        ext(torch.full((16, 1, 8, 8), float("nan")))


def test_style_vector_is_the_log_of_torch_var_per_channel():
    model = _model()
    x = torch.rand(16, 1, 8, 8) * 3 + 1
    with torch.no_grad():
        f0 = model.blocks[0][0](x)  # (16, 8, 8, 8) conv outputs
        f1 = model.blocks[1][0](model.blocks[0][1:](f0))
    ref = torch.cat([torch.log(f.double().var(dim=(0, 2, 3)) + 1e-5) for f in (f0, f1)]).float()
    torch.testing.assert_close(StyleExtractor(model, LAYERS)(x), ref, atol=F32_LAYERS, rtol=0)
    meanvar = StyleExtractor(_model(), LAYERS, fmt="meanvar")(x)
    torch.testing.assert_close(meanvar[:8], f0.mean(dim=(0, 2, 3)), atol=F32_LAYERS, rtol=0)
    torch.testing.assert_close(StyleExtractor(_model(), LAYERS, fmt="var")(x)[:8], f0.var(dim=(0, 2, 3)), atol=F32_NET, rtol=F32_LAYERS)


def test_without_ensembling_the_routed_copy_predicts_before_its_step():
    res = _reservoir(Tent(lr=1e-2), max_models=4, ensembling=False)
    probe = _model()
    for x, _ in _batches(3, seed=5, shift=5.0) + _batches(2, seed=6):
        before = copy.deepcopy(res.copies)
        logits = res.forward_and_adapt(x)
        k = res.last_cluster
        old = before[k]["params"] if k < len(before) else None
        if old is None:  # a new domain: its copy started from the copy chosen by MI init
            continue
        with torch.no_grad():
            for p, v in zip(norm_params(probe), old, strict=True):
                p.copy_(v)
            torch.testing.assert_close(logits, probe(x), atol=F32, rtol=0)
        assert not all(torch.equal(a, b) for a, b in zip(old, res.copies[k]["params"], strict=True))  # then it adapted
    assert res.num_models == 2


def test_5_source_batches_rarely_open_a_cluster_and_a_shift_opens_one():
    res = _reservoir(SourceOnly(), n_styles=200, max_models=3)
    for x, _ in _batches(100, seed=11):
        res.forward_and_adapt(x)
    assert res.num_models <= 2  # <= 1 opened in 100 source batches
    opened = res.num_models
    for x, _ in _batches(5, seed=12, shift=10.0):
        res.forward_and_adapt(x)
    assert res.num_models == opened + 1
    for shift in (20.0, 30.0, 40.0):
        for x, _ in _batches(2, seed=13, shift=shift):
            res.forward_and_adapt(x)
    assert res.num_models == 3  # never above max_models


def test_6_a_returning_domain_routes_back_to_its_index():
    res = _reservoir(Tent(lr=1e-3), max_models=8)
    shifts = [0.0, 5.0, -3.0]
    clusters, domains = [], []
    for rep in range(3):
        for d, shift in enumerate(shifts):
            for x, _ in _batches(3, seed=100 * rep + d, shift=shift):
                res.forward_and_adapt(x)
                clusters.append(res.last_cluster)
                domains.append(d)
    assert purity(clusters, domains) == 1.0
    assert len(set(clusters)) == 3


def test_7_mutual_information_init_copies_the_best_copy():
    res = _reservoir(Tent(lr=1e-3), max_models=4)
    confident = copy.deepcopy(res.copies[0])
    confident["params"] = [p * 50 for p in confident["params"]]  # large norm gains: confident, diverse predictions
    flat = copy.deepcopy(res.copies[0])
    flat["params"] = [torch.zeros_like(p) for p in flat["params"]]  # zero gains and biases: the same output for every x
    res.copies = [flat, confident]
    x, _ = _batches(1, seed=20, shift=7.0)[0]
    scores = res.mutual_information_scores(x)
    assert scores[0] == pytest.approx(0.0, abs=F32_LAYERS) and scores[1] < scores[0]
    res.deltas.append(nn.Parameter(torch.zeros_like(res.source_mean)))  # pretend two centroids exist
    res._new_domain(res.extractor(x), x)
    for a, b in zip(res.copies[-1]["params"], confident["params"], strict=True):
        assert torch.equal(a, b)


def test_8_buffer_capacity_and_fifo():
    for sampling in ("reservoir", "fifo", "replace"):
        res = _reservoir(SourceOnly(), max_models=4, buffer_size=8, sampling=sampling)
        for i in range(30):
            res._buffer_add(torch.full((16,), float(i)))
            assert len(res.buffer) <= res.capacity() == 2
        if sampling == "fifo":
            assert [float(b[0]) for b in res.buffer] == [28.0, 29.0]


# -- base methods -------------------------------------------------------------------------------------

def test_tent_equals_a_hand_written_entropy_step():
    model = _model(3)
    ref = copy.deepcopy(model)
    tent = Tent(lr=0.05)
    tent.setup(model, None)
    x = torch.rand(16, 1, 8, 8)
    tent.forward_and_adapt(x)
    params = [p for m in ref.modules() if isinstance(m, nn.GroupNorm) for p in (m.weight, m.bias)]
    loss = entropy(ref(x)).mean()
    grads = torch.autograd.grad(loss, params)
    for p, g, new in zip(params, grads, tent.params, strict=True):
        # Adam's first step: m_hat = g, v_hat = g^2 -> p - lr * g / (|g| + eps)
        torch.testing.assert_close(new.detach(), p.detach() - 0.05 * g / (g.abs() + 1e-8), atol=F32, rtol=0)
    conv = [p for n, p in model.named_parameters() if "blocks.0.0" in n]
    assert all(not p.requires_grad for p in conv)  # only norm affine parameters adapt


def test_eata_skips_unreliable_batches_and_anchors():
    eata = EATA(lr=1e-2, e_margin=1e-6, fisher_batches=2)
    eata.setup(_model(), iter(_batches(3)))
    before = _params(eata)
    eata.forward_and_adapt(torch.rand(16, 1, 8, 8))  # every entropy > 1e-6 * ln 10: no sample kept
    assert all(torch.equal(a, b) for a, b in zip(before, _params(eata), strict=True))
    assert all(float(f.sum()) > 0 for f in eata.fisher)
    eata2 = EATA(lr=1e-2, e_margin=1.0, d_margin=2.0, fisher_batches=2)
    eata2.setup(_model(), iter(_batches(3)))
    eata2.forward_and_adapt(torch.rand(16, 1, 8, 8))
    assert eata2.p_avg is not None and not all(torch.equal(a, b) for a, b in zip(before, _params(eata2), strict=True))


def test_cotta_restore_and_teacher():
    cotta = CoTTA(lr=1e-2, rst=1.0, mt_alpha=1.0, ap=0.0)
    cotta.setup(_model(), None)
    src = _params(cotta)
    teacher = [p.clone() for p in cotta.teacher.parameters()]
    out = cotta.forward_and_adapt(torch.rand(16, 1, 8, 8))
    assert out.shape == (16, 10)
    assert all(torch.equal(a, b) for a, b in zip(src, _params(cotta), strict=True))  # rst = 1: all restored
    assert all(torch.equal(a, b) for a, b in zip(teacher, cotta.teacher.parameters(), strict=True))  # alpha = 1
    cotta2 = CoTTA(lr=1e-2, rst=0.0, mt_alpha=0.5)
    cotta2.setup(_model(), None)
    cotta2.forward_and_adapt(torch.rand(16, 1, 8, 8))
    assert not all(torch.equal(a, b) for a, b in zip(src, _params(cotta2), strict=True))


def test_source_only_changes_nothing():
    s = SourceOnly()
    model = _model()
    before = copy.deepcopy(model.state_dict())
    s.setup(model, None)
    s.forward_and_adapt(torch.rand(16, 1, 8, 8))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# -- bad inputs (card section 6) --------------------------------------------------------------------

def test_bad_inputs():
    cases = [
        (dict(quantile=1.0), "quantile=1.0; allowed: \\(0, 1\\)"),
        (dict(max_models=0), "max_models=0"),
        (dict(max_models=8, buffer_size=4), "buffer_size=4 < max_models=8"),
        (dict(centroid_lr=0.0), "centroid_lr=0.0"),
        (dict(sampling="lru"), "sampling='lru'; allowed: reservoir, fifo, replace"),
        (dict(init="zero"), "init='zero'; allowed: mi, source"),
        (dict(fmt="std"), "fmt='std'; allowed: logvar, var, meanvar"),
    ]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            ReservoirTTA(Tent(), LAYERS, **kw)
    with pytest.raises(ValueError, match="no BatchNorm/LayerNorm/GroupNorm"):
        Tent().setup(nn.Sequential(nn.Flatten(), nn.Linear(64, 10)), None)
    bn = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(10))
    bn(torch.rand(2, 1, 8, 8))
    t = Tent()
    t.setup(bn, None)
    with pytest.raises(ValueError, match="batch size 1 with a BatchNorm"):
        t.forward_and_adapt(torch.rand(1, 1, 8, 8))
    with pytest.raises(ValueError, match="layers"):
        StyleExtractor(_model(), ["nope"])


# -- data -------------------------------------------------------------------------------------------

def test_corruptions_and_streams():
    x = torch.rand(4, 1, 16, 16)
    torch.testing.assert_close(corrupt(x, "inversion"), 1 - x)
    torch.testing.assert_close(corrupt(x, "brightness"), 0.6 * x + 0.4)
    c = corrupt(x, "contrast")
    torch.testing.assert_close(c.mean(dim=(1, 2, 3)), x.mean(dim=(1, 2, 3)), atol=F32, rtol=0)
    assert float(c.std()) < float(x.std())
    for name in CORRUPTIONS:
        y = corrupt(x, name, torch.Generator().manual_seed(0))
        assert y.min() >= 0 and y.max() <= 1 and y.shape == x.shape
        assert torch.equal(y, corrupt(x, name, torch.Generator().manual_seed(0)))
    imp = corrupt(torch.full((1, 1, 100, 100), 0.5), "impulse_noise", torch.Generator().manual_seed(0))
    assert abs(float(((imp == 0) | (imp == 1)).float().mean()) - 0.15) < 0.02
    csc = corruption_stream(["a", "b", "c"], 2, 3, "csc")
    assert csc[:6] == [(0, 0)] * 3 + [(1, 0)] * 3 and csc[-1] == (2, 1) and len(csc) == 18
    cdc = corruption_stream(["a", "b", "c"], 2, 3, "cdc", seed=1)
    assert len(cdc) == 18 and cdc != csc
    with pytest.raises(ValueError, match="setting='ccc'; allowed: csc, cdc"):
        corruption_stream(["a"], 1, 1, "ccc")
    with pytest.raises(ValueError, match="name='fog'"):
        corrupt(x, "fog")


# -- the configs through the CLI (source checkpoint made here) --------------------------------------

@pytest.fixture(scope="module")
def source_ckpt(tmp_path_factory):
    from tests.helpers import fitted_checkpoint

    return fitted_checkpoint("reservoir_tta/source_cnn_digits.yaml", tmp_path_factory.mktemp("tta_source"), "--trainer.max_epochs=1")


@pytest.mark.e2e
@pytest.mark.parametrize("name", ["csc_digits.yaml", "csc_digits_tent.yaml", "cdc_digits.yaml"])
def test_tta_config_runs(name, source_ckpt, run_root):
    import csv

    from tests.helpers import CONFIGS, run_cli

    extra = ["--model.init_args.method.init_args.n_source_styles=20"] if "tent" not in name else []
    rc = run_cli("test", "--config", CONFIGS / "reservoir_tta" / name, f"--model.init_args.source_ckpt={source_ckpt}",
                 "--data.init_args.recurrences=2", "--data.init_args.batches_per_visit=2", *extra, "--run_id", "smoke",
                 run_root=run_root)
    assert rc == 0
    exp = name.removesuffix(".yaml")
    run = run_root / "reservoir_tta" / exp / "smoke"
    with open(run / "tta_batches.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 6 * 2 and (run / "tta_recurrence.png").is_file()
    from lowrank_lit.report import last_values

    logged = last_values(run / "metrics.csv")
    assert [k for k in logged if k.startswith("test/error") and not k.startswith(("test/error_r", "test/error_last"))] == [
        "test/error"]  # the stream's error under one name
    weighted = sum(float(r["error"]) * int(r["n"]) for r in rows) / sum(int(r["n"]) for r in rows)
    assert logged["test/error"] == pytest.approx(weighted, abs=F32)


@pytest.mark.e2e
def test_tta_needs_gradients_in_test(source_ckpt, run_root):
    from tests.helpers import CONFIGS, run_cli

    with pytest.raises(RuntimeError, match="inference_mode=false"):
        run_cli("test", "--config", CONFIGS / "reservoir_tta" / "csc_digits_tent.yaml", f"--model.init_args.source_ckpt={source_ckpt}",
                "--data.init_args.recurrences=1", "--data.init_args.batches_per_visit=1", "--trainer.inference_mode=true",
                run_root=run_root)


# -- must show (card section 4) ---------------------------------------------------------------------

def _stream_run(method, ckpt, recurrences=6, seed=0):
    import lightning.pytorch as pl

    from lowrank_lit.data.corruptions import DigitsCorruptionDataModule
    from lowrank_lit.tta import TTAModule

    pl.seed_everything(seed, verbose=False)
    module = TTAModule(GroupNormCNN(widths=[32, 32, 32]), method, source_ckpt=str(ckpt))
    trainer = quiet_trainer(inference_mode=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.test(module, DigitsCorruptionDataModule(recurrences=recurrences, stream_seed=seed), verbose=False)
    return module


def _spike(rows):
    """Re-entry spike: mean over revisits of (error of the visit's first 2 batches - error of the rest of the visit)."""
    visits: dict[int, list[list[float]]] = {}
    prev = None
    for r in rows:
        key = (r["domain"], r["recurrence"])
        if key != prev:
            visits.setdefault(r["domain"], []).append([])
            prev = key
        visits[r["domain"]][-1].append(r["error"])
    jumps = [sum(v[:2]) / 2 - sum(v[2:]) / len(v[2:]) for vs in visits.values() for v in vs[1:]]
    return sum(jumps) / len(jumps)


@pytest.fixture(scope="module")
def recurring_runs(tmp_path_factory):
    """Seeds 0-9 (the seed budget, docs/reproduce.md "How many seeds"; source CNN trained and stream drawn with each
    seed): Tent and Tent + Reservoir per seed, EATA and EATA + Reservoir on seed 0."""
    from tests.helpers import CONFIGS, run_cli

    tmp_path = tmp_path_factory.mktemp("recurring")
    out: dict = {"gaps": [], "models": [], "purity": [], "report": {}}
    for seed in range(10):
        assert run_cli("fit", "--config", CONFIGS / "reservoir_tta" / "source_cnn_digits.yaml",
                       f"--seed_everything={seed}", f"--run_id=source_s{seed}", run_root=tmp_path) == 0
        ckpt = tmp_path / "reservoir_tta" / "source_cnn_digits" / f"source_s{seed}" / "checkpoints" / "last.ckpt"
        tent = _stream_run(Tent(), ckpt, seed=seed)
        tent_res = _stream_run(ReservoirTTA(Tent(), ["blocks.0.0", "blocks.1.0"]), ckpt, seed=seed)
        late = [sum(m.per_recurrence[k] for k in range(2, 6)) / 4 for m in (tent, tent_res)]
        out["gaps"].append(late[0] - late[1])  # Tent's error - Tent + Reservoir's, recurrences 3-6
        out["models"].append(tent_res.method.num_models)
        out["purity"].append(purity([r["cluster"] for r in tent_res.rows], [r["domain"] for r in tent_res.rows]))
        out["report"][seed] = {"tent": tent.per_recurrence, "tent+res": tent_res.per_recurrence,
                               "models": out["models"][-1]}
        if seed == 0:
            eata = _stream_run(EATA(), ckpt)
            eata_res = _stream_run(ReservoirTTA(EATA(), ["blocks.0.0", "blocks.1.0"]), ckpt)
            out["eata"] = (eata, eata_res)
    print({k: v for k, v in out.items() if k in ("gaps", "models", "purity")})
    return out


@pytest.mark.slow
def test_must_show_recurring_corruptions(recurring_runs):
    """Our acceptance criterion over seeds 0-9 (source CNN trained and stream drawn with each seed), the parts that
    hold: never more than 9 models; purity >= 0.95 on every seed (1.000 on all ten); EATA + Reservoir <= EATA + 1
    point and no re-entry spike (seed 0). Tent + Reservoir's mean error over recurrences 3-6 against Tent's, judged
    by the verdict rule with delta = 1 point: below Tent holds (+6.2 points, 95 % interval [+1.4, +11.0]); by >= 8
    points inconclusive (half-width 4.8 points). Per seed 13.7 / 8.5 / 11.5 / 1.1 / -3.8 / 13.9 / 12.4 / -0.3 /
    -0.6 / 5.3 points (docs/methods/reservoir_tta.md)."""
    from lowrank_lit.stats import expect_verdict

    gaps, models, report = recurring_runs["gaps"], recurring_runs["models"], recurring_runs["report"]
    assert min(recurring_runs["purity"]) >= 0.95, (recurring_runs["purity"], report)
    eata, eata_res = recurring_runs["eata"]
    assert eata_res.per_recurrence[5] <= eata.per_recurrence[5] + 0.01, report
    assert _spike(eata_res.rows) <= 0.02, (report, _spike(eata_res.rows), _spike(eata.rows))
    assert not math.isnan(_spike(eata.rows))
    assert max(models) <= 9, (models, report)
    expect_verdict("holds", gaps, delta=0.01, claim="Tent + Reservoir below Tent over recurrences 3-6")
    expect_verdict("inconclusive", gaps, margin=0.08, delta=0.01,
                   claim="Tent + Reservoir >= 8 points below Tent over recurrences 3-6")


@pytest.mark.slow
@pytest.mark.no_verdict("a property asserted on every seed (never above Tent's error), not a mean over seeds")
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="seeds 0-9: Tent + Reservoir's mean error over "
                   "recurrences 3-6 is above Tent's on seeds 4, 7 and 8 (by 3.8, 0.3 and 0.6 points)")
def test_must_show_reservoir_never_worse_than_tent(recurring_runs):
    """Our acceptance criterion: Tent + Reservoir's mean error over recurrences 3-6 not above Tent's on any seed."""
    gaps = recurring_runs["gaps"]
    assert min(gaps) >= 0.0, gaps


@pytest.mark.slow
@pytest.mark.no_verdict("a count over seeds (one model per domain, K = 7), not a mean difference")
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="seeds 0-9: the reservoir holds 7 models on 7 of 10 "
                   "seeds and 8 on seeds 0, 5 and 9 (an extra cluster), below the 3 in 4 of our criterion")
def test_must_show_reservoir_holds_one_model_per_domain(recurring_runs):
    """Our acceptance criterion: exactly 7 models (the source and the six corruptions) on at least 3 in 4 seeds."""
    models = recurring_runs["models"]
    assert 4 * sum(m == 7 for m in models) >= 3 * len(models), models


def test_cifar10c_stream_from_files(tmp_path):
    import numpy as np

    from lowrank_lit.data.cifar_c import CIFAR10CDataModule

    rng = np.random.default_rng(0)
    np.save(tmp_path / "labels.npy", np.tile(np.arange(10), 5 * 4))  # 40 images per severity
    for name in ("fog", "snow"):
        np.save(tmp_path / f"{name}.npy", rng.integers(0, 256, (200, 32, 32, 3), dtype=np.uint8))
    dm = CIFAR10CDataModule(str(tmp_path), corruptions=["fog", "snow"], severity=5, recurrences=2, batch_size=20)
    dm.setup()
    batches = list(dm.test_dataloader())
    assert len(batches) == 2 * 2 * 2
    x, y, d, r = batches[3]
    assert x.shape == (20, 3, 32, 32) and int(d[0]) == 1 and int(r[0]) == 0
    assert [int(b[2][0]) for b in batches] == [0, 0, 1, 1, 0, 0, 1, 1]
    with pytest.raises(FileNotFoundError, match="frost.npy"):
        CIFAR10CDataModule(str(tmp_path), corruptions=["frost"]).setup()
    with pytest.raises(ValueError, match="severity=6"):
        CIFAR10CDataModule(str(tmp_path), severity=6)


def test_reservoir_wraps_cotta_and_eata():
    for base in (CoTTA(lr=1e-3, rst=0.0), EATA(lr=1e-3, fisher_batches=2)):
        res = _reservoir(base, max_models=4)
        for shift in (0.0, 6.0, 0.0):
            for x, _ in _batches(2, seed=int(shift) + 40, shift=shift):
                assert res.forward_and_adapt(x).shape == (16, 10)
        assert res.num_models == 2


def test_reservoir_around_lame_keeps_lame_s_adjusted_outputs():
    """LAME adapts outputs, not weights: the reservoir's copies are identical and its ensemble returns LAME's output."""
    from lowrank_lit.tta import LAME

    res = _reservoir(LAME(knn=3), max_models=4)
    alone = LAME(knn=3)
    alone.setup(_model(), None)
    for shift in (0.0, 6.0):
        for x, _ in _batches(2, seed=int(shift) + 50, shift=shift):
            torch.testing.assert_close(res.forward_and_adapt(x).softmax(1), alone.forward_and_adapt(x).softmax(1))
