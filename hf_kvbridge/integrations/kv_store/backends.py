"""`open_store`: the store backend a URL names (one Redis/Valkey server, or a cluster of them)."""

from __future__ import annotations

from typing import Any

from ...errors import ServingConfigError
from .base import KVStore
from .redis_cluster import RedisClusterKVStore
from .redis_store import CLUSTER_SCHEMES, STORE_SCHEMES, RedisKVStore, safe_url, split_store_options, url_scheme


def open_store(url: str, **kwargs: Any) -> KVStore:
    """The store a URL names: `redis://`, `rediss://`, `unix://`, `valkey://`, `valkeys://` → `RedisKVStore` (one
    server); `redis-cluster://host:port[,host:port...]` (and `rediss-cluster://`, `valkey-cluster://`,
    `valkeys-cluster://`) → `RedisClusterKVStore` (a cluster; the hosts are where it starts to discover the others).

    Keywords go to the backend (`ttl_s`, `timeout`, `bulk_timeout`, `cooldown_s`, `encoding`, `connections`,
    `password`, `ssl_*`, ...); the store's own options may also be the URL's query parameters (`?encoding=fp8_e4m3
    &connections=8`; a keyword wins). An unknown scheme is a `ServingConfigError` that lists the known ones.

    Example:

    ```python
    >>> store = open_store("valkey://127.0.0.1:6379/0", ttl_s=600)  # doctest: +SKIP
    ```
    """
    if not isinstance(url, str):
        raise ServingConfigError(f"the KV store URL must be a string such as redis://HOST:PORT/DB, got {url!r}")
    url, options = split_store_options(url)
    kwargs = {**options, **kwargs}
    scheme = url_scheme(url)
    if scheme in CLUSTER_SCHEMES:
        return RedisClusterKVStore(url, **kwargs)
    if scheme in STORE_SCHEMES:
        return RedisKVStore(url, **kwargs)
    raise ServingConfigError(
        f"unknown KV store URL {safe_url(url)!r} (scheme {scheme or 'missing'!r}); use redis://HOST:PORT/DB, "
        "rediss:// (TLS), unix:///path/to.sock, valkey:// / valkeys://, or redis-cluster://HOST:PORT[,HOST:PORT...] "
        "(rediss-cluster:// for TLS)"
    )
