"""`RedisClusterKVStore`: the KV store on a Redis/Valkey cluster (`redis-cluster://host:port[,host:port...]`).

A cluster spreads the keys over its masters by hash slot, so the store holds more than one host's memory, and losing
one master loses only its share. The client is redis-py's `RedisCluster`, used for what it is good at (discovering the
masters and which one holds a key's slot); the calls themselves go to each master directly, all masters at once on
worker threads, so one call costs one network round trip whatever the number of masters, and each master's share of
a call succeeds or fails on its own:

- a lookup (`probe`) answers the keys of a master that is dead, hung or unknown as not stored (a shorter stored
  prefix, never an error), within the deadline;
- a fetch (`get_many`) fails if any of its masters does (the connector then falls back);
- a write (`put_many`) writes what its live masters take and counts the rest as write errors.

A master that failed is skipped for `cooldown_s` seconds (`deadline.NodeHealth`), and the slot map is refreshed in
the background (at most once per cool-down) after a failure or a `MOVED` reply. Keys carry no hash tags: the chunks of
one conversation spread over every master (even memory and load, one round trip to each); a tag per conversation
would put a conversation on one master (fewer masters per call) at the price of balance, since every conversation
that starts with the same first chunk (a shared system prompt) would land on the same master.

`tls-cluster yes` on the servers and a `rediss-cluster://` URL make it TLS; a user and password go in the URL or as
keywords, as for one server.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, unquote

from ...errors import ServingConfigError, StoreUnavailableError
from .keys import model_digest, scan_pattern
from .redis_store import (
    CLUSTER_SCHEMES,
    RedisStoreBase,
    no_retry,
    safe_url,
    scan_usage,
    spread,
    summarize,
    url_scheme,
)
from .wire import SetPipeline

if TYPE_CHECKING:
    from .format import ChunkPayload

logger = logging.getLogger(__name__)


def parse_cluster_url(url: str) -> tuple[list[tuple[str, int]], dict[str, Any]]:
    """The start-up nodes and the client keywords (`username`, `password`, `ssl`, and the query's options) of a
    `redis-cluster://[user:password@]host:port[,host:port...][?ssl_cert_reqs=none&...]` URL.

    Example:

    ```python
    >>> parse_cluster_url("rediss-cluster://alice:secret@10.0.0.1:7000,10.0.0.2:7000?ssl_cert_reqs=none")
    ([('10.0.0.1', 7000), ('10.0.0.2', 7000)], {'username': 'alice', 'password': 'secret', 'ssl': True, 'ssl_cert_reqs': 'none'})
    ```
    """  # noqa: E501 (a doctest's output)
    scheme = url_scheme(url)
    if scheme not in CLUSTER_SCHEMES:
        raise ServingConfigError(f"a cluster URL starts with {', '.join(s + '://' for s in CLUSTER_SCHEMES)}")
    rest = url[len(scheme) + 3 :]
    rest, _, query = rest.partition("?")
    rest = rest.split("/", 1)[0]  # a cluster has database 0 only
    kwargs: dict[str, Any] = {}
    if "@" in rest:
        userinfo, rest = rest.rsplit("@", 1)
        user, _, password = userinfo.partition(":")
        if user:
            kwargs["username"] = unquote(user)
        if password:
            kwargs["password"] = unquote(password)
    nodes = []
    for part in filter(None, rest.split(",")):
        host, _, port = part.rpartition(":")
        if not host or not port.isdigit():
            raise ServingConfigError(
                f"KV store {safe_url(url)!r}: {part!r} is not host:port; a cluster URL lists its start-up nodes as "
                "redis-cluster://HOST:PORT[,HOST:PORT...]"
            )
        nodes.append((host.strip("[]"), int(port)))
    if not nodes:
        raise ServingConfigError(f"KV store {safe_url(url)!r} names no node: redis-cluster://HOST:PORT[,HOST:PORT...]")
    if scheme.startswith(("rediss", "valkeys")):
        kwargs["ssl"] = True
    kwargs.update(parse_qsl(query))
    return nodes, kwargs


class RedisClusterKVStore(RedisStoreBase):
    """The KV store on a Redis or Valkey cluster.

    Args:
        url (`str`): `redis-cluster://[user:password@]host:port[,host:port...]` (`rediss-cluster://` for TLS;
            `valkey-cluster://`, `valkeys-cluster://` alike): the nodes it asks for the cluster's layout.
        ttl_s, timeout, bulk_timeout, min_fetch_bandwidth, cooldown_s, fetch_timeout: see `RedisStoreBase`.
        client_kwargs: passed to each node's `redis.Redis` client (`password`, `username`, `ssl_ca_certs`,
            `ssl_cert_reqs`, ...).

    Example:

    ```python
    >>> store = open_store("redis-cluster://127.0.0.1:7000,127.0.0.1:7001", timeout=0.05)  # doctest: +SKIP
    >>> store.probe(["kvbridge:v2:a", "kvbridge:v2:b"], [])  # one round trip, to every master at once
    ([0, 0], [])
    ```
    """

    io_servers = 16  # masters a fetch reads from at once, `connections` each

    def __init__(self, url: str, **kwargs: Any):
        startup, url_kwargs = parse_cluster_url(url)
        super().__init__(url, **kwargs)
        self._startup = startup
        self._node_kwargs = {**url_kwargs, **self._client_kwargs}
        try:  # checks the keywords now; connects nothing
            pool = self._redis.Redis(host=startup[0][0], port=startup[0][1], **self._node_kwargs).connection_pool
            pool.connection_class(**pool.connection_kwargs)
        except (ValueError, TypeError) as err:
            raise ServingConfigError(f"KV store {self.url}: the redis client refuses its settings: {err}") from None
        self._clients: dict[tuple[str, bool], Any] = {}  # (node, bulk) → that node's client
        self._lock = threading.Lock()
        self._cluster = None  # redis-py's RedisCluster: the slot map
        self._discovery: Future | None = None
        self._last_refresh = 0.0
        try:  # the layout now, at start-up (bounded); a cluster that cannot be reached is asked again later
            self._discover().result(timeout=self.bulk_timeout)
        except Exception as err:
            logger.warning("KV store %s: the cluster's layout is not known yet (%s: %s)", self.url,
                           type(err).__name__, err)  # fmt: skip

    def __repr__(self) -> str:
        return f"RedisClusterKVStore({self.url!r}, ttl_ms={self.ttl_ms})"

    # -- the cluster's layout ----------------------------------------------------------------------------------------
    def _connect(self):
        from redis.cluster import ClusterNode, RedisCluster

        cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in self._startup],
            require_full_coverage=False,  # a master down leaves the others' slots usable
            cluster_error_retry_attempts=1,
            retry=no_retry(),
            socket_timeout=self.bulk_timeout,
            socket_connect_timeout=self.timeout,
            **self._node_kwargs,
        )
        with self._lock:
            old, self._cluster = self._cluster, cluster
        if old is not None:
            old.close()
        logger.info("KV store %s: %d masters", self.url, len(cluster.get_primaries()))
        return cluster

    def _discover(self) -> Future:
        """Asks the start-up nodes for the slot map on a worker thread (never on the caller's)."""
        with self._lock:
            if self._discovery is None or self._discovery.done():
                self._last_refresh = time.monotonic()
                self._discovery = self._pool.submit(self._connect)
            return self._discovery

    def refresh(self) -> None:
        """Refreshes the slot map in the background, at most once per cool-down (after a failure or `MOVED`)."""
        if time.monotonic() - self._last_refresh >= self.health.cooldown_s:
            self._discover()

    def _layout(self, wait_s: float | None):
        """The `RedisCluster` that knows the slot map, waiting at most `wait_s` for a first discovery."""
        cluster = self._cluster
        if cluster is not None:
            return cluster
        future = self._discover()
        try:
            return future.result(timeout=wait_s)
        except Exception as err:
            raise StoreUnavailableError(
                f"KV store {self.url}: the cluster's layout is not known ({type(err).__name__}: {err}); check that "
                "the start-up nodes in the URL are reachable"
            ) from None

    def node_of(self, key: str, cluster=None) -> str | None:
        """The `host:port` of the master that holds `key`'s slot (`None`: no live master covers it)."""
        cluster = cluster or self._layout(self.timeout)
        try:
            return cluster.get_node_from_key(key).name
        except Exception:  # the slot is not covered (its master is gone and nothing took it over)
            return None

    def _client(self, node: str, bulk: bool):
        with self._lock:
            client = self._clients.get((node, bulk))
            if client is None:
                host, _, port = node.rpartition(":")
                client = self._redis.Redis(
                    host=host, port=int(port), socket_timeout=self.bulk_timeout if bulk else self.timeout,
                    socket_connect_timeout=self.timeout, retry=no_retry(), **self._node_kwargs,
                )  # fmt: skip
                self._clients[(node, bulk)] = client
            return client

    # -- one call: each master's share at once -----------------------------------------------------------------------
    def _by_node(self, keys: list[str], wait_s: float | None) -> tuple[dict[str | None, list[int]], Any]:
        cluster = self._layout(wait_s)
        groups: dict[str | None, list[int]] = {}
        for index, key in enumerate(keys):
            groups.setdefault(self.node_of(key, cluster), []).append(index)
        return groups, cluster

    def _each_node(
        self, what: str, groups: dict[str, list[int]], build, deadline: float | None, bulk: bool, pipeline=None
    ):
        """Runs `build(pipeline, indices)` as one pipeline per node (bulk calls: per node, one per connection of
        `connections`, each with its share of the keys), all at once, waiting at most `deadline` seconds in all
        (`None`: their socket timeouts). `pipeline(client)` makes the pipelines (default: the client's own).
        Returns `{node: replies or the StoreUnavailableError}`."""
        if bulk and self.connections > 1:
            parts = {(node, j): part for node, indices in groups.items()
                     for j, part in enumerate(spread(indices, self.connections))}  # fmt: skip
            by_part = self._each_part(what, parts, build, deadline, bulk, pipeline)
            results: dict[str, Any] = {}
            for (node, _), result in by_part.items():
                if isinstance(result, Exception) or isinstance(results.get(node), Exception):
                    results[node] = results.get(node) if isinstance(results.get(node), Exception) else result
                else:
                    results[node] = [*results.get(node, []), *result]
            return results
        return self._each_part(what, groups, build, deadline, bulk, pipeline)

    def _each_part(self, what: str, groups: dict, build, deadline: float | None, bulk: bool, pipeline=None):
        """`_each_node` of `groups` keyed by node, or by `(node, part)`: one pipeline each, all at once."""
        results: dict[Any, Any] = {}
        futures: dict[Any, Future] = {}
        for group, indices in groups.items():
            node = group[0] if isinstance(group, tuple) else group
            if node is None:
                results[group] = StoreUnavailableError(f"KV store {self.url}: {what}: no live master holds the slot")
                continue
            if self.health.is_down(node):
                results[group] = self._down(node, what)
                continue

            def run(node=node, indices=indices):
                client = self._client(node, bulk)
                pipe = client.pipeline(transaction=False) if pipeline is None else pipeline(client)
                build(pipe, indices)
                return pipe.execute()

            futures[group] = (self._io if bulk else self._pool).submit(self._run, node, what, run, None)
        if futures:
            wait(list(futures.values()), timeout=deadline)
            self.metrics.add(round_trips=1)
        for group, future in futures.items():
            node = group[0] if isinstance(group, tuple) else group
            if not future.done():
                future.cancel()
                self.metrics.add(timeouts=1)
                self.health.failed(node)
                results[group] = StoreUnavailableError(
                    f"KV store {self.url} node {node}: {what} got no answer within {deadline * 1000:.0f} ms (a hung "
                    f"or overloaded master): skipped for {self.health.cooldown_s:g} s"
                )
                continue
            error = future.exception()
            results[group] = error if error is not None else future.result()
        if any(isinstance(r, StoreUnavailableError) for r in results.values()):
            self.refresh()
        if any(isinstance(r, list) and any("MOVED" in str(x) for x in r if isinstance(x, Exception))
               for r in results.values()):  # fmt: skip
            self.refresh()
        return results

    # -- the store interface -------------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """Connects to every master now (a PING on each of its clients, within `bulk_timeout`)."""
        cluster = self._layout(self.bulk_timeout)
        for node in sorted(primary.name for primary in cluster.get_primaries()):
            for bulk in (False, True):
                self._run(node, "PING", self._client(node, bulk).ping, self.bulk_timeout)

    def probe(
        self, exists: list[str], get: list[str], *, timeout: float | None = None
    ) -> tuple[list[int], list[bytes | None]]:
        """Sizes of `exists` (`0`: not stored) and payloads of `get`, from every master at once within the deadline
        (`timeout`, default the lookup deadline); keys on a master that does not answer read as not stored."""
        keys = [*exists, *get]
        if not keys:
            return [], []
        deadline = self.timeout if timeout is None else timeout
        started = time.monotonic()
        try:
            groups, _ = self._by_node(keys, deadline)
        except StoreUnavailableError:
            self.metrics.add(read_errors=1)
            raise
        n = len(exists)

        def build(pipe, indices):
            for i in indices:
                (pipe.strlen if i < n else pipe.get)(keys[i])

        left = max(deadline - (time.monotonic() - started), 0.001)
        results = self._each_node(f"lookup of {len(keys)} keys", groups, build, left, bulk=deadline > self.timeout)
        replies: list[Any] = [None] * len(keys)
        failed = 0
        for node, indices in groups.items():
            result = results[node]
            if isinstance(result, Exception):
                failed += 1
                logger.debug("%s", result)
                continue
            for i, reply in zip(indices, result, strict=True):
                replies[i] = None if isinstance(reply, Exception) else reply
        if failed:
            self.metrics.add(read_errors=1)
            if failed == len(groups):  # nothing answered: a failed lookup (the caller's miss, with the reason)
                raise next(r for r in results.values() if isinstance(r, Exception))
        return [int(r or 0) for r in replies[:n]], replies[n:]

    def exists_many(self, keys: list[str]) -> list[bool]:
        return [size > 0 for size in self.probe(keys, [])[0]]

    def get_many(self, keys: list[str], expected_bytes: int | None = None) -> list[bytes | None]:
        """The payloads of `keys` (`None`: not stored) from every master at once; fails (`StoreUnavailableError`) if a
        master holding one of them does not answer within `fetch_deadline(expected_bytes)`."""
        if not keys:
            return []
        deadline = self.fetch_deadline(expected_bytes)
        started = time.perf_counter()
        try:
            groups, _ = self._by_node(keys, deadline if deadline is not None else self.bulk_timeout)
            results = self._each_node(
                f"GET of {len(keys)} chunks", groups, lambda pipe, idx: [pipe.get(keys[i]) for i in idx], deadline,
                bulk=True,
            )  # fmt: skip
            error = next((r for r in results.values() if isinstance(r, Exception)), None)
            if error is not None:
                raise error if isinstance(error, StoreUnavailableError) else self._error("GET", error)
        except StoreUnavailableError:
            self.metrics.add(read_errors=1, fetch_seconds=time.perf_counter() - started)
            raise
        payloads: list[bytes | None] = [None] * len(keys)
        for node, indices in groups.items():
            for i, reply in zip(indices, results[node], strict=True):
                if isinstance(reply, Exception):
                    self.metrics.add(read_errors=1, fetch_seconds=time.perf_counter() - started)
                    raise self._error(f"GET of {keys[i]}", reply, node)
                payloads[i] = reply
        found = [p for p in payloads if p is not None]
        self.metrics.add(
            chunks_read=len(found), bytes_read=sum(len(p) for p in found), fetch_seconds=time.perf_counter() - started
        )
        return payloads

    def put_many(self, items: dict[str, bytes | ChunkPayload], *, ttl_s: float | None = None) -> None:
        if not items:
            return
        keys = list(items)
        started = time.perf_counter()
        try:
            groups, _ = self._by_node(keys, self.bulk_timeout)
        except StoreUnavailableError:
            self.metrics.add(write_errors=len(items))
            raise

        ttl_ms = self._ttl_ms(ttl_s)

        def build(pipe, indices):
            for i in indices:
                pipe.set(keys[i], items[keys[i]], px=ttl_ms)

        pipes: list[SetPipeline] = []

        def pipeline(client) -> SetPipeline:  # a ChunkPayload's parts sent as they are
            pipes.append(SetPipeline(client))
            return pipes[-1]

        results = self._each_node(f"SET of {len(items)} chunks", groups, build, None, bulk=True, pipeline=pipeline)
        self.metrics.add(writer_cpu_seconds=sum(pipe.cpu_seconds for pipe in pipes))  # on the store's I/O threads
        written, errors = [], []
        for node, indices in groups.items():
            result = results[node]
            if isinstance(result, Exception):
                errors.append((len(indices), result))
                continue
            for i, reply in zip(indices, result, strict=True):
                if isinstance(reply, Exception):
                    errors.append((1, self._error(f"SET of {keys[i]}", reply, node)))
                else:
                    written.append(keys[i])
        self.metrics.add(
            chunks_written=len(written), bytes_written=sum(len(items[k]) for k in written),
            put_seconds=time.perf_counter() - started,
        )  # fmt: skip
        if errors:
            self.metrics.add(write_errors=sum(n for n, _ in errors))
            raise errors[0][1]

    def delete_many(self, keys: list[str]) -> int:
        if not keys:
            return 0
        groups, _ = self._by_node(keys, self.bulk_timeout)
        results = self._each_node("DEL", groups, lambda pipe, idx: [pipe.delete(keys[i]) for i in idx], None, True)
        return sum(int(r) for result in results.values() if isinstance(result, list) for r in result
                   if not isinstance(r, Exception))  # fmt: skip

    def stats(self, model_id: str | None = None, scan_count: int = 1000) -> dict[str, Any]:
        """What the cluster holds of this package's entries: key count and memory per model digest and in all, and
        per master (its keys, bytes and server memory: the balance), from `SCAN` / `MEMORY USAGE` / `INFO memory` of
        each master. A master that does not answer is listed with its error."""
        pattern = scan_pattern(model_id)
        cluster = self._layout(self.bulk_timeout)
        masters = sorted(node.name for node in cluster.get_primaries())
        by_model: dict[str, dict[str, int]] = {}
        nodes = []
        for node in masters:
            try:
                info, mine = self._run(
                    node, "SCAN / MEMORY USAGE", lambda n=node: scan_usage(self._client(n, True), pattern, scan_count),
                    None,
                )  # fmt: skip
            except StoreUnavailableError as err:
                nodes.append({"node": node, "error": str(err)})
                continue
            for model, counts in mine.items():
                entry = by_model.setdefault(model, dict.fromkeys(counts, 0))
                for name, value in counts.items():
                    entry[name] += value
            nodes.append({
                "node": node, "keys": sum(e["keys"] for e in mine.values()),
                "bytes": sum(e["bytes"] for e in mine.values()), "used_memory": int(info.get("used_memory", 0)),
                "maxmemory": int(info.get("maxmemory", 0)), "maxmemory_policy": info.get("maxmemory_policy"),
            })  # fmt: skip
        return {
            "url": self.url,
            "pattern": pattern,
            "model": None if model_id is None else {"id": model_id, "digest": model_digest(model_id)},
            **summarize(by_model),
            "masters": len(masters),
            "nodes": nodes,
            "used_memory": sum(n.get("used_memory", 0) for n in nodes),
            "maxmemory": sum(n.get("maxmemory", 0) for n in nodes),
        }

    def close(self) -> None:
        super().close()
        with self._lock:
            clients, self._clients = list(self._clients.values()), {}
            cluster, self._cluster = self._cluster, None
        for client in [*clients, *([cluster] if cluster is not None else [])]:
            try:
                client.close()
            except Exception as err:  # closing a broken connection must not raise
                logger.debug("closing %s: %s", self.url, err)
