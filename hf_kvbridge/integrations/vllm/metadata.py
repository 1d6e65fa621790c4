"""The metadata the connector passes scheduler → worker (`BridgeLoad`s, `ExportTask`s) and worker → scheduler
(outcomes), and the worker's pending quality-gate checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata

FAILED = ("fallback", "gated")  # outcomes whose blocks are reported as failed loads: the target recomputes them


@dataclass
class BridgeLoad:
    """One request's mapping in this step: source-prefill `token_ids` (the prompt up to `probe_end`), write the
    mapped K/V of tokens `[start, end)` into the slots of `block_ids`. With a quality gate, the target computes tokens
    `[probe_start, probe_end)` itself in this step (the probe); their mapped K/V are computed too, not written, and
    compared with the target's own after the forward pass. Without a gate `probe_start == probe_end`. Tokens
    `[end, probe_start)` are the recomputed tail (`recompute_fraction`, policy `"tail"`): the target computes them in
    this step, before the probe, as `bridge.generate` recomputes them.

    With a KV store, the store holds the source K/V of tokens `[0, store_end)` (`store_prefix`: the scheduler's
    lookup, where its chunks are; `store_salt` is the tenant's salt in the store's keys; `token_ids` reach to at least
    `store_end`): the worker fetches those of `[0, min(store_end, probe_end))` and the source runs only over the
    rest up to `probe_end`, from the fetched cache (none at all when `store_end >= probe_end`).

    `mapper`: the LoRA adapter whose mapper maps this load (`lora_bridges`); `None`: the base bridge's."""

    req_id: str
    token_ids: list[int]
    start: int
    end: int
    block_ids: list[int]
    probe_end: int
    probe_start: int | None = None
    store_end: int = 0
    store_salt: str | None = None
    store_prefix: Any = None
    mapper: str | None = None

    def __post_init__(self):
        if self.probe_start is None:
            self.probe_start = self.end

    @property
    def gated(self) -> bool:
        return self.probe_end > self.probe_start

    def origin(self) -> dict[str, Any]:
        """Where this load's source K/V come from, for the request's status: `source` (`"store"`: all fetched from
        the KV store; `"partial"`: a stored prefix plus the worker's source prefill; `"prefill"`: the cold path) and
        the token counts of each."""
        fetched = min(self.store_end, self.probe_end)
        kind = "prefill" if fetched == 0 else "store" if self.end <= self.store_end else "partial"
        return {"source": kind, "store_tokens": fetched, "prefill_tokens": self.probe_end - fetched}


@dataclass
class GateCheck:
    """A quality-gate check waiting for the forward pass: the load's transfer steps (`steps`, a
    `transfer.steps.TransferSteps` holding the mapped K/V of the probe tokens), the probe's slots in vLLM's paged
    cache, and the attention layers to read the target's own K/V from (`None` when the written cache could not be
    read back, see `read_slots`)."""

    load: BridgeLoad
    written: int
    steps: Any
    slots: torch.Tensor
    layers: dict[str, nn.Module] | None
    failed: bool = False  # this rank's mapping failed (a tensor-parallel rank still takes part in the gate's mean)


@dataclass
class ExportTask:
    """One request's export in this step (a source engine's connector): after the forward pass, read the K/V of
    tokens `[start, end)` (`start` chunk-aligned) from the slots of `block_ids` and write them to the KV store,
    chained from `token_ids[:start]` (`token_ids` is the sequence from token 0 up to `end`): the whole chunks, and
    with `tail` the trailing partial chunk (its sub-chunks and remainder). `finished`: the request has ended and its
    blocks are held for this export; the worker reports it in `finished_sending` once it has read them."""

    req_id: str
    token_ids: list[int]
    start: int
    end: int
    block_ids: list[int]
    salt: str | None = None
    tail: bool = False
    finished: bool = False


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    loads: list[BridgeLoad] = field(default_factory=list)
    exports: list[ExportTask] = field(default_factory=list)


@dataclass
class KVBridgeWorkerMetadata(KVConnectorWorkerMetadata):
    """Per-request outcomes of this step's mappings (`{req_id: {"status": ..., ...}}`)."""

    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.outcomes)
        for req_id, outcome in getattr(other, "outcomes", {}).items():
            if merged.get(req_id, {}).get("status") not in FAILED:  # a failure on any worker wins
                merged[req_id] = outcome
        return KVBridgeWorkerMetadata(merged)
