"""A bridge loaded and used inside `torch.inference_mode()`, as in a vLLM worker: its parameters are then inference
tensors, which have no version counter, so the stacked-weight cache must not read one."""

import torch

import hf_kvbridge
from hf_kvbridge import KVBridgeForCausalLM
from hf_kvbridge.mappers import engine as mapping
from tests.conftest import CORPUS, VOCAB


def test_bridge_loads_and_maps_inside_inference_mode(saved_pair, tmp_path):
    bridge = hf_kvbridge.calibrate(
        saved_pair["small"], saved_pair["large"], CORPUS, num_sequences=16, seq_len=32, top_k=2, batch_size=4
    )
    bridge.save_pretrained(tmp_path / "bridge")
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(11))
    want_tokens = bridge.generate(ids, max_new_tokens=6, do_sample=False)
    want_cache = bridge.prefill(ids)[0]
    with torch.inference_mode():
        loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "bridge")
        assert all(p.is_inference() for p in loaded.mapper.parameters())
        assert any(len(targets) > 1 for _, targets in mapping.mapping_steps(loaded.mapper))  # a stacked step runs
        got_tokens = loaded.generate(ids, max_new_tokens=6, do_sample=False)
        got_cache = loaded.prefill(ids)[0]
        last = len(got_cache.layers) - 1
        loaded.mapper.layers[last].bias.add_(1.0)  # an in-place edit inside inference mode is still seen
        edited = loaded.prefill(ids)[0]
    assert torch.equal(got_tokens, want_tokens)
    for a, b in zip(got_cache.layers, want_cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(a.values, b.values, atol=1e-6, rtol=1e-6)
    assert not torch.equal(edited.layers[last].values, got_cache.layers[last].values)
