"""Calibration with models sharded by a `device_map` and offloaded by accelerate equals plain loading.

There is one device here, so the shards are accelerate's real placements: decoder layers on `"cpu"` and on `"disk"`
(memory-mapped from the saved safetensors, on the `meta` device between forwards) and `cpu_offload` (every weight on
`meta`, streamed from a CPU copy). accelerate's hooks load each offloaded weight for its module's forward and drop it
afterwards; the statistics and the fitted mapper must not notice.
"""

from collections import Counter

import accelerate.hooks
import pytest
import torch
from accelerate import cpu_offload
from transformers import AutoModelForCausalLM

import hf_kvbridge
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from tests.conftest import CORPUS, VOCAB, qwen3

FIELDS = ("x_sum", "y_sum", "xx", "xy", "yy")
# small: 2 layers, large: 3 layers (conftest.saved_pair); lm_head is tied to embed_tokens, so it goes with it
SOURCE_MAP = {  # embedding offloaded: `model.device` is `meta`, inputs reach the layers through the hooks
    "model.embed_tokens": "disk",
    "lm_head": "disk",
    "model.rotary_emb": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
}
TARGET_MAP = {
    "model.embed_tokens": "cpu",
    "lm_head": "cpu",
    "model.rotary_emb": "disk",
    "model.layers.0": "disk",
    "model.layers.1": "cpu",
    "model.layers.2": "disk",
    "model.norm": "disk",
}


def _plain(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _sharded(path, device_map, offload_folder):
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, device_map=device_map, offload_folder=str(offload_folder)
    ).eval()
    assert set(model.hf_device_map.values()) == {"cpu", "disk"}
    return model


def _offloaded(label, model) -> set[str]:
    """Names of the parameters accelerate keeps off the model (on `meta`) between forwards, tied ones included."""
    return {
        f"{label}.{name}"
        for name, param in model.named_parameters(remove_duplicate=False)
        if param.device.type == "meta"
    }


@pytest.fixture
def hook_loads(monkeypatch):
    """Full names of the weights accelerate's hooks put on a device for a forward (with their values)."""
    loads: list[str] = []
    real = accelerate.hooks.set_module_tensor_to_device
    qualnames: dict[int, str] = {}

    def recording(module, name, device, value=None, **kwargs):
        if value is not None and str(device) != "meta":
            loads.append(f"{qualnames.get(id(module), '?')}.{name}")
        return real(module, name, device, value=value, **kwargs)

    def watch(**models):
        for label, model in models.items():
            qualnames.update({id(module): f"{label}.{qualname}" for qualname, module in model.named_modules()})

    monkeypatch.setattr(accelerate.hooks, "set_module_tensor_to_device", recording)
    return loads, watch


def _assert_same_statistics(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.count == b.count > 0
        for field in FIELDS:
            torch.testing.assert_close(getattr(a, field), getattr(b, field), rtol=1e-10, atol=1e-10)


def _assert_same_bridge(got, want):
    assert got.config.selected_layers == want.config.selected_layers
    for kind in ("k", "v"):  # rounded to 6 digits in the config
        assert got.config.heldout_r2[kind] == pytest.approx(want.config.heldout_r2[kind], abs=2e-6)
    torch.testing.assert_close(got.layer_r2, want.layer_r2, rtol=1e-10, atol=1e-10)
    state, reference = got.mapper.state_dict(), want.mapper.state_dict()
    assert state.keys() == reference.keys() and state
    for key, value in reference.items():
        assert state[key].device.type == "cpu"
        torch.testing.assert_close(state[key], value, rtol=1e-6, atol=1e-7)


def test_collect_statistics_over_cpu_and_disk_shards_equals_plain(saved_pair, tmp_path, hook_loads):
    loads, watch = hook_loads
    windows = torch.randint(0, VOCAB, (12, 24), generator=torch.Generator().manual_seed(0))
    kw = {"heldout": [2, 7], "batch_size": 4, "statistics_device": "cpu", "reverse": True}
    plain_source, plain_target = _plain(saved_pair["small"]), _plain(saved_pair["large"])
    source = _sharded(saved_pair["small"], SOURCE_MAP, tmp_path / "offload-source")
    target = _sharded(saved_pair["large"], TARGET_MAP, tmp_path / "offload-target")
    assert source.device.type == "meta" and target.device.type == "cpu"
    offloaded = _offloaded("source", source) | _offloaded("target", target)
    assert "source.model.layers.1.self_attn.k_proj.weight" in offloaded
    assert "target.model.layers.2.self_attn.v_proj.weight" in offloaded
    assert "target.model.layers.1.self_attn.v_proj.weight" not in offloaded  # on "cpu": stays put

    want = collect_statistics(plain_source, plain_target, windows, **kw)
    assert not loads  # plainly loaded models have no hooks
    watch(source=source, target=target)
    got = collect_statistics(source, target, windows, **kw)

    # every offloaded weight, and only those, was streamed in by the hooks once per forward (3 train batches and 1
    # held-out batch), and put back on meta after it
    assert Counter(loads) == dict.fromkeys(offloaded, 4)
    assert _offloaded("source", source) | _offloaded("target", target) == offloaded
    _assert_same_statistics(got, want)
    _assert_same_bridge(
        fit_bridge(source, target, *got[:2], top_k=1), fit_bridge(plain_source, plain_target, *want[:2], top_k=1)
    )


def test_calibrate_with_device_map_and_cpu_offload_equals_plain(saved_pair, tmp_path, hook_loads):
    loads, watch = hook_loads
    # 8 windows: 7 train (2 batches of ≤4) and 1 held out (1 batch), so 3 forwards per model
    kw = {"num_sequences": 8, "seq_len": 24, "top_k": 1, "batch_size": 4, "statistics_device": "cpu"}
    kw["keep_statistics"] = True  # compared below
    want = hf_kvbridge.calibrate(saved_pair["small"], saved_pair["large"], CORPUS, **kw)
    # loaded by calibrate itself: every decoder layer of both models on disk, through `**load_kwargs`
    got = hf_kvbridge.calibrate(
        saved_pair["small"],
        saved_pair["large"],
        CORPUS,
        device_map={
            "model.embed_tokens": "cpu",
            "lm_head": "cpu",
            "model.rotary_emb": "cpu",
            "model.layers": "disk",
            "model.norm": "cpu",
        },
        offload_folder=str(tmp_path / "offload"),
        **kw,
    )
    assert got.source.hf_device_map["model.layers"] == got.target.hf_device_map["model.layers"] == "disk"
    offloaded = _offloaded("source", got.source) | _offloaded("target", got.target)
    assert "source.model.layers.0.self_attn.k_proj.weight" in offloaded and len(offloaded) == 5 * 11
    # the models were loaded inside calibrate: count only; 3 forwards each, and each target layer's key norm read once
    # for its gains (`key_norm_gains`, through accelerate's hook like any forward)
    assert len(loads) == 3 * len(offloaded) + got.target.config.num_hidden_layers
    _assert_same_bridge(got, want)
    _assert_same_statistics(got.calibration_statistics, want.calibration_statistics)
    # the source entirely on meta (accelerate.cpu_offload): weights streamed from a CPU copy for every module
    loads.clear()
    source = cpu_offload(_plain(saved_pair["small"]), execution_device="cpu")
    assert source.device.type == "meta"
    watch(source=source)
    again = hf_kvbridge.calibrate(source, _plain(saved_pair["large"]), CORPUS, **kw)
    assert Counter(loads) == dict.fromkeys(_offloaded("source", source), 3)
    assert "source.model.layers.1.mlp.up_proj.weight" in loads
    _assert_same_bridge(again, want)
    _assert_same_statistics(again.calibration_statistics, want.calibration_statistics)


def test_bridge_over_offloaded_models_maps_and_generates_like_plain(saved_pair, tmp_path):
    """A bridge whose source and target keep their weights off-device (`model.device` is `meta`) puts its mapper
    on the hooks' execution device and prefills and generates exactly like the bridge over plain models."""
    from hf_kvbridge import KVBridgeForCausalLM

    plain_source, plain_target = _plain(saved_pair["small"]), _plain(saved_pair["large"])
    windows = torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(0))
    train, heldout = collect_statistics(plain_source, plain_target, windows, heldout=[0, 1])
    plain = fit_bridge(plain_source, plain_target, train, heldout, top_k=1)
    source = _sharded(saved_pair["small"], SOURCE_MAP, tmp_path / "s")
    target = cpu_offload(_plain(saved_pair["large"]), execution_device="cpu")
    assert source.device.type == "meta" and target.device.type == "meta"
    offloaded = KVBridgeForCausalLM(plain.config, source, target, plain.mapper)
    assert offloaded.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in offloaded.mapper.parameters())
    ids = torch.randint(0, VOCAB, (2, 15), generator=torch.Generator().manual_seed(1))
    for a, b in zip(offloaded.prefill(ids)[0].layers, plain.prefill(ids)[0].layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    torch.testing.assert_close(offloaded(ids, prefill_length=10).logits, plain(ids, prefill_length=10).logits)
    assert torch.equal(
        offloaded.generate(ids, max_new_tokens=5, do_sample=False),
        plain.generate(ids, max_new_tokens=5, do_sample=False),
    )


def test_layer_devices_follow_the_device_map():
    """Each layer's device as transformers/peft read it from `hf_device_map` (an int is an accelerator index: `cuda`
    on a machine without one; device objects need no GPU)."""
    from hf_kvbridge.utils.devices import layer_devices

    model = qwen3(layers=3)
    assert layer_devices(model, 3) == [torch.device("cpu")] * 3  # no device map: the model's device
    model.hf_device_map = {
        "model.embed_tokens": 0,
        "model.layers.0": 0,
        "model.layers.1": 1,
        "model.layers.2.self_attn": 2,  # split inside a layer: the attention's device reads the cache
        "model.layers.2.mlp": 1,
        "model.norm": 1,
        "lm_head": "cpu",
    }
    assert layer_devices(model, 3) == [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cuda", 2)]
    # offloaded layers ("cpu", "disk") run on the main device, the first accelerator of the map
    model.hf_device_map = {"model.embed_tokens": 1, "model.layers.0": "disk", "model.layers.1": "cpu", "": 1}
    assert layer_devices(model, 3) == [torch.device("cuda", 1)] * 3
    model.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": "disk", "lm_head": "cpu"}
    assert layer_devices(model, 3) == [torch.device("cpu")] * 3


def test_mapped_layers_land_on_their_target_layers_devices(monkeypatch):
    """A target split over devices gets each mapped layer on that layer's device, not all on the first device.

    A CPU-only machine has no second device to split a model over; `meta` stands in for one (tensors moved there keep
    their shape), with the per-layer lookup faked. What this shows: the engine asks for each layer's device and puts
    the layer there. That a real GPU split's devices are read right is `test_layer_devices_follow_the_device_map`.
    """
    from hf_kvbridge.mappers import engine as mapping

    model = qwen3(layers=3)
    windows = torch.randint(0, VOCAB, (8, 24), generator=torch.Generator().manual_seed(0))
    bridge = fit_bridge(model, model, *collect_statistics(model, model, windows, heldout=[0, 1]), top_k=1)
    asked = []

    def fake_layer_devices(target, num_layers):
        asked.append((target, num_layers))
        return [torch.device("cpu"), torch.device("meta"), torch.device("cpu")]

    monkeypatch.setattr(mapping, "layer_devices", fake_layer_devices)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    cache = bridge.map_cache(model(ids, use_cache=True).cache)
    assert asked == [(bridge.target, 3)]
    assert [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta", "cpu"]
    assert [layer.values.device.type for layer in cache.layers] == ["cpu", "meta", "cpu"]
    assert cache.layers[1].keys.shape == (2, 2, 10, 16)
