"""Control caches: zeros, or noise with the mapped cache's RMS per row and head (real columns only)."""

import pytest
import torch
from transformers import DynamicCache

from hf_kvbridge.controls import control_cache, controls_flag


def _cache(batch=2, heads=2, seq=6, dim=4, layers=2):
    generator = torch.Generator().manual_seed(123)  # not the control's own seed 0, whose noise it would equal
    cache = DynamicCache()
    for layer in range(layers):
        keys = (
            torch.randn(batch, heads, seq, dim, generator=generator)
            * (layer + 1)
            * torch.arange(1, heads + 1)[None, :, None, None]
        )
        cache.update(keys, 3 * torch.randn(batch, heads, seq, dim, generator=generator), layer)
    return cache


def _rms(tensor, real):
    real = real[:, None, :, None].float()
    return ((tensor.pow(2) * real).sum((2, 3)) / (real.sum((2, 3)) * tensor.shape[-1])).sqrt()  # (B, H)


def test_zero_cache_is_all_zeros_of_the_same_shape():
    cache = _cache()
    shapes = [layer.keys.shape for layer in cache.layers]
    control_cache(cache, "zero_cache")
    assert [layer.keys.shape for layer in cache.layers] == shapes
    assert all(not layer.keys.any() and not layer.values.any() for layer in cache.layers)


def test_random_cache_matches_the_rms_of_the_real_columns_and_is_seeded():
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0  # left padding in row 1
    cache, before = _cache(), _cache()
    control_cache(cache, "random_cache", mask)
    for layer, original in zip(cache.layers, before.layers):
        for name in ("keys", "values"):
            got, want = getattr(layer, name), getattr(original, name)
            torch.testing.assert_close(_rms(got, mask), _rms(want, mask))
            assert not got[1, :, :2].any()  # padding columns stay zero
            cosine = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
            assert abs(float(cosine)) < 0.3  # no information about the original
    again = control_cache(_cache(), "random_cache", mask)
    assert torch.equal(again.layers[0].keys, cache.layers[0].keys)
    other = control_cache(_cache(), "random_cache", mask, seed=1)
    assert not torch.equal(other.layers[0].keys, cache.layers[0].keys)
    with pytest.raises(ValueError, match="control mode must be one of"):
        control_cache(_cache(), "bridge")


def test_controls_flag():
    assert controls_flag(0.8, {"zero_cache": 0.69, "random_cache": 0.1}) is False
    assert controls_flag(0.8, {"zero_cache": 0.71, "random_cache": 0.1}) is True
    assert controls_flag(-2.0, {"zero_cache": -1.5}) is True  # a bridge worse than a control
    assert controls_flag(float("nan"), {"zero_cache": 0.1}) is None
    assert controls_flag(0.8, {"zero_cache": None}) is None
