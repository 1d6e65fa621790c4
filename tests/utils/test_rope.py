"""RoPE factoring agrees with transformers' own `apply_rotary_pos_emb`, for every rotary type we support."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from hf_kvbridge.utils.rope import Rotation, apply_rotary, rotary_cos_sin, rotate_kv, strip_rotary
from tests.conftest import llama, qwen3

ROOT = Path(__file__).resolve().parents[2]

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


# -- the fused rotation -----------------------------------------------------------------------------------------------
def _rotation_case(dtype, seed=0):
    """A rotation at left-padded positions (Qwen3's own rotary), keys and values in strided layouts, and outputs
    poisoned with NaN (so an element the op does not write shows)."""
    gen = torch.Generator().manual_seed(seed)
    model = qwen3(layers=1)
    rotation = Rotation(*rotary_cos_sin(model, _positions(2, 37, offset=5, gen=gen)))
    keys = torch.randn(2, 37, 2, 16, generator=gen).to(dtype).transpose(1, 2)  # (B, H, T, d), heads not outermost
    values = torch.randn(3, 2, 2, 37, 16, generator=gen).to(dtype)  # three layers at once
    key_out = torch.full((2, 2, 37, 32), float("nan"), dtype=dtype)[..., 8:24]  # a view with a row stride of 32
    value_out = torch.full((3, 2, 37, 2, 16), float("nan"), dtype=dtype).transpose(2, 3)
    return rotation, keys, values, key_out, value_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotation_equals_the_eager_one(dtype):
    """`rotate_kv` (one op for many layers) writes what `Rotation.__call__` computes and copies the values, into
    strided views, for 4-D and 5-D (several layers) inputs."""
    rotation, keys, values, key_out, value_out = _rotation_case(dtype)
    five = torch.stack([keys, 2 * keys, -keys])  # (3, B, H, T, d)
    five_out = torch.full_like(five, float("nan"))
    rotate_kv([keys, five], [], rotation.half_tables, [key_out, five_out], [])
    rotate_kv([], [values], rotation.half_tables, [], [value_out])
    assert torch.equal(key_out, rotation(keys)) and torch.equal(five_out, torch.stack([rotation(k) for k in five]))
    assert torch.equal(value_out, values)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_rotation_equals_the_eager_one(dtype, tmp_path):
    """The CUDA kernel (`hf_kvbridge.utils.rope_triton`), run on CPU tensors by Triton's interpreter
    (`TRITON_INTERPRET=1`,
    in a fresh process: the variable is read at import): every output element written, float32 within 1e-6 of the
    eager rotation relative to its norm, bfloat16 within one rounding (the kernel rounds once, the eager path
    twice), values copied exactly; on fresh random inputs of several shapes (head dim 16 and 12, not a power of 2)."""
    pytest.importorskip("triton")
    script = tmp_path / "check.py"
    script.write_text(
        f"""
import torch
from hf_kvbridge.utils.rope import Rotation
from hf_kvbridge.utils.rope_triton import rotate_kv
from tests.utils.test_rope import _rotation_case

dtype = torch.{dtype}
for seed in range(3):
    rotation, keys, values, key_out, value_out = _rotation_case(dtype, seed)
    rotate_kv([keys], [values[0]], *rotation.half_tables, [key_out], [value_out[0]])
    want = rotation(keys.float())  # in float32, then compared
    assert not key_out.isnan().any() and not value_out[0].isnan().any()
    assert torch.equal(value_out[0], values[0])
    error = ((key_out.float() - want).norm() / want.norm()).item()
    limit = 1e-6 if dtype == torch.float32 else 2 ** -8
    assert error <= limit, (seed, error)
    if dtype == torch.bfloat16:  # each element within one bfloat16 rounding of the float32 result
        assert ((key_out.float() - want).abs() <= want.abs() * 2 ** -8 + 1e-30).all()
# many layers of one layout in one launch (the engine's strip: bfloat16 cache layers into float32 row slots)
rotation, keys, values, _, _ = _rotation_case(dtype, 9)
layers_k = [keys * (i + 1) for i in range(3)]
layers_v = [values[i] for i in range(3)]
slots = torch.full((3, 2, 37, 2, 2, 16), float("nan")).permute(0, 1, 3, 2, 4, 5)  # (L, B, H, T, 2, d)
key_slots, value_slots = list(slots[..., 0, :].unbind(0)), list(slots[..., 1, :].unbind(0))
rotate_kv(layers_k, layers_v, *rotation.half_tables, key_slots, value_slots)
assert not slots.isnan().any()
for i in range(3):
    want = rotation(layers_k[i].float())
    assert ((slots[i, ..., 0, :] - want).norm() / want.norm()).item() <= 1e-6
    assert torch.equal(slots[i, ..., 1, :], layers_v[i].float())
# head dim 12: halves of 6, masked in a block of 8
cos, sin = torch.randn(1, 5, 6), torch.randn(1, 5, 6)
keys = torch.randn(1, 3, 5, 12, dtype=dtype)
out = torch.full_like(keys, float("nan"))
rotate_kv([keys], [], cos, sin, [out], [])
rotation = Rotation(torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
assert ((out.float() - rotation(keys.float())).norm() / rotation(keys.float()).norm()).item() <= 2 ** -8
print("ok")
"""
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
