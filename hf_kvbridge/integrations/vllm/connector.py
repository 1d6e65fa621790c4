"""`KVBridgeConnector`, the class vLLM loads (`kv_connector_module_path="hf_kvbridge.integrations.vllm"`): a thin
`KVConnectorBase_V1` that checks the bridge's config at start-up and forwards every scheduler-side call to a
[`BridgeScheduler`] and every worker-side call to a [`BridgeWorker`]."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from ...errors import ServingConfigError
from ...layout import KVLayout, check_fingerprint
from .configuration import REQUEST_MODES, check_recompute, read_bridge_config
from .scheduler import BridgeScheduler
from .worker import BridgeWorker, load_bridge

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger("vllm.hf_kvbridge")  # under "vllm", so vLLM's handlers format and show it


class KVBridgeConnector(KVConnectorBase_V1):
    """A vLLM v1 KV connector that fills a bridged request's prompt cache with the bridge's mapped source cache.

    `kv_connector_extra_config`: `bridge` (folder or Hub id, required), `revision`, `requests` (`"opt_in"`, the
    default, or `"all"`). See `hf_kvbridge.integrations.vllm`.
    """

    counters: Counter = Counter()  # per process: requests/tokens claimed, mapped, fallen back (both roles add here)
    _counter_lock = threading.Lock()

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        if "bridge" not in extra:
            raise ServingConfigError('KVBridgeConnector needs kv_connector_extra_config={"bridge": "DIR or Hub id"}')
        self.bridge_ref, self.revision = str(extra["bridge"]), extra.get("revision")
        self.requests_mode = extra.get("requests", "opt_in")
        if self.requests_mode not in REQUEST_MODES:
            raise ServingConfigError(
                f"kv_connector_extra_config['requests'] must be 'opt_in' or 'all', not {self.requests_mode!r}"
            )
        self.folder, self.config, checksums = read_bridge_config(self.bridge_ref, self.revision)
        if self.config.sink_tokens:
            raise ServingConfigError(
                f"bridge {self.bridge_ref} has sink_tokens={self.config.sink_tokens}: vLLM loads only a prefix of the "
                "prompt, so the target cannot compute the first tokens itself; save the bridge with sink_tokens=0"
            )
        check_recompute(self.config, self.bridge_ref)
        if role == KVConnectorRole.SCHEDULER and vllm_config.scheduler_config.async_scheduling:
            logger.warning(
                "KVBridgeConnector: async scheduling is on. A failed or gated mapping is rolled back by reporting its "
                "blocks as failed loads after the step ran; vLLM discards that step's sampled token, but with async "
                "scheduling it may already have scheduled the request's next step on it (not verified here): "
                "set async_scheduling=False (--no-async-scheduling) for exact fallbacks"
            )
        layout = KVLayout.from_config(vllm_config.model_config.hf_config)
        if self.config.target_fingerprint is not None:
            check_fingerprint(self.config.target_fingerprint, layout, "target", vllm_config.model_config.model)
        digest = hashlib.sha256(json.dumps(checksums, sort_keys=True).encode() + self.bridge_ref.encode())
        self.scheduler = BridgeScheduler(
            self.config,
            hold_back=max(1, int(self.config.hold_back)),  # vLLM must compute at least the last prompt token
            requests_mode=self.requests_mode,
            salt_tag=f"kvbridge:{digest.hexdigest()[:16]}",
            count=self._count,
        )
        self.worker: BridgeWorker | None = None
        if role == KVConnectorRole.WORKER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning(
                    "KVBridgeConnector: kv_load_failure_policy is %r; a failed mapping then fails the request instead "
                    "of falling back to the target's own prefill (set it to 'recompute')",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            dtype, device = vllm_config.model_config.dtype, torch.device(vllm_config.device_config.device)
            bridge = load_bridge(self.config, self.folder, self.revision, dtype, device, self.bridge_ref)
            self.worker = BridgeWorker(
                bridge,
                block_size=vllm_config.cache_config.block_size,
                gate_threshold=self.config.gate_threshold,
                count=self._count,
            )

    @property
    def bridge(self):
        """The worker's `KVBridgeForCausalLM` (source, mapper, the target's rotary embedding); `None` elsewhere."""
        return None if self.worker is None else self.worker.bridge

    @classmethod
    def _count(cls, **amounts: int) -> None:
        with cls._counter_lock:
            cls.counters.update(amounts)

    # ==============================
    # Scheduler-side methods
    # ==============================
    def on_new_request(self, request: Request) -> None:
        self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput):
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request)

    # ==============================
    # Worker-side methods
    # ==============================
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer is written in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # nothing is saved: the connector only loads

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()
