"""Pairs whose KV layouts differ (KV heads, head dim, RoPE base and scaling): oracles where the target's K/V is an
exact linear function of the source's, grouped same_head both ways, refusals, handoffs and checkpoints."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hf_kvbridge
from hf_kvbridge import KVBridgeForCausalLM, KVLayoutError
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge_in_passes
from hf_kvbridge.fitting.calibration.checks import split_heldout
from hf_kvbridge.transfer.session import HandoffSession
from hf_kvbridge.utils.heads import same_head_sources
from tests.conftest import CORPUS, VOCAB, make_tokenizer, qwen3

CALIBRATION = {"num_sequences": 8, "seq_len": 32, "top_k": 2}


def llama(layers: int, kv_heads: int, head_dim: int, rope: dict, seed: int, q_heads: int = 6) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        num_hidden_layers=layers,
        hidden_size=48,
        num_attention_heads=q_heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=VOCAB,
        intermediate_size=96,
        max_position_embeddings=256,
        rope_parameters=rope,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def linear_pair():
    """One-layer Llamas: source 2 KV heads × 16 at θ = 10⁴, target 3 KV heads × 8 with YaRN (factor 2, so its
    cos/sin carry an attention scaling) at θ = 5·10⁵. The target's embeddings and input norm are the source's and its
    key and value projections are fixed linear maps of the source's, so its content-space K/V is an exact linear
    function of the source's (layer 0 reads nothing but the embeddings); the rest of the target is its own."""
    source = llama(1, 2, 16, {"rope_type": "default", "rope_theta": 1e4}, seed=1)
    yarn = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0, "original_max_position_embeddings": 128}
    target = llama(1, 3, 8, yarn, seed=2)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(source.model.embed_tokens.weight)
        src_attn, tgt_attn = source.model.layers[0].self_attn, target.model.layers[0].self_attn
        target.model.layers[0].input_layernorm.weight.copy_(source.model.layers[0].input_layernorm.weight)
        for name in ("k_proj", "v_proj"):
            mix = torch.randn(3 * 8, 2 * 16, generator=generator) / 4  # (H_t·d_t, H_s·d_s)
            getattr(tgt_attn, name).weight.copy_(mix @ getattr(src_attn, name).weight)
    source.config.name_or_path, target.config.name_or_path = "org/two-by-16", "org/three-by-8"
    return source, target


def _assert_recovers(bridge, r2=0.9999, atol=1e-4):
    """Held-out R² of every layer ≈ 1, and the bridge's logits equal the target's own."""
    assert min(bridge.config.heldout_r2["k"] + bridge.config.heldout_r2["v"]) > r2, bridge.config.heldout_r2
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        bridged = bridge(ids).logits[:, -1]
        own = bridge.target(input_ids=ids).logits[:, -1]
    torch.testing.assert_close(bridged, own, atol=atol, rtol=1e-4)


@pytest.mark.parametrize(
    "mapper_type,kv_mode,extra",
    [
        ("ridge", "joint", {}),
        ("ridge", "separate", {}),
        ("ridge_attention_weighted", "joint", {}),
        ("low_rank", "joint", {"rank": 64}),  # ≥ min(p, q): the full ridge map
        ("mlp", "joint", {"mapper_kwargs": {"hidden": 8, "epochs": 1, "steps_per_batch": 2}}),
    ],
)
def test_exact_linear_target_is_recovered_across_heads_dims_and_rope(linear_pair, mapper_type, kv_mode, extra):
    source, target = linear_pair
    bridge = hf_kvbridge.calibrate(
        source, target, CORPUS, tokenizer=make_tokenizer(), mapper_type=mapper_type, kv_mode=kv_mode,
        **CALIBRATION, **extra,
    )  # fmt: skip
    assert bridge.config.mapper_type == mapper_type
    assert (bridge.mapper.source_kv_heads, bridge.mapper.source_head_dim) == (2, 16)
    assert (bridge.mapper.target_kv_heads, bridge.mapper.target_head_dim) == (3, 8)
    _assert_recovers(bridge, atol=1e-2 if mapper_type == "mlp" else 1e-4)  # the MLP's residual trains a little


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_budgeted_calibration_recovers_it_too(linear_pair, grouped_pair, windows, head_mode):
    """The selection statistics (head groups of gcd(H_s, H_t) heads) and the fit passes' block statistics."""
    source, target = linear_pair if head_mode == "all_heads" else grouped_pair[::-1]  # 2 × 16 → 3 × 8, 4 → 2 heads
    _, heldout = split_heldout(len(windows), 0.25, 0)
    bridge, _ = fit_bridge_in_passes(
        source, target, windows, heldout, statistics_memory=10**8, head_mode=head_mode, top_k=1
    )  # top-1: selection must find the one source layer that explains each target layer
    _assert_recovers(bridge)


def _duplicated(model, scale_values: float = 2.0, scale_keys: float = 3.0):
    """`model` (Qwen3, 2 KV heads, 4 query heads) re-parametrised with 4 KV heads: KV head `h` is a copy of the
    original head `h // 2`, values × `scale_values` (o_proj ÷), keys × `scale_keys` (k_norm ×, q_norm ÷). It computes
    the same function, and its K/V is an exact linear function of the original's."""
    config = model.config
    wide = qwen3(layers=config.num_hidden_layers, kv_heads=4, head_dim=config.head_dim, seed=9)
    shared = {k: v for k, v in model.state_dict().items() if not k.endswith(("k_proj.weight", "v_proj.weight"))}
    wide.load_state_dict(shared, strict=False)  # everything but the K/V projections, set below
    with torch.no_grad():
        for mine, theirs in zip(wide.model.layers, model.model.layers):
            attn, orig = mine.self_attn, theirs.self_attn
            for name, scale in (("k_proj", 1.0), ("v_proj", scale_values)):
                weight = getattr(orig, name).weight.view(2, config.head_dim, -1)  # (H, d, hidden)
                getattr(attn, name).weight.copy_(
                    scale * weight.repeat_interleave(2, 0).reshape(4 * config.head_dim, -1)
                )
            attn.o_proj.weight.copy_(orig.o_proj.weight / scale_values)
            attn.k_norm.weight.copy_(orig.k_norm.weight * scale_keys)
            attn.q_norm.weight.copy_(orig.q_norm.weight / scale_keys)
    return wide.eval()


@pytest.fixture(scope="module")
def grouped_pair():
    narrow = qwen3(layers=2, kv_heads=2, seed=5)
    wide = _duplicated(narrow)
    narrow.config.name_or_path, wide.config.name_or_path = "org/narrow", "org/wide"
    return narrow, wide


def test_the_grouped_pair_computes_the_same_function(grouped_pair):
    narrow, wide = grouped_pair
    ids = torch.randint(0, VOCAB, (1, 16))
    torch.testing.assert_close(wide(input_ids=ids).logits, narrow(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kv_mode", ["joint", "separate"])
def test_same_head_groups_heads_both_ways(grouped_pair, kv_mode):
    narrow, wide = grouped_pair
    bridge = hf_kvbridge.calibrate(
        narrow, wide, CORPUS, tokenizer=make_tokenizer(), head_mode="same_head", kv_mode=kv_mode, bidirectional=True,
        **CALIBRATION,
    )  # fmt: skip
    # 2 → 4: target heads 2h and 2h+1 read source head h; 4 → 2: target head h reads source heads 2h and 2h+1
    assert bridge.mapper.head_sources == [[0], [0], [1], [1]]
    assert bridge.reverse.mapper.head_sources == [[0, 1], [2, 3]]
    assert bridge.mapper.layers[0].weight.shape[0] == 4 * (1 if kv_mode == "joint" else 2)  # a map per target head
    _assert_recovers(bridge)
    _assert_recovers(bridge.reverse)


def test_same_head_refuses_head_counts_that_do_not_divide():
    three = llama(2, 3, 16, {"rope_type": "default", "rope_theta": 1e4}, seed=1)
    two = llama(2, 2, 16, {"rope_type": "default", "rope_theta": 1e4}, seed=2)
    three.config.name_or_path, two.config.name_or_path = "org/three", "org/two"
    message = r"'org/three' has 3 KV heads and target 'org/two' has 2.*head_mode='all_heads'"
    with pytest.raises(KVLayoutError, match=message):
        hf_kvbridge.calibrate(three, two, CORPUS, tokenizer=make_tokenizer(), head_mode="same_head", **CALIBRATION)
    with pytest.raises(KVLayoutError, match="3 KV heads"):
        same_head_sources(3, 2)
    # all_heads maps them
    bridge = hf_kvbridge.calibrate(three, two, CORPUS, tokenizer=make_tokenizer(), **CALIBRATION)
    assert bridge.map_cache(three(input_ids=torch.tensor([[1, 2, 3]])).cache).layers[0].keys.shape == (1, 2, 3, 16)


TEMPLATE = (
    "{% for m in messages %}<eos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<eos>assistant:{% endif %}"
)


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_session_hands_off_both_ways_between_layouts(grouped_pair, head_mode):
    narrow, wide = grouped_pair
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TEMPLATE
    bridge = hf_kvbridge.calibrate(
        narrow, wide, CORPUS, tokenizer=tokenizer, head_mode=head_mode, bidirectional=True, **{**CALIBRATION,
        "num_sequences": 16},
    )  # fmt: skip
    session, reference = HandoffSession(bridge, tokenizer), HandoffSession(bridge, tokenizer)
    models = {"source": narrow, "target": wide}
    for i, question in enumerate(["the fox", "a key", "small models", "rotary"]):
        model = "source" if i % 2 == 0 else "target"
        for s in (session, reference):
            s.add_user(question)
        prompt = session.prompt_tokens()
        mapped = session.sync(model, prompt, upto=len(prompt) - 1)
        if i > 0:  # the receiver's cache, mapped from the other layout, equals its own prefill
            assert mapped > 0
            state = session.states[model]
            fresh = models[model](input_ids=torch.tensor([state.tokens]), use_cache=True).cache
            for layer, own in zip(state.cache.layers, fresh.layers):
                assert layer.keys.shape == own.keys.shape
                torch.testing.assert_close(layer.keys, own.keys, atol=1e-3, rtol=1e-3)
                torch.testing.assert_close(layer.values, own.values, atol=1e-3, rtol=1e-3)
        turn = session.generate(model=model, max_new_tokens=4, do_sample=False)
        want = reference.generate(model="target", max_new_tokens=4, do_sample=False)
        assert turn.token_ids == want.token_ids, f"turn {i}"


@pytest.mark.parametrize("mapper_type", ["ridge", "low_rank", "mlp"])
def test_save_load_round_trip_keeps_both_layouts(linear_pair, tmp_path, mapper_type):
    source, target = linear_pair
    extra = {"rank": 8} if mapper_type == "low_rank" else {}
    if mapper_type == "mlp":
        extra = {"mapper_kwargs": {"hidden": 8, "epochs": 1, "steps_per_batch": 1}}
    bridge = hf_kvbridge.calibrate(
        source, target, CORPUS, tokenizer=make_tokenizer(), mapper_type=mapper_type, **CALIBRATION, **extra
    )
    bridge.save_pretrained(tmp_path / "bridge")
    loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "bridge", source_model=source, target_model=target)
    assert loaded.config.source_fingerprint["num_kv_heads"] == 2 and loaded.config.source_fingerprint["head_dim"] == 16
    assert loaded.config.target_fingerprint["num_kv_heads"] == 3 and loaded.config.target_fingerprint["head_dim"] == 8
    cache = source(input_ids=torch.tensor([[5, 6, 7, 8, 9]]), use_cache=True).cache
    want = bridge.map_cache(cache).layers[0]
    versions = [loaded]
    if mapper_type == "ridge":
        versions.append(
            KVBridgeForCausalLM.from_pretrained(
                tmp_path / "bridge", source_model=source, target_model=target, lazy_mapper=True
            )
        )
    for version in versions:
        got = version.map_cache(cache).layers[0]
        assert got.keys.shape == (1, 3, 5, 8)
        torch.testing.assert_close(got.keys, want.keys)
        torch.testing.assert_close(got.values, want.values)
    # the checkpoint belongs to this pair: the other way round is refused by its fingerprints
    with pytest.raises(KVLayoutError, match="different source model"):
        KVBridgeForCausalLM.from_pretrained(tmp_path / "bridge", source_model=target, target_model=source)
