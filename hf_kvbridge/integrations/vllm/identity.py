"""Whether an engine serves the bridge's own model, checked cheaply at start-up: digests of the model's config (its
parsed fields, less those a re-save rewrites) and of its tokenizer files, for the model vLLM loaded and for the model
the bridge names (`target_name_or_path` / `source_name_or_path` at its revision), never of the weights. Beside the
layout fingerprint (layers, heads, rotary), this catches a model of the same shape with another tokenizer or
another config (a fine-tune saved with a new vocabulary, a wrong folder of the same family). Needs no vLLM.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ...errors import ServingConfigError

CONFIG_FILE = "config.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
IDENTITY_FILES = (CONFIG_FILE, *TOKENIZER_FILES)
VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache"})
"""Config fields a load or re-save rewrites without changing the model: left out of its digest."""


def model_files(
    reference: str, revision: str | None = None, names=(CONFIG_FILE, *TOKENIZER_FILES)
) -> dict[str, bytes]:
    """The config and tokenizer files of a model (a folder, or a Hub id read from the local Hub cache; a file it does
    not have is left out), by name."""
    folder = Path(reference)
    out = {}
    for name in names:
        if folder.is_dir():
            path = folder / name
        else:
            try:
                from huggingface_hub import try_to_load_from_cache

                cached = try_to_load_from_cache(reference, name, revision=revision)
            except Exception:  # not a repo id: nothing to compare
                cached = None
            path = Path(cached) if isinstance(cached, str) else None
        if path is not None and path.is_file():
            out[name] = path.read_bytes()
    return out


def file_digests(files: dict[str, bytes]) -> dict[str, str]:
    """sha256 of each file, the config's of its parsed fields less `VOLATILE_CONFIG_KEYS`.

    Example:

    ```python
    >>> a = file_digests({"config.json": b'{"vocab_size": 8, "transformers_version": "5.0"}'})
    >>> a == file_digests({"config.json": b'{"transformers_version": "5.1", "vocab_size": 8}'})
    True
    ```
    """
    out = {}
    for name, data in files.items():
        if name == CONFIG_FILE:
            try:
                fields = {k: v for k, v in json.loads(data).items() if k not in VOLATILE_CONFIG_KEYS}
                data = json.dumps(fields, sort_keys=True).encode()
            except ValueError:
                pass  # compared as bytes
        out[name] = hashlib.sha256(data).hexdigest()
    return out


def identity_mismatch(served: dict[str, str], expected: dict[str, str]) -> str | None:
    """The files whose digests differ between the served model and the bridge's (compared where both have the file),
    or `None`."""
    differ = sorted(name for name in served.keys() & expected.keys() if served[name] != expected[name])
    return ", ".join(differ) if differ else None


def check_identity(model_config, config, side: str, bridge: str) -> None:
    """Refuses, with one line, an engine whose model's config or tokenizer files differ from those of the model the
    bridge names for `side` (`"target"` or `"source"`). `model_config` is vLLM's (`model`, `revision`, `tokenizer`,
    `tokenizer_revision`). Nothing to compare (a Hub model not in the local cache) is not a mismatch: the layout
    fingerprint still applies."""
    from ...loading import resolve_model_reference

    reference = getattr(config, f"{side}_name_or_path", None)
    if not reference:
        return
    revision = getattr(config, f"{side}_revision", None)
    expected = file_digests(model_files(resolve_model_reference(reference), revision))
    served_model = model_config.model
    served = model_files(served_model, getattr(model_config, "revision", None), names=(CONFIG_FILE,))
    tokenizer = getattr(model_config, "tokenizer", None) or served_model
    served |= model_files(tokenizer, getattr(model_config, "tokenizer_revision", None), names=TOKENIZER_FILES)
    served = file_digests(served)
    differ = identity_mismatch(served, expected)
    if differ is not None:
        raise ServingConfigError(
            f"KVBridgeConnector: the engine serves {served_model}, not the bridge {bridge}'s {side} {reference} "
            f"(they differ in {differ}): serve the bridge's own {side} (hf_kvbridge.integrations.vllm.served_model)"
        )
