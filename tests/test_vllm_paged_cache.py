"""`read_slots` against the CPU attention backend's own cache write (no engine): every kernel vLLM can pick here
(`vec`, `vec16`; `amx` where the CPU has AMX tiles) in float32, bfloat16 and float16, written through the backend's
`do_kv_cache_update` at scattered slots of several blocks and read back exactly; an fp8 cache is refused, never read
as numbers. The block layout is probed through the backend's op, so a kernel whose order is not the portable one
(here: a stand-in that pairs dimensions as AMX's VNNI tiles do) is read as it wrote, and one that loses values is
refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl  # noqa: E402

from hf_kvbridge.integrations.vllm.paged_cache import read_slots, reads_back, slots_of  # noqa: E402

BLOCKS, HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 32


def cpu_layer(isa: str, dtype: torch.dtype, kv_cache_dtype: str = "auto", impl_class=CPUAttentionBackendImpl):
    impl = impl_class.__new__(impl_class)  # what do_kv_cache_update reads (__init__ wants a running engine's config)
    impl.attn_type, impl.kv_cache_dtype = AttentionType.DECODER, kv_cache_dtype
    cache_dtype = torch.uint8 if kv_cache_dtype.startswith("fp8") else dtype
    kv_cache = torch.zeros(BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM, dtype=cache_dtype)
    return SimpleNamespace(kv_cache=kv_cache, impl=impl, isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)


def kernels():
    out = ["vec", "vec16"]
    if torch.cpu._is_amx_tile_supported():
        out.append("amx")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("isa", kernels())
def test_read_slots_reads_the_backends_own_write(isa, dtype):
    layer = cpu_layer(isa, dtype)
    slots = slots_of([4, 0, 5, 2], BLOCK, 7, 110)  # (103,) across four blocks, starting mid-block
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(len(slots), HEADS, HEAD_DIM, generator=generator).to(dtype)  # (T, H, d)
    values = torch.randn(len(slots), HEADS, HEAD_DIM, generator=generator).to(dtype)
    layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)
    got_keys, got_values = read_slots(layer, slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
    assert reads_back(layer, slots, keys, values)
    assert not reads_back(layer, slots, values, keys)  # the check can fail


class PairedDims(CPUAttentionBackendImpl):
    """A stand-in kernel with its own block order (as AMX's VNNI tiles: dimension pairs of two tokens side by side,
    values first): the probe must find it from the op alone."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        num_blocks, heads, block_size, width = kv_cache.shape
        d = width // 2
        pages = kv_cache.view(num_blocks, heads, 2, block_size // 2, d // 2, 2, 2)  # side, token pair, dim pair
        for t, slot in enumerate(slot_mapping.tolist()):
            block, offset = divmod(slot, block_size)
            for side, tensor in ((1, key), (0, value)):  # values first
                pairs = tensor[t].view(heads, d // 2, 2)  # (H, d/2, 2)
                pages[block, :, side, offset // 2, :, offset % 2, :] = pairs


class LosesValues(CPUAttentionBackendImpl):
    """A stand-in kernel that drops the last dimension: no permutation of a block's keys and values."""

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        key, value = key.clone(), value.clone()
        key[..., -1] = 0
        super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_kernel_with_its_own_order_is_probed_not_assumed(dtype):
    layer = cpu_layer("paired", dtype, impl_class=PairedDims)
    slots = slots_of([3, 1], BLOCK, 5, 60)
    keys = torch.randn(len(slots), HEADS, HEAD_DIM).to(dtype)
    values = torch.randn(len(slots), HEADS, HEAD_DIM).to(dtype)
    layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)
    got_keys, got_values = read_slots(layer, slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


def test_a_layout_that_is_not_a_permutation_is_refused():
    layer = cpu_layer("vec", torch.float32, impl_class=LosesValues)
    with pytest.raises(NotImplementedError, match="not a permutation"):
        read_slots(layer, slots_of([0], BLOCK, 0, 4))
    assert not reads_back(layer, slots_of([0], BLOCK, 0, 4), torch.zeros(4, HEADS, HEAD_DIM), torch.zeros(4, 2, 64))


def test_fp8_cache_codes_are_never_read_as_numbers():
    layer = cpu_layer("vec", torch.float32, kv_cache_dtype="fp8")
    with pytest.raises(NotImplementedError, match="quantized codes"):
        read_slots(layer, slots_of([0], BLOCK, 0, 4))
