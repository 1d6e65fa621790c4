"""A tensor-parallel target's loads mapped once, on rank 0, and scattered (`integrations.vllm.scatter`), without an
engine: the buffers' helpers, then the worker's `load_sharded` on simulated ranks (the real pocket-s → pocket-l
bridge on rank 0, no bridge on the others, paged caches of the FlashAttention-style `(2, blocks, block_size, heads,
d)` layout, the scatter simulated by handing each rank its buffer). The oracle is the TP 1 worker: each rank's cache
holds its heads of what TP 1 writes, and its mapped probe its heads of TP 1's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from transformers import DynamicCache  # noqa: E402

from hf_kvbridge import calibrate, pocket  # noqa: E402
from hf_kvbridge.integrations.vllm import worker as worker_module  # noqa: E402
from hf_kvbridge.integrations.vllm.export import ShardGeometry, unpack  # noqa: E402
from hf_kvbridge.integrations.vllm.metadata import BridgeLoad  # noqa: E402
from hf_kvbridge.integrations.vllm.scatter import cache_of, rank_buffers, sent_tokens, stack_kv  # noqa: E402
from hf_kvbridge.integrations.vllm.tensor_parallel import HeadShard  # noqa: E402
from hf_kvbridge.utils.cache import append_layer  # noqa: E402

BLOCK = 16


def test_stack_kv_and_cache_of_round_trip():
    cache = DynamicCache()
    for index in range(3):
        append_layer(cache, index, torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 4))  # (1, H, T, d)
    kv = stack_kv(cache)
    assert kv.shape == (3, 2, 7, 2, 4)
    for mine, theirs in zip(cache_of(kv).layers, cache.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


@pytest.mark.parametrize("total, size", [(2, 2), (8, 4), (1, 2), (2, 4)])  # sharded, and replicated heads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_rank_gets_its_heads_of_every_load_and_a_zero_status_for_a_failed_one(total, size, dtype):
    lengths = [5, 3, 9]
    kvs = [torch.randn(2, 2, n, total, 4) for n in lengths]  # (L, 2, T, H, d): every head
    kvs[1] = None  # rank 0 could not map the second load
    geometry = ShardGeometry(layers=2, heads=HeadShard.of(total, 0, size).num_heads(), head_dim=4, dtype=dtype)
    buffers = rank_buffers(kvs, lengths, geometry, total, size)
    numel = len(lengths) + sum(geometry.numel(n) for n in lengths)
    assert [b.numel() for b in buffers] == [numel] * size  # the scatter's one size, known on every rank
    for rank, buffer in enumerate(buffers):
        sent = buffer.view(torch.uint8).view(dtype)  # as scatter_from_first_rank sends it: bytes
        got = unpack(sent, lengths, geometry)
        assert got[1] is None  # every rank sees the failure
        heads = HeadShard.of(total, rank, size).heads
        for mine, kv in zip(got, kvs, strict=True):
            if kv is not None:
                assert torch.equal(mine, kv[:, :, :, heads].to(dtype))


def test_sent_tokens_are_the_mapped_span_then_the_probe():
    gated = BridgeLoad("r", list(range(60)), start=32, end=50, block_ids=[0, 1, 2, 3], probe_start=52, probe_end=60)
    plain = BridgeLoad("s", list(range(60)), start=0, end=59, block_ids=[0, 1, 2, 3], probe_end=59)
    assert sent_tokens(gated) == 18 + 8 and sent_tokens(plain) == 59


# -- the worker on simulated ranks ------------------------------------------------------------------------------
class PagedImpl:
    """A backend's cache-update op on the `(2, blocks, block_size, h, d)` layout."""

    def __init__(self, num_kv_heads):
        self.num_kv_heads = num_kv_heads

    def do_kv_cache_update(self, layer, keys, values, kv_cache, slots):  # keys, values (T, h, d)
        kv_cache[0, slots // BLOCK, slots % BLOCK] = keys
        kv_cache[1, slots // BLOCK, slots % BLOCK] = values


def _layers(num_layers, heads, dim, dtype, blocks=12):
    return {
        f"model.layers.{i}.self_attn.attn": SimpleNamespace(
            kv_cache=torch.zeros(2, blocks, BLOCK, heads, dim, dtype=dtype),
            num_kv_heads=heads,
            head_size=dim,
            impl=PagedImpl(heads),
        )  # fmt: skip
        for i in range(num_layers)
    }


@pytest.fixture(scope="module")
def bridge():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-l"))
    bridge = calibrate(
        "pocket/pocket-s", "pocket/pocket-l", pocket.load_texts("calibration"), num_sequences=8, seq_len=128,
        top_k=2, tokenizer=tokenizer,
    )  # fmt: skip
    ids = tokenizer("\n".join(pocket.load_texts("heldout")[:6]))["input_ids"]
    return bridge, ids


def _loads(ids):
    """A gated load of 70 tokens (62 mapped, 8 probe), one rank 0 cannot map, and a plain load of 45 tokens."""
    return [
        BridgeLoad("gated", ids[:71], start=0, end=62, block_ids=[3, 0, 5, 7, 9], probe_start=62, probe_end=70),
        BridgeLoad("broken", [7, 7, 7, 7] + ids[:40], start=0, end=43, block_ids=[1, 2, 4], probe_end=43),
        BridgeLoad("plain", ids[100:146], start=0, end=45, block_ids=[6, 8, 10], probe_end=45),
    ]


def _run(bridge, ids, shard, monkeypatch, buffers):
    """`load_sharded` on `shard.rank`: rank 0 maps with the bridge and hands out the buffers, another rank gets its
    own. Returns the worker, its layers and its counts."""
    layout = bridge.target_layout
    layers = _layers(layout.num_layers, shard.num_heads(), layout.head_dim, bridge.dtype)
    counts = []
    worker = worker_module.BridgeWorker(
        bridge if shard.rank == 0 else None, block_size=BLOCK, gate_threshold=0.5, count=lambda **c: counts.append(c),
        shard=shard, kv_dtype=bridge.dtype,
    )  # fmt: skip

    def scatter(sent, numel, dtype, device):
        if sent is not None:
            buffers[:] = sent
        assert buffers[shard.rank].numel() == numel
        return buffers[shard.rank]

    monkeypatch.setattr(worker_module, "scatter_from_first_rank", scatter)
    original = worker_module.BridgeWorker.map_and_write

    def map_and_write(self, load, layers):  # rank 0's failure, injected
        if load.req_id == "broken":
            raise RuntimeError("injected mapper failure")
        return original(self, load, layers)

    monkeypatch.setattr(worker_module.BridgeWorker, "map_and_write", map_and_write)
    worker.load_sharded(_loads(ids), layers)
    return worker, layers, counts


@pytest.mark.parametrize("size", [2, 4])  # pocket-l has 2 KV heads: one a rank, replicated on 2 ranks each at TP 4
def test_every_rank_writes_its_heads_of_the_tp1_map(bridge, monkeypatch, size):
    bridge, ids = bridge
    tp1 = worker_module.BridgeWorker(bridge, block_size=BLOCK, gate_threshold=0.5, count=lambda **c: None)
    layout = bridge.target_layout
    full = _layers(layout.num_layers, layout.num_kv_heads, layout.head_dim, bridge.dtype)
    for load in _loads(ids):
        if load.req_id != "broken":
            tp1.map_and_write(load, full)
    want_probe = tp1._gate_checks[0].steps.mapped_probe  # (1, H, 8, d) per layer
    buffers = []
    for rank in range(size):  # rank 0 first: it fills the buffers
        shard = HeadShard.of(layout.num_kv_heads, rank, size)
        worker, layers, counts = _run(bridge, ids, shard, monkeypatch, buffers)
        assert (worker.bridge is None) == (rank != 0) and worker.source_forward_calls == (2 if rank == 0 else 0)
        for name, layer in layers.items():
            assert torch.equal(layer.kv_cache, full[name].kv_cache[..., shard.heads, :]), (rank, name)
        outcomes = worker.build_connector_worker_meta().outcomes
        assert outcomes["plain"]["status"] == "mapped" and outcomes["broken"]["status"] == "fallback"
        assert outcomes["broken"]["start"] == 0  # where the target's recompute began (the prefix cache before it)
        assert "gated" not in outcomes  # decided after the forward pass, by the gate
        reason = "injected mapper failure" if rank == 0 else "tensor-parallel rank 0 could not map this load"
        assert reason in outcomes["broken"]["reason"]
        assert worker._invalid_blocks == {1, 2, 4}  # the broken load's blocks, reported as failed loads
        (check,) = worker._gate_checks  # one check of the one gated load, on every rank: the all-reduce matches
        assert check.layers is not None  # the written cache reads back
        for mine, theirs in zip(check.steps.mapped_probe.layers, want_probe.layers, strict=True):
            assert torch.equal(mine.keys, theirs.keys[:, shard.heads])
            assert torch.equal(mine.values, theirs.values[:, shard.heads])
        if rank:
            assert {"tokens_received": 62} in counts and {"tokens_received": 45} in counts
