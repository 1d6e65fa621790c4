"""The fp8 rotation study's rotation: orthogonal, and the rotated fp8 round trip returns the K/V within fp8's error."""

import pytest
import torch

from studies.fp8_rotation_study import hadamard, rotated_roundtrip


def test_the_hadamard_matrix_is_orthogonal_and_refuses_other_sizes():
    h = hadamard(32)
    assert torch.allclose(h @ h.T, torch.eye(32), atol=1e-6)
    assert torch.equal(h.abs(), torch.full((32, 32), 32**-0.5))  # every entry ±1/√n
    with pytest.raises(ValueError, match="power of two"):
        hadamard(24)


def test_the_rotated_round_trip_keeps_the_kv_within_fp8s_error_and_is_quantized():
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 100, 32, generator=gen)  # (batch, kv_heads, seq, head_dim)
    kv[..., 3] *= 20  # an outlier channel
    back = rotated_roundtrip(kv, chunk_size=64)
    assert back.shape == kv.shape and back.dtype == kv.dtype
    assert (back - kv).norm() / kv.norm() < 0.05 and not torch.equal(back, kv)
