"""LoRA adapters' own mappers on a target engine (`kv_connector_extra_config["lora_bridges"]`): a request with a LoRA
adapter is mapped only with a bridge calibrated for that adapter's target (the target with the adapter merged,
e.g. `calibrate(source, merged_target_dir)`), never with the base bridge, whose map is of the base target's K/V.

The source is the base bridge's: the source engine exports the base source's K/V (it exports no LoRA request), so one
source prefill or store entry serves the base mapper and every adapter's. What this module decides is pure (no vLLM,
no engine): which adapter bridges an engine accepts at start-up (`adapter_refusal`, `lora_bridges_refusal`) and which
mapper a request gets (`support.request_mapper`). Needs no vLLM import of its own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ...errors import ServingConfigError

PLAN_KNOBS = (
    "hold_back",
    "sink_tokens",
    "gate_threshold",
    "gate_probe_tokens",
    "recompute_fraction",
    "recompute_policy",
    "recompute_seed",
    "recompute_layers",
)
"""The bridge config fields that plan a request's positions (the scheduler's claim, the worker's gate): an adapter's
bridge must have the base bridge's, since the scheduler plans every request of the engine alike."""


@dataclass(frozen=True)
class AdapterBridge:
    """A LoRA adapter's bridge, as `lora_bridges` names it: a folder or Hub id, and the Hub revision (a branch, tag or
    commit; `None`: the repo's default branch) its files are read at, wherever they are read (the start-up checks,
    the cache salt's digest, the worker's load). In `kv_connector_extra_config` it is the string `bridge` (no
    revision) or `{"bridge": ID, "revision": REV}` (`to_config`); `str()` shows it as `ID@REV`.

    Example:

    ```python
    >>> spec = AdapterBridge("org/bridge-sql", revision="v1")
    >>> str(spec), spec.to_config(), AdapterBridge("bridges/sql").to_config()
    ('org/bridge-sql@v1', {'bridge': 'org/bridge-sql', 'revision': 'v1'}, 'bridges/sql')
    ```
    """

    bridge: str
    revision: str | None = None

    def to_config(self) -> str | dict[str, str]:
        """Its value in `kv_connector_extra_config["lora_bridges"]` (JSON): the string, or the mapping with the
        revision."""
        return self.bridge if self.revision is None else {"bridge": self.bridge, "revision": self.revision}

    def __str__(self) -> str:
        return self.bridge if self.revision is None else f"{self.bridge}@{self.revision}"


ADAPTER_BRIDGE_KEYS = ("bridge", "revision")
# a Hub repo id pinned the way `hf` and mergekit write it (`org/name@rev`): taken literally it names no repo (a Hub
# id has no "@"), so a string of that form that is no folder here is refused with the mapping to write instead
_HUB_ID_AT_REVISION = re.compile(r"(?P<bridge>[\w.-]+/[\w.-]+)@(?P<revision>.+)")


def parse_lora_bridges(value: Any) -> dict[str, AdapterBridge]:
    """`kv_connector_extra_config["lora_bridges"]` validated: `{adapter name: bridge}` (the name is vLLM's
    `LoRARequest.lora_name`, what `--lora-modules NAME=PATH` names it), where a bridge is a folder or Hub id (a
    string, taken literally) or `{"bridge": ID, "revision": REV}` to pin a Hub bridge's revision (or an
    `AdapterBridge`). `None` is `{}`. A mistake is a `ServingConfigError` of one line naming the adapter.

    Example:

    ```python
    >>> parse_lora_bridges({"sql": "bridges/s-to-l-sql", "chat": {"bridge": "org/b-chat", "revision": "v2"}})
    {'sql': AdapterBridge(bridge='bridges/s-to-l-sql', revision=None), \
'chat': AdapterBridge(bridge='org/b-chat', revision='v2')}
    ```
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ServingConfigError(
            "kv_connector_extra_config['lora_bridges'] must map a LoRA adapter name to a bridge folder or Hub id "
            f'({{"sql": "DIR"}}, or {{"sql": {{"bridge": "ID", "revision": "REV"}}}}), not {value!r}'
        )
    out = {}
    for name, bridge in value.items():
        if not isinstance(name, str) or not name:
            raise ServingConfigError(
                "kv_connector_extra_config['lora_bridges'] must map LoRA adapter names (non-empty strings) to "
                f"bridges, not {name!r}: {bridge!r}"
            )
        out[name] = _adapter_bridge(name, bridge)
    return out


def _adapter_bridge(name: str, value: Any) -> AdapterBridge:
    """One `lora_bridges` value as an `AdapterBridge`, or a one-line `ServingConfigError` naming adapter `name`."""
    where = f"kv_connector_extra_config['lora_bridges'][{name!r}]"
    if isinstance(value, AdapterBridge):
        value = {"bridge": value.bridge, "revision": value.revision}
    if isinstance(value, str):
        pinned = _HUB_ID_AT_REVISION.fullmatch(value)
        if pinned and not Path(value).expanduser().exists():
            raise ServingConfigError(
                f"{where} is {value!r}, no folder here and no Hub id (a Hub id has no '@'): pin a revision with "
                f'{{"bridge": "{pinned["bridge"]}", "revision": "{pinned["revision"]}"}}'
            )
        value = {"bridge": value}
    if not isinstance(value, Mapping):
        raise ServingConfigError(
            f'{where} must be a bridge folder or Hub id (a non-empty string) or {{"bridge": ID, "revision": REV}}, '
            f"not {value!r}"
        )
    unknown = sorted(map(str, set(value) - set(ADAPTER_BRIDGE_KEYS)))
    if unknown:
        raise ServingConfigError(f"{where} has unknown keys {unknown}; known: {list(ADAPTER_BRIDGE_KEYS)}")
    bridge, revision = value.get("bridge"), value.get("revision")
    if not isinstance(bridge, str) or not bridge:
        raise ServingConfigError(
            f"{where}['bridge'] must be the adapter's bridge folder or Hub id (a non-empty string), not {bridge!r}"
        )
    if revision is not None and (not isinstance(revision, str) or not revision):
        raise ServingConfigError(
            f"{where}['revision'] must be a Hub revision (a branch, tag or commit: a non-empty string), not "
            f"{revision!r}"
        )
    return AdapterBridge(bridge, revision)


class AdapterMapping(NamedTuple):
    """A LoRA adapter's bridge as the connector read it at start-up (`KVBridgeConnector._adapter_bridges`): its
    `config`, the `folder` its files were read from (a Hub bridge's snapshot of the pinned revision) and the `spec`
    it was named by (`adapters.AdapterBridge`: folder or Hub id, and revision)."""

    config: Any
    folder: Path
    spec: AdapterBridge


def local_revision_refusal(name: str, spec: AdapterBridge) -> str | None:
    """Why adapter `name`'s bridge `spec` cannot be read as asked (one line), or `None`: a revision pins a Hub repo's
    files, and a local folder has none to pin (read as it is, the revision would be ignored without a word).

    Example:

    ```python
    >>> local_revision_refusal("sql", AdapterBridge(".", revision="v1"))[:70]
    "adapter 'sql': its bridge is the local folder ., which has no revision"
    >>> local_revision_refusal("sql", AdapterBridge("org/bridge-sql", revision="v1")) is None
    True
    ```
    """
    if spec.revision is None or not Path(spec.bridge).expanduser().is_dir():
        return None
    return (
        f"adapter {name!r}: its bridge is the local folder {spec.bridge}, which has no revision {spec.revision!r} to "
        "read (a revision pins a Hub repo's files): drop the revision, or name the bridge by its Hub id"
    )


def lora_bridges_refusal(
    lora_bridges: Mapping[str, AdapterBridge | str], *, role: str, enable_lora: bool
) -> str | None:
    """Why an engine cannot take `lora_bridges` (one line), or `None`: they are for a target engine (role
    `"target"`; a source engine exports no LoRA request, whose K/V are not the base source's) with LoRA enabled
    (`enable_lora`: vLLM's `lora_config` is set; without it no request has an adapter to map).

    Example:

    ```python
    >>> lora_bridges_refusal({"sql": "b-sql"}, role="target", enable_lora=False)[:47]
    "lora_bridges {'sql': 'b-sql'} on an engine with"
    ```
    """
    if not lora_bridges:
        return None
    if role != "target":
        return (
            f"lora_bridges on a role {role!r} engine: an adapter's mapper maps into a target engine's LoRA requests "
            "(role 'target'); a LoRA request is never exported (its K/V are not the base model's)"
        )
    if not enable_lora:
        shown = {name: str(spec) for name, spec in lora_bridges.items()}
        return (
            f"lora_bridges {shown} on an engine without LoRA: no request can name an adapter; start "
            "vLLM with enable_lora=True (--enable-lora) and the adapters (--lora-modules NAME=PATH)"
        )
    return None


def adapter_refusal(
    name: str,
    config,
    base_config,
    *,
    served_fingerprint: dict | None,
    source_files: dict[str, str] | None = None,
    base_source_files: dict[str, str] | None = None,
) -> str | None:
    """Why the bridge `config` cannot map adapter `name`'s requests beside the base bridge `base_config` (one line),
    or `None`. Pure: the digests and the fingerprint are given.

    - its source must be the base bridge's: the same KV layout (`source_fingerprint`) and the same config and tokenizer
      files (`source_files`, `base_source_files`: `identity.file_digests` of each source's files; compared where both
      have a file), since the one source prefill or store entry of a request is the base source's;
    - its target's KV layout must be the served model's (`served_fingerprint`: the engine's `KVLayout.fingerprint()`;
      an adapter changes weights, not the layout);
    - its transfer knobs (`PLAN_KNOBS`) must be the base bridge's: the scheduler plans every request alike.

    Example:

    ```python
    >>> from hf_kvbridge import KVBridgeConfig
    >>> base = KVBridgeConfig(source_name_or_path="pocket/pocket-s")
    >>> other = KVBridgeConfig(source_name_or_path="pocket/pocket-m")
    >>> adapter_refusal("sql", other, base, served_fingerprint=None)[:54]
    "adapter 'sql': its bridge's source is pocket/pocket-m,"
    >>> adapter_refusal("sql", KVBridgeConfig(source_name_or_path="pocket/pocket-s"), base,
    ...                 served_fingerprint=None) is None
    True
    ```
    """
    source, base_source = config.source_name_or_path, base_config.source_name_or_path
    same_reference = (source, config.source_revision) == (base_source, base_config.source_revision)
    fingerprints = config.source_fingerprint, base_config.source_fingerprint
    if None not in fingerprints and fingerprints[0] != fingerprints[1]:
        differ = "they differ in KV layout"
    elif same_reference:
        differ = None
    elif common := (source_files or {}).keys() & (base_source_files or {}).keys():
        files = sorted(name for name in common if source_files[name] != base_source_files[name])  # identity's rule
        differ = f"they differ in {', '.join(files)}" if files else None
    else:  # two names and no files to compare (a Hub model not in the local cache): not shown to be the same
        differ = "no config or tokenizer files to compare"
    if differ is not None:
        return (
            f"adapter {name!r}: its bridge's source is {source}, not the base bridge's {base_source} ({differ}; the "
            f"base source's prefill or store entry is mapped): calibrate the adapter's bridge from {base_source}"
        )
    expected = config.target_fingerprint
    if expected is not None and served_fingerprint is not None:
        diffs = [key for key in served_fingerprint if expected.get(key) != served_fingerprint[key]]
        if diffs:
            return (
                f"adapter {name!r}: its bridge's target {config.target_name_or_path} has another KV layout than the "
                f"served model (differs in {', '.join(diffs)}): calibrate it for the served model with the adapter "
                "merged"
            )
    knobs = [knob for knob in PLAN_KNOBS if getattr(config, knob, None) != getattr(base_config, knob, None)]
    if knobs:
        shown = ", ".join(f"{k}={getattr(config, k, None)!r} (base {getattr(base_config, k, None)!r})" for k in knobs)
        return (
            f"adapter {name!r}: its bridge plans requests otherwise than the base bridge ({shown}): save it with the "
            "base bridge's transfer settings"
        )
    return None
