"""The stored chunk: per-token K/V of every layer for `chunk_size` tokens (fewer for a partial chunk's sub-chunks and
remainder), as one safetensors payload.

A chunk holds, for each layer `l`, tensors `layers.{l}.keys` and `layers.{l}.values` of shape `(kv_heads_l, tokens,
head_dim_l)`: keys as the model computed them (post-RoPE at the chunk's absolute positions `start .. start + tokens -
1`), values as they are, in the chunk's encoding (`encodings.py`: the source's dtype, bfloat16, or fp8 codes with
`layers.{l}.keys_scale` / `values_scale` beside them); and `token_ids` `(tokens,)` (int64), the tokens they are of, so
that a reader checks it takes the K/V of its own tokens (`decode_chunk(..., token_ids=...)`). Layers may differ in
shape. Nothing depends on an engine's paged layout or device: a GPU bfloat16 source and a CPU float32 target read the
same bytes (`decode_chunk` returns CPU tensors; the caller casts).

The safetensors metadata says what the payload is (`format`, `version`, `model_id`, `start`, `tokens`, `layers`,
`encoding`, the source `dtype`) and carries a checksum of the tensor bytes (token ids included), so `decode_chunk`
refuses anything else, or a damaged payload, with a `StoreFormatError` instead of handing back wrong K/V.

Version 3 (written now) checks its bytes with XXH3-64 (`xxhash`, several GB/s: a fraction of a copy) over the whole
tensor region in one pass; version 2 (written before, the source's dtype only) with CRC-32 (zlib), and is still read.
`decode_chunk` reads the tensors as views into the received payload (`torch.frombuffer`): no per-chunk copy.
"""

from __future__ import annotations

import json
import struct
import warnings
import zlib
from collections.abc import Sequence

import numpy as np
import torch

from ...errors import InvalidInputError, MissingDependencyError, StoreFormatError
from .encodings import (
    DEFAULT_ENCODING,
    ENCODINGS,
    SCALE_SUFFIX,
    check_encoding,
    check_stored,
    decode_tensor,
    encode_tensor,
)

FORMAT_NAME = "hf_kvbridge.kv"
"""The `format` field of a stored chunk's metadata."""

CHUNK_VERSION = 3
"""The version of the chunk format `encode_chunk` writes (3: encodings and the XXH3-64 checksum). The keys keep
`keys.FORMAT_VERSION` (2): a chunk written by version 2 is found under the same key and still read."""

READ_VERSIONS = (2, 3)
"""The chunk format versions `decode_chunk` reads."""

TOKEN_IDS = "token_ids"
"""The name of a chunk's token-id tensor."""

_PLACEHOLDER = "0" * 16  # an XXH3-64 digest's length in hex

# the dtypes of safetensors' header, and back
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "I8": torch.int8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}  # fmt: skip
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}

# The payload is the server's immutable reply: its tensors are read-only views, which every reader copies or casts
# (`PrefixKVStore` joins them). torch warns once per program about views of read-only buffers: that once is spent
# here, where it is known to be harmless.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


def _name(layer: int, kind: str) -> str:
    return f"layers.{layer}.{kind}"


def _xxh3():
    try:
        import xxhash
    except ImportError:
        raise MissingDependencyError(
            "the KV store's chunk checksum needs xxhash: pip install 'hf-kvbridge[store]' (or pip install xxhash)"
        ) from None
    return xxhash.xxh3_64_hexdigest


def _crc32(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], token_ids: torch.Tensor) -> str:
    """Version 2's checksum: CRC-32 of the tensors' bytes, layer by layer, keys then values, then the token ids."""
    crc = zlib.crc32(_bytes_of(token_ids))
    for k, v in zip(keys, values, strict=True):
        for tensor in (k, v):
            crc = zlib.crc32(_bytes_of(tensor), crc)
    return f"{crc:08x}"


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for a CPU `dst` of `src`'s shape and dtype; a CPU `src` (any strides with the last
    dimension's 1) is copied by numpy, one thread: torch's copy spreads a few hundred KB over its intra-op threads,
    and on a busy host (an engine's) the writer then waits for threads the engine holds."""
    if src.device.type != "cpu" or src.dim() == 0 or src.stride(-1) != 1 or src.dtype == torch.bool:
        dst.copy_(src)
        return
    np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())  # the bytes, strided as src


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` → `"bfloat16"`."""
    return str(dtype).removeprefix("torch.")


def encode_chunk(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    *,
    model_id: str,
    start: int,
    token_ids: Sequence[int],
    encoding: str = DEFAULT_ENCODING,
) -> bytes:
    """Serializes one chunk of K/V (every layer, the same tokens) for the store.

    Args:
        keys (list of `torch.Tensor`): per layer, `(kv_heads_l, tokens, head_dim_l)`, post-RoPE at absolute
            positions `start .. start + tokens - 1`; any device and dtype; views (a slice of a longer cache) are
            gathered straight into the payload.
        values (list of `torch.Tensor`): per layer, the same shape as `keys[l]`.
        model_id (`str`): the identity of the model that computed them (`model_identity`).
        start (`int`): absolute position of the chunk's first token.
        token_ids (list of `int`): the chunk's tokens (as many as the K/V hold).
        encoding (`str`, *optional*, defaults to `"source"`): `"source"`, `"bfloat16"` or `"fp8_e4m3"`
            (`encodings.py`).

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
    check_encoding(encoding)
    tokens = keys[0].shape[1] if keys[0].dim() == 3 else -1
    ids = torch.tensor(list(token_ids), dtype=torch.int64)  # (tokens,)
    if ids.dim() != 1 or len(ids) != tokens:
        raise InvalidInputError(
            f"encode_chunk: {len(ids)} token ids for K/V of {tokens} tokens; pass the chunk's tokens"
        )
    tensors: list[tuple[str, torch.Tensor]] = [(TOKEN_IDS, ids)]
    for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
        if k.dim() != 3 or k.shape != v.shape or k.shape[1] != tokens:
            raise InvalidInputError(
                f"layer {layer}: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be (kv_heads, tokens, "
                f"head_dim) with the {tokens} tokens of layer 0"
            )
        for kind, tensor in (("keys", k), ("values", v)):
            for suffix, part in encode_tensor(tensor.detach(), encoding).items():
                tensors.append((_name(layer, kind + suffix), part))
    header: dict[str, dict] = {}
    offset = 0
    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset,
                        offset + size]}  # fmt: skip
        offset += size
    header["__metadata__"] = {
        "format": FORMAT_NAME,
        "version": str(CHUNK_VERSION),
        "model_id": model_id,
        "start": str(start),
        "tokens": str(tokens),
        "layers": str(len(keys)),
        "encoding": encoding,
        "dtype": dtype_name(keys[0].dtype),
        "xxh3": _PLACEHOLDER,  # the checksum's 16 hex digits, written in once the tensors are in
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
    base = 8 + len(text)
    # One allocation and one copy: a fresh (zero) bytes object is filled in place before anything else holds it, as
    # C code builds one; the tensors are gathered straight from the (possibly strided, possibly GPU) cache into it.
    payload = bytes(base + offset)
    out = torch.frombuffer(payload, dtype=torch.uint8)  # (base + offset,)
    out[:8] = torch.tensor(list(struct.pack("<Q", len(text))), dtype=torch.uint8)
    out[8:base] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    for (_, tensor), entry in zip(tensors, header.values(), strict=False):
        lo, hi = entry["data_offsets"]
        if hi > lo:
            copy_into(out[base + lo : base + hi].view(tensor.dtype).view(tensor.shape), tensor)
    digest = _xxh3()(memoryview(payload)[base:]).encode()
    at = 8 + text.index(_PLACEHOLDER.encode())
    out[at : at + len(digest)] = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
    return payload


def _parse(payload) -> tuple[dict, dict[str, str], int]:
    """`(tensor entries, metadata, first data byte)` of a complete safetensors payload; `StoreFormatError` else."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise StoreFormatError(f"a stored chunk is bytes, got {type(payload).__name__}")
    if len(payload) < 8:
        raise StoreFormatError(f"the stored chunk is {len(payload)} bytes, too short to be a chunk (truncated?)")
    (header_len,) = struct.unpack_from("<Q", payload)
    if header_len > len(payload) - 8:
        raise StoreFormatError(
            f"the stored chunk is truncated or not a chunk: its header says {header_len:,} bytes, "
            f"{len(payload) - 8:,} follow"
        )
    try:
        header = json.loads(bytes(memoryview(payload)[8 : 8 + header_len]))
    except (UnicodeDecodeError, ValueError):
        raise StoreFormatError("the stored chunk's header is not JSON: not a chunk, or corrupt bytes") from None
    if not isinstance(header, dict):
        raise StoreFormatError("the stored chunk's header is not a safetensors header: not a chunk")
    metadata = header.pop("__metadata__", None)
    ends = [entry.get("data_offsets", [0, 0])[1] for entry in header.values() if isinstance(entry, dict)]
    if 8 + header_len + max(ends, default=0) != len(payload):
        raise StoreFormatError(
            f"the stored chunk is truncated or has trailing bytes: its tensors end at byte "
            f"{8 + header_len + max(ends, default=0):,}, the payload has {len(payload):,}"
        )
    return header, metadata if isinstance(metadata, dict) else {}, 8 + header_len


def read_metadata(payload: bytes) -> dict[str, str]:
    """The metadata of a stored chunk (safetensors' `__metadata__`), without reading its tensors.

    Raises `StoreFormatError` for anything that is not a complete safetensors payload.
    """
    return _parse(payload)[1]


def _check_metadata(metadata: dict[str, str], model_id: str, start: int | None) -> tuple[int, int, int]:
    """`(start, tokens, layers)` of a chunk whose metadata fits this format, model and start; else raises."""
    if metadata.get("format") != FORMAT_NAME:
        raise StoreFormatError(
            f"the stored entry is not an hf_kvbridge K/V chunk (format {metadata.get('format')!r}, expected "
            f"{FORMAT_NAME!r}); another program wrote this key, or the key prefix is shared"
        )
    version = metadata.get("version", "")
    if not version.isdigit() or int(version) not in READ_VERSIONS:
        newer = version.isdigit() and int(version) > CHUNK_VERSION
        raise StoreFormatError(
            f"the stored chunk has format version {version!r}, this hf_kvbridge reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}; "
            + ("upgrade hf_kvbridge on this engine" if newer else "re-export the prompt with this version")
        )
    encoding = metadata.get("encoding", DEFAULT_ENCODING)
    if encoding not in ENCODINGS:
        raise StoreFormatError(
            f"the stored chunk has encoding {encoding!r}, which this hf_kvbridge does not read (it reads "
            f"{', '.join(ENCODINGS)}): a miss; upgrade hf_kvbridge on this engine"
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


def _views(payload, header: dict, base: int) -> dict[str, torch.Tensor]:
    """Every tensor of the payload as a view into it (`torch.frombuffer`: no copy)."""
    tensors = {}
    for name, entry in header.items():
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(n) for n in entry["shape"]]
            lo, hi = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise StoreFormatError(f"the stored chunk's tensor {name!r} has an unreadable entry {entry!r}") from None
        numel = 1
        for n in shape:
            numel *= n
        if min(shape, default=0) < 0 or not 0 <= lo <= hi or hi - lo != numel * torch.empty((), dtype=dtype).itemsize:
            raise StoreFormatError(f"the stored chunk's tensor {name!r}: {hi - lo} bytes for {shape} {dtype}")
        flat = (torch.frombuffer(payload, dtype=torch.uint8, count=hi - lo, offset=base + lo) if hi > lo
                else torch.empty(0, dtype=torch.uint8))  # fmt: skip
        tensors[name] = flat.view(dtype).view(shape)
    return tensors


def decode_chunk(
    payload: bytes, *, model_id: str, start: int | None = None, token_ids: Sequence[int] | None = None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Reads a chunk written by `encode_chunk` (version 3, or version 2 as written before), after checking it is one of
    `model_id` starting at `start`.

    Args:
        payload (`bytes`): the stored bytes.
        model_id (`str`): the model identity the caller expects.
        start (`int`, *optional*): the absolute position the caller expects the chunk to start at.
        token_ids (list of `int`, *optional*): the tokens the caller will take from the chunk: the chunk's first
            tokens must be these (it may hold more).

    Returns:
        `(keys, values)`: per layer, CPU tensors `(kv_heads_l, tokens, head_dim_l)`: read-only views into `payload`
        in the stored dtype (encodings `source` and `bfloat16`), or fp8 entries dequantized into the source's dtype.

    Raises:
        `StoreFormatError`: not this format, another version, an unknown encoding, another model or start, truncated
            or corrupt bytes, shapes that do not agree with the metadata or with each other, tokens other than
            `token_ids`.
    """
    header, metadata, base = _parse(payload)
    _, tokens, layers = _check_metadata(metadata, model_id, start)
    encoding = metadata.get("encoding", DEFAULT_ENCODING)
    version = int(metadata["version"])
    tensors = _views(payload, header, base)
    scaled = encoding == "fp8_e4m3"
    kinds = ("keys", "values", "keys" + SCALE_SUFFIX, "values" + SCALE_SUFFIX) if scaled else ("keys", "values")
    expected = {TOKEN_IDS} | {_name(layer, kind) for layer in range(layers) for kind in kinds}
    if set(tensors) != expected:
        raise StoreFormatError(
            f"the stored chunk's tensors {sorted(tensors)[:4]}... do not match its {layers} layers "
            f"(layers.{{l}}.keys / layers.{{l}}.values, encoding {encoding})"
        )
    ids = tensors[TOKEN_IDS]
    if ids.dim() != 1 or len(ids) != tokens or ids.dtype != torch.int64:
        raise StoreFormatError(
            f"the stored chunk's token ids are {tuple(ids.shape)} {ids.dtype}, expected ({tokens},)"
        )
    stored_keys = [tensors[_name(layer, "keys")] for layer in range(layers)]
    stored_values = [tensors[_name(layer, "values")] for layer in range(layers)]
    for layer, (k, v) in enumerate(zip(stored_keys, stored_values, strict=True)):
        if k.dim() != 3 or k.shape != v.shape or k.shape[1] != tokens:
            raise StoreFormatError(
                f"the stored chunk's layer {layer} has keys {tuple(k.shape)} and values {tuple(v.shape)}, expected "
                f"both (kv_heads, {tokens}, head_dim)"
            )
    if version >= 3 and metadata.get("xxh3") != _xxh3()(memoryview(payload)[base:]):  # the whole region, one pass
        raise StoreFormatError("the stored chunk's tensor bytes fail their checksum (XXH3-64): corrupt bytes")
    if version == 2 and metadata.get("crc32") != _crc32(stored_keys, stored_values, ids):
        raise StoreFormatError("the stored chunk's tensor bytes fail their CRC-32 check: corrupt bytes")
    if token_ids is not None:
        wanted = list(token_ids)
        if len(wanted) > tokens or ids[: len(wanted)].tolist() != wanted:
            raise StoreFormatError(
                f"the stored chunk at token {metadata.get('start')} holds other tokens than the {len(wanted)} asked "
                "for (replaced since the lookup, or another sequence's): not used"
            )
    dtype = getattr(torch, metadata.get("dtype", ""), None) if scaled else None
    if scaled and not isinstance(dtype, torch.dtype):
        raise StoreFormatError(f"the stored fp8 chunk names no source dtype it decodes to ({metadata.get('dtype')!r})")
    out = []
    for kind, stored in (("keys", stored_keys), ("values", stored_values)):
        decoded = []
        for layer, codes in enumerate(stored):
            scale = tensors.get(_name(layer, kind + SCALE_SUFFIX))
            check_stored(_name(layer, kind), codes, scale, encoding)
            decoded.append(decode_tensor(codes, scale, encoding, dtype))
        out.append(decoded)
    return out[0], out[1]
