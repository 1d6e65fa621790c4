"""Richer source features (`hidden_state_layers`): the source's hidden states as mapper inputs beside its K/V.

The oracle pair: a 3-layer target whose embeddings and first two layers are the 2-layer source's, and whose layer 2
reads the source's final normed hidden state exactly (its input norm is the source's final norm). Its layer-2 K/V
(content space) is then an exact linear function of the source's last hidden state, and not of the source's K/V
(one KV head of 8 per layer: 16 features of a 48-wide residual stream). Hidden-state features recover it with
R² ≈ 1; K/V-only features cannot.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import hf_kvbridge
from hf_kvbridge import KVBridgeConfig, KVBridgeForCausalLM
from hf_kvbridge.constants import FORMAT_VERSION, HIDDEN_FEATURES_FORMAT_VERSION, KV_FORMAT_VERSION
from hf_kvbridge.errors import ConfigurationError, InvalidInputError, KVLayoutError, ServingConfigError
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge, fit_bridge_in_passes
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.settings import CalibrationSettings
from hf_kvbridge.transfer.session import HandoffSession
from hf_kvbridge.utils.layout import KVLayout
from hf_kvbridge.utils.source_features import (
    SourceFeatures,
    check_servable,
    required_format_version,
    resolve_hidden_state_layers,
)
from tests.conftest import VOCAB
from tests.conftest import llama as conftest_llama

HELDOUT = [0, 1, 2, 3]


def llama(layers: int, seed: int):
    """A Llama of 48 hidden units and one KV head of 8 (`tests.conftest.llama`)."""
    return conftest_llama(layers, hidden=48, seed=seed, kv_heads=1, head_dim=8)


@pytest.fixture(scope="module")
def models():
    """(source, target): the target's layer 2 reads the source's last (normed) hidden state exactly."""
    source, target = llama(2, seed=1), llama(3, seed=2)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
        for i in range(2):
            target.model.layers[i].load_state_dict(source.model.layers[i].state_dict())
        target.model.layers[2].input_layernorm.weight.copy_(source.model.norm.weight)
        target.model.layers[2].input_layernorm.variance_epsilon = source.model.norm.variance_epsilon
    return source, target


def features_of(source, layers="all") -> SourceFeatures:
    return SourceFeatures.for_models(KVLayout.from_config(source.config), 48, layers)


def fitted(source, target, windows, features, top_k=None):
    train, held = collect_statistics(source, target, windows, heldout=HELDOUT, features=features)
    return fit_bridge(source, target, train, held, top_k=top_k, ridge_lambda=1e-6, features=features)


@pytest.fixture(scope="module")
def bridges(models, windows):
    """(K/V-only bridge, bridge with hidden state 2 as features), all blocks selected."""
    source, target = models
    return fitted(source, target, windows, None), fitted(source, target, windows, features_of(source, [-1]))


def test_the_oracle_pair_is_what_it_claims(models, windows):
    source, target = models
    ids = windows[:2]
    with torch.no_grad():
        src, tgt = source(ids, output_hidden_states=True), target(ids, output_hidden_states=True)
        normed = target.model.layers[2].input_layernorm(tgt.hidden_states[2])
    torch.testing.assert_close(normed, src.hidden_states[2])  # the target's layer-2 input is the source's last state


def test_hidden_features_recover_a_map_kv_features_cannot(bridges):
    kv_only, hidden = bridges
    kv_r2 = [kv_only.config.heldout_r2[kind][2] for kind in ("k", "v")]
    hidden_r2 = [hidden.config.heldout_r2[kind][2] for kind in ("k", "v")]
    assert min(hidden_r2) > 0.999, hidden_r2
    assert max(kv_r2) < 0.9, kv_r2  # the source's K/V hold 16 of the 48 features per layer
    # the copied layers stay exact either way
    assert min(kv_only.config.heldout_r2["k"][:2] + kv_only.config.heldout_r2["v"][:2]) > 0.999


def test_selection_ranks_hidden_blocks_with_kv_blocks(models, windows):
    source, target = models
    features = features_of(source, [-1])  # 3 pieces of 16 after the 2 K/V blocks: blocks 2, 3, 4
    assert (features.pieces, features.num_blocks) == (3, 5)
    bridge = fitted(source, target, windows, features, top_k=3)
    assert sorted(bridge.config.selected_layers[2]) == [2, 3, 4]  # the hidden state's three pieces win for layer 2
    assert bridge.config.source_features["hidden_state_layers"] == [2]
    assert min(bridge.config.heldout_r2["k"][2], bridge.config.heldout_r2["v"][2]) > 0.999


def test_a_kv_only_fit_of_statistics_with_hidden_blocks_is_the_kv_only_fit(models, windows, bridges):
    """`kvbridge tune` fits its K/V-only configurations from the statistics its hidden-state ones need: leaving the
    hidden-state blocks out gives the map statistics without them give, not a map that reads them."""
    source, target = models
    kv_only, _ = bridges
    features = features_of(source, [-1])
    train, held = collect_statistics(source, target, windows, heldout=HELDOUT, features=features)
    assert train.source_layers == features.num_blocks > 2
    for top_k in (None, 1):
        bridge = fit_bridge(source, target, train, held, top_k=top_k, ridge_lambda=1e-6)
        reference = kv_only if top_k is None else fitted(source, target, windows, None, top_k=top_k)
        assert bridge.config.selected_layers == reference.config.selected_layers
        assert all(s < 2 for layers in bridge.config.selected_layers for s in layers)
        assert bridge.source_features is None and not bridge.config.source_features
        for ours, theirs in zip(bridge.mapper.state_dict().values(), reference.mapper.state_dict().values()):
            torch.testing.assert_close(ours, theirs)
        ids = windows[:2, :16]
        torch.testing.assert_close(bridge(ids).logits, reference(ids).logits)


def test_the_bridge_maps_with_hidden_states_in_forward_generate_and_sessions(bridges, models, windows):
    _, bridge = bridges
    _, target = models
    ids = windows[:2, :20]
    with torch.no_grad():
        own = target(ids).logits[:, -1]
        bridged = bridge(ids).logits[:, -1]  # every target layer is an exact map of the source here
    torch.testing.assert_close(bridged, own, atol=2e-3, rtol=1e-3)
    generated = bridge.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert torch.equal(generated, target.generate(ids[:1], max_new_tokens=4, do_sample=False))
    session = HandoffSession(bridge)
    tokens = ids[0].tolist()
    session.states["source"].tokens, session.states["source"].cache = [], None
    session._run("source", tokens)
    assert session.sync("target", tokens, len(tokens)) > 0
    with pytest.raises(InvalidInputError, match="hidden_states"):
        bridge.map_cache(bridge.source(ids, use_cache=True).past_key_values)


def test_budgeted_passes_give_the_dense_fit(models, windows, bridges):
    source, target = models
    _, dense = bridges  # every block selected
    budgeted, _ = fit_bridge_in_passes(
        source,
        target,
        windows,
        HELDOUT,
        statistics_memory=600_000,  # a selection pass, then fit passes of the selected blocks
        top_k=None,
        ridge_lambda=1e-6,
        features=dense.source_features,
    )
    assert budgeted.config.source_features == dense.config.source_features
    for kind in ("k", "v"):
        torch.testing.assert_close(
            torch.tensor(budgeted.config.heldout_r2[kind]),
            torch.tensor(dense.config.heldout_r2[kind]),
            atol=1e-4,
            rtol=0,
        )


def test_save_load_round_trip_records_the_new_format(bridges, models, tmp_path):
    kv_only, bridge = bridges
    source, target = models
    bridge.save_pretrained(tmp_path / "hidden")
    kv_only.save_pretrained(tmp_path / "kv")
    saved = json.loads((tmp_path / "hidden" / "config.json").read_text())
    assert saved["format_version"] == HIDDEN_FEATURES_FORMAT_VERSION <= FORMAT_VERSION
    assert json.loads((tmp_path / "kv" / "config.json").read_text())["format_version"] == KV_FORMAT_VERSION
    loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "hidden", source_model=source, target_model=target)
    assert loaded.source_features == bridge.source_features
    ids = torch.arange(16).unsqueeze(0) % VOCAB
    torch.testing.assert_close(loaded(ids).logits, bridge(ids).logits)


def test_a_reader_of_the_kv_only_format_refuses_a_hidden_feature_checkpoint(bridges, tmp_path, monkeypatch):
    _, bridge = bridges
    bridge.save_pretrained(tmp_path / "hidden")
    saved = json.loads((tmp_path / "hidden" / "config.json").read_text())
    import hf_kvbridge.configuration as configuration

    monkeypatch.setattr(configuration, "FORMAT_VERSION", KV_FORMAT_VERSION)  # today's reader, which knows format 1
    with pytest.raises(ConfigurationError, match="format version 2, newer than this hf_kvbridge supports"):
        KVBridgeConfig.from_dict(saved)
    monkeypatch.undo()
    with pytest.raises(ConfigurationError, match="newer than this hf_kvbridge supports"):
        KVBridgeConfig.from_dict({**saved, "format_version": FORMAT_VERSION + 1})


def test_required_format_version():
    assert required_format_version(KVBridgeConfig()) == KV_FORMAT_VERSION
    record = {"kv_layers": 2, "hidden_state_layers": [2], "hidden_size": 48, "block_width": 16}
    config = KVBridgeConfig(source_features=record)
    assert required_format_version(config) == config.format_version == HIDDEN_FEATURES_FORMAT_VERSION
    with pytest.raises(ConfigurationError, match="source_features lacks"):
        KVBridgeConfig(source_features={"hidden_state_layers": [2]})


def test_serving_refuses_a_bridge_that_reads_hidden_states(bridges):
    kv_only, bridge = bridges
    check_servable(kv_only.config, "kv-bridge")
    with pytest.raises(ServingConfigError, match="receives only the source's K/V"):
        check_servable(bridge.config, "hidden-bridge", "the vLLM connector of a store-only target")


def test_a_loaded_bridge_checks_its_source(bridges, models):
    _, bridge = bridges
    source, target = models
    config = copy.deepcopy(bridge.config)
    config.source_features = {**config.source_features, "hidden_size": 64}
    with pytest.raises(KVLayoutError, match="hidden size 64"):
        KVBridgeForCausalLM(config, source, target, bridge.mapper)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_state_layers": "some"}, "hidden_state_layers must be"),
        ({"hidden_state_layers": [1.5]}, "hidden_state_layers must be"),
        ({"hidden_state_layers": [1], "head_mode": "same_head"}, "head_mode='all_heads'"),
        ({"hidden_state_layers": [1], "kv_mode": "separate"}, "kv_mode='joint'"),
        ({"hidden_state_layers": [1], "mapper_type": "mlp"}, "not 'mlp', whose fit reads K/V rows only"),
        ({"hidden_state_layers": [1], "bidirectional": True}, "bidirectional=False"),
    ],
)
def test_bad_settings_are_refused_before_any_work(changes, match):
    with pytest.raises(ConfigurationError, match=match):
        CalibrationSettings(**changes)


def test_hidden_state_layers_resolve_like_transformers_counts_them():
    assert resolve_hidden_state_layers(None, 3) == []
    assert resolve_hidden_state_layers(-1, 3) == [3]
    assert resolve_hidden_state_layers([0, -1, 3], 3) == [0, 3]
    with pytest.raises(ConfigurationError, match="outside the source's 4 hidden states"):
        resolve_hidden_state_layers([4], 3)


def test_calibrate_with_hidden_state_layers(models, tokenizer):
    from tests.conftest import CORPUS

    source, target = models
    bridge = hf_kvbridge.calibrate(
        source, target, CORPUS * 4, tokenizer=tokenizer, num_sequences=12, seq_len=24, top_k=None,
        hidden_state_layers=[-1], ridge_lambda=1e-6,
    )  # fmt: skip
    assert bridge.config.source_features["hidden_state_layers"] == [2]
    assert bridge.config.heldout_r2["v"][2] > 0.99, (bridge.config.selected_layers, bridge.config.heldout_r2)
    with pytest.raises(ConfigurationError, match="outside the source's 3 hidden states"):
        hf_kvbridge.calibrate(source, target, CORPUS, tokenizer=tokenizer, hidden_state_layers=[5])


@torch.no_grad()
def test_both_schedules_map_hidden_state_blocks_alike(bridges, windows):
    """The engine's whole-layer schedule (the GPU's) writes the hidden-state blocks into its rows as the chunked one
    does: the same cache."""
    from hf_kvbridge.utils.cache import output_cache

    _, bridge = bridges
    ids = windows[:2, :20]
    out = bridge.source(ids, use_cache=True, output_hidden_states=True)
    mapped = {}
    for schedule in ("layers", "chunked"):
        bridge.free_workspace()  # fresh buffers: nothing left from the other schedule
        mapped[schedule] = bridge.map_cache(output_cache(out), hidden_states=out.hidden_states, schedule=schedule)
    chunked, layers = mapped["chunked"], mapped["layers"]
    for a, b in zip(chunked.layers, layers.layers):
        torch.testing.assert_close(b.keys, a.keys, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(b.values, a.values, atol=1e-6, rtol=1e-5)


# -- the attention-weighted closed form over hidden-state blocks --------------------------------------------------
def test_uniform_weighted_refit_over_hidden_blocks_is_the_ridge_fit(bridges, windows):
    """`ridge_attention_weighted` reads the hidden-state blocks from its own forward passes: with every weight 1 it
    is the ridge fit of the same blocks (which a fit over K/V rows alone could not be: its selection names blocks
    2–4, the hidden state's)."""
    from hf_kvbridge.fitting.mapper_fits import refit

    _, bridge = bridges
    assert max(map(max, bridge.config.selected_layers)) >= bridge.config.source_features["kv_layers"]
    uniform = refit(bridge, "ridge_attention_weighted", windows=windows, weighting="uniform", batch_size=16)
    for got, want in zip(uniform.mapper.layers, bridge.mapper.layers, strict=True):
        torch.testing.assert_close(got.weight, want.weight, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.bias, want.bias, atol=1e-5, rtol=1e-4)
    assert uniform.config.source_features == bridge.config.source_features


def test_attention_weighted_calibration_with_hidden_states_maps_the_oracle_layer(models, tokenizer, windows, tmp_path):
    """Calibrated end to end (`mapper_type="ridge_attention_weighted"`, `hidden_state_layers=[-1]`): layer 2's K/V
    are an exact linear function of the hidden state, so any weighting recovers them; the bridge maps a cache close
    to the target's own there."""
    from tests.conftest import CORPUS

    source, target = models
    bridge = hf_kvbridge.calibrate(
        source, target, CORPUS * 4, tokenizer=tokenizer, num_sequences=12, seq_len=24, top_k=None,
        hidden_state_layers=[-1], ridge_lambda=1e-6, mapper_type="ridge_attention_weighted",
    )  # fmt: skip
    assert bridge.config.mapper_type == "ridge_attention_weighted"
    assert bridge.config.mapper_kwargs["weighting"] == "attention"
    assert bridge.config.source_features["hidden_state_layers"] == [2]
    ids = windows[:2, :20]
    with torch.no_grad():
        from hf_kvbridge.utils.cache import output_cache

        out = source(ids, use_cache=True, output_hidden_states=True)
        mapped = bridge.map_cache(output_cache(out), hidden_states=out.hidden_states)
        own = output_cache(target(ids, use_cache=True))
    torch.testing.assert_close(mapped.layers[2].values, own.layers[2].values, atol=2e-3, rtol=1e-2)
    bridge.save_pretrained(tmp_path / "both")  # a normal checkpoint of the hidden-feature format
    loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "both", source_model=source, target_model=target)
    assert (
        json.loads((tmp_path / "both" / "config.json").read_text())["format_version"] == HIDDEN_FEATURES_FORMAT_VERSION
    )
    with torch.no_grad():
        again = loaded.map_cache(output_cache(out), hidden_states=out.hidden_states)
    torch.testing.assert_close(again.layers[2].values, mapped.layers[2].values)


def test_a_fit_that_reads_kv_rows_only_refuses_a_bridge_with_hidden_states(bridges, windows):
    from hf_kvbridge.fitting.mapper_fits import refit

    _, bridge = bridges
    with pytest.raises(ConfigurationError, match="mapper_type 'mlp' is fitted from K/V rows only"):
        refit(bridge, "mlp", windows=windows)


def test_the_weighted_fit_without_the_features_its_selection_names_is_refused(bridges, models, windows):
    from hf_kvbridge.errors import MapperError
    from hf_kvbridge.fitting.mapper_fits.weighted import fit_attention_weighted

    _, bridge = bridges
    source, target = models
    with pytest.raises(MapperError, match=r"reads source blocks \[2, 3, 4\] past the source's 2 K/V layers"):
        fit_attention_weighted(bridge.mapper, source=source, target=target, windows=windows, ridge_lambda=1e-6)
