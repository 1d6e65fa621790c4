"""`kvbridge bench vllm`'s bridge of random Qwen3-shaped models (`hf_kvbridge.tools.bench.vllm`), without vLLM;
the vLLM runs themselves are tests/integrations/vllm/test_vllm*.py's (in the vLLM venv)."""

from hf_kvbridge.tools.bench import shapes


def test_vllm_bench_random_shapes_bridge_builds(tmp_path, monkeypatch):
    """`kvbridge bench vllm --shapes` builds its bridge from the mapper bench's helpers (it once imported a module
    that did not exist); without vLLM, at a tiny shape: the saved bridge loads back."""
    from hf_kvbridge import KVBridgeForCausalLM
    from hf_kvbridge.tools.bench.vllm import random_shapes_bridge

    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-a", (2, 32, 4, 2, 16, 64))
    monkeypatch.setitem(shapes.QWEN3_SHAPES, "tiny-b", (3, 48, 4, 2, 16, 96))
    bridge_dir = random_shapes_bridge(tmp_path, "tiny-a:tiny-b", top_k=2, max_positions=128)
    bridge = KVBridgeForCausalLM.from_pretrained(bridge_dir)
    assert bridge.source.config.num_hidden_layers == 2 and bridge.target.config.num_hidden_layers == 3
