"""The mapping engine against a float64 oracle, and the rotations its workspace keeps between mappings."""

import pytest
import torch
from transformers import Qwen3Config, StaticCache

from hf_kvbridge.errors import InvalidInputError
from hf_kvbridge.mappers import KVMapper
from hf_kvbridge.mappers.engine import Workspace, map_cache
from hf_kvbridge.mappers.low_rank import LowRankKVMapper
from hf_kvbridge.tools.bench.ops import count_ops
from hf_kvbridge.tools.bench.shapes import random_bridge
from hf_kvbridge.utils.cache import cache_layer_kv, output_cache
from hf_kvbridge.utils.layout import KVLayout
from hf_kvbridge.utils.rope import apply_rotary, inverse_cos_sin, rotary_cos_sin
from tests.conftest import VOCAB, qwen3


@pytest.fixture(scope="module")
def bridge():
    """3 → 4 layers, different RoPE bases (so stripping the source's and applying the target's both matter)."""
    torch.manual_seed(0)
    source, target = qwen3(layers=3, theta=10000.0, seed=1), qwen3(layers=4, hidden=48, theta=500000.0, seed=2)
    bridge = random_bridge(source.config, target.config, top_k=2)
    with torch.no_grad():
        for layer in bridge.mapper.layers:
            layer.bias.normal_()
    return bridge


def _source_cache(bridge, seq=21, batch=2, seed=3):
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return output_cache(bridge.source.model(input_ids=ids, use_cache=True))


def _oracle(bridge, source_cache, positions):
    """The map in float64, layer by layer, from the definitions: strip, concatenate, W x + b, apply."""
    mapper, out = bridge.mapper, []
    cos_s, sin_s = rotary_cos_sin(bridge.source, positions, dtype=torch.float64)
    cos_t, sin_t = rotary_cos_sin(bridge.target, positions, dtype=torch.float64)
    for t, layers in enumerate(mapper.selected_layers):
        rows = []
        for s in layers:
            keys, values = (x.double() for x in cache_layer_kv(source_cache, s))  # (B, H, T, d)
            content = apply_rotary(keys, *inverse_cos_sin(cos_s, sin_s))
            rows.append(torch.stack([content, values], 3).permute(0, 2, 1, 3, 4).flatten(2))  # (B, T, H·2d)
        weight, bias = mapper.layers[t].weight[0].double(), mapper.layers[t].bias[0].double()
        mapped = torch.cat(rows, -1) @ weight + bias  # (B, T, H·2d)
        batch, seq = mapped.shape[:2]
        kv = mapped.view(batch, seq, mapper.target_kv_heads, 2, mapper.target_head_dim).permute(3, 0, 2, 1, 4)
        out.append((apply_rotary(kv[0].contiguous(), cos_t, sin_t), kv[1]))
    return out


def _assert_close_to_oracle(cache, oracle):
    for layer, (keys, values) in zip(cache.layers, oracle):
        for got, want in ((layer.keys, keys), (layer.values, values)):
            scale = want.abs().max().item()
            assert (got.double() - want).abs().max().item() <= 2e-6 * scale * 16  # float32 rounding of a short sum


@torch.no_grad()
def test_mapping_equals_a_float64_oracle_with_kept_rotations(bridge):
    """First call (rotations computed), second call (rotations kept), and new positions (recomputed): each equals
    the float64 map within float32 rounding, and reuse changes no bit."""
    source_cache = _source_cache(bridge)
    positions = torch.arange(21).unsqueeze(0).expand(2, -1)
    workspace = Workspace()
    first = map_cache(
        bridge.source, bridge.target, bridge.mapper, bridge.source_layout, source_cache, workspace=workspace
    )
    again = map_cache(
        bridge.source, bridge.target, bridge.mapper, bridge.source_layout, source_cache, workspace=workspace
    )
    oracle = _oracle(bridge, source_cache, positions)
    _assert_close_to_oracle(first, oracle)
    _assert_close_to_oracle(again, oracle)
    for a, b in zip(first.layers, again.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    shifted = positions + torch.tensor([[5], [40]])  # per-row offsets: a left-padded batch, a later chunk
    moved = map_cache(
        bridge.source, bridge.target, bridge.mapper, bridge.source_layout, source_cache, shifted, workspace=workspace
    )
    _assert_close_to_oracle(moved, _oracle(bridge, source_cache, shifted))


@torch.no_grad()
def test_kept_rotations_follow_the_rotary_modules(bridge):
    """An in-place edit of the target's rotary frequencies is seen by the next mapping: the result equals a
    workspace that keeps nothing, and differs from before the edit."""
    import copy

    target = copy.deepcopy(bridge.target)
    source_cache = _source_cache(bridge, seed=4)
    kept, fresh = Workspace(), Workspace(reuse_rotations=False)

    def run(workspace):
        return map_cache(bridge.source, target, bridge.mapper, bridge.source_layout, source_cache, workspace=workspace)

    before = run(kept)
    target.model.rotary_emb.inv_freq.mul_(0.5)
    after, reference = run(kept), run(fresh)
    for a, b, c in zip(after.layers, reference.layers, before.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert not torch.equal(a.keys, c.keys)
    other = copy.deepcopy(target)  # another module with equal buffers: recomputed (identity is part of the key)
    other.model.rotary_emb.inv_freq.mul_(2.0)
    swapped = map_cache(bridge.source, other, bridge.mapper, bridge.source_layout, source_cache, workspace=kept)
    for a, c in zip(swapped.layers, before.layers):
        assert torch.allclose(a.keys, c.keys, atol=1e-5)


@torch.no_grad()
def test_dynamic_rope_is_never_kept():
    """A rotary whose frequencies transformers updates inside its forward (dynamic NTK) is computed on every call."""
    source = qwen3(layers=2, seed=1)
    dynamic = qwen3(layers=2, seed=1)
    dynamic.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    dynamic.model.rotary_emb.rope_type = "dynamic"
    workspace = Workspace()
    positions = torch.arange(9).unsqueeze(0)
    workspace.rotations(source, dynamic, positions)
    assert not any(key[0] == "rotations" for space in workspace._per_thread.values() for key in space)
    workspace.rotations(source, source, positions)
    assert any(key[0] == "rotations" for space in workspace._per_thread.values() for key in space)


# -- the two schedules ----------------------------------------------------------------------------------------------
def _random_mapper(cls, selected, source, target, head_mode, kv_mode="joint", seed=0, **kwargs):
    """A mapper of `cls` for `source` → `target` with random weights and biases."""
    src, tgt = (KVLayout.from_config(m.config) for m in (source, target))
    heads = {} if (src.num_kv_heads, src.head_dim) == (tgt.num_kv_heads, tgt.head_dim) else {
        "target_kv_heads": tgt.num_kv_heads, "target_head_dim": tgt.head_dim}  # fmt: skip
    mapper = cls(selected, src.num_kv_heads, src.head_dim, head_mode, kv_mode=kv_mode, **kwargs, **heads)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in mapper.parameters():
            shape = parameter.shape
            scale = shape[1] ** -0.5 if parameter.dim() == 3 else 1.0
            parameter.copy_(torch.randn(shape, generator=generator) * scale)
    return mapper


def _both_schedules(source, target, mapper, cache, positions=None, **kwargs):
    layout = KVLayout.from_config(source.config)
    return [
        map_cache(source, target, mapper, layout, cache, positions, schedule=schedule, **kwargs)
        for schedule in ("chunked", "layers")
    ]


def _assert_same_maps(a, b, rtol=2e-6):
    for x, y in zip(a.layers, b.layers):
        for got, want in ((y.keys, x.keys), (y.values, x.values)):
            assert got.shape == want.shape and got.dtype == want.dtype
            assert (got.double() - want.double()).norm() <= rtol * want.double().norm()


# selections with layers read in a non-ascending order, sets shared by several target layers, layers not side by
# side in the rows (3 between 1 and 4 is read by another step), and repeated sets in another order
SELECTED = [[2, 0], [0, 2], [1, 4], [4, 1], [3, 2], [1, 3, 4]]


@pytest.mark.parametrize(
    "head_mode, kv_mode, source_heads, target_heads",
    [
        ("all_heads", "joint", 2, 2),
        ("all_heads", "separate", 2, 2),
        ("same_head", "joint", 2, 2),
        ("same_head", "separate", 2, 2),
        ("same_head", "joint", 2, 4),  # a source head read by two target heads (copied within the rows)
        ("same_head", "joint", 4, 2),  # two source heads per target head
        ("all_heads", "joint", 4, 2),
    ],
)
@torch.no_grad()
def test_layer_schedule_equals_the_chunked_one(head_mode, kv_mode, source_heads, target_heads):
    """Every head mode, kv mode and head layout: the "layers" schedule maps what the (oracle-checked) chunked one
    does, within float32 rounding, for a left-padded batch (per-row positions), whole and in chunks."""
    source = qwen3(layers=5, kv_heads=source_heads, theta=10000.0, seed=1)
    target = qwen3(layers=6, hidden=48, kv_heads=target_heads, theta=500000.0, seed=2)
    mapper = _random_mapper(KVMapper, SELECTED, source, target, head_mode, kv_mode)
    ids = torch.randint(0, VOCAB, (2, 19), generator=torch.Generator().manual_seed(5))
    cache = output_cache(source.model(input_ids=ids, use_cache=True))
    positions = torch.arange(19).unsqueeze(0).expand(2, -1) + torch.tensor([[0], [7]])
    chunked, layers = _both_schedules(source, target, mapper, cache, positions)
    _assert_same_maps(chunked, layers)
    mapper.max_layer_chunk_bytes = 5 * 19 * mapper.slot_features * 4  # about a quarter of the tokens per chunk
    _, in_chunks = _both_schedules(source, target, mapper, cache, positions)
    _assert_same_maps(chunked, in_chunks)


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
@torch.no_grad()
def test_layer_schedule_of_mappers_with_their_own_product(head_mode):
    """A low-rank mapper (its own stacked product) and a bfloat16 copy of a float32 mapper over float32 caches: the
    two schedules agree (bfloat16: within its rounding)."""
    source, target = qwen3(layers=5, seed=1), qwen3(layers=6, hidden=48, theta=500000.0, seed=2)
    ids = torch.randint(0, VOCAB, (1, 23), generator=torch.Generator().manual_seed(6))
    cache = output_cache(source.model(input_ids=ids, use_cache=True))
    low_rank = _random_mapper(LowRankKVMapper, SELECTED, source, target, head_mode, rank=5)
    _assert_same_maps(*_both_schedules(source, target, low_rank, cache))
    half = _random_mapper(KVMapper, SELECTED, source, target, head_mode).to(torch.bfloat16)
    _assert_same_maps(*_both_schedules(source, target, half, cache), rtol=2e-2)


@torch.no_grad()
def test_layer_schedule_equals_the_float64_oracle(bridge):
    """The "layers" schedule against the map computed in float64 from its definition."""
    source_cache = _source_cache(bridge)
    positions = torch.arange(21).unsqueeze(0).expand(2, -1) + torch.tensor([[3], [0]])
    mapped = map_cache(
        bridge.source, bridge.target, bridge.mapper, bridge.source_layout, source_cache, positions, schedule="layers"
    )
    _assert_close_to_oracle(mapped, _oracle(bridge, source_cache, positions))


@torch.no_grad()
def test_layer_schedule_writes_a_static_cache_in_place(bridge):
    """A `StaticCache` is filled where it lies: the same tensors hold the mapped keys and values, its length
    advances, and its contents equal the dynamic mapping; a cache too short is refused before any work."""
    source_cache = _source_cache(bridge, seq=13, batch=1, seed=7)
    static = StaticCache(config=bridge.target.config, max_cache_len=20)
    dynamic = bridge.map_cache(source_cache, schedule="layers")
    mapped = bridge.map_cache(source_cache, target_cache=static, schedule="layers")
    assert mapped is static and int(static.get_seq_length()) == 13
    pointers = [layer.keys.data_ptr() for layer in static.layers]
    for layer, want in zip(static.layers, dynamic.layers):
        assert torch.equal(layer.keys[:, :, :13], want.keys) and torch.equal(layer.values[:, :, :13], want.values)
    with pytest.raises(InvalidInputError, match="max_cache_len"):
        bridge.map_cache(source_cache, target_cache=static, schedule="layers")  # 13 more do not fit in 20
    assert [layer.keys.data_ptr() for layer in static.layers] == pointers and int(static.get_seq_length()) == 13


def _wide_pair(layers_source=40, layers_target=64):
    """Configs of Qwen3-14B → 32B layer counts with a small KV layout (what the engine dispatches depends on the
    layers and the plan, not on the widths)."""
    source = Qwen3Config(**{**SMALL, "num_hidden_layers": layers_source})
    target = Qwen3Config(**{**SMALL, "num_hidden_layers": layers_target, "rope_parameters": ROPE_TARGET})
    return source, target


SMALL = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB,
         "intermediate_size": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
ROPE_TARGET = {"rope_type": "default", "rope_theta": 500000.0}


@pytest.mark.parametrize("head_mode, rank, key_norm",
                         [("all_heads", None, False), ("same_head", None, False), ("all_heads", 8, False),
                          ("all_heads", None, True)])  # fmt: skip
@torch.no_grad()
def test_layer_schedule_dispatches_a_few_ops_per_target_layer_at_any_length(head_mode, rank, key_norm):
    """Counted with the bench's `OpCounter` at Qwen3-14B → 32B layer counts, top-6: at most 12 ops per target layer
    (views included) and at most 3 that run kernels, the same at 16 and 160 tokens and whether the whole sequence
    or chunks of it fit at once. (The chunked schedule grows with the length: its chunks are cache-sized.)"""
    bridge = random_bridge(*_wide_pair(), top_k=6, head_mode=head_mode, rank=rank)
    if key_norm:  # keys put back on a key-norm sphere: a few ops for all layers, not a few per layer
        bridge.mapper.set_key_norm(torch.rand(len(bridge.mapper.selected_layers), bridge.mapper.target_head_dim) + 0.5)
    counts = {}
    for length in (16, 160):
        ids = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(length))
        cache = output_cache(bridge.source.model(input_ids=ids, use_cache=True))
        bridge.map_cache(cache, schedule="layers")  # the kept rotations and workspace, as in use
        counts[length] = count_ops(lambda: bridge.map_cache(cache, schedule="layers"))  # noqa: B023
        if head_mode == "all_heads" and rank is None:
            bridge.mapper.max_chunk_bytes, bridge.mapper.min_chunk_rows = 2**18, 16
            counts[f"chunked {length}"] = count_ops(lambda: bridge.map_cache(cache, schedule="chunked")).total  # noqa: B023
            del bridge.mapper.max_chunk_bytes, bridge.mapper.min_chunk_rows  # the class's again
    assert counts[16].ops == counts[160].ops
    assert counts[16].total <= 12 * 64, counts[16].as_dict()
    assert counts[16].compute_ops <= 3 * 64, counts[16].as_dict()
    if head_mode == "all_heads" and rank is None:
        assert counts["chunked 160"] > counts["chunked 16"]
