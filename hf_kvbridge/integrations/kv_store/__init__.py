"""The KV store of warm-path serving: per-token K/V of prompts and replies, found by the longest stored prefix.

A source engine exports its own K/V of a sequence here; a target engine (another model) later looks up the longest
stored prefix of its request's tokens, fetches the source K/V and maps it with the bridge. The store is an existing
system, a Redis-protocol server (Redis or Valkey), behind a small interface (`KVStore`) that another backend can
implement. The pieces, one module each:

- `keys`: chained per-chunk keys over token ids, with the model's identity and the tenant's salt in every key, and the
  finer keys of a trailing partial chunk (sub-chunks and a remainder);
- `format`: the versioned, engine-layout-independent chunk payload (safetensors);
- `base`, `redis_store`, `redis_cluster`, `backends`: the store interface, its metrics, the clients of one
  Redis/Valkey server and of a cluster, and `open_store` (the backend a URL names); `deadline`: the deadline of every
  call and the health of each server;
- `writer`: asynchronous writes that never block or fail the caller;
- `prefix`: lookup / save / load of one model's prefixes; `dynamic_cache`: the same for a transformers cache;
- `local_server`: a local Redis/Valkey server (or cluster) for single-host setups and the tests; `sizing`: bytes per
  chunk.

Example:

```python
>>> from hf_kvbridge.integrations.kv_store import PrefixKVStore, model_identity, open_store, start_local_server
>>> server = start_local_server()  # doctest: +SKIP
>>> store = open_store(server.url)  # doctest: +SKIP
>>> prefix = PrefixKVStore(store, model_id=model_identity("pocket-s"), chunk_size=64)  # doctest: +SKIP
>>> save_cache(prefix, ids, cache); load_cache(prefix, ids, prefix.lookup(ids).tokens)  # doctest: +SKIP
```
"""

from ...errors import StoreFormatError, StoreMissError, StoreUnavailableError
from .backends import open_store
from .base import KVStore, StoreMetrics
from .dynamic_cache import load_cache, save_cache
from .encodings import ENCODINGS
from .format import (
    CHUNK_VERSION,
    FORMAT_NAME,
    ChunkEncoder,
    ChunkPayload,
    decode_chunk,
    encode_chunk,
    encode_chunk_views,
    read_metadata,
)
from .keys import (
    DEFAULT_CHUNK_SIZE,
    FORMAT_VERSION,
    KEY_PREFIX,
    as_token_list,
    chunk_keys,
    model_digest,
    model_identity,
    parse_key,
    salt_digest,
    scan_pattern,
    sequence_keys,
)
from .local_server import LocalCluster, LocalServer, find_server_binary, start_local_cluster, start_local_server
from .prefix import FetchedRun, PrefixKVStore, StoredPrefix
from .redis_cluster import RedisClusterKVStore
from .redis_store import CLUSTER_SCHEMES, STORE_SCHEMES, RedisKVStore, safe_url
from .sizing import chunk_bytes
from .writer import AsyncWriter

__all__ = [
    "CHUNK_VERSION",
    "DEFAULT_CHUNK_SIZE",
    "ENCODINGS",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "KEY_PREFIX",
    "STORE_SCHEMES",
    "AsyncWriter",
    "ChunkEncoder",
    "ChunkPayload",
    "CLUSTER_SCHEMES",
    "FetchedRun",
    "KVStore",
    "LocalCluster",
    "LocalServer",
    "PrefixKVStore",
    "RedisClusterKVStore",
    "RedisKVStore",
    "StoredPrefix",
    "StoreFormatError",
    "StoreMetrics",
    "StoreMissError",
    "StoreUnavailableError",
    "as_token_list",
    "chunk_bytes",
    "chunk_keys",
    "sequence_keys",
    "decode_chunk",
    "encode_chunk",
    "encode_chunk_views",
    "find_server_binary",
    "load_cache",
    "model_digest",
    "model_identity",
    "open_store",
    "parse_key",
    "read_metadata",
    "safe_url",
    "salt_digest",
    "save_cache",
    "scan_pattern",
    "start_local_cluster",
    "start_local_server",
]
