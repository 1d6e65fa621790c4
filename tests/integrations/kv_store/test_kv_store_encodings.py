"""The store's data plane: chunk format version 3 (zero-copy decode, XXH3-64), version 2 entries still read, compact
encodings (bfloat16, fp8 with per-head scales) recorded and checked, fetches and writes spread over connections; on a
real local redis."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from hf_kvbridge import MissingDependencyError, ServingConfigError
from hf_kvbridge.errors import InvalidInputError, StoreFormatError
from hf_kvbridge.integrations.kv_store import (
    AsyncWriter,
    PrefixKVStore,
    RedisKVStore,
    decode_chunk,
    encode_chunk,
    open_store,
    read_metadata,
    start_local_server,
)
from hf_kvbridge.integrations.kv_store.encodings import ENCODINGS
from hf_kvbridge.integrations.kv_store.staging import stage_export

DATA = Path(__file__).resolve().parents[2] / "data"
MODEL = "org/source@abc123"


@pytest.fixture(scope="module")
def server():
    try:
        server = start_local_server(maxmemory="256mb")
    except MissingDependencyError as err:  # fail, never skip: the store is part of what CI tests
        pytest.fail(f"{err}; e.g. `apt-get install -y redis-server` (the KV store tests need a real server)")
    yield server
    server.stop()


def _kv(layers: int, heads: int, tokens: int, dim: int, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(heads, tokens, dim, generator=gen).to(dtype) for _ in range(layers)]
    values = [torch.randn(heads, tokens, dim, generator=gen).to(dtype) for _ in range(layers)]
    return keys, values


def test_a_chunk_written_by_version_2_is_still_read():
    """`store_chunk_v2.safetensors` was written by the version-2 encoder (safetensors, CRC-32) before this change."""
    payload = (DATA / "store_chunk_v2.safetensors").read_bytes()
    assert read_metadata(payload)["version"] == "2" and "encoding" not in read_metadata(payload)
    keys, values = decode_chunk(payload, model_id="pocket-s", start=32, token_ids=[11, 12, 13])
    reference = safetensors_load(payload)  # an independent reader of the same bytes
    for layer in range(2):
        assert torch.equal(keys[layer], reference[f"layers.{layer}.keys"])
        assert torch.equal(values[layer], reference[f"layers.{layer}.values"])
    assert keys[1].shape == (1, 5, 4) and keys[0].dtype == torch.bfloat16
    damaged = bytearray(payload)
    damaged[-20] ^= 0x01
    with pytest.raises(StoreFormatError, match="CRC-32"):
        decode_chunk(bytes(damaged), model_id="pocket-s", start=32)


def test_decode_reads_views_into_the_received_payload_and_checks_every_byte():
    keys, values = _kv(3, 2, 16, 8)
    payload = encode_chunk(keys, values, model_id=MODEL, start=0, token_ids=range(16))
    assert safetensors_load(payload)["layers.2.values"].equal(values[2])  # still a safetensors file
    assert read_metadata(payload)["version"] == "3"
    got_keys, got_values = decode_chunk(payload, model_id=MODEL, start=0)
    begin = torch.frombuffer(payload, dtype=torch.uint8).data_ptr()
    for got, want in zip([*got_keys, *got_values], [*keys, *values], strict=True):
        assert torch.equal(got, want)
        assert begin <= got.data_ptr() < begin + len(payload)  # a view, not a copy
    for position in (len(payload) - 1, len(payload) - 8 * 16 - 1):  # the last value byte, a token id byte
        damaged = bytearray(payload)
        damaged[position] ^= 0x01
        with pytest.raises(StoreFormatError, match="checksum"):
            decode_chunk(bytes(damaged), model_id=MODEL, start=0)


def test_each_encoding_is_recorded_read_back_and_takes_its_bytes():
    keys, values = _kv(2, 2, 32, 16, dtype=torch.bfloat16)
    keys[0][0] *= 1e3  # heads of very different magnitudes: one scale for both would flush the small one to zero
    keys[0][1] *= 1e-3
    sizes = {}
    for encoding in ENCODINGS:
        payload = encode_chunk(keys, values, model_id=MODEL, start=64, token_ids=range(32), encoding=encoding)
        metadata = read_metadata(payload)
        assert (metadata["encoding"], metadata["dtype"]) == (encoding, "bfloat16")
        got_keys, got_values = decode_chunk(payload, model_id=MODEL, start=64)
        sizes[encoding] = sum(t.numel() * t.element_size() for t in safetensors_load(payload).values())
        for got, want in zip([*got_keys, *got_values], [*keys, *values], strict=True):
            assert got.dtype == torch.bfloat16 and got.shape == want.shape
            if encoding != "fp8_e4m3":
                assert torch.equal(got, want)
                continue
            for head in range(want.shape[0]):  # e4m3: 3 mantissa bits, per-head scale
                error = (got[head].float() - want[head].float()).norm() / want[head].float().norm()
                assert error < 0.05, (head, error)
    values_bytes = 2 * 2 * 32 * 16  # K and V, per format: layers × heads × tokens × dim
    assert sizes["source"] == sizes["bfloat16"] == 2 * values_bytes * 2 + 8 * 32
    assert sizes["fp8_e4m3"] == 2 * values_bytes + 8 * 32 + 2 * 2 * 2 * 4  # codes, ids, a float32 scale per head
    float32 = [k.float() for k in keys]
    payload = encode_chunk(float32, float32, model_id=MODEL, start=0, token_ids=range(32), encoding="bfloat16")
    assert decode_chunk(payload, model_id=MODEL)[0][0].dtype == torch.bfloat16  # half a float32 source's bytes
    with pytest.raises(InvalidInputError, match="unknown store encoding 'int4'"):
        encode_chunk(keys, values, model_id=MODEL, start=0, token_ids=range(32), encoding="int4")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fp8_codes_are_the_float32_quotients_and_the_source_is_left_as_it_was(dtype):
    """The fp8 encoder's codes are e4m3 of `x / scale` computed in float32 (scale: the head's largest magnitude over
    448), on a strided slice as the store hands it a chunk; it scales a copy, never the caller's tensor (a float32
    source's `.float()` would be the tensor itself)."""
    from hf_kvbridge.integrations.kv_store.encodings import FP8_DTYPE, FP8_MAX, encode_tensor

    full = torch.randn(3, 40, 16, generator=torch.Generator().manual_seed(7)).to(dtype)
    full[1] *= 300  # heads of very different magnitudes; one all zero (its scale is 1)
    full[2] = 0
    chunk = full[:, 8:24]  # (H, 16, d), not contiguous
    before = chunk.clone()
    parts = encode_tensor(chunk, "fp8_e4m3")
    assert torch.equal(chunk, before)
    wide = chunk.float()
    amax = wide.abs().amax(dim=(1, 2))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    want = (wide / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    assert torch.equal(parts["_scale"], scale) and parts["_scale"].dtype == torch.float32
    assert parts[""].dtype == FP8_DTYPE and torch.equal(parts[""].view(torch.uint8), want.view(torch.uint8))


def _save(tensors: dict, metadata: dict) -> bytes:
    """A chunk of these tensors and metadata with a checksum that fits its bytes (what a buggy or other writer could
    store): only the checks of the encoding stand between it and the reader."""
    payload = safetensors_save(tensors, metadata=metadata)
    base = 8 + int.from_bytes(payload[:8], "little")
    return safetensors_save(tensors, metadata={**metadata, "xxh3": xxhash.xxh3_64_hexdigest(payload[base:])})


def _rewrite(payload: bytes, **metadata) -> bytes:
    return _save(safetensors_load(payload), {**read_metadata(payload), **metadata})


def test_an_entry_of_an_unknown_or_inconsistent_encoding_is_refused_with_its_reason():
    keys, values = _kv(2, 2, 8, 8)
    fp8 = encode_chunk(keys, values, model_id=MODEL, start=0, token_ids=range(8), encoding="fp8_e4m3")
    source = encode_chunk(keys, values, model_id=MODEL, start=0, token_ids=range(8))
    cases = [
        (_rewrite(fp8, encoding="cachegen"), "encoding 'cachegen'.*a miss"),
        (_rewrite(source, encoding="fp8_e4m3"), "do not match its 2 layers"),  # no scales
        (_rewrite(fp8, encoding="bfloat16"), "do not match"),  # scales that bfloat16 does not have
        (_rewrite(fp8, dtype="float99"), "names no source dtype"),
    ]
    tensors = safetensors_load(fp8)
    tensors["layers.1.values_scale"] = torch.ones(3)
    cases.append((_save(tensors, read_metadata(fp8)), "one float32 scale per KV head"))
    tensors = safetensors_load(source)
    tensors["layers.0.keys"] = tensors["layers.0.keys"].float()
    cases.append((_save(tensors, {**read_metadata(source), "encoding": "bfloat16"}),
                  "says encoding bfloat16 but layers.0.keys is torch.float32"))  # fmt: skip
    for payload, reason in cases:
        with pytest.raises(StoreFormatError, match=reason):
            decode_chunk(payload, model_id=MODEL, start=0)


def test_a_store_url_chooses_the_encoding_and_connections_and_a_load_joins_mixed_encodings(server):
    url = server.url + ("&" if "?" in server.url else "?") + "encoding=fp8_e4m3&connections=3"
    with open_store(url, timeout=2.0) as store:
        assert (store.encoding, store.connections) == ("fp8_e4m3", 3)
        fp8 = PrefixKVStore(store, model_id=MODEL, chunk_size=16)
        exact = PrefixKVStore(store, model_id=MODEL, chunk_size=16, encoding="source")
        half = PrefixKVStore(store, model_id=MODEL, chunk_size=16, encoding="bfloat16")
        assert (fp8.encoding, exact.encoding) == ("fp8_e4m3", "source")
        ids = list(range(1000, 1048))
        keys, values = _kv(2, 2, 48, 8, dtype=torch.float32)
        half.save(ids, [k[:, :16] for k in keys], [v[:, :16] for v in values], start=0)
        exact.save(ids, [k[:, 16:32] for k in keys], [v[:, 16:32] for v in values], start=16)
        fp8.save(ids, [k[:, 32:] for k in keys], [v[:, 32:] for v in values], start=32)
        entries = store.get_many(fp8.keys(ids))
        assert [read_metadata(p)["encoding"] for p in entries] == ["bfloat16", "source", "fp8_e4m3"]
        for parts in (1, 3):  # chunks of other encodings in one run, and in runs of their own
            got_keys = torch.cat([run.keys[1] for run in fp8.iter_load(ids, 48, parts=parts)], dim=1)
            assert got_keys.dtype == torch.float32 and got_keys.shape == (2, 48, 8)
            assert torch.equal(got_keys[:, :16], keys[1][:, :16].bfloat16().float())
            assert torch.equal(got_keys[:, 16:32], keys[1][:, 16:32])  # the exact chunk, exact
            assert torch.allclose(got_keys[:, 32:], keys[1][:, 32:], rtol=0.07, atol=0.02)
        fp8.store.delete_many(fp8.keys(ids))
    for bad, message in (("encoding=int4", "unknown store encoding 'int4'"), ("connections=0", "connections")):
        with pytest.raises(ServingConfigError, match=message):
            open_store(f"{server.url}?{bad}")


def _slowed_calls(target, name: str, seconds: float, keywords: list | None = None) -> list:
    """Wraps `target.name` to sleep `seconds` first and record each call's thread and start time (and its keywords in
    `keywords`)."""
    calls, original = [], getattr(target, name)

    def call(*args, **kwargs):
        calls.append((threading.get_ident(), time.perf_counter()))
        if keywords is not None:
            keywords.append(kwargs)
        time.sleep(seconds)
        return original(*args, **kwargs)

    setattr(target, name, call)
    return calls


def test_a_fetch_and_a_write_spread_over_the_store_connections(server):
    store = RedisKVStore(server.url, timeout=2.0, connections=4)
    try:
        items = {f"kvbridge-test:spread:{i}": bytes([i]) * (1 << 20) for i in range(8)}  # 8 MB: 4 parts of 2 MB
        sets = _slowed_calls(store._bulk.connection_pool, "get_connection", 0.2)  # a SetPipeline's, each
        began = time.perf_counter()
        store.put_many(items)
        assert len(sets) == 4 and len({thread for thread, _ in sets}) == 4
        assert time.perf_counter() - began < 0.6  # four at once, not 0.8 s one after another
        del store._bulk.connection_pool.get_connection  # the pool's own again
        gets = _slowed_calls(store._bulk, "mget", 0.2)
        began = time.perf_counter()
        assert store.get_many([*items, "kvbridge-test:spread:none"]) == [*items.values(), None]  # in order
        assert len(gets) == 4 and len({thread for thread, _ in gets}) == 4
        assert time.perf_counter() - began < 0.6
        store.delete_many(list(items))
    finally:
        store.close()


def test_the_runs_of_a_load_are_fetched_at_once_and_handed_over_in_token_order(server):
    store = RedisKVStore(server.url, timeout=2.0, connections=4)
    try:
        prefix = PrefixKVStore(store, model_id=MODEL, chunk_size=8)
        ids = list(range(2000, 2032))
        keys, values = _kv(2, 2, 32, 8)
        prefix.save(ids, keys, values, start=0)
        asked: list[dict] = []
        fetches = _slowed_calls(store, "get_many", 0.3, asked)
        began = time.perf_counter()
        found = prefix.lookup(ids)
        runs = list(prefix.iter_load(ids, 32, parts=4, stored=found))
        # four runs share the bandwidth: each one's deadline allows for the bytes of all four in flight
        assert [call["expected_bytes"] for call in asked] == [4 * piece[3] for piece in found.pieces]
        assert [(run.start, run.end) for run in runs] == [(0, 8), (8, 16), (16, 24), (24, 32)]
        assert len(fetches) == 4 and max(t for _, t in fetches) - min(t for _, t in fetches) < 0.25  # all at once
        assert time.perf_counter() - began < 0.9
        got = torch.cat([run.keys[1] for run in runs], dim=1)
        assert torch.equal(got, keys[1])
        store.delete_many(prefix.keys(ids))
    finally:
        store.close()


def test_an_export_is_read_on_the_writer_thread_after_its_staging_and_its_cpu_time_is_counted(server):
    """The step hands strided views over (`stage_export`) and returns at once; the writer thread waits for the staging
    (`ready`), gathers the views into the chunks, and counts its own CPU time."""
    store = RedisKVStore(server.url, timeout=2.0)
    writer = AsyncWriter(store)
    try:
        prefix = PrefixKVStore(store, model_id=MODEL, chunk_size=8, writer=writer)
        ids = list(range(3000, 3016))
        keys, values = _kv(2, 2, 16, 8)
        pages = [k.transpose(0, 1).contiguous() for k in keys]  # (T, H, d): as gathered from a paged cache
        staged = stage_export([p.transpose(0, 1) for p in pages], [p.transpose(0, 1) for p in pages])
        assert not staged.keys[0].is_contiguous() and staged.event is None  # CPU: views, the writer gathers them
        staging_done, readers = threading.Event(), []

        def ready() -> None:
            readers.append(threading.current_thread().name)
            staging_done.wait(5)

        began = time.perf_counter()
        assert prefix.save(ids, staged.keys, staged.values, start=0, ready=ready) == 2
        assert time.perf_counter() - began < 0.5  # the step did not wait for the staging or the store
        time.sleep(0.2)
        assert store.probe(prefix.keys(ids), [])[0] == [0, 0]  # nothing read or written before the staging ends
        staging_done.set()
        assert writer.flush(timeout=10)
        assert readers == ["kvbridge-store-writer"]
        got_keys, got_values = prefix.load(ids, 16)
        assert torch.equal(got_keys[1], keys[1]) and torch.equal(got_values[0], keys[0])
        assert store.metrics.as_dict()["writer_cpu_seconds"] > 0
        store.delete_many(prefix.keys(ids))
    finally:
        writer.close()
        store.close()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_an_fp8_caches_codes_are_dequantized_on_the_writer_thread(server, fp8):
    """An fp8 engine hands its cache's codes and its per-layer scales over (`save(scales=...)`); the writer thread
    dequantizes them (`code * scale`, float32, as the engine's attention reads them) before it encodes: the stored
    K/V equal the step's old dequantized read exactly, keys with keys' scales and values with values'."""
    store = RedisKVStore(server.url, timeout=2.0)
    writer = AsyncWriter(store)
    try:
        prefix = PrefixKVStore(store, model_id=MODEL, chunk_size=8, writer=writer)
        ids = list(range(4000, 4016))
        keys, values = _kv(2, 2, 16, 8, dtype=torch.float32)
        codes_k, codes_v = [(k * 4).to(fp8) for k in keys], [(v * 4).to(fp8) for v in values]
        scales = [(0.05, 0.2), (0.5, 0.125)]
        assert prefix.save(ids, codes_k, codes_v, start=0, scales=scales) == 2
        assert writer.flush(timeout=10)
        got_keys, got_values = prefix.load(ids, 16)
        for layer, (k_scale, v_scale) in enumerate(scales):
            assert got_keys[layer].dtype == torch.float32
            assert torch.equal(got_keys[layer], codes_k[layer].to(torch.float32) * k_scale)
            assert torch.equal(got_values[layer], codes_v[layer].to(torch.float32) * v_scale)
        with pytest.raises(InvalidInputError, match="scale pairs"):
            prefix.save(ids, codes_k, codes_v, start=0, scales=scales[:1])
        store.delete_many(prefix.keys(ids))
    finally:
        writer.close()
        store.close()


def test_an_fp8_engines_e4m3_codes_and_scales_are_stored_as_they_are_in_an_fp8_store(server):
    """A store of encoding fp8_e4m3 keeps an fp8 (e4m3) engine's own codes byte for byte, with the engine's per-layer
    scale as each head's scale: not dequantized and quantized again. e5m2 codes are not e4m3's: dequantized, then
    quantized by the store as any K/V (per-head scales of their own)."""
    store = RedisKVStore(server.url, timeout=2.0)
    try:
        prefix = PrefixKVStore(store, model_id=MODEL, chunk_size=8, encoding="fp8_e4m3")
        keys, values = _kv(2, 2, 16, 8, dtype=torch.float32)
        scales = [(0.0625, 0.25), (0.5, 0.125)]  # float32 numbers, as an engine's (vLLM's are float32 tensors')
        for fp8, seed in ((torch.float8_e4m3fn, 5000), (torch.float8_e5m2, 6000)):
            ids = list(range(seed, seed + 16))
            codes_k, codes_v = [(k * 4).to(fp8) for k in keys], [(v * 4).to(fp8) for v in values]
            assert prefix.save(ids, codes_k, codes_v, start=0, scales=scales) == 2
            payloads = store.get_many(prefix.keys(ids))
            assert all(read_metadata(p)["encoding"] == "fp8_e4m3" for p in payloads)
            assert all(read_metadata(p)["dtype"] == "float32" for p in payloads)
            stored = safetensors_load(payloads[1])  # the second chunk: tokens 8..16, read by another reader
            for layer, (k_scale, v_scale) in enumerate(scales):
                kept = [stored[f"layers.{layer}.{kind}"] for kind in ("keys", "values")]
                head_scales = [stored[f"layers.{layer}.{kind}_scale"] for kind in ("keys", "values")]
                if fp8 == torch.float8_e4m3fn:  # the engine's own codes and scales
                    assert torch.equal(kept[0].view(torch.uint8), codes_k[layer][:, 8:].view(torch.uint8))
                    assert torch.equal(kept[1].view(torch.uint8), codes_v[layer][:, 8:].view(torch.uint8))
                    assert head_scales[0].tolist() == [k_scale] * 2 and head_scales[1].tolist() == [v_scale] * 2
                else:  # quantized by the store: each head's largest magnitude maps to 448
                    assert head_scales[0].tolist() != [k_scale] * 2
            got_keys, got_values = prefix.load(ids, 16)
            for layer, (k_scale, v_scale) in enumerate(scales):
                want_k = codes_k[layer].to(torch.float32) * k_scale
                want_v = codes_v[layer].to(torch.float32) * v_scale
                if fp8 == torch.float8_e4m3fn:  # exactly what the engine's attention reads
                    assert torch.equal(got_keys[layer], want_k) and torch.equal(got_values[layer], want_v)
                else:
                    assert torch.allclose(got_keys[layer], want_k, rtol=0.07, atol=0.02)
            store.delete_many(prefix.keys(ids))
    finally:
        store.close()
