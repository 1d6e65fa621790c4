"""`KVBridgeConnector`, the class vLLM loads (`kv_connector_module_path="hf_kvbridge.integrations.vllm"`): a thin
`KVConnectorBase_V1` that checks the bridge's config at start-up and forwards every scheduler-side call to a
[`BridgeScheduler`] and every worker-side call to a [`BridgeWorker`]."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from ...constants import REVERSE_FOLDER
from ...errors import ServingConfigError
from ...utils.layout import KVLayout, check_fingerprint
from ...utils.source_features import check_servable
from .adapters import AdapterMapping, adapter_refusal, local_revision_refusal, lora_bridges_refusal
from .configuration import check_recompute, connector_settings, read_bridge_config
from .identity import check_identity, file_digests, model_files
from .scheduler import BridgeScheduler
from .store import open_prefix_store, redact, store_identity
from .support import EngineShape, check_engine, source_memory_note
from .tensor_parallel import HeadShard
from .worker import BridgeWorker, load_adapter_bridges, load_bridge

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
    default, or `"all"`), `role` (`"target"`, `"source"`, `"both"`), `store` (a KV store URL) and the store's
    options (`ConnectorSettings`), `lora_bridges` (`{LoRA adapter name: bridge}`, a bridge being a folder or Hub id
    or `{"bridge": ID, "revision": REV}`: a request with that adapter is mapped with its own bridge). See
    `hf_kvbridge.integrations.vllm`.
    """

    counters: Counter = Counter()  # per process: requests/tokens claimed, mapped, fallen back (both roles add here)
    _counter_lock = threading.Lock()

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = connector_settings(self._kv_transfer_config.kv_connector_extra_config or {})
        settings = self.settings
        self.bridge_ref, self.revision, self.requests_mode = settings.bridge, settings.revision, settings.requests
        # before anything is loaded: an engine option the connector cannot serve right stops the engine, one line
        shape = EngineShape.from_vllm_config(vllm_config, kv_cache_config)
        check_engine(shape, self.bridge_ref, exports=settings.exports)
        self.folder, self.config, checksums = read_bridge_config(self.bridge_ref, self.revision)
        layout = KVLayout.from_config(vllm_config.model_config.hf_config)
        # the mapping into the served model: the bridge's (served model = its target) or its reverse (role "both"
        # on the source's engine)
        self.import_folder, self.import_config = self.folder, self.config
        if settings.role == "both" and settings.serves == "source":
            self.import_folder = Path(self.folder) / REVERSE_FOLDER
            if not (self.import_folder / "config.json").is_file():
                raise ServingConfigError(
                    f"bridge {self.bridge_ref} has no reverse mapper ({REVERSE_FOLDER}/): role 'both' on the source's "
                    "engine maps the target's KV into the source; calibrate it with bidirectional=True"
                )
            _, self.import_config, checksums = read_bridge_config(str(self.import_folder))
        served = "source" if settings.serves == "source" else "target"
        fingerprint = getattr(self.config, f"{served}_fingerprint", None)
        if fingerprint is not None:
            check_fingerprint(fingerprint, layout, served, vllm_config.model_config.model)
        check_identity(vllm_config.model_config, self.config, served, self.bridge_ref)  # config and tokenizer files
        if settings.imports:
            self._check_mapping_config(vllm_config, self.import_config, self.bridge_ref)
        digest = hashlib.sha256(json.dumps(checksums, sort_keys=True).encode() + self.bridge_ref.encode())
        # LoRA adapters with a mapper of their own: {name: AdapterMapping}, and their cache-salt prefixes
        self.adapters, salt_tags = self._adapter_bridges(vllm_config, layout)
        import_store = export_store = None
        if settings.store and settings.imports:
            import_store = open_prefix_store(settings, store_identity(self.import_config, "source"))
        if settings.store and settings.exports:
            export_store = open_prefix_store(
                settings, store_identity(self.config, served), writer=role == KVConnectorRole.WORKER
            )
        self.scheduler = BridgeScheduler(
            self.import_config,
            hold_back=max(1, int(self.import_config.hold_back)),  # vLLM must compute at least the last prompt token
            requests_mode=self.requests_mode,
            salt_tag=f"kvbridge:{digest.hexdigest()[:16]}",
            count=self._count,
            imports=settings.imports,
            store=import_store,
            exports=export_store,
            on_miss=settings.on_miss,
            mappers=salt_tags,
        )
        self.worker: BridgeWorker | None = None
        self._step_tokens = vllm_config.scheduler_config.max_num_batched_tokens  # the most a step computes (exports)
        if role == KVConnectorRole.WORKER:
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning(
                    "KVBridgeConnector: kv_load_failure_policy is %r; a failed mapping then fails the request instead "
                    "of falling back to the target's own prefill (set it to 'recompute')",
                    self._kv_transfer_config.kv_load_failure_policy,
                )
            shard = None
            if shape.tensor_parallel_size > 1:  # this rank's share of the served model's KV heads
                from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

                rank, size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
                shard = HeadShard.of(layout.num_kv_heads, rank, size)
                heads = shard.heads
                logger.info(
                    "KVBridgeConnector: tensor-parallel rank %d of %d writes KV heads %d..%d of %d",
                    rank, size, heads.start, heads.stop - 1, shard.total,
                )  # fmt: skip
            bridge, dtype, mappers = None, vllm_config.model_config.dtype, {}
            if settings.imports and shard is not None and shard.rank != 0:  # rank 0 maps and scatters (scatter.py)
                logger.info(
                    "KVBridgeConnector: tensor-parallel rank %d holds no source model and no mapper: rank 0 maps "
                    "every load and sends this rank its KV heads",
                    shard.rank,
                )
            elif settings.imports:
                device = torch.device(vllm_config.device_config.device)
                bridge = load_bridge(
                    self.import_config, self.import_folder, self.revision, dtype, device, self.bridge_ref,
                    source_weights=settings.source_weights,
                )  # fmt: skip
                mappers = load_adapter_bridges(bridge, self.adapters) if self.adapters else {}
                if settings.source_weights:  # outside vLLM's KV sizing, which ran before this connector was built
                    source_bytes = sum(p.numel() * p.element_size() for p in bridge.source.parameters())
                    logger.warning("KVBridgeConnector: %s", source_memory_note(source_bytes, vllm_config.cache_config,
                                                                                shape.device_type))  # fmt: skip
            self.worker = BridgeWorker(
                bridge,
                block_size=vllm_config.cache_config.block_size,
                gate_threshold=self.import_config.gate_threshold,
                count=self._count,
                store=import_store,
                exports=export_store,
                source_weights=settings.source_weights,
                fetch_parts=settings.store_fetch_parts,
                shard=shard,
                kv_dtype=dtype,
                mappers=mappers,
            )
        logger.info(
            "KVBridgeConnector: role %s (serves the bridge's %s), store %s, requests %s",
            settings.role,
            served,
            redact(settings.store) if settings.store else "none",
            settings.requests,
        )

    def _adapter_bridges(self, vllm_config, layout: KVLayout) -> tuple[dict[str, AdapterMapping], dict[str, str]]:
        """The LoRA adapters' bridges (`lora_bridges`), each read at its revision and checked at start-up with one
        line (`adapters.py`): LoRA on, a target engine, no revision on a local folder, the base bridge's source
        (fingerprint, config and tokenizer digests), the served model's KV layout, the base bridge's transfer knobs,
        and what vLLM can serve of its mapping. Returns `{name: AdapterMapping}` (the config and the folder read, for
        the worker to load) and `{name: cache-salt prefix}` (each mapper's blocks are its own in the prefix cache)."""
        lora_bridges = self.settings.lora_bridges
        refused = lora_bridges_refusal(
            lora_bridges, role=self.settings.role, enable_lora=getattr(vllm_config, "lora_config", None) is not None
        )
        if refused is not None:
            raise ServingConfigError(f"KVBridgeConnector (bridge {self.bridge_ref}) does not serve {refused}")
        if not lora_bridges:
            return {}, {}
        from ...loading import resolve_model_reference

        def source_files(config) -> dict[str, str]:
            reference = resolve_model_reference(config.source_name_or_path)
            return file_digests(model_files(reference, config.source_revision))

        base_files = source_files(self.import_config)
        adapters, salt_tags = {}, {}
        for name, spec in lora_bridges.items():
            refused = local_revision_refusal(name, spec)
            if refused is not None:
                raise ServingConfigError(f"KVBridgeConnector (bridge {self.bridge_ref}, lora_bridges): {refused}")
            folder, config, checksums = read_bridge_config(spec.bridge, spec.revision)
            refused = adapter_refusal(
                name, config, self.import_config, served_fingerprint=layout.fingerprint(),
                source_files=source_files(config), base_source_files=base_files,
            )  # fmt: skip
            if refused is not None:
                raise ServingConfigError(f"KVBridgeConnector (bridge {self.bridge_ref}, lora_bridges): {refused}")
            self._check_mapping_config(vllm_config, config, str(spec))
            # the mapper's files (checksums) and where they were read: one revision's blocks never serve another's
            reference = json.dumps([spec.bridge, spec.revision]).encode()
            digest = hashlib.sha256(json.dumps(checksums, sort_keys=True).encode() + reference)
            adapters[name] = AdapterMapping(config, folder, spec)
            salt_tags[name] = f"kvbridge:{digest.hexdigest()[:16]}"
        logger.info(
            "KVBridgeConnector: LoRA adapters with a mapper of their own: %s",
            ", ".join(f"{name} (bridge {adapters[name].spec})" for name in sorted(adapters)),
        )
        return adapters, salt_tags

    def _check_mapping_config(self, vllm_config, config, bridge_ref: str) -> None:
        """What vLLM cannot do with the mapping `config` (of bridge `bridge_ref`) into the served model, refused at
        start-up with the reason."""
        if config.sink_tokens:
            raise ServingConfigError(
                f"bridge {bridge_ref} has sink_tokens={config.sink_tokens}: vLLM loads only a prefix of the "
                "prompt, so the target cannot compute the first tokens itself; save the bridge with sink_tokens=0"
            )
        check_recompute(config, bridge_ref)
        # hidden-state features: the store and the source engine give K/V only (a store-only target, or not)
        check_servable(
            config,
            bridge_ref,
            "the vLLM connector" + ("" if self.settings.source_weights else " of a store-only target"),
        )
        if config.gate_threshold is not None and not self.settings.source_weights:
            logger.warning(
                "KVBridgeConnector: bridge %s has a quality gate, and this store-only target has no source model to "
                "map the probe tokens: loads from the store are not gated",
                bridge_ref,
            )
        if self._role == KVConnectorRole.SCHEDULER and vllm_config.scheduler_config.async_scheduling:
            logger.warning(
                "KVBridgeConnector: async scheduling is on. A failed or gated mapping is rolled back by reporting its "
                "blocks as failed loads after the step ran; vLLM discards that step's sampled token, but with async "
                "scheduling it may already have scheduled the request's next step on it (not verified here): "
                "set async_scheduling=False (--no-async-scheduling) for exact fallbacks"
            )

    @property
    def bridge(self):
        """The worker's `KVBridgeForCausalLM` (source, mapper, the target's rotary embedding); `None` elsewhere,
        and on tensor-parallel ranks other than 0 (rank 0 maps for them: `scatter`)."""
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
        return self.scheduler.request_finished(request, block_ids)

    # ==============================
    # Worker-side methods
    # ==============================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker is not None:
            self.worker.register_kv_caches(kv_caches, self._step_tokens)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._get_connector_metadata(), forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every layer is written in start_load_kv, before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # exports are read after the forward pass, all layers at once (wait_for_save)

    def wait_for_save(self):
        self.worker.export_steps(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker.build_connector_worker_meta()
