"""`kvbridge bench store`: the KV store's put and fetch beside the wire's own limit, on the same bytes.

For each token count, one source model's K/V (random values of its real layer shapes, `shapes.QWEN3_SHAPES`) is saved
through `PrefixKVStore.save` (the encoding, its checksum and the pipelined writes: what an export costs past the
gather) and fetched back through `PrefixKVStore.iter_load` (the reads, every check, the decode: what a warm load costs
before the map), and the very payloads the store wrote are sent again as raw pipelined `SET`s and `GET`s over the same
number of client connections: the wire's limit on this machine, with no encoding or checks. The ratios
(`fetch_over_raw`, `put_over_raw`) say how close the store's data plane runs to that limit. Store and raw runs
alternate in rounds (median of `repeats`), so a loaded machine slows both alike.

```bash
kvbridge bench store --store local --shapes qwen3-0.6b:qwen3-1.7b --tokens 1000,8000 --json store.json
```
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from ...errors import InvalidInputError
from .shapes import QWEN3_SHAPES, SMALL_SHAPES, shape_pair

RAW_PREFIX = "kvbridge-bench:raw:"
"""Keys of the raw SET/GET runs (deleted after each token count)."""


@contextmanager
def _timed(wall: list[float], cpu: list[float]) -> Iterator[None]:
    """Appends the block's wall time to `wall` and the process's CPU time over it (every thread) to `cpu`."""
    began, began_cpu = time.perf_counter(), time.process_time()
    yield
    wall.append(time.perf_counter() - began)
    cpu.append(time.process_time() - began_cpu)


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 4) if seconds > 0 else float("inf")


def _split(items: list, parts: int) -> list[list]:
    """`items` in `parts` slices of consecutive items, as even as counts allow (empty ones left out)."""
    parts = max(1, min(parts, len(items)))
    size, extra = divmod(len(items), parts)
    out, at = [], 0
    for i in range(parts):
        n = size + (i < extra)
        out.append(items[at : at + n])
        at += n
    return [part for part in out if part]


def _in_parallel(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Runs `jobs` on threads of their own (one each), returns their results in order, re-raises the first error."""
    from ...integrations.kv_store.base import at_once

    if len(jobs) == 1:
        return [jobs[0]()]
    return at_once(jobs)


class RawRedis:
    """Raw pipelined `SET`/`GET` over `connections` client connections to one server (a thread each): the wire's limit
    that the store's put and fetch are measured against.

    Args:
        url (`str`): the server (`redis://`, `valkey://`, ...).
        connections (`int`): client connections, each sending its share of the keys as one pipeline.
    """

    def __init__(self, url: str, connections: int):
        import redis

        from ...integrations.kv_store.redis_store import client_url

        self.clients = [redis.Redis.from_url(client_url(url), socket_timeout=60) for _ in range(connections)]

    def set(self, items: list[tuple[str, bytes]]) -> int:
        """Writes `items` (pipelined, split over the connections); returns the bytes sent."""

        def send(client, part):
            pipe = client.pipeline(transaction=False)
            for key, payload in part:
                # a memoryview is sent as it is (redis-py's Python packer; with hiredis installed, its packer copies
                # every value, which would make the raw SET slower than the wire)
                pipe.set(key, memoryview(payload))
            pipe.execute()

        parts = _split(items, len(self.clients))
        _in_parallel([lambda c=c, p=p: send(c, p) for c, p in zip(self.clients, parts, strict=False)])
        return sum(len(payload) for _, payload in items)

    def get(self, keys: list[str]) -> int:
        """Reads `keys` (pipelined, split over the connections); returns the bytes received."""

        def read(client, part):
            pipe = client.pipeline(transaction=False)
            for key in part:
                pipe.get(key)
            return sum(len(payload) for payload in pipe.execute() if payload is not None)

        parts = _split(keys, len(self.clients))
        return sum(_in_parallel([lambda c=c, p=p: read(c, p) for c, p in zip(self.clients, parts, strict=False)]))

    def delete(self, keys: list[str]) -> None:
        if keys:
            self.clients[0].delete(*keys)

    def close(self) -> None:
        for client in self.clients:
            client.close()


def source_kv(shape: str, tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[list, list, list[int]]:
    """Random K/V of the source shape `shape` for `tokens` tokens: per layer `(kv_heads, tokens, head_dim)`, and
    random token ids."""
    layers, _, _, kv_heads, head_dim, _ = {**QWEN3_SHAPES, **SMALL_SHAPES}[shape]
    generator = torch.Generator().manual_seed(seed)
    keys = [torch.randn(kv_heads, tokens, head_dim, generator=generator).to(dtype) for _ in range(layers)]
    values = [torch.randn(kv_heads, tokens, head_dim, generator=generator).to(dtype) for _ in range(layers)]
    ids = torch.randint(0, 100_000, (tokens,), generator=generator).tolist()
    return keys, values, ids


def measure_tokens(
    store, url: str, shape: str, tokens: int, *, chunk_size: int, repeats: int, dtype: torch.dtype,
    connections: int,
) -> dict[str, Any]:  # fmt: skip
    """One row of `run_store_benchmark`: store put/fetch and raw SET/GET of the same payloads, alternating rounds."""
    from ...integrations.kv_store import PrefixKVStore

    keys, values, ids = source_kv(shape, tokens, dtype)
    prefix = PrefixKVStore(store, model_id=f"kvbridge-bench/{shape}/{tokens}", chunk_size=chunk_size)
    metrics = store.metrics
    raw = RawRedis(url, connections)
    timings: dict[str, list[float]] = {"put": [], "fetch": [], "raw_set": [], "raw_get": []}
    cpu: dict[str, list[float]] = {name: [] for name in timings}  # the process's CPU time (every thread) per run
    moved: dict[str, int] = {}
    try:
        prefix.save(ids, keys, values, start=0, skip_stored=False)  # warm-up, and the entries the fetch reads
        found = prefix.lookup(ids)
        entry_keys = [piece[0] for piece in found.pieces]
        payloads = store.get_many(entry_keys)
        items = [(f"{RAW_PREFIX}{i}", payload) for i, payload in enumerate(payloads)]
        raw_keys = [key for key, _ in items]
        raw.set(items)
        for _ in range(repeats):
            written = metrics.as_dict()["bytes_written"]
            with _timed(timings["put"], cpu["put"]):
                prefix.save(ids, keys, values, start=0, skip_stored=False)
            moved["put"] = metrics.as_dict()["bytes_written"] - written

            with _timed(timings["raw_set"], cpu["raw_set"]):
                moved["raw_set"] = raw.set(items)

            read, fetched = metrics.as_dict()["bytes_read"], 0
            with _timed(timings["fetch"], cpu["fetch"]):
                for run in prefix.iter_load(ids, found.tokens, stored=found, parts=connections):
                    fetched += run.end - run.start
            moved["fetch"] = metrics.as_dict()["bytes_read"] - read
            if fetched != tokens:
                raise InvalidInputError(f"bench store: fetched {fetched} tokens of {tokens}: the store lost entries")

            with _timed(timings["raw_get"], cpu["raw_get"]):
                moved["raw_get"] = raw.get(raw_keys)
        raw.delete(raw_keys)
        store.delete_many(entry_keys)
    finally:
        raw.close()
    seconds = {name: statistics.median(values) for name, values in timings.items()}
    gbps = {name: _gbps(moved[name], seconds[name]) for name in seconds}
    payload_bytes = sum(len(p) for p in payloads)
    return {
        "tokens": tokens,
        "entries": len(payloads),
        "payload_bytes": payload_bytes,
        "bytes_per_token": round(payload_bytes / tokens, 1),
        "bytes_moved": moved,
        "seconds": {name: round(value, 6) for name, value in seconds.items()},
        "put_gbps": gbps["put"],
        "raw_set_gbps": gbps["raw_set"],
        "put_over_raw": round(gbps["put"] / gbps["raw_set"], 3),
        "fetch_gbps": gbps["fetch"],
        "raw_get_gbps": gbps["raw_get"],
        "fetch_over_raw": round(gbps["fetch"] / gbps["raw_get"], 3),
        # CPU seconds (all threads of this process) per 1,000 tokens: an export's and a warm load's host cost
        "cpu_seconds_per_1k_tokens": {name: round(statistics.median(v) / tokens * 1000, 5) for name, v in cpu.items()},
    }


def run_store_benchmark(
    store: str = "local",
    shapes: str = "qwen3-0.6b:qwen3-1.7b",
    tokens: list[int] | tuple[int, ...] = (1000, 8000),
    *,
    chunk_size: int | None = None,
    repeats: int = 3,
    dtype: str = "bfloat16",
    **store_kwargs: Any,
) -> dict[str, Any]:
    """The store's put and fetch against raw pipelined `SET`/`GET` of the same payloads, per token count.

    Args:
        store (`str`): a store URL of one server (`redis://`, `valkey://`, `unix://`), or `"local"` to start a
            redis-server on 127.0.0.1 for the run.
        shapes (`str`): `SOURCE:TARGET` shape names (as `kvbridge bench mapper --shapes` takes them); the store
            holds the source's K/V.
        tokens (list of `int`): prompt lengths.
        chunk_size (`int`, *optional*): tokens per stored chunk (default: the store's default).
        repeats (`int`, *optional*, defaults to 3): alternating rounds; the medians are reported.
        dtype (`str`, *optional*, defaults to `"bfloat16"`): the source K/V's dtype.
        store_kwargs: the store's options (`open_store`).

    Returns:
        `dict`: the settings, the store's `encoding` and `connections`, and one row per token count with
        `fetch_gbps`, `raw_get_gbps`, `fetch_over_raw`, `put_gbps`, `raw_set_gbps`, `put_over_raw`, the bytes moved
        by each path and the bytes per token.

    Example:

    ```python
    >>> result = run_store_benchmark("local", "small-3l-2x64:small-8l-2x64", [64], repeats=1)  # doctest: +SKIP
    >>> sorted(result["rows"][0])[:3]  # doctest: +SKIP
    ['bytes_moved', 'bytes_per_token', 'entries']
    ```
    """
    from ...integrations.kv_store import CLUSTER_SCHEMES, DEFAULT_CHUNK_SIZE, open_store, start_local_server
    from ...integrations.kv_store.redis_store import url_scheme

    source, target = shape_pair(shapes, "--shapes", {**QWEN3_SHAPES, **SMALL_SHAPES})
    if not tokens or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in tokens):
        raise InvalidInputError(f"--tokens takes prompt lengths ≥ 1, got {tokens!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise InvalidInputError(f"repeats must be a whole number ≥ 1, got {repeats!r}")
    if not isinstance(getattr(torch, dtype, None), torch.dtype):
        raise InvalidInputError(f"unknown dtype {dtype!r}; e.g. bfloat16, float16, float32")
    if url_scheme(store) in CLUSTER_SCHEMES:
        raise InvalidInputError(
            "kvbridge bench store times one server against raw SET/GET on it; give a redis:// URL of one master"
        )
    with ExitStack() as stack:
        if store == "local":
            server = start_local_server(maxmemory="4gb")
            stack.callback(server.stop)
            url = server.url
        else:
            url = store
        # a loaded machine measures slowly rather than fails: the serving deadlines widened unless given
        opened = open_store(url, **{"fetch_timeout": 60.0, "bulk_timeout": 60.0, **store_kwargs})
        stack.callback(opened.close)
        connections = int(getattr(opened, "connections", 1))
        rows = [
            measure_tokens(
                opened,
                url,
                source,
                n,
                chunk_size=chunk_size or DEFAULT_CHUNK_SIZE,
                repeats=repeats,
                dtype=getattr(torch, dtype),
                connections=connections,
            )  # fmt: skip
            for n in tokens
        ]
    return {
        "store": "local" if store == "local" else opened.url,
        "shapes": f"{source}:{target}",
        "dtype": dtype,
        "encoding": getattr(opened, "encoding", "source"),
        "connections": connections,
        "chunk_size": chunk_size or DEFAULT_CHUNK_SIZE,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def format_store_table(result: dict[str, Any]) -> str:
    """The rows of `run_store_benchmark` as a text table (GB/s)."""
    lines = [
        f"{'tokens':>7} {'MB':>8} {'B/token':>8} {'put':>7} {'raw SET':>8} {'ratio':>6} {'fetch':>7} {'raw GET':>8} "
        f"{'ratio':>6}"
    ]
    for row in result["rows"]:
        lines.append(
            f"{row['tokens']:>7} {row['payload_bytes'] / 1e6:>8.1f} {row['bytes_per_token']:>8.0f} "
            f"{row['put_gbps']:>7.3f} {row['raw_set_gbps']:>8.3f} {row['put_over_raw']:>6.2f} "
            f"{row['fetch_gbps']:>7.3f} {row['raw_get_gbps']:>8.3f} {row['fetch_over_raw']:>6.2f}"
        )
    return "\n".join(lines)
