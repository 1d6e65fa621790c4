"""Multi-turn handoff: identity oracle over 10 alternating turns, incremental mapping, bounded memory, drift, chat."""

import copy
import gc
import io
import re
import shutil
import weakref

import pytest
import torch

from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.transfer.session import HandoffSession
from hf_kvbridge.transfer.steps import TransferDecision
from studies.drift import drift_conversation, drift_summary
from tests.conftest import make_tokenizer, qwen3

TEMPLATE = (
    "{% for m in messages %}<eos>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<eos>assistant:{% endif %}"
)
QUESTIONS = ["the fox", "a key", "small models", "rotary", "ridge", "the cat", "a value", "large", "pairs", "sun"]


@pytest.fixture(scope="module")
def chat_tokenizer():
    tokenizer = make_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _bidirectional(source, target, windows, **kw):
    stats = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3], reverse=True)
    bridge = fit_bridge(source, target, *stats[:2], **kw)
    bridge.reverse = fit_bridge(target, source, *stats[2:], **kw)
    return bridge


@pytest.fixture(scope="module")
def identity(windows):
    model = qwen3(layers=2)
    return _bidirectional(model, model, windows, top_k=2, ridge_lambda=1e-9)


def test_ten_turn_alternating_identity_session_equals_target_only(identity, chat_tokenizer):
    session, reference = HandoffSession(identity, chat_tokenizer), HandoffSession(identity, chat_tokenizer)
    target = identity.target
    for i, question in enumerate(QUESTIONS):
        model = "source" if i % 2 == 0 else "target"
        for s in (session, reference):
            s.add_user(question)
        # after the switch, the receiving model's cache equals a fresh prefill of the conversation by the target
        prompt = session.prompt_tokens()
        mapped = session.sync(model, prompt, upto=len(prompt) - 1)
        if i > 0:
            assert mapped > 0
            state = session.states[model]
            fresh = target(input_ids=torch.tensor([state.tokens]), use_cache=True).cache
            for layer, own in zip(state.cache.layers, fresh.layers):
                torch.testing.assert_close(layer.keys, own.keys, atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(layer.values, own.values, atol=1e-4, rtol=1e-4)
        turn = session.generate(model=model, max_new_tokens=4, do_sample=False)
        want = reference.generate(model="target", max_new_tokens=4, do_sample=False)
        assert turn.token_ids == want.token_ids, f"turn {i}"
    assert session.tokens == reference.tokens
    assert [t.model for t in session.turns] == ["source", "target"] * 5


def test_incremental_maps_only_new_tokens_and_full_remaps_all(identity, chat_tokenizer):
    counts = {}
    for remap in ("incremental", "full"):
        session = HandoffSession(identity, chat_tokenizer, remap=remap)
        session.add_user("the fox")
        session.generate(model="source", max_new_tokens=4, do_sample=False)
        session.add_user("a key")
        first = session.generate(model="target", max_new_tokens=4, do_sample=False)
        session.add_user("ridge")
        session.generate(model="source", max_new_tokens=4, do_sample=False)
        session.add_user("rotary")
        second = session.generate(model="target", max_new_tokens=4, do_sample=False)
        counts[remap] = (first.mapped_tokens, second.mapped_tokens, second.cache_tokens)
    first, second, length = counts["incremental"]
    assert second < length / 2  # only what the source added since the target's last turn
    assert counts["full"][1] > second  # full re-mapping re-maps the conversation up to there
    assert counts["full"][0] == first  # on the first switch both map everything


def test_memory_stays_bounded(identity, chat_tokenizer):
    session = HandoffSession(identity, chat_tokenizer)
    released = []
    per_token = 2 * 2 * 2 * 16 * 4  # layers × (K, V) × heads × head_dim × float32 bytes
    for i, question in enumerate(QUESTIONS):
        model = "source" if i % 2 == 0 else "target"
        old = session.states[model].cache
        if old is not None:
            released.append(weakref.ref(old.layers[0].keys))
        session.add_user(question)
        session.generate(model=model, max_new_tokens=4, do_sample=False)
        sizes = session.cache_bytes()
        for name, state in session.states.items():
            assert sizes[name] == len(state.tokens) * per_token  # exactly the conversation, nothing older
    gc.collect()
    assert released and all(
        ref() is None
        or ref() is session.states["source"].cache.layers[0].keys
        or ref() is session.states["target"].cache.layers[0].keys
        for ref in released
    )


def test_drift_harness_identity_has_no_drift(identity):
    gen = torch.Generator().manual_seed(1)
    segments = [torch.randint(0, 128, (12,), generator=gen).tolist() for _ in range(6)]
    for evaluated in ("target", "source"):
        rows = drift_conversation(identity, segments, evaluated=evaluated)
        assert [r["turn"] for r in rows] == [1, 3, 5]
        assert all(r["agreement"] == 1.0 and abs(r["nll_handoff"] - r["nll_reference"]) < 1e-3 for r in rows)
        assert all(r["mapped_tokens"] > 0 for r in rows)
    summary = drift_summary([rows, rows])
    assert summary["agreement_pp_per_turn"] == pytest.approx(0.0)


def test_drift_harness_real_pair(windows):
    bridge = _bidirectional(qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2), windows, top_k=2)
    segments = [list(range(10 + i, 22 + i)) for i in range(4)]
    rows = drift_conversation(bridge, segments, evaluated="target", remap="full")
    assert len(rows) == 2 and all(r["mapped_tokens"] > 0 for r in rows)
    # the harness measures the mapping: a scrambled mapper drifts further than the fitted one, on every turn
    scrambled = copy.deepcopy(bridge.mapper)
    with torch.no_grad():
        for layer in scrambled.layers:
            layer.weight.copy_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(0)))
    broken = bridge.with_mapper(scrambled, bridge.config)
    bad = drift_conversation(broken, segments, evaluated="target", remap="full")
    for good_row, bad_row in zip(rows, bad):
        assert good_row["nll_reference"] == pytest.approx(bad_row["nll_reference"])  # same target-only reference
    gap = sum(abs(r["nll_handoff"] - r["nll_reference"]) for r in rows)
    assert sum(abs(r["nll_handoff"] - r["nll_reference"]) for r in bad) > gap
    assert sum(r["agreement"] for r in bad) < sum(r["agreement"] for r in rows)


def test_chat_cli(saved_pair, tmp_path, monkeypatch, capsys, chat_tokenizer):
    import hf_kvbridge
    from kvbridge_cli import main

    large = tmp_path / "large"  # a copy: the session-wide pair stays without a chat template for other tests
    shutil.copytree(saved_pair["large"], large)
    chat_tokenizer.save_pretrained(large)  # give the target a chat template
    bridge = hf_kvbridge.calibrate(
        saved_pair["small"], str(large), [" ".join(QUESTIONS) * 20], num_sequences=12, seq_len=32, top_k=2
    )
    bridge.save_pretrained(tmp_path / "b")
    monkeypatch.setattr("sys.stdin", io.StringIO("the fox\n/switch\na key\n/source\nridge\n/quit\n"))
    assert main(["chat", str(tmp_path / "b"), "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "[source] mapped 0 tokens" in out
    assert out.count("[source]") == 2
    # the target maps what the source computed and the conversation still starts with: the first prompt (the
    # template renders the reply as " ttt", which tokenises unlike the generated "ttt", so the source's cached
    # reply tokens are dropped); it computes the rest itself, and caches all but its last reply token
    first = chat_tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTIONS[0]}], tokenize=False, add_generation_prompt=True
    )
    first_tokens = len(chat_tokenizer(first, add_special_tokens=False)["input_ids"])
    line = re.search(r"\[target\] mapped (\d+) tokens, prefilled (\d+), cache (\d+) tokens", out)
    assert line is not None, out
    mapped, prefilled, cached = map(int, line.groups())
    assert mapped == first_tokens > 0
    assert mapped + prefilled + 3 - 1 == cached


def test_bidirectional_checkpoint_round_trip(saved_pair, tmp_path, chat_tokenizer):
    import hf_kvbridge
    from hf_kvbridge import KVBridgeForCausalLM

    bridge = hf_kvbridge.calibrate(
        saved_pair["small"],
        saved_pair["large"],
        [" ".join(QUESTIONS) * 20],
        num_sequences=12,
        seq_len=32,
        top_k=2,
        bidirectional=True,
    )
    assert bridge.reverse is not None
    assert bridge.reverse.source is bridge.target and bridge.reverse.target is bridge.source
    assert len(bridge.reverse.config.selected_layers) == 2  # one list per layer of the small model
    bridge.save_pretrained(tmp_path / "b")
    assert (tmp_path / "b" / "reverse" / "mapper.safetensors").is_file()
    loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "b")
    assert loaded.reverse is not None and loaded.reverse.source is loaded.target
    assert loaded.reverse.config.selected_layers == bridge.reverse.config.selected_layers
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    want = bridge.reverse.prefill(ids)[0]
    got = loaded.reverse.prefill(ids)[0]
    for a, b in zip(want.layers, got.layers):
        torch.testing.assert_close(a.keys, b.keys)
    session = loaded.start_session(chat_tokenizer)
    session.add_user("the fox")
    session.generate(model="target", max_new_tokens=3, do_sample=False)
    session.add_user("a key")
    assert session.generate(model="source", max_new_tokens=3, do_sample=False).mapped_tokens > 0


def _with_policy(bridge, scramble: bool = False, **config):
    """`bridge` with a copy of its config changed (sinks, gate) and, optionally, a scrambled mapper."""
    mapper = copy.deepcopy(bridge.mapper)
    if scramble:
        with torch.no_grad():
            for layer in mapper.layers:
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(0)))
    new_config = copy.deepcopy(bridge.config)
    for key, value in config.items():
        setattr(new_config, key, value)
    return bridge.with_mapper(mapper, new_config)


def test_session_keeps_the_sinks_the_receivers_own(identity, chat_tokenizer):
    session = HandoffSession(_with_policy(identity, sink_tokens=3), chat_tokenizer)
    session.add_user("the fox")
    session.generate(model="source", max_new_tokens=4, do_sample=False)
    session.add_user("a key")
    prompt = session.prompt_tokens()
    plain = copy.deepcopy(session)
    plain.mappers["target"] = identity.transfer_side()  # the same conversation, no sinks
    everything = plain.sync("target", prompt, upto=len(prompt) - 1)
    mapped = session.sync("target", prompt, upto=len(prompt) - 1)
    assert everything > 3 and mapped == everything - 3  # what the source computed, except the 3 sink tokens
    state = session.states["target"]
    sinks = identity.target(input_ids=torch.tensor([prompt[:3]]), use_cache=True).cache
    for layer, own in zip(state.cache.layers, sinks.layers):
        assert torch.equal(layer.keys[:, :, :3], own.keys) and torch.equal(layer.values[:, :, :3], own.values)


def test_session_sinks_are_planned_and_run_by_the_transfer_steps(identity, chat_tokenizer, monkeypatch):
    """The sinks are the plan's `[0, map_start)`, run by the transfer steps: the session plans from what the
    receiver's cache holds (it runs nothing before planning), and a sync that the sinks cover whole still leaves the
    steps' decision record."""
    from hf_kvbridge.transfer import session as session_module

    planned, plan = [], session_module.plan_from_config
    monkeypatch.setattr(
        session_module, "plan_from_config", lambda *a, **k: planned.append(k["start"]) or plan(*a, **k)
    )
    for sinks in (3, 10_000):
        session = HandoffSession(_with_policy(identity, sink_tokens=sinks), chat_tokenizer)
        session.add_user("the fox")
        session.generate(model="source", max_new_tokens=4, do_sample=False)
        session.add_user("a key")
        prompt = session.prompt_tokens()
        planned.clear()
        mapped = session.sync("target", prompt, upto=len(prompt) - 1)
        decision, state = session.last_decision, session.states["target"]
        assert planned == [0] and isinstance(decision, TransferDecision) and decision.mapped_tokens == mapped
        if sinks == 3:
            assert mapped > 0 and decision.target_tokens == 3 and state.tokens == prompt[: len(state.tokens)]
        else:  # the sinks cover what the source computed: the target computed all of it itself, nothing mapped
            assert mapped == 0 and decision.transferred and len(state.tokens) == state.cache.get_seq_length() > 0
            own = identity.target(input_ids=torch.tensor([state.tokens]), use_cache=True).cache
            for layer, fresh in zip(state.cache.layers, own.layers):
                torch.testing.assert_close(layer.keys, fresh.keys, atol=1e-5, rtol=1e-5)


def test_session_gate_refuses_a_bad_mapping_and_passes_a_good_one(identity, chat_tokenizer):
    reference = HandoffSession(identity, chat_tokenizer)
    bad = _with_policy(identity, scramble=True, gate_threshold=0.9, gate_probe_tokens=4)
    good = _with_policy(identity, gate_threshold=0.99, gate_probe_tokens=4)
    sessions = {"bad": HandoffSession(bad, chat_tokenizer), "good": HandoffSession(good, chat_tokenizer)}
    for question, model in (("the fox", "source"), ("a key", "target")):
        for s in (reference, *sessions.values()):
            s.add_user(question)
        want = reference.generate(model="target", max_new_tokens=4, do_sample=False)
        turns = {name: s.generate(model=model, max_new_tokens=4, do_sample=False) for name, s in sessions.items()}
    bad, good = turns["bad"], turns["good"]
    assert bad.fell_back and bad.gate_score < 0.9 and bad.mapped_tokens == 0
    assert bad.token_ids == want.token_ids  # the target computed the conversation itself: its own reply
    assert not good.fell_back and good.gate_score > 0.999 and good.mapped_tokens > 0
    assert good.token_ids == want.token_ids
    # one decision record: the session keeps the steps' `TransferDecision`, and each turn reports its fields
    for name, turn in turns.items():
        decision = sessions[name].last_decision
        assert isinstance(decision, TransferDecision) and decision.gate == "checked"
        assert (decision.transferred, decision.score) == (not turn.fell_back, turn.gate_score)
        assert (decision.mapped_tokens, decision.recomputed_tokens) == (turn.mapped_tokens, turn.recomputed_tokens)


def _after_switch(bridge, chat_tokenizer):
    """A session that ran one source turn, then synced the target's cache for the next prompt: (session, mapped)."""
    session = HandoffSession(bridge, chat_tokenizer)
    session.add_user("the fox")
    session.generate(model="source", max_new_tokens=4, do_sample=False)
    session.add_user("a key")
    prompt = session.prompt_tokens()
    return session, session.sync("target", prompt, upto=len(prompt) - 1)


def test_session_recompute_everything_is_the_receivers_own_prefill(identity, chat_tokenizer):
    """`recompute_fraction=1` over a scrambled mapper: the target recomputes every token the sync mapped, so its cache
    is its own prefill of the conversation and its reply is the target-only reply."""
    bridge = _with_policy(identity, scramble=True, recompute_fraction=1.0)
    session, mapped = _after_switch(bridge, chat_tokenizer)
    assert mapped == 0 and session.last_sync["recomputed_tokens"] > 0
    state = session.states["target"]
    own = identity.target(input_ids=torch.tensor([state.tokens]), use_cache=True).cache
    for layer, fresh in zip(state.cache.layers, own.layers):
        torch.testing.assert_close(layer.keys, fresh.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values, fresh.values, atol=1e-4, rtol=1e-4)
    reference = HandoffSession(identity, chat_tokenizer)
    for question in ("the fox", "a key"):
        reference.add_user(question)
        want = reference.generate(model="target", max_new_tokens=4, do_sample=False)
    turn = session.generate(model="target", max_new_tokens=4, do_sample=False)
    assert turn.token_ids == want.token_ids and turn.recomputed_tokens == session.last_sync["recomputed_tokens"]


def test_session_tail_recompute_equals_the_receiver_computing_the_tail(identity, chat_tokenizer):
    """Recomputing the tail of a sync is the receiving model running those tokens itself over the mapped rest."""
    scrambled = _with_policy(identity, scramble=True)
    tail, _ = _after_switch(_with_policy(scrambled, recompute_fraction=0.25), chat_tokenizer)
    plain, everything = _after_switch(scrambled, chat_tokenizer)
    recomputed = tail.last_sync["recomputed_tokens"]
    assert recomputed > 0 and tail.last_sync["mapped_tokens"] == everything - recomputed
    state = plain.states["target"]
    untouched = [layer.keys.clone() for layer in state.cache.layers]
    tokens = state.tokens
    state.cache.crop(-recomputed)
    state.tokens = tokens[:-recomputed]
    plain._run("target", tokens)  # the target computes the last `recomputed` tokens over the mapped cache
    for mine, want in zip(tail.states["target"].cache.layers, state.cache.layers):
        torch.testing.assert_close(mine.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, want.values, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(tail.states["target"].cache.layers[-1].keys, untouched[-1])  # the tail did change
