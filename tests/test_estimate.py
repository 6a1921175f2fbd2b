"""``lowrank estimate``: memory per GPU at full size from the meta device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import CONFIGS
from tests.rehearsal import fixtures as fx

HUB = Path(__file__).parent / "rehearsal" / "hub_configs"


def test_lowrank_adam_steady_state_bytes_equal_its_state_after_a_real_step():
    from lowrank_lit.methods.is_lowrank import LowRankAdam

    torch.manual_seed(0)
    w, b, v = torch.nn.Parameter(torch.randn(12, 20)), torch.nn.Parameter(torch.randn(20)), torch.nn.Parameter(torch.randn(30, 8))
    opt = LowRankAdam([{"params": [w, v], "lowrank": True, "rank": 4}, {"params": [b], "lowrank": False}], lr=1e-2, seed=0)
    for p in (w, b, v):
        p.grad = torch.randn_like(p)
    opt.step()
    real = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if torch.is_tensor(t)
               and t.dim() > 0)
    assert opt.steady_state_bytes() == real


def test_saved_activation_bytes_on_meta_equal_those_of_a_real_run():
    """The meta-device count is the count a real forward makes (same shapes, same dtypes) with math attention;
    a fused attention kernel keeps less, so the meta count is an upper bound for it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lowrank_lit.launch.estimate import SavedTensors

    def saved_bytes(device, attention):
        seen = SavedTensors()
        torch.manual_seed(0)
        with torch.device(device):
            cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=16)
            model = LlamaForCausalLM._from_config(cfg, attn_implementation=attention)
            with torch.autograd.graph.saved_tensors_hooks(seen.pack, lambda t: t):
                model(torch.zeros(3, 16, dtype=torch.long)).logits.float().mean()
        return seen.bytes

    assert saved_bytes("meta", "eager") == saved_bytes("cpu", "eager") > 0
    assert saved_bytes("cpu", "sdpa") <= saved_bytes("meta", "sdpa")


def test_estimate_galore_llama_at_full_size(tmp_path):
    from lowrank_lit.launch.estimate import estimate

    text = fx.text_folder(tmp_path / "text", n_files=2, lines=400)
    e = estimate(["--config", str(CONFIGS / "is_lowrank/llama_gpu.yaml"), f"--data.init_args.root={text}",
                  "--data.init_args.num_workers=0"])
    assert e.parameters == e.trainable == 25_567_744
    assert e.weights >= 4 * e.parameters and e.gradients == 4 * e.parameters
    assert 0 < e.optimizer < 2 * 4 * e.parameters  # rank-128 moments: below AdamW's two full moments
    assert e.activations is not None and e.activations > 0 and e.devices == 1
    assert "fits in 80 GiB" in e.report(80) and "does NOT fit in 1 GiB" in e.report(1) and "FSDP over" in e.report(1)


def test_sharded_estimate_divides_the_state_and_checkpointing_keeps_unit_inputs(tmp_path):
    """Sharded over 4: parameters, gradients and optimizer state / 4, buffers whole; with activation checkpointing
    the activations drop to (outside the units) + (unit inputs) + (the largest unit's internals), which for 8
    equal decoder layers is below a third of the full count."""
    from lowrank_lit.launch.estimate import estimate

    text = fx.text_folder(tmp_path / "text", n_files=2, lines=400)
    args = ["--config", str(CONFIGS / "is_lowrank/llama_gpu.yaml"), f"--data.init_args.root={text}",
            "--data.init_args.num_workers=0"]
    one = estimate(args)
    e = estimate([*args, "--config", str(CONFIGS / "base/trainer_fsdp.yaml"), "--trainer.devices=4",
                  "--trainer.strategy.init_args.activation_checkpointing=true"])
    assert e.sharded and e.devices == 4 and not one.sharded
    assert (e.weights, e.gradients, e.optimizer) == (one.weights, one.gradients, one.optimizer)
    assert 0 < e.buffers < e.weights
    assert e.sharded_state(4) == (e.weights - e.buffers + e.gradients + e.optimizer) // 4 + e.buffers
    assert e.activations == one.activations and e.checkpointed_activations is not None
    assert 0 < e.checkpointed_activations < e.activations / 3
    assert e.total == e.sharded_state(4) + e.checkpointed_activations
    assert "sharded over 4" in e.report() and "with activation checkpointing" in e.report()


def test_estimate_pt_moe_llama_1b_from_its_config_json(tmp_path):
    from lowrank_lit.launch.estimate import estimate

    tok = fx.bpe_tokenizer("PreTrainedTokenizerFast", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"})
    folder = fx.architecture_folder(tmp_path / "Llama-3.2-1B-Instruct", HUB / "Llama-3.2-1B.json", tok)
    qa = fx.write_jsonl(tmp_path / "train.jsonl", fx.qa_records(40))
    e = estimate(["--config", str(CONFIGS / "pt_moe/llama_1b_gpu.yaml"), f"--model.init_args.backbone={folder}",
                  f"--data.init_args.tokenizer={folder}", f"--data.init_args.train_path={qa}", f"--data.init_args.val_path={qa}"])
    prompt = e.parameters - 1_235_814_400
    assert 0 < prompt == e.trainable  # only the PT-MoE prompt and router train
    assert 2 * 4 * prompt <= e.optimizer <= 2 * 4 * prompt + 64  # AdamW: two fp32 moments of what trains (+ step counters)
    assert e.activations is not None and e.activations > e.weights  # 32 x 512 tokens through 16 layers


@pytest.mark.e2e
def test_estimate_command_line(capsys, tmp_path):
    from lowrank_lit.cli import main

    assert main(["estimate", "--config", str(CONFIGS / "baseline/mlp_digits.yaml"), "--gpu-memory"]) == 2
    assert main(["estimate", "--config", str(CONFIGS / "baseline/mlp_digits.yaml"), "--gpu-memory", "1"]) == 0
    out = capsys.readouterr().out
    assert "total per GPU" in out and "fits in 1 GiB" in out


@pytest.mark.e2e
def test_estimate_names_a_config_that_cannot_be_built_on_meta(capsys, tmp_path):
    """An evaluation config whose model reads values while being built (Shallow Diffuse draws its key) says so."""
    from lowrank_lit.cli import main

    model_dir = fx.tiny_stable_diffusion(tmp_path / "sd")
    rc = main(["estimate", "--config", str(CONFIGS / "shallow_diffuse/sd21_gpu.yaml"),
               f"--model.init_args.denoiser.init_args.model_dir={model_dir}"])
    assert rc == 2 and "cannot be built on the meta device" in capsys.readouterr().err
