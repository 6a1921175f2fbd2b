"""Full size without the memory: the configs' architectures instantiated on the ``meta`` device at full size, their
parameter counts checked against the published ones (hub models from ``config.json`` fixtures with the public values)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

HUB = Path(__file__).parent / "hub_configs"


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("name", "published"), [
    ("Llama-3.2-1B", 1_235_814_400),   # pt_moe/llama_1b_gpu.yaml
    ("Llama-2-7b-hf", 6_738_415_616),  # lope/llama_gpu.yaml
    ("Qwen2.5-0.5B", 494_032_768),     # skrull/sft_jsonl_gpu.yaml
    ("gpt-neo-2.7B", 2_651_307_520),   # icl_rank_retriever/gptneo_score_gpu.yaml
])
def test_hub_causal_lm_parameter_count(name, published):
    from transformers import AutoConfig, AutoModelForCausalLM

    values = json.loads((HUB / f"{name}.json").read_text())
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert _count(model) == published


def test_bert_base_tower_parameter_count():  # icl_rank_retriever/gptneo_gpu.yaml: two of them
    from transformers import AutoConfig, AutoModel

    values = json.loads((HUB / "bert-base-uncased.json").read_text())
    with torch.device("meta"):
        model = AutoModel.from_config(AutoConfig.for_model(values.pop("model_type"), **values))
    assert _count(model) == 109_482_240


def test_stable_diffusion_21_unet_parameter_count():  # shallow_diffuse/sd21_gpu.yaml
    from diffusers import UNet2DConditionModel

    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(json.loads((HUB / "stable-diffusion-2-1-base_unet.json").read_text()))
    assert _count(unet) == 865_910_724


def test_trust_vmamba_t_config_is_the_official_vmamba_t():
    """The TRUST ImageNet-C config's backbone, built from the config file itself: 30,249,064 parameters (30 M)."""
    import yaml

    from lowrank_lit.models.vmamba import TinyVMamba
    from tests.helpers import CONFIGS

    args = yaml.safe_load((CONFIGS / "trust" / "vmamba_tiny_imagenetc_gpu.yaml").read_text())["model"]["init_args"]["model"]
    assert args["class_path"] == "lowrank_lit.models.vmamba.TinyVMamba"
    with torch.device("meta"):
        model = TinyVMamba(**args["init_args"])
    assert _count(model) == 30_249_064


def test_galore_60m_llama_config_size():
    """is_lowrank/llama_gpu.yaml and nanoadam/llama_gpu.yaml: GaLore's 60M Llama shape with a 256-byte vocabulary."""
    import yaml

    from lowrank_lit.models.lm import llama
    from tests.helpers import CONFIGS

    for config in ("is_lowrank/llama_gpu.yaml", "nanoadam/llama_gpu.yaml"):
        args = yaml.safe_load((CONFIGS / config).read_text())["model"]["init_args"]["backbone"]["init_args"]
        with torch.device("meta"):
            model = llama(**args)
        d, m, layers, vocab = 512, 1376, 8, 256
        per_layer = 4 * d * d + 3 * d * m + 2 * d  # q k v o, gate up down, two RMSNorms
        assert _count(model) == layers * per_layer + 2 * vocab * d + d == 25_567_744, config  # + embedding, head, norm
