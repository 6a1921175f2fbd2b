"""Sharded training (FSDP2 on CPU with gloo): the shard rule, refusals, exact whole-matrix optimizers, checkpoints."""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil
import socket
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lowrank_lit
from lowrank_lit.sharding import Shardable, ShardedStrategy, owners, shard_units, sharding_refusal
from tests.helpers import MLP_CONFIG, ROOT

FSDP = str(ROOT / "configs" / "base" / "trainer_fsdp.yaml")
#: the largest weight difference measured between a 2-rank sharded and a 1-process update over 20 steps
#: (LowRankAdam, NanoAdam, AdamQ3R; float32 gradients averaged in another order): 3.4e-7; the bound leaves 30x
SHARDED_ATOL = 1e-5
#: sharded against DDP training losses of the methods' CPU configs after up to 3 steps: float32 sums in another
#: order, through up to 3 updates (Adam divides by sqrt(v), so a gradient's last bits move the weights by ~lr * eps)
SHARDED_LOSS_RTOL = 1e-4


# ----------------------------------------------------------------------------------------- the shard rule
def test_shard_units_are_the_repeated_blocks_of_each_family():
    from lowrank_lit.models.lm import llama
    from lowrank_lit.models.mlp import MLP
    from lowrank_lit.models.vit import vit_tiny
    from lowrank_lit.models.vmamba import TinyVMamba

    vit = vit_tiny(num_classes=10, img_size=8, patch_size=2, in_chans=1)
    assert [type(u).__name__ for u in shard_units(vit)] == ["Block"] * 12
    vm = TinyVMamba(dim=[8, 16], depth=[2, 1])
    assert [type(u).__name__ for u in shard_units(vm)] == ["_VSSBlock"] * 3
    lm = llama(num_layers=3)
    units = shard_units(lm)
    assert [type(u).__name__ for u in units] == ["LlamaDecoderLayer"] * 3
    assert units[0] is lm.model.layers[2]  # innermost-last order of modules(), reversed: fully_shard children first
    assert shard_units(MLP(in_features=4, num_classes=2, hidden=[8])) == []  # no units: one root group


def test_a_singleton_hugging_face_unit_stays_in_the_root_group():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=32))
    assert "BertEmbeddings" in bert._no_split_modules
    assert [type(u).__name__ for u in shard_units(bert)] == ["BertLayer", "BertLayer"]


def test_owners_balance_elements_largest_first():
    params = [torch.empty(n) for n in (10, 100, 50, 60)]
    got = owners(params, 2)
    # 100 -> rank 0; 60 -> rank 1; 50 -> rank 1 (60 < 100); 10 -> rank 0 (100 < 110)
    assert [got[id(p)] for p in params] == [0, 0, 1, 1]
    assert owners(params, 1) == {id(p): 0 for p in params}


def _lightning_modules():
    out = {}
    for info in pkgutil.walk_packages(lowrank_lit.__path__, "lowrank_lit."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, pl.LightningModule) and cls.__module__ == info.name:
                out[f"{info.name}.{cls.__name__}"] = cls
    return out


def test_every_lightning_module_runs_sharded_or_says_why():
    classes = _lightning_modules()
    assert len(classes) >= 20
    refusing = {name: sharding_refusal(cls) for name, cls in classes.items() if sharding_refusal(cls)}
    assert sorted(n.rsplit(".", 1)[1] for n in refusing) == ["NeuralSafeMetaRLModule", "PinvBoundStudy",
                                                             "SafeMetaRLModule", "ShallowDiffuseEval",
                                                             "SkrullSFTModule", "TTAModule", "WhatHowModule"]
    for reason in refusing.values():
        assert "\n" not in reason and "does not run sharded" in reason and len(reason) < 200, reason
    for name, cls in classes.items():
        assert name in refusing or issubclass(cls, Shardable), name

    class Plain(pl.LightningModule):
        pass

    assert "declares no shard rule" in sharding_refusal(Plain)


def test_sharded_strategy_bad_mixed_precision_is_one_line():
    with pytest.raises(ValueError, match=r"^ShardedStrategy: mixed_precision='fp8'; allowed: none, bf16, fp16$"):
        ShardedStrategy(mixed_precision="fp8")


def test_sync_batchnorm_is_refused_not_dropped():
    """Lightning's ModelParallelStrategy leaves ``sync_batchnorm=True`` out without a word; ours refuses it."""
    from lightning.pytorch import Trainer

    trainer = Trainer(strategy=ShardedStrategy(), sync_batchnorm=True, accelerator="cpu", devices=1, logger=False)
    with pytest.raises(ValueError, match=r"^ShardedStrategy: trainer.sync_batchnorm=true is not applied"):
        trainer.strategy.setup_environment()


# ----------------------------------------------------------------------------------------- exact whole-matrix updates
def _stack():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(24, 24, bias=False), nn.Tanh()) for _ in range(4)], nn.Linear(24, 5))


def _optimizer(kind, m):
    from lowrank_lit.methods.is_lowrank import LowRankAdam
    from lowrank_lit.methods.nanoadam import NanoAdam
    from lowrank_lit.methods.q3r import AdamQ3R, Q3RHparams, Q3RRegularizer, resolve_targets

    mats, head = [m[i][0].weight for i in range(4)], list(m[4].parameters())
    if kind == "lowrank_importance":
        return LowRankAdam([{"params": mats}, {"params": head, "lowrank": False}], lr=1e-2, rank=4, update_proj_gap=5,
                           seed=3)
    if kind == "lowrank_galore":
        return LowRankAdam([{"params": mats}, {"params": head, "lowrank": False}], lr=1e-2, rank=4, update_proj_gap=5,
                           selector="dominant")
    if kind == "nanoadam_random":
        return NanoAdam([{"params": mats}, {"params": head, "nano": False}], lr=1e-2, density=0.1, mask_interval=5,
                        selector="random", seed=3)
    if kind == "nanoadam":
        return NanoAdam([{"params": mats}, {"params": head, "nano": False}], lr=1e-2, density=0.1, mask_interval=5)
    reg = Q3RRegularizer(resolve_targets(m, ["0.0", "1.0", "2.0", "3.0"]), Q3RHparams(target_rank=0.2, lam=0.5, period=5))
    return AdamQ3R(m.parameters(), reg, lr=1e-2)


KINDS = ["lowrank_importance", "lowrank_galore", "nanoadam_random", "nanoadam", "adam_q3r"]


def _train(kind, rank=0, world=1):
    """20 steps on a fixed stream; under sharding each rank takes its half of every batch of 16."""
    from lowrank_lit.sharding import full_tensor, local_bytes

    m = _stack()
    torch.manual_seed(1)
    x, y = torch.randn(20, 16, 24), torch.randn(20, 16, 5)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in list(m)[:4]:
            fully_shard(block, mesh=mesh)
        fully_shard(m, mesh=mesh)
    opt = _optimizer(kind, m)
    for s in range(20):
        xb, yb = (x[s].chunk(world)[rank], y[s].chunk(world)[rank]) if world > 1 else (x[s], y[s])
        ((m(xb) - yb) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    weights = {k: full_tensor(v.detach()).clone().numpy() for k, v in m.state_dict().items()}
    state = local_bytes([v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.ndim])
    if not hasattr(opt, "generator"):  # torch's Adam (Q3R): its sharded state is saved by torch's own helpers
        return weights, state, {}
    whole = opt.state_dict()  # under sharding: what a one-process run saves (a collective on every rank)
    if world > 1:  # the whole state loads back into a fresh sharded optimizer, each rank keeping its part
        again = _optimizer(kind, m)
        again.load_state_dict(whole)
        assert _flat(again.state_dict()).keys() == _flat(whole).keys()
        for key, value in _flat(again.state_dict()).items():
            assert torch.equal(value, _flat(whole)[key]), key
        assert local_bytes([v for st in again.state.values() for v in st.values()
                            if isinstance(v, torch.Tensor) and v.ndim]) == state
    return weights, state, {k: v.numpy() for k, v in _flat(whole).items()}


def _flat(sd):
    """The tensors of an optimizer state dict by ``(param index, key)`` (generator states left out)."""
    return {f"{i}.{k}": v.detach().clone() for i, st in sd["state"].items() for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.dtype != torch.uint8}


def _worker(rank, world, port, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        queue.put((rank, {kind: _train(kind, rank, world) for kind in KINDS}))
    except Exception:  # noqa: BLE001 - the test reports it (the other rank then stops at the collective timeout)
        import traceback

        queue.put((rank, traceback.format_exc()))
        os._exit(1)
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_whole_matrix_optimizers_are_exact_under_sharding_and_hold_half_the_state():
    """LowRankAdam (importance sampling and GaLore's dominant subspace), NanoAdam (smallest and random selection) and
    Q3R (Adam + the reweighting step) on 2 sharded ranks: after 20 steps every weight equals the 1-process run's
    (within float32 reduction order), each rank holds about half of the optimizer state, the state every rank saves
    is the 1-process run's, and it loads back, each rank keeping its half."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rank, first = queue.get(timeout=600)
    assert not isinstance(first, str), f"rank {rank}: {first}"
    results = dict([(rank, first), queue.get(timeout=60)])
    assert not any(isinstance(r, str) for r in results.values()), results
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    torch.set_num_threads(1)
    for kind in KINDS:
        ref, ref_state, ref_whole = _train(kind)
        for rank in (0, 1):
            weights, state, whole = results[rank][kind]
            for key, value in ref.items():
                torch.testing.assert_close(torch.from_numpy(weights[key]), torch.from_numpy(value), atol=SHARDED_ATOL,
                                           rtol=0, msg=f"{kind} rank {rank} {key}")
            assert abs(state / ref_state - 0.5) < 0.05, (kind, rank, state, ref_state)
            assert whole.keys() == ref_whole.keys(), kind
            for key, value in ref_whole.items():
                torch.testing.assert_close(torch.from_numpy(whole[key]), torch.from_numpy(value),
                                           atol=SHARDED_ATOL, rtol=1e-4, msg=f"{kind} rank {rank} state {key}")  # tol: moments of tiny gradients; relative rounding


# ----------------------------------------------------------------------------------------- sharded runs of the CLI
def _fit(root, *extra, devices=2, timeout=600, verb="fit"):
    env = {**os.environ, "PL_DISABLE_FORK": "0", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.pop("LOWRANK_RUN_DIR", None)
    return subprocess.run([sys.executable, "-m", "lowrank_lit", verb, *extra, "--trainer.accelerator=cpu",
                           f"--trainer.devices={devices}", "--trainer.enable_progress_bar=false",
                           "--run_root", str(root)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


#: one process with the config's batch against 2 sharded ranks with half of it each: (config, batch, overrides)
ONE_PROCESS = {
    "baseline": ("baseline/mlp_digits.yaml", 64, ["--model.init_args.backbone.init_args.dropout=0.0"]),
    "q3r": ("q3r/mlp_digits.yaml", 64, []),
    "is_lowrank": ("is_lowrank/char_lm.yaml", 32, ["--model.init_args.optimizer.init_args.update_proj_gap=1"]),
    "capt": ("capt/templated_capt.yaml", 32, []),
    "nanoadam": ("nanoadam/digits_finetune.yaml", 64, []),
    "glvq": ("glvq/mlp_digits_fp.yaml", 64, []),
    # with their per-process random draws turned off (the router noise, the HyNoIse embedding noise)
    "pt_moe": ("pt_moe/templated_ptmoe.yaml", 32, ["--model.init_args.prompt.init_args.noise_std=0.0"]),
    "lope": ("lope/lope.yaml", 32, ["--trainer.callbacks.emb_alpha=0.0"]),
}

#: the configs of EVERY_METHOD whose 2-process runs (sharded or DDP alike) differ from one process by design, and why
DIFFERS_FROM_ONE_PROCESS = {
    "baseline/vit_tiny_digits.yaml": "float order: 1 of 110,592 elements of one matrix differs by 2.2e-5 after 3 steps",
    "bayes_prefix/prefix_soft.yaml": "generated data: each process draws its own batches from the stream",
    "gaze_3dpe/param_encoder_prior.yaml": "generated data: each process draws its own batches from the stream",
    "masked_block_icl/unconstrained.yaml": "generated data: each process draws its own batches from the stream",
    "icl_rank_retriever/synthetic_sedpo.yaml": "random draws: each process draws its own preference pairs",
    "shallow_diffuse/unet_digits_train.yaml": "random draws: each process draws its own noise and timesteps",
    "strank/synthetic_balanced.yaml": "batch statistics: the list loss normalises over each process's spots of a slide",
    "trust/source_vmamba_digits.yaml": "batch statistics: BatchNorm normalises over each process's batch",
}


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(ONE_PROCESS))
def test_sharded_steps_equal_single_process_steps(name, tmp_path):
    """3 steps of a config on 2 sharded ranks (half the batch each) end with the weights of 3 steps in one process
    with the whole batch (the same sampler permutation): AdamW, Q3R's reweighting, LowRankAdam with a new
    importance-sampled subspace every step, CaPT's prompt on the frozen MiniLM, NanoAdam after its pretraining, GLVQ,
    PT-MoE's router and LoPE's masked experts. The checkpoint is one consolidated file."""
    config, batch, extra = ONE_PROCESS[name]
    common = ["--config", str(ROOT / "configs" / config), "--trainer.max_steps=3", "--trainer.limit_val_batches=0",
              "--test_after_fit=false", *extra]
    single = _fit(tmp_path / "single", *common, "--trainer.strategy=ddp_find_unused_parameters_true",
                  f"--data.init_args.batch_size={batch}",
                  devices=1)
    assert single.returncode == 0, single.stderr[-2000:]
    sharded = _fit(tmp_path / "sharded", *common, "--config", FSDP, "--trainer.strategy.init_args.mixed_precision=none",
                   f"--data.init_args.batch_size={batch // 2}")
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    (a,) = (tmp_path / "single").rglob("last.ckpt")
    (b,) = (tmp_path / "sharded").rglob("last.ckpt")
    assert b.is_file()  # consolidated, not a folder of shards
    wa = torch.load(a, map_location="cpu", weights_only=True)["state_dict"]
    wb = torch.load(b, map_location="cpu", weights_only=True)["state_dict"]
    assert set(wa) == set(wb)
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], atol=SHARDED_ATOL, rtol=0, msg=lambda m, key=key: key + " " + m)


@pytest.mark.e2e
def test_a_sharded_checkpoint_is_read_by_one_process_test_and_export(tmp_path):
    """The consolidated checkpoint of a sharded run: ``lowrank test`` and ``lowrank export`` read it on one process."""
    common = ["--config", str(MLP_CONFIG), "--trainer.max_steps=3", "--trainer.limit_val_batches=0",
              "--test_after_fit=false", "--model.init_args.backbone.init_args.dropout=0.0"]
    sharded = _fit(tmp_path / "sharded", *common, "--config", FSDP, "--trainer.strategy.init_args.mixed_precision=none")
    assert sharded.returncode == 0, sharded.stderr[-2000:]
    (b,) = (tmp_path / "sharded").rglob("last.ckpt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    env.pop("LOWRANK_RUN_DIR", None)
    test = subprocess.run([sys.executable, "-m", "lowrank_lit", "test", "--config", str(MLP_CONFIG), "--ckpt_path", str(b),
                           "--model.init_args.backbone.init_args.dropout=0.0",
                           "--trainer.enable_progress_bar=false", "--run_root", str(tmp_path / "test")], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    assert test.returncode == 0, test.stderr[-2000:]
    assert "test/acc" in test.stdout + test.stderr
    export = subprocess.run([sys.executable, "-m", "lowrank_lit", "export", "--ckpt_path", str(b), "--out",
                             str(tmp_path / "export")], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert export.returncode == 0, export.stderr[-2000:]
    assert any((tmp_path / "export").iterdir())


@pytest.mark.e2e
def test_a_method_that_cannot_run_sharded_says_why_before_it_starts(tmp_path):
    proc = _fit(tmp_path, "--config", str(ROOT / "configs" / "tta" / "digits_tent.yaml"), "--config", FSDP, verb="test")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "lowrank test: error: TTAModule does not run sharded (trainer.strategy: ShardedStrategy): it adapts at test "
        "time, batch by batch on one stream (lowrank test); nothing trains to shard")
    assert not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.e2e
@pytest.mark.parametrize("target", ["rank1", "group"])
def test_a_stopped_sharded_run_saves_one_checkpoint_and_resumes_to_the_uninterrupted_weights(tmp_path, target):
    """SIGTERM to rank 1 or to the whole group (as SLURM does) stops both sharded ranks after the same batch and
    writes one consolidated last.ckpt; resumed on 2 sharded ranks, the run ends with the weights of an uninterrupted
    sharded run."""
    import signal

    from tests.test_distributed import _ddp_fit, _only_run

    sharded = ("--config", FSDP, "--trainer.strategy.init_args.mixed_precision=none")
    if target == "group":
        rc, _, err, _ = _ddp_fit(tmp_path / "reference", strategy=sharded)
        assert rc == 0, err[-2000:]
    rc, _, err, waited = _ddp_fit(tmp_path, signal_at="epoch 2/4  batch 4/10", target=target, strategy=sharded)
    assert rc == 128 + signal.SIGTERM, err[-2000:]
    assert waited < 20, waited
    run = _only_run(tmp_path / "baseline" / "mlp_digits")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt"]  # one file, not shards
    stopped = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert 10 < stopped["global_step"] < 20, stopped["global_step"]
    if target != "group":
        return  # the resume itself is checked once
    rc, _, err, _ = _ddp_fit(tmp_path, "--run_id", run.name, "--ckpt_path", "last", strategy=sharded)
    assert rc == 0, err[-2000:]
    final = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    reference = torch.load(_only_run(tmp_path / "reference" / "baseline" / "mlp_digits") / "checkpoints" / "last.ckpt",
                           map_location="cpu", weights_only=True)
    assert final["global_step"] == reference["global_step"] == 40
    for key, value in reference["state_dict"].items():
        assert torch.equal(final["state_dict"][key], value), key


@pytest.mark.e2e
def test_trained_only_checkpoints_of_a_sharded_run_resume_sharded(tmp_path):
    """NanoAdam fine-tuning (the source head frozen) with callbacks/trained_only.yaml, on 2 sharded ranks: the
    checkpoint leaves the frozen head out (digests recorded), and a sharded resume checks the gathered head against
    them and continues."""
    config = str(ROOT / "configs" / "nanoadam" / "digits_finetune.yaml")
    common = ["--config", config, "--config", str(ROOT / "callbacks" / "trained_only.yaml"), "--config", FSDP,
              "--trainer.strategy.init_args.mixed_precision=none", "--trainer.limit_val_batches=1",
              "--test_after_fit=false", "--run_id", "lora"]
    first = _fit(tmp_path, *common, "--trainer.max_steps=2")
    assert first.returncode == 0, first.stderr[-2000:]
    (ckpt,) = tmp_path.rglob("last.ckpt")
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert sorted(saved["frozen_omitted"]) == ["head_src.bias", "head_src.weight"]
    assert not set(saved["frozen_omitted"]) & set(saved["state_dict"])
    resumed = _fit(tmp_path, *common, "--trainer.max_steps=4", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] == 4


#: one training config of every method that trains (methods that only evaluate refuse; so do lowrank_rnn_cl, whose
#: task modules are unused on some ranks at some steps, Skrull, whose ranks run different numbers of micro-batches, and
#: the safe meta-RL modules, which write a meta-gradient by hand or adapt per-task copies of the policy)
EVERY_METHOD = [
    "baseline/vit_tiny_digits.yaml", "bayes_prefix/prefix_soft.yaml", "capt/templated_capt.yaml",
    "gaze_3dpe/param_encoder_prior.yaml", "glvq/mlp_digits_fp.yaml",
    "icl_rank_retriever/synthetic_sedpo.yaml", "is_lowrank/char_lm.yaml", "lope/lope.yaml",
    "masked_block_icl/unconstrained.yaml", "nanoadam/digits_finetune.yaml",
    "pt_moe/templated_ptmoe.yaml", "q3r/mlp_digits.yaml",
    "shallow_diffuse/unet_digits_train.yaml", "strank/synthetic_balanced.yaml",
    "trust/source_vmamba_digits.yaml",
]


def test_every_sharded_method_is_compared_with_one_process_or_says_why_it_differs():
    compared = {config for config, _, _ in ONE_PROCESS.values()}
    assert not compared & set(DIFFERS_FROM_ONE_PROCESS)
    assert set(EVERY_METHOD) - compared == set(DIFFERS_FROM_ONE_PROCESS)


@pytest.mark.rehearsal
@pytest.mark.e2e
@pytest.mark.parametrize("config", EVERY_METHOD)
def test_every_method_that_trains_runs_sharded(config, tmp_path):
    """Three optimizer steps of each method's CPU config on 2 sharded gloo ranks run to the end of its fit (end-of-fit
    evaluations included), write one consolidated checkpoint, and log the training losses of the same 2-process run
    under DDP (the same data and random draws per rank: sharding changes only the order of float sums)."""
    common = ["--config", str(ROOT / "configs" / config), "--trainer.max_steps=3", "--trainer.log_every_n_steps=1",
              "--trainer.limit_val_batches=1", "--test_after_fit=false"]
    proc = _fit(tmp_path / "sharded", *common, "--config", FSDP, "--trainer.strategy.init_args.mixed_precision=none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt,) = (tmp_path / "sharded").rglob("last.ckpt")
    assert ckpt.is_file()
    ddp = _fit(tmp_path / "ddp", *common, "--trainer.strategy=ddp_find_unused_parameters_true")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    sharded, plain = _train_losses(tmp_path / "sharded"), _train_losses(tmp_path / "ddp")
    assert sharded and sharded.keys() == plain.keys(), (sharded, plain)
    for key, values in plain.items():
        assert len(sharded[key]) == len(values), key
        for a, b in zip(sharded[key], values, strict=True):
            assert a == pytest.approx(b, rel=SHARDED_LOSS_RTOL, abs=SHARDED_ATOL), (key, sharded[key], values)


TIMED = ("_s", "per_s", "_ms")  # wall-clock metrics (Skrull's step time and throughput) differ between any two runs


def _train_losses(root):
    """The training metrics rank 0 logged (losses, returns, ...; not wall-clock ones), by name, in step order."""
    import csv

    (path,) = [p for p in root.rglob("metrics.csv")]
    out: dict[str, list[float]] = {}
    for row in csv.DictReader(path.open()):
        for key, value in row.items():
            if key.startswith("train/") and not key.endswith(TIMED) and value not in ("", None):
                out.setdefault(key, []).append(float(value))
    return out


@pytest.mark.rehearsal
@pytest.mark.e2e
@pytest.mark.parametrize("opt", ["galore", "importance", "nanoadam"])
def test_the_optimizer_x_regularizer_cells_of_the_composition_grid_run_sharded(opt, tmp_path):
    """grids/opt_reg_ptq.yaml: each memory-lean optimizer with Q3R on the same matrices, two steps on 2 sharded
    ranks (the cell's fragments as ``lowrank matrix`` layers them on the base config)."""
    import yaml

    grid = yaml.safe_load((ROOT / "grids" / "opt_reg_ptq.yaml").read_text())
    fragment = tmp_path / "cell.yaml"
    nested: dict = {}
    for key, value in {**grid["axes"]["opt"][opt], **grid["axes"]["reg"]["q3r"]}.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    fragment.write_text(yaml.safe_dump(nested))
    proc = _fit(tmp_path / "runs", "--config", str(ROOT / grid["config"]), "--config", str(fragment), "--config", FSDP,
                "--trainer.strategy.init_args.mixed_precision=none", "--trainer.max_steps=6",
                "--trainer.limit_val_batches=1", "--test_after_fit=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (ckpt,) = (tmp_path / "runs").rglob("last.ckpt")
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 6
    states = saved["optimizer_states"][0]["state"]
    assert all(st for st in states.values())  # the whole state of every matrix, gathered from its owner
