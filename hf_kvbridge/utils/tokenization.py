"""Tokenizer identity: the one thing a bridged pair must share, so that token i means the same in both caches.

Two tokenizers are the same when they split every text into the same ids: same vocabulary (token → id), same
merges, same special and added tokens, same normalizer and pre-tokenizer. Identical tokenizers saved in different
folders compare equal; a tokenizer with the same vocabulary size but another vocabulary does not.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import KVLayoutError


def _backend(tokenizer) -> dict[str, Any]:
    """The fast tokenizer's own JSON description (model, normalizer, pre-tokenizer), or `{}` for a slow one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return json.loads(backend.to_str()) if backend is not None else {}


def _first_vocab_difference(a: dict[str, int], b: dict[str, int]) -> str | None:
    if len(a) != len(b):
        return f"vocabulary sizes {len(a)} vs {len(b)}"
    for token, index in sorted(a.items(), key=lambda item: item[1]):
        if b.get(token) != index:
            other = b.get(token)
            where = f"id {other}" if other is not None else "absent"
            return f"token {token!r} is id {index} in the first and {where} in the second"
    return None


def tokenizer_difference(first, second) -> str | None:
    """The first way `first` and `second` would tokenize differently, in words, or `None` when they are the same.

    Example:

    ```python
    >>> from tests.conftest import make_tokenizer  # doctest: +SKIP
    >>> tokenizer_difference(make_tokenizer(), make_tokenizer()) is None  # doctest: +SKIP
    True
    ```
    """
    difference = _first_vocab_difference(first.get_vocab(), second.get_vocab())
    if difference:
        return difference
    special = [(t, first.convert_tokens_to_ids(t)) for t in first.all_special_tokens]
    other_special = [(t, second.convert_tokens_to_ids(t)) for t in second.all_special_tokens]
    if sorted(special) != sorted(other_special):
        return f"special tokens {sorted(special)} vs {sorted(other_special)}"
    a, b = _backend(first), _backend(second)
    for part in ("model", "normalizer", "pre_tokenizer", "added_tokens"):
        if a.get(part) != b.get(part):
            if part == "model" and (a.get("model") or {}).get("merges") != (b.get("model") or {}).get("merges"):
                return "the BPE merges differ"
            return f"the tokenizers' {part.replace('_', '-')} settings differ"
    return None


def check_same_tokenizer(first, second, first_name: str, second_name: str) -> None:
    """Raises `KVLayoutError` naming both models and the first difference when their tokenizers differ."""
    difference = tokenizer_difference(first, second)
    if difference is not None:
        raise KVLayoutError(
            f"{first_name!r} and {second_name!r} use different tokenizers ({difference}); a bridge needs one shared "
            "tokenizer, so that token i means the same in both caches."
        )
