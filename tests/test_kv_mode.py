"""kv_mode="separate": keys from keys, values from values, in every head mode, through fit, runtime and checkpoints."""

import json

import pytest
import torch

import hf_kvbridge
from hf_kvbridge import KVBridgeForCausalLM
from hf_kvbridge.calibration import collect_statistics, fit_bridge
from hf_kvbridge.mappers import KVMapper
from hf_kvbridge.solve import solve_ridge
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
            # several target layers in one stacked product (a `mapping_plan` step) agree with `map_layer`
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
    with pytest.raises(ValueError, match="kv_mode='separate' is implemented for mapper_type='ridge' only"):
        hf_kvbridge.CalibrationSettings(kv_mode="separate", mapper_type="mlp")
