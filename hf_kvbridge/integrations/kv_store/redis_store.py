"""`RedisKVStore`: the KV store on a Redis-protocol server (Redis or Valkey), through the `redis` client, and what it
shares with the cluster's store (`redis_cluster.RedisClusterKVStore`): URL schemes, deadlines, error messages.

One server, on one host or reached across hosts. Eviction is the server's: run it with `maxmemory` and
`maxmemory-policy allkeys-lru` (what `start_local_server` and `kvbridge store serve` do), and it drops the least
recently used chunks when full; a chunk whose key is gone reads as a miss. A TTL (`ttl_s`) makes every chunk expire
that long after it was written (`SET ... PX`). Authentication and TLS are the client's: a user and password in the
URL (`redis://user:secret@host:6379/0`) or as keywords, `rediss://` for TLS with `ssl_*` keywords (`ssl_ca_certs`,
`ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`) passed through.

Every call has a deadline: lookups (`probe`, `exists_many`) `timeout` seconds (50 ms by default) of wall time, fetches
(`get_many`, in the worker) `fetch_timeout` (1 s) plus the bytes to read at `min_fetch_bandwidth`; writes (on the
writer thread) `bulk_timeout` of silence. A server that failed (refused, timed out) is skipped for `cooldown_s` seconds
(`deadline.NodeHealth`). The client never retries: a failed call is a `StoreUnavailableError`, and the caller falls
back.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ...errors import MissingDependencyError, ServingConfigError, StoreUnavailableError
from .base import KVStore, StoreMetrics, spread, spread_parts
from .deadline import DeadlineExceeded, NodeHealth, within
from .encodings import DEFAULT_ENCODING, ENCODINGS
from .keys import model_digest, parse_key, scan_pattern
from .wire import SetPipeline

if TYPE_CHECKING:
    from .format import ChunkPayload

logger = logging.getLogger(__name__)

T = TypeVar("T")

REDIS_SCHEMES = ("redis", "rediss", "unix")
"""URL schemes of the `redis` client."""

SCHEME_ALIASES = {"valkey": "redis", "valkeys": "rediss"}
"""Valkey speaks the same protocol: its URL schemes map to the client's."""

CLUSTER_SCHEMES = ("redis-cluster", "rediss-cluster", "valkey-cluster", "valkeys-cluster")
"""URL schemes of a Redis/Valkey cluster (`RedisClusterKVStore`): `redis-cluster://[user:password@]host:port[,host:port
...]`, the `s` forms for TLS."""

STORE_SCHEMES = (*REDIS_SCHEMES, *SCHEME_ALIASES, *CLUSTER_SCHEMES)
"""Every URL scheme `open_store` takes."""

DEFAULT_TIMEOUT_S = 0.05
"""The deadline of a lookup (seconds): it runs in vLLM's scheduler, between two engine steps."""

DEFAULT_BULK_TIMEOUT_S = 10.0
"""The longest silence of a write or a fetch before it fails (seconds; a fetch also has a wall-clock deadline)."""

DEFAULT_MIN_FETCH_BANDWIDTH = 100e6
"""Bytes a second a fetch must at least get: its deadline is `fetch_timeout + bytes / min_fetch_bandwidth`."""

DEFAULT_FETCH_TIMEOUT_S = 1.0
"""The fixed part of a fetch's deadline (seconds): a fetch runs in vLLM's worker, where a busy server's first byte
may take longer than the scheduler's lookup deadline allows, and a failed fetch costs a fallback."""

DEFAULT_COOLDOWN_S = 1.0
"""Seconds a server (a node) that failed is skipped before it is asked again."""

DEFAULT_CONNECTIONS = 4
"""Connections a fetch or a write of many chunks is spread over (per server): one client thread's reads of one
connection leave the wire idle while it parses and checks; several keep it busy."""

STORE_OPTIONS = ("encoding", "connections")
"""Store options a URL may carry as query parameters (`redis://host:6379/0?encoding=fp8_e4m3&connections=8`): they
are the store's, not the redis client's (`split_store_options`)."""


def split_store_options(url: str) -> tuple[str, dict[str, Any]]:
    """`url` without the store's own query parameters (`STORE_OPTIONS`), and those as keywords.

    Example:

    ```python
    >>> split_store_options("redis://127.0.0.1:6379/0?encoding=fp8_e4m3&connections=8&ssl_cert_reqs=none")
    ('redis://127.0.0.1:6379/0?ssl_cert_reqs=none', {'encoding': 'fp8_e4m3', 'connections': '8'})
    ```
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return url, {}
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    options = {k: v for k, v in pairs if k in STORE_OPTIONS}
    if not options:
        return url, {}
    query = urlencode([(k, v) for k, v in pairs if k not in STORE_OPTIONS])
    return urlunsplit((parts.scheme, parts.netloc, parts.path, query, parts.fragment)), options


def safe_url(url: str) -> str:
    """`url` without its password (in the user part or the query), for messages and logs (a cluster's several hosts
    included).

    Example:

    ```python
    >>> safe_url("redis://alice:secret@db.example:6380/2?password=x&ssl_cert_reqs=none")
    'redis://alice@db.example:6380/2?ssl_cert_reqs=none'
    ```
    """
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            user, host = netloc.rsplit("@", 1)
            user = user.split(":", 1)[0]
            netloc = f"{user}@{host}" if user else host
        query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k.lower() != "password"])
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:
        return "<unparsable store URL>"


def url_scheme(url: str) -> str:
    """The scheme of a store URL, lower-case (`""` when it has none)."""
    return url.split("://", 1)[0].lower() if "://" in url else ""


def client_url(url: str) -> str:
    """`url` as the `redis` client reads it: `valkey://` → `redis://`, `valkeys://` → `rediss://`."""
    scheme = url_scheme(url)
    return SCHEME_ALIASES[scheme] + url[len(scheme) :] if scheme in SCHEME_ALIASES else url


def _reason(err: BaseException) -> str:
    """A client error's message, short and printable: a pipeline's error quotes its command, payload included, so
    only what follows "caused error:" is kept."""
    text = str(err)
    if "caused error:" in text:
        text = text.split("caused error:", 1)[1].strip()
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= 300 else text[:300] + "..."


def no_retry():
    """A `redis.retry.Retry` that never retries: a failed call fails at once and the caller falls back."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return Retry(NoBackoff(), 0)


def _redis_module():
    try:
        return importlib.import_module("redis")
    except ImportError:
        raise MissingDependencyError(
            "the KV store needs the redis client: pip install 'hf-kvbridge[store]' (or pip install 'redis>=5')"
        ) from None


class RedisStoreBase(KVStore):
    """What the single-server and the cluster store share: settings, deadlines, node health, error messages.

    Args:
        url (`str`): the store's URL (kept without its password, for messages).
        ttl_s (`float`, *optional*): seconds a chunk lives after it is written (`SET ... PX`); `None`: until the
            server evicts it.
        timeout (`float`, *optional*, defaults to `0.05`): the deadline of a lookup, and of connecting.
        bulk_timeout (`float`, *optional*, defaults to `10.0`): the longest silence of a write or a fetch.
        min_fetch_bandwidth (`float`, *optional*, defaults to `1e8`): bytes a second below which a fetch fails.
        fetch_timeout (`float`, *optional*, defaults to `1.0`): the fixed part of a fetch's deadline.
        encoding (`str`, *optional*, defaults to `"source"`): how the chunks written through this store hold their
            K/V (`encodings.ENCODINGS`: `"source"`, `"bfloat16"`, `"fp8_e4m3"`); `PrefixKVStore` writes it.
        connections (`int`, *optional*, defaults to `4`): connections (per server) a fetch or a write of several
            chunks is spread over, in parallel.
        cooldown_s (`float`, *optional*, defaults to `1.0`): seconds a failed server is skipped.
        client_kwargs: the redis client's keywords (`password`, `ssl_*`, ...), kept for the subclass's clients. A
            subclass takes `url, **kwargs` and passes them all here (as transformers' configs pass theirs to
            `PretrainedConfig.__init__`), so the options above are declared once.
    """

    io_servers = 1
    """Servers a bulk call's connections may be spread over at once (the cluster's: its masters)."""

    def __init__(
        self,
        url: str,
        *,
        ttl_s: float | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        bulk_timeout: float = DEFAULT_BULK_TIMEOUT_S,
        min_fetch_bandwidth: float = DEFAULT_MIN_FETCH_BANDWIDTH,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        fetch_timeout: float = DEFAULT_FETCH_TIMEOUT_S,
        encoding: str = DEFAULT_ENCODING,
        connections: int | str = DEFAULT_CONNECTIONS,
        **client_kwargs: Any,
    ):
        if ttl_s is not None and not ttl_s > 0:
            raise ServingConfigError(f"ttl_s must be a number of seconds > 0 (or None for no expiry), got {ttl_s!r}")
        for name, value in (("timeout", timeout), ("bulk_timeout", bulk_timeout), ("fetch_timeout", fetch_timeout),
                            ("min_fetch_bandwidth", min_fetch_bandwidth)):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ServingConfigError(f"{name} must be a number > 0, got {value!r}")
        if isinstance(cooldown_s, bool) or not isinstance(cooldown_s, int | float) or cooldown_s < 0:
            raise ServingConfigError(f"cooldown_s must be a number of seconds ≥ 0, got {cooldown_s!r}")
        if encoding not in ENCODINGS:
            raise ServingConfigError(f"unknown store encoding {encoding!r}; choose one of {', '.join(ENCODINGS)}")
        if isinstance(connections, str) and connections.isdigit():  # from a URL's query
            connections = int(connections)
        if isinstance(connections, bool) or not isinstance(connections, int) or not 1 <= connections <= 64:
            raise ServingConfigError(f"connections must be a whole number in [1, 64], got {connections!r}")
        self._redis = _redis_module()
        self.url = safe_url(url)
        self.encoding, self.connections = encoding, connections
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self.timeout, self.bulk_timeout = float(timeout), float(bulk_timeout)
        self.min_fetch_bandwidth, self.fetch_timeout = float(min_fetch_bandwidth), float(fetch_timeout)
        self.metrics = StoreMetrics()
        self.health = NodeHealth(cooldown_s)
        self._client_kwargs = client_kwargs
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kvbridge-store")
        workers = connections * self.io_servers
        self._io = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvbridge-store-io")

    def _spread(self, calls: list[Callable[[], T]]) -> list[T]:
        """`calls` run at once, each on a connection of its own (the store's I/O threads); their results in order,
        the first error raised. One call runs here."""
        if len(calls) == 1:
            return [calls[0]()]
        futures = [self._io.submit(call) for call in calls]
        return [future.result() for future in futures]

    def _ttl_ms(self, ttl_s: float | None) -> int | None:
        """`ttl_s` in milliseconds (`None`: the store's TTL); the shorter of the two when both are set."""
        if ttl_s is None:
            return self.ttl_ms
        ms = max(1, round(ttl_s * 1000))
        return ms if self.ttl_ms is None else min(ms, self.ttl_ms)

    def fetch_deadline(self, expected_bytes: int | None) -> float | None:
        """The wall-clock deadline of a fetch of `expected_bytes` (`None` when the size is not known: the fetch is
        then bounded by `bulk_timeout` of silence only)."""
        return None if expected_bytes is None else self.fetch_timeout + expected_bytes / self.min_fetch_bandwidth

    def _error(self, what: str, err: BaseException, node: str | None = None) -> StoreUnavailableError:
        """A `StoreUnavailableError` naming the store (and node), what failed and what to check."""
        errors = self._redis.exceptions
        where = f"KV store {self.url}" + (f" node {node}" if node and node != self.url else "")
        if isinstance(err, DeadlineExceeded):
            return StoreUnavailableError(
                f"{where}: {what} got {err} (a hung or overloaded server): treated as a miss; the server is skipped "
                f"for {self.health.cooldown_s:g} s"
            )
        reason = _reason(err)
        if isinstance(err, errors.AuthenticationError | errors.NoPermissionError) or any(
            word in reason for word in ("NOAUTH", "WRONGPASS", "invalid password", "Authentication", "NOPERM")
        ):
            hint = "the server refused the credentials: check the user, the password and the user's ACL"
        elif "maxmemory" in reason or type(err).__name__ == "OutOfMemoryError":
            hint = "the server is full and does not evict: run it with maxmemory-policy allkeys-lru"
        elif "CLUSTERDOWN" in reason:
            hint = (
                "the cluster is down for this master (it lost sight of the majority of masters, or a slot has no "
                "master): check the cluster's masters"
            )
        elif "MOVED" in reason or "CROSSSLOT" in reason or "cluster" in reason.lower():
            hint = "this is a Redis Cluster: use a redis-cluster:// URL"
        else:
            hint = (
                "check that the server is running and reachable from here (host, port, firewall), that TLS "
                "matches (rediss:// for a TLS port), and the password"
            )
        return StoreUnavailableError(f"{where}: {what} failed ({type(err).__name__}: {reason}); {hint}")

    def _down(self, node: str, what: str) -> StoreUnavailableError:
        self.metrics.add(skipped_down=1)
        return StoreUnavailableError(
            f"KV store {self.url}: {what} not sent: {node} failed less than {self.health.cooldown_s:g} s ago "
            "(asked again after that)"
        )

    def _run(self, node: str, what: str, fn: Callable[[], T], deadline: float | None) -> T:
        """`fn()` against `node`, within `deadline` seconds of wall time (`None`: its socket timeouts only); a failure
        marks the node down (`StoreUnavailableError`), a reply marks it up."""
        if self.health.is_down(node):
            raise self._down(node, what)
        errors = self._redis.exceptions
        try:
            result = fn() if deadline is None else within(self._pool, deadline, fn)
        except DeadlineExceeded as err:
            self.metrics.add(timeouts=1)
            self.health.failed(node)
            raise self._error(what, err, node) from None
        except errors.ResponseError as err:  # the server answered (an error reply): it is up
            raise self._error(what, err, node) from err
        except (errors.RedisError, OSError) as err:
            self.health.failed(node)
            if isinstance(err, errors.TimeoutError | TimeoutError):  # the socket's timeout came first: the same miss
                self.metrics.add(timeouts=1)
                wait = self.bulk_timeout if deadline is None else deadline  # calls without one use the bulk client
                raise self._error(what, DeadlineExceeded(f"no answer within {wait * 1000:.0f} ms"), node) from err
            raise self._error(what, err, node) from err
        self.health.succeeded(node)
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._io.shutdown(wait=False, cancel_futures=True)


class RedisKVStore(RedisStoreBase):
    """The KV store on one Redis or Valkey server.

    Args:
        url (`str`): `redis://[user:password@]host:port/db`, `rediss://...` (TLS), `unix:///path/to.sock?db=0`;
            `valkey://` and `valkeys://` are the same as `redis://` and `rediss://`.
        ttl_s (`float`, *optional*): seconds a chunk lives after it is written (`SET ... PX`); `None`: until the
            server evicts it (`maxmemory` with `allkeys-lru`).
        timeout (`float`, *optional*, defaults to `0.05`): the deadline of a lookup (and of connecting), seconds.
        bulk_timeout, min_fetch_bandwidth, cooldown_s, fetch_timeout: see `RedisStoreBase`.
        client_kwargs: passed to `redis.Redis.from_url`: `password`, `username`, `ssl_ca_certs`, `ssl_certfile`,
            `ssl_keyfile`, `ssl_cert_reqs`, ...

    Example:

    ```python
    >>> store = RedisKVStore("redis://127.0.0.1:6379/0", ttl_s=3600)  # doctest: +SKIP
    >>> store.put_many({"kvbridge:v2:x": b"payload"})  # doctest: +SKIP
    >>> store.get_many(["kvbridge:v2:x", "missing"])  # doctest: +SKIP
    [b'payload', None]
    ```
    """

    def __init__(self, url: str, **kwargs: Any):
        scheme = url_scheme(url)
        if scheme not in (*REDIS_SCHEMES, *SCHEME_ALIASES):
            raise ServingConfigError(
                "RedisKVStore takes a redis://, rediss://, unix://, valkey:// or valkeys:// URL, got "
                f"{safe_url(url)!r}" + ("; open a cluster with open_store" if scheme in CLUSTER_SCHEMES else "")
            )
        super().__init__(url, **kwargs)
        self.node = self.url
        try:
            # lookups: replies within the deadline; writes and fetches: large payloads, bounded by silence
            self._fast = self._client(url, self.timeout)
            self._bulk = self._client(url, self.bulk_timeout)
        except (ValueError, TypeError) as err:  # a URL or keyword the client does not take
            raise ServingConfigError(f"KV store {self.url}: the redis client refuses its settings: {err}") from None

    def _client(self, url: str, socket_timeout: float):
        kwargs = {"socket_connect_timeout": self.timeout, "retry": no_retry(), **self._client_kwargs}
        client = self._redis.Redis.from_url(client_url(url), socket_timeout=socket_timeout, **kwargs)
        pool = client.connection_pool
        pool.connection_class(**pool.connection_kwargs)  # checks the keywords now; connects nothing
        return client

    def __repr__(self) -> str:
        return f"RedisKVStore({self.url!r}, ttl_ms={self.ttl_ms})"

    def ping(self) -> None:
        """Raises `StoreUnavailableError` unless the server answers (and accepts the credentials) within the
        deadline."""
        self._run(self.node, "PING", self._fast.ping, self.timeout)

    def warm_up(self) -> None:
        """Connects both clients now (a PING each, within `bulk_timeout`)."""
        for client in (self._fast, self._bulk):
            self._run(self.node, "PING", client.ping, self.bulk_timeout)

    def probe(
        self, exists: list[str], get: list[str], *, timeout: float | None = None
    ) -> tuple[list[int], list[bytes | None]]:
        """For each of `exists` the stored payload's size (`0`: not stored), and the payloads of `get`: one pipeline
        (`STRLEN`, `GET`), within the deadline (`timeout`, default the lookup deadline)."""
        if not exists and not get:
            return [], []
        deadline = self.timeout if timeout is None else timeout
        client = self._fast if deadline <= self.timeout else self._bulk  # the fast one's sockets time out first

        def run():
            pipe = client.pipeline(transaction=False)
            for key in exists:
                pipe.strlen(key)
            for key in get:
                pipe.get(key)
            return pipe.execute()

        try:
            replies = self._run(self.node, f"lookup of {len(exists)} + {len(get)} keys", run, deadline)
        except StoreUnavailableError:
            self.metrics.add(read_errors=1)
            raise
        self.metrics.add(round_trips=1)
        return [int(n) for n in replies[: len(exists)]], replies[len(exists) :]

    def exists_many(self, keys: list[str]) -> list[bool]:
        return [size > 0 for size in self.probe(keys, [])[0]]

    def put_many(self, items: dict[str, bytes | ChunkPayload], *, ttl_s: float | None = None) -> None:
        if not items:
            return

        parts = spread(list(items.items()), spread_parts(sum(len(p) for p in items.values()), self.connections))
        pipes = [SetPipeline(self._bulk) for _ in parts]  # a ChunkPayload's parts sent as they are

        def send(pipe: SetPipeline, part: list[tuple[str, bytes | ChunkPayload]]) -> None:
            for key, payload in part:
                pipe.set(key, payload, px=self._ttl_ms(ttl_s))
            pipe.execute()

        def run():
            self._spread([lambda p=pipe, part=part: send(p, part) for pipe, part in zip(pipes, parts, strict=True)])

        try:
            with self.metrics.timed("put_seconds"):
                self._run(self.node, f"SET of {len(items)} chunks", run, None)
        except StoreUnavailableError:
            self.metrics.add(write_errors=len(items))
            raise
        finally:
            if len(pipes) > 1:  # sent on the store's I/O threads (one alone is sent here): the writer's CPU time too
                self.metrics.add(writer_cpu_seconds=sum(pipe.cpu_seconds for pipe in pipes))
        self.metrics.add(round_trips=1, chunks_written=len(items), bytes_written=sum(len(p) for p in items.values()))

    def get_many(self, keys: list[str], expected_bytes: int | None = None) -> list[bytes | None]:
        """The payloads of `keys` (`None` for a key not stored), in `MGET`s spread over up to `connections`
        connections at once; with `expected_bytes`, within `fetch_deadline(expected_bytes)` of wall time."""
        if not keys:
            return []

        def run() -> list[bytes | None]:
            parts = self._spread([lambda part=part: self._bulk.mget(part) for part in spread(keys, self.connections)])
            return [payload for part in parts for payload in part]

        try:
            with self.metrics.timed("fetch_seconds"):
                payloads = self._run(
                    self.node, f"MGET of {len(keys)} chunks", run, self.fetch_deadline(expected_bytes)
                )
        except StoreUnavailableError:
            self.metrics.add(read_errors=1)
            raise
        found = [p for p in payloads if p is not None]
        self.metrics.add(round_trips=1, chunks_read=len(found), bytes_read=sum(len(p) for p in found))
        return payloads

    def delete_many(self, keys: list[str]) -> int:
        """Deletes `keys`; returns how many existed."""
        if not keys:
            return 0
        deleted = int(self._run(self.node, "DEL", lambda: self._bulk.delete(*keys), None))
        self.metrics.add(round_trips=1)
        return deleted

    def stats(self, model_id: str | None = None, scan_count: int = 1000) -> dict[str, Any]:
        """What the server holds of this package's entries: key count and memory, per model digest and in all.

        Walks the keyspace with `SCAN` (never blocks the server) and asks `MEMORY USAGE` of each entry; the server's
        own `used_memory`, `maxmemory` and `maxmemory_policy` come from `INFO memory`.
        """
        pattern = scan_pattern(model_id)
        info, by_model = self._run(
            self.node, "SCAN / MEMORY USAGE", lambda: scan_usage(self._bulk, pattern, scan_count), None
        )
        return {
            "url": self.url,
            "pattern": pattern,
            "model": None if model_id is None else {"id": model_id, "digest": model_digest(model_id)},
            **summarize(by_model),
            "used_memory": int(info.get("used_memory", 0)),
            "maxmemory": int(info.get("maxmemory", 0)),
            "maxmemory_policy": info.get("maxmemory_policy"),
        }

    def close(self) -> None:
        super().close()
        for client in (self._fast, self._bulk):
            try:
                client.close()
                client.connection_pool.disconnect()
            except Exception as err:  # closing a broken connection must not raise
                logger.debug("closing %s: %s", self.url, err)


def scan_usage(client, pattern: str, scan_count: int = 1000) -> tuple[dict, dict[str, dict[str, int]]]:
    """`(INFO memory, {model digest: {"keys", "bytes", "chunks", "subs", "partials"}})` of one server's entries that
    match `pattern`: `SCAN` (never blocks the server), then `MEMORY USAGE` of each, pipelined 500 at a time."""
    info = client.info("memory")
    by_model: dict[str, dict[str, int]] = {}
    batch: list[bytes] = []

    def account(names: list[bytes]) -> None:
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.memory_usage(name)
        for name, used in zip(names, pipe.execute(), strict=True):
            fields = parse_key(name.decode())
            entry = by_model.setdefault(fields["model"], {"keys": 0, "bytes": 0, "chunks": 0, "subs": 0,
                                                          "partials": 0})  # fmt: skip
            entry["keys"] += 1
            entry["bytes"] += int(used or 0)
            entry[{"chunk": "chunks", "sub": "subs", "partial": "partials"}[fields["kind"]]] += 1

    for name in client.scan_iter(match=pattern, count=scan_count):
        batch.append(name)
        if len(batch) >= 500:
            account(batch)
            batch = []
    if batch:
        account(batch)
    return info, by_model


def summarize(by_model: dict[str, dict[str, int]]) -> dict[str, Any]:
    """Totals of `scan_usage`'s per-model counts, and the counts sorted by model digest."""
    total = {name: sum(e[name] for e in by_model.values()) for name in ("keys", "bytes", "chunks", "subs", "partials")}
    return {**total, "by_model": dict(sorted(by_model.items()))}
