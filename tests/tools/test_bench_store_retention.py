"""What a store encoding costs a bridge (`kvbridge bench store --retention`): the source's K/V encoded and decoded
before the map, against the exact K/V, paired over held-out windows of a real (pocket) pair."""

import pytest
import torch
from transformers import AutoTokenizer

import hf_kvbridge
from hf_kvbridge import pocket
from hf_kvbridge.tools.bench.store_retention import EncodedSource, encoding_retention, roundtrip
from hf_kvbridge.tools.evaluation import heldout_windows, window_nll


@pytest.fixture(scope="module")
def bridge_and_windows():
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-m"))
    bridge = hf_kvbridge.calibrate("pocket/pocket-s", "pocket/pocket-m", pocket.load_texts("calibration"),
                                   tokenizer=tokenizer, num_sequences=2, seq_len=128)  # fmt: skip
    return bridge, heldout_windows(pocket.load_texts("heldout"), tokenizer, 96, 6)


def test_the_roundtrip_is_the_stores_per_chunk_encoding():
    kv = torch.randn(2, 2, 40, 8)  # (B, H, T, d)
    assert torch.equal(roundtrip(kv, "source", 16), kv)
    assert torch.equal(roundtrip(kv, "bfloat16", 16), kv.bfloat16().float())
    kv[0, 1, 20:] *= 1000  # a later chunk of one head much larger: its own scale, the first chunk's kept
    fp8 = roundtrip(kv, "fp8_e4m3", 16)
    assert ((fp8[0, 1, :16] - kv[0, 1, :16]).norm() / kv[0, 1, :16].norm()) < 0.05


def test_encoding_costs_are_paired_and_the_exact_encoding_costs_nothing(bridge_and_windows):
    bridge, windows = bridge_and_windows
    result = encoding_retention(bridge, windows, context_len=64, chunk_size=32, batch_size=6)
    rows = result["encodings"]
    assert rows["source"]["nll_change"] == 0 and rows["source"]["max_window_nll_change"] == 0  # the exact encoding
    assert rows["source"]["retention"] == result["retention"]
    for name in ("bfloat16", "fp8_e4m3"):
        row = rows[name]
        assert row["max_window_nll_change"] > 0  # the encoded K/V did reach the map
        assert row["nll_change_low"] <= row["nll_change"] <= row["nll_change_high"]
        if row["cost"] is not None:  # defined where the windows resolve the target's gain from the context
            assert row["cost_low"] <= row["cost"] <= row["cost_high"]
            assert row["cost"] == pytest.approx(result["retention"] - row["retention"], abs=1e-9)
        else:
            assert "not" in row["cost_reason"]
    assert rows["fp8_e4m3"]["max_window_nll_change"] > rows["bfloat16"]["max_window_nll_change"]
    exact = window_nll(bridge, windows, 64, "bridge", 6)
    with EncodedSource(bridge, "source", 32):
        pass
    assert torch.equal(window_nll(bridge, windows, 64, "bridge", 6), exact)  # the bridge is itself again
