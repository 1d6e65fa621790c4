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


def target_model(bridge: str, revision: str | None = None) -> str:
    """What vLLM should load as its model for `bridge`: the target it was calibrated for (a Hub id or a folder;
    `pocket/<name>` resolves to the shipped pocket model's folder)."""
    from ...loading import resolve_model_reference

    _, config, _ = read_bridge_config(bridge, revision)
    return resolve_model_reference(config.target_name_or_path)
