"""The store's put path without copies: a save's chunks are the header and views into the saved K/V
(`ChunkEncoder`, `ChunkPayload`), checksummed in one pass and sent as they are (`SetPipeline`, `send_parts`); the bytes
are version 3's as written before; on a real local redis."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import torch

from hf_kvbridge import MissingDependencyError
from hf_kvbridge.errors import StoreFormatError
from hf_kvbridge.integrations.kv_store import PrefixKVStore, RedisKVStore, decode_chunk, start_local_server
from hf_kvbridge.integrations.kv_store.format import ChunkEncoder, ChunkPayload, encode_chunk_views
from hf_kvbridge.integrations.kv_store.wire import SetPipeline, send_parts
from hf_kvbridge.integrations.kv_store.writer import AsyncWriter

DATA = Path(__file__).resolve().parents[2] / "data"
MODEL = "org/source@abc123"


@pytest.fixture(scope="module")
def server():
    try:
        server = start_local_server(maxmemory="64mb")
    except MissingDependencyError as err:  # fail, never skip: the store is part of what CI tests
        pytest.fail(f"{err}; e.g. `apt-get install -y redis-server` (the KV store tests need a real server)")
    yield server
    server.stop()


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    return tensor.view(torch.uint8).numpy()


def _shares(part, tensors: list[torch.Tensor]) -> bool:
    return any(np.shares_memory(np.asarray(part), _bytes(t)) for t in tensors)


def test_the_bytes_are_version_3_as_written_before_the_views():
    """`store_chunk_v3.safetensors` was written by the copying encoder (one payload, the tensors gathered into it)
    before this change, from these inputs: the views write the same bytes, so every reader reads them."""
    cache = torch.arange(2 * 3 * 40 * 8, dtype=torch.float32).reshape(2, 3, 40, 8).div(97).sin()  # (layers, H, T, d)
    keys = [cache[layer].bfloat16()[:, 8:24] for layer in range(2)]  # (3, 16, 8) slices of a longer cache
    values = [cache[layer].bfloat16().flip(1)[:, 8:24].contiguous() for layer in range(2)]
    golden = (DATA / "store_chunk_v3.safetensors").read_bytes()
    payload = encode_chunk_views(keys, values, model_id="pocket-s", start=256, token_ids=range(100, 116))
    assert isinstance(payload, ChunkPayload) and len(payload) == len(golden) and bytes(payload) == golden
    got_k, got_v = decode_chunk(golden, model_id="pocket-s", start=256, token_ids=range(100, 116))
    assert all(torch.equal(a, b) for a, b in zip(got_k + got_v, keys + values, strict=True))


def test_a_chunk_is_the_header_and_views_into_the_saved_tensors():
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(4, 96, 128, generator=gen).bfloat16() for _ in range(3)]  # (H, T, d): 64 tokens a head: 16 KB
    values = [torch.randn(4, 96, 128, generator=gen).bfloat16() for _ in range(3)]
    encoder = ChunkEncoder(keys, values, model_id=MODEL)
    whole = encoder.encode(0, 96, start=0, token_ids=range(96))  # contiguous tensors: one view each
    assert len(whole.parts) == 2 + 6 and all(_shares(part, keys + values) for part in whole.parts[2:])
    chunk = encoder.encode(32, 96, start=32, token_ids=range(32, 96))  # a slice: one view per KV head
    assert len(chunk.parts) == 2 + 6 * 4 and all(_shares(part, keys + values) for part in chunk.parts[2:])
    assert not any(_shares(part, keys + values) for part in chunk.parts[:2])  # the header, the token ids
    got_k, got_v = decode_chunk(bytes(chunk), model_id=MODEL, start=32, token_ids=range(32, 96))
    assert all(torch.equal(a, b[:, 32:]) for a, b in zip(got_k + got_v, keys + values, strict=True))
    short = encoder.encode(32, 48, start=32, token_ids=range(32, 48))  # 4 KB heads: gathered, one copy a tensor
    assert len(short.parts) == 2 + 6 and not any(_shares(part, keys + values) for part in short.parts)
    assert decode_chunk(bytes(short), model_id=MODEL)[1][2].equal(values[2][:, 32:48])
    for encoding in ("bfloat16", "fp8_e4m3"):  # other encodings: computed, then sent from their own tensors
        wide = [k.float() for k in keys]
        payload = ChunkEncoder(wide, wide, model_id=MODEL, encoding=encoding).encode(
            0, 64, start=0, token_ids=range(64)
        )
        got = decode_chunk(bytes(payload), model_id=MODEL)[0][1].float()
        assert torch.allclose(got, wide[1][:, :64], rtol=0.07, atol=0.02) and got.dtype == torch.float32


def test_the_checksum_catches_a_tensor_changed_after_encoding_and_a_flipped_byte():
    keys = [torch.randn(2, 32, 128).bfloat16()]
    values = [torch.randn(2, 32, 128).bfloat16()]
    payload = encode_chunk_views(keys, values, model_id=MODEL, start=0, token_ids=range(32))
    good = bytes(payload)
    flipped = bytearray(good)
    flipped[-100] ^= 1  # one bit of the last values
    with pytest.raises(StoreFormatError, match="checksum"):
        decode_chunk(bytes(flipped), model_id=MODEL)
    values[0][1, 5, 7] += 1  # changed under the views before they were sent: a miss, never a wrong cache
    with pytest.raises(StoreFormatError, match="checksum"):
        decode_chunk(bytes(payload), model_id=MODEL)
    assert decode_chunk(good, model_id=MODEL)[0][0].equal(keys[0])


def test_send_parts_sends_every_byte_in_order_through_partial_sends():
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender.settimeout(30)  # as the redis client's sockets: non-blocking inside, so a sendmsg sends what fits
    received = bytearray()

    def read():
        while chunk := receiver.recv(1 << 16):
            received.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    data = np.random.default_rng(0).integers(0, 256, size=3_000_000, dtype=np.uint8)
    parts = [b"head", data[:100_000], b"", data[100_000:100_007], data[100_007:], memoryview(b"tail"), *([b"x"] * 900)]
    send_parts(sender, parts)
    sender.close()
    reader.join(timeout=30)
    receiver.close()
    assert bytes(received) == b"".join(parts)


def test_set_pipeline_writes_each_value_from_its_parts_and_reads_every_reply(server):
    client = redis.Redis.from_url(server.url)
    try:
        keys = [torch.randn(2, 64, 128).bfloat16()]
        payload = encode_chunk_views(keys, keys, model_id=MODEL, start=0, token_ids=range(64))
        pipe = SetPipeline(client).set("kvbridge-test:put:a", payload, px=60_000).set("kvbridge-test:put:b", b"raw")
        assert len(pipe) == 2 and pipe.execute() == [True, True] and len(pipe) == 0
        assert client.get("kvbridge-test:put:a") == bytes(payload) and client.get("kvbridge-test:put:b") == b"raw"
        assert 0 < client.pttl("kvbridge-test:put:a") <= 60_000 and client.pttl("kvbridge-test:put:b") == -1
        pipe.set("kvbridge-test:put:c", b"bad", px=0).set("kvbridge-test:put:d", b"good")  # PX 0: an error reply
        with pytest.raises(redis.ResponseError, match="expire"):
            pipe.execute()
        assert client.get("kvbridge-test:put:d") == b"good" and client.ping()  # read past it, the connection clean
        client.delete(*(f"kvbridge-test:put:{name}" for name in "abcd"))
    finally:
        client.close()


def test_a_save_hands_the_store_views_of_its_tensors(server):
    store = RedisKVStore(server.url, timeout=2.0)
    sent: list[dict] = []
    put_many = store.put_many
    store.put_many = lambda items, **kw: (sent.append(dict(items)), put_many(items, **kw))[1]
    try:
        prefix = PrefixKVStore(store, model_id=MODEL, chunk_size=64)
        gen = torch.Generator().manual_seed(1)
        keys = [torch.randn(2, 150, 128, generator=gen).bfloat16() for _ in range(2)]  # 2 chunks and a tail
        values = [torch.randn(2, 150, 128, generator=gen).bfloat16() for _ in range(2)]
        ids = list(range(500, 650))
        prefix.save(ids, keys, values, start=0)
        whole = [p for items in sent for key, p in items.items() if len(p) > 64 * 2 * 2 * 2 * 128 * 2]
        assert len(whole) == 2 and all(isinstance(p, ChunkPayload) for p in whole)
        assert all(_shares(part, keys + values) for p in whole for part in p.parts[2:])
        found = prefix.lookup(ids)
        got_k, got_v = prefix.load(ids, found.tokens, stored=found)
        assert found.tokens == 150 and all(
            torch.equal(a, b) for a, b in zip(got_k + got_v, keys + values, strict=True)
        )
        store.delete_many([piece[0] for piece in found.pieces])
    finally:
        store.close()


def test_the_sends_on_the_store_io_threads_count_as_the_writers_cpu_time(server):
    store = RedisKVStore(server.url, timeout=2.0, connections=4)
    try:
        items = {f"kvbridge-test:cpu:{i}": bytes([i]) * (4 << 20) for i in range(8)}  # 4 pipelines on I/O threads
        store.put_many(items)
        assert store.metrics.as_dict()["writer_cpu_seconds"] > 0
        store.delete_many(list(items))
    finally:
        store.close()


@pytest.mark.parametrize("through_writer", [True, False], ids=["async_writer", "caller"])
def test_a_saves_cpu_time_is_counted_once(server, monkeypatch, through_writer):
    """A small save is one write, run inline on the thread that runs the save (the asynchronous writer's, or the
    caller's): its CPU time is counted once, not once by the write and again by the writer thread around it. The
    threads' CPU clock is a fake one that only the store's `put_many` advances, by 1 s on the thread it runs on."""
    clock = threading.local()
    monkeypatch.setattr(time, "thread_time", lambda: getattr(clock, "seconds", 0.0))
    store = RedisKVStore(server.url, timeout=2.0)
    put_many = store.put_many

    def put_many_burning_a_second(items, **kwargs):
        if items:  # the writer also calls it with nothing to write, which returns at once
            clock.seconds = getattr(clock, "seconds", 0.0) + 1.0
        return put_many(items, **kwargs)

    store.put_many = put_many_burning_a_second
    writer = AsyncWriter(store) if through_writer else None
    prefix = PrefixKVStore(store, model_id=MODEL, chunk_size=8, writer=writer)
    ids = list(range(7000, 7016)) if through_writer else list(range(7100, 7116))
    try:
        gen = torch.Generator().manual_seed(3)
        keys = [torch.randn(2, 16, 8, generator=gen) for _ in range(2)]  # 2 small chunks: one write, one pipeline
        prefix.save(ids, keys, [k.flip(1) for k in keys], start=0)
        if writer is not None:
            assert writer.flush(timeout=10)
        assert store.probe(prefix.keys(ids), [])[0][0] > 0  # written
        assert store.metrics.as_dict()["writer_cpu_seconds"] == 1.0
    finally:
        if writer is not None:
            writer.close()
        store.delete_many(prefix.keys(ids))
        store.close()


def test_a_small_write_is_sent_on_the_calling_thread(server):
    store = RedisKVStore(server.url, timeout=2.0, connections=4)
    threads: list[str] = []
    execute = SetPipeline.execute

    def record(pipe):
        threads.append(threading.current_thread().name)
        return execute(pipe)

    SetPipeline.execute = record
    try:
        store.put_many({f"kvbridge-test:small:{i}": bytes(1000) for i in range(8)})  # 8 KB: one pipeline, here
        assert threads == [threading.current_thread().name]
        store.put_many({f"kvbridge-test:large:{i}": bytes(1 << 20) for i in range(8)})  # 8 MB: 4 at once
        assert len(threads) == 5 and all(name.startswith("kvbridge-store-io") for name in threads[1:])
        store.delete_many([f"kvbridge-test:{kind}:{i}" for kind in ("small", "large") for i in range(8)])
    finally:
        SetPipeline.execute = execute
        store.close()


def _saved(prefix, done, ids, tokens=150):
    """`prefix.save` of `tokens` random K/V (2 layers, 2 heads) with `done` counting its calls; returns the chunks."""
    gen = torch.Generator().manual_seed(tokens)
    keys = [torch.randn(2, tokens, 16, generator=gen) for _ in range(2)]
    return prefix.save(ids[:tokens], keys, keys, start=0, done=done)


def test_a_saves_done_is_called_once_whatever_becomes_of_it(server):
    """`done` (what gives a staging buffer back): once after the writes (on the writer thread with one), once at
    once when the writer drops the save, once when the save is refused, and never before the tensors are read."""
    from hf_kvbridge.integrations.kv_store import AsyncWriter

    calls: list[str] = []
    store = RedisKVStore(server.url, timeout=2.0)
    ids = list(range(700, 850))
    try:
        prefix = PrefixKVStore(store, model_id=MODEL, chunk_size=64)
        assert _saved(prefix, lambda: calls.append(threading.current_thread().name), ids) == 2  # no writer: here
        assert calls == [threading.current_thread().name]
        writer = AsyncWriter(store, max_pending_bytes=1)  # one job at a time: a second one queued beside it drops
        prefix = PrefixKVStore(store, model_id=MODEL, chunk_size=64, writer=writer)
        gate = threading.Event()
        writer.submit_job(gate.wait, nbytes=1)  # the writer is busy until the gate opens
        calls.clear()
        assert _saved(prefix, lambda: calls.append("dropped"), ids) == 0 and calls == ["dropped"]
        gate.set()
        assert writer.flush(timeout=30)
        calls.clear()
        assert _saved(prefix, lambda: calls.append(threading.current_thread().name), ids[1:] + [0]) == 2
        assert writer.flush(timeout=30) and calls == ["kvbridge-store-writer"]
        calls.clear()
        with pytest.raises(ValueError, match="start must be a multiple"):
            prefix.save(ids, [torch.zeros(2, 10, 16)], [torch.zeros(2, 10, 16)], start=3, done=lambda: calls.append(1))
        assert calls == [1]
        writer.close()
    finally:
        store.close()


def test_the_staging_pool_reuses_buffers_given_back_and_keeps_at_most_its_limit():
    from hf_kvbridge.integrations.kv_store.staging import StagingPool

    pool = StagingPool(max_bytes=10 << 20, granule=1 << 20)
    first = pool.lease(3 << 20, users=2)
    second = pool.lease(3 << 20, users=1)  # the first is still lent: a new buffer
    assert pool.allocated == 2 and first.buffer.data_ptr() != second.buffer.data_ptr()
    first.release()
    assert pool.free_bytes == 0  # one of its two users still reads it
    first.release()
    again = pool.lease((2 << 20) + 1, users=1)  # fits in the 3 MiB given back: reused, not allocated
    assert pool.allocated == 2 and again.buffer.data_ptr() == first.buffer.data_ptr()
    assert again.buffer.numel() == (2 << 20) + 1
    second.release()
    again.release()
    big = pool.lease(9 << 20, users=1)  # larger than any free buffer
    assert pool.allocated == 3 and pool.free_bytes == 6 << 20
    big.release()  # 15 MiB free would pass the limit: the smallest go first
    assert pool.free_bytes == 9 << 20
    with pytest.raises(ValueError, match="granule > 0"):
        StagingPool(granule=0)


def _resident_bytes() -> int:
    """This process's resident memory (Linux `/proc/self/statm`)."""
    import os
    from pathlib import Path

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_reserved_staging_buffer_is_resident_before_any_lease_and_the_first_lease_reuses_it():
    """`StagingPool.reserve` (what the connector does at start-up): one buffer of a step's size, its pages written
    now (resident before any step), capped at the pool's limit; a step's lease that fits it allocates nothing."""
    from hf_kvbridge.integrations.kv_store.staging import StagingPool

    pool = StagingPool(max_bytes=64 << 20, granule=1 << 20)
    before = _resident_bytes()
    assert pool.reserve((40 << 20) - 5) == 40 << 20  # rounded up to the granule
    assert _resident_bytes() - before >= 36 << 20  # faulted in now, not by the first step's copy
    lease = pool.lease(39 << 20, users=1)
    assert pool.allocated == 0 and lease.buffer.numel() == 39 << 20 and pool.free_bytes == 0
    lease.release()
    assert StagingPool(max_bytes=8 << 20, granule=1 << 20).reserve(100 << 20) == 8 << 20  # at most the limit
    assert StagingPool(max_bytes=0).reserve(1 << 20) == 0 and pool.reserve(0) == 0
