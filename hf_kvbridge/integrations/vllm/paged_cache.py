"""vLLM's paged KV cache, read and written: slots of a request's positions, one layer's write through the attention
backend's own cache-update op, and reading slots back (the quality gate), with the layout detected at run time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


def slots_of(block_ids: list[int], block_size: int, start: int, end: int) -> torch.Tensor:
    """Slots in vLLM's paged cache of prompt positions `[start, end)` of a request holding blocks `block_ids`."""
    offsets = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.long)[offsets // block_size]
    return blocks * block_size + offsets % block_size


def write_layer(layer: nn.Module, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes `keys`, `values` (`(T, kv_heads, head_dim)` each, keys post-RoPE) at `slots` of `layer`'s paged cache
    through the backend's `do_kv_cache_update`, so the layout is the backend's business."""
    kv_cache = layer.kv_cache
    layer.impl.do_kv_cache_update(layer, keys, values, kv_cache, slots.to(kv_cache.device))


def read_slots(layer: nn.Module, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `(len(slots), kv_heads, head_dim)` stored at `slots` of `layer`'s paged KV cache.

    Two kinds of layout:

    - the CPU backend's `(blocks, kv_heads, block_size, 2 * head_dim)` cache, whose kernels (`layer.isa`: "vec" and
      "vec16", the portable ones; "amx", which vLLM picks for bfloat16 on CPUs with AMX tiles; "neon", ...) each
      order a block's keys and values their own way. The order is not assumed: it is *probed*, once per kernel,
      dtype and shape, by writing coordinates through the backend's own `do_kv_cache_update` into a scratch block
      (`probe_block_layout`), so every kernel vLLM picks is read as it wrote;
    - the `(2, blocks, block_size, kv_heads, head_dim)` of FlashAttention-style backends (not run here: no GPU).

    Only the slots' own elements are read (`gather_slots`: one `index_select` on the cache seen as rows). An fp8
    cache (`kv_cache_dtype` fp8, fp8_e4m3 or fp8_e5m2: `uint8` codes, `code = fp8(x / scale)` with the layer's
    `_k_scale_float` / `_v_scale_float`) is read on the CPU backend as the engine reads it: the codes dequantized
    with the engine's scales, in float32 (`fp8_format`, `dequantize`); the probe checks the codes' format and the
    scales' sense too. Other quantized caches, and fp8 in the FlashAttention-style layout (never run here), raise
    `NotImplementedError`, and so does any other layout. `map_and_write` checks that it reads back what the
    backend's own op wrote (within fp8's round-off for an fp8 cache) before the gate trusts it (`reads_back`).
    """
    codes = fp8_format(layer)  # None: the cache holds the model's numbers
    kv = gather_slots(layer, slot_rows(layer, slots))  # (2, H, T, d)
    keys, values = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # (T, H, d) views
    if codes is not None:
        k_scale, v_scale = engine_scales(layer)
        return dequantize(keys, codes, k_scale), dequantize(values, codes, v_scale)
    return keys, values


def _cpu_backend(layer: nn.Module) -> bool:
    return any(cls.__name__.startswith("CPUAttention") for cls in type(layer.impl).__mro__)


@dataclass(frozen=True)
class TokenRuns:
    """How `gather_slots` reads a side stored token-major (the CPU kernels' keys: a block's tokens side by side for
    each head and dimension): `segments` runs of one block each (`rows`: `(kv_heads · segments · head_dim,)` rows of
    `block_size` elements, a whole block's tokens), then `pieces` `(first, last, offset, tokens, at)`: segments
    `[first, last)`, from token `offset` of each, `tokens` of them in all, copied transposed to token `at` of the
    read. Consecutive whole blocks are one piece."""

    segments: int
    block_size: int
    pieces: tuple[tuple[int, int, int, int, int], ...]


@dataclass(frozen=True)
class SlotRows:
    """Where the keys and values of some slots lie in a layer's paged cache: the keys in the cache seen as rows of
    `runs[0]` elements (`kv_cache.view(-1, runs[0])`), at rows `rows[0]` (`(kv_heads · T · head_dim / runs[0],)`, in
    the order of a `(kv_heads, T, head_dim)` read: each head's tokens side by side, so that a head's run of tokens
    is one contiguous piece the store sends as it is), and the values likewise (`runs[1]`, `rows[1]`); a side
    stored token-major is read in rows of whole blocks instead (`tokens[i]`, a `TokenRuns`; `None` otherwise).
    `rows` is `None` where the cache is not one flat block of memory: then `slots` (`(T,)`) are read by indexing
    (`gather_slots`)."""

    rows: tuple[torch.Tensor, torch.Tensor] | None
    runs: tuple[int, int]
    shape: tuple[int, int, int, int]
    slots: torch.Tensor
    tokens: tuple[TokenRuns | None, TokenRuns | None] = (None, None)


_BLOCK_ROWS: dict[tuple, tuple[list[tuple[torch.Tensor, int, bool]], int]] = {}


def _layout_key(layer: nn.Module) -> tuple:
    """What a cache's layout depends on: the backend's kernel and dtypes, the engine's scales, the cache's shape and
    strides (the same key for every layer of a model that shares them)."""
    kv_cache = layer.kv_cache
    return (
        layer.impl.__class__.__name__, getattr(layer, "isa", None), kv_cache.dtype,
        getattr(layer.impl, "kv_cache_dtype", None), engine_scales(layer), tuple(kv_cache.shape),
        kv_cache.stride(), str(kv_cache.device),
    )  # fmt: skip


def block_rows(layer: nn.Module) -> tuple[list[tuple[torch.Tensor, int, bool]], int] | None:
    """`([(rows_in_block, run, token_major) for keys, then values], elements_per_block)` of `layer`'s cache: seen
    as rows of `run` elements (`kv_cache.view(-1, run)`), block `b`'s offset `o` holds head `h`'s keys (or values)
    in rows `b * elements_per_block / run + rows_in_block[h, o]` (`rows_in_block`: `(kv_heads, block_size, head_dim
    / run)`). `run` is the longest power of two dividing `head_dim` whose pieces of a key (or value) lie side by side
    in the cache (`head_dim` for a row per token and head, as the CPU kernels store values). A side whose keys'
    (or values') dimensions lie apart but whose block's tokens lie side by side for each head and dimension (the
    CPU kernels' keys, dimension-major) is `token_major`: `run` is then `block_size`, and `rows_in_block`
    (`(kv_heads, head_dim)`) the row of each head's dimension in its block. `None` for a cache that is not
    contiguous. Raises `NotImplementedError` for a layout `read_slots` cannot read."""
    kv_cache = layer.kv_cache
    paged = kv_cache.dim() == 5 and kv_cache.shape[0] == 2  # FlashAttention-style: (2, blocks, block_size, H, d)
    if not (_cpu_backend(layer) and kv_cache.dim() == 4) and not paged:
        raise NotImplementedError(
            f"unknown KV cache layout {tuple(kv_cache.shape)} of {layer.impl.__class__.__name__}"
        )
    if not kv_cache.is_contiguous():
        if paged:
            return None
        raise NotImplementedError(f"a CPU KV cache of strides {kv_cache.stride()}: not one block of memory")
    key = _layout_key(layer)
    if key in _BLOCK_ROWS:
        return _BLOCK_ROWS[key]
    if not paged:
        _, heads, block_size, width = kv_cache.shape
        key_index, value_index = probe_block_layout(layer)  # (block_size, H, d) each, into a flattened block
        where = torch.stack((key_index, value_index)).transpose(1, 2).cpu()  # (2, H, block_size, d)
        page = heads * block_size * width
    else:
        _, num_blocks, block_size, heads, head_dim = kv_cache.shape
        side, head, offset, dim = torch.meshgrid(
            torch.arange(2), torch.arange(heads), torch.arange(block_size), torch.arange(head_dim), indexing="ij"
        )  # (2, H, block_size, d) each
        page = block_size * heads * head_dim  # a block's elements in each of the two halves
        where = side * num_blocks * page + (offset * heads + head) * head_dim + dim  # (2, H, block_size, d)
    head_dim = where.shape[-1]
    sides = []
    for side in where:  # (H, block_size, d): keys, then values
        run = head_dim & -head_dim  # the largest power of two dividing head_dim
        while run > 1:
            pieces = side.reshape(*side.shape[:-1], head_dim // run, run)  # (H, block_size, d / run, run)
            if bool((pieces[..., 0] % run == 0).all()) and bool((pieces == pieces[..., :1] + torch.arange(run)).all()):
                break
            run //= 2
        first = side[:, 0]  # (H, d): where each head's dimension starts in the block
        along = torch.arange(block_size).view(1, -1, 1)
        if run == 1 and bool((first % block_size == 0).all()) and bool((side == first.unsqueeze(1) + along).all()):
            sides.append((first // block_size, block_size, True))  # a row of the block's tokens a head and dim
            continue
        sides.append((side.reshape(*side.shape[:-1], head_dim // run, run)[..., 0] // run, run, False))
    _BLOCK_ROWS[key] = (sides, page)
    return _BLOCK_ROWS[key]


def slot_rows(layer: nn.Module, slots: torch.Tensor) -> SlotRows:
    """The rows of `layer`'s cache that hold the keys and values of `slots` (`(T,)`), for `gather_slots`. The same
    `SlotRows` reads every layer of the same layout (`same_layout`)."""
    kv_cache = layer.kv_cache
    codes = fp8_format(layer)
    if codes is not None and not (_cpu_backend(layer) and kv_cache.dim() == 4):
        raise NotImplementedError(f"an fp8 KV cache of {layer.impl.__class__.__name__}: read on the CPU backend only")
    slots = slots.to(torch.long).cpu()
    found = block_rows(layer)
    if kv_cache.dim() == 4:
        heads, block_size, head_dim = kv_cache.shape[1], kv_cache.shape[2], kv_cache.shape[3] // 2
    else:
        block_size, heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    shape = (2, heads, len(slots), head_dim)
    if found is None:
        return SlotRows(None, (head_dim, head_dim), shape, slots.to(kv_cache.device))
    sides, page = found
    blocks, offsets = slots // block_size, slots % block_size  # (T,) each
    rows, runs, tokens = [], [], []
    for rows_in_block, run, token_major in sides:
        index_dtype = torch.int32 if kv_cache.numel() // run < 2**31 else torch.long
        if token_major:
            runs_of_tokens, segment_blocks = token_runs(blocks, offsets, block_size)
            side_rows = segment_blocks.view(1, -1, 1) * (page // run) + rows_in_block.unsqueeze(1)  # (H, S, d)
        else:
            runs_of_tokens = None
            side_rows = blocks.view(1, -1, 1) * (page // run) + rows_in_block[:, offsets]  # (H, T, d / run)
        rows.append(side_rows.flatten().to(device=kv_cache.device, dtype=index_dtype))
        runs.append(run)
        tokens.append(runs_of_tokens)
    return SlotRows((rows[0], rows[1]), (runs[0], runs[1]), shape, slots, (tokens[0], tokens[1]))


def token_runs(blocks: torch.Tensor, offsets: torch.Tensor, block_size: int) -> tuple[TokenRuns, torch.Tensor]:
    """The slots `blocks * block_size + offsets` (`(T,)` each) as runs within one block each (`TokenRuns`), and the
    block of each run (`(S,)`)."""
    starts = torch.ones(len(blocks), dtype=torch.bool)  # a run starts where the block changes or a slot is skipped
    starts[1:] = (blocks[1:] != blocks[:-1]) | (offsets[1:] != offsets[:-1] + 1)
    first = starts.nonzero().flatten()  # (S,): each run's first token in the read
    lengths = torch.diff(first, append=torch.tensor([len(blocks)]))
    pieces, at = [], 0
    for segment, (offset, tokens) in enumerate(zip(offsets[first].tolist(), lengths.tolist(), strict=True)):
        last = pieces[-1] if pieces else None
        whole = offset == 0 and tokens == block_size
        if whole and last is not None and last[2] == 0 and last[3] == (last[1] - last[0]) * block_size:
            pieces[-1] = (last[0], segment + 1, 0, last[3] + tokens, last[4])  # another whole block: one copy
        else:
            pieces.append((segment, segment + 1, offset, tokens, at))
        at += tokens
    return TokenRuns(len(first), block_size, tuple(pieces)), blocks[first]


def gather_slots(layer: nn.Module, rows: SlotRows, out: torch.Tensor | None = None) -> torch.Tensor:
    """The keys and values at `rows` of `layer`'s cache, `(2, kv_heads, T, head_dim)` in the cache's own dtype (an
    fp8 cache's `uint8` codes, not dequantized): one `index_select` for the keys and one for the values, of exactly
    the slots' elements (into `out`, a contiguous tensor of that shape and dtype, if given)."""
    kv_cache = layer.kv_cache
    if rows.rows is None:  # a strided cache (FlashAttention-style layout): indexed per half
        block_size = kv_cache.shape[2]
        blocks, offsets = rows.slots // block_size, rows.slots % block_size
        kv = torch.stack([part[blocks, offsets] for part in kv_cache.unbind(0)]).transpose(1, 2)  # (2, H, T, d)
        return kv if out is None else out.copy_(kv)
    if out is None:
        out = torch.empty(rows.shape, dtype=kv_cache.dtype, device=kv_cache.device)
    for side, side_rows, run, runs in zip(out, rows.rows, rows.runs, rows.tokens, strict=True):  # keys, then values
        if runs is not None:  # token-major: whole blocks' rows, then each piece's tokens transposed into place
            heads, head_dim = side.shape[0], side.shape[2]
            read = torch.index_select(kv_cache.view(-1, run), 0, side_rows)  # (H · S · d, block_size)
            read = read.view(heads, runs.segments, head_dim, runs.block_size)
            for first, last, offset, tokens, at in runs.pieces:
                segments = last - first  # (H, n, d, block_size) -> (H, tokens, d): one run, or n whole blocks
                part = read[:, first:last, :, offset : offset + tokens // segments].transpose(2, 3)
                side[:, at : at + tokens].view(heads, segments, tokens // segments, head_dim).copy_(part)
            continue
        shape = (-1,) if run == 1 else (-1, run)  # single elements: a flat index_select (its fast path)
        torch.index_select(kv_cache.view(shape), 0, side_rows, out=side.view(shape))  # (H · T · d / run, run)
    return out


def read_layers(
    layers: Sequence[nn.Module], slots: torch.Tensor, buffer: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """The keys and values at `slots` (`(T,)`) of each of `layers`: per layer `(2, kv_heads, T, head_dim)` in its
    cache's own dtype (`uint8` codes for an fp8 cache: `dequantize` them, off the engine's step), one `index_select`
    a layer; the rows of the slots are found once per layout, not once per layer. With `buffer` (flat `uint8`, at
    least `read_nbytes(layers, T)`, e.g. a `StagingPool` lease's) the layers are read into it, one after another."""
    found: dict[tuple, SlotRows] = {}
    out, offset = [], 0
    for layer in layers:
        key = _layout_key(layer)
        if key not in found:
            found[key] = slot_rows(layer, slots)
        place = None
        if buffer is not None:
            dtype, shape = layer.kv_cache.dtype, found[key].shape
            size = math.prod(shape) * dtype.itemsize
            place = buffer[offset : offset + size].view(dtype).view(shape)
            offset += size
        out.append(gather_slots(layer, found[key], place))
    return out


def slot_nbytes(kv_cache: torch.Tensor) -> int:
    """Bytes one token slot (its keys and values) takes in one layer's paged cache `kv_cache`, as `read_layers`
    reads it."""
    blocks = kv_cache.shape[0] if kv_cache.dim() == 4 else kv_cache.shape[1]
    return kv_cache.numel() // (blocks * kv_cache.shape[2]) * kv_cache.dtype.itemsize


def read_nbytes(layers: Sequence[nn.Module], tokens: int) -> int:
    """Bytes `read_layers` reads for `tokens` slots of each of `layers` (each layer's keys and values)."""
    return sum(slot_nbytes(layer.kv_cache) for layer in layers) * tokens


FP8_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""vLLM's fp8 `kv_cache_dtype` names and the code format they store on CPU (`fp8` is e4m3)."""


def fp8_format(layer: nn.Module) -> torch.dtype | None:
    """The fp8 format of `layer`'s cache codes (`torch.float8_e4m3fn` or `torch.float8_e5m2`), or `None` for a cache
    of the model's numbers. Any other quantized cache raises `NotImplementedError`.

    Example:

    ```python
    >>> from types import SimpleNamespace
    >>> import torch
    >>> fp8_format(SimpleNamespace(kv_cache=torch.zeros(1, dtype=torch.uint8),
    ...                            impl=SimpleNamespace(kv_cache_dtype="fp8_e5m2")))
    torch.float8_e5m2
    ```
    """
    kv_cache = layer.kv_cache
    if kv_cache.dtype.is_floating_point and kv_cache.dtype.itemsize >= 2:
        return None
    name = str(getattr(layer.impl, "kv_cache_dtype", "auto"))
    if name not in FP8_FORMATS:
        raise NotImplementedError(f"a {kv_cache.dtype} KV cache ({name}) holds quantized codes this cannot read")
    return FP8_FORMATS[name]


def engine_scales(layer: nn.Module) -> tuple[float, float]:
    """The scales `layer`'s backend quantizes its keys and values with (`code = fp8(x / scale)`), as its kernels
    read them (`_k_scale_float`, `_v_scale_float`; 1.0 when the checkpoint has none)."""
    return float(getattr(layer, "_k_scale_float", 1.0)), float(getattr(layer, "_v_scale_float", 1.0))


def dequantize(codes: torch.Tensor, fp8: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """float32 values of fp8 `codes` (`uint8`, any shape) of format `fp8`, times `scale`."""
    return codes.contiguous().view(fp8).to(torch.float32) * scale


def quantize(x: torch.Tensor, fp8: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """`x` through an fp8 cache of format `fp8` and `scale`, as float32: saturated at the format's largest value,
    rounded to nearest (what vLLM's cache write stores, dequantized as its attention reads it).

    Example:

    ```python
    >>> import torch
    >>> quantize(torch.tensor([0.3, 1000.0]), torch.float8_e4m3fn).tolist()
    [0.3125, 448.0]
    ```
    """
    largest = torch.finfo(fp8).max
    return (x.float() / scale).clamp(-largest, largest).to(fp8).to(torch.float32) * scale


def fp8_tolerance(fp8: torch.dtype) -> tuple[float, float]:
    """`(rtol, atol / scale)` within which a value read back from an fp8 cache equals the value written: one unit in
    the last place of the format (rounding to nearest is half of it), and its smallest subnormal near zero."""
    mantissa = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[fp8]
    return 2.0**-mantissa, float(torch.finfo(fp8).smallest_normal) * 2.0**-mantissa


_PROBED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_DIGIT = 128  # coordinates are written in base-128 digits (+1): integers up to 129 are exact in bfloat16 and float16
_FP8_DIGIT = 8  # and in base-8 digits in an fp8 cache: integers up to 8 are exact in e4m3 and e5m2


def probe_block_layout(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the backend's cache-update op puts each key and value of one block: `(key_index, value_index)`, each
    `(block_size, kv_heads, head_dim)` of positions in the block's flattened page (`kv_cache[block].flatten()`).

    Found by writing a scratch one-block cache of `layer`'s dtype and shape through `layer.impl.do_kv_cache_update`
    (the op vLLM and the connector write with, with the layer's kernel and scales), once per coordinate digit: the
    token offset, the head and the dimension, each as base-128 digits plus one (exact in every float cache dtype;
    base-8 digits in an fp8 cache, written times the layer's scales and decoded from the codes, so that a code
    format or a scale sense other than `fp8_format`'s and `engine_scales`' fails the probe), and whether it is a key
    or a value. Every `(key/value, offset, head, dim)` must land in exactly one place, or the layout is not one this
    can read (`NotImplementedError`). Cached per kernel (`layer.isa`), cache dtype, scales and shape.
    """
    kv_cache = layer.kv_cache
    _, heads, block_size, width = kv_cache.shape
    key = (
        layer.impl.__class__.__name__, getattr(layer, "isa", None), kv_cache.dtype,
        getattr(layer.impl, "kv_cache_dtype", None), engine_scales(layer), heads, block_size, width,
    )  # fmt: skip
    if key not in _PROBED:
        try:
            _PROBED[key] = _probe(layer)
        except RuntimeError as error:  # the kernel cannot write this shape or dtype: nothing to read either
            raise NotImplementedError(f"probing the KV cache layout failed: {error}") from error
    return _PROBED[key]


def _probe(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    kv_cache = layer.kv_cache
    _, heads, block_size, width = kv_cache.shape
    head_dim = width // 2
    codes = fp8_format(layer)
    base = _DIGIT if codes is None else _FP8_DIGIT
    number = kv_cache.dtype if codes is None else torch.float32  # what the op is given: the cache's numbers
    k_scale, v_scale = (1.0, 1.0) if codes is None else engine_scales(layer)
    scratch = torch.zeros((1, heads, block_size, width), dtype=kv_cache.dtype, device=kv_cache.device)
    slots = torch.arange(block_size, device=kv_cache.device)

    def write(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # the scratch block's numbers, flat
        scratch.zero_()
        keys, values = (keys * k_scale).to(number), (values * v_scale).to(number)  # (block_size, H, d) each
        layer.impl.do_kv_cache_update(layer, keys, values, scratch, slots)
        read = scratch.flatten() if codes is None else dequantize(scratch.flatten(), codes)
        if codes is not None and not bool(((read == read.round()) & (read.abs() <= base)).all()):
            raise NotImplementedError(
                f"the fp8 KV cache of {layer.impl.__class__.__name__} does not hold {codes} codes of x / scale"
            )
        return read.long()

    grid = torch.stack(
        torch.meshgrid(torch.arange(block_size), torch.arange(heads), torch.arange(head_dim), indexing="ij")
    ).to(kv_cache.device)  # (3, block_size, H, d): offset, head, dim
    found = torch.zeros(heads * block_size * width, dtype=torch.long, device=kv_cache.device)
    for axis, stride in enumerate((heads * head_dim, head_dim, 1)):  # into the flat (offset, head, dim) index
        power = 1
        while power == 1 or power <= int(grid[axis].max()):  # one digit per write
            digit = (grid[axis] // power % base + 1).float()  # (block_size, H, d), in 1..base
            found += (write(digit, digit) - 1).clamp(min=0) * power * stride
            power *= base
    ones = torch.ones((block_size, heads, head_dim), device=kv_cache.device)
    side = write(ones, ones * 2)  # 1: a key, 2: a value, 0: nothing (padding)
    index = torch.full((2, block_size * heads * head_dim), -1, dtype=torch.long, device=kv_cache.device)
    for side_value in (1, 2):
        positions = (side == side_value).nonzero().flatten()
        index[side_value - 1, found[positions]] = positions
    counts = torch.stack([torch.bincount(found[side == v], minlength=index.shape[1]) for v in (1, 2)])
    if (index < 0).any() or (counts != 1).any() or int((side > 0).sum()) != 2 * index.shape[1]:
        raise NotImplementedError(
            f"the KV cache layout of {layer.impl.__class__.__name__} (isa {getattr(layer, 'isa', None)}, "
            f"{kv_cache.dtype}) is not a permutation of one block's keys and values"
        )
    shape = (block_size, heads, head_dim)
    return index[0].view(shape), index[1].view(shape)


def reads_back(layer: nn.Module, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `read_slots` returns the `keys`/`values` just written at `slots`: exactly, in the cache's dtype; within
    one unit in the last place of the format for an fp8 cache (`fp8_tolerance`: the engine's own rounding)."""
    try:
        got_keys, got_values = read_slots(layer, slots)
        codes = fp8_format(layer)
    except NotImplementedError:
        return False
    if codes is None:
        dtype = got_keys.dtype
        return torch.equal(got_keys, keys.to(dtype)) and torch.equal(got_values, values.to(dtype))
    rtol, atol = fp8_tolerance(codes)
    return all(
        torch.allclose(got, quantize(want, codes, scale), rtol=rtol, atol=atol * scale)
        for got, want, scale in zip((got_keys, got_values), (keys, values), engine_scales(layer), strict=True)
    )
