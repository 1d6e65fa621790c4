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
`"requests": "all"` bridges every request that does not say `{"kvbridge": false}`. Only a boolean counts
(`parse_request_flag`): `"yes"`, `"false"`, `1` are refused, never bridged. `kvbridge serve` answers such a request
with HTTP 400 naming `kv_transfer_params.kvbridge` (`middleware.KVBridgeParamsMiddleware`, after the server's own
`--api-key` authentication; it also takes the semantic router's `x-vsr-kv-*` headers as an opt-in and answers
`x-vsr-kv-transfer-status`); where nothing can refuse it
(plain `vllm serve`, offline `LLM`) it is served unbridged, with a WARNING naming the request and the reason, and its
output's `kv_transfer_params["kvbridge"]` is `{"status": "refused", "reason": ...}` (`requests_refused` counted).

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
(`read_slots`) and scores them with `transfer.steps.probe_agreement`. Below the threshold the load's blocks are
reported as failed in that same step: vLLM's scheduler (`Scheduler.update_from_output` → `_handle_invalid_blocks` →
`_update_requests_with_invalid_blocks`) sets the request's computed tokens back to the first failed block and skips
the request's output of that step (its sampled token is dropped), so the target recomputes the prompt and samples
its own first token (status "gated" with `score`, `threshold` and `probe_tokens`; WARNING with the request id and
score; `requests_gated` counted). That is exact when a step's output is processed before the next step is scheduled
(no async scheduling: vLLM's CPU platform turns it off); with async scheduling it is not verified, and a start-up
warning says so. `read_slots` probes the CPU backend's block layout through its own write op (any kernel it picks)
and reads FlashAttention's; the worker checks it reads back what it just wrote, and where it cannot the gate rejects
(fails safe, with the reason). If chunked prefill gives the request fewer tokens than the probe in the load step, the
gate scores the probe tokens computed.

**Selective recompute** (`config.recompute_fraction`) with the `"tail"` policy (the default): the scheduler side
claims `ceil(fraction · n)` fewer of the `n` tokens `bridge.generate` maps, so vLLM's target computes that tail
itself in the load step, before the probe, as `bridge.generate` recomputes it. The other policies pick tokens
inside the prompt and are refused at start-up (`check_recompute`).

Not supported here: `config.sink_tokens` (vLLM can only load a prefix; refused at start-up). A tensor-parallel
target engine is served: rank 0 alone holds the source and the mapper, maps every head and scatters each rank its
own KV heads (`scatter`, `tensor_parallel.HeadShard`), and the gate's score is averaged over the ranks. A
tensor-parallel exporting engine is served too: each rank reads its own KV heads and rank 0 writes them all
(`export.export_sharded`). An fp8 KV cache on the CPU backend is read back dequantized with the engine's scales.
Pipeline, context and data parallelism, fp8 KV caches on other devices and other quantized caches, speculative
decoding, multi-modal, MLA, hybrid and sliding-window models are refused at start-up with one line naming the
option (`support.engine_refusal`); a request with prompt embeddings or multi-modal inputs, or with a LoRA adapter
that has no mapper of its own, is served unbridged and not exported, status `"unsupported"` with its reason
(`support.request_refusal`). A target engine with `enable_lora` maps a LoRA request with its adapter's own bridge
(`lora_bridges`: `{adapter name: bridge}`, each calibrated for the target with that adapter merged, from the base
bridge's source, a Hub bridge pinnable to a revision with `{"bridge": ID, "revision": REV}`; checked at start-up,
`adapters.adapter_refusal`), from the same source prefill or store entry; its status names the mapper (`"mapper"`).
A source engine exports no LoRA request. An engine whose model's config or tokenizer files differ from the bridge's
model's is refused at start-up (`identity.check_identity`: digests of those files, not of the weights).

The package:

| module | holds |
|---|---|
| `connector` | `KVBridgeConnector`, the thin `KVConnectorBase_V1` vLLM loads (`# Scheduler-side` / `# Worker-side`) |
| `scheduler` | `BridgeScheduler`: opt-in, cache salt, the claimed positions (`transfer.plan`), the loads sent |
| `worker` | `BridgeWorker`, the bridged-request engine: source prefill, mapping, paged writes, the quality gate |
| `paged_cache` | vLLM's paged KV layout: slots, writes through the backend, reads (layout detected at run time) |
| `metadata` | the per-step dataclasses passed scheduler → worker → scheduler |
| `rotary` | `RotaryOnlyTarget`: the target's rotary embedding without its weights |
| `identity` | `check_identity`: the served model's config and tokenizer files against the bridge's model's |
| `tensor_parallel` | `HeadShard`: a tensor-parallel rank's KV heads; the gate's score averaged over the ranks |
| `scatter` | a tensor-parallel target's loads mapped on rank 0 and scattered, each rank its heads (`rank_buffers`) |
| `export` | `export_sharded`: a tensor-parallel exporting engine's heads gathered to rank 0, which writes them |
| `support` | what is served right: `engine_refusal` (options refused at start-up), `request_refusal` (`unsupported`) |
| `adapters` | LoRA adapters' own bridges (`lora_bridges`): checked at start-up (`adapter_refusal`) |
| `configuration` | `kv_transfer_config`, `bridged`, `parse_request_flag`, `target_model`, `check_recompute` |
| `middleware` | `KVBridgeParamsMiddleware` (`kvbridge serve`): after authentication, bad flags (400), router headers |
| `serve` | `kvbridge serve` (`serve_main`) |
"""

from .adapters import AdapterBridge
from .configuration import (
    CONNECTOR_NAME,
    MODULE_PATH,
    PARAM_KEY,
    ROLES,
    ConnectorSettings,
    bridged,
    check_recompute,
    connector_settings,
    kv_transfer_config,
    parse_request_flag,
    read_bridge_config,
    served_model,
    target_model,
)
from .paged_cache import read_slots, reads_back, slots_of, write_layer
from .rotary import RotaryOnlyTarget, rotary_embedding_class
from .serve import serve_command, serve_main
from .support import EngineShape, check_engine, engine_refusal, request_mapper, request_refusal

# the modules that import vLLM load on first use of one of their names (PEP 562), so that the paged-cache and rotary
# helpers above import without vLLM (the GPU benchmark checks them on a machine that has none)
_LAZY = {
    "KVBridgeConnector": "connector",
    **dict.fromkeys(
        ("FAILED", "BridgeLoad", "ExportTask", "GateCheck", "KVBridgeConnectorMetadata", "KVBridgeWorkerMetadata"),
        "metadata",
    ),
    "BridgeScheduler": "scheduler",
    "open_prefix_store": "store",
    "store_identity": "store",
    "BridgeWorker": "worker",
    "load_bridge": "worker",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CONNECTOR_NAME",
    "FAILED",
    "MODULE_PATH",
    "PARAM_KEY",
    "ROLES",
    "AdapterBridge",
    "BridgeLoad",
    "BridgeScheduler",
    "BridgeWorker",
    "ConnectorSettings",
    "EngineShape",
    "ExportTask",
    "GateCheck",
    "KVBridgeConnector",
    "KVBridgeConnectorMetadata",
    "KVBridgeWorkerMetadata",
    "RotaryOnlyTarget",
    "bridged",
    "check_engine",
    "check_recompute",
    "connector_settings",
    "engine_refusal",
    "kv_transfer_config",
    "load_bridge",
    "open_prefix_store",
    "parse_request_flag",
    "read_bridge_config",
    "read_slots",
    "reads_back",
    "request_mapper",
    "request_refusal",
    "rotary_embedding_class",
    "serve_command",
    "serve_main",
    "served_model",
    "slots_of",
    "store_identity",
    "target_model",
    "write_layer",
]
