"""The connector's worker side, the bridged-request engine: loads the bridge (source model, mapper, the target's
rotary embedding), gets each load's source K/V (fetched from the KV store, the source prefill, or both), maps them,
writes the mapped K/V into vLLM's paged cache, runs the quality gate after the forward pass, and reports failed loads
so that the target recomputes them. On an exporting engine it also reads the K/V of each step's completed store
chunks back from the paged cache and hands them to the store's writer thread."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import DynamicCache
from vllm.logger import init_logger

from ...errors import KVLayoutError, ServingConfigError
from ...transfer.plan import plan_load, plan_transfer
from ...transfer.steps import SourceKV, TransferDecision, TransferSteps, decide, served_outcome
from ...utils.cache import append_layer, output_cache, slice_cache
from ..kv_store.staging import StagingPool
from ..kv_store.writer import DEFAULT_MAX_PENDING_BYTES
from .adapters import AdapterMapping
from .export import ShardGeometry, export_local, export_sharded, unpack
from .metadata import BridgeLoad, GateCheck, KVBridgeConnectorMetadata, KVBridgeWorkerMetadata
from .paged_cache import read_slots, reads_back, slot_nbytes, slots_of, write_layer
from .rotary import RotaryOnlyTarget
from .scatter import cache_of, rank_buffers, scatter_from_first_rank, sent_tokens, stack_kv
from .tensor_parallel import HeadShard, mean_over_ranks, slice_heads

logger = init_logger("vllm.hf_kvbridge")  # under "vllm", so vLLM's handlers format and show it


def load_bridge(
    config,
    folder,
    revision: str | None,
    dtype: torch.dtype,
    device,
    bridge_ref: str = "",
    *,
    source_weights: bool = True,
):
    """The source model, the mapper, and the target's rotary embedding (no target weights), as a
    `KVBridgeForCausalLM`. With `source_weights=False` (a store-only target) the source is a stand-in too: its
    config and rotary embedding, which the mapper needs to strip the source's rotation from fetched keys. Loaded
    outside inference mode, so the mapper's stacked weights can be cached (vLLM runs this inside it)."""
    from ...loading import load_model
    from ...modeling import KVBridgeForCausalLM

    device = torch.device(device)
    with torch.inference_mode(False):
        if source_weights:
            source = load_model(config.source_name_or_path, config.source_revision, dtype=dtype)
            source = source.to(device)
        else:
            source = RotaryOnlyTarget.from_reference(config.source_name_or_path, config.source_revision, dtype, device)
        target = RotaryOnlyTarget.from_reference(config.target_name_or_path, config.target_revision, dtype, device)
        bridge = KVBridgeForCausalLM.from_pretrained(
            folder, source_model=source, target_model=target, revision=revision
        )
        bridge.reverse = None  # a bidirectional checkpoint's reverse mapper is of no use here
    logger.info(
        "KVBridgeConnector: bridge %s loaded (source %s, %d parameters; mapper %d parameters; target %s: rotary "
        "embedding only)",
        bridge_ref,
        config.source_name_or_path,
        sum(p.numel() for p in source.parameters()),
        sum(p.numel() for p in bridge.mapper.parameters()),
        config.target_name_or_path,
    )
    return bridge


def load_adapter_bridges(bridge, adapters: dict[str, AdapterMapping]) -> dict[str, Any]:
    """The LoRA adapters' bridges (`{name: AdapterMapping}`, read at their revisions and checked at start-up:
    `adapters.adapter_refusal`), as `KVBridgeForCausalLM`s holding each adapter's mapper beside `bridge`'s source
    model and target stand-in (one source model, whatever the number of adapters). Each mapper is loaded from the
    folder the start-up checks read (a Hub bridge's snapshot of its pinned revision), so what was checked is what
    maps. Loaded outside inference mode, as `load_bridge`."""
    from ...modeling import KVBridgeForCausalLM

    out = {}
    with torch.inference_mode(False):
        for name, (config, folder, spec) in adapters.items():
            adapter_bridge = KVBridgeForCausalLM.from_pretrained(
                folder, source_model=bridge.source, target_model=bridge.target, config=config
            )
            adapter_bridge.reverse = None
            out[name] = adapter_bridge
            logger.info(
                "KVBridgeConnector: LoRA adapter %r is mapped with bridge %s (%s; mapper %d parameters; source %s)",
                name, spec, folder, sum(p.numel() for p in adapter_bridge.mapper.parameters()),
                config.source_name_or_path,
            )  # fmt: skip
    return out


def attention_layers(forward_context) -> dict[str, nn.Module]:
    """vLLM's attention layers that hold a paged cache and a cache-update op, by name."""
    return {
        name: layer
        for name, layer in forward_context.no_compile_layers.items()
        if hasattr(layer, "kv_cache") and hasattr(getattr(layer, "impl", None), "do_kv_cache_update")
    }


class BridgeWorker:
    """What `KVBridgeConnector` does in the worker process.

    Args:
        bridge (`KVBridgeForCausalLM`): the source, the mapper and the target's stand-in (`load_bridge`).
        block_size (`int`): vLLM's block size.
        gate_threshold (`float`, *optional*): the quality gate's threshold (`None`: no gate).
        count (`Callable`): adds to the connector's counters.
        store (`PrefixKVStore`, *optional*): the other model's KV in the store (fetched for loads with `store_end`).
        exports (`PrefixKVStore`, *optional*): this engine's model's KV in the store, with an `AsyncWriter`.
        source_weights (`bool`): whether `bridge.source` is the source model (else a stand-in: store-only).
        fetch_parts (`int`): runs a load from the store is fetched in, each mapped and written while the next is
            fetched (`1`: fetch all, then map).
        shard (`HeadShard`, *optional*): the target KV heads this tensor-parallel rank holds (`None`: all of them).
            At TP > 1 rank 0 maps every load and scatters each rank its heads (`scatter`); `bridge` is `None` on the
            other ranks, which hold no source model and no mapper.
        kv_dtype (`torch.dtype`, *optional*): the dtype the mapped K/V are sent in at TP > 1 (the model's; the
            mapped cache's own, so that every rank writes what rank 0 mapped). Default float32.
        mappers (`dict`, *optional*): `{LoRA adapter name: KVBridgeForCausalLM}`, the adapters' bridges
            (`load_adapter_bridges`: their mappers, sharing `bridge`'s source and target stand-in); a load whose
            `mapper` names one is mapped with it. Held where `bridge` is (rank 0 at TP > 1).
    """

    def __init__(
        self,
        bridge,
        *,
        block_size: int,
        gate_threshold: float | None,
        count: Callable[..., None],
        store=None,
        exports=None,
        source_weights: bool = True,
        fetch_parts: int = 4,
        shard: HeadShard | None = None,
        kv_dtype: torch.dtype = torch.float32,
        mappers: dict[str, Any] | None = None,
    ):
        self.mappers = dict(mappers or {})
        self.bridge, self.block_size, self.gate_threshold, self.count = bridge, block_size, gate_threshold, count
        self.shard = shard or HeadShard(total=0)
        self.heads = self.shard.heads if self.shard.sharded else slice(None)  # this rank's target KV heads
        self.store, self.exports, self.source_weights = store, exports, source_weights
        writer = getattr(exports, "writer", None)  # the export's buffers: as much as the writer may queue is kept
        self.staging = StagingPool(getattr(writer, "max_pending_bytes", DEFAULT_MAX_PENDING_BYTES))
        self.staging_reserved = 0  # bytes of it faulted in at start-up (`register_kv_caches`)
        self.fetch_parts, self.kv_dtype = fetch_parts, kv_dtype
        self._shares: list[torch.Tensor] | None = None  # rank 0 at TP > 1: the load's mapped K/V, every head
        self._layers: dict[str, nn.Module] = {}
        self._export_layout_ok: bool | None = None
        self.source_forward_calls = 0  # source forward passes run in this worker (0 on a store-only target)
        self._invalid_blocks: set[int] = set()
        self._step_outcomes: dict[str, dict[str, Any]] = {}
        self._gate_checks: list[GateCheck] = []
        self._finished_sending: set[str] = set()  # ended requests whose blocks an export read in this step

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], step_tokens: int) -> int:
        """At start-up, once vLLM has made its paged caches: a TP 1 source that exports from a CPU cache reserves a
        step's export in its staging pool (`step_tokens`, the scheduler's tokens a step, times the bytes a token
        takes in every layer, capped by the pool's limit, `export_buffer_mb`), faulted in now, so that the first
        exports' steps do not pay for fresh pages. Returns the bytes reserved (0 elsewhere: no exports, a TP > 1
        engine, a GPU cache, whose reads go to pinned buffers). Any exporting engine warns when a whole step's
        export (every rank's heads) would not fit in `export_buffer_mb`: such steps drop exports past it."""
        caches = list(kv_caches.values())
        if self.exports is None or not caches:
            return 0
        per_token = sum(slot_nbytes(cache) for cache in caches)  # keys and values of one token in every layer
        whole = per_token * self.shard.total // self.shard.num_heads() if self.shard.sharded else per_token
        if whole * int(step_tokens) > self.staging.max_bytes:
            logger.warning(
                "KVBridgeConnector: a whole step's export (%d tokens × %d bytes = %.0f MiB) exceeds export_buffer_mb "
                "(%.0f MiB): a step that exports that much drops what does not fit (counted in writes_dropped); set "
                "kv_connector_extra_config['export_buffer_mb'] to at least %d",
                step_tokens, whole, whole * step_tokens / 2**20, self.staging.max_bytes / 2**20,
                -(-whole * step_tokens // 2**20),
            )  # fmt: skip
        if self.shard.sharded or caches[0].device.type != "cpu":
            return 0
        reserved = self.staging_reserved = self.staging.reserve(per_token * int(step_tokens))
        logger.info(
            "KVBridgeConnector: %.0f MiB of export staging reserved (%d tokens a step × %d bytes a token, at most "
            "%.0f MiB)", reserved / 2**20, step_tokens, per_token, self.staging.max_bytes / 2**20,
        )  # fmt: skip
        return reserved

    def start_load_kv(self, meta, forward_context) -> None:
        """Maps and writes every load of this step's metadata before the forward pass; a failure falls back."""
        self._layers = attention_layers(forward_context)  # the exports read them after the forward pass
        if not isinstance(meta, KVBridgeConnectorMetadata) or not meta.loads:
            return
        layers = self._layers
        if self.shard.sharded:  # rank 0 maps, every rank writes its heads
            self.load_sharded(meta.loads, layers)
            return
        for load in meta.loads:
            try:
                self.map_and_write(load, layers)
            except Exception as error:  # fall back: the target recomputes the claimed tokens
                self.fail(load, f"{type(error).__name__}: {error}")
                continue
            if not load.gated:  # no gate: mapped for good (a gated one is decided after the forward)
                self.record(load, decide(self.plan(load)))

    def fail(self, load: BridgeLoad, reason: str) -> None:
        """`load` could not be mapped or written: reported as a failed load (`fallback`), with a WARNING."""
        failed = decide(self.plan(load), ok=torch.zeros(1, dtype=torch.bool))
        self.record(load, failed, reason=reason)
        if load.gated and self.shard.sharded:  # the other ranks average the gate over this one: take part
            self._gate_checks.append(GateCheck(load, 0, None, None, None, failed=True))
        logger.warning(
            "KVBridgeConnector: mapping failed for request %s (%d tokens): %s; the target computes the prompt itself",
            load.req_id,
            load.end - load.start,
            reason,
        )

    def load_sharded(self, loads: list[BridgeLoad], layers: dict[str, nn.Module]) -> None:
        """A step's loads on a tensor-parallel rank (`scatter`): rank 0 maps each (`map_and_write`, which writes its
        own heads and keeps every head's K/V), then one scatter sends each rank its heads, which the other ranks
        write (`write_received`). A load rank 0 could not map reaches them as a zero status: every rank reports it
        as a failed load. Every rank calls the scatter once a step with loads, whatever failed."""
        first = next(iter(layers.values()))
        geometry = ShardGeometry(len(layers), int(first.num_kv_heads), int(first.head_size), self.kv_dtype)
        lengths = [sent_tokens(load) for load in loads]
        device = first.kv_cache.device
        numel = len(loads) + sum(geometry.numel(n) for n in lengths)
        if self.shard.rank != 0:
            flat = scatter_from_first_rank(None, numel, geometry.dtype, device)
            for load, kv in zip(loads, unpack(flat, lengths, geometry), strict=True):
                if kv is None:
                    self.fail(load, "tensor-parallel rank 0 could not map this load")
                    continue
                try:
                    self.write_received(load, layers, kv)
                except Exception as error:
                    self.fail(load, f"{type(error).__name__}: {error}")
                    continue
                if not load.gated:
                    self.record(load, decide(self.plan(load)))
            return
        kvs: list[torch.Tensor | None] = []
        for load, length in zip(loads, lengths, strict=True):
            self._shares, checks = [], len(self._gate_checks)
            try:
                self.map_and_write(load, layers)
                kv = torch.cat(self._shares, dim=2)  # (L, 2, T, H, d): [start, end), then the probe
                want = (geometry.layers, 2, length, self.shard.total, geometry.head_dim)
                if tuple(kv.shape) != want:  # what every rank's share is packed from: checked before it is sent
                    raise KVLayoutError(f"rank 0 mapped K/V of shape {tuple(kv.shape)} where {want} was expected")
                kvs.append(kv)
            except Exception as error:
                del self._gate_checks[checks:]  # one check a gated load on every rank: the failed one below
                kvs.append(None)
                self.fail(load, f"{type(error).__name__}: {error}")
                continue
            finally:
                self._shares = None
            if not load.gated:
                self.record(load, decide(self.plan(load)))
        buffers = rank_buffers(kvs, lengths, geometry, self.shard.total, self.shard.size, device)
        del kvs
        scatter_from_first_rank(buffers, numel, geometry.dtype, device)

    def write_received(self, load: BridgeLoad, layers: dict[str, nn.Module], kv: torch.Tensor) -> None:
        """Writes this rank's heads of `load`'s mapped K/V (`kv`, `(layers, 2, sent_tokens(load), h, d)`, from rank
        0's scatter) into its paged cache; a gated load's probe is kept for the gate, as `map_and_write` keeps it."""
        written = load.end - load.start
        slots = slots_of(load.block_ids, self.block_size, load.start, load.end)  # (end - start,)
        readable = self.write_mapped(layers, cache_of(kv[:, :, :written]), slots, slice(None), read_back=load.gated)
        self.count(tokens_received=written)
        if load.gated:
            positions = torch.arange(load.probe_end, device=kv.device).unsqueeze(0)  # (1, probe_end)
            steps = TransferSteps(self.plan(load), None, positions=positions, num_layers=len(layers))
            steps.mapped_probe = cache_of(kv[:, :, written:])  # (1, h, probe, d) per layer: this rank's heads
            probe_slots = slots_of(load.block_ids, self.block_size, load.probe_start, load.probe_end)
            self._gate_checks.append(GateCheck(load, written, steps, probe_slots, layers if readable else None))

    def write_mapped(
        self, layers: dict[str, nn.Module], mapped, slots: torch.Tensor, heads: slice, *, read_back: bool = False
    ) -> bool:
        """Writes the KV heads `heads` of `mapped` (a cache of the tokens at `slots`, `(1, H, T, d)` per layer) into
        `layers`' paged caches, one cache-update call a layer. With `read_back`, returns whether the cache reads back
        what was written (the gate reads it: `reads_back`, on the last block's tokens); else `True`."""
        from vllm.model_executor.models.utils import extract_layer_index

        readable = True
        for name, layer in layers.items():
            cache_layer = mapped.layers[extract_layer_index(name)]
            keys = cache_layer.keys[0, heads].transpose(0, 1)  # (T, h, d), post-RoPE, this rank's heads
            values = cache_layer.values[0, heads].transpose(0, 1)  # (T, h, d)
            check_heads(layer, keys)
            kv_cache = layer.kv_cache
            keys, values = keys.to(kv_cache.device).contiguous(), values.to(kv_cache.device).contiguous()
            write_layer(layer, keys, values, slots)
            if read_back:  # the gate reads the cache back: check that it reads what was written
                tail = slice(-self.block_size, None)
                readable = readable and reads_back(layer, slots[tail], keys[tail], values[tail])
        return readable

    def bridge_of(self, load: BridgeLoad):
        """The bridge whose mapper maps `load`: its LoRA adapter's (`load.mapper`), or the base bridge."""
        if load.mapper is None:
            return self.bridge
        adapter_bridge = self.mappers.get(load.mapper)
        if adapter_bridge is None:  # the scheduler claims only adapters with a mapper: never the base map instead
            raise ServingConfigError(f"no mapper for LoRA adapter {load.mapper!r} in this worker")
        return adapter_bridge

    def plan(self, load: BridgeLoad):
        """`load`'s transfer plan (`transfer.plan.plan_load`: the positions the scheduler's plan gave it)."""
        return plan_load(load.start, load.end, load.probe_start, load.probe_end, self.gate_threshold)

    def record(self, load: BridgeLoad, decision: TransferDecision, reason: str | None = None) -> None:
        """The request's outcome, from the transfer's `decision` (`transfer.steps.served_outcome`: `mapped`, `gated`
        or `fallback`). A load that did not transfer reports its blocks as failed loads: vLLM truncates the request
        to its last good block, discards this step's sampled token and has the target compute the rest. Every
        outcome carries the load's `start`: the request's tokens before it came from vLLM's prefix cache (what earlier
        requests of its cache salt computed, often the bridge's map), also when this load failed and the target
        computed the rest."""
        outcome = {**served_outcome(decision, self.plan(load), reason=reason), "start": load.start}
        status = outcome["status"]
        if decision.transferred:
            self._step_outcomes[load.req_id] = {**outcome, **load.origin()}
            self.count(requests_mapped=1, tokens_mapped=decision.mapped_tokens)
            return
        first, last = load.start // self.block_size, (load.end - 1) // self.block_size
        self._invalid_blocks.update(load.block_ids[first : last + 1])
        self._step_outcomes[load.req_id] = outcome
        self.count(**{f"requests_{status}": 1, f"tokens_{status}": load.end - load.start})

    def map_and_write(self, load: BridgeLoad, layers: dict[str, nn.Module]) -> int:
        """Source prefill over `load.token_ids`, mapping of tokens `[start, end)`, and one cache-update call per
        target attention layer. Returns the number of tokens written. With a quality gate, also maps the probe
        tokens `[probe_start, probe_end)` (not written: the target computes them in this step) and queues the gate's
        check for after the forward pass (`check_gates`). On rank 0 at TP > 1 it also keeps every head's mapped K/V
        for the other ranks (`load_sharded`)."""
        bridge = self.bridge
        if bridge is None:
            raise ServingConfigError(
                "the bridge is not loaded in this worker; the connector loads it at start-up (kv_role kv_both)"
            )
        device = bridge.device
        if self.store is not None and load.store_end >= load.end and not load.gated:
            return self.map_from_store(load, layers)
        maps = self.bridge_of(load)  # the base bridge, or the load's LoRA adapter's (same source, same stand-in)
        source_cache = self.source_kv(load)  # (1, H, probe_end, d) per source layer
        # the shared transfer steps, as vLLM runs them: no sinks and no recompute before the forward (the target
        # computes a recomputed tail itself, after the loaded prefix), the probe [probe_start, probe_end) after it
        plan = self.plan(load)
        positions = torch.arange(load.probe_end, device=device).unsqueeze(0)  # (1, probe_end)
        steps = TransferSteps(plan, maps.map_cache, positions=positions, num_layers=maps.target_layout.num_layers)
        started = time.perf_counter()
        mapped = steps.before_target(SourceKV(source_cache), cached=load.start)  # target layout, [start, end)
        self.count(map_seconds=time.perf_counter() - started)
        started = time.perf_counter()
        if len(layers) != len(mapped.layers):
            raise KVLayoutError(
                f"vLLM has {len(layers)} attention layers, the mapped cache {len(mapped.layers)}; serve the bridge's "
                "own target model (hf_kvbridge.integrations.vllm.target_model)"
            )
        slots = slots_of(load.block_ids, self.block_size, load.start, load.end)  # (end - start,)
        readable = self.write_mapped(layers, mapped, slots, self.heads, read_back=load.gated)
        self.count(write_seconds=time.perf_counter() - started)
        written = load.end - load.start
        if self._shares is not None:  # rank 0 at TP > 1: every head, for the other ranks
            self._shares.append(stack_kv(mapped))  # (L, 2, end - start, H, d)
            if load.gated:
                self._shares.append(stack_kv(steps.mapped_probe))  # (L, 2, probe, H, d)
        if load.gated:
            if self.shard.sharded:  # this rank scores its own heads of the mapped probe
                steps.mapped_probe = slice_heads(steps.mapped_probe, self.heads)
            probe_slots = slots_of(load.block_ids, self.block_size, load.probe_start, load.probe_end)
            self._gate_checks.append(GateCheck(load, written, steps, probe_slots, layers if readable else None))
        return written

    def map_from_store(self, load: BridgeLoad, layers: dict[str, nn.Module]) -> int:
        """A load whose mapped tokens `[start, end)` all come from the store: fetched in `fetch_parts` runs
        (`PrefixKVStore.iter_load`, on a thread of its own), each run mapped by the shared transfer steps and written
        into the paged cache as soon as it has arrived, while the next one is being fetched, so that the load costs
        about the longer of the fetch and the mapping, not their sum. Returns the number of tokens written."""
        bridge, maps = self.bridge, self.bridge_of(load)  # the base bridge, or the load's LoRA adapter's
        device, dtype = bridge.device, bridge.source.dtype
        began = time.perf_counter()
        fetched = waited = mapping = writing = 0.0
        runs = self.store.iter_load(
            load.token_ids, load.end, load.store_salt, stored=load.store_prefix, start=load.start,
            parts=self.fetch_parts,
        )  # fmt: skip
        positions = torch.arange(load.end, device=device).unsqueeze(0)  # (1, end)
        while True:
            started = time.perf_counter()
            run = next(runs, None)
            waited += time.perf_counter() - started
            if run is None:
                break
            fetched += run.seconds
            source = DynamicCache()
            for index, (k, v) in enumerate(zip(run.keys, run.values, strict=True)):  # (H, n, d) each
                append_layer(
                    source, index, k.to(device=device, dtype=dtype)[None], v.to(device=device, dtype=dtype)[None]
                )
            plan = plan_transfer(run.end, start=run.start)
            steps = TransferSteps(plan, maps.map_cache, positions=positions[:, : run.end],
                                  num_layers=maps.target_layout.num_layers)  # fmt: skip
            started = time.perf_counter()
            mapped = steps.before_target(StoredRun(source, offset=run.start), cached=run.start)  # [start, end) of run
            mapping += time.perf_counter() - started
            started = time.perf_counter()
            if len(layers) != len(mapped.layers):
                raise KVLayoutError(
                    f"vLLM has {len(layers)} attention layers, the mapped cache {len(mapped.layers)}; serve the "
                    "bridge's own target model (hf_kvbridge.integrations.vllm.target_model)"
                )
            slots = slots_of(load.block_ids, self.block_size, run.start, run.end)  # (n,)
            self.write_mapped(layers, mapped, slots, self.heads)
            if self._shares is not None:  # rank 0 at TP > 1: every head, for the other ranks
                self._shares.append(stack_kv(mapped))  # (L, 2, n, H, d)
            writing += time.perf_counter() - started
        self.count(
            fetch_seconds=fetched, fetch_wait_seconds=waited, map_seconds=mapping, write_seconds=writing,
            load_seconds=time.perf_counter() - began, tokens_fetched=load.end - load.start, store_loads=1,
        )  # fmt: skip
        return load.end - load.start

    def source_kv(self, load: BridgeLoad):
        """The source's cache of the load's tokens (at least `[0, probe_end)`): the tokens of `[0, store_end)` it needs
        fetched from the KV store (`hf_kvbridge.integrations.kv_store.load_cache`, cast to the source's dtype), the
        rest computed by the worker's source model over the fetched cache (the cold path when nothing was fetched)."""
        from ..kv_store import load_cache

        bridge, cache = self.bridge, None
        fetched = min(load.store_end, load.probe_end)
        if fetched > 0:
            started = time.perf_counter()
            cache = load_cache(
                self.store, load.token_ids, fetched, salt=load.store_salt, dtype=bridge.source.dtype,
                device=bridge.device, stored=load.store_prefix,
            )  # fmt: skip
            self.count(fetch_seconds=time.perf_counter() - started, tokens_fetched=fetched)
        if load.probe_end > fetched:
            if not self.source_weights:
                raise ServingConfigError(
                    f"request {load.req_id} needs the source's K/V of tokens {fetched}..{load.probe_end} and this "
                    "worker has no source model (source_weights=false): the scheduler should not have claimed them"
                )
            started = time.perf_counter()
            ids = torch.tensor([load.token_ids[fetched : load.probe_end]], device=bridge.device)  # (1, T - fetched)
            positions = torch.arange(fetched, load.probe_end, device=bridge.device).unsqueeze(0)
            past = {} if cache is None else {"past_key_values": cache}
            out = bridge.source(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **past)
            cache = output_cache(out)
            self.source_forward_calls += 1
            self.count(prefill_seconds=time.perf_counter() - started, tokens_prefilled=load.probe_end - fetched)
        return cache

    def export_steps(self, meta) -> None:
        """After the forward pass: reads the K/V of each export task's tokens back from the paged cache (one gather
        per layer; the store's writer thread encodes and writes them, so the step does not wait for the store). An
        ended request's task (`finished`) is reported in `finished_sending` afterwards, whatever its outcome, so that
        vLLM frees its blocks."""
        if not isinstance(meta, KVBridgeConnectorMetadata) or not meta.exports:
            return
        from vllm.model_executor.models.utils import extract_layer_index

        layers = [layer for _, layer in sorted(self._layers.items(), key=lambda item: extract_layer_index(item[0]))]
        if self.shard.sharded:  # each rank reads its heads, rank 0 writes them all (export.export_sharded)
            self._export_sharded(meta.exports, layers)
            return
        try:
            if self.exports is not None:
                self._export(meta.exports, layers)
        finally:
            self._finished_sending.update(task.req_id for task in meta.exports if task.finished)

    def _export(self, tasks, layers: list[nn.Module]) -> None:
        """The step's export `tasks` on a TP 1 engine (`export.export_local`), read into this worker's pool."""
        export_local(tasks, layers, block_size=self.block_size, exports=self.exports, count=self.count,
                     pool=self.staging)  # fmt: skip

    def _export_sharded(self, tasks, layers: list[nn.Module]) -> None:
        try:
            if self.exports is not None:
                export_sharded(tasks, layers, block_size=self.block_size, exports=self.exports, shard=self.shard,
                               count=self.count)  # fmt: skip
        except Exception as error:  # an export never fails the step
            self.count(export_errors=len(tasks))
            logger.warning("KVBridgeConnector: export failed: %s: %s", type(error).__name__, error)
        finally:
            self._finished_sending.update(task.req_id for task in tasks if task.finished)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The ended requests whose last export read their blocks in this step: vLLM frees their blocks now."""
        done, self._finished_sending = self._finished_sending, set()
        return (done or None), None

    def check_gates(self) -> None:
        """The quality gate of this step's gated loads, after the forward pass wrote the target's own K/V of the probe
        tokens into the paged cache: `transfer.steps.probe_agreement` of own vs mapped probe K/V (mean cosine over
        layers, heads and tokens, as `bridge.generate` scores it). Below `gate_threshold`, or if the cache cannot be
        read, the load is reported as failed and the target computes the prompt itself. On a tensor-parallel rank
        each rank scores its own heads and the scores are averaged over the ranks (`mean_over_ranks`), so that every
        rank decides alike on the score over all heads."""
        checks, self._gate_checks = self._gate_checks, []
        if not checks:
            return
        local, reasons = [], []
        for check in checks:
            score, reason = self._own_score(check)
            local.append(float("nan") if score is None else score)
            reasons.append(reason)
        scores = mean_over_ranks(torch.tensor(local, dtype=torch.float32), self.shard).tolist()
        for check, score, reason in zip(checks, scores, reasons, strict=True):
            if check.failed:  # this rank's mapping failed: it has reported its fallback already
                continue
            load = check.load
            if score != score:  # NaN: this rank, or another one, could not score
                reason = reason or "another tensor-parallel rank could not map or score the probe"
            check.steps.judge(torch.tensor([score]))  # the decision on the score over every rank's heads
            decision = check.steps.decision()
            self.record(load, decision, reason=None if decision.transferred else reason)
            if decision.transferred:
                continue
            score = decision.score
            logger.warning(
                "KVBridgeConnector: quality gate rejected the mapping of request %s (%d tokens): probe K/V cosine %s "
                "below %s%s; the target computes the prompt itself",
                load.req_id,
                load.end - load.start,
                "n/a" if score is None else f"{score:.4f}",
                self.gate_threshold,
                f" ({reason})" if reason else "",
            )

    def _own_score(self, check: GateCheck) -> tuple[float | None, str | None]:
        """This rank's gate score of `check` (its heads' own probe K/V read back against their mapped ones), or
        `None` and the reason."""
        from vllm.model_executor.models.utils import extract_layer_index

        if check.failed:
            return None, "mapping failed"
        if check.layers is None:
            return None, "the quality gate cannot read this attention backend's KV cache layout"
        try:
            own = DynamicCache()
            for name, layer in check.layers.items():
                keys, values = read_slots(layer, check.slots)  # (n, h, d) each
                append_layer(own, extract_layer_index(name), keys.transpose(0, 1)[None], values.transpose(0, 1)[None])
            return float(check.steps.score(own, 0)[0]), None  # own: the probe tokens only; decided over the ranks
        except Exception as error:
            return None, f"quality gate failed: {type(error).__name__}: {error}"

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Called after the forward pass (also when wait_for_save is deferred past a draft model), so the probe
        # tokens' own K/V are in the cache: the gate decides here, and its failures reach the scheduler in this step.
        self.check_gates()
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_connector_worker_meta(self) -> KVBridgeWorkerMetadata | None:
        if not self._step_outcomes:
            return None
        outcomes, self._step_outcomes = self._step_outcomes, {}
        return KVBridgeWorkerMetadata(outcomes)


def check_heads(layer: nn.Module, keys: torch.Tensor) -> None:
    """Refuses to write `keys` (`(T, h, d)`) into a layer whose cache holds another number of KV heads (a
    tensor-parallel rank holds its share): a write past them would land in other blocks."""
    expected = getattr(getattr(layer, "impl", None), "num_kv_heads", None)
    if expected is not None and keys.shape[1] != expected:
        raise KVLayoutError(
            f"the mapped cache has {keys.shape[1]} KV heads for this rank and vLLM's layer holds {expected}; serve "
            "the bridge's own target model (hf_kvbridge.integrations.vllm.target_model)"
        )


class StoredRun(SourceKV):
    """The source's K/V of a run of tokens `[offset, offset + n)` fetched from the store, as the transfer steps read a
    source cache (from position 0): `kv(start, end)` slices at absolute positions."""

    def __init__(self, cache, offset: int):
        super().__init__(cache)
        self.offset = offset

    def kv(self, start: int, end: int):
        if start == self.offset and end - start == self.cache.get_seq_length():
            return self.cache
        return slice_cache(self.cache, start - self.offset, end - self.offset)
