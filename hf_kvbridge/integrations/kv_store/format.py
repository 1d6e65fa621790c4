"""The stored chunk: per-token K/V of every layer for `chunk_size` tokens (fewer for a partial chunk's sub-chunks and
remainder), as one safetensors payload.

A chunk holds, for each layer `l`, tensors `layers.{l}.keys` and `layers.{l}.values` of shape `(kv_heads_l, tokens,
head_dim_l)`: keys as the model computed them (post-RoPE at the chunk's absolute positions `start .. start + tokens -
1`), values as they are; and `token_ids` `(tokens,)` (int64), the tokens they are of, so that a reader checks it takes
the K/V of its own tokens (`decode_chunk(..., token_ids=...)`). Layers may differ in shape; any dtype (bfloat16
included) is kept as it was written. Nothing depends on an engine's paged layout or device: a GPU bfloat16 source and a
CPU float32 target read the same bytes (`decode_chunk` returns CPU tensors in the stored dtype; the caller casts).

The safetensors metadata says what the payload is (`format`, `version`, `model_id`, `start`, `tokens`, `layers`)
and carries a CRC-32 of the tensor bytes (token ids included), so `decode_chunk` refuses anything else, or a damaged
payload, with a `StoreFormatError` instead of handing back wrong K/V.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Sequence

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from ...errors import InvalidInputError, StoreFormatError
from .keys import FORMAT_VERSION

FORMAT_NAME = "hf_kvbridge.kv"
"""The `format` field of a stored chunk's metadata."""


def _name(layer: int, kind: str) -> str:
    return f"layers.{layer}.{kind}"


TOKEN_IDS = "token_ids"
"""The name of a chunk's token-id tensor."""


def _crc32(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], token_ids: torch.Tensor) -> str:
    """CRC-32 of the tensors' bytes, layer by layer, keys then values, then the token ids (CPU, contiguous)."""
    crc = zlib.crc32(token_ids.reshape(-1).view(torch.uint8).numpy())
    for k, v in zip(keys, values, strict=True):
        for tensor in (k, v):
            crc = zlib.crc32(tensor.reshape(-1).view(torch.uint8).numpy(), crc)  # zero-copy view of the bytes
    return f"{crc:08x}"


def encode_chunk(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    *,
    model_id: str,
    start: int,
    token_ids: Sequence[int],
) -> bytes:
    """Serializes one chunk of K/V (every layer, the same tokens) for the store.

    Args:
        keys (list of `torch.Tensor`): per layer, `(kv_heads_l, tokens, head_dim_l)`, post-RoPE at absolute
            positions `start .. start + tokens - 1`; any device and dtype.
        values (list of `torch.Tensor`): per layer, the same shape as `keys[l]`.
        model_id (`str`): the identity of the model that computed them (`model_identity`).
        start (`int`): absolute position of the chunk's first token.
        token_ids (list of `int`): the chunk's tokens (as many as the K/V hold).

    Returns:
        `bytes`: a safetensors payload with the chunk's metadata.

    Example:

    ```python
    >>> k = [torch.randn(2, 4, 8)]
    >>> payload = encode_chunk(k, [torch.randn(2, 4, 8)], model_id="pocket-s", start=0, token_ids=[5, 6, 7, 8])
    >>> decode_chunk(payload, model_id="pocket-s", start=0, token_ids=[5, 6])[0][0].equal(k[0])
    True
    ```
    """
    if len(keys) != len(values) or not keys:
        raise InvalidInputError(f"encode_chunk needs keys and values for the same ≥ 1 layers, got {len(keys)} and "
                                f"{len(values)}")  # fmt: skip
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise InvalidInputError(f"start must be the chunk's first absolute position (an int ≥ 0), got {start!r}")
    tokens = keys[0].shape[1] if keys[0].dim() == 3 else -1
    ids = torch.tensor(list(token_ids), dtype=torch.int64)  # (tokens,)
    if ids.dim() != 1 or len(ids) != tokens:
        raise InvalidInputError(
            f"encode_chunk: {len(ids)} token ids for K/V of {tokens} tokens; pass the chunk's tokens"
        )
    tensors, seen, cpu_keys, cpu_values = {TOKEN_IDS: ids}, set(), [], []
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k.dim() != 3 or k.shape != v.shape or k.shape[1] != tokens:
            raise InvalidInputError(
                f"layer {layer}: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be (kv_heads, tokens, "
                f"head_dim) with the {tokens} tokens of layer 0"
            )
        pair = []
        for tensor in (k, v):
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.untyped_storage().data_ptr() in seen:  # safetensors refuses tensors that share memory
                tensor = tensor.clone()
            seen.add(tensor.untyped_storage().data_ptr())
            pair.append(tensor)
        tensors[_name(layer, "keys")], tensors[_name(layer, "values")] = pair
        cpu_keys.append(pair[0])
        cpu_values.append(pair[1])
    metadata = {
        "format": FORMAT_NAME,
        "version": str(FORMAT_VERSION),
        "model_id": model_id,
        "start": str(start),
        "tokens": str(tokens),
        "layers": str(len(keys)),
        "crc32": _crc32(cpu_keys, cpu_values, ids),
    }
    return safetensors_save(tensors, metadata=metadata)


def read_metadata(payload: bytes) -> dict[str, str]:
    """The metadata of a stored chunk (safetensors' `__metadata__`), without reading its tensors.

    Raises `StoreFormatError` for anything that is not a complete safetensors payload.
    """
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise StoreFormatError(f"a stored chunk is bytes, got {type(payload).__name__}")
    if len(payload) < 8:
        raise StoreFormatError(f"the stored chunk is {len(payload)} bytes, too short to be a chunk (truncated?)")
    (header_len,) = struct.unpack("<Q", bytes(payload[:8]))
    if header_len > len(payload) - 8:
        raise StoreFormatError(
            f"the stored chunk is truncated or not a chunk: its header says {header_len:,} bytes, "
            f"{len(payload) - 8:,} follow"
        )
    try:
        header = json.loads(bytes(payload[8 : 8 + header_len]))
    except (UnicodeDecodeError, ValueError):
        raise StoreFormatError("the stored chunk's header is not JSON: not a chunk, or corrupt bytes") from None
    if not isinstance(header, dict):
        raise StoreFormatError("the stored chunk's header is not a safetensors header: not a chunk")
    ends = [entry.get("data_offsets", [0, 0])[1] for name, entry in header.items() if name != "__metadata__"
            and isinstance(entry, dict)]  # fmt: skip
    if 8 + header_len + max(ends, default=0) != len(payload):
        raise StoreFormatError(
            f"the stored chunk is truncated or has trailing bytes: its tensors end at byte "
            f"{8 + header_len + max(ends, default=0):,}, the payload has {len(payload):,}"
        )
    metadata = header.get("__metadata__")
    return metadata if isinstance(metadata, dict) else {}


def _check_metadata(metadata: dict[str, str], model_id: str, start: int | None) -> tuple[int, int, int]:
    """`(start, tokens, layers)` of a chunk whose metadata fits this format, model and start; else raises."""
    if metadata.get("format") != FORMAT_NAME:
        raise StoreFormatError(
            f"the stored entry is not an hf_kvbridge K/V chunk (format {metadata.get('format')!r}, expected "
            f"{FORMAT_NAME!r}); another program wrote this key, or the key prefix is shared"
        )
    version = metadata.get("version", "")
    if version != str(FORMAT_VERSION):
        newer = version.isdigit() and int(version) > FORMAT_VERSION
        raise StoreFormatError(
            f"the stored chunk has format version {version!r}, this hf_kvbridge reads version {FORMAT_VERSION}; "
            + ("upgrade hf_kvbridge on this engine" if newer else "re-export the prompt with this version")
        )
    if metadata.get("model_id") != model_id:
        raise StoreFormatError(
            f"the stored chunk holds K/V of model {metadata.get('model_id')!r}, not {model_id!r}; "
            "look it up with the model identity that wrote it"
        )
    try:
        stored_start, tokens, layers = (int(metadata[name]) for name in ("start", "tokens", "layers"))
    except (KeyError, ValueError):
        raise StoreFormatError(f"the stored chunk's metadata lacks start/tokens/layers: {metadata}") from None
    if start is not None and stored_start != start:
        raise StoreFormatError(
            f"the stored chunk starts at token {stored_start}, expected {start}: the key does not match its data"
        )
    if tokens < 1 or layers < 1:
        raise StoreFormatError(f"the stored chunk says {tokens} tokens and {layers} layers; expected ≥ 1 of each")
    return stored_start, tokens, layers


def decode_chunk(
    payload: bytes, *, model_id: str, start: int | None = None, token_ids: Sequence[int] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Reads a chunk written by `encode_chunk`, after checking it is one of `model_id` starting at `start`.

    Args:
        payload (`bytes`): the stored bytes.
        model_id (`str`): the model identity the caller expects.
        start (`int`, *optional*): the absolute position the caller expects the chunk to start at.
        token_ids (list of `int`, *optional*): the tokens the caller will take from the chunk: the chunk's first
            tokens must be these (it may hold more).

    Returns:
        `(keys, values)`: per layer, CPU tensors `(kv_heads_l, tokens, head_dim_l)` in the stored dtype.

    Raises:
        `StoreFormatError`: not this format, another version, another model or start, truncated or corrupt bytes,
            shapes that do not agree with the metadata or with each other, tokens other than `token_ids`.
    """
    metadata = read_metadata(payload)
    _, tokens, layers = _check_metadata(metadata, model_id, start)
    try:
        tensors = safetensors_load(bytes(payload))
    except Exception as err:  # safetensors' own error type differs between versions
        raise StoreFormatError(f"the stored chunk's tensors cannot be read ({err}): corrupt bytes") from None
    expected = {TOKEN_IDS} | {_name(layer, kind) for layer in range(layers) for kind in ("keys", "values")}
    if set(tensors) != expected:
        raise StoreFormatError(
            f"the stored chunk's tensors {sorted(tensors)[:4]}... do not match its {layers} layers "
            "(layers.{l}.keys / layers.{l}.values)"
        )
    keys = [tensors[_name(layer, "keys")] for layer in range(layers)]
    values = [tensors[_name(layer, "values")] for layer in range(layers)]
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k.dim() != 3 or k.shape != v.shape or k.shape[1] != tokens:
            raise StoreFormatError(
                f"the stored chunk's layer {layer} has keys {tuple(k.shape)} and values {tuple(v.shape)}, expected "
                f"both (kv_heads, {tokens}, head_dim)"
            )
    ids = tensors[TOKEN_IDS]
    if ids.dim() != 1 or len(ids) != tokens or ids.dtype != torch.int64:
        raise StoreFormatError(
            f"the stored chunk's token ids are {tuple(ids.shape)} {ids.dtype}, expected ({tokens},)"
        )
    if metadata.get("crc32") != _crc32(keys, values, ids):
        raise StoreFormatError("the stored chunk's tensor bytes fail their CRC-32 check: corrupt bytes")
    if token_ids is not None:
        wanted = list(token_ids)
        if len(wanted) > tokens or ids[: len(wanted)].tolist() != wanted:
            raise StoreFormatError(
                f"the stored chunk at token {metadata.get('start')} holds other tokens than the {len(wanted)} asked "
                "for (replaced since the lookup, or another sequence's): not used"
            )
    return keys, values
