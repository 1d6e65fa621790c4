"""The engine's `"layers"` schedule (`hf_kvbridge.mappers.engine`, the GPU's): whole-layer steps over all tokens at
once, or over the fewest chunks the memory budget allows (`layer_chunk_tokens`).

```
source cache ──one fused strip (every source layer read)──▶ row slots in layer order ──one product a step──▶
    every target layer's rows ──one fused rotation──▶ the cache (a new block, or a StaticCache's tensors in place)
```

The ops dispatched do not grow with the length (`hf_kvbridge.tools.bench.ops` counts them); on CUDA the two fused ops
are Triton kernels (`hf_kvbridge.utils.rope.rotate_kv`).
"""

from __future__ import annotations

import torch

from ..errors import InvalidInputError
from ..utils.cache import cache_layer_kv
from ..utils.devices import execution_device
from ..utils.rope import Rotation, rotate_kv
from .base import KVMapper
from .engine_steps import SpanJob, held_offsets, mapping_steps

CPU_LAYER_CHUNK_BYTES = 2**30  # the working set on a CPU (a GPU's comes from its free memory)


def layer_chunk_tokens(
    mapper: KVMapper, batch: int, seq: int, num_slots: int, widest: int, device: torch.device, held: int = 0
) -> int:
    """Tokens per chunk of the `"layers"` schedule: all `seq` of them when the working set (`num_slots` source layers'
    rows and the widest step's output, per token) fits the budget, else as many as fit. The budget is
    `mapper.max_layer_chunk_bytes` when set; on CUDA half the device's free memory plus what the workspace holds
    already (`held` bytes, reused), elsewhere `CPU_LAYER_CHUNK_BYTES`."""
    per_token = batch * (num_slots * mapper.slot_features + widest) * torch.finfo(mapper.layout_dtype()).bits // 8
    budget = getattr(mapper, "max_layer_chunk_bytes", None)
    if budget is None and device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0] // 2 + held
    elif budget is None:
        budget = CPU_LAYER_CHUNK_BYTES
    return max(1, min(seq, budget // max(per_token, 1)))


def static_destinations(cache, mapper: KVMapper, batch: int, seq: int, places, dtype) -> dict | None:
    """`{target layer: (keys, values)}`, the `(B, H, seq, d)` views of a static cache's tensors where the next `seq`
    tokens go, when `cache` is a static cache of full-attention layers (`StaticLayer`: preallocated tensors and a
    `cumulative_length` tensor); `None` for any other cache (the mapped tensors are appended instead). Lazily
    allocated layers are allocated here, as their first `update` would."""
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "StaticLayer" for layer in layers):
        return None
    heads, dim = mapper.target_kv_heads, mapper.target_head_dim
    for t, layer in enumerate(layers):
        if not layer.is_initialized:
            empty = torch.empty((batch, heads, 0, dim), dtype=dtype, device=places[t])
            layer.lazy_initialization(empty, empty)
    start = int(layers[0].cumulative_length)  # one read (a device sync on a GPU): the layers advance together
    into = {}
    for t, layer in enumerate(layers):
        if layer.keys.shape[0] != batch or start + seq > layer.keys.shape[2]:
            raise InvalidInputError(
                f"the static cache holds {layer.keys.shape[0]} rows of at most {layer.keys.shape[2]} tokens, with "
                f"{start} used; mapping {batch} rows of {seq} tokens needs room for {start + seq}: make the cache "
                "with max_cache_len covering the prompt and the new tokens"
            )
        into[t] = (layer.keys[:, :, start : start + seq], layer.values[:, :, start : start + seq])
    return into


def map_span_layers(job: SpanJob, into: dict | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The `"layers"` schedule of the engine's chunked `_map_span` (the same `SpanJob` and result): whole-layer steps
    over all tokens at once (or over the fewest chunks the memory budget allows, `layer_chunk_tokens`). `into`:
    `{target layer: (keys, values)}` `(B, H, seq - first, d)` views to write into (a static cache's tensors)
    instead of new tensors.

    Per chunk: one fused op strips every source layer the mapper reads into its slot of the row buffer (slots in
    layer order); per step one product and one fused op that rotates its target layers' keys and writes them and
    their values into the cache."""
    source, target, mapper, src, source_cache, position_ids, first, targets, workspace, features = job
    seq = position_ids.shape[-1]
    first_keys, _ = cache_layer_kv(source_cache, 0)
    batch, device = first_keys.shape[0], execution_device(target)
    positions = position_ids[:, first:] if first else position_ids
    strip, rotate = workspace.rotations(source, target, positions.to(device))  # (B, T, d) each
    span = seq - first
    fused = _writes_into(mapper)
    plan = mapping_steps(mapper, targets, ascending=True)
    used = sorted({s for sources, _ in plan for s in sources})
    slots = {s: i for i, s in enumerate(used)}  # layer order: the layers a step reads side by side are one view
    order = [t for _, step_targets in plan for t in step_targets]  # target layers in step order
    # output features per token held at once: every target layer's rows (one rotation for all), or the widest step's
    widest = (len(order) if fused else max(len(step_targets) for _, step_targets in plan)) * mapper.y_row
    dtype = mapper.layout_dtype()
    chunk = layer_chunk_tokens(mapper, batch, span, len(used), widest, torch.device(device), workspace.nbytes())
    heads, dim = mapper.target_kv_heads, mapper.target_head_dim
    offsets = held_offsets(source_cache, src, plan, seq, first)
    if into is None:  # the new cache's tensors: one (2, N, B, H, T, d) block, [0] keys, [1] values, in step order
        block = torch.empty((2, len(order), batch, heads, span, dim), dtype=target.dtype, device=device).unbind(0)
        result = dict(zip(order, zip(block[0].unbind(0), block[1].unbind(0))))
    else:
        block, result = None, {t: into[t] for t in targets}
    kv_layers = [s for s in used if s < src.num_layers]  # the rest are hidden-state blocks
    row_space = workspace.buffer("rows", batch * chunk * len(used) * mapper.slot_features, dtype, device)
    out_space = workspace.buffer("mapped", batch * chunk * widest, dtype, device)
    whole = chunk == span
    for start in range(0, span, chunk):
        end = min(start + chunk, span)
        strip_c = strip if whole else strip.narrow(start, end)
        rotate_c = rotate if whole else rotate.narrow(start, end)
        rows = mapper.new_rows(batch, end - start, len(used), out=row_space)  # (B·c, L·H_s·2d_s) or so
        keys_in, values_in = [], []
        for s in kv_layers:  # source layer s's tokens of this chunk, keys post-RoPE (B, H, c, d)
            keys, values = cache_layer_kv(source_cache, s)
            lo, hi = first + start - offsets[s], first + end - offsets[s]
            if (lo, hi) != (0, keys.shape[2]):
                keys, values = keys[:, :, lo:hi], values[:, :, lo:hi]
            if keys.device != device:
                keys, values = keys.to(device), values.to(device)
            keys_in.append(keys)
            values_in.append(values)
        _strip_into_rows(mapper, rows, [slots[s] for s in kv_layers], keys_in, values_in, strip_c, batch, end - start)
        for s in used[len(kv_layers) :]:  # hidden-state blocks, as they are (no rotation)
            part = features[0].piece(features[1], s)[:, first + start : first + end]  # (B, c, W)
            features[0].write_block(mapper, rows, slots[s], part.to(device))
        if block is not None:  # (N, B, H, c, d) each: the chunk's tokens of every layer
            outputs = block if whole else tuple(x[..., start:end, :] for x in block)
        else:
            kept = [result[t] for t in order]  # (B, H, T, d) pairs in step order
            outputs = kept if whole else [(k[..., start:end, :], v[..., start:end, :]) for k, v in kept]
        if fused:  # every step's product into its columns of one buffer, then one rotation for all target layers
            mapped = _mapped_buffer(mapper, out_space, batch * (end - start), len(order))
            column = 0
            for sources, step_targets in plan:
                width = len(step_targets) * mapper.out_width
                mapper.map_targets(sources, step_targets, rows, slots=slots, into=mapped[..., column : column + width])
                column += width
            keys_c, values_c = mapper.split_rows(mapped, batch, end - start, layers=len(order))  # (N, B, H, c, d)
            mapper.project_mapped_keys(keys_c, order)  # onto the target's key-norm sphere, if it has one
            _rotate_into(keys_c, values_c, rotate_c, outputs)
            continue
        done = 0
        for sources, step_targets in plan:  # a mapper with its own product: one rotation per step
            mapped = mapper.map_targets(sources, step_targets, rows, out=out_space, slots=slots)
            keys_c, values_c = mapper.split_rows(mapped, batch, end - start, layers=len(step_targets))  # (n,B,H,c,d)
            mapper.project_mapped_keys(keys_c, step_targets)
            n = len(step_targets)
            part = tuple(x[done : done + n] for x in outputs) if block is not None else outputs[done : done + n]
            _rotate_into(keys_c, values_c, rotate_c, part)
            done += n
    return result


def _writes_into(mapper: KVMapper) -> bool:
    """Whether `mapper` keeps `KVMapper`'s own product, which writes a step into a view of a larger buffer
    (`map_targets(into=...)`); mappers with a product of their own (low rank, MLP) return theirs instead."""
    return mapper.groupable and type(mapper).map_targets is KVMapper.map_targets


def _mapped_buffer(mapper: KVMapper, space: torch.Tensor, rows: int, layers: int) -> torch.Tensor:
    """`layers` target layers' rows side by side in `space`, in `map_targets`' layout: `(B·T, n·H·2d)`, or
    `(G, B·T, n·w)` for a mapper with head groups."""
    width = layers * mapper.out_width
    shape = (mapper.groups, rows, width) if mapper.grouped else (rows, width)
    return space[: rows * width * mapper.groups].view(shape)


def _strip_into_rows(mapper: KVMapper, rows, slots: list[int], keys, values, rotation: Rotation, batch, seq) -> None:
    """Strips the rotation of each source layer's `keys` and writes them with its `values` into its slot of `rows`:
    one fused op for all of them where one view covers the slots (`KVMapper.row_views`), else layer by layer."""
    views = mapper.row_views(rows, batch, seq)
    tables = rotation.half_tables
    if views is not None and tables is not None:
        key_slots, value_slots = (v.unbind(0) for v in views)  # (B, H, c, d) views, one per slot
        rotate_kv(keys, values, tables, [key_slots[i] for i in slots], [value_slots[i] for i in slots])
        return

    def write_keys(k, out):
        if tables is None:
            rotation(k, out=out)
        else:
            rotate_kv([k], [], tables, [out], [])

    for slot, k, v in zip(slots, keys, values):
        mapper.write_rows(rows, slot, k, v, write_keys=write_keys)


def _rotate_into(keys: torch.Tensor, values: torch.Tensor, rotation: Rotation, outputs) -> None:
    """Rotates the `n` layers of `keys` `(n, B, H, c, d)` into `outputs`' keys and copies `values` into its values:
    `outputs` is a `(keys, values)` pair of `(n, B, H, c, d)` blocks (one fused op, `rope.rotate_kv`, for all `n`
    layers) or a list of `n` pairs of `(B, H, c, d)` tensors (a static cache's layers: one op, one launch per layer).
    A rotation that is not rotate-half runs eagerly."""
    tables = rotation.half_tables
    if isinstance(outputs, tuple):
        key_out, value_out = [outputs[0]], [outputs[1]]
        keys, values = [keys], [values]
    else:
        key_out, value_out = [k for k, _ in outputs], [v for _, v in outputs]
        keys, values = keys.unbind(0), values.unbind(0)
    if tables is not None:
        rotate_kv(keys, values, tables, key_out, value_out)
        return
    for k, v, k_out, v_out in zip(keys, values, key_out, value_out):
        rotation(k, out=k_out)
        v_out.copy_(v)
