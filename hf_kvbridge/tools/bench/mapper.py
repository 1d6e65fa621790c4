"""Latency, FLOP efficiency and memory of the mapper against the target's own prefill of the same context.

Timed as the paper times it: the target's re-prefill is its transformer body without the LM head; the mapper is
`map_cache` (strip RoPE, map, apply RoPE, build the `DynamicCache`) with the source cache already there (*warm*, the
cascade case); *cold* adds the source's own prefill (the bridge as one model). Medians of repeated runs after
warm-up. Weights do not change timings, so real-size shapes can be benchmarked with random weights
(`shapes.random_bridge`).
"""

from __future__ import annotations

import torch

from ...mappers.engine import resolve_schedule
from ...utils.cache import output_cache
from ...utils.precision import float32_matmul_precision
from .flop_model import mapper_flops, prefill_flops
from .ops import mapping_measures
from .report import fixed_width
from .timing import interleaved_medians, median_seconds, peak_extra_bytes, random_prompts


@torch.no_grad()
def mapper_vs_prefill(
    bridge,
    input_ids: torch.Tensor,
    repeats: int = 5,
    warmup: int = 1,
    interleave: bool = False,
    schedule: str | None = None,
    ceilings: dict | None = None,
) -> dict:
    """Times target re-prefill, mapper and source prefill for one context, with FLOP efficiency and memory.

    Returns:
        `dict` with seconds for each, the warm (`prefill / map`) and cold (`prefill / (source + map)`) speedups,
        FLOPs, achieved FLOP/s, the mapper's efficiency relative to the target's prefill (FLOP/s ratio), the
        FLOP-ratio bound on the warm speedup, the peak extra memory of one mapping (the cache it returns included)
        and the workspace `map_cache` keeps between mappings.

    Each of the three runs `repeats` times in a row (the usual way: warm caches, memory the allocator just freed);
    with `interleave=True` the rounds run source, mapper, target, so the mapper runs right after a source prefill,
    as in a cascade, and each one after the others have evicted its data. `schedule` is the engine's
    (`hf_kvbridge.mappers.engine.SCHEDULES`); the row also holds the mapping's ops, device time and floors
    (`ops.mapping_measures`, with the device's measured `ceilings`).
    """
    from ...utils.devices import execution_device

    device = bridge.device
    ids_t, ids_s = input_ids.to(device), input_ids.to(execution_device(bridge.source))
    tokens = int(input_ids.numel())
    source_cache = output_cache(bridge.source.model(input_ids=ids_s, use_cache=True))
    fns = {  # in cascade order when interleaved: the mapper runs right after a source prefill
        "source": lambda: bridge.source.model(input_ids=ids_s, use_cache=True),
        "mapper": lambda: bridge.map_cache(source_cache, schedule=schedule),
        "target": lambda: bridge.target.model(input_ids=ids_t, use_cache=True),
    }
    if interleave:
        seconds = interleaved_medians(fns, device, repeats, warmup)
    else:
        seconds = {name: median_seconds(fn, device, repeats, warmup) for name, fn in fns.items()}
    target_s, map_s, source_s = seconds["target"], seconds["mapper"], seconds["source"]
    peak = peak_extra_bytes(lambda: bridge.map_cache(source_cache, schedule=schedule), device)  # warm workspace
    measures = mapping_measures(bridge, fns["mapper"], *input_ids.shape, map_s, ceilings)
    target_flops = prefill_flops(bridge.target.config, int(input_ids.shape[1])) * input_ids.shape[0]
    map_flops = mapper_flops(bridge.mapper, tokens)
    return {
        "context_tokens": int(input_ids.shape[1]),
        "batch": int(input_ids.shape[0]),
        "target_prefill_s": target_s,
        "mapper_s": map_s,
        "source_prefill_s": source_s,
        "warm_speedup": target_s / map_s,
        "cold_speedup": target_s / (source_s + map_s),
        "target_prefill_flops": target_flops,
        "mapper_flops": map_flops,
        "target_flops_per_s": target_flops / target_s,
        "mapper_flops_per_s": map_flops / map_s,
        "mapper_efficiency": (map_flops / map_s) / (target_flops / target_s),
        "flop_ratio_bound": target_flops / map_flops,
        "fraction_of_bound": (target_s / map_s) / (target_flops / map_flops),
        "mapping_peak_extra_bytes": peak,
        "mapping_workspace_bytes": bridge.workspace_bytes(),
        "mapped_cache_bytes": _mapped_cache_bytes(bridge, tokens),
        "repeats": repeats,
        "warmup": warmup,
        "device": str(device),
        "dtype": str(bridge.target.dtype),
        "mapper_dtype": str(bridge.mapper.layout_dtype()),
        "threads": torch.get_num_threads(),
        "interleaved": interleave,
        "schedule": resolve_schedule(schedule, device),
        **measures,
    }


def _mapped_cache_bytes(bridge, tokens: int) -> int:
    layout = bridge.target_layout
    element = torch.finfo(bridge.target.dtype).bits // 8
    return layout.num_layers * tokens * layout.features_per_layer * element


def benchmark(
    bridge,
    lengths: list[int],
    *,
    batch: int = 1,
    repeats: int = 5,
    warmup: int = 1,
    seed: int = 0,
    interleave: bool = False,
    schedule: str | None = None,
    ceilings: dict | None = None,
) -> list[dict]:
    """`mapper_vs_prefill` at each context length on random token ids.

    Example:

    ```python
    >>> rows = benchmark(bridge, [256, 1024], repeats=3)  # doctest: +SKIP
    >>> rows[-1]["warm_speedup"]  # doctest: +SKIP
    ```
    """
    prompts = random_prompts(bridge.target_layout.vocab_size, lengths, batch, seed)
    return [mapper_vs_prefill(bridge, ids, repeats, warmup, interleave, schedule, ceilings) for ids in prompts]


def format_table(rows: list[dict]) -> str:
    """The benchmark as a fixed-width table."""
    header = (
        "tokens",
        "target ms",
        "mapper ms",
        "source ms",
        "warm ×",
        "cold ×",
        "bound ×",
        "of bound",
        "map eff.",
        "map peak MB",
        "workspace MB",
    )
    table = []
    for r in rows:
        peak = r["mapping_peak_extra_bytes"]
        cells = (
            r["context_tokens"],
            f"{r['target_prefill_s'] * 1e3:.1f}",
            f"{r['mapper_s'] * 1e3:.1f}",
            f"{r['source_prefill_s'] * 1e3:.1f}",
            f"{r['warm_speedup']:.2f}",
            f"{r['cold_speedup']:.2f}",
            f"{r['flop_ratio_bound']:.2f}",
            f"{r['fraction_of_bound']:.2f}",
            f"{r['mapper_efficiency']:.2f}",
            "n/a" if peak is None else f"{peak / 2**20:.1f}",
            f"{r['mapping_workspace_bytes'] / 2**20:.1f}",
        )
        table.append(cells)
    return fixed_width(header, table)


# `--old-vs-new`: the default mapping of a float32 bridge at PyTorch's default matmul precision against the one where
# `torch.set_float32_matmul_precision("medium")` lets it map with a bfloat16 copy of the mapper
OLD_DEFAULT = "map_cache with the float32 mapper (float32 matmul precision 'highest', PyTorch's default)"
NEW_DEFAULT = (
    "map_cache with a bfloat16 copy of the mapper (KVBridgeForCausalLM.mapping_mapper) under "
    "torch.set_float32_matmul_precision('medium'), where the device has bfloat16 matrix units; the float32 mapper "
    "otherwise"
)


@torch.no_grad()
def old_vs_new(bridge, lengths: list[int], *, batch: int = 1, repeats: int = 20, warmup: int = 2, seed: int = 0):
    """The old default mapping against the new one on the same bridge, source caches and lengths, in one run.

    Old: the bridge's float32 mapper (`map_cache` with `bridge.mapper`). New: `bridge.map_cache` under
    `torch.set_float32_matmul_precision("medium")`, which maps with a bfloat16 copy of the mapper where the device has
    bfloat16 matrix units (`hf_kvbridge.utils.precision`). Per length, one source cache; the two are timed in
    alternating
    rounds (`interleaved_medians`), so a slow patch of a shared machine slows both alike, and their outputs are
    compared (`max_abs_difference`, and `relative_difference`: the largest `‖new − old‖ / ‖old‖` over the layers' keys
    and values; 0 where the new one maps in float32 too).

    Returns:
        `list[dict]`, one row per length: `old_default_s`, `new_default_s` (medians), `new_over_old` (their ratio,
        < 1 when the new one is faster), `max_abs_difference`, `relative_difference`, `new_mapper_dtype`,
        `mapper_flops`, `repeats`, `threads`.

    Example:

    ```python
    >>> rows = old_vs_new(bridge, [256, 1024])  # doctest: +SKIP
    >>> rows[-1]["new_over_old"]  # doctest: +SKIP
    ```
    """
    from ...mappers.engine import Workspace, map_cache
    from ...utils.devices import execution_device

    device = bridge.device
    old_workspace = Workspace()
    with float32_matmul_precision("medium"):
        new_dtype = bridge.mapping_mapper().layout_dtype()
    rows = []
    for length, ids in zip(lengths, random_prompts(bridge.target_layout.vocab_size, lengths, batch, seed)):
        source_cache = output_cache(
            bridge.source.model(input_ids=ids.to(execution_device(bridge.source)), use_cache=True)
        )

        def old(cache=source_cache):
            return map_cache(
                bridge.source,
                bridge.target,
                bridge.mapper,
                bridge.source_layout,
                cache,
                workspace=old_workspace,
                target_layout=bridge.target_layout,
            )

        def new(cache=source_cache):
            with float32_matmul_precision("medium"):
                return bridge.map_cache(cache)

        seconds = interleaved_medians({"old": old, "new": new}, device, repeats, warmup)
        pairs = [
            (a, b)
            for old_layer, new_layer in zip(old().layers, new().layers)
            for a, b in ((old_layer.keys, new_layer.keys), (old_layer.values, new_layer.values))
        ]
        rows.append(
            {
                "context_tokens": length,
                "batch": batch,
                "old_default_s": seconds["old"],
                "new_default_s": seconds["new"],
                "new_over_old": seconds["new"] / seconds["old"],
                "max_abs_difference": max((b.float() - a.float()).abs().max().item() for a, b in pairs),
                "relative_difference": max(
                    ((b.float() - a.float()).norm() / a.float().norm().clamp_min(1e-30)).item() for a, b in pairs
                ),
                "mapper_flops": mapper_flops(bridge.mapper, batch * length),
                "repeats": repeats,
                "warmup": warmup,
                "threads": torch.get_num_threads(),
                "device": str(device),
                "mapper_dtype": str(bridge.mapper.layout_dtype()),
                "new_mapper_dtype": str(new_dtype),
            }
        )
    return rows


def format_old_vs_new(rows: list[dict]) -> str:
    """`old_vs_new` as a fixed-width table."""
    header = ("tokens", "old ms", "new ms", "new / old", "max |diff|", "rel. diff")
    table = []
    for r in rows:
        cells = (
            r["context_tokens"],
            f"{r['old_default_s'] * 1e3:.2f}",
            f"{r['new_default_s'] * 1e3:.2f}",
            f"{r['new_over_old']:.3f}",
            f"{r['max_abs_difference']:.1e}",
            f"{r['relative_difference']:.1e}",
        )
        table.append(cells)
    return fixed_width(header, table)
