"""The pocket family: tiny real Qwen3 language models and text splits shipped inside ``hf_kvbridge``.

The models share one byte-level BPE tokenizer (vocab 4096). ``pocket-s``, ``pocket-m`` and ``pocket-l`` also share
their KV-cache layout (2 KV heads x head_dim 32) and differ in depth and width, so a KV cache of one can be mapped
into another. ``pocket-x`` has a different KV layout (4 KV heads x head_dim 16): the pairs with another layout.
They were trained from scratch on the Python 3.11 documentation (PSF-2.0) by ``studies/train_pocket.py``
(in a checkout; not shipped).

This module imports nothing heavy; load the models with ``transformers`` yourself::

    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from hf_kvbridge.pocket import POCKET_MODELS, load_texts, model_path
    >>> POCKET_MODELS
    ('pocket-s', 'pocket-m', 'pocket-l', 'pocket-x')
    >>> model = AutoModelForCausalLM.from_pretrained(model_path("pocket-s"))  # doctest: +SKIP
    >>> tokenizer = AutoTokenizer.from_pretrained(model_path("pocket-s"))  # doctest: +SKIP
    >>> texts = load_texts("calibration")  # documents for fitting KV mappers; never use "heldout" for that
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from ..errors import InvalidInputError

__all__ = ["POCKET_MODELS", "SPLITS", "data_path", "load_documents", "load_model", "load_texts", "model_path"]

POCKET_MODELS: tuple[str, ...] = ("pocket-s", "pocket-m", "pocket-l", "pocket-x")
"""Names of the shipped models, smallest of the 2 x 32 layout first; ``pocket-x`` has another KV layout (4 x 16)."""

SPLITS: tuple[str, ...] = ("calibration", "heldout")
"""Names of the shipped text splits. No pocket model was trained on either."""

_ROOT = Path(__file__).resolve().parent


def model_path(name: str) -> Path:
    """Return the folder of a shipped pocket model, ready for ``from_pretrained``.

    Args:
        name: one of :data:`POCKET_MODELS`.

    Raises:
        InvalidInputError: (a `ValueError`) for an unknown name (the message lists the available models).
        FileNotFoundError: if the model is known but its files are missing from this installation.

    Example::

        >>> model_path("pocket-m").name
        'pocket-m'
    """
    if name not in POCKET_MODELS:
        raise InvalidInputError(f"unknown pocket model {name!r}; available: {', '.join(POCKET_MODELS)}")
    folder = _ROOT / "models" / name
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"pocket model {name!r} is not installed at {folder}; reinstall hf_kvbridge (its wheel ships the pocket "
            "models)"
        )
    return folder


def data_path(split: str) -> Path:
    """Return the path of a shipped split file (``data/<split>.jsonl.gz``).

    Raises:
        InvalidInputError: (a `ValueError`) for a split not in :data:`SPLITS`.
    """
    if split not in SPLITS:
        raise InvalidInputError(f"unknown split {split!r}; available: {', '.join(SPLITS)}")
    return _ROOT / "data" / f"{split}.jsonl.gz"


def load_documents(split: str) -> list[dict[str, str]]:
    """Load a shipped split as ``{"text": ..., "source": ...}`` dicts, one per documentation file.

    ``source`` is the file's path relative to the documentation's ``_sources`` folder.

    Example::

        >>> docs = load_documents("heldout")
        >>> sorted(docs[0])
        ['source', 'text']
    """
    with gzip.open(data_path(split), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_model(name: str):
    """A shipped pocket model in float32, in eval mode (transformers is imported here, not at module import).

    Example::

        >>> load_model("pocket-s").config.num_hidden_layers  # doctest: +SKIP
        3
    """
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path(name), dtype=torch.float32).eval()


def load_texts(split: str) -> list[str]:
    """Load the documents of a shipped split as plain strings.

    Args:
        split: ``"calibration"`` (for fitting KV-cache mappers) or ``"heldout"`` (for final evaluation only;
            never seen by any model or calibration run).

    Raises:
        InvalidInputError: (a `ValueError`) for an unknown split (the message lists the available ones).

    Example::

        >>> texts = load_texts("calibration")
        >>> isinstance(texts[0], str) and len(texts) > 10
        True
    """
    return [doc["text"] for doc in load_documents(split)]
