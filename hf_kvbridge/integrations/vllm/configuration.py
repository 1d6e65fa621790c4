"""The connector's configuration: the `kv_transfer_config` that loads it, a request's opt-in, the checks a bridge's
config must pass before vLLM can serve it, and the target model vLLM should load. Needs no vLLM import of its own."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ...errors import ServingConfigError
from .adapters import AdapterBridge, lora_bridges_refusal, parse_lora_bridges

PARAM_KEY = "kvbridge"  # the key in a request's kv_transfer_params, and in the output's kv_transfer_params
ROUTER_PARAM_KEY = "kvbridge_router"  # what kvbridge serve records of a router's x-vsr-kv-* headers, in the same dict
CONNECTOR_NAME = "KVBridgeConnector"
MODULE_PATH = "hf_kvbridge.integrations.vllm"  # what vLLM imports (not __main__ when run with -m)
REQUEST_MODES = ("opt_in", "all")


ROLES = ("source", "target", "both")
MISS_POLICIES = ("prefill", "target")
SIDES = ("source", "target")


@dataclass(frozen=True)
class ConnectorSettings:
    """What `kv_connector_extra_config` asks of the connector, validated (`connector_settings`).

    Attributes:
        bridge, revision: the bridge checkpoint (folder or Hub id) and its revision.
        requests: `"opt_in"` or `"all"`: which requests are bridged (and, on an exporting engine, exported).
        role: `"target"` (maps into the served model; the default), `"source"` (serves the bridge's source and
            exports its KV to the store) or `"both"` (a bidirectional bridge: exports the served model's KV and maps
            the other model's with the direction into it).
        serves: with `role="both"`, which of the bridge's two models this engine serves (`"target"` or `"source"`).
        store: the KV store's URL (`redis://HOST:PORT/DB`, `rediss://` for TLS, `valkey://`), or `None`.
        chunk_size: tokens per store chunk (the store's unit; independent of vLLM's block size; `None`: the store's
            `DEFAULT_CHUNK_SIZE`).
        store_ttl_s: lifetime of exported chunks in the store (`None`: until the server evicts them).
        store_timeout_ms: the deadline of each store lookup (vLLM's scheduler waits at most this long; a dead or hung
            store is then a miss), and of connecting.
        store_fetch_parts: a load whose mapped tokens all come from the store is fetched in this many runs, each
            mapped and written while the next is fetched (`1`: fetch all, then map).
        on_miss: what a mapping engine does when the store holds too little of a prompt: `"prefill"` (the cold path:
            the worker's source model prefills) or `"target"` (the target computes the prompt itself).
        source_weights: whether a mapping engine's worker loads the source model (`False`: store only, no source
            weights; misses then go to the target).
        lora_bridges: `{LoRA adapter name: AdapterBridge}` (a target engine with `enable_lora`): a request with
            adapter NAME is mapped with that bridge (a folder or Hub id, and its Hub revision; calibrated for the
            target with the adapter merged, from the same source); a request with an adapter not named here is served
            unbridged (status `"unsupported"`).
        export_buffer_mb: on an exporting engine, the MiB of exported K/V held between the engine's steps and the
            store: the writer's queue (an export past it is dropped and counted, never waited for) and the staging
            buffers kept for reuse, of which a step's export is faulted in at start-up (`None`: 256 MiB).
    """

    bridge: str
    revision: str | None = None
    requests: str = "opt_in"
    role: str = "target"
    serves: str = "target"
    store: str | None = None
    chunk_size: int | None = None
    store_ttl_s: float | None = None
    store_timeout_ms: float = 50.0
    store_fetch_parts: int = 4
    on_miss: str = "prefill"
    source_weights: bool = True
    lora_bridges: dict[str, AdapterBridge] = field(default_factory=dict)
    export_buffer_mb: int | None = None

    @property
    def imports(self) -> bool:
        """Whether this engine maps the other model's KV into its own (roles target and both)."""
        return self.role in ("target", "both")

    @property
    def exports(self) -> bool:
        """Whether this engine writes its own KV to the store (roles source and both)."""
        return self.role in ("source", "both")


def connector_settings(extra: dict[str, Any]) -> ConnectorSettings:
    """Validates `kv_connector_extra_config` into `ConnectorSettings`; every mistake is a `ServingConfigError` naming
    the key, before any model is loaded.

    Example:

    ```python
    >>> connector_settings({"bridge": "my-bridge", "role": "source", "store": "redis://127.0.0.1:6379/0"}).exports
    True
    ```
    """
    extra = dict(extra or {})
    if "bridge" not in extra:
        raise ServingConfigError('KVBridgeConnector needs kv_connector_extra_config={"bridge": "DIR or Hub id"}')
    known = {f.name for f in fields(ConnectorSettings)}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ServingConfigError(f"kv_connector_extra_config has unknown keys {unknown}; known: {sorted(known)}")

    def choice(key: str, allowed: tuple[str, ...], default: str) -> str:
        value = extra.get(key, default)
        if value not in allowed:
            raise ServingConfigError(
                f"kv_connector_extra_config[{key!r}] must be one of {', '.join(map(repr, allowed))}, not {value!r}"
            )
        return value

    role = choice("role", ROLES, "target")
    store = extra.get("store")
    if store is not None and not isinstance(store, str):
        raise ServingConfigError(f"kv_connector_extra_config['store'] must be a URL string, not {store!r}")
    if role != "target" and not store:
        raise ServingConfigError(
            f"kv_connector_extra_config['role'] is {role!r}: an exporting engine needs a KV store; set "
            "kv_connector_extra_config['store'] (e.g. 'redis://127.0.0.1:6379/0', or start one with "
            "`kvbridge store serve`)"
        )
    chunk_size = extra.get("chunk_size")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ServingConfigError(f"kv_connector_extra_config['chunk_size'] must be a positive int, not {chunk_size!r}")
    ttl = extra.get("store_ttl_s")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0):
        raise ServingConfigError(f"kv_connector_extra_config['store_ttl_s'] must be a positive number, not {ttl!r}")
    parts = extra.get("store_fetch_parts", 4)
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1:
        raise ServingConfigError(f"kv_connector_extra_config['store_fetch_parts'] must be an int ≥ 1, not {parts!r}")
    timeout = extra.get("store_timeout_ms", 50.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 60_000:
        raise ServingConfigError(
            f"kv_connector_extra_config['store_timeout_ms'] must be a number of milliseconds in (0, 60000], not "
            f"{timeout!r}"
        )
    source_weights = extra.get("source_weights", role == "target")
    if not isinstance(source_weights, bool):
        raise ServingConfigError(
            f"kv_connector_extra_config['source_weights'] must be true or false, not {source_weights!r}"
        )
    if role == "both" and source_weights:
        raise ServingConfigError(
            "kv_connector_extra_config['source_weights'] is true with role 'both': an engine of a bidirectional "
            "cascade holds only its own model and maps the other's KV from the store; drop source_weights"
        )
    if not source_weights and not store:
        raise ServingConfigError(
            "kv_connector_extra_config['source_weights'] is false and there is no 'store': the worker would have "
            "no source K/V at all; set a store URL or load the source weights"
        )
    on_miss = choice("on_miss", MISS_POLICIES, "prefill" if source_weights else "target")
    if on_miss == "prefill" and not source_weights:
        raise ServingConfigError(
            "kv_connector_extra_config['on_miss'] is 'prefill' but source_weights is false: with no source model "
            "a store miss can only go to the target (on_miss='target')"
        )
    buffer_mb = extra.get("export_buffer_mb")
    if buffer_mb is not None:
        if isinstance(buffer_mb, bool) or not isinstance(buffer_mb, int) or buffer_mb < 1:
            raise ServingConfigError(
                f"kv_connector_extra_config['export_buffer_mb'] must be a positive int (MiB), not {buffer_mb!r}"
            )
        if role == "target":
            raise ServingConfigError(
                "kv_connector_extra_config['export_buffer_mb'] sizes an exporting engine's buffers; role 'target' "
                "exports nothing (drop it, or set role 'source' or 'both')"
            )
    lora_bridges = parse_lora_bridges(extra.get("lora_bridges"))
    refused = lora_bridges_refusal(lora_bridges, role=role, enable_lora=True)  # the engine's LoRA: checked at start
    if refused is not None:
        raise ServingConfigError(f"kv_connector_extra_config: {refused}")
    return ConnectorSettings(
        bridge=str(extra["bridge"]),
        revision=extra.get("revision"),
        requests=choice("requests", REQUEST_MODES, "opt_in"),
        role=role,
        serves=choice("serves", SIDES, "source" if role == "source" else "target"),
        store=store,
        chunk_size=chunk_size,
        store_ttl_s=None if ttl is None else float(ttl),
        store_timeout_ms=float(timeout),
        store_fetch_parts=parts,
        on_miss=on_miss,
        source_weights=source_weights,
        lora_bridges=lora_bridges,
        export_buffer_mb=buffer_mb,
    )


def kv_transfer_config(
    bridge: str,
    *,
    role: str = "target",
    store: str | None = None,
    requests: str = "opt_in",
    serves: str | None = None,
    on_miss: str | None = None,
    source_weights: bool | None = None,
    chunk_size: int | None = None,
    store_ttl_s: float | None = None,
    store_timeout_ms: float | None = None,
    store_fetch_parts: int | None = None,
    export_buffer_mb: int | None = None,
    revision: str | None = None,
    lora_bridges: dict[str, str | dict[str, str] | AdapterBridge] | None = None,
) -> dict[str, Any]:
    """The `kv_transfer_config` dict for `vllm.LLM(...)` (or, as JSON, `vllm serve --kv-transfer-config`).

    Args:
        bridge: a bridge checkpoint folder or Hub id (what `KVBridgeForCausalLM.from_pretrained` takes).
        role: `"target"` (the default: this engine serves the bridge's target and maps into it), `"source"` (this
            engine serves the bridge's source and exports the KV of its requests to `store`) or `"both"` (a
            bidirectional bridge: exports its own KV and maps the other's, see `serves`).
        store: the KV store (`"redis://HOST:PORT/DB"`; `rediss://` for TLS; credentials in the URL). A target with a
            store maps from it and falls back to the cold path (or the target) on a miss.
        requests: `"opt_in"` (a request is bridged/exported when its `kv_transfer_params` hold `{"kvbridge": true}`)
            or `"all"` (every request unless it says `{"kvbridge": false}`: a router's "export all").
        serves: with `role="both"`, which of the bridge's models this engine serves (`"target"`, the default, or
            `"source"`); `served_model(bridge, serves)` is the model to load.
        on_miss: `"prefill"` (the cold path, the default with source weights) or `"target"`.
        source_weights: `False` for a store-only target (its worker loads no source weights; the default with
            `role="both"`).
        chunk_size: tokens per store chunk (default: the store's `DEFAULT_CHUNK_SIZE`); both engines must use the
            same.
        store_ttl_s: lifetime of exported chunks (default: until the server evicts them).
        store_timeout_ms: the deadline of each store lookup in vLLM's scheduler (default 50 ms).
        store_fetch_parts: runs a load from the store is fetched in, each mapped while the next arrives (default 4;
            1: fetch, then map).
        export_buffer_mb: on an exporting engine, the MiB its exports may hold between the engine's steps and the
            store (default 256): past it an export is dropped (counted), never waited for. At start-up a step's
            export (the scheduler's tokens a step × the bytes a token's K/V take in every layer) is reserved within
            it, and a WARNING says when a whole step's export does not fit.
        revision: revision of a Hub bridge.
        lora_bridges: `{LoRA adapter name: bridge}` on a target engine with `enable_lora`: a request with that
            adapter (`LoRARequest.lora_name`) is mapped with that bridge (calibrated for the target with the adapter
            merged, from the same source); one with another adapter is served unbridged (`"unsupported"`). A bridge
            is a folder or Hub id, or `{"bridge": ID, "revision": REV}` (or an `AdapterBridge`) to pin a Hub
            bridge's revision.

    Example:

    ```python
    >>> kv_transfer_config("my-bridge", role="source", store="redis://127.0.0.1:6379/0")["kv_connector_extra_config"]
    {'bridge': 'my-bridge', 'requests': 'opt_in', 'role': 'source', 'store': 'redis://127.0.0.1:6379/0'}
    ```
    """
    extra: dict[str, Any] = {"bridge": str(bridge), "requests": requests, "role": role}
    optional = {
        "store": store,
        "serves": serves,
        "on_miss": on_miss,
        "source_weights": source_weights,
        "chunk_size": chunk_size,
        "store_ttl_s": store_ttl_s,
        "store_timeout_ms": store_timeout_ms,
        "store_fetch_parts": store_fetch_parts,
        "export_buffer_mb": export_buffer_mb,
        "revision": revision,
        # JSON (vllm serve --kv-transfer-config): each bridge as its string, or the mapping with its revision
        "lora_bridges": {name: spec.to_config() for name, spec in parse_lora_bridges(lora_bridges).items()} or None,
    }
    extra.update({key: value for key, value in optional.items() if value is not None})
    connector_settings(extra)  # refuse a mistake here, not in vLLM's engine process
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


FLAG_FIELD = f"kv_transfer_params.{PARAM_KEY}"  # how a request's opt-in is named in errors and statuses


def parse_request_flag(params: Any) -> tuple[bool | None, str | None]:
    """A request's opt-in, strictly: `(value, None)` for JSON `true` / `false` or an absent / `null` flag
    (`value` is then `None`), `(None, reason)` for anything else.

    Only a real boolean counts (Python `bool`, not `1`, not `"yes"`, not `"false"`): a client that asks not to get
    approximate KV must never get it because its flag was spelled loosely. `params` is the request's
    `kv_transfer_params` (a dict, or `None`). The reason names the field and what it accepts; the connector serves a
    refused request unbridged (status `"refused"`), and `kvbridge serve` answers it with HTTP 400 first.

    Example:

    ```python
    >>> parse_request_flag({"kvbridge": True}), parse_request_flag(None)
    ((True, None), (None, None))
    >>> parse_request_flag({"kvbridge": "false"})
    (None, "kv_transfer_params.kvbridge must be a boolean (JSON true / false) or absent, not 'false' (str)")
    ```
    """
    if params is None:
        return None, None
    if not isinstance(params, dict):
        return None, f"kv_transfer_params must be a JSON object, not {type(params).__name__}"
    flag = params.get(PARAM_KEY)
    if flag is None or isinstance(flag, bool):
        return flag, None
    shown = repr(flag) if len(repr(flag)) <= 40 else repr(flag)[:37] + "..."
    return None, f"{FLAG_FIELD} must be a boolean (JSON true / false) or absent, not {shown} ({type(flag).__name__})"


def read_bridge_config(bridge: str, revision: str | None = None):
    from ...configuration import KVBridgeConfig
    from ...constants import MAPPER_CHECKSUMS_KEY
    from ...loading import read_config_dict, resolve_checkpoint

    folder = resolve_checkpoint(bridge, revision=revision)
    config_dict = read_config_dict(folder)
    checksums = config_dict.pop(MAPPER_CHECKSUMS_KEY, None) or {}
    return folder, KVBridgeConfig.from_dict(config_dict), checksums


def check_recompute(config, bridge: str) -> float:
    """The bridge's `recompute_fraction`, if vLLM can apply it: with the `"tail"` policy the recomputed tokens are
    the last mapped ones, which the target computes after the loaded prefix (a longer hold-back). Any other policy
    picks tokens inside the prompt, and vLLM loads only a prefix: refused at start-up. So is layer recompute
    (`recompute_layers > 0`): vLLM runs every layer of the target over the tokens it computes and cannot run only
    its top layers over the loaded ones (a store-only target cannot either).

    Example:

    ```python
    >>> from hf_kvbridge import KVBridgeConfig
    >>> check_recompute(KVBridgeConfig(recompute_fraction=0.1), "my-bridge")
    0.1
    ```
    """
    layers = int(getattr(config, "recompute_layers", 0) or 0)
    if layers > 0:
        raise ServingConfigError(
            f"bridge {bridge} has recompute_layers={layers} (layer recompute: the target runs its top {layers} "
            "layers over the mapped prompt from a mapped residual stream): vLLM runs all of the target's layers over "
            "the tokens it computes and cannot run only the top ones over a loaded prefix; save the bridge with "
            "recompute_layers=0 to serve it (or serve it with the transformers bridge)"
        )
    fraction = float(getattr(config, "recompute_fraction", 0.0) or 0.0)
    policy = getattr(config, "recompute_policy", "tail")
    if fraction > 0 and policy != "tail":
        raise ServingConfigError(
            f"bridge {bridge} has recompute_policy={policy!r} (recompute_fraction={fraction}): vLLM loads only a "
            "prefix of the prompt, so the target can recompute only the tail of the mapped tokens; save the bridge "
            "with recompute_policy='tail' or recompute_fraction=0"
        )
    return fraction


def served_model(bridge: str, serves: str = "target", revision: str | None = None) -> str:
    """What vLLM should load for `bridge` on the side it `serves`: the bridge's target (`"target"`) or its source
    (`"source"`, the model of a `role="source"` engine), as a Hub id or folder (`pocket/<name>` resolves to the
    shipped pocket model's folder)."""
    from ...loading import resolve_model_reference

    if serves not in SIDES:
        raise ServingConfigError(f"serves must be 'source' or 'target', not {serves!r}")
    _, config, _ = read_bridge_config(bridge, revision)
    reference = config.source_name_or_path if serves == "source" else config.target_name_or_path
    return resolve_model_reference(reference)


def target_model(bridge: str, revision: str | None = None) -> str:
    """What vLLM should load as its model for `bridge`: the target it was calibrated for (a Hub id or a folder;
    `pocket/<name>` resolves to the shipped pocket model's folder)."""
    from ...loading import resolve_model_reference

    _, config, _ = read_bridge_config(bridge, revision)
    return resolve_model_reference(config.target_name_or_path)
