"""Partial recompute (sink tokens, hold-back) and the quality gate."""

import pytest
import torch

from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.utils.cache import slice_cache
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
    cache, source_out = bridge.prefill(ids, mask)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    own = bridge.target(ids, attention_mask=mask, position_ids=positions, use_cache=True).cache
    # the rest (tokens 5-11: after the longest row's sinks) is exactly the mapper's output for those tokens
    mapped = bridge.map_cache(slice_cache(source_out.cache, 5, 12), positions[:, 5:])
    assert cache.get_seq_length() == 12
    for layer, ref, want in zip(cache.layers, own.layers, mapped.layers):
        torch.testing.assert_close(layer.keys[0, :, :3], ref.keys[0, :, :3])  # row 0: tokens 0-2
        torch.testing.assert_close(layer.values[1, :, 2:5], ref.values[1, :, 2:5])  # row 1: tokens 2-4
        torch.testing.assert_close(layer.keys[:, :, 5:], want.keys)
        torch.testing.assert_close(layer.values[:, :, 5:], want.values)
        assert not torch.allclose(want.keys[0], ref.keys[0, :, 5:], atol=1e-3)  # and that is not the target's own
    assert bridge.last_transfer == {
        "transferred": True,
        "rows_transferred": [True, True],
        "mapped_tokens": 7,
        "target_tokens": 5,
        "recomputed_tokens": 0,
        "score": None,
        "scores": None,
        "gate": None,
        "recomputed_layers": 0,
    }


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


def test_gate_decides_per_row(windows):
    """One bad row falls back alone; the good row keeps its mapped cache (the gate used to average the batch)."""
    model = qwen3(layers=2)
    train, heldout = collect_statistics(model, model, windows, heldout=[0, 1, 2, 3])
    bridge = fit_bridge(model, model, train, heldout, top_k=2, ridge_lambda=1e-9)
    bridge.config.gate_threshold, bridge.config.gate_probe_tokens = 0.99, 4
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    real_map = bridge.map_cache

    def map_with_a_bad_row(source_cache, position_ids=None, target_cache=None):
        start = 0 if target_cache is None else target_cache.get_seq_length()
        cache = real_map(source_cache, position_ids, target_cache)
        for layer in cache.layers:  # row 1's mapped K/V scrambled (tokens already in the cache are not touched)
            layer.keys[1, :, start:] = torch.randn_like(layer.keys[1, :, start:])
        return cache

    bridge.map_cache = map_with_a_bad_row
    cache, _ = bridge.prefill(ids)
    decision = bridge.last_transfer
    assert decision["rows_transferred"] == [True, False] and not decision["transferred"]
    assert decision["scores"][0] > 0.999 and decision["scores"][1] < 0.9 and decision["score"] == decision["scores"][1]
    own = model(ids, use_cache=True).cache
    for layer, ref in zip(cache.layers, own.layers):
        torch.testing.assert_close(layer.keys[1], ref.keys[1])  # row 1: the target's own prefill
        torch.testing.assert_close(layer.values[1], ref.values[1])
        torch.testing.assert_close(layer.keys[0], ref.keys[0], atol=2e-4, rtol=1e-4)  # row 0: mapped (≈ own)
    assert bridge.transfer_counts == {"transferred": 1, "fallback": 1}


def test_gate_records_that_it_was_skipped_when_sinks_cover_the_prompt(pair, caplog):
    bridge = _bridge(pair, sink_tokens=10, gate_threshold=0.99, gate_probe_tokens=4)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with caplog.at_level("INFO", logger="hf_kvbridge.transfer"):
        cache, _ = bridge.prefill(ids)
    assert bridge.last_transfer["gate"] == "skipped" and "quality gate skipped" in caplog.text
    assert bridge.last_transfer["mapped_tokens"] == 0 and bridge.last_transfer["target_tokens"] == 12
    own = bridge.target(ids, use_cache=True).cache
    for layer, ref in zip(cache.layers, own.layers):  # nothing mapped: the target's own cache
        torch.testing.assert_close(layer.keys, ref.keys)
    bridge = _bridge(pair, sink_tokens=2, gate_threshold=0.0, gate_probe_tokens=4)
    bridge.prefill(ids)
    assert bridge.last_transfer["gate"] == "checked" and bridge.last_transfer["mapped_tokens"] == 6
