"""The one step sequence (`hf_kvbridge.transfer.steps`) gives what each of its former copies gave.

`transfer_prefill` and `HandoffSession.sync` each restated sinks → map → layer recompute → token recompute → probe
gate → decision until the three transfers (the vLLM worker the third) shared one sequence. `tests/data/
transfer_reference.pt` holds what the two library copies computed before the merge (written from commit a9a7f4f with
`KVBRIDGE_WRITE_TRANSFER_REFERENCE=1`), on float64 models so that it reads the same on any machine: every layer of
every cache, every decision, every turn of a session. The merged code must give the same caches (≤ 1e-6 relative),
the same decisions and the same turns. The vLLM worker's copy is checked end to end by the vLLM tests (served =
library).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

import hf_kvbridge
from tests.conftest import CORPUS, VOCAB, make_tokenizer, qwen3

REFERENCE = Path(__file__).parents[1] / "data" / "transfer_reference.pt"
WRITE = os.environ.get("KVBRIDGE_WRITE_TRANSFER_REFERENCE") == "1"

# knobs of each prefill scenario (applied to the bridge's config); "gate_split" sets the threshold between the two
# rows' probe scores, so that one row keeps its mapped cache and the other falls back
PREFILL = {
    "plain": {},
    "sinks_gate_pass": {"sink_tokens": 2, "gate_threshold": -1.0, "gate_probe_tokens": 3},
    "gate_split": {"gate_threshold": "split", "gate_probe_tokens": 3},
    "gate_fail": {"gate_threshold": 2.0, "gate_probe_tokens": 3},
    "gate_skipped": {"sink_tokens": 16, "gate_threshold": 0.0, "gate_probe_tokens": 8},
    "recompute_tail": {"recompute_fraction": 0.25},
    "recompute_random": {"recompute_fraction": 0.25, "recompute_policy": "random", "recompute_seed": 3},
    "recompute_probe": {"recompute_fraction": 0.25, "recompute_policy": "tail_probe"},
    "recompute_spread_sinks_gate": {
        "recompute_fraction": 0.2,
        "recompute_policy": "spread",
        "sink_tokens": 1,
        "gate_threshold": -1.0,
        "gate_probe_tokens": 2,
    },
    "layers_1": {"recompute_layers": 1},
    "layers_1_tokens_gate": {
        "recompute_layers": 1,
        "recompute_fraction": 0.2,
        "gate_threshold": -1.0,
        "gate_probe_tokens": 2,
    },  # fmt: skip
    "layers_all": {"recompute_layers": 3, "sink_tokens": 1},
}
FEATURES = {"hidden_features": {}, "hidden_features_gate": {"gate_threshold": -1.0, "gate_probe_tokens": 3}}
# knobs of each session scenario, and the turns: which model answers each user message
SESSION = {
    "plain": {},
    "sinks_gate_recompute": {
        "sink_tokens": 2,
        "gate_threshold": -1.0,
        "gate_probe_tokens": 2,
        "recompute_fraction": 0.2,
    },  # fmt: skip
    "gate_fail": {"gate_threshold": 2.0, "gate_probe_tokens": 2},
    "layers_1": {"recompute_layers": 1},
    "layers_all": {"recompute_layers": 3},
    "full_remap": {"remap": "full", "recompute_fraction": 0.2, "recompute_policy": "random"},
}
TURNS = ["source", "target", "source", "target", "target"]
MESSAGES = ["What is a cache?", "And a key?", "Why rotate?", "Say more.", "Thanks."]


def _bridges():
    """A source → target bridge with a residual map for `recompute_layers=1`, and one whose map also reads the
    source's hidden states; float64 models and statistics (a reference that reads the same on any machine)."""
    source, target = qwen3(layers=2, seed=1).double(), qwen3(layers=3, hidden=48, seed=2).double()
    # key_norm off: the reference predates it (the step sequence is what is checked here, not the map)
    common = {"tokenizer": make_tokenizer(), "num_sequences": 10, "seq_len": 24, "top_k": 2, "ridge_lambda": 0.1,
              "statistics_dtype": "float64", "key_norm": "off"}  # fmt: skip
    bridge = hf_kvbridge.calibrate(source, target, CORPUS, recompute_layers=[1], **common)
    bridge.config.recompute_layers = 0
    features = hf_kvbridge.calibrate(source, target, CORPUS, hidden_state_layers="all", **common)
    return bridge, features


def _with(bridge, knobs: dict):
    copied = copy.copy(bridge)
    copied.config = copy.deepcopy(bridge.config)
    for key, value in knobs.items():
        setattr(copied.config, key, value)
    return copied


def _layers(cache) -> list[torch.Tensor]:
    return [t.detach().clone() for layer in cache.layers for t in (layer.keys, layer.values)]


def _prompts() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # the second row is left-padded
    return ids, mask


def _prefill(bridge, knobs: dict) -> dict:
    ids, mask = _prompts()
    if knobs.get("gate_threshold") == "split":  # between the two rows' scores: one falls back
        probe = _with(bridge, {**knobs, "gate_threshold": -1.0})
        probe.prefill(ids, mask)
        knobs = {**knobs, "gate_threshold": sum(probe.last_transfer["scores"]) / 2}
    run = _with(bridge, knobs)
    cache, source_out = run.prefill(ids, mask)
    return {"cache": _layers(cache), "decision": run.last_transfer, "source_logits": source_out.logits[:, -1].clone()}


def _session(bridge, knobs: dict) -> dict:
    remap = knobs.pop("remap", "incremental")
    session = _with(bridge, knobs).start_session(make_tokenizer(), remap=remap)
    turns = []
    for model, message in zip(TURNS, MESSAGES):
        session.add_user(message)
        turn = session.generate(model=model, max_new_tokens=4, do_sample=False)
        turns.append({key: getattr(turn, key) for key in vars(turn)})
    states = {name: _layers(state.cache) for name, state in session.states.items()}
    return {"turns": turns, "caches": states, "tokens": list(session.tokens)}


def _compute() -> dict:
    bridge, features = _bridges()
    out = {f"prefill/{name}": _prefill(bridge, dict(knobs)) for name, knobs in PREFILL.items()}
    out.update({f"prefill/{name}": _prefill(features, dict(knobs)) for name, knobs in FEATURES.items()})
    out.update({f"session/{name}": _session(bridge, dict(knobs)) for name, knobs in SESSION.items()})
    return out


@pytest.fixture(scope="module")
def computed() -> dict:
    return _compute()


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.shape == b.shape, what
    a, b = a.double(), b.double()
    scale = max(float(b.abs().max()), 1e-12)
    assert float((a - b).abs().max()) <= 1e-6 * scale, what


def _same(a, b, what: str) -> None:
    if isinstance(b, torch.Tensor):
        _close(a, b, what)
    elif isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9), what
    elif isinstance(b, dict):
        assert sorted(a) == sorted(b), what
        for key in b:
            _same(a[key], b[key], f"{what}.{key}")
    elif isinstance(b, list):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    else:
        assert a == b, what


def test_write_reference(computed):
    """Writes the reference (only with `KVBRIDGE_WRITE_TRANSFER_REFERENCE=1`, from the code before the merge)."""
    if not WRITE:
        pytest.skip("the reference is written once, from the code before the merge")
    REFERENCE.parent.mkdir(exist_ok=True)
    torch.save(_as_float32(computed), REFERENCE)


def _as_float32(value):
    """The reference's tensors in float32 (half the bytes; 6e-8 relative rounding, well inside the 1e-6 compared)."""
    if isinstance(value, torch.Tensor):
        return value.float()
    if isinstance(value, dict):
        return {key: _as_float32(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_as_float32(item) for item in value]
    return value


SCENARIOS = [f"prefill/{n}" for n in [*PREFILL, *FEATURES]] + [f"session/{n}" for n in SESSION]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_step_sequence_gives_what_its_copies_gave(computed, scenario):
    reference = torch.load(REFERENCE, weights_only=False)[scenario]
    _same(computed[scenario], reference, scenario)


def test_the_reference_covers_every_step(computed):
    """The scenarios exercise every step of the sequence in both copies, each way it can end: the reference would
    prove little if, say, no gate refused or no layer was recomputed."""
    decisions = {name: out["decision"] for name, out in computed.items() if name.startswith("prefill/")}
    assert decisions["prefill/gate_split"]["rows_transferred"] == [True, False] or decisions["prefill/gate_split"][
        "rows_transferred"
    ] == [False, True]
    assert decisions["prefill/gate_fail"]["transferred"] is False
    assert decisions["prefill/gate_skipped"]["gate"] == "skipped"
    assert decisions["prefill/recompute_random"]["recomputed_tokens"] > 0
    assert decisions["prefill/layers_1"]["recomputed_layers"] == 1
    assert decisions["prefill/layers_all"]["mapped_tokens"] == 0
    turns = {name: out["turns"] for name, out in computed.items() if name.startswith("session/")}
    assert any(t["fell_back"] for t in turns["session/gate_fail"])
    assert any(t["recomputed_tokens"] for t in turns["session/sinks_gate_recompute"])
    assert any(t["recomputed_layers"] == 1 and t["mapped_tokens"] for t in turns["session/layers_1"])
    assert all(t["mapped_tokens"] == 0 for t in turns["session/layers_all"])
    assert any(t["mapped_tokens"] for t in turns["session/plain"])


def test_the_comparison_fails_on_a_changed_cache(computed):
    """The comparison above sees a change of one part in a million in one layer of one cache."""
    reference = torch.load(REFERENCE, weights_only=False)["prefill/plain"]
    changed = copy.deepcopy(computed["prefill/plain"])
    changed["cache"][3] = changed["cache"][3] * (1 + 3e-6)
    with pytest.raises(AssertionError):
        _same(changed, reference, "prefill/plain")


# -- one decision record for the vLLM worker too (issue 46) ---------------------------------------------------------
def test_a_load_is_planned_by_plan_transfer_as_the_worker_planned_it_by_hand():
    """`plan_load` (what the worker calls) gives the positions the worker's hand-built plans held: mapped span, the
    recomputed tail before the probe, the probe, the gate."""
    from hf_kvbridge.transfer.plan import plan_load

    gated = plan_load(16, 40, 44, 48, gate_threshold=0.9)  # tail [40, 44), probe [44, 48)
    assert (gated.length, gated.map_start, gated.map_end, gated.probe_start, gated.probe_tokens) == (48, 16, 40, 44, 4)
    assert (gated.gate, gated.gate_threshold, gated.recompute_tokens) == ("checked", 0.9, 0)
    no_tail = plan_load(0, 40, 40, 48, gate_threshold=0.9)
    assert (no_tail.map_start, no_tail.map_end, no_tail.probe_start, no_tail.probe_tokens) == (0, 40, 40, 8)
    plain = plan_load(16, 40, 40, 40, gate_threshold=0.9)  # no probe: no gate
    assert (plain.length, plain.map_start, plain.map_end, plain.probe_tokens, plain.gate) == (40, 16, 40, 0, None)


def test_the_threshold_is_met_in_one_place_and_the_served_record_comes_from_the_decision():
    """`TransferSteps.judge` is where a score meets the threshold (the library's `gate` and the worker's score
    averaged over tensor-parallel ranks alike; NaN, a score no rank could give, falls back with no score), and
    `served_outcome` is the worker's per-request status, read off the `TransferDecision`."""
    import ast

    from hf_kvbridge.transfer.plan import plan_load
    from hf_kvbridge.transfer.steps import TransferSteps, decide, served_outcome

    plan = plan_load(4, 12, 12, 16, gate_threshold=0.9)
    steps = TransferSteps(plan, None, positions=torch.arange(16)[None], num_layers=2)
    assert steps.judge(torch.tensor([0.95])).tolist() == [True]
    assert served_outcome(steps.decision(), plan) == {
        "status": "mapped", "mapped_tokens": 8, "score": pytest.approx(0.95), "probe_tokens": 4
    }  # fmt: skip
    assert steps.judge(torch.tensor([0.5])).tolist() == [False]
    assert served_outcome(steps.decision(), plan) == {
        "status": "gated", "mapped_tokens": 0, "score": 0.5, "threshold": 0.9, "probe_tokens": 4
    }  # fmt: skip
    steps.judge(torch.tensor([float("nan")]))
    assert served_outcome(steps.decision(), plan, reason="unreadable") == {
        "status": "gated", "mapped_tokens": 0, "score": None, "threshold": 0.9, "probe_tokens": 4,
        "reason": "unreadable",
    }  # fmt: skip
    failed = decide(plan, ok=torch.zeros(1, dtype=torch.bool))
    assert served_outcome(failed, plan, reason="boom") == {"status": "fallback", "mapped_tokens": 0, "reason": "boom"}
    plain = plan_load(4, 12, 12, 12, gate_threshold=0.9)
    assert served_outcome(decide(plain), plain) == {"status": "mapped", "mapped_tokens": 8}
    # the worker compares no score with a threshold itself (read as text: the module needs vLLM)
    tree = ast.parse((Path(hf_kvbridge.__file__).parent / "integrations" / "vllm" / "worker.py").read_text())
    compared = [ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Compare) and "threshold" in ast.unparse(n)]
    assert compared == []
