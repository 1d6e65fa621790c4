"""Oracles: with source == target the bridge reproduces the target's own logits, tokens and cache."""

import copy

import pytest
import torch

from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from tests.conftest import VOCAB, llama, qwen3

EXACT = 1e-9  # ridge λ for the oracles: the identity map is then recovered to float precision


def _bridge(source, target, windows, **kw):
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    kw.setdefault("ridge_lambda", EXACT)
    return fit_bridge(source, target, train, heldout, **kw)


def _check_logits_and_tokens(bridge, target, prefill_length=20, seq=26):
    ids = torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(5))
    out = bridge(ids, prefill_length=prefill_length)
    ref = target(ids).logits
    start = prefill_length - bridge.config.hold_back
    torch.testing.assert_close(out.logits[:, start:], ref[:, start:], atol=2e-4, rtol=1e-4)
    assert out.past_key_values.get_seq_length() == seq
    prompt = ids[:, :prefill_length]
    got = bridge.generate(prompt, max_new_tokens=12, do_sample=False)
    want = target.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(got, want)


def test_identity_pair_reproduces_target(windows):
    model = qwen3(layers=3)
    bridge = _bridge(model, model, windows, top_k=2)
    # each target layer's best source layer is itself
    assert [layers[0] for layers in bridge.config.selected_layers] == [0, 1, 2]
    _check_logits_and_tokens(bridge, model)


def test_identity_pair_default_lambda_keeps_greedy_tokens(windows):
    model = qwen3(layers=2)
    bridge = _bridge(model, model, windows, top_k=2, ridge_lambda=0.01)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(9))
    out = bridge(ids)
    ref = model(ids).logits
    assert (out.logits[:, -1] - ref[:, -1]).abs().max() < 0.1
    assert torch.equal(out.logits[:, -1].argmax(-1), ref[:, -1].argmax(-1))


def test_identity_mapped_cache_equals_fresh_target_prefill(windows):
    model = qwen3(layers=2)
    bridge = _bridge(model, model, windows, top_k=2)
    ids = torch.randint(0, VOCAB, (1, 18), generator=torch.Generator().manual_seed(3))
    mapped, _ = bridge.prefill(ids)
    own = model(ids, use_cache=True).cache
    for layer in range(2):
        torch.testing.assert_close(mapped.layers[layer].keys, own.layers[layer].keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mapped.layers[layer].values, own.layers[layer].values, atol=1e-4, rtol=1e-4)


def _theta_copy(model, theta):
    target = copy.deepcopy(model)
    target.config.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    rotary = type(target.model.rotary_emb)(config=target.config)
    target.model.rotary_emb = rotary
    return target


def test_target_with_other_rope_theta(windows):
    """A one-layer copy of the source with another θ: content-space K/V are identical, rotations are not.

    Reading the wrong θ anywhere (e.g. the source's instead of the target's) cancels in a round trip but not here.
    """
    source = qwen3(layers=1, theta=10000.0)
    target = _theta_copy(source, 300.0)
    bridge = _bridge(source, target, windows, top_k=1)
    ids = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    mapped, _ = bridge.prefill(ids)
    own = target(ids, use_cache=True).cache
    torch.testing.assert_close(mapped.layers[0].keys, own.layers[0].keys, atol=1e-4, rtol=1e-4)
    # the source's own rotation really is different, so this test would catch a θ mix-up
    src_keys = source(ids, use_cache=True).cache.layers[0].keys
    assert (src_keys - own.layers[0].keys).abs().max() > 0.1
    _check_logits_and_tokens(bridge, target)


def test_llama_identity(windows):
    model = llama(layers=2)
    bridge = _bridge(model, model, windows, top_k=2)
    _check_logits_and_tokens(bridge, model)


def test_llama_other_theta(windows):
    source = llama(layers=1)
    target = copy.deepcopy(source)
    target.config.rope_parameters = {"rope_type": "default", "rope_theta": 777.0}
    target.model.rotary_emb = type(source.model.rotary_emb)(config=target.config)
    bridge = _bridge(source, target, windows, top_k=1)
    _check_logits_and_tokens(bridge, target)


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_identity_both_head_modes(windows, head_mode):
    model = qwen3(layers=2)
    bridge = _bridge(model, model, windows, top_k=2, head_mode=head_mode)
    _check_logits_and_tokens(bridge, model, prefill_length=12, seq=15)
