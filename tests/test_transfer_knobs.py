"""Partial recompute (sink tokens, hold-back) and the quality gate."""

import pytest
import torch

from hf_kvbridge.calibration import collect_statistics, fit_bridge
from tests.conftest import VOCAB, qwen3


@pytest.fixture(scope="module")
def pair(windows):
    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    stats = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    return source, target, stats


def _bridge(pair, **config):
    source, target, stats = pair
    bridge = fit_bridge(source, target, *stats, top_k=2)
    for key, value in config.items():
        setattr(bridge.config, key, value)
    return bridge


def test_sink_tokens_are_the_targets_own(pair):
    bridge = _bridge(pair, sink_tokens=3)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: the sinks are the first real tokens of each row
    cache, _ = bridge.prefill(ids, mask)
    own = bridge.target(
        ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0), use_cache=True
    ).cache
    assert cache.get_seq_length() == 12
    for layer, ref in zip(cache.layers, own.layers):
        torch.testing.assert_close(layer.keys[0, :, :3], ref.keys[0, :, :3])  # row 0: tokens 0-2
        torch.testing.assert_close(layer.values[1, :, 2:5], ref.values[1, :, 2:5])  # row 1: tokens 2-4
        assert not torch.allclose(layer.keys[0, :, 6:], ref.keys[0, :, 6:], atol=1e-3)  # the rest is mapped
    assert bridge.last_transfer == {"transferred": True, "mapped_tokens": 7, "target_tokens": 5, "score": None}


def test_hold_back_more_tokens(pair):
    bridge = _bridge(pair, hold_back=4)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    out = bridge(ids)
    torch.testing.assert_close(out.logits[:, :8], bridge.source(ids[:, :8]).logits)
    assert bridge.last_transfer["mapped_tokens"] == 8


def test_gate_transfers_a_good_mapping(windows):
    model = qwen3(layers=2)
    train, heldout = collect_statistics(model, model, windows, heldout=[0, 1, 2, 3])
    bridge = fit_bridge(model, model, train, heldout, top_k=2, ridge_lambda=1e-9)
    bridge.config.gate_threshold, bridge.config.gate_probe_tokens = 0.99, 4
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    out = bridge(ids)
    assert bridge.last_transfer["transferred"] and bridge.last_transfer["score"] > 0.999
    assert bridge.last_transfer["mapped_tokens"] == 11 and bridge.last_transfer["target_tokens"] == 4
    torch.testing.assert_close(out.logits[:, 15:], model(ids).logits[:, 15:], atol=2e-4, rtol=1e-4)


def test_gate_falls_back_on_a_bad_mapping(pair):
    bridge = _bridge(pair, gate_threshold=0.9, gate_probe_tokens=4)
    with torch.no_grad():
        for layer in bridge.mapper.layers:  # a broken mapper: scrambled weights
            layer.weight.copy_(torch.randn_like(layer.weight))
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(3))
    out = bridge(ids)
    assert not bridge.last_transfer["transferred"] and bridge.last_transfer["score"] < 0.9
    # the fallback is the target's own prefill: its logits are the target's exactly
    torch.testing.assert_close(out.logits[:, 15:], bridge.target(ids).logits[:, 15:], atol=1e-5, rtol=1e-5)
    got = bridge.generate(ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(got, bridge.target.generate(ids, max_new_tokens=5, do_sample=False))
    assert bridge.transfer_counts == {"fallback": 2}
