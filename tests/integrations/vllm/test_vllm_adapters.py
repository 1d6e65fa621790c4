"""LoRA adapters' own bridges on a target engine (`kv_connector_extra_config["lora_bridges"]`), as pure functions (no
engine): the setting and its start-up checks (`adapters.lora_bridges_refusal`, `adapters.adapter_refusal` with the
pocket models' real config and tokenizer digests), an adapter's bridge pinned to a Hub revision (`{"bridge": ID,
"revision": REV}`, `--lora-bridge NAME=ID@REV`, resolved through huggingface_hub's own code on a local Hub cache,
offline), the mapper a request gets (`support.request_mapper`, `support.request_refusal`), the scheduler's status and
load on real vLLM `Request`s, the worker's choice of mapper, and `kvbridge serve --lora-bridge`. The engine test (a
LoRA request mapped with its adapter's bridge, tokens = `bridge.generate` with the merged target) is in
test_vllm.py."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from hf_kvbridge import KVBridgeConfig, pocket
from hf_kvbridge.errors import ServingConfigError
from hf_kvbridge.integrations.vllm.adapters import (
    PLAN_KNOBS,
    AdapterBridge,
    AdapterMapping,
    adapter_refusal,
    local_revision_refusal,
    lora_bridges_refusal,
    parse_lora_bridges,
)
from hf_kvbridge.integrations.vllm.configuration import connector_settings, kv_transfer_config
from hf_kvbridge.integrations.vllm.identity import file_digests, model_files
from hf_kvbridge.integrations.vllm.support import request_mapper, request_refusal


def _fingerprint(name: str) -> dict:
    from transformers import AutoConfig

    from hf_kvbridge.utils.layout import KVLayout

    return KVLayout.from_config(AutoConfig.from_pretrained(pocket.model_path(name))).fingerprint()


def _config(source="pocket/pocket-s", target="pocket-l", **knobs) -> KVBridgeConfig:
    """A bridge config of `source` → pocket `target` with the layouts' fingerprints (as `calibrate` records them)."""
    source_name = source.split("/")[-1] if source.startswith("pocket/") else "pocket-s"
    return KVBridgeConfig(
        source_name_or_path=source,
        target_name_or_path=f"pocket/{target}",
        source_fingerprint=_fingerprint(source_name),
        target_fingerprint=_fingerprint(target),
        **knobs,
    )


def _files(reference: str) -> dict[str, str]:
    from hf_kvbridge.loading import resolve_model_reference

    return file_digests(model_files(resolve_model_reference(reference)))


# -- the setting ------------------------------------------------------------------------------------------------------
def test_lora_bridges_setting_is_validated_before_any_model_loads():
    settings = connector_settings({"bridge": "b", "lora_bridges": {"sql": "b-sql", "chat": "org/b-chat"}})
    assert settings.lora_bridges == {"sql": AdapterBridge("b-sql"), "chat": AdapterBridge("org/b-chat")}
    assert connector_settings({"bridge": "b"}).lora_bridges == {}
    extra = kv_transfer_config("b", lora_bridges={"sql": "b-sql"})["kv_connector_extra_config"]
    assert extra["lora_bridges"] == {"sql": "b-sql"}
    assert "lora_bridges" not in kv_transfer_config("b")["kv_connector_extra_config"]
    for bad in (["b-sql"], {"": "b-sql"}, "sql=b-sql"):
        with pytest.raises(ServingConfigError, match=r"\['lora_bridges'\] must map") as error:
            connector_settings({"bridge": "b", "lora_bridges": bad})
        assert "\n" not in str(error.value)
    for bad in ({"sql": ""}, {"sql": 3}, {"sql": ["b-sql"]}):  # the adapter named
        with pytest.raises(ServingConfigError, match=r"\['lora_bridges'\]\['sql'\]"):
            connector_settings({"bridge": "b", "lora_bridges": bad})
    with pytest.raises(ServingConfigError, match=r"unknown keys \['lora_bridge'\]"):  # misspelled: refused
        connector_settings({"bridge": "b", "lora_bridge": {"sql": "b-sql"}})
    with pytest.raises(ServingConfigError, match="lora_bridges on a role 'source' engine"):
        kv_transfer_config("b", role="source", store="redis://127.0.0.1:6379/0", lora_bridges={"sql": "b-sql"})


def test_lora_bridges_need_a_target_engine_with_lora():
    assert lora_bridges_refusal({}, role="source", enable_lora=False) is None  # nothing asked, nothing refused
    assert lora_bridges_refusal({"sql": "b"}, role="target", enable_lora=True) is None
    refused = lora_bridges_refusal({"sql": "b"}, role="target", enable_lora=False)
    assert "without LoRA" in refused and "--enable-lora" in refused and "\n" not in refused
    assert "role 'both'" in lora_bridges_refusal({"sql": "b"}, role="both", enable_lora=True)


# -- an adapter's bridge pinned to a Hub revision ---------------------------------------------------------------------
def test_an_adapter_bridge_takes_a_revision_and_mistakes_are_one_line_naming_the_adapter(tmp_path):
    pinned = {"bridge": "org/b-sql", "revision": "v1"}
    settings = connector_settings({"bridge": "b", "lora_bridges": {"sql": pinned, "chat": "b-chat"}})
    assert settings.lora_bridges == {"sql": AdapterBridge("org/b-sql", "v1"), "chat": AdapterBridge("b-chat")}
    assert parse_lora_bridges({"sql": {"bridge": "org/b-sql"}}) == {"sql": AdapterBridge("org/b-sql")}
    assert parse_lora_bridges({"sql": {"bridge": "org/b-sql", "revision": None}})["sql"].revision is None
    # kv_transfer_config writes JSON (vllm serve --kv-transfer-config): the string, or the mapping with a revision
    extra = kv_transfer_config(
        "b", lora_bridges={"sql": AdapterBridge("org/b-sql", "v1"), "chat": "b-chat", "db": {"bridge": "org/b-db"}}
    )["kv_connector_extra_config"]
    assert extra["lora_bridges"] == {"sql": pinned, "chat": "b-chat", "db": "org/b-db"}
    assert connector_settings(json.loads(json.dumps(extra))).lora_bridges["sql"] == AdapterBridge("org/b-sql", "v1")
    refusals = {
        "has unknown keys ['revison']; known: ['bridge', 'revision']": {"bridge": "org/b-sql", "revison": "v1"},
        "['bridge'] must be the adapter's bridge folder or Hub id": {"revision": "v1"},
        "['bridge'] must be the adapter's bridge folder or Hub id (a non-empty string), not 3": {"bridge": 3},
        "['revision'] must be a Hub revision (a branch, tag or commit: a non-empty string), not 1": {
            "bridge": "org/b-sql",
            "revision": 1,
        },
        "['revision'] must be a Hub revision": {"bridge": "org/b-sql", "revision": ""},
        # a Hub id has no "@": the mapping to write instead
        """is 'org/b-sql@v1', no folder here and no Hub id (a Hub id has no '@'): pin a revision with {"bridge": \
"org/b-sql", "revision": "v1"}""": "org/b-sql@v1",
    }
    for expected, bad in refusals.items():
        with pytest.raises(ServingConfigError) as error:
            connector_settings({"bridge": "b", "lora_bridges": {"sql": bad}})
        message = str(error.value)
        assert message.startswith("kv_connector_extra_config['lora_bridges']['sql']") and expected in message, message
        assert "\n" not in message
        with pytest.raises(ServingConfigError):  # refused in the caller's process, not in vLLM's engine process
            kv_transfer_config("b", lora_bridges={"sql": bad})
    # a folder whose name has an "@" is a folder: the rule is that a path that exists wins
    folder = tmp_path / "bridges" / "sql@v1"
    folder.mkdir(parents=True)
    assert parse_lora_bridges({"sql": str(folder)}) == {"sql": AdapterBridge(str(folder))}


def test_a_revision_on_a_local_folder_is_refused(tmp_path):
    """A local folder has no revision to read: refused (read as it is, the revision would be ignored silently)."""
    refused = local_revision_refusal("sql", AdapterBridge(str(tmp_path), "v1"))
    assert refused.startswith(f"adapter 'sql': its bridge is the local folder {tmp_path}, which has no revision 'v1'")
    assert local_revision_refusal("sql", AdapterBridge(str(tmp_path))) is None
    assert local_revision_refusal("sql", AdapterBridge("org/b-sql", "v1")) is None


# -- an adapter's bridge against the base bridge and the served model -------------------------------------------------
def test_adapter_bridge_of_the_same_source_and_served_layout_is_accepted(tmp_path):
    base = _config()
    fingerprint = _fingerprint("pocket-l")
    files = _files("pocket/pocket-s")
    assert adapter_refusal("sql", _config(), base, served_fingerprint=fingerprint) is None
    # the same source by another name (a copy of its folder, as a merged-target calibration may record it): the
    # config and tokenizer digests say it is the same model
    copy = tmp_path / "pocket-s-copy"
    shutil.copytree(pocket.model_path("pocket-s"), copy, ignore=shutil.ignore_patterns("*.safetensors"))
    by_folder = _config(source=str(copy))
    assert adapter_refusal(
        "sql", by_folder, base, served_fingerprint=fingerprint, source_files=_files(str(copy)), base_source_files=files
    ) is None  # fmt: skip


def test_adapter_bridge_of_another_source_is_refused(tmp_path):
    base = _config()
    fingerprint = _fingerprint("pocket-l")
    other = _config(source="pocket/pocket-m")  # another layout
    refused = adapter_refusal("sql", other, base, served_fingerprint=fingerprint)
    assert refused.startswith("adapter 'sql': its bridge's source is pocket/pocket-m, not the base bridge's")
    assert "KV layout" in refused and "\n" not in refused
    # the same layout, another tokenizer: only the digests tell
    retokenized = tmp_path / "pocket-s-retokenized"
    shutil.copytree(pocket.model_path("pocket-s"), retokenized, ignore=shutil.ignore_patterns("*.safetensors"))
    tokenizer_config = json.loads((retokenized / "tokenizer_config.json").read_text())
    (retokenized / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "<|im_end|>"}))
    refused = adapter_refusal(
        "sql", _config(source=str(retokenized)), base, served_fingerprint=fingerprint,
        source_files=_files(str(retokenized)), base_source_files=_files("pocket/pocket-s"),
    )  # fmt: skip
    assert "they differ in tokenizer_config.json" in refused
    # another name and nothing to compare (a Hub model not in the local cache): not shown to be the same source
    hub = _config(source="org/some-model")
    refused = adapter_refusal("sql", hub, base, served_fingerprint=fingerprint, source_files={}, base_source_files={})
    assert "no config or tokenizer files to compare" in refused


def test_adapter_bridge_for_another_target_layout_or_plan_is_refused():
    base = _config()
    refused = adapter_refusal("sql", _config(target="pocket-m"), base, served_fingerprint=_fingerprint("pocket-l"))
    assert refused.startswith("adapter 'sql': its bridge's target pocket/pocket-m has another KV layout")
    for knob, value in (("hold_back", 3), ("gate_threshold", 0.5), ("recompute_fraction", 0.1)):
        assert knob in PLAN_KNOBS
        refused = adapter_refusal("sql", _config(**{knob: value}), base, served_fingerprint=_fingerprint("pocket-l"))
        assert refused is not None and f"{knob}={value!r}" in refused, knob


# -- which mapper a request gets -------------------------------------------------------------------------------------
def _request(lora: str | None = None, **fields):
    lora_request = None if lora is None else SimpleNamespace(lora_name=lora)
    base = {"lora_request": lora_request, "prompt_token_ids": [1, 2, 3], "prompt_embeds": None}
    return SimpleNamespace(**{**base, "prompt_is_token_ids": None, **fields})


def test_a_lora_request_gets_its_adapters_mapper_or_none():
    mappers = {"sql"}
    assert (request_mapper(_request("sql"), mappers), request_refusal(_request("sql"), mappers)) == ("sql", None)
    assert request_mapper(_request(), mappers) is None and request_refusal(_request(), mappers) is None  # the base
    refused = request_refusal(_request("chat"), mappers)  # an adapter without a mapper: never the base map
    assert request_mapper(_request("chat"), mappers) is None
    assert refused.startswith("LoRA adapter 'chat': the bridge maps the base model's K/V") and "'sql' only" in refused
    assert "no lora_bridges" in request_refusal(_request("sql"))  # a source engine, or no lora_bridges
    # an adapter's mapper does not lift the other refusals
    assert "prompt embeddings" in request_refusal(_request("sql", prompt_token_ids=None), mappers)


def _counter():
    counts: dict[str, int] = {}

    def count(**amounts):
        for key, value in amounts.items():
            counts[key] = counts.get(key, 0) + value

    return counts, count


def test_scheduler_bridges_a_lora_request_with_its_adapters_mapper():
    """On real vLLM `Request`s: a request with adapter "sql" (which has a mapper) is claimed, salted with that
    mapper's tag, its load names the mapper, and its status says `"mapper": "sql"`; one with adapter "chat" (none)
    is `unsupported`; a plain request is the base bridge's (no `mapper` in its status)."""
    pytest.importorskip("vllm")
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.v1.request import Request

    from hf_kvbridge.integrations.vllm import BridgeScheduler, bridged

    counts, count = _counter()
    scheduler = BridgeScheduler(
        KVBridgeConfig(), hold_back=1, requests_mode="opt_in", salt_tag="base", count=count, mappers={"sql": "sql-tag"}
    )
    params = SamplingParams(max_tokens=4, extra_args=bridged())
    requests = {
        "sql": Request("sql", list(range(100)), params, None, lora_request=LoRARequest("sql", 1, "/nowhere")),
        "chat": Request("chat", list(range(100)), params, None, lora_request=LoRARequest("chat", 2, "/nowhere")),
        "plain": Request("plain", list(range(100)), params, None),
    }
    for request in requests.values():
        request.kv_transfer_params = params.extra_args["kv_transfer_params"]
        scheduler.on_new_request(request)
    assert requests["sql"].cache_salt.startswith("sql-tag|") and requests["plain"].cache_salt.startswith("base|")
    claimed = {}
    for name in ("sql", "chat", "plain"):
        claimed[name] = scheduler.get_num_new_matched_tokens(requests[name], 0)[0]
        scheduler.update_state_after_alloc(requests[name], claimed[name])
    assert claimed["sql"] == claimed["plain"] == 99 and claimed["chat"] == 0
    output = SimpleNamespace(
        num_scheduled_tokens={"sql": 1, "plain": 1},
        scheduled_new_reqs=[SimpleNamespace(req_id=name, block_ids=([0, 1, 2, 3],)) for name in ("sql", "plain")],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[]),
    )
    loads = {load.req_id: load for load in scheduler.build_connector_meta(output).loads}
    assert (loads["sql"].mapper, loads["plain"].mapper) == ("sql", None)
    statuses = {name: scheduler.request_finished(requests[name], [])[1]["kvbridge"] for name in requests}
    assert statuses["sql"]["status"] == "mapped" and statuses["sql"]["mapper"] == "sql"
    assert statuses["plain"]["status"] == "mapped" and "mapper" not in statuses["plain"]
    assert statuses["chat"]["status"] == "unsupported" and "LoRA adapter 'chat'" in statuses["chat"]["reason"]
    assert counts["requests_adapter_mapper"] == 1 and counts["requests_unsupported"] == 1


def _bridged_requests(*names: str):
    """A `BridgeScheduler` (no store) and vLLM's own `Request`s of 100 prompt tokens, opted in and seen by it."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from hf_kvbridge import KVBridgeConfig
    from hf_kvbridge.integrations.vllm import BridgeScheduler, bridged

    _, count = _counter()
    scheduler = BridgeScheduler(KVBridgeConfig(), hold_back=1, requests_mode="opt_in", salt_tag="base", count=count)
    params = SamplingParams(max_tokens=4, extra_args=bridged())
    requests = {name: Request(name, list(range(100)), params, None) for name in names}
    for request in requests.values():
        request.kv_transfer_params = params.extra_args["kv_transfer_params"]
        scheduler.on_new_request(request)
    return scheduler, requests


def test_a_request_loaded_again_after_a_preemption_says_what_its_earlier_loads_were():
    """vLLM's own `Request` through the scheduler: a load that falls back (the target recomputes the prompt), a
    preemption, and a load again on resuming (mapped): the status is the last load's, with `earlier_loads:
    ["fallback"]` (the tokens before the preemption came from the target's own cache); a request loaded once has
    none."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    scheduler, requests = _bridged_requests("twice", "once")

    def load(names, resumed=False):
        for name in names:
            scheduler.update_state_after_alloc(
                requests[name], scheduler.get_num_new_matched_tokens(requests[name], 0)[0]
            )
        blocks = ([0, 1, 2, 3],)
        new = [] if resumed else [SimpleNamespace(req_id=name, block_ids=blocks) for name in names]
        resumed_names = list(names) if resumed else []
        cached = SimpleNamespace(req_ids=resumed_names, resumed_req_ids=set(resumed_names),
                                 new_block_ids=[blocks] * len(resumed_names))  # fmt: skip
        output = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(names, 1), scheduled_new_reqs=new,
                                 scheduled_cached_reqs=cached)  # fmt: skip
        return scheduler.build_connector_meta(output).loads

    assert len(load(["twice", "once"])) == 2
    fallback = {"status": "fallback", "mapped_tokens": 0, "reason": "KV store: fetch failed"}
    scheduler.update_connector_output(
        SimpleNamespace(kv_connector_worker_meta=SimpleNamespace(outcomes={"twice": fallback}))  # fmt: skip
    )
    assert len(load(["twice"], resumed=True)) == 1  # preempted, then resumed: claimed and loaded again
    twice = scheduler.request_finished(requests["twice"], [])[1]["kvbridge"]
    once = scheduler.request_finished(requests["once"], [])[1]["kvbridge"]
    assert twice["status"] == "mapped" and twice["mapped_tokens"] == 99 and twice["earlier_loads"] == ["fallback"]
    assert once["status"] == "mapped" and "earlier_loads" not in once


def test_a_request_resumed_on_the_prefix_cache_after_a_preemption_is_not_labelled_mapped():
    """vLLM's own `Request` through the scheduler: a request mapped, then preempted; on resuming, vLLM's prefix cache
    holds its prompt (its own blocks, or those another request of its cache salt left, perhaps the target's own after
    a fallback), so nothing is loaded again and the target computes the rest over those blocks. Its status is then
    `target` from that `start`, with its load in `earlier_loads`, never the earlier load's `mapped` alone. Offered
    again after a preemption with nothing in the prefix cache, it is loaded again and keeps `mapped`."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    scheduler, requests = _bridged_requests("cached", "evicted")
    blocks = ([0, 1, 2, 3],)
    for request in requests.values():
        scheduler.update_state_after_alloc(request, scheduler.get_num_new_matched_tokens(request, 0)[0])
    new = [SimpleNamespace(req_id=name, block_ids=blocks) for name in requests]
    none_cached = SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[])
    output = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(requests, 1), scheduled_new_reqs=new,
                             scheduled_cached_reqs=none_cached)  # fmt: skip
    assert len(scheduler.build_connector_meta(output).loads) == 2  # both mapped [0, 99)
    # both preempted; "cached" resumes with its prompt's blocks in the prefix cache (96 tokens: 6 blocks of 16)
    assert scheduler.get_num_new_matched_tokens(requests["cached"], 96) == (3, False)  # [96, 99) mapped again
    assert scheduler.get_num_new_matched_tokens(requests["cached"], 99) == (0, False)  # asked again: all cached
    assert scheduler.get_num_new_matched_tokens(requests["evicted"], 99) == (0, False)  # the first answer ...
    claimed, _ = scheduler.get_num_new_matched_tokens(requests["evicted"], 0)  # ... and the one that holds
    scheduler.update_state_after_alloc(requests["evicted"], claimed)
    resumed = SimpleNamespace(req_ids=["evicted"], resumed_req_ids={"evicted"}, new_block_ids=[blocks])
    output = SimpleNamespace(num_scheduled_tokens={"evicted": 1}, scheduled_new_reqs=[], scheduled_cached_reqs=resumed)
    assert len(scheduler.build_connector_meta(output).loads) == 1
    cached = scheduler.request_finished(requests["cached"], [])[1]["kvbridge"]
    evicted = scheduler.request_finished(requests["evicted"], [])[1]["kvbridge"]
    assert cached == {"status": "target", "mapped_tokens": 0, "reason": "nothing to map beyond the prefix cache",
                      "start": 99, "earlier_loads": ["mapped"]}  # fmt: skip
    assert evicted["status"] == "mapped" and evicted["start"] == 0 and evicted["earlier_loads"] == ["mapped"]


def test_worker_maps_a_load_with_its_adapters_mapper():
    pytest.importorskip("vllm")
    from hf_kvbridge.integrations.vllm import BridgeLoad, BridgeWorker

    base, sql = object(), object()
    worker = BridgeWorker(base, block_size=32, gate_threshold=None, count=lambda **_: None, mappers={"sql": sql})
    load = BridgeLoad("r", list(range(40)), start=0, end=39, block_ids=[0, 1], probe_end=39)
    assert worker.bridge_of(load) is base
    load.mapper = "sql"
    assert worker.bridge_of(load) is sql
    load.mapper = "chat"  # never mapped with the base bridge's map instead
    with pytest.raises(ServingConfigError, match="no mapper for LoRA adapter 'chat'"):
        worker.bridge_of(load)


def test_worker_maps_a_store_load_with_its_adapters_mapper():
    """A load whose source K/V all come from the KV store (`map_from_store`, the store-only path) is mapped with the
    load's adapter's mapper too, and a plain load with the base bridge's (stand-ins: a one-run store, mappers that
    record their calls and map to an empty cache)."""
    pytest.importorskip("vllm")
    import torch
    from transformers import DynamicCache

    from hf_kvbridge.integrations.vllm import BridgeLoad, BridgeWorker

    calls = []

    def mapper(name):
        def map_cache(kv, positions, **_):
            calls.append((name, kv.get_seq_length(), positions.shape[-1]))
            return DynamicCache()  # no layers: nothing for the (absent) attention layers to write

        return {"map_cache": map_cache, "target_layout": SimpleNamespace(num_layers=1)}

    keys = torch.zeros(1, 64, 4)  # (H, n, d)
    run = SimpleNamespace(keys=[keys], values=[keys], start=0, end=64, seconds=0.0)
    store = SimpleNamespace(iter_load=lambda *args, **kwargs: iter([run]))
    base = SimpleNamespace(device=torch.device("cpu"), source=SimpleNamespace(dtype=torch.float32), **mapper("base"))
    worker = BridgeWorker(
        base, block_size=32, gate_threshold=None, count=lambda **_: None, store=store,
        mappers={"sql": SimpleNamespace(**mapper("sql"))},
    )  # fmt: skip
    load = BridgeLoad("r", list(range(65)), 0, 64, [0, 1], probe_end=64, store_end=64, mapper="sql")
    assert worker.map_and_write(load, {}) == 64
    load.mapper = None
    assert worker.map_and_write(load, {}) == 64
    assert calls == [("sql", 64, 64), ("base", 64, 64)]


# -- kvbridge serve --------------------------------------------------------------------------------------------------
def test_kvbridge_serve_lora_bridge_options(tmp_path, capsys):
    from hf_kvbridge.integrations.vllm.serve import lora_bridge_options, serve_main

    assert lora_bridge_options(["sql=b/sql", "chat=org/b-chat"]) == {
        "sql": AdapterBridge("b/sql"),
        "chat": AdapterBridge("org/b-chat"),
    }
    for bad in (["sql"], ["=b"], ["sql="], ["sql=a", "sql=b"]):
        with pytest.raises(ServingConfigError, match="--lora-bridge"):
            lora_bridge_options(bad)
    # refused before vLLM starts (and before the bridge is read): no --enable-lora
    with pytest.raises(ServingConfigError, match="without LoRA"):
        serve_main(["no-such-bridge", "--lora-bridge", "sql=b-sql", "--print"])
    assert capsys.readouterr().out == ""
    bridge = tmp_path / "bridge"
    config = KVBridgeConfig(source_name_or_path="pocket/pocket-s", target_name_or_path="pocket/pocket-l")
    config.save_pretrained(bridge)
    assert serve_main([str(bridge), "--lora-bridge", "sql=b-sql", "--enable-lora", "--print"]) == 0
    printed = capsys.readouterr().out
    config = json.loads(printed.split("--kv-transfer-config ")[1].split(" --")[0].strip("'"))
    assert config["kv_connector_extra_config"]["lora_bridges"] == {"sql": "b-sql"}
    assert "--enable-lora" in printed


def test_kvbridge_serve_lora_bridge_at_a_revision(tmp_path, capsys):
    """`--lora-bridge NAME=ID@REVISION`: the text after the first "@" pins the Hub revision, unless the whole text
    is a path that exists here (a folder with an "@" in its name is taken whole)."""
    from hf_kvbridge.integrations.vllm.serve import lora_bridge_options, serve_main

    assert lora_bridge_options(["sql=org/b-sql@v1", "chat=org/b-chat@refs/pr/3", "db=org/b-db"]) == {
        "sql": AdapterBridge("org/b-sql", "v1"),
        "chat": AdapterBridge("org/b-chat", "refs/pr/3"),
        "db": AdapterBridge("org/b-db"),
    }
    folder = tmp_path / "sql@v1"
    folder.mkdir()
    assert lora_bridge_options([f"sql={folder}"]) == {"sql": AdapterBridge(str(folder))}  # an existing folder wins
    refusals = {
        f"sql={tmp_path}@v1": "which has no revision 'v1'",  # a folder that exists, and a revision: refused
        "sql=org/b-sql@": "needs both a bridge and a revision",
        "sql=@v1": "needs both a bridge and a revision",
    }
    for option, expected in refusals.items():
        with pytest.raises(ServingConfigError, match="--lora-bridge") as error:
            lora_bridge_options([option])
        assert expected in str(error.value) and "\n" not in str(error.value), option
    bridge = tmp_path / "bridge"
    KVBridgeConfig(source_name_or_path="pocket/pocket-s", target_name_or_path="pocket/pocket-l").save_pretrained(
        bridge
    )
    argv = [str(bridge), "--lora-bridge", "sql=org/b-sql@v1", "--lora-bridge", f"raw={folder}"]
    assert serve_main([*argv, "--enable-lora", "--print"]) == 0
    printed = capsys.readouterr().out
    config = json.loads(printed.split("--kv-transfer-config ")[1].split(" --")[0].strip("'"))
    lora_bridges = config["kv_connector_extra_config"]["lora_bridges"]
    assert lora_bridges == {"sql": {"bridge": "org/b-sql", "revision": "v1"}, "raw": str(folder)}


def _connector(lora_bridges):
    """A stand-in of a target `KVBridgeConnector` (base bridge "base", `_config()`'s source) with `lora_bridges`, on
    which the connector's own start-up methods run (`_adapter_bridges`, `_check_mapping_config`)."""
    from hf_kvbridge.integrations.vllm.connector import KVBridgeConnector

    fake = SimpleNamespace(
        settings=connector_settings({"bridge": "base", "lora_bridges": lora_bridges, "source_weights": True}),
        bridge_ref="base", import_config=_config(), _role=None,
    )  # fmt: skip
    fake._check_mapping_config = lambda *args: KVBridgeConnector._check_mapping_config(fake, *args)
    return fake


def test_connector_checks_lora_bridges_at_start_up(tmp_path):
    """`KVBridgeConnector._adapter_bridges`, what the connector runs at start-up, on vLLM's config values: an engine
    without LoRA is refused, an adapter bridge of another source is refused (one line naming the adapter), and the
    accepted ones get a cache-salt prefix of their own (their blocks never serve another mapper's request)."""
    pytest.importorskip("vllm")
    from hf_kvbridge.integrations.vllm.connector import KVBridgeConnector
    from hf_kvbridge.utils.layout import KVLayout

    def saved(name, **fields):
        _config(**fields).save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    bridges = {"sql": saved("b-sql"), "chat": saved("b-chat"), "other": saved("b-other", source="pocket/pocket-m")}
    from transformers import AutoConfig

    layout = KVLayout.from_config(AutoConfig.from_pretrained(pocket.model_path("pocket-l")))

    with_lora = SimpleNamespace(lora_config=object(), scheduler_config=SimpleNamespace(async_scheduling=False))
    without_lora = SimpleNamespace(lora_config=None, scheduler_config=with_lora.scheduler_config)
    fake = _connector({"sql": bridges["sql"]})
    with pytest.raises(ServingConfigError, match=r"does not serve lora_bridges .* on an engine without LoRA"):
        KVBridgeConnector._adapter_bridges(fake, without_lora, layout)
    assert KVBridgeConnector._adapter_bridges(_connector({}), without_lora, layout) == ({}, {})
    fake = _connector({"sql": bridges["sql"], "other": bridges["other"]})
    with pytest.raises(ServingConfigError, match=r"lora_bridges\): adapter 'other': its bridge's source is pocket/"):
        KVBridgeConnector._adapter_bridges(fake, with_lora, layout)
    adapters, salts = KVBridgeConnector._adapter_bridges(_connector({"sql": bridges["sql"], "chat": bridges["chat"]}),
                                                         with_lora, layout)  # fmt: skip
    assert set(adapters) == set(salts) == {"sql", "chat"} and str(adapters["sql"][1]) == bridges["sql"]
    assert len(set(salts.values())) == 2 and all(salt.startswith("kvbridge:") for salt in salts.values())


def _hub_cache_repo(cache, repo: str, revisions: dict[str, KVBridgeConfig]) -> dict[str, str]:
    """A Hub cache as huggingface_hub lays it out (`models--org--name/{refs/REF, snapshots/COMMIT/}`), one commit per
    ref holding `config` saved: `{ref: commit}`."""
    import hashlib

    repo_dir = cache / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True, exist_ok=True)
    commits = {}
    for ref, config in revisions.items():
        commits[ref] = hashlib.sha1(f"{repo}@{ref}".encode()).hexdigest()
        config.save_pretrained(repo_dir / "snapshots" / commits[ref])
        (repo_dir / "refs" / ref).write_text(commits[ref])
    return commits


def test_connector_reads_an_adapters_bridge_at_its_revision(tmp_path, monkeypatch):
    """`KVBridgeConnector._adapter_bridges` resolves an adapter's Hub bridge at its revision with huggingface_hub's
    own code (a local Hub cache, offline): `main` holds a bridge of the base bridge's source, `v1` one of another
    source. Unpinned, the adapter is accepted from main's snapshot; pinned to v1 it is refused (v1's config was read);
    pinned to main's commit it is main's snapshot. Two revisions with the same files get two cache salts; the start-up
    log line names the revision; a revision not in the cache is not found (no network call)."""
    pytest.importorskip("vllm")
    import logging

    from huggingface_hub import constants
    from transformers import AutoConfig

    from hf_kvbridge.errors import CheckpointNotFoundError
    from hf_kvbridge.integrations.vllm.connector import KVBridgeConnector
    from hf_kvbridge.utils.layout import KVLayout

    assert constants.HF_HUB_OFFLINE  # conftest: nothing may touch the network
    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    commits = _hub_cache_repo(
        cache, "org/b-sql", {"main": _config(), "v1": _config(source="pocket/pocket-m"), "v2": _config()}
    )
    snapshots = cache / "models--org--b-sql" / "snapshots"
    layout = KVLayout.from_config(AutoConfig.from_pretrained(pocket.model_path("pocket-l")))
    with_lora = SimpleNamespace(lora_config=object(), scheduler_config=SimpleNamespace(async_scheduling=False))

    def adapter_bridges(lora_bridges):
        return KVBridgeConnector._adapter_bridges(_connector(lora_bridges), with_lora, layout)

    adapters, _ = adapter_bridges({"sql": "org/b-sql"})
    assert adapters["sql"].folder == snapshots / commits["main"] and adapters["sql"].spec == AdapterBridge("org/b-sql")
    with pytest.raises(ServingConfigError, match=r"adapter 'sql': its bridge's source is pocket/pocket-m, not"):
        adapter_bridges({"sql": {"bridge": "org/b-sql", "revision": "v1"}})
    adapters, _ = adapter_bridges({"sql": {"bridge": "org/b-sql", "revision": commits["main"]}})
    assert adapters["sql"].folder == snapshots / commits["main"]

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.hf_kvbridge")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        adapters, salts = adapter_bridges({"sql": "org/b-sql", "chat": {"bridge": "org/b-sql", "revision": "v2"}})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert adapters["chat"].folder == snapshots / commits["v2"] and salts["sql"] != salts["chat"]
    assert any("chat (bridge org/b-sql@v2), sql (bridge org/b-sql)" in record.getMessage() for record in records)

    with pytest.raises(CheckpointNotFoundError, match=r"not in the local Hub cache"):
        adapter_bridges({"sql": {"bridge": "org/b-sql", "revision": "v3"}})
    with pytest.raises(ServingConfigError, match=r"local folder .* has no revision 'v1'"):
        adapter_bridges({"sql": {"bridge": str(snapshots / commits["main"]), "revision": "v1"}})


def test_worker_loads_each_adapters_mapper_from_the_folder_read_at_start_up(monkeypatch):
    """`load_adapter_bridges` loads each adapter's mapper from the folder the start-up checks read (a Hub bridge's
    snapshot of its pinned revision), with the config they checked, beside the base bridge's source and target
    (a stand-in `from_pretrained` records its arguments)."""
    pytest.importorskip("vllm")
    import torch

    from hf_kvbridge.integrations.vllm.worker import load_adapter_bridges
    from hf_kvbridge.modeling import KVBridgeForCausalLM

    calls = []

    def from_pretrained(folder, **kwargs):
        calls.append((folder, kwargs))
        return SimpleNamespace(mapper=torch.nn.Linear(2, 2), reverse="reverse")

    monkeypatch.setattr(KVBridgeForCausalLM, "from_pretrained", from_pretrained)
    base = SimpleNamespace(source="source", target="target")
    config = _config()
    snapshot = "hub-cache/models--org--b-sql/snapshots/0123"
    loaded = load_adapter_bridges(base, {"sql": AdapterMapping(config, snapshot, AdapterBridge("org/b-sql", "v1"))})
    assert calls == [(snapshot, {"source_model": "source", "target_model": "target", "config": config})]
    assert loaded["sql"].reverse is None


def test_kvbridge_serve_bridge_revision_reads_the_base_bridge_at_it(tmp_path, monkeypatch, capsys):
    """`kvbridge serve ID --bridge-revision REV`: the served model is read from the base bridge's config at REV
    (`main` bridges into pocket-l, `v1` into pocket-m, in a local Hub cache, offline) and the connector gets REV;
    vllm serve's own `--revision` (the served model's) passes through untouched."""
    import shlex

    from huggingface_hub import constants

    from hf_kvbridge.integrations.vllm.serve import serve_main

    cache = tmp_path / "hub-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    base = {"source_name_or_path": "pocket/pocket-s"}
    revisions = {
        "main": KVBridgeConfig(**base, target_name_or_path="pocket/pocket-l"),
        "v1": KVBridgeConfig(**base, target_name_or_path="pocket/pocket-m"),
    }
    _hub_cache_repo(cache, "org/base", revisions)

    def served(*options):
        assert serve_main(["org/base", *options, "--print"]) == 0
        command = shlex.split(capsys.readouterr().out)
        config = json.loads(command[command.index("--kv-transfer-config") + 1])
        return command[command.index("serve") + 1], config["kv_connector_extra_config"].get("revision"), command

    assert served()[:2] == (str(pocket.model_path("pocket-l")), None)
    model, revision, command = served("--bridge-revision", "v1", "--revision", "model-rev")
    assert (model, revision) == (str(pocket.model_path("pocket-m")), "v1")
    assert command[command.index("--revision") + 1] == "model-rev"
