"""Diagnostics: the target's queries, the inspect report (oracles on the identity pair) and `kvbridge inspect`."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_kvbridge.fitting.attention import target_queries
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.mapper_fits import refit
from hf_kvbridge.tools.diagnostics import INSPECT_FILES, inspect_bridge
from hf_kvbridge.utils.devices import decoder_layers
from kvbridge_cli import main
from tests.conftest import CORPUS, VOCAB, qwen3


def _bridge(source, target, windows, **kw):
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1])
    return fit_bridge(source, target, train, heldout, **kw)


@pytest.fixture(scope="module")
def heldout_ids():
    return torch.randint(0, VOCAB, (6, 40), generator=torch.Generator().manual_seed(21))


def test_target_queries_reproduce_the_layers_attention():
    """Oracle: the captured queries attending over the model's own cache give each `self_attn`'s own output."""
    model = qwen3(layers=2)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    outputs = {}
    layers = decoder_layers(model)
    handles = [
        layer.self_attn.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, out[0]))
        for i, layer in enumerate(layers)
    ]
    try:
        queries, cache = target_queries(model, ids)
    finally:
        for handle in handles:
            handle.remove()
    for t, layer in enumerate(layers):
        attn = layer.self_attn
        keys, values = cache.layers[t].keys, cache.layers[t].values  # (B, H_kv, T, d)
        rep = queries[t].shape[1] // keys.shape[1]
        attended = torch.nn.functional.scaled_dot_product_attention(
            queries[t], keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1), is_causal=True,
            scale=attn.scaling,
        )  # fmt: skip
        mine = attn.o_proj(attended.transpose(1, 2).reshape(2, 12, -1))
        torch.testing.assert_close(mine, outputs[t], atol=1e-5, rtol=1e-4)


def test_identity_pair_is_perfect(windows, heldout_ids):
    model = qwen3(layers=2)
    bridge = _bridge(model, model, windows[:12], top_k=2, ridge_lambda=1e-9)
    report = inspect_bridge(bridge, heldout_ids, batch_size=3, heldout_fraction=0.5)
    assert min(min(row) for row in report["mapper_r2"]["k"] + report["mapper_r2"]["v"]) > 0.9999
    assert min(report["attention_cosine"]) > 0.9999
    assert max(report["key_error_layer"]) < 1e-6 and max(report["key_error_centered_layer"]) < 1e-6
    # each target layer is best predicted by the same source layer
    single = torch.tensor(report["single_layer_r2"])
    assert torch.equal(single.argmax(1), torch.arange(2)) and single.diagonal().min() > 0.999


def test_report_shapes_and_r2_from_statistics(windows, heldout_ids):
    """Mapper R² measured from the mapper's outputs equals R² from `KVStatistics.residual_sums` with its weights."""
    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    bridge = _bridge(source, target, windows[:12], top_k=2)
    report = inspect_bridge(bridge, heldout_ids, batch_size=4)
    assert report["windows"] == 6 and report["tokens"] == 240 and report["mapper_type"] == "ridge"
    assert torch.tensor(report["mapper_r2"]["k"]).shape == (3, 2)  # (target layers, KV heads)
    assert torch.tensor(report["key_error"]).shape == (3, 2)
    assert torch.tensor(report["single_layer_r2"]).shape == (3, 2)  # (target layers, source layers)
    assert torch.tensor(report["single_layer_r2_kv"]).shape == (3, 2, 2)
    assert len(report["attention_cosine"]) == len(report["key_error_layer"]) == 3
    stats = collect_statistics(source, target, heldout_ids)[0]  # every window in one KVStatistics
    for t, layers in enumerate(bridge.mapper.selected_layers):
        layer = bridge.mapper.layers[t]
        x_idx, y_idx = stats.source_index(layers), stats.target_index(t)
        sse, sst = stats.residual_sums(x_idx, y_idx, layer.weight[0], layer.bias[0])
        r2 = 1 - sse.view(2, 2, 16).sum(-1) / sst.view(2, 2, 16).sum(-1)  # (H, K/V)
        got = torch.tensor([report["mapper_r2"]["k"][t], report["mapper_r2"]["v"][t]], dtype=torch.float64).T
        torch.testing.assert_close(got, r2, atol=1e-4, rtol=0)


def test_inspect_cli_writes_json_and_plots(saved_pair, windows, tmp_path, capsys):
    source = AutoModelForCausalLM.from_pretrained(saved_pair["small"]).eval()
    target = AutoModelForCausalLM.from_pretrained(saved_pair["large"]).eval()
    refs = {"source_name_or_path": saved_pair["small"], "target_name_or_path": saved_pair["large"]}
    bridge = _bridge(source, target, windows[:12], top_k=1, config_kwargs=refs)
    bridge = refit(bridge, "mlp", windows=windows[:12], hidden=8, epochs=1, batch_size=12)
    bridge.save_pretrained(tmp_path / "bridge")
    data = tmp_path / "heldout.txt"
    data.write_text(" ".join(CORPUS))
    out = tmp_path / "inspect"
    args = ["inspect", str(tmp_path / "bridge"), "--data", str(data), "--num-sequences", "4", "--seq-len", "24"]
    assert main([*args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "attention cosine" in printed and "λ K" in printed  # the ridge λ of each target layer
    assert sorted(p.name for p in out.iterdir()) == sorted(INSPECT_FILES)
    report = json.loads((out / "report.json").read_text())
    assert report["ridge_lambda"] == "auto"  # the MLP starts from the auto-λ ridge and keeps its λ per layer
    assert report["ridge_lambda_layer"]["k"] == [v for (v,) in bridge.config.ridge_lambdas["k"]]
    assert report["mapper_type"] == "mlp" and report["windows"] == 4 and len(report["attention_cosine"]) == 3
