"""Artifacts: only what a run trained, in safetensors, applied onto a base that is checked to be the right one.

An artifact folder holds

* ``artifact.safetensors`` -- the state-dict entries that training changed, against the model the run's config
  builds before training (same seed, same pretrained parts). An entry where few values changed (NanoAdam's sparse
  updates) is stored sparse: ``<key>@indices`` (int64, flat positions) and ``<key>@values`` (the trained values
  there, not differences, so applying it gives the trained tensor bit for bit);
* ``artifact.json`` -- ``format``, the model section of the config (``class_path`` / ``init_args``) and its
  ``seed_everything``, the method, the checkpoint it came from and its step, the stored entries (shape, dtype,
  dense or sparse) and the base: a digest of every other entry of the base's state dict, so a wrong base is named
  by its first differing key.

:func:`save_artifact` writes one (never into a folder that holds files); :func:`read_artifact` reads it back, one
line of :class:`ArtifactError` for a missing, truncated or foreign file; :func:`apply_artifact` checks the base
and writes the entries into it. ``lowrank export`` / ``lowrank load`` (:mod:`lowrank_lit.launch.export`) build the
base from a config and add the ecosystem's formats (``peft``, ``hf``).

Shapes: a sparse entry of a tensor of shape ``S`` stores ``indices (n,)`` into ``S`` flattened and ``values (n,)``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "ArtifactError", "FORMAT", "TENSORS", "META", "tensor_digest", "digests_digest", "state_digest", "changed_entries", "save_artifact",
    "read_artifact", "apply_artifact", "load_artifact", "artifact_bytes", "aliases", "flatten_state",
    "unflatten_state", "save_state", "load_state",
]

#: the ``format`` field of ``artifact.json``
FORMAT = "lowrank_lit.artifact/1"
TENSORS = "artifact.safetensors"
META = "artifact.json"
#: an entry is stored sparse when at most this share of its values changed
SPARSE_SHARE = 0.5


class ArtifactError(ValueError):
    """An artifact that cannot be read or does not fit the base; the message is one line."""


def tensor_digest(t: torch.Tensor) -> str:
    """A 16-hex-digit SHA-256 digest of a tensor's dtype, shape and bytes (CPU, contiguous)."""
    t = t.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def digests_digest(digests: Mapping[str, str]) -> str:
    """One 16-hex-digit digest of named tensor digests (names included, in sorted order)."""
    return hashlib.sha256("".join(f"{k}={d};" for k, d in sorted(digests.items())).encode()).hexdigest()[:16]


def state_digest(state: Mapping[str, Any]) -> str:
    """One digest of every tensor of a state dict (names included): :func:`digests_digest` of the
    :func:`tensor_digest` of each entry."""
    return digests_digest({k: tensor_digest(v) for k, v in state.items() if isinstance(v, torch.Tensor)})


def _view_id(t: torch.Tensor) -> tuple[int, int, tuple[int, ...], tuple[int, ...]]:
    """What tells two state-dict names of one tensor apart from two tensors: storage, offset, shape, strides."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()))


def aliases(state: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """``{second name: first name}`` for the names of a state dict that view the same tensor."""
    first: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.numel():
            view = _view_id(value)
            if view in first:
                out[key] = first[view]
            else:
                first[view] = key
    return out


def changed_entries(trained: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
                    sparse_share: float = SPARSE_SHARE) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, Any]]]:
    """The entries of ``trained`` that differ from ``base``, packed for :func:`save_artifact`.

    Args:
        trained: the trained state dict (a checkpoint's ``state_dict``; it may omit frozen entries).
        base: the state dict before training (the model the config builds).
        sparse_share: store an entry sparse when at most this share of its values changed.

    Returns:
        (tensors to save, per-key description ``{"shape", "dtype", "storage": "dense" | "sparse", "changed"}``).

    Raises:
        ArtifactError: a trained key is missing from the base or has another shape or dtype (another model).
    """
    tensors: dict[str, torch.Tensor] = {}
    entries: dict[str, dict[str, Any]] = {}
    seen: set[tuple[int, int, tuple[int, ...], tuple[int, ...]]] = set()
    for key, value in trained.items():
        if not isinstance(value, torch.Tensor):
            continue
        view = _view_id(value)
        if view in seen:  # another name of a tensor already taken (a module registered under two names)
            continue
        seen.add(view)
        ref = base.get(key)
        if ref is None:
            raise ArtifactError(f"key {key!r} of the trained state is not in the base model the config builds")
        if ref.shape != value.shape or ref.dtype != value.dtype:
            raise ArtifactError(f"key {key!r}: trained {tuple(value.shape)} {value.dtype}, base {tuple(ref.shape)} "
                                f"{ref.dtype}: the config does not build the trained model")
        value = value.detach().to("cpu")
        diff = value.ne(ref.detach().to("cpu")).reshape(-1)  # (numel,)
        n = int(diff.sum())
        if n == 0:
            continue
        meta = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."), "changed": n}
        if n <= sparse_share * value.numel() and value.numel() > 1:
            idx = diff.nonzero().reshape(-1)  # (n,)
            tensors[f"{key}@indices"] = idx.to(torch.int64)
            tensors[f"{key}@values"] = value.reshape(-1)[idx].clone()
            meta["storage"] = "sparse"
        else:
            tensors[key] = value.contiguous().clone()
            meta["storage"] = "dense"
        entries[key] = meta
    return tensors, entries


def save_artifact(out: str | os.PathLike, tensors: Mapping[str, torch.Tensor], entries: Mapping[str, Any],
                  base: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> Path:
    """Write ``artifact.safetensors`` and ``artifact.json`` into ``out`` (created; refused if it holds an artifact).

    Args:
        tensors, entries: from :func:`changed_entries`.
        base: the base state dict (its entries not in ``entries`` are digested into ``artifact.json``).
        meta: further fields of ``artifact.json`` (model section, method, source checkpoint, ...).
    """
    from safetensors.torch import save_file

    out = Path(out)
    if out.exists() and (not out.is_dir() or (out / TENSORS).exists() or (out / META).exists()):
        raise ArtifactError(f"out={str(out)!r} already holds an artifact; an export never overwrites files: pick "
                            "a new folder")
    out.mkdir(parents=True, exist_ok=True)
    alias = aliases(base)
    frozen = {k: tensor_digest(v) for k, v in base.items()
              if k not in entries and alias.get(k) not in entries and isinstance(v, torch.Tensor)}
    total = digests_digest(frozen)
    doc = {"format": FORMAT, **meta, "entries": dict(entries), "base": {"digest": total, "tensors": frozen}}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / TENSORS))
    (out / META).write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return out


def _is_entry(e: Any) -> bool:
    return (isinstance(e, dict) and isinstance(e.get("shape"), list) and all(isinstance(n, int) for n in e["shape"])
            and isinstance(e.get("dtype"), str) and e.get("storage", "dense") in ("dense", "sparse"))


#: the fields of artifact.json that loading reads: name -> (required, check, what is allowed)
_FIELDS: dict[str, tuple[bool, Any, str]] = {
    "model": (False, lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("class_path"), str)),
              "a mapping with the class_path of the model, or null"),
    "entries": (True, lambda v: isinstance(v, dict) and all(isinstance(k, str) and _is_entry(e) for k, e in v.items()),
                "a mapping of tensor names to {shape: [int, ...], dtype: str, storage: dense or sparse}"),
    "base": (True, lambda v: isinstance(v, dict) and isinstance(v.get("digest"), str) and isinstance(v.get("tensors"), dict),
             "a mapping with digest (a string) and tensors (a mapping)"),
    "formats": (False, lambda v: isinstance(v, list) and all(isinstance(f, str) for f in v), "a list of format names"),
    "seed_everything": (False, lambda v: v is None or isinstance(v, int), "an integer, true, false or null"),
    "data": (False, lambda v: v is None or isinstance(v, dict), "a mapping or null"),
    "backbone": (False, lambda v: v is None or isinstance(v, dict | str), "a mapping, a string or null"),
    "source": (False, lambda v: isinstance(v, dict), "a mapping"),
}


def _check_fields(meta: dict[str, Any], meta_file: Path) -> None:
    """Each field of artifact.json that loading reads has the type `lowrank export` writes: else one line naming it."""
    for name, (required, ok, allowed) in _FIELDS.items():
        if name not in meta:
            if required:
                raise ArtifactError(f"artifact {str(meta_file)!r} lacks the field {name!r} ({allowed})")
            continue
        if not ok(meta[name]):
            raise ArtifactError(f"artifact {str(meta_file)!r}: field {name!r} is {json.dumps(meta[name])[:60]}; "
                                f"allowed: {allowed}")


def read_artifact(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``(artifact.json, tensors)`` of an artifact folder.

    Raises:
        ArtifactError: the folder or a file is missing, truncated or not an artifact (one line naming the file).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    meta_file, tensor_file = folder / META, folder / TENSORS
    for f in (meta_file, tensor_file):
        if not f.is_file():
            raise ArtifactError(f"artifact {str(folder)!r}: {f.name} is missing (write one with `lowrank export`)")
    try:
        meta = json.loads(meta_file.read_text())
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"artifact {str(meta_file)!r} is truncated or not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(meta, dict):
        raise ArtifactError(f"artifact {str(meta_file)!r} holds a JSON {type(meta).__name__}; allowed: the object "
                            "`lowrank export` writes")
    if meta.get("format") != FORMAT:
        raise ArtifactError(f"artifact {str(meta_file)!r}: format {meta.get('format')!r}; this version reads {FORMAT!r}")
    _check_fields(meta, meta_file)
    try:
        tensors = load_file(str(tensor_file))
    except (SafetensorError, OSError, ValueError) as exc:
        size = tensor_file.stat().st_size
        raise ArtifactError(f"artifact {str(tensor_file)!r} is truncated or not a safetensors file ({size} bytes: "
                            f"{str(exc).splitlines()[0]})") from None
    for key, entry in meta.get("entries", {}).items():
        names = [f"{key}@indices", f"{key}@values"] if entry.get("storage") == "sparse" else [key]
        missing = [n for n in names if n not in tensors]
        if missing:
            raise ArtifactError(f"artifact {str(tensor_file)!r} lacks {missing[0]!r}, which {META} lists")
    return meta, tensors


def apply_artifact(module: nn.Module, meta: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                   check_base: bool = True) -> nn.Module:
    """Write an artifact's entries into ``module`` (in place) after checking that ``module`` is its base.

    Args:
        module: the base: the model the artifact's config builds (or one with the same weights).
        meta, tensors: from :func:`read_artifact`.
        check_base: compare every other entry's digest with the one stored at export (reads all weights once).

    Raises:
        ArtifactError: a stored key is not in ``module``, has another shape or dtype, or a base entry differs from
            the export's base (the first such key is named).
    """
    state = module.state_dict()
    entries = meta["entries"]
    _check_backbone_config(module, meta.get("backbone"))
    for key in sorted(entries):
        entry = entries[key]
        if key not in state:
            raise ArtifactError(f"wrong base: the artifact's key {key!r} is not in {type(module).__name__}")
        target = state[key]
        if list(target.shape) != entry["shape"] or str(target.dtype).removeprefix("torch.") != entry["dtype"]:
            raise ArtifactError(f"wrong base at {key!r}: the artifact holds {tuple(entry['shape'])} {entry['dtype']}, "
                                f"the base {tuple(target.shape)} {str(target.dtype).removeprefix('torch.')}")
    if check_base:  # a base with more parts (layers) than the export's: the artifact would apply to part of it
        known = set(entries) | set(meta["base"]["tensors"])
        alias = aliases(state)
        extra = sorted(k for k in state if k not in known and alias.get(k) not in known)
        if extra:
            more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
            raise ArtifactError(f"wrong base: {extra[0]!r}{more} is not in the export's base; the base has parts the "
                                "artifact was not exported against")
    if check_base:
        for key, digest in sorted(meta["base"]["tensors"].items()):
            if key not in state:
                raise ArtifactError(f"wrong base: {key!r} of the export's base is not in {type(module).__name__}")
            if tensor_digest(state[key]) != digest:
                raise ArtifactError(f"wrong base at {key!r}: its weights differ from those the artifact was exported "
                                    "against (another checkpoint, seed or model)")
    with torch.no_grad():
        for key, entry in entries.items():
            target = state[key]
            if entry["storage"] == "sparse":
                idx, values = tensors[f"{key}@indices"], tensors[f"{key}@values"]
                flat = target.view(-1) if target.is_contiguous() else None
                if flat is None:
                    raise ArtifactError(f"base entry {key!r} is not contiguous; cannot apply a sparse entry")
                flat[idx.to(target.device)] = values.to(target.device, target.dtype)
            else:
                target.copy_(tensors[key].to(target.device, target.dtype))
    return module


def _check_backbone_config(module: nn.Module, backbone: Mapping[str, Any] | None) -> None:
    """The transformers backbone inside ``module`` has every config field the artifact states (``artifact.json``'s
    ``backbone.config``: what the run changed, e.g. ``num_hidden_layers``).

    Raises:
        ArtifactError: one line naming the first field that differs.
    """
    if not backbone or not backbone.get("config"):
        return
    found = next((m for m in module.modules() if hasattr(m, "config") and hasattr(m.config, "to_dict")
                  and hasattr(m, "name_or_path")), None)
    if found is None:
        raise ArtifactError(f"wrong base: {type(module).__name__} holds no transformers model; the artifact was "
                            f"exported from {backbone.get('name') or 'a transformers model'}")
    have = found.config.to_dict()
    for field_name, want in sorted(backbone["config"].items()):
        if have.get(field_name) != want:
            raise ArtifactError(f"wrong base: backbone config {field_name}={have.get(field_name)!r}; the artifact needs "
                                f"{field_name}={want!r} (base {backbone.get('name') or 'built from its config'})")


def load_artifact(path: str | os.PathLike, base: nn.Module, check_base: bool = True) -> nn.Module:
    """Apply the artifact in folder ``path`` onto ``base`` (in place) and return it (see :func:`apply_artifact`)."""
    meta, tensors = read_artifact(path)
    return apply_artifact(base, meta, tensors, check_base=check_base)


def artifact_bytes(path: str | os.PathLike) -> int:
    """Bytes of every file in an artifact folder."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


# ------------------------------------------------------------------------------ nested states (TTA streams)
#: the ``format`` field of a nested state's JSON (``state.json``)
STATE_FORMAT = "lowrank_lit.state/1"


def flatten_state(obj: Any, prefix: str = "s") -> tuple[dict[str, torch.Tensor], Any]:
    """A nested state (dicts with any keys, lists, tuples, tensors, numbers, strings, None) as ``(tensors by path,
    JSON skeleton)``: each tensor becomes ``{"__tensor__": path}``; dicts become ``{"__dict__": [[key, value],
    ...]}`` (keys keep their type), tuples ``{"__tuple__": [...]}``. :func:`unflatten_state` inverts it."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors[path] = x.detach().to("cpu").contiguous().clone()
            return {"__tensor__": path}
        if isinstance(x, dict):
            return {"__dict__": [[k, walk(v, f"{path}.{i}")] for i, (k, v) in enumerate(x.items())]}
        if isinstance(x, (list, tuple)):
            items = [walk(v, f"{path}.{i}") for i, v in enumerate(x)]
            return {"__tuple__": items} if isinstance(x, tuple) else items
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        raise ArtifactError(f"flatten_state: {path} is a {type(x).__name__}; allowed: tensors, dicts, lists, tuples, "
                            "numbers, strings, None")

    return tensors, walk(obj, prefix)


def unflatten_state(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The nested state :func:`flatten_state` described."""
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__tuple__" in skeleton:
            return tuple(unflatten_state(v, tensors) for v in skeleton["__tuple__"])
        return {k if not isinstance(k, list) else tuple(k): unflatten_state(v, tensors) for k, v in skeleton["__dict__"]}
    return skeleton


def save_state(folder: str | os.PathLike, obj: Any, meta: Mapping[str, Any]) -> Path:
    """Write a nested state as ``state.safetensors`` + ``state.json`` into a new folder (never over one)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if (folder / "state.json").exists():
        raise ArtifactError(f"{str(folder)!r} already holds a state; it is never overwritten")
    tensors, skeleton = flatten_state(obj)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "state.safetensors"))
    (folder / "state.json").write_text(json.dumps({"format": STATE_FORMAT, **meta, "state": skeleton}) + "\n")
    return folder


def load_state(folder: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(state, meta)`` of a :func:`save_state` folder; one line of :class:`ArtifactError` when broken."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    meta_file, tensor_file = folder / "state.json", folder / "state.safetensors"
    for f in (meta_file, tensor_file):
        if not f.is_file():
            raise ArtifactError(f"state {str(folder)!r}: {f.name} is missing")
    try:
        meta = json.loads(meta_file.read_text())
        tensors = load_file(str(tensor_file))
    except json.JSONDecodeError as exc:
        raise ArtifactError(f"{str(meta_file)!r} is truncated or not JSON ({exc.msg})") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise ArtifactError(f"{str(tensor_file)!r} is truncated or not a safetensors file "
                            f"({str(exc).splitlines()[0]})") from None
    if meta.get("format") != STATE_FORMAT:
        raise ArtifactError(f"{str(meta_file)!r}: format {meta.get('format')!r}; this version reads {STATE_FORMAT!r}")
    skeleton = meta.pop("state")
    try:
        return unflatten_state(skeleton, tensors), meta
    except KeyError as exc:
        raise ArtifactError(f"{str(tensor_file)!r} lacks {exc.args[0]!r}, which state.json lists") from None
