"""The connector's scheduler side: which requests are bridged, how many prompt tokens the connector claims (the
transfer plan's, `hf_kvbridge.plan.plan_prompt`, as `bridge.prefill` plans them), and the loads sent to the worker.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from ...plan import TransferPlan, plan_prompt
from .configuration import PARAM_KEY, parse_request_flag
from .metadata import BridgeLoad, KVBridgeConnectorMetadata

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
    """

    def __init__(self, config, *, hold_back: int, requests_mode: str, salt_tag: str, count: Callable[..., None]):
        self.config, self.hold_back, self.requests_mode, self.salt_tag = config, hold_back, requests_mode, salt_tag
        self.count = count
        self._bridged: dict[str, bool] = {}  # req_id → opted in (decided once, on arrival)
        self._claims: dict[str, tuple[int, int]] = {}  # req_id → (start, end) offered by get_num_new_matched_tokens
        self._pending: dict[str, tuple[Request, int, int]] = {}  # allocated, to be sent to the worker
        self._outcomes: dict[str, dict[str, Any]] = {}  # req_id → what the worker did
        self._sent: dict[str, dict[str, Any]] = {}  # req_id → the load sent to the worker (its outcome until known)
        self._refused: dict[str, str] = {}  # req_id → why its flag was refused (served unbridged)

    # -- positions: the transfer plan's ------------------------------------------------------------------------------
    def plan(self, num_prompt_tokens: int) -> TransferPlan:
        """The positions of a prompt, as `bridge.prefill` plans them (`hf_kvbridge.plan.plan_prompt`), with this
        connector's hold-back (vLLM computes at least the last prompt token)."""
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
        wanted = self.wants_bridge(request)
        self._bridged[request.request_id] = wanted
        if wanted:
            request.cache_salt = f"{self.salt_tag}|{request.cache_salt or ''}"
            request.block_hashes = []
            request.update_block_hashes()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._bridged.get(request.request_id, False):
            return 0, False
        end = self.map_end(request.num_prompt_tokens)  # the target computes the recomputed tail and the probe
        if end <= num_computed_tokens:  # nothing to map (short prompt, or all of it is in the prefix cache)
            return 0, False
        self._claims[request.request_id] = (num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        default_end = self.map_end(request.num_prompt_tokens)
        _, end = self._claims.pop(request.request_id, (None, default_end))
        self._pending[request.request_id] = (request, end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVBridgeConnectorMetadata:
        meta = KVBridgeConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.req_id in self._pending:
                request, start, end = self._pending.pop(new_req.req_id)
                meta.loads.append(self.load(request, start, end, new_req.block_ids[0], scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._pending and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                request, start, end = self._pending.pop(req_id)
                meta.loads.append(self.load(request, start, end, cached.new_block_ids[i][0], scheduled))
        self._pending.clear()
        for load in meta.loads:
            self.count(requests_claimed=1, tokens_claimed=load.end - load.start)
            # A request can finish in the step of its load, before the worker's outcome reaches
            # update_connector_output; a failed load never finishes in that step (vLLM reschedules it), so until told
            # otherwise it was mapped.
            self._sent[load.req_id] = {"status": "mapped", "mapped_tokens": load.end - load.start, "start": load.start}
        return meta

    def load(self, request: Request, start: int, end: int, block_ids, scheduled: dict[str, int]) -> BridgeLoad:
        """The worker's load of `request`'s claimed tokens `[start, end)`.

        The probe is what the target computes of it in this step: all of it, unless chunked prefill split the step
        (the target then computes at least one token, and the gate checks the probe tokens it computed). The
        recomputed tail `[end, probe_start)` comes before it."""
        plan = self.plan(request.num_prompt_tokens)
        gated = plan.gate == "checked"
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
        token_ids = list(request.prompt_token_ids[:probe_end])
        return BridgeLoad(request.request_id, token_ids, start, end, list(block_ids), probe_end, probe_start)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        for req_id, outcome in getattr(meta, "outcomes", {}).items():
            if req_id in self._bridged:  # not finished yet (one that finished in its load step has reported already)
                self._outcomes[req_id] = outcome

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        self._claims.pop(request.request_id, None)
        wanted = self._bridged.pop(request.request_id, False)
        sent = self._sent.pop(request.request_id, None)
        outcome = self._outcomes.pop(request.request_id, None) or sent
        refused = self._refused.pop(request.request_id, None)
        if refused is not None:
            return False, {PARAM_KEY: {"status": "refused", "mapped_tokens": 0, "reason": refused}}
        if not wanted:
            return False, None
        if outcome is None:
            outcome = {"status": "target", "mapped_tokens": 0, "reason": "nothing to map"}
        return False, {PARAM_KEY: outcome}
