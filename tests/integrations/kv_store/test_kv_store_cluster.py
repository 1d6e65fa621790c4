"""The KV store on a real Redis cluster: three masters on 127.0.0.1 (the installed redis-server with
`cluster-enabled yes`, joined by `redis-cli --cluster create`, `cluster-require-full-coverage no`), started once for
the module by the package's `start_local_cluster`. A model's cache goes in and comes back through
`RedisClusterKVStore`, spread over every master; then, as the module's last tests, one master is stopped (SIGSTOP: a
hung process whose socket still accepts) and another killed (SIGKILL): lookups answer within their deadline with the
prefix the live masters hold, fetches that need a lost master fail within theirs, and nothing waits longer.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from transformers import DynamicCache

from hf_kvbridge import KVLayout, ServingConfigError
from hf_kvbridge.integrations.kv_store import (
    PrefixKVStore,
    RedisClusterKVStore,
    StoreUnavailableError,
    load_cache,
    model_identity,
    open_store,
    save_cache,
    start_local_cluster,
)
from hf_kvbridge.integrations.kv_store.redis_cluster import parse_cluster_url
from hf_kvbridge.utils.cache import cache_kwargs, output_cache
from tests.conftest import VOCAB, qwen3

CHUNK = 8
DEADLINE_S = 0.2  # a healthy master on 2 busy cores answers well within it (one that misses it is skipped)


@pytest.fixture(scope="module")
def cluster():
    with start_local_cluster(3, maxmemory="64mb", node_timeout_ms=500) as running:
        yield running


@pytest.fixture(scope="module")
def store(cluster):
    with open_store(cluster.url, timeout=DEADLINE_S, cooldown_s=0.5) as opened:
        opened.warm_up()  # a connection to every master, as an engine makes at start-up
        yield opened


@pytest.fixture(scope="module")
def model():
    return qwen3(layers=2)


@pytest.fixture(scope="module")
def saved(store, model):
    """A prompt of 300 tokens (37 chunks of 8 and a partial of 4) and its cache, saved in the cluster."""
    ids = torch.randint(0, VOCAB, (1, 300), generator=torch.Generator().manual_seed(21))
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True, **cache_kwargs(DynamicCache())))
    layout = KVLayout.from_config(model.config).fingerprint()
    prefix = PrefixKVStore(store, model_id=model_identity("tests/qwen3-tiny", None, layout), chunk_size=CHUNK)
    assert save_cache(prefix, ids, cache) == 37
    return prefix, ids, cache


def test_cluster_urls_name_the_start_up_nodes_and_credentials():
    nodes, kwargs = parse_cluster_url("valkeys-cluster://u:p%40ss@10.0.0.1:7000,[::1]:7001/0?ssl_cert_reqs=none")
    assert nodes == [("10.0.0.1", 7000), ("::1", 7001)]
    assert kwargs == {"username": "u", "password": "p@ss", "ssl": True, "ssl_cert_reqs": "none"}
    for bad, message in (("redis-cluster://", "names no node"), ("redis-cluster://host", "is not host:port")):
        with pytest.raises(ServingConfigError, match=message):
            open_store(bad)


def test_a_cache_goes_in_spread_over_every_master_and_comes_back(store, saved):
    prefix, ids, cache = saved
    trips = store.metrics.round_trips
    found = prefix.lookup(ids)
    assert (found.tokens, found.chunks, found.tail_tokens) == (300, 37, 4)
    assert store.metrics.round_trips - trips == 1  # every master asked at once: one round trip
    loaded = load_cache(prefix, ids, found.tokens, stored=found)
    for layer in range(2):
        assert torch.equal(loaded.layers[layer].keys, cache.layers[layer].keys)
        assert torch.equal(loaded.layers[layer].values, cache.layers[layer].values)
    assert isinstance(store, RedisClusterKVStore)
    stats = store.stats()
    assert stats["masters"] == 3 and stats["chunks"] == 37 and stats["partials"] == 1 and stats["subs"] == 0
    per_master = sorted(node["keys"] for node in stats["nodes"])
    assert per_master[0] >= 5 and sum(per_master) == 38, stats["nodes"]  # no hash tags: spread, not piled


def test_a_bulk_fetch_reads_each_master_over_several_connections(store, saved):
    """Each master's share of a fetch is cut into `connections` pipelines sent at once; lookups: one per master."""
    prefix, ids, _ = saved
    calls, original = [], store._client

    def client(node, bulk):
        calls.append((node, bulk))
        return original(node, bulk)

    store._client = client
    try:
        keys = prefix.keys(ids)
        payloads = store.get_many(keys)
        store.probe(keys, [])
    finally:
        del store._client
    assert all(payload is not None for payload in payloads)
    bulk = [node for node, is_bulk in calls if is_bulk]
    assert store.connections == 4 and len(set(bulk)) == 3
    assert all(bulk.count(node) == 4 for node in set(bulk))  # 37 keys over 3 masters: 4 pipelines each
    assert sorted(node for node, is_bulk in calls if not is_bulk) == sorted(set(bulk))  # the lookup: one each


def test_store_stats_on_the_command_line_reports_each_master(cluster, saved, capsys):
    from kvbridge_cli import main

    assert main(["store", "stats", cluster.url]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["masters"] == 3 and len(stats["nodes"]) == 3 and stats["keys"] == 38
    assert all(node["maxmemory_policy"] == "allkeys-lru" for node in stats["nodes"])


def test_options_set_the_store_and_other_keywords_go_to_each_client(cluster, store):
    """`RedisClusterKVStore(url, **kwargs)`: `RedisStoreBase`'s options set the store (and are checked there), the
    other keywords go to the masters' clients, which check them at once."""
    assert (store.timeout, store.health.cooldown_s) == (DEADLINE_S, 0.5)  # as the `store` fixture opened it
    with pytest.raises(ServingConfigError, match="fetch_timeout must be a number > 0"):
        open_store(cluster.url, fetch_timeout=0)
    with pytest.raises(ServingConfigError, match="the redis client refuses its settings"):
        open_store(cluster.url, no_such_option=1)


# -- the last tests of the module: masters go away --------------------------------------------------------------
def _first_chunk_on(store, prefix, ids, node: str) -> int:
    keys = prefix.keys(ids)
    return next(i for i, key in enumerate(keys) if store.node_of(key) == node)


def test_a_hung_master_turns_its_keys_into_misses_within_the_deadline(cluster, store, saved, model):
    prefix, ids, cache = saved
    hung = cluster.masters[1]
    node = f"127.0.0.1:{hung.port}"
    first = _first_chunk_on(store, prefix, ids, node)
    before = prefix.lookup(ids)  # what a scheduler found before the master hung
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        begin = time.monotonic()
        found = prefix.lookup(ids)  # the live masters answer; the hung one's keys read as missing
        elapsed = time.monotonic() - begin
        assert found.chunks == first and found.tokens <= (first + 1) * CHUNK, found
        assert elapsed < 2 * DEADLINE_S + 0.3, elapsed  # one deadline and the bookkeeping, not a socket timeout
        begin = time.monotonic()
        assert prefix.lookup(ids).chunks == first and time.monotonic() - begin < DEADLINE_S  # skipped, not waited on
        assert store.metrics.timeouts >= 1 and store.metrics.skipped_down >= 1
        if first > 0:  # what the live masters hold is still right
            loaded = load_cache(prefix, ids, first * CHUNK)
            assert torch.equal(loaded.layers[1].keys, cache.layers[1].keys[:, :, : first * CHUNK])
        begin = time.monotonic()
        with pytest.raises(StoreUnavailableError, match=node):  # a fetch that needs the hung master fails
            prefix.load(ids, 300, stored=before)
        assert time.monotonic() - begin < 2 * DEADLINE_S + 0.3
    finally:
        os.kill(hung.pid, signal.SIGCONT)


def test_a_killed_master_and_a_hung_one_leave_the_third_serving_reads(cluster, store, saved):
    """Two of three masters lost: the third serves what it holds (`cluster-allow-reads-when-down`), and refuses writes
    once it sees it has lost the majority (Redis Cluster's own rule); each refusal is counted, none waits."""
    import redis

    prefix, ids, cache = saved
    dead, hung, alive = cluster.masters
    os.kill(dead.pid, signal.SIGKILL)
    os.kill(hung.pid, signal.SIGSTOP)
    try:
        survivor = redis.Redis(port=alive.port, socket_timeout=1.0)
        deadline = time.monotonic() + 20  # its cluster-node-timeout (500 ms) and the failure reports
        while survivor.execute_command("CLUSTER INFO").get("cluster_state") != "fail" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert survivor.execute_command("CLUSTER INFO").get("cluster_state") == "fail"
        time.sleep(0.6)  # past the cool-downs of earlier failures: every master is asked again
        begin = time.monotonic()
        found = prefix.lookup(ids)
        assert time.monotonic() - begin < 2 * DEADLINE_S + 0.3
        live = f"127.0.0.1:{alive.port}"
        first_lost = next(i for i, key in enumerate(prefix.keys(ids)) if store.node_of(key) != live)
        assert found.chunks == first_lost  # what the live master holds, up to the first chunk it does not
        if first_lost:
            loaded = load_cache(prefix, ids, first_lost * CHUNK)
            assert torch.equal(loaded.layers[0].values, cache.layers[0].values[:, :, : first_lost * CHUNK])
        before = store.metrics.write_errors
        keys = prefix.keys(ids[:, :200].flip(1))  # chunks of another sequence, over every master's slots
        begin = time.monotonic()
        with pytest.raises(StoreUnavailableError, match="127.0.0.1"):
            store.put_many({key: b"x" for key in keys})
        assert time.monotonic() - begin < 2 * DEADLINE_S + 0.3
        assert store.metrics.write_errors - before == len(keys)  # each one counted: lost masters and CLUSTERDOWN
        assert not any(store.exists_many([key for key in keys if store.node_of(key) == live]))
    finally:
        os.kill(hung.pid, signal.SIGCONT)
