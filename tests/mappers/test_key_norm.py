"""Mapped keys put back on the target's key-norm sphere (`config.key_norm`, `hf_kvbridge.utils.key_norm`)."""

import json

import pytest
import torch
from safetensors import safe_open

import hf_kvbridge
from hf_kvbridge import KVBridgeForCausalLM
from hf_kvbridge.errors import ConfigurationError, MapperError, MapperFileError
from hf_kvbridge.utils.cache import output_cache
from hf_kvbridge.utils.key_norm import key_norm_gains, normalized_keys, project_keys, with_key_norm
from hf_kvbridge.utils.rope import apply_rotary, inverse_cos_sin, rotary_cos_sin
from tests.conftest import VOCAB, llama, qwen3
from tests.test_identity import _bridge, _check_logits_and_tokens


def _with_gains(model, seed: int):
    """`model` with random positive key-norm weights (a fresh Qwen3's are ones, which would hide a wrong gain)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.self_attn.k_norm.weight
            weight.copy_(0.5 + torch.rand(weight.shape, generator=generator))
    return model


def _content_keys(model, cache):
    """Each layer's keys `(B, H, T, d)` with the model's rotary embedding stripped."""
    keys = [layer.keys for layer in cache.layers]
    positions = torch.arange(keys[0].shape[2])[None].expand(keys[0].shape[0], -1)
    inverse = inverse_cos_sin(*rotary_cos_sin(model, positions))
    return [apply_rotary(k.float(), *inverse) for k in keys]


def _rms(keys, gain):
    return (keys / gain).square().mean(-1).sqrt()  # (B, H, T)


def test_the_gains_are_read_off_each_layers_key_norm():
    model = _with_gains(qwen3(layers=3), seed=0)
    gains = key_norm_gains(model)
    want = torch.stack([layer.self_attn.k_norm.weight for layer in model.model.layers])
    torch.testing.assert_close(gains, want, atol=1e-6, rtol=1e-6)
    assert key_norm_gains(llama()) is None  # no key norm


def test_the_targets_own_keys_lie_on_the_sphere_and_stay_there():
    model = _with_gains(qwen3(layers=2), seed=1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    gains = key_norm_gains(model)
    keys = _content_keys(model, cache)
    # `rms(k / g)² = m / (m + eps)` for the unnormalised key's mean square m: 1 within 1e-4 for a random model's small
    # activations (m of a few 1e-3, eps 1e-6)
    for layer, gain in zip(keys, gains):
        torch.testing.assert_close(_rms(layer, gain), torch.ones(layer.shape[:-1]), atol=3e-4, rtol=0)
    stacked = torch.stack(keys)  # (L, B, H, T, d)
    torch.testing.assert_close(project_keys(stacked.clone(), gains), stacked, atol=3e-4, rtol=3e-4)
    torch.testing.assert_close(normalized_keys(keys[0], gains[0]), keys[0], atol=3e-4, rtol=3e-4)


def test_the_identity_pair_with_key_norm_reproduces_the_target(windows):
    model = _with_gains(qwen3(layers=3), seed=2)
    bridge = with_key_norm(_bridge(model, model, windows, top_k=2), key_norm_gains(model))
    assert bridge.config.key_norm and bridge.mapper.key_norm_gain is not None
    _check_logits_and_tokens(bridge, model)


@pytest.mark.parametrize("schedule", ["chunked", "layers"])
def test_mapped_keys_land_on_the_sphere_in_both_schedules(windows, schedule):
    source, target = qwen3(layers=2, seed=3), _with_gains(qwen3(layers=3, hidden=48, seed=4), seed=5)
    plain = _bridge(source, target, windows, top_k=2, ridge_lambda=1.0)  # a strong ridge: keys well off the sphere
    gains = key_norm_gains(target)
    ids = torch.randint(0, VOCAB, (2, 30), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        source_cache = output_cache(source(ids, use_cache=True))
    off = plain.map_cache(source_cache, schedule=schedule)
    off_keys = _content_keys(target, off)
    assert min(float(_rms(k, g).min()) for k, g in zip(off_keys, gains)) < 0.9  # the plain map shrinks keys
    normed = with_key_norm(_bridge(source, target, windows, top_k=2, ridge_lambda=1.0), gains)
    on = normed.map_cache(source_cache, schedule=schedule)
    for t, (key_off, key_on, gain) in enumerate(zip(off_keys, _content_keys(target, on), gains)):
        torch.testing.assert_close(_rms(key_on, gain), torch.ones(key_on.shape[:-1]), atol=1e-4, rtol=0)
        # the same direction as the plain map's key, only its length changed
        torch.testing.assert_close(key_on, key_off / _rms(key_off, gain)[..., None], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(on.layers[t].values, off.layers[t].values)


def test_the_checkpoint_keeps_the_gains(windows, tmp_path):
    source, target = qwen3(layers=2, seed=3), _with_gains(qwen3(layers=3, hidden=48, seed=4), seed=5)
    bridge = with_key_norm(_bridge(source, target, windows, top_k=2), key_norm_gains(target))
    bridge.save_pretrained(tmp_path / "bridge")
    config = json.loads((tmp_path / "bridge" / "config.json").read_text())
    assert config["key_norm"] is True and config["format_version"] == 3  # older readers refuse it
    with safe_open(str(tmp_path / "bridge" / "mapper.safetensors"), framework="pt") as handle:
        torch.testing.assert_close(handle.get_tensor("key_norm_gain"), key_norm_gains(target))
    card = (tmp_path / "bridge" / "README.md").read_text()
    assert "| mapped keys put back on the target's key-norm sphere (`key_norm`) | yes |" in card
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        source_cache = output_cache(source(ids, use_cache=True))
    want = bridge.map_cache(source_cache)
    for lazy in (False, True):
        loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "bridge", source, target, lazy_mapper=lazy)
        assert loaded.config.key_norm
        got = loaded.map_cache(source_cache)
        for ref, layer in zip(want.layers, got.layers):
            torch.testing.assert_close(layer.keys, ref.keys, atol=3e-4, rtol=1e-3)  # lazy: other products
    # a bridge without it stays format 1 and stores no gains
    plain = _bridge(source, target, windows, top_k=2)
    plain.save_pretrained(tmp_path / "plain")
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["format_version"] == 1
    with safe_open(str(tmp_path / "plain" / "mapper.safetensors"), framework="pt") as handle:
        assert "key_norm_gain" not in handle.keys()
    assert "(`key_norm`) | no |" in (tmp_path / "plain" / "README.md").read_text()
    assert KVBridgeForCausalLM.from_pretrained(tmp_path / "plain", source, target).mapper.key_norm_gain is None
    # zero gains (keys would be divided by them) are refused on load, with the file named
    bridge.mapper.key_norm_gain.zero_()
    bridge.save_pretrained(tmp_path / "zeroed")
    with pytest.raises(MapperFileError, match="key_norm_gain holds zeros"):
        KVBridgeForCausalLM.from_pretrained(tmp_path / "zeroed", source, target)


def test_calibrate_turns_it_on_where_the_target_has_a_key_norm(tokenizer):
    texts = ["the quick brown fox jumps over the lazy dog " * 30] * 8
    kwargs = {"tokenizer": tokenizer, "num_sequences": 8, "seq_len": 32, "top_k": 1, "ridge_lambda": 0.1}
    qwen = hf_kvbridge.calibrate(qwen3(layers=2, seed=1), qwen3(layers=2, seed=2), texts, **kwargs)
    assert qwen.config.key_norm and qwen.mapper.key_norm_gain.shape == (2, 16)
    off = hf_kvbridge.calibrate(qwen3(layers=2, seed=1), qwen3(layers=2, seed=2), texts, key_norm="off", **kwargs)
    assert not off.config.key_norm and off.mapper.key_norm_gain is None
    plain = hf_kvbridge.calibrate(llama(seed=1), llama(seed=2), texts, **kwargs)  # auto: no key norm to put back
    assert not plain.config.key_norm and plain.mapper.key_norm_gain is None


def test_bad_key_norm_settings_are_refused_before_any_work(tokenizer):
    with pytest.raises(ConfigurationError, match="no self_attn.k_norm"):  # before the (empty) data is read
        hf_kvbridge.calibrate(llama(seed=1), llama(seed=2), [], tokenizer=tokenizer, key_norm="on")
    with pytest.raises(ConfigurationError, match="key_norm must be one of"):
        hf_kvbridge.calibrate(llama(seed=1), llama(seed=2), [], tokenizer=tokenizer, key_norm="yes")
    bridge = _bridge(qwen3(layers=2), qwen3(layers=2), torch.randint(0, VOCAB, (8, 24)), top_k=1)
    with pytest.raises(MapperError, match="key-norm gains must be"):
        bridge.mapper.set_key_norm(torch.ones(3, 16))


def test_half_keys_of_any_length_stay_finite():
    """A zero key stays zero and a very short one is scaled up without overflowing float16 (the scale is float32)."""
    gains = torch.rand(2, 16, generator=torch.Generator().manual_seed(0)) + 0.5
    keys = torch.randn(2, 1, 2, 4, 16, generator=torch.Generator().manual_seed(1)).half()
    keys[0, 0, 0, 0] = 0  # zero
    keys[1, 0, 1, 2] *= 1e-5  # short: its scale is above float16's range
    out = project_keys(keys.clone(), gains)
    assert torch.isfinite(out).all() and torch.equal(out[0, 0, 0, 0], keys[0, 0, 0, 0])
    rms = (out[1, 0, 1, 2].float() / gains[1]).square().mean().sqrt()
    assert abs(float(rms) - 1) < 2e-2


def test_a_refit_keeps_the_gains(tokenizer, tmp_path):
    """`refit` (what `kvbridge tune` and a user's low-rank refit call) maps its keys on the sphere as before, and the
    result saves and loads (config and weights agree)."""
    from hf_kvbridge.fitting.mapper_fits import refit

    texts = ["the quick brown fox jumps over the lazy dog " * 30] * 8
    source, target = qwen3(layers=2, seed=1), _with_gains(qwen3(layers=2, seed=2), seed=3)
    bridge = hf_kvbridge.calibrate(source, target, texts, tokenizer=tokenizer, num_sequences=8, seq_len=32, top_k=1,
                                   ridge_lambda=0.1, keep_statistics=True)  # fmt: skip
    low_rank = refit(bridge, "low_rank", rank=4)
    assert low_rank.config.key_norm
    torch.testing.assert_close(low_rank.mapper.key_norm_gain, key_norm_gains(target))
    low_rank.save_pretrained(tmp_path / "low-rank")
    assert KVBridgeForCausalLM.from_pretrained(tmp_path / "low-rank", source, target).mapper.key_norm_gain is not None
