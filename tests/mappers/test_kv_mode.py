"""kv_mode="separate": keys from keys, values from values, for every mapper type and head mode, through fit,
runtime and checkpoints."""

import copy
import dataclasses
import json

import pytest
import torch

import hf_kvbridge
from hf_kvbridge import KVBridgeForCausalLM
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.mapper_fits import fit_of, refit
from hf_kvbridge.fitting.solve import solve_ridge
from hf_kvbridge.mappers import MAPPER_REGISTRY, MAPPER_TYPES, KVMapper
from tests.conftest import VOCAB, qwen3

H, D = 2, 4


def _joint_equivalent(separate: KVMapper) -> KVMapper:
    """The joint mapper computing what `separate` computes: its weights placed block-diagonally over K and V."""
    joint = KVMapper(separate.selected_layers, H, D, separate.head_mode, kv_mode="joint")
    for t, layers in enumerate(separate.selected_layers):
        k = len(layers)
        w, b = separate.layers[t].weight, separate.layers[t].bias
        jw, jb = joint.layers[t].weight.data, joint.layers[t].bias.data
        if separate.head_mode == "all_heads":  # joint rows (k, H, 2, d), separate group kv rows (k, H, d)
            view_w = jw[0].view(k, H, 2, D, H, 2, D)
            for kv in range(2):
                view_w[:, :, kv, :, :, kv, :] = w[kv].view(k, H, D, H, D)
                jb[0].view(H, 2, D)[:, kv] = b[kv].view(H, D)
        else:  # group h: joint rows (k, 2, d) → (2, d); separate group kv·H + h: (k, d) → (d)
            for h in range(H):
                view_w = jw[h].view(k, 2, D, 2, D)
                for kv in range(2):
                    view_w[:, kv, :, kv, :] = w[kv * H + h].view(k, D, D)
                    jb[h].view(2, D)[kv] = b[kv * H + h]
    return joint


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_separate_runtime_equals_block_diagonal_joint_map(head_mode):
    gen = torch.Generator().manual_seed(0)
    separate = KVMapper([[1, 0], [0, 1]], H, D, head_mode, kv_mode="separate")
    for layer in separate.layers:
        layer.weight.data.normal_(generator=gen)
        layer.bias.data.normal_(generator=gen)
    joint = _joint_equivalent(separate)
    # half the weights of the joint map
    assert sum(p.numel() for p in separate.parameters() if p.dim() == 3) * 2 == sum(
        p.numel() for p in joint.parameters() if p.dim() == 3
    )
    assert separate.flops_per_token() * 2 == joint.flops_per_token()
    keys, values = torch.randn(2, 2, H, 5, D, generator=gen).unbind(0)  # (B, H, T, d) of one source layer
    for mapper_pair in [(separate, joint)]:
        outs = []
        for mapper in mapper_pair:
            rows = [mapper.layout_rows(keys, values), mapper.layout_rows(values * 2, keys - 1)]  # source layers 0, 1
            mapped = mapper.map_layer(1, rows)  # target layer 1 reads source layers [0, 1]
            outs.append(mapper.split_rows(mapped, batch=2, seq=5))
            # several target layers in one stacked product (a `mapping_steps` step) agree with `map_layer`
            buffer = mapper.new_rows(2, 5, 2)
            mapper.write_rows(buffer, 0, keys, values)
            mapper.write_rows(buffer, 1, values * 2, keys - 1)
            both = mapper.map_targets([0, 1], [0, 1], buffer)
            k_all, v_all = mapper.split_rows(both, batch=2, seq=5, layers=2)
            torch.testing.assert_close(k_all[1], outs[-1][0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(v_all[1], outs[-1][1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(outs[0][1], outs[1][1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ridge_lambda", [0.01, "auto"])
@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_separate_fit_is_keys_from_keys_and_values_from_values(windows, head_mode, ridge_lambda):
    source, target = qwen3(layers=2, kv_heads=H, head_dim=D, seed=1), qwen3(layers=3, kv_heads=H, head_dim=D, seed=2)
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    bridge = fit_bridge(
        source, target, train, heldout, top_k=2, head_mode=head_mode, kv_mode="separate", ridge_lambda=ridge_lambda
    )
    assert bridge.config.kv_mode == "separate"
    both = train + heldout
    for t, layers in enumerate(bridge.config.selected_layers):
        for kv in range(2):
            for h in [None] if head_mode == "all_heads" else range(H):
                x_idx = both.source_index(layers, h).view(-1, 2, D)[:, kv].reshape(-1)
                y_idx = both.target_index(t, h).view(-1, 2, D)[:, kv].reshape(-1)
                lam = ridge_lambda  # or the auto choice of this layer's K or V map (of head h)
                if ridge_lambda == "auto":
                    lam = bridge.config.ridge_lambdas["kv"[kv]][t][0 if h is None else h]
                weight, bias = solve_ridge(both, x_idx, y_idx, lam)
                g = kv if h is None else kv * H + h
                torch.testing.assert_close(bridge.mapper.layers[t].weight[g], weight.float(), atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(bridge.mapper.layers[t].bias[g], bias.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_separate_identity_pair_reproduces_target(windows, head_mode, tmp_path):
    model = qwen3(layers=2, kv_heads=H, head_dim=D)
    train, heldout = collect_statistics(model, model, windows, heldout=[0, 1, 2, 3])
    bridge = fit_bridge(
        model, model, train, heldout, top_k=2, head_mode=head_mode, ridge_lambda=1e-9, kv_mode="separate"
    )
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))
    out = bridge(ids, prefill_length=16)
    torch.testing.assert_close(out.logits[:, 15:], model(ids).logits[:, 15:], atol=2e-4, rtol=1e-4)
    bridge.save_pretrained(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["kv_mode"] == "separate"
    for lazy in (False, True):
        loaded = KVBridgeForCausalLM.from_pretrained(
            tmp_path / "b", source_model=model, target_model=model, lazy_mapper=lazy
        )
        assert loaded.mapper.kv_mode == "separate"
        torch.testing.assert_close(loaded(ids, prefill_length=16).logits, out.logits)


def test_old_config_without_kv_mode_loads_as_joint():
    config = hf_kvbridge.KVBridgeConfig.from_dict({"head_mode": "all_heads", "selected_layers": [[0]]})
    assert config.kv_mode == "joint"
    with pytest.raises(ValueError, match="kv_mode must be one of"):
        hf_kvbridge.KVBridgeConfig(kv_mode="both")


def test_every_mapper_type_accepts_separate_and_a_type_without_it_is_refused(monkeypatch):
    for mapper_type in MAPPER_TYPES:
        hf_kvbridge.CalibrationSettings(kv_mode="separate", mapper_type=mapper_type)  # validates
    joint_only = dataclasses.replace(MAPPER_REGISTRY["mlp"], kv_modes=("joint",))
    monkeypatch.setitem(MAPPER_REGISTRY, "mlp", joint_only)
    with pytest.raises(ValueError, match="mapper_type 'mlp' supports kv_mode \\['joint'\\], not 'separate'"):
        hf_kvbridge.CalibrationSettings(kv_mode="separate", mapper_type="mlp")


# -- every mapper type × kv_mode × head_mode --------------------------------------------------------------------------
# Pairs whose KV layouts differ (2 ↔ 4 KV heads). "unrelated": a random target, whose joint maps really mix keys and
# values (the control that the perturbation test can see mixing). "narrow_to_wide" / "wide_to_narrow": the target's
# K/V is an exact linear function of the source's, keys of keys and values of values: the wide model's KV head j is
# the narrow one's head j // 2, its keys scaled per dimension (k_norm × a, q_norm ÷ a, a equal on the two halves that
# RoPE rotates together) and its values mixed by an invertible A_j (o_proj × A_j⁻¹). The two compute the same
# function, so every layer's K/V is that map of the other's (and a joint fit learns it block-diagonal too).

FIT_KWARGS = {
    "ridge": {},
    "ridge_attention_weighted": {},
    "low_rank": {"rank": 4},  # below every map's width, so the rank itself is what separate halves
    "mlp": {"hidden": 8, "epochs": 1, "steps_per_batch": 2},
}
MODES = [(h, kv) for h in ("all_heads", "same_head") for kv in ("joint", "separate")]


def _widened(narrow):
    """`narrow` (Qwen3, 2 KV heads, 4 query heads) with 4 KV heads, keys scaled and values mixed as described above."""
    config, dim = narrow.config, narrow.config.head_dim
    wide = qwen3(layers=config.num_hidden_layers, kv_heads=4, head_dim=dim, seed=9)
    shared = {k: v for k, v in narrow.state_dict().items() if not k.endswith(("k_proj.weight", "v_proj.weight"))}
    wide.load_state_dict(shared, strict=False)  # all but the K/V projections (their shapes differ), set below
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for mine, theirs in zip(wide.model.layers, narrow.model.layers):
            attn, orig = mine.self_attn, theirs.self_attn
            mix = torch.eye(dim) + 0.3 * torch.randn(4, dim, dim, generator=gen)  # (H_t, d, d): v'_j = A_j v_(j//2)
            v_weight = orig.v_proj.weight.view(2, dim, -1).repeat_interleave(2, 0)  # (H_t, d, hidden)
            attn.v_proj.weight.copy_((mix @ v_weight).reshape(4 * dim, -1))
            attn.k_proj.weight.copy_(orig.k_proj.weight.view(2, dim, -1).repeat_interleave(2, 0).reshape(4 * dim, -1))
            out = orig.o_proj.weight.view(-1, 4, dim)  # (hidden, H_q, d): query head j reads KV head j in `wide`
            attn.o_proj.weight.copy_(torch.einsum("ojd,jde->oje", out, torch.linalg.inv(mix)).reshape(-1, 4 * dim))
            half = 1 + torch.rand(dim // 2, generator=gen)
            scale = torch.cat([half, half])  # RoPE rotates dims i and i + d/2 together: scale them alike
            attn.k_norm.weight.copy_(orig.k_norm.weight * scale)
            attn.q_norm.weight.copy_(orig.q_norm.weight / scale)
    return wide.eval()


@pytest.fixture(scope="module")
def pairs():
    narrow = qwen3(layers=2, kv_heads=H, head_dim=D, seed=5)
    wide = _widened(narrow)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(wide(input_ids=ids).logits, narrow(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
    unrelated = qwen3(layers=2, kv_heads=2 * H, head_dim=D, seed=6)
    return {"unrelated": (narrow, unrelated), "narrow_to_wide": (narrow, wide), "wide_to_narrow": (wide, narrow)}


@pytest.fixture(scope="module")
def fitted(pairs, windows):
    """`fitted(mapper_type, head_mode, kv_mode, pair)`: a bridge fitted as `calibrate` fits it (the ridge, then the
    type's registry fit from the ridge bridge), cached for the module."""
    statistics, bridges = {}, {}
    windows = windows[:12]  # 576 tokens: plenty for 32 input features, and 40 fits stay quick

    def fit(mapper_type, head_mode, kv_mode, pair="unrelated"):
        key = (mapper_type, head_mode, kv_mode, pair)
        if key not in bridges:
            source, target = pairs[pair]
            if pair not in statistics:
                statistics[pair] = collect_statistics(source, target, windows, heldout=[0, 1])
            train, heldout = statistics[pair]
            bridge = fit_bridge(source, target, train, heldout, top_k=2, head_mode=head_mode, kv_mode=kv_mode)
            kwargs = dict(FIT_KWARGS[mapper_type])
            if mapper_type == "low_rank" and pair != "unrelated":
                kwargs["rank"] = 32  # the linear pairs' maps at full rank (on these widths): exact recovery
            if fit_of(mapper_type) is not None:
                bridge = refit(
                    bridge, mapper_type, windows=windows, statistics=(train, heldout), batch_size=8, **kwargs
                )
            assert bridge.config.mapper_type == mapper_type and bridge.mapper.kv_mode == kv_mode
            bridges[key] = bridge
        return bridges[key]

    return fit


def _source_cache(bridge, seed=7):
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return bridge.source(input_ids=ids, use_cache=True).cache


def _perturbed(cache, kind: str):
    """A copy of `cache` with noise added to every layer's keys or values."""
    cache = copy.deepcopy(cache)
    gen = torch.Generator().manual_seed(11)
    for layer in cache.layers:
        tensor = getattr(layer, kind)
        tensor.add_(torch.randn(tensor.shape, generator=gen) * tensor.std())
    return cache


@pytest.mark.parametrize("head_mode,kv_mode", MODES)
@pytest.mark.parametrize("mapper_type", MAPPER_TYPES)
def test_separate_maps_keys_only_from_keys_and_values_only_from_values(fitted, mapper_type, head_mode, kv_mode):
    bridge = fitted(mapper_type, head_mode, kv_mode)
    cache = _source_cache(bridge)
    with torch.no_grad():
        base = bridge.map_cache(cache)
        other_values, other_keys = (
            bridge.map_cache(_perturbed(cache, "values")),
            bridge.map_cache(_perturbed(cache, "keys")),
        )
    for layer, moved_v, moved_k in zip(base.layers, other_values.layers, other_keys.layers):
        # each perturbation reaches its own kind; it reaches the other kind only in joint mode
        assert not torch.allclose(moved_v.values, layer.values, atol=1e-3)
        assert not torch.allclose(moved_k.keys, layer.keys, atol=1e-3)
        if kv_mode == "separate":
            torch.testing.assert_close(moved_v.keys, layer.keys, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(moved_k.values, layer.values, atol=1e-6, rtol=1e-6)
        else:
            assert not torch.allclose(moved_v.keys, layer.keys, atol=1e-3)
            assert not torch.allclose(moved_k.values, layer.values, atol=1e-3)


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
@pytest.mark.parametrize("mapper_type", MAPPER_TYPES)
def test_separate_has_half_the_joint_weights_and_flops(fitted, mapper_type, head_mode):
    separate, joint = (fitted(mapper_type, head_mode, kv_mode).mapper for kv_mode in ("separate", "joint"))
    assert type(separate) is type(joint)

    def weights(mapper):  # the matrices; biases keep their size (G·q is the output width in both modes)
        return sum(p.numel() for p in mapper.parameters() if p.dim() == 3)

    assert 2 * weights(separate) == weights(joint)
    assert 2 * separate.flops_per_token() == joint.flops_per_token()


@pytest.mark.parametrize("head_mode,kv_mode", MODES)
@pytest.mark.parametrize("mapper_type", MAPPER_TYPES)
def test_kv_mode_survives_save_and_load(fitted, mapper_type, head_mode, kv_mode, tmp_path):
    bridge = fitted(mapper_type, head_mode, kv_mode)
    bridge.save_pretrained(tmp_path / "b")
    saved = json.loads((tmp_path / "b" / "config.json").read_text())
    assert (saved["mapper_type"], saved["kv_mode"]) == (mapper_type, kv_mode)
    loaded = KVBridgeForCausalLM.from_pretrained(
        tmp_path / "b", source_model=bridge.source, target_model=bridge.target
    )
    assert type(loaded.mapper) is type(bridge.mapper) and loaded.mapper.kv_mode == kv_mode
    cache = _source_cache(bridge)
    with torch.no_grad():
        want, got = bridge.map_cache(cache), loaded.map_cache(cache)
    for a, b in zip(want.layers, got.layers):
        torch.testing.assert_close(b.keys, a.keys)
        torch.testing.assert_close(b.values, a.values)


def _r2(pred: torch.Tensor, true: torch.Tensor) -> float:
    """R² over all features of `(B, H, T, d)` tensors, each feature centred over batch and tokens."""
    centred = true - true.mean((0, 2), keepdim=True)
    return 1 - float((pred - true).pow(2).sum() / centred.pow(2).sum())


@pytest.mark.parametrize("pair", ["narrow_to_wide", "wide_to_narrow"])
@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
@pytest.mark.parametrize("mapper_type", MAPPER_TYPES)
def test_separate_recovers_a_target_whose_keys_and_values_are_linear_in_the_sources(
    fitted, mapper_type, head_mode, pair
):
    bridge = fitted(mapper_type, head_mode, "separate", pair)
    ids = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(21))  # never calibrated on
    with torch.no_grad():
        mapped = bridge.map_cache(bridge.source(input_ids=ids, use_cache=True).cache)
        true = bridge.target(input_ids=ids, use_cache=True).cache
    floor = 0.999 if mapper_type == "mlp" else 0.9999  # the MLP's residual trains a little
    for got, want in zip(mapped.layers, true.layers):
        assert _r2(got.keys, want.keys) > floor
        assert _r2(got.values, want.values) > floor
