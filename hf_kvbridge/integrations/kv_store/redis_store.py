"""`RedisKVStore`: the KV store on a Redis-protocol server (Redis or Valkey), through the `redis` client.

One server, on one host or reached across hosts. Eviction is the server's: run it with `maxmemory` and
`maxmemory-policy allkeys-lru` (what `start_local_server` and `kvbridge store serve` do), and it drops the least
recently used chunks when full; a chunk whose key is gone reads as a miss. A TTL (`ttl_s`) makes every chunk expire
that long after it was written (`SET ... PX`). Authentication and TLS are the client's: a user and password in the
URL (`redis://user:secret@host:6379/0`) or as keywords, `rediss://` for TLS with `ssl_*` keywords (`ssl_ca_certs`,
`ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`) passed through. Redis Cluster is not supported (a prefix is read in
one `MGET`, which a cluster refuses across slots).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ...errors import MissingDependencyError, ServingConfigError, StoreUnavailableError
from .base import KVStore, StoreMetrics
from .keys import model_digest, parse_key, scan_pattern

logger = logging.getLogger(__name__)

T = TypeVar("T")

REDIS_SCHEMES = ("redis", "rediss", "unix")
"""URL schemes of the `redis` client."""

SCHEME_ALIASES = {"valkey": "redis", "valkeys": "rediss"}
"""Valkey speaks the same protocol: its URL schemes map to the client's."""

STORE_SCHEMES = (*REDIS_SCHEMES, *SCHEME_ALIASES)
"""Every URL scheme `open_store` takes."""


def safe_url(url: str) -> str:
    """`url` without its password (in the user part or the query), for messages and logs.

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


def _redis_module():
    try:
        return importlib.import_module("redis")
    except ImportError:
        raise MissingDependencyError(
            "the KV store needs the redis client: pip install 'hf-kvbridge[store]' (or pip install 'redis>=5')"
        ) from None


class RedisKVStore(KVStore):
    """The KV store on a Redis or Valkey server.

    Args:
        url (`str`): `redis://[user:password@]host:port/db`, `rediss://...` (TLS), `unix:///path/to.sock?db=0`;
            `valkey://` and `valkeys://` are the same as `redis://` and `rediss://`.
        ttl_s (`float`, *optional*): seconds a chunk lives after it is written (`SET ... PX`); `None`: until the
            server evicts it (`maxmemory` with `allkeys-lru`).
        socket_timeout (`float`, *optional*, defaults to `5.0`): seconds a connect or a reply may take before the
            call fails with `StoreUnavailableError`.
        client_kwargs: passed to `redis.Redis.from_url`: `password`, `username`, `ssl_ca_certs`, `ssl_certfile`,
            `ssl_keyfile`, `ssl_cert_reqs`, `retry`, ...

    Example:

    ```python
    >>> store = RedisKVStore("redis://127.0.0.1:6379/0", ttl_s=3600)  # doctest: +SKIP
    >>> store.put_many({"kvbridge:v1:x": b"payload"})  # doctest: +SKIP
    >>> store.get_many(["kvbridge:v1:x", "missing"])  # doctest: +SKIP
    [b'payload', None]
    ```
    """

    def __init__(self, url: str, *, ttl_s: float | None = None, socket_timeout: float = 5.0, **client_kwargs: Any):
        scheme = url_scheme(url)
        if scheme not in STORE_SCHEMES:
            raise ServingConfigError(
                f"RedisKVStore takes a {', '.join(s + '://' for s in STORE_SCHEMES)} URL, got {safe_url(url)!r}"
            )
        if ttl_s is not None and not ttl_s > 0:
            raise ServingConfigError(f"ttl_s must be a number of seconds > 0 (or None for no expiry), got {ttl_s!r}")
        if not socket_timeout > 0:
            raise ServingConfigError(f"socket_timeout must be a number of seconds > 0, got {socket_timeout!r}")
        self._redis = _redis_module()
        self.url = safe_url(url)
        self.ttl_ms = None if ttl_s is None else max(1, round(ttl_s * 1000))
        self.metrics = StoreMetrics()
        client_kwargs.setdefault("socket_connect_timeout", socket_timeout)
        try:
            self._client = self._redis.Redis.from_url(client_url(url), socket_timeout=socket_timeout, **client_kwargs)
            pool = self._client.connection_pool
            pool.connection_class(**pool.connection_kwargs)  # checks the keywords now; connects nothing
        except (ValueError, TypeError) as err:  # a URL or keyword the client does not take
            raise ServingConfigError(f"KV store {self.url}: the redis client refuses its settings: {err}") from None

    def __repr__(self) -> str:
        return f"RedisKVStore({self.url!r}, ttl_ms={self.ttl_ms})"

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Runs one client call; any client or connection error becomes a `StoreUnavailableError`."""
        errors = self._redis.exceptions
        try:
            return fn()
        except (errors.RedisError, OSError) as err:
            reason = _reason(err)
            if isinstance(err, errors.AuthenticationError) or any(
                word in reason for word in ("NOAUTH", "WRONGPASS", "invalid password", "Authentication")
            ):
                hint = "the server refused the credentials: check the user and password (in the URL or password=)"
            elif "maxmemory" in reason or type(err).__name__ == "OutOfMemoryError":
                hint = "the server is full and does not evict: run it with maxmemory-policy allkeys-lru"
            elif "MOVED" in reason or "CROSSSLOT" in reason:
                hint = "this is a Redis Cluster, which the store does not support: use one server"
            else:
                hint = (
                    "check that the server is running and reachable from here (host, port, firewall), that TLS "
                    "matches (rediss:// for a TLS port), and the password"
                )
            text = f"{type(err).__name__}: {reason}"
            raise StoreUnavailableError(f"KV store {self.url}: {what} failed ({text}); {hint}") from err

    def ping(self) -> None:
        """Raises `StoreUnavailableError` unless the server answers (and accepts the credentials)."""
        self._call("PING", self._client.ping)

    def exists_many(self, keys: list[str]) -> list[bool]:
        if not keys:
            return []

        def run():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        try:
            return [bool(n) for n in self._call("EXISTS", run)]
        except StoreUnavailableError:
            self.metrics.add(read_errors=1)
            raise

    def put_many(self, items: dict[str, bytes]) -> None:
        if not items:
            return

        def run():
            pipe = self._client.pipeline(transaction=False)
            for key, payload in items.items():
                pipe.set(key, payload, px=self.ttl_ms)
            pipe.execute()

        try:
            with self.metrics.timed("put_seconds"):
                self._call(f"SET of {len(items)} chunks", run)
        except StoreUnavailableError:
            self.metrics.add(write_errors=len(items))
            raise
        self.metrics.add(chunks_written=len(items), bytes_written=sum(len(p) for p in items.values()))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        try:
            with self.metrics.timed("fetch_seconds"):
                payloads = self._call(f"MGET of {len(keys)} chunks", lambda: self._client.mget(keys))
        except StoreUnavailableError:
            self.metrics.add(read_errors=1)
            raise
        found = [p for p in payloads if p is not None]
        self.metrics.add(chunks_read=len(found), bytes_read=sum(len(p) for p in found))
        return payloads

    def delete_many(self, keys: list[str]) -> int:
        """Deletes `keys`; returns how many existed (for tests and for dropping one model's entries)."""
        return int(self._call("DEL", lambda: self._client.delete(*keys))) if keys else 0

    def stats(self, model_id: str | None = None, scan_count: int = 1000) -> dict[str, Any]:
        """What the server holds of this package's chunks: key count and memory, per model digest and in all.

        Walks the keyspace with `SCAN` (never blocks the server) and asks `MEMORY USAGE` of each chunk; the server's
        own `used_memory`, `maxmemory` and `maxmemory_policy` come from `INFO memory`.
        """
        pattern = scan_pattern(model_id)

        def run():
            info = self._client.info("memory")
            by_model: dict[str, dict[str, int]] = {}
            batch: list[bytes] = []

            def account(names: list[bytes]) -> None:
                pipe = self._client.pipeline(transaction=False)
                for name in names:
                    pipe.memory_usage(name)
                for name, used in zip(names, pipe.execute(), strict=True):
                    model = parse_key(name.decode())["model"]
                    entry = by_model.setdefault(model, {"keys": 0, "bytes": 0})
                    entry["keys"] += 1
                    entry["bytes"] += int(used or 0)

            for name in self._client.scan_iter(match=pattern, count=scan_count):
                batch.append(name)
                if len(batch) >= 500:
                    account(batch)
                    batch = []
            if batch:
                account(batch)
            return info, by_model

        info, by_model = self._call("SCAN / MEMORY USAGE", run)
        return {
            "url": self.url,
            "pattern": pattern,
            "model": None if model_id is None else {"id": model_id, "digest": model_digest(model_id)},
            "keys": sum(e["keys"] for e in by_model.values()),
            "bytes": sum(e["bytes"] for e in by_model.values()),
            "by_model": dict(sorted(by_model.items())),
            "used_memory": int(info.get("used_memory", 0)),
            "maxmemory": int(info.get("maxmemory", 0)),
            "maxmemory_policy": info.get("maxmemory_policy"),
        }

    def close(self) -> None:
        try:
            self._client.close()
            self._client.connection_pool.disconnect()
        except Exception as err:  # closing a broken connection must not raise
            logger.debug("closing %s: %s", self.url, err)


def open_store(url: str, **kwargs: Any) -> KVStore:
    """The store a URL names: `redis://`, `rediss://`, `unix://`, `valkey://`, `valkeys://` → `RedisKVStore`.

    Keywords go to the backend (`ttl_s`, `socket_timeout`, `password`, `ssl_*`, ...). An unknown scheme is a
    `ServingConfigError` that lists the known ones.

    Example:

    ```python
    >>> store = open_store("valkey://127.0.0.1:6379/0", ttl_s=600)  # doctest: +SKIP
    ```
    """
    if not isinstance(url, str):
        raise ServingConfigError(f"the KV store URL must be a string such as redis://HOST:PORT/DB, got {url!r}")
    scheme = url_scheme(url)
    if scheme in STORE_SCHEMES:
        return RedisKVStore(url, **kwargs)
    raise ServingConfigError(
        f"unknown KV store URL {safe_url(url)!r} (scheme {scheme or 'missing'!r}); use redis://HOST:PORT/DB, "
        "rediss:// (TLS), unix:///path/to.sock, or valkey:// / valkeys://"
    )
