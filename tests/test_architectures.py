"""Any rotate-half RoPE decoder: the identity oracle on tiny random models of many architectures, and refusals that
name the reason for the rest. Support is decided from what a model exposes (rotary module, cache layout), never from
a list of model types."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_kvbridge.errors import KVLayoutError
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.utils.layout import check_models
from tests.conftest import VOCAB

SUPPORTED = ["llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma2", "gemma", "granite", "starcoder2"]


def tiny_config(model_type: str, **overrides):
    """A 2-layer config of `model_type` (head dim 16, 2 KV heads, vocabulary of the test tokenizer)."""
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    return AutoConfig.for_model(model_type, **{**kwargs, **overrides})


def tiny(model_type: str, **overrides) -> torch.nn.Module:
    """A random model of `tiny_config`, full attention in every layer."""
    config = tiny_config(model_type, **overrides)
    if getattr(config, "layer_types", None) is not None:  # hybrid families: make every layer full attention
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    elif hasattr(config, "sliding_window"):
        config.sliding_window = None
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_identity_oracle_for_every_supported_architecture(model_type):
    model = tiny(model_type)
    windows = torch.randint(0, VOCAB, (24, 32), generator=torch.Generator().manual_seed(0))
    train, heldout = collect_statistics(model, model, windows, heldout=[0, 1, 2, 3])
    bridge = fit_bridge(model, model, train, heldout, top_k=2, ridge_lambda=1e-9)
    ids = torch.randint(0, VOCAB, (2, 26), generator=torch.Generator().manual_seed(5))
    out = bridge(ids, prefill_length=20)
    ref = model(ids).logits
    torch.testing.assert_close(out.logits[:, 19:], ref[:, 19:], atol=2e-4, rtol=1e-4)
    prompt = ids[:, :20]
    assert torch.equal(
        bridge.generate(prompt, max_new_tokens=8, do_sample=False),
        model.generate(prompt, max_new_tokens=8, do_sample=False),
    )


@pytest.mark.parametrize(
    ("model_type", "overrides", "reason"),
    [
        ("cohere", {}, "not the rotate-half layout"),  # interleaved rotary: an identity pair would not notice
        ("gpt_neox", {"partial_rotary_factor": 0.25}, "partial rotary"),
        ("stablelm", {"partial_rotary_factor": 0.25}, "partial rotary"),
        ("gemma3_text", {"sliding_window": 64}, "one rotary per layer type"),
        ("smollm3", {"no_rope_layers": [1, 0]}, "NoPE"),
    ],
)
def test_unsupported_models_are_refused_with_the_reason(model_type, overrides, reason):
    config = tiny_config(model_type, **overrides)
    if model_type == "gemma3_text":
        config.layer_types = ["full_attention"] * 2  # so that only the per-layer-type rotary stands in the way
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(KVLayoutError, match=reason):
        check_models(model, model, "a", "b")


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("mistral", {"sliding_window": 8}),  # every layer slides
        ("gemma2", {"sliding_window": 8, "num_hidden_layers": 4}),  # sliding and full layers alternate
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "num_hidden_layers": 3}),
    ],
)
def test_identity_oracle_with_sliding_window_layers_beyond_the_window(model_type, overrides):
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    windows = torch.randint(0, VOCAB, (24, 32), generator=torch.Generator().manual_seed(0))
    train, heldout = collect_statistics(model, model, windows, heldout=[0, 1, 2, 3])
    bridge = fit_bridge(model, model, train, heldout, top_k=2, ridge_lambda=1e-9)
    assert bridge.target_layout.layer_windows is not None
    ids = torch.randint(0, VOCAB, (2, 26), generator=torch.Generator().manual_seed(5))
    out = bridge(ids, prefill_length=20)  # 19 mapped tokens: more than the window of 8
    own = model(ids[:, :19], use_cache=True).cache
    for t, layer in enumerate(out.past_key_values.layers):
        assert type(layer) is type(own.layers[t])  # the target's own cache layer types
        assert layer.get_seq_length() == 26
    torch.testing.assert_close(out.logits[:, 19:], model(ids).logits[:, 19:], atol=2e-4, rtol=1e-4)
    prompt = ids[:, :20]
    assert torch.equal(  # generation runs far past the window
        bridge.generate(prompt, max_new_tokens=16, do_sample=False),
        model.generate(prompt, max_new_tokens=16, do_sample=False),
    )


def test_a_full_attention_target_layer_never_reads_a_sliding_source_layer():
    source = AutoModelForCausalLM.from_config(tiny_config("gemma2", num_hidden_layers=4, sliding_window=8)).eval()
    target = tiny("gemma2", num_hidden_layers=3)  # full attention everywhere
    windows = torch.randint(0, VOCAB, (24, 32), generator=torch.Generator().manual_seed(0))
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    bridge = fit_bridge(source, target, train, heldout, top_k=4, ridge_lambda=0.01)
    full_source_layers = {s for s, w in enumerate(bridge.source_layout.layer_windows) if w is None}
    assert all(set(layers) <= full_source_layers for layers in bridge.config.selected_layers)
    assert all(len(layers) == len(full_source_layers) for layers in bridge.config.selected_layers)
    out = bridge(torch.randint(0, VOCAB, (1, 30)), prefill_length=28)  # the mapping reads every token
    assert out.past_key_values.get_seq_length() == 30


def test_a_target_layer_no_source_layer_can_fill_is_refused():
    sliding = AutoModelForCausalLM.from_config(tiny_config("mistral", sliding_window=8)).eval()
    with pytest.raises(KVLayoutError, match="layer 0 needs all tokens, but no layer of source 's' keeps them"):
        check_models(sliding, tiny("mistral"), "s", "t")


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("mistral", {"sliding_window": 8}), ("gemma2", {"sliding_window": 8, "num_hidden_layers": 4})],
)
def test_handoff_session_with_sliding_window_layers_runs_past_the_window(model_type, overrides):
    """An identity session switching models every turn, the conversation far longer than the window of 8: every
    turn's greedy tokens equal a target-only session's (sliding layers receive only the window they keep)."""
    from hf_kvbridge.transfer.session import HandoffSession
    from tests.conftest import make_tokenizer
    from tests.transfer.test_session import QUESTIONS, TEMPLATE, _bidirectional

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()
    windows = torch.randint(0, VOCAB, (24, 32), generator=torch.Generator().manual_seed(0))
    bridge = _bidirectional(model, model, windows, top_k=2, ridge_lambda=1e-9)
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TEMPLATE
    session, reference = HandoffSession(bridge, tokenizer), HandoffSession(bridge, tokenizer)
    for i, question in enumerate(QUESTIONS[:6]):
        for s in (session, reference):
            s.add_user(question)
        turn = session.generate(model="source" if i % 2 == 0 else "target", max_new_tokens=4, do_sample=False)
        want = reference.generate(model="target", max_new_tokens=4, do_sample=False)
        assert turn.token_ids == want.token_ids, f"turn {i}"
    assert len(session.tokens) > 4 * overrides["sliding_window"]
    assert session.tokens == reference.tokens
