"""The connector's KV store: which model's KV an engine reads or writes (`store_identity`), and the store opened from
the connector's settings (`open_prefix_store`; the store itself is `hf_kvbridge.integrations.kv_store`'s)."""

from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger("vllm.hf_kvbridge")  # under "vllm", so vLLM's handlers format and show it


def store_identity(config, side: str) -> str:
    """The store's identity of the bridge config's `side` model (`"source"` or `"target"`): its name, revision and
    the fingerprint of its KV layout, so that two engines agree on it and a key never matches another model's KV."""
    from ..kv_store import model_identity

    return model_identity(
        getattr(config, f"{side}_name_or_path"),
        getattr(config, f"{side}_revision"),
        getattr(config, f"{side}_fingerprint"),
    )


def open_prefix_store(settings, model_id: str, *, writer: bool = False):
    """A `PrefixKVStore` of `model_id`'s KV in the store at `settings.store` (chunk size, TTL and deadline from
    `settings`), with an `AsyncWriter` when `writer` (the exporting worker: its steps never wait for the store), whose
    queue holds at most `settings.export_buffer_mb` MiB."""
    from ..kv_store import DEFAULT_CHUNK_SIZE, AsyncWriter, PrefixKVStore, open_store

    kwargs = {"timeout": settings.store_timeout_ms / 1000}
    if settings.store_ttl_s is not None:
        kwargs["ttl_s"] = settings.store_ttl_s
    store = open_store(settings.store, **kwargs)
    try:  # connect now, so that the first lookups do not pay for it within their deadline
        store.warm_up()
    except Exception as error:  # a store that is down at start-up: lookups are misses until it answers
        logger.warning(
            "KVBridgeConnector: KV store %s is not reachable at start-up: %s", redact(settings.store), error
        )
    return PrefixKVStore(
        store,
        model_id=model_id,
        chunk_size=settings.chunk_size or DEFAULT_CHUNK_SIZE,
        writer=AsyncWriter(store, max_pending_bytes=export_buffer_bytes(settings)) if writer else None,
    )


def export_buffer_bytes(settings) -> int:
    """The bytes an exporting engine's exports may hold between its steps and the store (`export_buffer_mb`; unset,
    the writer's own default)."""
    from ..kv_store.writer import DEFAULT_MAX_PENDING_BYTES

    return settings.export_buffer_mb << 20 if settings.export_buffer_mb else DEFAULT_MAX_PENDING_BYTES


def redact(url: str) -> str:
    """`url` without its password (for logs)."""
    from ..kv_store import safe_url

    return safe_url(url)
