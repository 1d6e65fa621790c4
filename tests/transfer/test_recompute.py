"""Selective recompute over a mapped cache: oracles at the ends and against hold_back."""

from __future__ import annotations

import pytest
import torch

from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.transfer.plan import recompute_count
from hf_kvbridge.transfer.token_recompute import choose_tokens, recompute_tokens
from hf_kvbridge.utils.masks import positions_from_mask
from tests.conftest import VOCAB, qwen3


@pytest.fixture(scope="module")
def pair_bridge(windows):
    """A deliberately imperfect bridge (different models, small λ): mapped K/V differ from the target's own."""
    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    return fit_bridge(source, target, train, heldout, top_k=2, ridge_lambda=0.01)


def _context(batch=2, seq=14, pad=0):
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :pad] = 0
    return ids, mask, positions_from_mask(mask)


@pytest.mark.parametrize("pad", [0, 3])
def test_recomputing_every_token_is_the_targets_own_prefill(pair_bridge, pad):
    ids, mask, pos = _context(pad=pad)
    mapped = pair_bridge.map_cache(pair_bridge.source(ids, attention_mask=mask, position_ids=pos).cache, pos)
    cache = recompute_tokens(pair_bridge.target, mapped, ids, mask, pos, mask.bool())
    own = pair_bridge.target(ids, attention_mask=mask, position_ids=pos, use_cache=True).cache
    for got, want in zip(cache.layers, own.layers):
        real = mask.bool()
        torch.testing.assert_close(
            got.keys.transpose(1, 2)[real], want.keys.transpose(1, 2)[real], atol=1e-4, rtol=1e-4
        )
        torch.testing.assert_close(
            got.values.transpose(1, 2)[real], want.values.transpose(1, 2)[real], atol=1e-4, rtol=1e-4
        )


def test_recomputing_nothing_leaves_the_mapped_cache(pair_bridge):
    ids, mask, pos = _context()
    mapped = pair_bridge.map_cache(pair_bridge.source(ids).cache)
    before = [layer.keys.clone() for layer in mapped.layers]
    cache = recompute_tokens(pair_bridge.target, mapped, ids, mask, pos, torch.zeros_like(mask, dtype=torch.bool))
    assert all(torch.equal(a, layer.keys) for a, layer in zip(before, cache.layers))


def test_recomputing_the_tail_equals_hold_back(pair_bridge):
    """Recomputing the last m context tokens = the target running those m tokens itself (hold_back = m + 1)."""
    ids, mask, pos = _context(batch=1, seq=16)
    m = 4
    mapped = pair_bridge.map_cache(pair_bridge.source(ids[:, :-1]).cache)  # 15 context tokens
    chosen = choose_tokens("tail", m, mask[:, :-1])
    cache = recompute_tokens(pair_bridge.target, mapped, ids[:, :-1], mask[:, :-1], pos[:, :-1], chosen)
    got = pair_bridge.target(ids[:, -1:], position_ids=pos[:, -1:], cache=cache).logits[:, -1]
    held = pair_bridge.map_cache(pair_bridge.source(ids[:, : -1 - m]).cache)  # source runs 11, target the last 5
    want = pair_bridge.target(ids[:, -1 - m :], position_ids=pos[:, -1 - m :], cache=held).logits[:, -1]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plain = pair_bridge.target(
        ids[:, -1:], position_ids=pos[:, -1:], cache=pair_bridge.map_cache(pair_bridge.source(ids[:, :-1]).cache)
    ).logits[:, -1]
    assert (plain - want).abs().max() > 1e-3  # the recompute changed something: the mapped cache is not exact


def test_policies_choose_the_requested_count_of_real_tokens():
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, :4] = 0
    score = torch.arange(20.0).view(2, 10).flip(-1)
    for policy in ("tail", "random", "spread", "probe"):
        chosen = choose_tokens(policy, 3, mask, score=score, generator=torch.Generator().manual_seed(0))
        assert chosen.sum(-1).tolist() == [3, 3] and not (chosen & ~mask.bool()).any()
    assert choose_tokens("probe", 2, mask, score=score)[0].nonzero().squeeze(-1).tolist() == [0, 1]
    assert choose_tokens("tail", 2, mask)[1].nonzero().squeeze(-1).tolist() == [8, 9]
    assert recompute_count(0.1, 15) == 2 and recompute_count(0.0, 15) == 0
    with pytest.raises(ValueError, match="recompute_policy must be one of"):
        choose_tokens("oracle", 1, mask)


@pytest.mark.parametrize("policy", ["probe", "tail", "random", "spread"])
def test_bridge_with_recompute_fraction_one_behaves_as_the_target(pair_bridge, policy):
    import copy

    bridge = pair_bridge.with_mapper(pair_bridge.mapper, copy.deepcopy(pair_bridge.config))
    bridge.config.recompute_fraction, bridge.config.recompute_policy = 1.0, policy
    ids = torch.randint(0, VOCAB, (2, 18), generator=torch.Generator().manual_seed(11))
    out = bridge(ids, prefill_length=16)
    torch.testing.assert_close(out.logits[:, 15:], pair_bridge.target(ids).logits[:, 15:], atol=1e-4, rtol=1e-4)
    assert bridge.last_transfer["recomputed_tokens"] == 15 and bridge.last_transfer["mapped_tokens"] == 0
    prompt = ids[:, :16]
    assert torch.equal(
        bridge.generate(prompt, max_new_tokens=6, do_sample=False),
        pair_bridge.target.generate(prompt, max_new_tokens=6, do_sample=False),
    )
    bridge.config.recompute_fraction = 0.2
    bridge(ids, prefill_length=16)
    assert bridge.last_transfer["recomputed_tokens"] == 3 and bridge.last_transfer["mapped_tokens"] == 12
