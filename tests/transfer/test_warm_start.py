"""The warm cascade (`bridge.generate_from_cache`): with source == target and an identity map it is the target's own
`generate`, and it costs the map plus the hold-back forward and nothing more."""

import copy

import pytest
import torch
from transformers import CompileConfig

from hf_kvbridge.configuration import KVBridgeConfig
from hf_kvbridge.errors import ConfigurationError, InvalidInputError
from hf_kvbridge.mappers import KVMapper
from hf_kvbridge.modeling import KVBridgeForCausalLM
from hf_kvbridge.pocket import load_model
from hf_kvbridge.transfer.prefill import positions_from_mask
from hf_kvbridge.utils.cache import cache_kwargs, output_cache
from hf_kvbridge.utils.layout import KVLayout

LENGTH, NEW = 30, 8


@pytest.fixture(scope="module")
def identity():
    """pocket-s bridged to itself by the identity map (each layer from itself, W = I): the target's own cache."""
    model = load_model("pocket-s")
    layout = KVLayout.from_config(model.config)
    selected = [[t] for t in range(layout.num_layers)]
    mapper = KVMapper(selected, layout.num_kv_heads, layout.head_dim, "all_heads")
    with torch.no_grad():
        for layer in mapper.layers:
            layer.weight[0].copy_(torch.eye(layer.weight.shape[1]))
    config = KVBridgeConfig(top_k=1, head_mode="all_heads", selected_layers=selected, ridge_lambda=0.0)
    return KVBridgeForCausalLM(config, model, model, mapper)


def _prompt(seed=0, batch=2, pad=4):
    ids = torch.randint(0, 4096, (batch, LENGTH), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1:, :pad] = 0  # the second row left-padded
    return ids, mask


def _source_cache(model, ids, mask, tokens):
    """The source's cache of the prompt's first `tokens` tokens, at generate's positions."""
    positions = positions_from_mask(mask)
    out = model(
        input_ids=ids[:, :tokens], attention_mask=mask[:, :tokens], position_ids=positions[:, :tokens], use_cache=True
    )
    return output_cache(out)


@torch.no_grad()
def test_identity_warm_start_is_the_targets_own_generate(identity):
    """Greedy, left-padded batch: the same tokens as the target's `generate`, and the first token's logits within
    float32 rounding of its own (`return_dict_in_generate` / `output_logits` as generate returns them)."""
    model = identity.target
    ids, mask = _prompt()
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                          output_logits=True)  # fmt: skip
    cache = _source_cache(model, ids, mask, LENGTH - 1)
    got = identity.generate_from_cache(cache, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                                       return_dict_in_generate=True, output_logits=True)  # fmt: skip
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == NEW
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    plain = identity.generate_from_cache(cache, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(plain, want.sequences)


@torch.no_grad()
def test_a_short_source_cache_maps_what_it_covers_and_the_target_computes_the_rest(identity):
    """A source cache of the first 11 of 30 tokens: the target's first forward runs exactly the other 19 (then one
    token a step), the source never runs, the map runs once, and the tokens are the target's own."""
    model = identity.target
    ids, mask = _prompt(seed=1)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    cache = _source_cache(model, ids, mask, 11)
    seen, maps = [], []
    hook = model.register_forward_pre_hook(lambda _, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    original = identity.map_cache
    identity.map_cache = lambda *a, **k: maps.append(a[0].get_seq_length()) or original(*a, **k)
    try:
        got = identity.generate_from_cache(cache, ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    finally:
        hook.remove()
        del identity.map_cache
    assert torch.equal(got, want)
    assert seen == [LENGTH - 11] + [1] * (NEW - 1) and maps == [11]


@torch.no_grad()
def test_one_new_token_costs_the_map_and_the_hold_back_forward(identity, monkeypatch):
    """`max_new_tokens=1` (the time to first token): one forward of the `hold_back` tokens, no `generate` call, and
    the target's own first token."""
    model = identity.target
    ids, mask = _prompt(seed=2)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    cache = _source_cache(model, ids, mask, LENGTH)  # the whole prompt cached: the last token is held back anyway
    seen = []
    hook = model.register_forward_pre_hook(lambda _, args, kw: seen.append(kw["input_ids"].shape[1]), with_kwargs=True)
    monkeypatch.setattr(model, "generate", lambda *a, **k: pytest.fail("generate was called"))
    try:
        got = identity.generate_from_cache(cache, ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    finally:
        hook.remove()
    assert torch.equal(got, want) and seen == [identity.config.hold_back]


@torch.no_grad()
def test_static_cache_eager_and_compiled_hold_back(identity):
    """`cache_implementation="static"`: the mapped cache is written into a StaticCache the bridge keeps and reuses
    (same tensors on the next call), with the hold-back eager or through the target's compiled call (here with
    torch.compile's eager backend, which needs no compiler): the target's own tokens each time."""
    model = identity.target
    ids, mask = _prompt(seed=3)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    cache = _source_cache(model, ids, mask, LENGTH - 1)
    config = copy.deepcopy(model.generation_config)
    config.compile_config = CompileConfig(backend="eager", mode=None)
    config.max_new_tokens, config.do_sample = NEW, False
    got = identity.generate_from_cache(cache, ids, attention_mask=mask, cache_implementation="static",
                                       generation_config=config)  # fmt: skip
    static = identity._warm_start["static_cache"]
    pointer = static.layers[0].keys.data_ptr()
    compiled = identity.generate_from_cache(cache, ids, attention_mask=mask, cache_implementation="static",
                                            compile_hold_back=True, generation_config=config)  # fmt: skip
    assert torch.equal(got, want) and torch.equal(compiled, want)
    assert identity._warm_start["static_cache"] is static and static.layers[0].keys.data_ptr() == pointer
    assert int(static.get_seq_length()) == LENGTH + NEW - 1
    with pytest.raises(InvalidInputError, match="static cache"):
        identity.generate_from_cache(cache, ids, attention_mask=mask, compile_hold_back=True, max_new_tokens=2)


@torch.no_grad()
def test_sampling_and_processors_choose_as_generate_does(identity):
    """Sampling (same seed, repetition penalty) and a logits processor that rules out the greedy first tokens
    (`suppress_tokens`): the target's own tokens; a streamer sees the prompt, then each token once, as with
    `generate`."""
    model = identity.target
    ids, mask = _prompt(seed=4)
    cache = _source_cache(model, ids, mask, LENGTH - 1)
    options = {"max_new_tokens": NEW, "do_sample": True, "top_k": 20, "repetition_penalty": 1.3}
    torch.manual_seed(7)
    want = model.generate(ids, attention_mask=mask, **options)
    torch.manual_seed(7)
    got = identity.generate_from_cache(cache, ids, attention_mask=mask, **options)
    assert torch.equal(got, want)
    first = model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)[:, -1].tolist()
    suppressed = {"max_new_tokens": 2, "do_sample": False, "suppress_tokens": first}  # the greedy first tokens
    want = model.generate(ids, attention_mask=mask, **suppressed)
    got = identity.generate_from_cache(cache, ids, attention_mask=mask, **suppressed)
    assert torch.equal(got, want) and not set(got[:, LENGTH].tolist()) & set(first)
    ending = {"max_new_tokens": 4, "do_sample": False, "eos_token_id": first[0], "pad_token_id": 0}  # row 0 ends
    want = model.generate(ids, attention_mask=mask, **ending)
    got = identity.generate_from_cache(cache, ids, attention_mask=mask, **ending)
    assert torch.equal(got, want) and got[0, LENGTH + 1 :].tolist() == [0] * 3

    class Recorder:
        def __init__(self):
            self.puts, self.ended = [], 0

        def put(self, value):
            self.puts.append(value.flatten().tolist())

        def end(self):
            self.ended += 1

    single = ids[:1]
    mine, theirs = Recorder(), Recorder()
    model.generate(single, max_new_tokens=4, do_sample=False, streamer=theirs)
    identity.generate_from_cache(_source_cache(model, single, torch.ones_like(single), LENGTH - 1), single,
                                 max_new_tokens=4, do_sample=False, streamer=mine)  # fmt: skip
    assert mine.puts == theirs.puts and mine.ended == theirs.ended == 1


@torch.no_grad()
def test_bad_inputs_are_refused_with_what_to_do(identity):
    model = identity.target
    ids, mask = _prompt(seed=5)
    cache = _source_cache(model, ids, mask, 10)
    right = torch.ones_like(ids)
    right[0, -3:] = 0
    with pytest.raises(InvalidInputError, match="padded on the right"):
        identity.generate_from_cache(cache, ids, attention_mask=right, max_new_tokens=2)
    with pytest.raises(InvalidInputError, match="holds 10 tokens but the prompt has 8"):
        identity.generate_from_cache(cache, ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=2)
    with pytest.raises(InvalidInputError, match="holds 2 rows but input_ids has 1"):
        identity.generate_from_cache(cache, ids[:1], max_new_tokens=2)
    with pytest.raises(InvalidInputError, match="beam search"):
        identity.generate_from_cache(cache, ids, attention_mask=mask, max_new_tokens=2, num_beams=2)
    gated = copy.copy(identity)
    gated.config = copy.deepcopy(identity.config)
    gated.config.sink_tokens = 2
    with pytest.raises(ConfigurationError, match="sink_tokens"):
        gated.generate_from_cache(cache, ids, attention_mask=mask, max_new_tokens=2)


@torch.no_grad()
def test_a_static_cache_passed_in_is_filled_in_place(identity):
    """`cache=` an empty StaticCache: it is the cache the target decodes on (no copy of the mapped cache)."""
    from transformers import StaticCache

    model = identity.target
    ids, mask = _prompt(seed=6, batch=1)
    want = model.generate(ids, max_new_tokens=3, do_sample=False)
    static = StaticCache(config=model.config, max_cache_len=LENGTH + 3)
    got = identity.generate_from_cache(_source_cache(model, ids, mask, LENGTH - 1), ids, max_new_tokens=3,
                                       do_sample=False, **cache_kwargs(static))  # fmt: skip
    assert torch.equal(got, want) and int(static.get_seq_length()) == LENGTH + 2


@torch.no_grad()
def test_the_warm_start_is_a_transfer_with_the_one_decision_record(identity, monkeypatch):
    """The map runs through the transfer steps (`TransferSteps`), over the positions of the bridge's plan of the
    tokens the source cache covers, and its `TransferDecision` is kept as `prefill` keeps its own; a plan function
    that would have the target compute tokens inside the mapped span is refused."""
    from hf_kvbridge.transfer import warm_start
    from hf_kvbridge.transfer.plan import plan_transfer
    from hf_kvbridge.transfer.steps import decide

    model = identity.target
    ids, mask = _prompt(seed=7)
    cache = _source_cache(model, ids, mask, 11)
    planned, before = [], warm_start.TransferSteps.before_target
    monkeypatch.setattr(warm_start.TransferSteps, "before_target", lambda s, *a, **k: planned.append(s.plan) or
                        before(s, *a, **k))  # fmt: skip
    identity.last_transfer, counts = None, dict(identity.transfer_counts)
    got = identity.generate_from_cache(cache, ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False))
    assert planned == [identity.transfer_plan(11)] and planned[0].map_start == 0 and planned[0].map_end == 11
    assert identity.last_transfer == decide(planned[0], batch=2).as_dict()
    assert identity.last_transfer["mapped_tokens"] == 11 and identity.last_transfer["rows_transferred"] == [True] * 2
    assert identity.transfer_counts["transferred"] == counts.get("transferred", 0) + 2
    with pytest.raises(ConfigurationError, match="sink_tokens"):
        sinks = lambda n: plan_transfer(n, sink_tokens=2)  # noqa: E731
        warm_start.generate_from_source_cache(
            model, identity.map_cache, cache, ids, attention_mask=mask, max_new_tokens=2, transfer_plan=sinks
        )
