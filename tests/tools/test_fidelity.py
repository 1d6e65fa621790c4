"""Fidelity on held-out text (`hf_kvbridge.tools.fidelity`, `kvbridge eval --heldout`): the next-token KL of bridge vs
target with paired bootstrap intervals (0 for an identity bridge, above 0 for a corrupted map), the retrieval probe
(on a model built to recall: the pocket models do not), both directions of a pair from the command line."""

import copy
import json
import shutil

import pytest
import torch
from torch import nn

import hf_kvbridge
from hf_kvbridge.errors import InvalidInputError
from hf_kvbridge.tools.evaluation import window_nll
from hf_kvbridge.tools.fidelity import (
    RetrievalItem,
    build_retrieval_items,
    greedy_agreement,
    heldout_fidelity,
    paired_bootstrap,
    retrieval_probe,
)
from kvbridge_cli import main
from tests.conftest import CORPUS

ROUND_OFF = 1e-6  # nats/token: float32 logits of the same distribution computed two ways


@pytest.fixture(scope="module")
def identity(saved_pair):
    """small → small with λ ≈ 0 (the map is the identity to float precision), both directions."""
    kw = {"num_sequences": 16, "seq_len": 32, "top_k": 2, "batch_size": 4, "ridge_lambda": 1e-9}
    return hf_kvbridge.calibrate(saved_pair["small"], saved_pair["small"], CORPUS, bidirectional=True, **kw)


def test_paired_bootstrap_keeps_the_pairing():
    """A difference that is the same on every window has a zero-width interval however much the windows differ (a
    two-sample resampling would not); the value is the statistic on all windows; a seed reproduces the draws."""
    a = torch.tensor([1.0, 5.0, 2.0, 9.0, 3.0, 7.0])
    result = paired_bootstrap({"a": a, "b": a + 0.25}, lambda s: float((s["b"] - s["a"]).mean()), iterations=300)
    assert result["value"] == pytest.approx(0.25) and result["low"] == pytest.approx(0.25) == result["high"]
    mean = paired_bootstrap({"a": a}, lambda s: float(s["a"].mean()), iterations=300)
    assert mean["low"] < mean["value"] < mean["high"] and mean["value"] == pytest.approx(4.5) and mean["windows"] == 6
    assert paired_bootstrap({"a": a}, lambda s: float(s["a"].mean()), iterations=300) == mean
    with pytest.raises(InvalidInputError, match="same, non-zero number of windows"):
        paired_bootstrap({"a": a, "b": a[:3]}, lambda s: 0.0)


def _corrupted(bridge, scale: float = 0.3):
    """A copy of `bridge` whose map's weights are scaled by `scale` (before it ever maps: nothing cached)."""
    broken = copy.deepcopy(bridge)
    with torch.no_grad():
        for tensor in broken.mapper.state_dict().values():
            if tensor.is_floating_point():
                tensor.mul_(scale)
    return broken


def test_identity_bridge_has_zero_kl_and_a_corrupted_map_does_not(identity, windows):
    """source == target: KL(target ‖ bridge) is 0 within round-off on every window, and so is its interval; the
    same bridge with its map scaled down: KL above 0 with an interval that excludes 0. The NLLs of the KL pass are
    the ones `window_nll` scores (same positions), and no context is far from the target."""
    ids, context = windows[:8], 32
    report = heldout_fidelity(identity, ids, context, iterations=500)
    kl = report["kl"]["bridge"]
    assert abs(kl["value"]) < ROUND_OFF and -ROUND_OFF < kl["low"] <= kl["high"] < ROUND_OFF, kl
    assert max(map(abs, report["per_window"]["kl"]["bridge"])) < ROUND_OFF
    for mode in ("target", "bridge", "no_context", "zero_cache"):
        want = window_nll(identity, ids, context, mode)
        assert report["per_window"]["nll"][mode] == pytest.approx(want.tolist(), abs=1e-5), mode
    assert report["kl"]["no_context"]["low"] > 100 * ROUND_OFF
    assert set(report["kl"]) == {"bridge", "no_context", "zero_cache", "random_cache"}
    assert report["gap_recovered"] is None and "identity pair" in report["gap_recovered_reason"]

    broken = heldout_fidelity(_corrupted(identity), ids, context, controls=False, iterations=500)
    assert broken["kl"]["bridge"]["low"] > 100 * ROUND_OFF, broken["kl"]
    assert set(broken["kl"]) == {"bridge", "no_context"} and "controls_flag" not in broken


class CopyModel(nn.Module):
    """A model built to recall: at each position it predicts (logit 30) the token that followed the latest earlier
    occurrence of the last two tokens, and is uniform where there is none (an ideal induction head)."""

    device = torch.device("cpu")

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids: torch.Tensor, **kwargs):
        batch, length = input_ids.shape
        logits = torch.zeros(batch, length, self.vocab_size)  # (B, T, V)
        keys = input_ids[:, :-1] * self.vocab_size + input_ids[:, 1:]  # (B, T - 1): the bigram ending at t + 1
        earlier = torch.ones(length - 1, length - 1, dtype=torch.bool).tril(-1)  # [t, s]: s < t
        for b in range(batch):
            match = (keys[b, :, None] == keys[b, None, :]) & earlier  # (T - 1, T - 1)
            for t in range(length - 2):
                hits = match[t].nonzero()
                if len(hits):
                    logits[b, t + 1, input_ids[b, hits[-1, 0] + 2]] = 30.0
        return type("Output", (), {"logits": logits})()


class OracleBridge:
    """A bridge whose target is `CopyModel`: `keeps_context` maps the context perfectly; otherwise the "mapped" cache
    carries nothing (the context's tokens blanked, the hold-back token kept)."""

    def __init__(self, vocab_size: int, keeps_context: bool):
        self.target, self.keeps_context = CopyModel(vocab_size), keeps_context

    def __call__(self, ids: torch.Tensor, prefill_length: int):
        if not self.keeps_context:
            ids = ids.clone()
            ids[:, : prefill_length - 1] = 0
        return self.target(input_ids=ids)


def test_retrieval_probe_scores_recall_on_a_model_built_to_recall():
    """The pocket models do not recall a fact 500 tokens back (measured: the target's answer log-probability is no
    better than with no context), so the probe's mechanics are checked on `CopyModel`: with the fact in its context
    the target gets every answer right and no context gets none (the question alone holds no fact); a bridge that
    keeps the context scores as the target, one that keeps nothing as no context."""
    from transformers import AutoTokenizer

    from hf_kvbridge import pocket

    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-s"))
    vocab = len(tokenizer)
    filler = torch.randint(3, vocab, (3, 96), generator=torch.Generator().manual_seed(0))
    items = build_retrieval_items(tokenizer, filler, context_len=96, count=3)
    assert all(len(item.context) == 96 and len(item.answer) >= 1 for item in items)
    keeps = retrieval_probe(OracleBridge(vocab, keeps_context=True), items, iterations=200)
    assert keeps["exact"] == {"target": 1.0, "bridge": 1.0, "no_context": 0.0}
    assert keeps["logprob"]["target"]["value"] == pytest.approx(0.0, abs=1e-6) == keeps["logprob"]["bridge"]["value"]
    assert keeps["target_recalls"] and keeps["gain"]["bridge"]["low"] > 1.0
    loses = retrieval_probe(OracleBridge(vocab, keeps_context=False), items, iterations=200)
    assert loses["exact"]["bridge"] == 0.0 and loses["gain"]["bridge"]["value"] == pytest.approx(0.0, abs=1e-6)
    with pytest.raises(InvalidInputError, match="retrieval item needs"):
        build_retrieval_items(tokenizer, filler, context_len=20, count=1)
    with pytest.raises(InvalidInputError, match="at least one item"):
        retrieval_probe(OracleBridge(vocab, True), [])
    assert isinstance(items[0], RetrievalItem)


def test_eval_heldout_both_directions(identity, tmp_path, capsys):
    """`kvbridge eval --heldout --both-directions`: both directions on the same windows, each with its KL, retention,
    controls and probe, in the printed tables and the JSON; `--reverse DIR` is the same from a second checkpoint; a
    bridge with no reverse mapper is refused with one line."""
    both, one = tmp_path / "both", tmp_path / "one"
    identity.save_pretrained(both)
    shutil.copytree(both, one, ignore=shutil.ignore_patterns("reverse"))  # the forward map alone
    text = tmp_path / "heldout.txt"
    text.write_text(" ".join(CORPUS * 3), encoding="utf-8")
    options = ["--heldout", str(text), "--windows", "3", "--context-len", "24", "--continuation-len", "12",
               "--probe-items", "1", "--probe-context", "64", "--bootstrap", "100"]  # fmt: skip
    out = tmp_path / "eval.json"
    assert main(["eval", str(both), *options, "--both-directions", "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("KL(target ‖ mode)") == 2 and printed.count("retrieval probe") == 2
    payload = json.loads(out.read_text())
    reports = payload["heldout"]
    assert len(reports) == 2 and payload["rows"] == [] and "lm_eval_version" not in payload
    for report in reports:
        assert report["windows"] == 3 and report["continuation_len"] == 12
        assert abs(report["kl"]["bridge"]["value"]) < ROUND_OFF
        assert report["retention"].keys() == {"bridge", "zero_cache", "random_cache"}
        assert report["probe"]["items"] == 1 and report["probe"]["logprob"]["bridge"]["value"] == pytest.approx(
            report["probe"]["logprob"]["target"]["value"], abs=1e-4
        )
    assert reports[0]["per_window"]["nll"]["target"] == reports[1]["per_window"]["nll"]["target"]  # same windows
    reverse = tmp_path / "reverse.json"
    lean = ["--modes", "target,bridge,no_context", "--probe-items", "0"]
    assert main(["eval", str(one), *options, *lean, "--reverse", str(both / "reverse"), "--output", str(reverse)]) == 0
    assert len(json.loads(reverse.read_text())["heldout"]) == 2
    capsys.readouterr()
    assert main(["eval", str(one), *options, "--both-directions"]) == 1
    err = capsys.readouterr().err
    assert "has no reverse mapper" in err and len(err.strip().splitlines()) == 1


# -- greedy_agreement: two greedy runs, the same tokens or a first difference at a near-tie ---------------------------
def test_greedy_agreement_equal_runs_and_a_run_that_stops_early():
    assert greedy_agreement([5, 7, 9], [5, 7, 9]).same
    early = greedy_agreement([5, 7], [5, 7, 9])  # one run stopped: a difference, no tie
    assert early.first_difference == 2 and not early.within(1.0)


def test_greedy_agreement_measures_each_runs_gap_at_the_first_difference():
    got_top = [{5: -0.1}, {7: -0.6900, 8: -0.6905}, {1: -0.2}]
    want_top = [{5: -0.1}, [[8, -0.6900], [7, -0.6903]], {2: -0.2}]  # vLLM's [[token, logprob], ...] form too
    tie = greedy_agreement([5, 7, 1], [5, 8, 2], got_top, want_top)
    assert tie.first_difference == 1 and tie.gaps == pytest.approx((0.0005, 0.0003))
    assert tie.within(1e-3) and not tie.within(4e-4)  # the larger of the two gaps decides
    assert "token 1" in str(tie)


def test_greedy_agreement_is_no_tie_where_the_other_token_was_not_among_the_leading_ones():
    got_top, want_top = [{7: -0.1, 3: -3.0}], [{8: -0.1, 7: -0.1001}]
    wide = greedy_agreement([7], [8], got_top, want_top)  # 8 is not among got's leading tokens
    assert wide.gaps[0] == float("inf") and not wide.within(10.0)
    assert not greedy_agreement([7], [8]).within(10.0)  # no logprobs: nothing says it was a tie
