"""A tensor-parallel source engine's export (`integrations.vllm.export`), without an engine: the real pocket-s cache
of a prompt laid into each rank's paged cache (the FlashAttention-style `(2, blocks, block_size, heads, d)` layout,
shuffled blocks), each rank's share read and packed, the gather simulated (every rank's buffer to rank 0), and rank 0
writing to a real redis-server. The oracle is the TP 1 export: the same entries, the same K/V read back.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from hf_kvbridge import pocket  # noqa: E402
from hf_kvbridge.integrations.kv_store import PrefixKVStore, load_cache, open_store, start_local_server  # noqa: E402
from hf_kvbridge.integrations.vllm.export import (  # noqa: E402
    ShardGeometry,
    assemble,
    export_sharded,
    head_owners,
    pack,
    unpack,
)
from hf_kvbridge.integrations.vllm.metadata import ExportTask  # noqa: E402
from hf_kvbridge.integrations.vllm.tensor_parallel import HeadShard  # noqa: E402

BLOCK, CHUNK, TOKENS = 16, 32, 75  # 2 whole chunks of 32 and a partial one of 11


@pytest.fixture(scope="module")
def source_kv():
    """pocket-s's own cache of a 75-token prompt: (layers, 2, T, H, d), and the prompt."""
    from transformers import AutoTokenizer

    from hf_kvbridge.loading import load_model

    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-s"))
    ids = tokenizer("\n".join(pocket.load_texts("heldout")[:8]))["input_ids"][:TOKENS]
    model = load_model("pocket/pocket-s", dtype=torch.float32)
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    kv = torch.stack([torch.stack((layer.keys[0], layer.values[0])).transpose(1, 2) for layer in cache.layers])
    return ids, kv  # (L, 2, T, H, d)


@pytest.fixture(scope="module")
def server():
    with start_local_server(maxmemory="64mb") as server:
        yield server


def _store(server, name):
    return PrefixKVStore(open_store(server.url), model_id=f"export-test-{name}", chunk_size=CHUNK)


def _rank_layers(kv, shard: HeadShard, block_ids, broken=False):
    """Rank `shard.rank`'s attention layers: its heads of `kv` at the slots of `block_ids` in a paged cache of the
    `(2, blocks, block_size, h, d)` layout (`broken`: a layout `read_slots` does not know, so its reads fail)."""
    layers_, _, tokens, _, dim = kv.shape
    heads = kv[:, :, :, shard.heads]  # (L, 2, T, h, d)
    layers = []
    for layer in heads:
        cache = torch.full((2, max(block_ids) + 2, BLOCK, heads.shape[3], dim), float("nan"))
        for t in range(tokens):
            cache[:, block_ids[t // BLOCK], t % BLOCK] = layer[:, t]
        if broken:
            cache = cache.flatten(0, 1)
        layers.append(SimpleNamespace(kv_cache=cache, num_kv_heads=heads.shape[3], head_size=dim, impl=object()))
    return layers


def _export(kv, ids, size, store, broken_rank=None):
    """Runs `export_sharded` on every rank of `size` (rank 0 last: the simulated gather hands it every rank's
    buffer); returns the buffers, one a rank, and rank 0's counts."""
    block_ids = [5, 2, 7, 0, 3]  # shuffled
    task = ExportTask(req_id="r", token_ids=ids, start=0, end=len(ids), block_ids=block_ids, tail=True)
    buffers, counts = {}, []

    def gather_of(rank):
        def gather(flat, n):
            buffers[rank] = flat.clone()
            return [buffers[r] for r in range(n)] if rank == 0 else None

        return gather

    for rank in reversed(range(size)):
        shard = HeadShard.of(kv.shape[3], rank, size)
        layers = _rank_layers(kv, shard, block_ids, broken=rank == broken_rank)
        export_sharded([task], layers, block_size=BLOCK, exports=store, shard=shard,
                       count=lambda **c: counts.append(c), gather=gather_of(rank))  # fmt: skip
    return buffers, counts


@pytest.mark.parametrize("size", [1, 2, 4])  # pocket-s has 2 KV heads: one a rank at TP 2, replicated at TP 4
def test_tensor_parallel_export_equals_the_tp1_export(source_kv, server, size):
    ids, kv = source_kv
    reference = _store(server, "ref")
    reference.save(ids, [layer[0].transpose(0, 1) for layer in kv], [layer[1].transpose(0, 1) for layer in kv],
                   start=0, tail=True)  # fmt: skip  # what a TP 1 engine writes
    store = _store(server, f"tp{size}")
    buffers, counts = _export(kv, ids, size, store)
    assert len({b.numel() for b in buffers.values()}) == 1  # every rank sends as many elements: the gather matches
    assert counts == [{"chunks_exported": 2, "partials_exported": 1, "tokens_exported": TOKENS}]
    assert store.stored_tokens(ids) == reference.stored_tokens(ids) == TOKENS
    got = load_cache(store, ids, TOKENS, dtype=torch.float32)
    want = load_cache(reference, ids, TOKENS, dtype=torch.float32)
    for mine, theirs, layer in zip(got.layers, want.layers, kv, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        assert torch.equal(mine.keys[0], layer[0].transpose(0, 1))  # the source's own keys, every head
    # the same store entries, byte for byte but their model ids (of the same length)
    for mine, theirs in zip(store.keys(ids), reference.keys(ids), strict=True):
        (payload,), (want,) = store.store.get_many([mine]), reference.store.get_many([theirs])
        assert payload.replace(f"export-test-tp{size}".encode(), b"export-test-ref") == want


def test_a_rank_that_cannot_read_makes_rank_0_write_nothing(source_kv, server):
    ids, kv = source_kv
    store = _store(server, "broken")
    buffers, counts = _export(kv, ids, 2, store, broken_rank=1)
    assert buffers[1][0] == 0.0 and buffers[0][0] == 1.0  # rank 1's marker, rank 0's status
    assert buffers[0].numel() == buffers[1].numel()  # the failed rank took part in the gather all the same
    assert counts == [{"export_errors": 1}]
    assert store.stored_tokens(ids) == 0


OWNERS = [(8, 4, [0, 1, 2, 3]), (2, 4, [0, 2]), (1, 2, [0]), (4, 8, [0, 2, 4, 6])]  # KV heads, ranks, owners


@pytest.mark.parametrize("total, size, owners", OWNERS)
def test_each_head_is_taken_once_from_its_first_replica(total, size, owners):
    assert head_owners(total, size) == owners
    full = torch.randn(3, 2, 5, total, 4)  # (L, 2, T, H, d)
    shares = [full[:, :, :, HeadShard.of(total, rank, size).heads] for rank in range(size)]
    assert torch.equal(assemble(shares, total), full)


def test_pack_and_unpack_round_trip_with_a_failed_task():
    geometry = ShardGeometry(layers=2, heads=1, head_dim=4, dtype=torch.bfloat16)
    first = torch.randn(geometry.shape(3)).to(torch.bfloat16)
    flat = pack([first, None], [3, 5], geometry)
    assert flat.numel() == 2 + geometry.numel(3) + geometry.numel(5)  # known from the lengths alone
    got_first, got_second = unpack(flat, [3, 5], geometry)
    assert torch.equal(got_first, first) and got_second is None


def test_the_tp1_export_reads_into_pooled_buffers_the_writer_gives_back(source_kv, server):
    """`export_local` (a TP 1 engine's step): the step reads into a `StagingPool` buffer; once the writer has
    written a step's tasks the buffer goes back, and the next step reads into it (no fresh pages); the entries are
    what the TP 1 library save writes, read back equal to the source's own K/V."""
    from hf_kvbridge.integrations.kv_store import AsyncWriter
    from hf_kvbridge.integrations.kv_store.staging import StagingPool
    from hf_kvbridge.integrations.vllm.export import export_local

    ids, kv = source_kv
    block_ids = [5, 2, 7, 0, 3]
    layers = _rank_layers(kv, HeadShard.of(kv.shape[3], 0, 1), block_ids)
    pool, counts = StagingPool(), []
    base = _store(server, "local")
    store = PrefixKVStore(base.store, model_id=base.model_id, chunk_size=CHUNK, writer=AsyncWriter(base.store))
    steps = [  # two tasks in one step (one lease, two users), then a step of one task
        [ExportTask(req_id="a", token_ids=ids, start=0, end=2 * CHUNK, block_ids=block_ids, tail=False),
         ExportTask(req_id="b", token_ids=ids[:50], start=0, end=50, block_ids=block_ids, tail=True)],
        [ExportTask(req_id="a", token_ids=ids, start=2 * CHUNK, end=TOKENS, block_ids=block_ids, tail=True)],
    ]  # fmt: skip
    buffers = []
    for tasks in steps:
        export_local(tasks, layers, block_size=BLOCK, exports=store, count=lambda **c: counts.append(c), pool=pool)
        assert store.writer.flush(timeout=60)
        buffers.append(pool._free[-1].data_ptr())  # given back once both tasks were written
    assert pool.allocated == 1 and buffers[0] == buffers[1] and pool.free_bytes > 0
    assert [c.get("export_errors", 0) for c in counts] == [0, 0, 0]
    assert store.stored_tokens(ids) == TOKENS
    got = load_cache(store, ids, TOKENS, dtype=torch.float32)
    for mine, layer in zip(got.layers, kv, strict=True):  # (1, H, T, d) against (2, T, H, d)
        assert torch.equal(mine.keys[0], layer[0].transpose(0, 1)) and torch.equal(
            mine.values[0], layer[1].transpose(0, 1)
        )
    store.writer.close()


@pytest.mark.parametrize("shard", [HeadShard(total=0), HeadShard.of(2, rank=0, size=2)])
def test_the_export_buffer_bounds_the_reserve_and_a_step_that_does_not_fit_is_named(shard, monkeypatch):
    """`export_buffer_mb` is the writer's queue limit and the staging pool's: a TP 1 CPU source reserves a step's
    export within it, and an exporting engine whose whole step's export (every rank's heads) does not fit says so at
    start-up, with the MiB to set; one that fits says nothing."""
    from hf_kvbridge.integrations.vllm import worker as worker_module

    warnings = []
    monkeypatch.setattr(worker_module.logger, "warning", lambda message, *args: warnings.append(message % args))
    # 4 layers of the (2, blocks, block_size, heads, d) layout: this rank's 1 of 2 heads (TP 2) or both (TP 1)
    heads = 1 if shard.sharded else 2
    caches = {f"layer.{i}": torch.zeros(2, 8, BLOCK, heads, 64) for i in range(4)}
    whole = 4 * 2 * 2 * 64 * 4  # bytes a token: every layer's K and V of both heads, float32

    def start(limit_mb, step_tokens):
        writer = SimpleNamespace(max_pending_bytes=limit_mb << 20)
        worker = worker_module.BridgeWorker(None, block_size=BLOCK, gate_threshold=None, count=lambda **_: None,
                                            exports=SimpleNamespace(writer=writer), shard=shard)  # fmt: skip
        warnings.clear()
        return worker.register_kv_caches(caches, step_tokens), list(warnings)

    reserved, said = start(8, 2048)  # 2048 tokens × 4 KiB = 8 MiB: fits exactly
    assert said == [] and reserved == (0 if shard.sharded else 8 << 20)
    reserved, said = start(4, 2048)  # 8 MiB of a step in 4 MiB: the reserve capped, and a warning naming 8
    assert reserved == (0 if shard.sharded else 4 << 20)
    assert len(said) == 1 and f"2048 tokens × {whole} bytes = 8 MiB" in said[0], said
    assert "export_buffer_mb (4 MiB)" in said[0] and "'export_buffer_mb'] to at least 8" in said[0], said
