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
tensor region in one pass; it is written without copying the tensors (`encode_chunk_views`: the header, then views
into the tensors, which a store sends as they are). Version 2 (written before, the source's dtype only) checks them
with CRC-32 (zlib), and is still read.
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
    FP8_DTYPE,
    SCALE_SUFFIX,
    check_encoding,
    check_stored,
    decode_tensor,
    dequantize_codes,
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


def _xxhash():
    try:
        import xxhash
    except ImportError:
        raise MissingDependencyError(
            "the KV store's chunk checksum needs xxhash: pip install 'hf-kvbridge[store]' (or pip install xxhash)"
        ) from None
    return xxhash


def _xxh3():
    """XXH3-64 of one buffer, as 16 hex digits."""
    return _xxhash().xxh3_64_hexdigest


def _xxh3_stream():
    """The XXH3-64 hasher class (`update` over parts: the digest of their concatenation)."""
    return _xxhash().xxh3_64


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


class ChunkPayload:
    """An encoded chunk as the buffers its bytes are made of, in order (`encode_chunk_views`): the safetensors header,
    the token ids, then each stored tensor's bytes as views into the tensor itself (1-D `uint8` arrays, one per
    contiguous run: the whole tensor, or one per KV head of a slice of a longer cache). A store sends the parts as
    they are (`wire.SetPipeline`), so a save copies nothing; `bytes(payload)` joins them (what `encode_chunk`
    returns).

    The views read the tensors when they are sent: the tensors must not change until then (a change is caught by
    the checksum on fetch: a miss, never a wrong cache).

    Attributes:
        parts (tuple): the payload's bytes, in order: `bytes` or 1-D byte buffers (`uint8` arrays, memoryviews).
        nbytes (`int`): their total length (also `len(payload)`).
    """

    __slots__ = ("parts", "nbytes")

    def __init__(self, parts: Sequence[bytes | np.ndarray | memoryview]):
        self.parts = tuple(parts)
        self.nbytes = sum(memoryview(part).nbytes for part in self.parts)

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)

    def __repr__(self) -> str:
        return f"ChunkPayload({len(self.parts)} parts, {self.nbytes:,} bytes)"


MIN_SEGMENT = 16 << 10
"""A tensor whose per-head runs are shorter than this (bytes: a partial chunk's sub-chunks, 16 tokens) is gathered
into one contiguous copy rather than sent as one view per head: copying a few KB costs less than handling (hashing,
sending) each as a part of its own."""


def _bytes_view(tensor: torch.Tensor) -> np.ndarray:
    """`tensor`'s bytes as a `uint8` array of its shape (the last dimension × its item size): a view of a CPU tensor
    whose last dimension is contiguous, else a contiguous copy (another device, other strides)."""
    if tensor.device.type != "cpu" or tensor.dim() == 0 or tensor.stride(-1) != 1 or tensor.dtype == torch.bool:
        gathered = torch.empty(tensor.shape, dtype=tensor.dtype)  # the one copy
        copy_into(gathered, tensor)
        tensor = gathered
    return tensor.view(torch.uint8).numpy()


def _segments(array: np.ndarray) -> list[np.ndarray]:
    """The bytes of `array` (`uint8`, e.g. `(kv_heads, tokens, head_dim * itemsize)`) in row-major order as 1-D views
    into it: one for a contiguous array, one per KV head for a slice of a longer `(H, T, ...)` cache whose heads are
    each contiguous and at least `MIN_SEGMENT` bytes; any other layout (a transposed cache, short heads) gathered into
    one copy. (numpy arrays, not memoryviews: the garbage collector does not track them, and a save makes hundreds a
    chunk.)"""
    if array.size == 0:
        return []
    if array.flags.c_contiguous:
        return [array.reshape(-1)]
    if array.ndim > 1 and array[0].flags.c_contiguous and array[0].size >= MIN_SEGMENT:
        return [head.reshape(-1) for head in array]
    return [np.ascontiguousarray(array).reshape(-1)]


class ChunkEncoder:
    """Encodes chunks of one save's K/V (tokens `[0, T)` of every layer) without copying them: each chunk's payload is
    the header and views into the tensors (`ChunkPayload`), checksummed in one XXH3-64 pass over the views. The
    tensors are turned into byte arrays once for all the chunks (an encoding that keeps them as they are: `source`,
    or `bfloat16` of a bfloat16 source); other encodings (fp8, a cast) are computed per chunk.

    Args:
        keys (list of `torch.Tensor`): per layer, `(kv_heads, T, head_dim_l)`, post-RoPE; any device and dtype.
        values (list of `torch.Tensor`): per layer, the same shape as `keys[l]`.
        model_id (`str`): the identity of the model that computed them (`model_identity`).
        encoding (`str`, *optional*, defaults to `"source"`): `"source"`, `"bfloat16"` or `"fp8_e4m3"`.
        scales (list of `(k_scale, v_scale)`, *optional*): per layer, the scales of an fp8 KV cache whose codes
            `keys`/`values` are (`float8_e4m3fn` or `float8_e5m2`, `x = code * scale`, as vLLM's fp8 caches hold
            them). In encoding `fp8_e4m3`, `float8_e4m3fn` codes are stored as they are, the layer's scale as each
            head's scale (not quantized twice); otherwise they are dequantized to float32 first. The entry's
            source dtype is float32 (what the codes dequantize to).

    Example:

    ```python
    >>> cache = torch.randn(2, 8, 4)  # (kv_heads, tokens, head_dim)
    >>> encoder = ChunkEncoder([cache], [cache], model_id="m")
    >>> payload = encoder.encode(4, 8, start=4, token_ids=[5, 6, 7, 8])
    >>> decode_chunk(bytes(payload), model_id="m", start=4)[0][0].equal(cache[:, 4:])
    True
    ```
    """

    def __init__(
        self,
        keys: Sequence[torch.Tensor],
        values: Sequence[torch.Tensor],
        *,
        model_id: str,
        encoding: str = DEFAULT_ENCODING,
        scales: Sequence[tuple[float, float]] | None = None,
    ):
        if len(keys) != len(values) or not keys:
            raise InvalidInputError(f"encode_chunk needs keys and values for the same ≥ 1 layers, got {len(keys)} "
                                    f"and {len(values)}")  # fmt: skip
        check_encoding(encoding)
        self.tokens = keys[0].shape[1] if keys[0].dim() == 3 else -1
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            if k.dim() != 3 or k.shape != v.shape or k.shape[1] != self.tokens:
                raise InvalidInputError(
                    f"layer {layer}: keys {tuple(k.shape)} and values {tuple(v.shape)} must both be (kv_heads, "
                    f"tokens, head_dim) with the {self.tokens} tokens of layer 0"
                )
        self.model_id, self.encoding, self.layers = model_id, encoding, len(keys)
        if scales is not None and len(scales) != len(keys):
            raise InvalidInputError(f"encode_chunk: {len(scales)} scale pairs for {len(keys)} layers")
        self.dtype = keys[0].dtype if scales is None else torch.float32
        # per layer, keys then values: (name, tensor, its bytes (H, T, d * itemsize) when the encoding keeps it as is,
        # and an fp8 engine's codes' per-head scales (H,) kept with them)
        self._tensors = []
        for layer, (k, v) in enumerate(zip(keys, values, strict=True)):
            for side, (kind, tensor) in enumerate((("keys", k), ("values", v))):
                tensor, head_scales = tensor.detach(), None
                if scales is not None:  # an fp8 engine's codes: as they are where the encoding is theirs
                    scale = scales[layer][side]
                    if encoding == "fp8_e4m3" and tensor.dtype == FP8_DTYPE:
                        head_scales = torch.full((tensor.shape[0],), scale, dtype=torch.float32)  # (H,)
                    else:
                        tensor = dequantize_codes(tensor, scale)  # (H, T, d) float32
                kept = (
                    encoding == "source"
                    or (encoding == "bfloat16" and tensor.dtype == torch.bfloat16)
                    or head_scales is not None
                )
                self._tensors.append((_name(layer, kind), tensor, _bytes_view(tensor) if kept else None, head_scales))

    def encode(self, lo: int, hi: int, *, start: int, token_ids: Sequence[int]) -> ChunkPayload:
        """The chunk of tokens `[lo, hi)` of the tensors, at absolute positions `start ..`, of tokens `token_ids`."""
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise InvalidInputError(f"start must be the chunk's first absolute position (an int ≥ 0), got {start!r}")
        if not 0 <= lo <= hi <= self.tokens:
            raise InvalidInputError(f"encode: tokens [{lo}, {hi}) of K/V of {self.tokens} tokens")
        ids = np.asarray(list(token_ids), dtype=np.int64)  # (tokens,)
        if ids.ndim != 1 or len(ids) != hi - lo:
            raise InvalidInputError(
                f"encode_chunk: {len(ids)} token ids for K/V of {hi - lo} tokens; pass the chunk's tokens"
            )
        entries: list[tuple[str, str, list[int], list[np.ndarray]]] = [
            (TOKEN_IDS, "I64", [len(ids)], [ids.view(np.uint8)])
        ]  # (name, safetensors dtype, shape, its bytes)
        for name, tensor, kept, head_scales in self._tensors:
            if kept is not None:  # a view of the tokens' bytes: (H, hi - lo, d * itemsize)
                shape = [tensor.shape[0], hi - lo, tensor.shape[2]]
                entries.append((name, _NAMES[tensor.dtype], shape, _segments(kept[:, lo:hi])))
                if head_scales is not None:  # an fp8 engine's codes, stored with its scale as each head's
                    scale_bytes = _segments(_bytes_view(head_scales))
                    entries.append((name + SCALE_SUFFIX, _NAMES[torch.float32], [len(head_scales)], scale_bytes))
                continue
            for suffix, part in encode_tensor(tensor[:, lo:hi], self.encoding).items():  # fp8 codes and scales, casts
                entries.append((name + suffix, _NAMES[part.dtype], list(part.shape), _segments(_bytes_view(part))))
        header: dict[str, dict] = {}
        data: list[np.ndarray] = []
        hasher = _xxh3_stream()()
        offset = 0
        for name, dtype, shape, segments in entries:
            size = sum(len(segment) for segment in segments)
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
            for segment in segments:  # one pass over the tensor region: one XXH3-64 of its concatenation
                hasher.update(segment)
            data += segments
        header["__metadata__"] = {
            "format": FORMAT_NAME,
            "version": str(CHUNK_VERSION),
            "model_id": self.model_id,
            "start": str(start),
            "tokens": str(hi - lo),
            "layers": str(self.layers),
            "encoding": self.encoding,
            "dtype": dtype_name(self.dtype),
            "xxh3": hasher.hexdigest(),
        }
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # safetensors pads its header to 8 bytes
        return ChunkPayload([struct.pack("<Q", len(text)) + text, *data])


def encode_chunk_views(keys, values, *, model_id: str, encoding: str = DEFAULT_ENCODING, **position) -> ChunkPayload:
    """Serializes one chunk of K/V (every layer, the same tokens) for the store without copying its tensors
    (`ChunkEncoder`): the payload's parts are the header and views into the tensors. Its bytes are exactly
    `encode_chunk`'s.

    Args: as `encode_chunk` (`position`: its `start` and `token_ids`, which `ChunkEncoder.encode` takes).

    Returns:
        `ChunkPayload`: the parts of the safetensors payload; `bytes(payload)` joins them.

    Example:

    ```python
    >>> cache = torch.randn(2, 8, 4)  # (kv_heads, tokens, head_dim) of a longer sequence
    >>> payload = encode_chunk_views([cache[:, :4]], [cache[:, 4:]], model_id="m", start=0, token_ids=[1, 2, 3, 4])
    >>> len(payload) == len(bytes(payload)), decode_chunk(bytes(payload), model_id="m")[0][0].equal(cache[:, :4])
    (True, True)
    ```
    """
    encoder = ChunkEncoder(keys, values, model_id=model_id, encoding=encoding)
    return encoder.encode(0, encoder.tokens, **position)


def encode_chunk(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    *,
    model_id: str,
    start: int,
    token_ids: Sequence[int],
    encoding: str = DEFAULT_ENCODING,
) -> bytes:
    """Serializes one chunk of K/V (every layer, the same tokens) for the store, as one `bytes` (a store's save sends
    `encode_chunk_views`' parts instead, without this join).

    Args:
        keys (list of `torch.Tensor`): per layer, `(kv_heads, tokens, head_dim_l)`, post-RoPE at absolute
            positions `start .. start + tokens - 1`; any device and dtype; views (a slice of a longer cache) are
            read where they are.
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
    return bytes(
        encode_chunk_views(keys, values, model_id=model_id, encoding=encoding, start=start, token_ids=token_ids)
    )


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
