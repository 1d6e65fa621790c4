"""RoPE factoring agrees with transformers' own `apply_rotary_pos_emb`, for every rotary type we support."""

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from hf_kvbridge.rope import apply_rotary, rotary_cos_sin, strip_rotary
from tests.conftest import llama, qwen3

ROPE_TYPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def _model(arch: str, rope: dict):
    if arch == "qwen3":
        model = qwen3(layers=1)
    else:
        model = llama(layers=1)
    config = model.config
    config.rope_parameters = dict(rope)
    rotary_cls = Qwen3RotaryEmbedding if arch == "qwen3" else LlamaRotaryEmbedding
    model.model.rotary_emb = rotary_cls(config=config)
    return model


def _positions(batch: int, seq: int, offset: int, gen: torch.Generator) -> torch.Tensor:
    """Per-row positions of a left-padded batch (pads at 0), shifted by `offset`."""
    pads = torch.randint(0, seq // 2, (batch,), generator=gen)
    mask = (torch.arange(seq)[None, :] >= pads[:, None]).long()
    return (mask.cumsum(-1) - 1).clamp_min(0) + offset * mask


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("rope_name", list(ROPE_TYPES))
def test_strip_then_reapply_matches_transformers(arch, rope_name):
    gen = torch.Generator().manual_seed(0)
    model = _model(arch, ROPE_TYPES[rope_name])
    batch, heads, seq, dim = 3, 2, 10, 16
    keys = torch.randn(batch, heads, seq, dim, generator=gen)
    pos_p = _positions(batch, seq, offset=0, gen=gen)
    pos_q = _positions(batch, seq, offset=90, gen=gen)  # beyond original_max_position_embeddings for yarn/llama3
    cos_p, sin_p = rotary_cos_sin(model, pos_p)
    cos_q, sin_q = rotary_cos_sin(model, pos_q)
    # cached keys, rotated by transformers itself at p
    _, rotated_p = apply_rotary_pos_emb(keys, keys, cos_p, sin_p)
    content = strip_rotary(rotated_p, cos_p, sin_p)
    torch.testing.assert_close(content, keys, atol=1e-5, rtol=1e-5)  # strip ∘ apply = identity
    _, expected_q = apply_rotary_pos_emb(keys, keys, cos_q, sin_q)
    torch.testing.assert_close(apply_rotary(content, cos_q, sin_q), expected_q, atol=1e-5, rtol=1e-5)


def test_cos_sin_are_the_models_own():
    """YaRN scales cos/sin by attention_scaling ≠ 1: our cos/sin must be exactly what the model computes."""
    model = _model("qwen3", ROPE_TYPES["yarn"])
    rotary = model.model.rotary_emb
    assert rotary.attention_scaling != 1.0
    pos = torch.arange(20).unsqueeze(0)
    cos, sin = rotary_cos_sin(model, pos)
    ref_cos, ref_sin = rotary(torch.zeros(1, dtype=torch.float32), pos)
    torch.testing.assert_close(cos, ref_cos)
    torch.testing.assert_close(sin, ref_sin)


def test_different_theta_is_not_a_round_trip():
    """Stripping with one model and applying another's θ differs from the source rotation (the test can fail)."""
    a, b = qwen3(layers=1, theta=10000.0), qwen3(layers=1, theta=500.0)
    pos = torch.arange(12).unsqueeze(0)
    keys = torch.randn(1, 2, 12, 16)
    cos_a, sin_a = rotary_cos_sin(a, pos)
    cos_b, sin_b = rotary_cos_sin(b, pos)
    assert not torch.allclose(apply_rotary(keys, cos_a, sin_a), apply_rotary(keys, cos_b, sin_b), atol=1e-3)
