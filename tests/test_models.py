"""Backbones, the ImageClassifier baseline and the registry."""

from __future__ import annotations

import pytest
import torch

from lowrank_lit import registry
from lowrank_lit.models.mlp import MLP
from lowrank_lit.models.vit import vit_factory, vit_tiny
from tests.helpers import quiet_trainer


def test_mlp_shapes_and_flatten():
    m = MLP(in_features=64, num_classes=10, hidden=[16])
    assert m(torch.randn(5, 1, 8, 8)).shape == (5, 10)
    assert sum(p.numel() for p in m.parameters()) == 64 * 16 + 16 + 16 * 10 + 10


@pytest.mark.parametrize(("kw", "needle"), [({"activation": "swish"}, "activation"), ({"dropout": 1.0}, "dropout"),
                                           ({"hidden": [0]}, "hidden")])
def test_mlp_bad_arguments(kw, needle):
    with pytest.raises(ValueError, match=needle):
        MLP(**kw)


def test_vit_tiny_geometry():
    torch.manual_seed(0)
    m = vit_tiny(num_classes=10, img_size=32, patch_size=4, in_chans=3)
    # ViT-Tiny: 12 blocks of width 192 with 3 heads; 8x8 = 64 patches + class token
    assert len(m.blocks) == 12 and m.embed_dim == 192 and m.blocks[0].attn.num_heads == 3
    assert m.pos_embed.shape == (1, 65, 192)
    assert sum(p.numel() for p in m.parameters()) == 5_362_762
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_vit_bad_geometry():
    with pytest.raises(ValueError, match="patch_size=5 must divide img_size=32"):
        vit_factory(patch_size=5)
    with pytest.raises(ValueError, match="global_pool"):
        vit_factory(global_pool="max")


@pytest.mark.e2e
def test_classifier_learns_a_separable_task():
    """A few steps of the real module on a linearly separable problem reach high accuracy."""
    import lightning.pytorch as pl

    from lowrank_lit.data import TensorDataModule
    from lowrank_lit.models.classifier import ImageClassifier

    pl.seed_everything(0)
    x = torch.randn(256, 8)
    y = (x[:, 0] > 0).long()
    dm = TensorDataModule(train=(x, y), val=(x, y), batch_size=32)
    model = ImageClassifier(MLP(8, 2, hidden=[16]), num_classes=2,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.5))
    trainer = quiet_trainer(max_epochs=10)
    trainer.fit(model, dm)
    assert trainer.callback_metrics["val/acc"] > 0.95
    assert trainer.callback_metrics["val/loss"] < 0.2


def test_classifier_scheduler_and_bad_args():
    from lowrank_lit.models.classifier import ImageClassifier

    model = ImageClassifier(
        MLP(4, 3, hidden=[4]), num_classes=3,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1), scheduler_interval="step",
    )
    cfg = model.configure_optimizers()
    assert isinstance(cfg["optimizer"], torch.optim.AdamW) and cfg["lr_scheduler"]["interval"] == "step"
    with pytest.raises(ValueError, match="scheduler_interval='batch'; allowed: epoch, step"):
        ImageClassifier(MLP(4, 3), num_classes=3, scheduler_interval="batch")
    with pytest.raises(ValueError, match="num_classes=1"):
        ImageClassifier(MLP(4, 3), num_classes=1)


def test_registry_rejects_bad_entries():
    with pytest.raises(ValueError, match="slug='Bad-Slug'"):
        registry.register_method("Bad-Slug", kind="Loss", paper="x")
    with pytest.raises(ValueError, match="kind='Thing'"):
        registry.register_method("ok_slug", kind="Thing", paper="x")
    with pytest.raises(KeyError, match="unknown method 'nope'"):
        registry.get_method("nope")


def test_registry_baseline_entry():
    registry.load_all()
    info = registry.get_method("baseline")
    assert info.target == "lowrank_lit.models.classifier.ImageClassifier"
    assert "configs/baseline/mlp_digits.yaml" in info.configs()


def test_prompt_checkpoints_hold_what_trains_and_reload_strictly(tmp_path):
    """A pretrained frozen backbone is left out of the checkpoint and put back from its source on loading."""
    from lowrank_lit.models.text import PromptTunedClassifier
    from lowrank_lit.nn.prompts import SoftPrompt

    def build():
        return PromptTunedClassifier(num_layers=1, prompt=SoftPrompt(prompt_len=4, hidden=384))

    torch.manual_seed(0)
    model = build()
    with torch.no_grad():
        model.head.weight.normal_()
        model.encoder.prompt.prompt_embeddings.add_(1.0)
    checkpoint = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(checkpoint)
    kept = set(checkpoint["state_dict"])
    assert kept == {k for k in model.state_dict() if not k.startswith(("encoder.backbone.", "encoder.layers."))}
    assert {"head.weight", "encoder.prompt.prompt_embeddings"} <= kept and checkpoint["frozen_backbone_omitted"]
    torch.manual_seed(1)
    fresh = build()
    fresh.on_load_checkpoint(checkpoint)
    fresh.load_state_dict(checkpoint["state_dict"], strict=True)  # strict: the backbone came back from the source
    ids, mask = torch.randint(1000, 2000, (2, 6)), torch.ones(2, 6, dtype=torch.long)
    model.eval(), fresh.eval()
    assert torch.equal(model(ids, mask)[0], fresh(ids, mask)[0])


def test_random_init_backbone_is_saved_whole():
    from lowrank_lit.models.text import PromptTunedLM

    cfg = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1}
    model = PromptTunedLM(backbone_config=cfg, tokenizer=None)
    checkpoint = {"state_dict": model.state_dict()}
    model.on_save_checkpoint(checkpoint)  # no source to read the weights from again: everything stays
    assert set(checkpoint["state_dict"]) == set(model.state_dict()) and "frozen_backbone_omitted" not in checkpoint
