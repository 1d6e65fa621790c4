"""`read_slots` against the CPU attention backend's own cache write (no engine): every kernel vLLM can pick here
(`vec`, `vec16`; `amx` where the CPU has AMX tiles) in float32, bfloat16 and float16, written
through the backend's `do_kv_cache_update` at scattered slots of several blocks and read back exactly. An fp8 cache
(e4m3, e5m2) is read as its codes dequantized with the engine's scales: through the real op where the CPU has AVX-512
or AMX (not here: the op cannot write fp8, and nothing is read), and through a stand-in of the `vec` kernel's fp8
write; codes of another format or scale sense are refused. The block layout is probed through the backend's op, so
a kernel whose order is not the portable one (here: a stand-in that pairs dimensions as AMX's VNNI tiles do) is read
as it wrote, and one that loses values is refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl  # noqa: E402

from hf_kvbridge.integrations.vllm.paged_cache import quantize, read_slots, reads_back, slots_of  # noqa: E402

BLOCKS, HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 32


def cpu_layer(isa: str, dtype: torch.dtype, kv_cache_dtype: str = "auto", impl_class=CPUAttentionBackendImpl):
    impl = impl_class.__new__(impl_class)  # what do_kv_cache_update reads (__init__ wants a running engine's config)
    impl.attn_type, impl.kv_cache_dtype = AttentionType.DECODER, kv_cache_dtype
    cache_dtype = dtype if kv_cache_dtype == "auto" else torch.uint8
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


FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_KERNELS = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()  # vLLM's CPU fp8 kernels


def fp8_layer(kv_cache_dtype: str, impl_class=CPUAttentionBackendImpl, k_scale=1.0, v_scale=1.0):
    layer = cpu_layer("vec", torch.float32, kv_cache_dtype=kv_cache_dtype, impl_class=impl_class)
    layer._k_scale_float, layer._v_scale_float = k_scale, v_scale
    return layer


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8))
def test_fp8_cache_reads_the_backends_own_write_dequantized(kv_cache_dtype):
    """The real op. vLLM's CPU fp8 kernels need AVX-512 or AMX (`_get_attn_isa`); on a CPU without them (an
    AVX2-only AMD EPYC) the op cannot write an fp8 cache and the probe says so: nothing is read, no codes as
    numbers."""
    layer = fp8_layer(kv_cache_dtype, k_scale=0.05, v_scale=0.2)
    slots = slots_of([4, 0, 5], BLOCK, 7, 80)
    keys, values = torch.randn(len(slots), HEADS, HEAD_DIM), torch.randn(len(slots), HEADS, HEAD_DIM)
    if not FP8_KERNELS:
        with pytest.raises(NotImplementedError, match="probing the KV cache layout failed"):
            read_slots(layer, slots)
        assert not reads_back(layer, slots, keys, values)
        return
    layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)
    got_keys, got_values = read_slots(layer, slots)
    for got, want, scale in ((got_keys, keys, 0.05), (got_values, values, 0.2)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, quantize(want, FP8[kv_cache_dtype], scale), rtol=0.25, atol=scale / 64)
    assert reads_back(layer, slots, keys, values) and not reads_back(layer, slots, values, keys)


class Fp8Vec(CPUAttentionBackendImpl):
    """A stand-in of the `vec` kernel's fp8 write (where the real one cannot run): the portable block layout (a
    block's keys, then its values, per head), `code = fp8(x / scale)` with the layer's scales. `codes` and `scaled`
    make it wrong on purpose: another code format than the layer's `kv_cache_dtype`, or `x * scale`."""

    codes: torch.dtype | None = None
    scaled = "divide"

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        num_blocks, heads, block_size, width = kv_cache.shape
        pages = kv_cache.view(num_blocks, heads, 2, block_size, width // 2)  # keys, then values
        codes = self.codes or FP8[self.kv_cache_dtype]
        for side, tensor, scale in ((0, key, layer._k_scale_float), (1, value, layer._v_scale_float)):
            scaled = tensor.float() / scale if self.scaled == "divide" else tensor.float() * scale
            for t, slot in enumerate(slot_mapping.tolist()):  # (H, d) codes per token
                block, offset = divmod(slot, block_size)
                pages[block, :, side, offset] = scaled[t].to(codes).view(torch.uint8)


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8))
def test_fp8_codes_are_read_with_the_engines_scales(kv_cache_dtype):
    layer = fp8_layer(kv_cache_dtype, Fp8Vec, k_scale=0.05, v_scale=0.2)
    slots = slots_of([3, 1], BLOCK, 5, 60)
    keys, values = torch.randn(len(slots), HEADS, HEAD_DIM), torch.randn(len(slots), HEADS, HEAD_DIM) * 30
    layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)
    got_keys, got_values = read_slots(layer, slots)
    assert got_keys.dtype == torch.float32
    assert torch.equal(got_keys, quantize(keys, FP8[kv_cache_dtype], 0.05))
    assert torch.equal(got_values, quantize(values, FP8[kv_cache_dtype], 0.2))
    assert (got_keys - keys).abs().max() > 0  # codes, not numbers: fp8 round-off
    assert reads_back(layer, slots, keys, values) and not reads_back(layer, slots, values, keys)


@pytest.mark.parametrize("wrong", ["format", "scale"])
def test_fp8_codes_of_another_format_or_scale_sense_are_refused(wrong):
    impl = type("Wrong", (Fp8Vec,), {"codes": torch.float8_e4m3fn} if wrong == "format" else {"scaled": "multiply"})
    layer = fp8_layer("fp8_e5m2", impl, k_scale=0.05, v_scale=0.2)
    with pytest.raises(NotImplementedError, match="does not hold"):
        read_slots(layer, slots_of([0], BLOCK, 0, 4))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_inc", "fp4"])
def test_other_quantized_caches_are_never_read_as_numbers(kv_cache_dtype):
    layer = fp8_layer(kv_cache_dtype)
    with pytest.raises(NotImplementedError, match="quantized codes"):
        read_slots(layer, slots_of([0], BLOCK, 0, 4))


def old_read_slots(layer, slots):
    """The read before `gather_slots` (the oracle): each token's whole block page copied, then its keys and values
    picked out of it; an fp8 cache's codes left as codes."""
    from hf_kvbridge.integrations.vllm.paged_cache import probe_block_layout

    kv_cache = layer.kv_cache
    if kv_cache.dim() == 4:
        num_blocks, heads, block_size, width = kv_cache.shape
        key_index, value_index = probe_block_layout(layer)
        blocks, offsets = slots // block_size, slots % block_size
        pages = kv_cache.reshape(num_blocks, -1)[blocks]  # (T, H * block_size * 2d)
        shape = (len(slots), heads, width // 2)
        return tuple(pages.gather(1, index[offsets].flatten(1)).view(shape) for index in (key_index, value_index))
    block_size = kv_cache.shape[2]
    return tuple(part[slots // block_size, slots % block_size] for part in kv_cache.unbind(0))


def _filled(layer, tokens: int, dtype) -> None:
    """Every slot of `layer`'s cache written through its own op with random keys and values."""
    kv_cache = layer.kv_cache
    slots = torch.arange(tokens)
    generator = torch.Generator().manual_seed(tokens)
    shape = (tokens, HEADS, HEAD_DIM)
    keys, values = (torch.randn(shape, generator=generator).to(dtype) for _ in range(2))
    if kv_cache.dim() == 4:
        layer.impl.do_kv_cache_update(layer, keys, values, kv_cache, slots)
    else:
        block_size = kv_cache.shape[2]
        kv_cache[0, slots // block_size, slots % block_size] = keys
        kv_cache[1, slots // block_size, slots % block_size] = values


def _layouts():
    """(name, layer, dtype of its numbers): the CPU kernels at several block sizes, the paired stand-in, an fp8
    stand-in (codes), and the FlashAttention-style layout (contiguous, and a strided view of a larger tensor)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl as Impl

    def cpu(isa, dtype, block_size, impl_class=Impl, kv_cache_dtype="auto"):
        layer = cpu_layer(isa, dtype, kv_cache_dtype, impl_class)
        cache_dtype = layer.kv_cache.dtype
        layer.kv_cache = torch.zeros(BLOCKS, HEADS, block_size, 2 * HEAD_DIM, dtype=cache_dtype)
        return layer

    out = []
    for isa in kernels():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for block_size in (16, 32, 128):
                if isa == "amx" and block_size % 32:
                    continue  # vLLM picks amx only for blocks of a multiple of 32 (its kernel checks it and aborts)
                out.append((f"{isa}-{dtype}-{block_size}", cpu(isa, dtype, block_size), dtype))
    out.append(("paired", cpu("paired", torch.bfloat16, 32, PairedDims), torch.bfloat16))
    for kv_cache_dtype in sorted(FP8):
        layer = cpu("vec", torch.float32, 16, Fp8Vec, kv_cache_dtype)
        layer._k_scale_float, layer._v_scale_float = 0.05, 0.2
        out.append((kv_cache_dtype, layer, torch.float32))
    flash = SimpleNamespace(kv_cache=torch.zeros(2, BLOCKS, 16, HEADS, HEAD_DIM), impl=object())
    strided = SimpleNamespace(kv_cache=torch.zeros(2, BLOCKS, 16, HEADS, 2 * HEAD_DIM)[..., :HEAD_DIM], impl=object())
    out += [("flash", flash, torch.float32), ("flash-strided", strided, torch.float32)]
    return out


def test_the_slot_gather_reads_what_the_whole_block_read_did():
    """`gather_slots` (one index_select of the slots' own elements) against the old read that copied each token's
    whole block: bit-identical on every layout and block size, for tasks that start and end mid-block (partial
    blocks), a single token, and several tasks read at once (`read_layers`)."""
    from hf_kvbridge.integrations.vllm.paged_cache import gather_slots, read_layers, read_nbytes, slot_rows

    for name, layer, dtype in _layouts():
        block_size = layer.kv_cache.shape[2]
        _filled(layer, BLOCKS * block_size, dtype)
        tasks = [
            slots_of([4, 0, 5, 2], block_size, 3, 3 * block_size + 5),  # partial first and last blocks
            slots_of([1], block_size, block_size - 1, block_size),  # one token, a block's last
            slots_of([3, 5], block_size, 0, 2 * block_size),  # whole blocks
        ]
        for slots in tasks:
            kv = gather_slots(layer, slot_rows(layer, slots))  # (2, H, T, d), the cache's dtype
            want_keys, want_values = old_read_slots(layer, slots)  # (T, H, d) each
            assert kv.dtype == layer.kv_cache.dtype, name
            assert torch.equal(kv[0].transpose(0, 1), want_keys), name
            assert torch.equal(kv[1].transpose(0, 1), want_values), name
        both = read_layers([layer, layer], torch.cat(tasks))  # the step's tasks, one op a layer
        buffer = torch.empty(read_nbytes([layer, layer], sum(map(len, tasks))), dtype=torch.uint8)
        into = read_layers([layer, layer], torch.cat(tasks), buffer)  # a staging buffer's: the layers side by side
        assert all(torch.equal(a, b) for a, b in zip(into, both, strict=True)), name
        assert into[1].data_ptr() == buffer.data_ptr() + into[0].numel() * into[0].element_size(), name
        assert buffer.numel() == 2 * into[0].numel() * into[0].element_size(), name
        offset = 0
        for slots in tasks:
            want_keys, want_values = old_read_slots(layer, slots)
            for kv in both:
                part = kv[:, :, offset : offset + len(slots)].transpose(1, 2)  # (2, T, H, d)
                assert torch.equal(part[0], want_keys) and torch.equal(part[1], want_values), name
            offset += len(slots)


@pytest.mark.parametrize("encoding", ["fp8_e4m3", "source"])
@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8))
def test_an_fp8_caches_export_keeps_its_codes_or_dequantizes_them_off_the_step(kv_cache_dtype, encoding):
    """The export of an fp8 cache (the `vec` stand-in's write): the step copies its codes (`read_layers`, `uint8`),
    the store keeps e4m3 codes and the engine's scales as they are in an fp8_e4m3 store, and otherwise dequantizes
    them on the writer's side; either way the stored K/V are exactly what the engine reads (`read_slots`)."""
    from hf_kvbridge.integrations.kv_store import PrefixKVStore, open_store, read_metadata, start_local_server
    from hf_kvbridge.integrations.vllm.export import task_views
    from hf_kvbridge.integrations.vllm.paged_cache import engine_scales, fp8_format, read_layers

    layers = [fp8_layer(kv_cache_dtype, Fp8Vec, k_scale=0.0625, v_scale=0.25) for _ in range(2)]
    slots = slots_of([3, 1, 4], BLOCK, 0, 80)
    ids = list(range(100, 180))
    for layer in layers:
        keys, values = torch.randn(len(slots), HEADS, HEAD_DIM), torch.randn(len(slots), HEADS, HEAD_DIM) * 30
        layer.impl.do_kv_cache_update(layer, keys, values, layer.kv_cache, slots)
    kv = read_layers(layers, slots)  # per layer (2, H, T, d) codes
    assert kv[0].dtype == torch.uint8
    keys, values = task_views(kv, 0, len(slots), fp8_format(layers[0]))
    with start_local_server(maxmemory="32mb") as server, open_store(server.url) as store:
        prefix = PrefixKVStore(store, model_id="fp8-export", chunk_size=32, encoding=encoding)
        prefix.save(ids, keys, values, start=0, scales=[engine_scales(layer) for layer in layers])
        payload = store.get_many(prefix.keys(ids)[:1])[0]
        got_keys, got_values = prefix.load(ids, 64)
    codes_kept = encoding == "fp8_e4m3" and kv_cache_dtype == "fp8_e4m3"
    assert (read_metadata(payload)["encoding"], read_metadata(payload)["dtype"]) == (encoding, "float32")
    assert payload.count(kv[1][0, 0, :32].numpy().tobytes()) == int(codes_kept)  # the engine's own codes
    for layer, got_k, got_v in zip(layers, got_keys, got_values, strict=True):
        want_k, want_v = read_slots(layer, slots[:64])  # (T, H, d), dequantized as the engine reads them
        if encoding == "fp8_e4m3" and not codes_kept:  # e5m2 codes are not e4m3's: the store quantizes them
            torch.testing.assert_close(got_v, want_v.transpose(0, 1), rtol=0.07, atol=0.5)
            continue
        assert torch.equal(got_k, want_k.transpose(0, 1)) and torch.equal(got_v, want_v.transpose(0, 1))
