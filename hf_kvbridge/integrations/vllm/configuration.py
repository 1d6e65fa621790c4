"""The connector's configuration: the `kv_transfer_config` that loads it, a request's opt-in, the checks a bridge's
config must pass before vLLM can serve it, and the target model vLLM should load. Needs no vLLM import of its own."""

from __future__ import annotations

from typing import Any

from ...errors import ServingConfigError

PARAM_KEY = "kvbridge"  # the key in a request's kv_transfer_params, and in the output's kv_transfer_params
CONNECTOR_NAME = "KVBridgeConnector"
MODULE_PATH = "hf_kvbridge.integrations.vllm"  # what vLLM imports (not __main__ when run with -m)
REQUEST_MODES = ("opt_in", "all")


def kv_transfer_config(bridge: str, *, requests: str = "opt_in", revision: str | None = None) -> dict[str, Any]:
    """The `kv_transfer_config` dict for `vllm.LLM(...)` (or, as JSON, `vllm serve --kv-transfer-config`).

    Args:
        bridge: a bridge checkpoint folder or Hub id (what `KVBridgeForCausalLM.from_pretrained` takes).
        requests: `"opt_in"` (a request is bridged when its `kv_transfer_params` hold `{"kvbridge": true}`) or
            `"all"` (every request unless it says `{"kvbridge": false}`).
        revision: revision of a Hub bridge.
    """
    if requests not in REQUEST_MODES:
        raise ServingConfigError(f"requests must be 'opt_in' or 'all', not {requests!r}")
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
    from ...persistence import read_config_dict, resolve_checkpoint

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
        raise ServingConfigError(
            f"bridge {bridge} has recompute_policy={policy!r} (recompute_fraction={fraction}): vLLM loads only a "
            "prefix of the prompt, so the target can recompute only the tail of the mapped tokens; save the bridge "
            "with recompute_policy='tail' or recompute_fraction=0"
        )
    return fraction


def target_model(bridge: str, revision: str | None = None) -> str:
    """What vLLM should load as its model for `bridge`: the target it was calibrated for (a Hub id or a folder;
    `pocket/<name>` resolves to the shipped pocket model's folder)."""
    from ...loading import resolve_model_reference

    _, config, _ = read_bridge_config(bridge, revision)
    return resolve_model_reference(config.target_name_or_path)
