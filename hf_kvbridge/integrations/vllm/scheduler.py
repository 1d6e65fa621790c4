"""The connector's scheduler side: which requests are bridged, how many prompt tokens the connector claims (the
transfer plan's, `hf_kvbridge.transfer.plan.plan_prompt`, as `bridge.prefill` plans them; with a KV store, how much of
it a stored source prefix covers), the loads sent to the worker, and (an exporting engine) what each step exports: the
store chunks it completes, the prompt's trailing partial chunk in the step that completes the prefill, and the
conversation's trailing partial chunk once the request has ended (its blocks are held one more step for it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from ...transfer.plan import TransferPlan, plan_prompt
from .configuration import PARAM_KEY, ROUTER_PARAM_KEY, parse_request_flag
from .metadata import BridgeLoad, ExportTask, KVBridgeConnectorMetadata
from .support import request_mapper, request_refusal

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.hf_kvbridge")  # under "vllm", so vLLM's handlers format and show it


class BridgeScheduler:
    """What `KVBridgeConnector` does in the scheduler process.

    Args:
        config (`KVBridgeConfig`): the bridge's config (its transfer knobs plan the positions).
        hold_back (`int`): prompt tokens left to vLLM's target (at least 1: vLLM computes the last prompt token).
        requests_mode (`str`): `"opt_in"` or `"all"`.
        salt_tag (`str`): the cache-salt prefix of bridged requests.
        count (`Callable`): adds to the connector's counters (`count(requests_claimed=1, ...)`).
        imports (`bool`): whether this engine maps into its model (roles target and both); `False` on a source.
        store (`PrefixKVStore`, *optional*): the other model's KV in the store, looked up for bridged requests.
        exports (`PrefixKVStore`, *optional*): this engine's model's KV in the store, written for opted-in requests.
        on_miss (`str`): `"prefill"` (the worker's source model prefills what the store lacks) or `"target"`.
        mappers (`dict`, *optional*): `{LoRA adapter name: cache-salt prefix}` of the adapters with a mapper of their
            own (`lora_bridges`): a request with one of them is bridged with it (the worker maps with that mapper;
            its status names it, `"mapper"`); one with another adapter is `"unsupported"`.
    """

    def __init__(
        self,
        config,
        *,
        hold_back: int,
        requests_mode: str,
        salt_tag: str,
        count: Callable[..., None],
        imports: bool = True,
        store=None,
        exports=None,
        on_miss: str = "prefill",
        mappers: dict[str, str] | None = None,
    ):
        self.config, self.hold_back, self.requests_mode, self.salt_tag = config, hold_back, requests_mode, salt_tag
        self.count, self.imports, self.store, self.exports, self.on_miss = count, imports, store, exports, on_miss
        self.mappers = dict(mappers or {})
        self._mapper: dict[str, str] = {}  # req_id → the LoRA adapter whose mapper maps it (none: the base bridge's)
        self._salts: dict[str, str | None] = {}  # req_id → the tenant's own cache salt (the store's keys use it)
        # req_id → why nothing was mapped (status "target"; `None`: the default reason) and where vLLM's prefix cache
        # ended then (its blocks, of the bridged salt, are what earlier bridged requests computed); the last offer's
        # answer only, so beside a sent load it means a resume after a preemption that loaded nothing
        self._reasons: dict[str, tuple[str | None, int | None]] = {}
        self._exporting: dict[str, _Export] = {}  # req_id → what of it is in the store (an exporting engine)
        self._bridged: dict[str, bool] = {}  # req_id → opted in (decided once, on arrival)
        self._claims: dict[str, _Claim] = {}  # req_id → what get_num_new_matched_tokens offered
        self._pending: dict[str, tuple[Request, int, int]] = {}  # allocated, to be sent to the worker
        self._outcomes: dict[str, dict[str, Any]] = {}  # req_id → what the worker did
        self._sent: dict[str, dict[str, Any]] = {}  # req_id → the load sent to the worker (its outcome until known)
        self._earlier: dict[str, list[str]] = {}  # req_id → the statuses of its loads before a preemption
        self._refused: dict[str, str] = {}  # req_id → why its flag was refused (served unbridged)
        self._unsupported: dict[str, str] = {}  # req_id → why it cannot be bridged nor exported (LoRA, embeds)
        self._lookups: dict[str, Any] = {}  # req_id → what the store holds of its prompt (one lookup per request)
        self._routed: dict[str, dict[str, str]] = {}  # req_id → the router's headers (kvbridge serve records them)
        self._final_exports: list[ExportTask] = []  # ended requests' last partial chunks, for the next step

    # -- positions: the transfer plan's ------------------------------------------------------------------------------
    def plan(self, num_prompt_tokens: int) -> TransferPlan:
        """The positions of a prompt, as `bridge.prefill` plans them (`hf_kvbridge.transfer.plan.plan_prompt`), with
        this connector's hold-back (vLLM computes at least the last prompt token)."""
        return plan_prompt(num_prompt_tokens, self.config, hold_back=self.hold_back)

    def map_end(self, num_prompt_tokens: int) -> int:
        """The end of the tokens mapped and written (`0`: nothing to map). vLLM loads only a prefix, so the plan's
        recomputed tokens (the `"tail"` policy: the last mapped ones) are left to the target after it, with the
        probe: a longer hold-back."""
        plan = self.plan(num_prompt_tokens)
        return plan.recompute_start if plan.mapped_tokens else 0

    # -- the requests --------------------------------------------------------------------------------------------
    def wants_bridge(self, request: Request) -> bool:
        """Whether `request` opted in (`requests_mode`); a flag that is not a boolean is refused
        (`parse_request_flag`): the request is served unbridged, with a WARNING and status `"refused"`."""
        flag, refused = parse_request_flag(request.kv_transfer_params)
        if refused is not None:
            self._refused[request.request_id] = refused
            self.count(requests_refused=1)
            logger.warning("KVBridgeConnector: request %s is served unbridged: %s", request.request_id, refused)
            return False
        if self.requests_mode == "all":
            return flag is not False
        return flag is True

    def on_new_request(self, request: Request) -> None:
        """Decides whether `request` is bridged and, if so, salts its block hashes so that its (mapped) blocks are
        never a prefix-cache hit for a request that is not bridged by this mapper."""
        routed = router_info(request.kv_transfer_params)
        if routed:
            self._routed[request.request_id] = routed
        wanted = self.wants_bridge(request)
        self._salts[request.request_id] = request.cache_salt
        mappers = self.mappers if self.imports else ()  # an exporting engine exports no LoRA request
        unsupported = None
        if wanted and (self.imports or self.exports is not None):
            unsupported = request_refusal(request, mappers)
        if unsupported is not None:  # served unbridged and not exported, never mapped with the base model's map
            self._unsupported[request.request_id] = unsupported
            self._bridged[request.request_id] = False
            self.count(requests_unsupported=1)
            logger.warning(
                "KVBridgeConnector: request %s is served unbridged and not exported: %s",
                request.request_id,
                unsupported,
            )
            return
        if wanted and self.exports is not None and not self._maps_from_store(request):
            # Exported, not bridged: its blocks are its own model's K/V (a request whose cache is mapped, or that
            # could hit mapped blocks in the prefix cache, never exports: approximations must not compound).
            self._exporting[request.request_id] = _Export(request, request.cache_salt)
            self._bridged[request.request_id] = False
            return
        self._bridged[request.request_id] = wanted and self.imports
        if self._bridged[request.request_id]:
            mapper = request_mapper(request, mappers)
            salt_tag = self.salt_tag
            if mapper is not None:  # its mapper's blocks: never a prefix-cache hit for another mapper's request
                self._mapper[request.request_id], salt_tag = mapper, self.mappers[mapper]
                self.count(requests_adapter_mapper=1)
            request.cache_salt = f"{salt_tag}|{request.cache_salt or ''}"
            request.block_hashes = []
            request.update_block_hashes()

    def _maps_from_store(self, request: Request) -> bool:
        """On an engine that both exports and maps (role "both"): whether the store holds any of the other model's
        chunks of this prompt. Such a request is bridged (mapped, salted, not exported); any other is served by this
        engine's model alone and exported."""
        if self.store is None or not self.imports:
            return False
        return self._stored_tokens(request) > 0

    def _stored_tokens(self, request: Request) -> int:
        """Tokens of `request`'s prompt that the store's longest stored prefix of the other model's KV covers."""
        return self._lookup(request).tokens

    def _lookup(self, request: Request):
        """What the store holds of `request`'s prompt (a `StoredPrefix`), asked once per request (a request waiting
        for blocks is offered again each step); an empty one when the store cannot answer within its deadline (a
        miss, with a WARNING)."""
        from ..kv_store import StoredPrefix

        found = self._lookups.get(request.request_id)
        if found is not None:
            return found
        started = time.perf_counter()
        try:
            found = self.store.lookup(list(request.prompt_token_ids), salt=self._salts.get(request.request_id))
            self.count(lookup_seconds=time.perf_counter() - started, store_round_trips=found.round_trips)
        except Exception as error:
            self.count(store_lookup_errors=1, lookup_seconds=time.perf_counter() - started)
            logger.warning(
                "KVBridgeConnector: KV store lookup failed for request %s: %s: %s; treated as a miss",
                request.request_id,
                type(error).__name__,
                error,
            )
            found = StoredPrefix()
        self._lookups[request.request_id] = found
        return found

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._bridged.get(request.request_id, False):
            return 0, False
        self._reasons.pop(request.request_id, None)  # asked again each step it waits: the last answer holds
        end = self.map_end(request.num_prompt_tokens)  # the target computes the recomputed tail and the probe
        if end <= num_computed_tokens:  # nothing to map (short prompt, or all of it is in the prefix cache)
            reason = "nothing to map beyond the prefix cache" if end > 0 else "nothing to map"  # a short prompt
            self._reasons[request.request_id] = (reason, num_computed_tokens)
            return 0, False
        claim = self.claim(request, num_computed_tokens, end)
        if claim is None:  # the target computes from where the prefix cache ends: status "target" with that `start`
            self._reasons.setdefault(request.request_id, (None, num_computed_tokens))  # kept: `claim`'s own reason
            return 0, False
        self._claims[request.request_id] = claim
        return claim.end - num_computed_tokens, False

    def claim(self, request: Request, start: int, end: int) -> _Claim | None:
        """What the connector maps of `request`'s tokens `[start, end)` (after the prefix cache's `start` tokens):

        - no store: all of it, from the worker's source prefill (the cold path, source `"prefill"`);
        - a full hit (the stored source prefix, whole chunks and a partial one, covers all but less than one chunk of
          `[0, end)`; all of it when the source engine served this prompt): up to the stored end, from the store
          alone (source `"store"`); the target computes the rest;
        - a partial hit: the stored prefix, and the rest from the worker's source model run over the fetched cache
          (source `"partial"`); with no source model (or `on_miss="target"`), only the stored prefix;
        - a miss: the cold path (`on_miss="prefill"`) or nothing (the target computes the prompt).
        """
        if self.store is None:
            return _Claim(start, end, 0, "prefill")
        found = self._lookup(request)
        stored = found.tokens  # the stored prefix of the prompt (whole chunks and a partial one), at most its length
        covered = min(stored, end)
        self.count(store_lookups=1, store_hit_tokens=stored)
        if 0 < covered <= start and end - start < self.store.chunk_size:
            # this engine's prefix cache already holds all the store has (an earlier request of the same prompt,
            # mapped from it): the target computes the few tokens left, as it did for that request
            self._reasons[request.request_id] = ("nothing to map beyond the prefix cache", start)
            return None
        full_hit = end - covered < self.store.chunk_size
        if covered > start and (full_hit or self.on_miss == "target"):
            return _Claim(start, covered, stored, "store", found)
        if stored > 0 and self.on_miss == "prefill":
            return _Claim(start, end, stored, "partial", found)
        if self.on_miss == "prefill":
            return _Claim(start, end, 0, "prefill")
        return None  # the target computes it: status "target" when the request finishes

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        claim = self._claims.pop(request.request_id, None)
        if claim is None:
            claim = _Claim(0, self.map_end(request.num_prompt_tokens), 0, "prefill")
        self._lookups.pop(request.request_id, None)  # allocated: a later offer (after a preemption) asks again
        self._pending[request.request_id] = (request, claim.end - num_external_tokens, claim)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVBridgeConnectorMetadata:
        meta = KVBridgeConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.req_id in self._pending:
                request, start, claim = self._pending.pop(new_req.req_id)
                meta.loads.append(self.load(request, start, claim, new_req.block_ids[0], scheduled))
            if new_req.req_id in self._exporting:
                self._exporting[new_req.req_id].block_ids = list(new_req.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._pending and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                request, start, claim = self._pending.pop(req_id)
                meta.loads.append(self.load(request, start, claim, cached.new_block_ids[i][0], scheduled))
            export = self._exporting.get(req_id)
            if export is not None and cached.new_block_ids[i] is not None:
                if req_id in cached.resumed_req_ids:  # preempted and resumed: a new block table
                    export.block_ids = list(cached.new_block_ids[i][0])
                else:
                    export.block_ids.extend(cached.new_block_ids[i][0])
        self._pending.clear()
        for load in meta.loads:
            self.count(requests_claimed=1, tokens_claimed=load.end - load.start)
            if load.req_id in self._sent:  # preempted after a load and loaded again: its first tokens came from that
                earlier = self._outcomes.pop(load.req_id, None) or self._sent[load.req_id]
                self._earlier.setdefault(load.req_id, []).append(earlier["status"])
            # A request can finish in the step of its load, before the worker's outcome reaches
            # update_connector_output; a failed load never finishes in that step (vLLM reschedules it), so until told
            # otherwise it was mapped.
            self._sent[load.req_id] = {
                "status": "mapped",
                "mapped_tokens": load.end - load.start,
                "start": load.start,
                **load.origin(),
            }
        meta.exports = self.export_tasks(scheduled) + self._final_exports
        self._final_exports = []
        return meta

    def export_tasks(self, scheduled: dict[str, int]) -> list[ExportTask]:
        """What this step exports, per exported request: its K/V exist for tokens `[0, num_computed_tokens +
        scheduled)` after the step (prompt and the replies fed back in decode steps); every whole chunk from the first
        one not yet in the store up to there is exported, and in the step that completes the prompt's prefill, the
        prompt's trailing partial chunk too (so a prompt of any length is found whole). On arrival the store is asked
        what it already holds (a prompt another request exported, or this engine's own prefix-cache hit exported
        before), and those chunks are skipped."""
        if self.exports is None:
            return []
        tasks = []
        for req_id, export in self._exporting.items():
            n = scheduled.get(req_id, 0)
            if n <= 0 or not export.block_ids:
                continue
            self._first_export_lookup(req_id, export)
            request = export.request
            computed = request.num_computed_tokens + n  # tokens whose K/V exist after this step
            prefill_ends = request.num_computed_tokens < request.num_prompt_tokens <= computed
            # the step that samples the last token max_tokens allows: the conversation's partial chunk now (a request
            # that ends otherwise, e.g. at EOS, exports it in the step after its end, see request_finished)
            last = computed >= request.num_prompt_tokens and request.num_output_tokens + 1 >= request.max_tokens
            task = self._export_task(req_id, export, computed, prefill_ends or last)
            if task is not None:
                tasks.append(task)
        return tasks

    def _first_export_lookup(self, req_id: str, export: _Export) -> None:
        if export.next_token is not None:
            return
        try:  # first step: skip what the store already holds
            found = self.exports.lookup(list(export.request.prompt_token_ids), salt=export.salt)
            export.next_token, export.tail_end = found.chunks * self.exports.chunk_size, found.tokens
        except Exception as error:
            self.count(store_lookup_errors=1)
            logger.warning("KVBridgeConnector: KV store lookup failed for request %s: %s", req_id, error)
            export.next_token = 0

    def _export_task(self, req_id: str, export: _Export, computed: int, tail: bool) -> ExportTask | None:
        """The export of `export`'s tokens `[next_token, computed)`: its whole chunks, and with `tail` its trailing
        partial chunk (unless the store holds it already); `None` when there is nothing new."""
        size = self.exports.chunk_size
        done = computed // size * size
        tail = tail and computed % size > 0 and computed > export.tail_end
        if done <= export.next_token and not tail:
            return None
        end = computed if tail else done
        tokens = list(export.request.all_token_ids[:end])
        task = ExportTask(req_id, tokens, export.next_token, end, list(export.block_ids), export.salt, tail)
        export.next_token = done
        if tail:
            export.tail_end = computed
        return task

    def load(self, request: Request, start: int, claim: _Claim, block_ids, scheduled: dict[str, int]) -> BridgeLoad:
        """The worker's load of `request`'s claimed tokens `[start, claim.end)`.

        The probe is what the target computes of it in this step: all of it, unless chunked prefill split the step
        (the target then computes at least one token, and the gate checks the probe tokens it computed). The
        recomputed tail `[end, probe_start)` comes before it."""
        end = claim.end
        plan = self.plan(request.num_prompt_tokens)
        gated = plan.gate == "checked" and claim.kind != "store"  # a store-only load has no source K/V of the probe
        probe_start = max(end, plan.map_end) if gated else end
        probe_end = min(plan.length, end + scheduled.get(request.request_id, 0)) if gated else end
        if probe_end <= probe_start:  # chunked prefill stopped before the probe: nothing for the gate to check
            if gated:
                logger.warning(
                    "KVBridgeConnector: request %s computes no probe token in its load step (chunked prefill); the "
                    "quality gate is not applied to it",
                    request.request_id,
                )
            probe_start = probe_end = end
        token_ids = list(request.prompt_token_ids[: max(probe_end, claim.store_end)])
        return BridgeLoad(
            request.request_id,
            token_ids,
            start,
            end,
            list(block_ids),
            probe_end,
            probe_start,
            store_end=claim.store_end,
            store_salt=self._salts.get(request.request_id),
            store_prefix=claim.stored,
            mapper=self._mapper.get(request.request_id),
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        for req_id, outcome in getattr(meta, "outcomes", {}).items():
            if req_id in self._bridged:  # not finished yet (one that finished in its load step has reported already)
                self._outcomes[req_id] = outcome

    def request_finished(self, request: Request, block_ids=None) -> tuple[bool, dict[str, Any] | None]:
        """The request's status (its output's `kv_transfer_params["kvbridge"]`), and whether vLLM must keep its blocks
        one more step: an exported request whose K/V end inside a chunk exports that partial chunk in the next step
        (the worker reads it from these blocks, then reports the request in `finished_sending`). A request that vLLM
        preempted after a load and loaded again on resuming has the status of its last load, and `earlier_loads`, the
        statuses of the loads before (its tokens until the preemption came from those caches: a `fallback`, the
        target's own). One that resumed with nothing loaded again (the prefix cache held its prompt) has status
        `target` with that `start` and its load in `earlier_loads`: the target computed its tokens from there, over
        blocks that may be its own map or what other requests of its cache salt left."""
        req_id = request.request_id
        self._claims.pop(req_id, None)
        self._salts.pop(req_id, None)
        self._lookups.pop(req_id, None)
        routed = self._routed.pop(req_id, None)
        reason, prefix = self._reasons.pop(req_id, (None, None))
        export = self._exporting.pop(req_id, None)
        wanted = self._bridged.pop(req_id, False)
        sent = self._sent.pop(req_id, None)
        outcome = self._outcomes.pop(req_id, None) or sent
        refused = self._refused.pop(req_id, None)
        unsupported = self._unsupported.pop(req_id, None)
        mapper = self._mapper.pop(req_id, None)
        earlier = self._earlier.pop(req_id, None)
        delay = False
        if refused is not None:
            status = {"status": "refused", "mapped_tokens": 0, "reason": refused}
        elif unsupported is not None:
            status = {"status": "unsupported", "mapped_tokens": 0, "reason": unsupported}
        elif export is not None:
            delay = self._final_export(request, export, block_ids)
            status = {"status": "exported", "exported_tokens": max(export.next_token or 0, export.tail_end)}
        elif not wanted:
            status = None
        else:
            if sent is not None and prefix is not None:
                # a load was sent, and the last offer (a resume after a preemption) loaded nothing: the target
                # computed its tokens from `prefix` over the prefix cache's blocks (its own, or what other requests
                # of its cache salt left there), so its status cannot stay that load's
                earlier = [*(earlier or []), outcome["status"]]
                outcome = None
            if outcome is None:
                reason = reason or (
                    "nothing to map" if self.store is None else "the KV store holds too little of the prompt"
                )
                outcome = {"status": "target", "mapped_tokens": 0, "reason": reason}
                if prefix is not None:  # `start` > 0: computed over bridged blocks [0, start), not the target's alone
                    outcome["start"] = prefix
            status = dict(outcome)
            if mapper is not None and status["status"] != "target":  # never passed off as the base bridge's map
                status["mapper"] = mapper
            if earlier:  # the status is its last load's; the tokens before its preemption came from these
                status["earlier_loads"] = earlier
        if routed and status is not None:
            status["router"] = routed
            logger.info(
                "KVBridgeConnector: request %s (router cache id %s, source pod %s): %s",
                req_id,
                routed.get("cache_id", "-"),
                routed.get("source_pod", "-"),
                {k: v for k, v in status.items() if k != "router"},
            )
        return delay, (None if status is None else {PARAM_KEY: status})

    def _final_export(self, request: Request, export: _Export, block_ids) -> bool:
        """Queues the export of the ended request's trailing partial chunk (its K/V of tokens up to
        `num_computed_tokens`, decode steps included) for the next step; `True` when there is one (its blocks must
        then outlive this step)."""
        if self.exports is None or export.next_token is None or not block_ids:
            return False
        computed = max(0, request.num_computed_tokens - getattr(request, "num_in_flight_tokens", 0))
        computed = min(computed, len(request.all_token_ids))
        blocks = block_ids[0] if block_ids and isinstance(block_ids[0], list | tuple) else block_ids
        export.block_ids = list(blocks)
        task = self._export_task(request.request_id, export, computed, tail=True)
        if task is None:
            return False
        task.finished = True
        self._final_exports.append(task)
        return True


def router_info(params: Any) -> dict[str, str]:
    """The semantic router's request headers that `kvbridge serve` put into `kv_transfer_params`
    (`ROUTER_PARAM_KEY`: `cache_id`, `source_pod`, `mapper_id`), as strings; `{}` without them."""
    info = params.get(ROUTER_PARAM_KEY) if isinstance(params, dict) else None
    if not isinstance(info, dict):
        return {}
    return {key: str(info[key])[:256] for key in ("cache_id", "source_pod", "mapper_id") if info.get(key) is not None}


@dataclass
class _Claim:
    """What the connector offers to load of a request: tokens `[start, end)` mapped, of which the source K/V of
    `[0, store_end)` come from the store (`stored`: the lookup, where its chunks are); `kind` is the status's `source`
    (`"store"`, `"partial"`, `"prefill"`)."""

    start: int
    end: int
    store_end: int
    kind: str
    stored: Any = None


@dataclass
class _Export:
    """An exported request: the request, its tenant salt, its block table (kept up to date from the scheduler's
    output), the first token not yet in the store in whole chunks (`None` until its first step asks the store), and
    the end of the stored prefix with its partial chunk (`tail_end`)."""

    request: Any
    salt: str | None
    block_ids: list[int] = field(default_factory=list)
    next_token: int | None = None
    tail_end: int = 0
