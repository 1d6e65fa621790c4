"""The mapping engine against a float64 oracle, and the rotations its workspace keeps between mappings."""

import pytest
import torch

from hf_kvbridge.cache import cache_layer_kv, output_cache
from hf_kvbridge.mappers.engine import Workspace, map_cache
from hf_kvbridge.rope import apply_rotary, inverse_cos_sin, rotary_cos_sin
from hf_kvbridge.tools.bench.mapper import random_bridge
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
