"""Runtime helpers below the bridge, the mappers and the transfers: the target's cache storage, RoPE, head and KV
layouts, masks, devices, precision, tokenization, byte sizes and the source's extra features. They import nothing of
the package above them but `errors` and `constants` (and each other).

| module | holds |
|---|---|
| `cache` | the one owner of transformers cache layers' storage: every write, crop and read of a layer's K/V |
| `rope`, `rope_triton` | rotary embeddings: strip, apply, re-rotate (a Triton kernel on CUDA) |
| `heads` | head layouts, same-head sources, map groups |
| `layout` | `KVLayout`: a model's KV layout (layers, heads, head dim, RoPE) and its fingerprint |
| `masks` | attention masks and positions of mapped spans |
| `devices` | decoder layers, devices of a model, transfers between them |
| `precision` | dtypes a mapper computes in |
| `tokenization` | the shared-tokenizer check |
| `sizes` | byte sizes as people write them (standard library only) |
| `source_features` | the source's hidden states as extra mapper inputs |
"""
