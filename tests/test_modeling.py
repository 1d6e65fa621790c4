"""Saving, loading, Auto classes, layer order, and batched generation of a real small→large bridge."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import hf_kvbridge
from hf_kvbridge import KVBridgeConfig, KVBridgeForCausalLM
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.mappers import engine as mapping
from hf_kvbridge.utils.cache import cache_kwargs, output_cache
from tests.conftest import CORPUS, VOCAB, qwen3

# config, mapper, card and the pair's shared tokenizer (persistence.BridgeHubMixin.save_pretrained)
BRIDGE_FILES = {"config.json", "mapper.safetensors", "README.md", "tokenizer.json", "tokenizer_config.json"}


@pytest.fixture(scope="module")
def pair_bridge(saved_pair):
    return hf_kvbridge.calibrate(
        saved_pair["small"], saved_pair["large"], CORPUS, num_sequences=16, seq_len=32, top_k=2, batch_size=4
    )


def test_stacked_mapping_equals_layer_by_layer(pair_bridge):
    """Target layers reading the same source layers are mapped by one wide product: the same numbers as mapping
    them one by one (the plan really does group them here: top-2 of a 2-layer source)."""
    plan = mapping.mapping_steps(pair_bridge.mapper)
    assert plan == [([0, 1], [0, 1, 2])]
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(0))
    stacked = pair_bridge.prefill(ids)[0]
    pair_bridge.mapper.groupable = False
    try:
        single = pair_bridge.prefill(ids)[0]
    finally:
        del pair_bridge.mapper.groupable
    for a, b in zip(stacked.layers, single.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


def test_chunked_mapping_equals_one_pass(pair_bridge):
    """`map_cache` streams over tokens in chunks (ragged last chunk, left-padded batch): the same cache as one pass,
    and a cache it returned is not touched by later mappings that reuse its workspace."""
    mapper = pair_bridge.mapper
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mapper.max_chunk_bytes = None
    try:
        whole = pair_bridge.prefill(ids, mask)[0]
        pair_bridge.free_workspace()
        mapper.max_chunk_bytes, mapper.min_chunk_rows = 2 * 3 * mapping.chunk_bytes_per_token(mapper), 1
        assert mapping.chunk_tokens(mapper, 2, 14) == 3  # 5 chunks, the last of 2
        mapper.min_chunk_rows = 8
        assert (
            mapping.chunk_tokens(mapper, 2, 14) == 4 and mapping.chunk_tokens(mapper, 16, 14) == 1
        )  # products of ≥ 8 rows
        mapper.min_chunk_rows = 1
        chunked = pair_bridge.prefill(ids, mask)[0]
        kept = [(layer.keys.clone(), layer.values.clone()) for layer in chunked.layers]
        pair_bridge.prefill(ids[:, :9])  # another mapping through the same workspace
        assert 0 < pair_bridge.workspace_bytes() <= mapper.max_chunk_bytes
    finally:
        del mapper.max_chunk_bytes, mapper.min_chunk_rows
    for a, b, (keys, values) in zip(whole.layers, chunked.layers, kept):
        # other row counts → other BLAS blockings of the same float32 sums: rounding-level differences only
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)
        assert torch.equal(b.keys, keys) and torch.equal(b.values, values)
    pair_bridge.free_workspace()
    assert pair_bridge.workspace_bytes() == 0


@pytest.mark.parametrize("head_mode", ["all_heads", "same_head"])
def test_stacked_step_over_non_consecutive_source_layers(head_mode):
    """Target layers that read source layers 0 and 2 (in either order) are stacked over gathered inputs: the same
    numbers as mapping them one by one."""
    from hf_kvbridge.mappers import KVMapper

    source, target = qwen3(layers=3), qwen3(layers=2, hidden=48)
    mapper = KVMapper([[2, 0], [0, 2]], 2, 16, head_mode)
    generator = torch.Generator().manual_seed(0)
    for layer in mapper.layers:
        layer.weight.data.normal_(generator=generator)
        layer.bias.data.normal_(generator=generator)
    config = KVBridgeConfig(top_k=2, head_mode=head_mode, selected_layers=mapper.selected_layers)
    bridge = KVBridgeForCausalLM(config, source, target, mapper)
    assert mapping.mapping_steps(mapper) == [([0, 2], [0, 1])]
    ids = torch.randint(0, VOCAB, (1, 11), generator=generator)
    stacked = bridge.prefill(ids)[0]
    mapper.groupable = False
    single = bridge.prefill(ids)[0]
    for a, b in zip(stacked.layers, single.layers):
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)


@pytest.mark.parametrize("kind", ["all_heads", "same_head", "low_rank"])
def test_source_rows_share_slots_once_a_layer_is_done(monkeypatch, kind):
    """Each source layer holds a slot of the row buffer only from the first step that reads it to the last, so
    4 source layers need 2 slots here; then layers 1 and 2, read together by two stacked target layers, sit in slots
    1 and 0 (not side by side: their products are accumulated). The same caches as one slot per layer in order."""
    from hf_kvbridge.mappers import KVMapper, LowRankKVMapper

    source, target = qwen3(layers=4), qwen3(layers=4, hidden=48)
    selected = [[0, 1], [2, 1], [1, 2], [1, 3]]
    if kind == "low_rank":
        mapper = LowRankKVMapper(selected, 2, 16, "all_heads", rank=5)
    else:
        mapper = KVMapper(selected, 2, 16, kind)
    generator = torch.Generator().manual_seed(0)
    for param in mapper.parameters():
        param.data.normal_(generator=generator)
    config = KVBridgeConfig(top_k=2, selected_layers=selected, head_mode=mapper.head_mode)
    bridge = KVBridgeForCausalLM(config, source, target, mapper)
    assert mapping.mapping_steps(mapper) == [([0, 1], [0]), ([1, 2], [1, 2]), ([1, 3], [3])]
    assert mapping.row_slots(mapping.mapping_steps(mapper)) == ({0: 0, 1: 1, 2: 0, 3: 0}, 2)
    ids = torch.randint(0, VOCAB, (2, 9), generator=generator)
    shared = bridge.prefill(ids)[0]
    monkeypatch.setattr(mapping, "row_slots", lambda *plan: ({s: s for s in range(4)}, 4))
    bridge.free_workspace()
    for a, b in zip(shared.layers, bridge.prefill(ids)[0].layers):  # outputs of size ~10: float32 sums, reordered
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(a.values, b.values, rtol=1e-5, atol=1e-4)


def _same_cache(a, b):
    assert len(a.layers) == len(b.layers)
    for la, lb in zip(a.layers, b.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)


def test_calibrate_records_pair_and_provenance(pair_bridge, saved_pair):
    config = pair_bridge.config
    assert config.source_name_or_path == saved_pair["small"]
    assert config.target_name_or_path == saved_pair["large"]
    assert config.source_fingerprint["num_layers"] == 2 and config.target_fingerprint["num_layers"] == 3
    assert config.target_fingerprint["rope_parameters"]["rope_theta"] == 10000.0
    assert len(config.selected_layers) == 3 and all(len(layers) == 2 for layers in config.selected_layers)
    assert config.calibration["num_sequences"] == 16 and config.calibration["seq_len"] == 32
    assert config.calibration["heldout_sequences"] >= 1
    assert {"seed", "hf_kvbridge_version", "data", "tokens"} <= set(config.calibration)
    assert len(config.heldout_r2["k"]) == 3


def test_save_load_round_trip(pair_bridge, tmp_path):
    pair_bridge.save_pretrained(tmp_path / "bridge")
    files = {p.name for p in (tmp_path / "bridge").iterdir()}
    assert files == BRIDGE_FILES  # no source or target weights, no stray temp folders
    weights = load_file(tmp_path / "bridge" / "mapper.safetensors")
    gains = weights.pop("key_norm_gain")  # the target's key-norm gains (Qwen3: calibrate's key_norm="auto")
    assert gains.shape == (3, pair_bridge.mapper.target_head_dim) and pair_bridge.config.key_norm
    assert all(key.startswith("layers.") for key in weights)
    assert sum(t.numel() for t in weights.values()) == sum(p.numel() for p in pair_bridge.mapper.parameters())
    card = (tmp_path / "bridge" / "README.md").read_text()
    assert "library_name: hf-kvbridge" in card and "base_model" in card

    loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "bridge")  # models loaded by their recorded paths
    assert loaded.config.selected_layers == pair_bridge.config.selected_layers
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(0))
    _same_cache(loaded.prefill(ids)[0], pair_bridge.prefill(ids)[0])
    torch.testing.assert_close(loaded(ids).logits, pair_bridge(ids).logits)


def test_auto_classes_resolve_to_the_bridge(pair_bridge, tmp_path):
    pair_bridge.save_pretrained(tmp_path / "bridge")
    config = AutoConfig.from_pretrained(tmp_path / "bridge")
    assert isinstance(config, KVBridgeConfig)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "bridge")
    assert isinstance(model, KVBridgeForCausalLM)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(ids).logits, pair_bridge(ids).logits)


def test_non_monotone_layer_order_survives_save_load(windows, tmp_path):
    source, target = qwen3(layers=3, seed=3), qwen3(layers=2, hidden=48, seed=4)
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    order = [[2, 0, 1], [1, 2]]
    bridge = fit_bridge(source, target, train, heldout, selected_layers=order, top_k=None)
    assert bridge.config.selected_layers == order
    bridge.save_pretrained(tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["selected_layers"] == order
    loaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "b", source_model=source, target_model=target)
    assert loaded.config.selected_layers == order and loaded.mapper.selected_layers == order
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    _same_cache(loaded.prefill(ids)[0], bridge.prefill(ids)[0])
    # the order matters: the same layers in sorted order give a different mapper
    resorted = fit_bridge(source, target, train, heldout, selected_layers=[sorted(x) for x in order], top_k=None)
    assert not torch.allclose(resorted.prefill(ids)[0].layers[0].keys, bridge.prefill(ids)[0].layers[0].keys)


def _independent_single_layer_r2(source, target, windows, train_ids, heldout_ids, ridge_lambda=1e-3):
    """Dense reference, fitted here with `torch.linalg.solve` on each (target layer, source layer) pair: held-out R²
    of the target layer's [K | V] rows from one source layer's, mean over heads and K/V → `(L_t, L_s)`."""
    from hf_kvbridge.fitting.content_rows import cache_rows

    heads, dim = target.config.num_key_value_heads, target.config.head_dim
    width = heads * 2 * dim
    x_train, x_held = (cache_rows(source, windows[ids]).double() for ids in (train_ids, heldout_ids))
    y_train, y_held = (cache_rows(target, windows[ids]).double() for ids in (train_ids, heldout_ids))
    out = torch.zeros(y_train.shape[1] // width, x_train.shape[1] // width, dtype=torch.float64)
    for s in range(out.shape[1]):
        x, xh = x_train[:, s * width : (s + 1) * width], x_held[:, s * width : (s + 1) * width]
        xc = x - x.mean(0)
        gram = xc.T @ xc
        gram += torch.diag(ridge_lambda * gram.diagonal())  # λ relative to each feature's variance
        for t in range(out.shape[0]):
            y, yh = y_train[:, t * width : (t + 1) * width], y_held[:, t * width : (t + 1) * width]
            weight = torch.linalg.solve(gram, xc.T @ (y - y.mean(0)))
            predicted = (xh - x.mean(0)) @ weight + y.mean(0)
            sse = ((yh - predicted) ** 2).sum(0).view(heads, 2, dim).sum(-1)
            sst = ((yh - yh.mean(0)) ** 2).sum(0).view(heads, 2, dim).sum(-1)
            out[t, s] = (1 - sse / sst).mean()
    return out


@pytest.mark.parametrize("statistics_memory", [None, "blocks"])
def test_selection_picks_the_layers_an_independent_heldout_r2_ranks_best(saved_pair, tokenizer, statistics_memory):
    """Selection (dense statistics, or the budgeted selection pass) against single-layer R² computed here from the
    models' own caches: every chosen layer scores within 0.01 of the best layer it passed over."""
    from hf_kvbridge.fitting.budget import fit_bytes
    from hf_kvbridge.fitting.calibration.checks import split_heldout
    from hf_kvbridge.fitting.data import token_windows

    source = AutoModelForCausalLM.from_pretrained(saved_pair["large"])  # 3 layers → 2: a real choice at top_k=1
    target = AutoModelForCausalLM.from_pretrained(saved_pair["small"])
    budget = None
    if statistics_memory == "blocks":  # room for one target layer's top-1 block at a time, far from the dense sums
        budget = fit_bytes(1, 1, target.config.num_key_value_heads * 2 * target.config.head_dim, torch.float64) * 2
    bridge = hf_kvbridge.calibrate(
        source, target, CORPUS, num_sequences=16, seq_len=32, top_k=1, ridge_lambda=1e-3, statistics_memory=budget
    )
    windows = token_windows(CORPUS, tokenizer, 16, 32)
    train_ids, heldout_ids = split_heldout(len(windows), 0.1, 0)  # calibrate's defaults
    reference = _independent_single_layer_r2(source, target, windows, train_ids, heldout_ids)
    assert (reference.max(1).values - reference.min(1).values).min() > 0.02  # the layers differ: a wrong pick shows
    for t, layers in enumerate(bridge.config.selected_layers):
        passed_over = [s for s in range(reference.shape[1]) if s not in layers]
        assert reference[t, layers].min() >= reference[t, passed_over].max() - 0.01, (t, layers, reference[t])


def test_batched_left_padded_generation_equals_per_prompt(pair_bridge, saved_pair):
    tokenizer = AutoTokenizer.from_pretrained(saved_pair["small"], padding_side="left")
    prompts = ["The quick brown fox jumps over", "Ridge", "A key and a value are cached for every token"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    assert (batch["attention_mask"] == 0).any()
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    batched = pair_bridge.generate(**batch, **kw)
    for row, prompt in enumerate(prompts):
        single = pair_bridge.generate(**tokenizer(prompt, return_tensors="pt"), **kw)
        assert batched[row, -8:].tolist() == single[0, -8:].tolist(), prompt


def test_generate_accepts_the_targets_options(identity, pair_bridge, saved_pair):
    """Sampling options reach the target's `generate`: with the identity pair and one seed, the bridge samples the
    very tokens (and scores) the target samples on its own."""
    from transformers import TextIteratorStreamer

    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(11))
    kw = {"max_new_tokens": 5, "do_sample": True, "top_k": 5, "return_dict_in_generate": True, "output_scores": True}
    identity.transfer_counts.clear()
    torch.manual_seed(3)
    out = identity.generate(ids, **kw)
    torch.manual_seed(3)
    want = identity.target.generate(ids, **kw)
    assert identity.transfer_counts == {"transferred": 2}  # both prompts were prefilled by the source and mapped
    assert out.sequences.shape == (2, 15) and len(out.scores) == 5
    assert out.sequences.tolist() == want.sequences.tolist()
    for got, own in zip(out.scores, want.scores):
        torch.testing.assert_close(got, own, atol=2e-4, rtol=1e-4)  # top_k=5 keeps 5 finite logits per row
    assert all(int(torch.isfinite(step).sum(-1).max()) == 5 for step in out.scores)
    tokenizer = AutoTokenizer.from_pretrained(saved_pair["small"])
    inputs = tokenizer("The quick brown fox", return_tensors="pt")
    streamer = TextIteratorStreamer(tokenizer)
    pair_bridge.generate(**inputs, max_new_tokens=4, streamer=streamer, pad_token_id=tokenizer.pad_token_id)
    assert "".join(streamer).startswith("The quick brown fox")


def test_forward_logits_split_source_then_target(pair_bridge, identity):
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(6))
    out = pair_bridge(ids, prefill_length=9)
    source_logits = pair_bridge.source(ids[:, :8]).logits
    torch.testing.assert_close(out.logits[:, :8], source_logits)
    assert out.logits.shape == (1, 12, VOCAB)
    # with a cache, forward is plain target decoding
    step = pair_bridge(ids[:, -1:], past_key_values=out.past_key_values)
    assert step.past_key_values.get_seq_length() == 13
    # the target half: with source == target (near-exact mapper), positions 8 … 11 are the target's own logits, as
    # if it had run the whole sequence itself
    own = identity(ids, prefill_length=9)
    torch.testing.assert_close(own.logits[:, 8:], identity.target(ids).logits[:, 8:], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(own.logits[:, :8], identity.source(ids[:, :8]).logits)


def test_lazy_mapper_loads_one_layer_at_a_time(pair_bridge, tmp_path, monkeypatch):
    from hf_kvbridge.mappers.lazy import LazyKVMapper

    pair_bridge.save_pretrained(tmp_path / "b", max_shard_size=3000)  # several shards
    lazy = KVBridgeForCausalLM.from_pretrained(
        tmp_path / "b", source_model=pair_bridge.source, target_model=pair_bridge.target, lazy_mapper=True
    )
    assert isinstance(lazy.mapper, LazyKVMapper)
    assert all(p.device.type == "meta" for p in lazy.mapper.parameters())  # nothing resident after loading
    most = []
    real = LazyKVMapper.materialize

    def spy(self, layer):
        real(self, layer)
        most.append(len(self.loaded))

    monkeypatch.setattr(LazyKVMapper, "materialize", spy)
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(0))
    lazy_cache, eager_cache = lazy.prefill(ids)[0], pair_bridge.prefill(ids)[0]
    for a, b in zip(lazy_cache.layers, eager_cache.layers):  # layer by layer vs one stacked product: rounding only
        torch.testing.assert_close(a.keys, b.keys)
        torch.testing.assert_close(a.values, b.values)
    assert most == [1, 1, 1] and not lazy.mapper.loaded  # one target layer's weights at a time, none after


def test_threads_map_at_once_with_their_own_workspaces(pair_bridge):
    """Two threads mapping different contexts through one bridge at the same time get what each gets alone; each
    thread's workspace goes when the thread does."""
    import gc
    import threading

    contexts = [torch.randint(0, VOCAB, (2, n), generator=torch.Generator().manual_seed(n)) for n in (19, 23)]
    alone = [pair_bridge.prefill(ids)[0] for ids in contexts]
    pair_bridge.free_workspace()
    results, barrier = {}, threading.Barrier(2)

    def run(i):
        barrier.wait()
        for _ in range(20):  # overlap many mappings
            results[i] = pair_bridge.prefill(contexts[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, reference in enumerate(alone):
        for a, b in zip(results[i].layers, reference.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    del threads, thread
    gc.collect()
    assert pair_bridge.workspace_bytes() == 0


def test_stacked_weights_follow_in_place_edits(pair_bridge):
    """The stacked weights of a step are cached; editing a layer's weight or bias in place, or its layer order, is
    seen by the next mapping (the same cache as a bridge built fresh with the edited mapper)."""
    import copy

    bridge = pair_bridge.with_mapper(copy.deepcopy(pair_bridge.mapper), pair_bridge.config)
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(7))
    bridge.prefill(ids)  # fills the cache
    with torch.no_grad():
        bridge.mapper.layers[1].weight.mul_(0.5)
        bridge.mapper.layers[2].bias.add_(1.0)
    edited = bridge.prefill(ids)[0]
    fresh = pair_bridge.with_mapper(copy.deepcopy(bridge.mapper), pair_bridge.config).prefill(ids)[0]
    _same_cache(edited, fresh)
    assert not torch.equal(edited.layers[1].keys, pair_bridge.prefill(ids)[0].layers[1].keys)


def test_a_lazily_loaded_mapper_saves_its_weights(pair_bridge, tmp_path):
    pair_bridge.save_pretrained(tmp_path / "b", max_shard_size=3000)
    lazy = KVBridgeForCausalLM.from_pretrained(
        tmp_path / "b", source_model=pair_bridge.source, target_model=pair_bridge.target, lazy_mapper=True
    )
    lazy.save_pretrained(tmp_path / "again")  # meta tensors before the fix: nothing to write
    saved = load_file(tmp_path / "again" / "mapper.safetensors")
    want = pair_bridge.mapper.state_dict()
    assert saved.keys() == want.keys() and all(torch.equal(saved[k], want[k]) for k in want)
    reloaded = KVBridgeForCausalLM.from_pretrained(
        tmp_path / "again", source_model=pair_bridge.source, target_model=pair_bridge.target
    )
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    _same_cache(reloaded.prefill(ids)[0], pair_bridge.prefill(ids)[0])


def test_the_bridge_never_casts_the_callers_mapper(pair_bridge):
    mapper = pair_bridge.mapper
    before = {k: (v.dtype, v.data_ptr(), v.clone()) for k, v in mapper.state_dict().items()}
    source = copy.deepcopy(pair_bridge.source).to(torch.bfloat16)
    target = copy.deepcopy(pair_bridge.target).to(torch.bfloat16)
    half = KVBridgeForCausalLM(pair_bridge.config, source, target, mapper)
    assert half.mapper is not mapper and all(p.dtype == torch.bfloat16 for p in half.mapper.parameters())
    for key, tensor in mapper.state_dict().items():  # the caller's mapper: same tensors, same dtype, same values
        dtype, ptr, values = before[key]
        assert (tensor.dtype, tensor.data_ptr()) == (dtype, ptr) and torch.equal(tensor, values)
    # a mapper already in the right dtype and place is used as it is (no copy of a large mapper)
    assert KVBridgeForCausalLM(pair_bridge.config, pair_bridge.source, pair_bridge.target, mapper).mapper is mapper


@pytest.fixture(scope="module")
def identity(windows):
    """A bridge whose source is its target, with a near-exact mapper: it must reproduce the target."""
    model = qwen3(layers=2)
    train, heldout = collect_statistics(model, model, windows, heldout=[0, 1, 2, 3])
    return fit_bridge(model, model, train, heldout, top_k=2, ridge_lambda=1e-9)


def test_labels_loss_is_the_targets_own_loss(identity):
    ids = torch.randint(0, VOCAB, (2, 14), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    labels[0, :4] = -100  # ignored positions
    out = identity(ids, labels=labels)
    want = identity.target(ids, labels=labels).loss  # transformers' own causal LM loss
    torch.testing.assert_close(out.loss, want, atol=1e-4, rtol=1e-4)
    assert out.loss.ndim == 0 and torch.isfinite(out.loss)


def test_target_only_forwards_pass_every_argument_to_the_target(identity):
    """A prompt too short to bridge, and a step on a cache, are the target's own forward pass: the caller's labels,
    positions (with a gap, so they change the logits) and use_cache reach it."""
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(9))
    positions = torch.tensor([[0, 1, 2, 7, 8, 9]])
    mask = torch.ones_like(ids)  # explicit: without one, transformers reads a gap in positions as packed sequences
    short = identity(ids, mask, prefill_length=1, labels=ids, position_ids=positions, use_cache=False)  # no bridging
    want = identity.target(ids, attention_mask=mask, labels=ids, position_ids=positions, use_cache=False)
    torch.testing.assert_close(short.logits, want.logits)
    torch.testing.assert_close(short.loss, want.loss)
    assert output_cache(short) is None and output_cache(want) is None
    with torch.no_grad():  # a cache to copy for both runs
        cache = output_cache(identity.target(ids[:, :4], position_ids=positions[:, :4], use_cache=True))
    step_kwargs = {"attention_mask": mask, "labels": ids[:, 4:], "position_ids": positions[:, 4:]}
    step = identity(ids[:, 4:], cache=copy.deepcopy(cache), **step_kwargs)
    want = identity.target(ids[:, 4:], **cache_kwargs(copy.deepcopy(cache)), **step_kwargs)
    torch.testing.assert_close(step.logits, want.logits)
    torch.testing.assert_close(step.loss, want.loss)
    assert output_cache(step).get_seq_length() == 6


def test_caller_position_ids_reach_the_prefill(identity):
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(8))
    positions = torch.arange(14).unsqueeze(0) + 9  # e.g. a continuation of an earlier segment
    out = identity(ids, position_ids=positions)
    want = identity.target(ids, position_ids=positions).logits
    torch.testing.assert_close(out.logits[:, -1], want[:, -1], atol=2e-4, rtol=1e-4)
    cache, _ = identity.prefill(ids[:, :13], position_ids=positions[:, :13])
    own = identity.target(ids[:, :13], position_ids=positions[:, :13], use_cache=True).cache
    for a, b in zip(cache.layers, own.layers):  # keys rotated at the caller's positions, not at 0 … 12
        torch.testing.assert_close(a.keys, b.keys, atol=2e-4, rtol=1e-4)


def test_bfloat16_bridge_end_to_end(identity, tmp_path):
    model = copy.deepcopy(identity.target).to(torch.bfloat16)
    bridge = KVBridgeForCausalLM(identity.config, model, model, identity.mapper)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(9))
    cache, _ = bridge.prefill(ids[:, :15])
    assert all(layer.keys.dtype == torch.bfloat16 for layer in cache.layers)
    out = bridge(ids)
    assert out.logits.dtype == torch.bfloat16
    want = model(ids).logits
    # bfloat16 keeps ~3 significant digits: the bridged last-token logits are the target's up to that
    torch.testing.assert_close(out.logits[:, -1].float(), want[:, -1].float(), atol=3e-2, rtol=3e-2)
    generated = bridge.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (2, 20) and torch.equal(generated[:, :16], ids)
    bridge.save_pretrained(tmp_path / "bf16")
    reloaded = KVBridgeForCausalLM.from_pretrained(tmp_path / "bf16", source_model=model, target_model=model)
    assert reloaded.mapper.layers[0].weight.dtype == torch.bfloat16
    torch.testing.assert_close(reloaded(ids).logits, out.logits)


def test_text_generation_pipeline(pair_bridge, saved_pair):
    from transformers import pipeline

    tokenizer = AutoTokenizer.from_pretrained(saved_pair["small"])
    assert pair_bridge.can_generate()
    assert pair_bridge.get_input_embeddings() is pair_bridge.target.get_input_embeddings()
    assert pair_bridge.get_output_embeddings() is pair_bridge.target.get_output_embeddings()
    generator = pipeline("text-generation", model=pair_bridge, tokenizer=tokenizer)
    kw = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    (result,) = generator("The quick brown fox", **kw)
    inputs = tokenizer("The quick brown fox", return_tensors="pt")
    want = tokenizer.decode(pair_bridge.generate(**inputs, **kw)[0], skip_special_tokens=True)
    assert result["generated_text"] == want
    pair_bridge.transfer_counts.clear()
    generator("A key and a value", **kw)
    assert pair_bridge.transfer_counts == {"transferred": 1}  # the pipeline went through the bridge's prefill
