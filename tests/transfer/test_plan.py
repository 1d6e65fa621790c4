"""The transfer plan (pure positions), and the one transfer path: `transfer_prefill` returns its decision and only
`bridge.prefill` records it; the vLLM connector claims the positions the same plan gives."""

from types import SimpleNamespace

import pytest
import torch

from hf_kvbridge import KVBridgeConfig
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.mappers.engine import map_cache
from hf_kvbridge.transfer.plan import plan_from_config, plan_prompt, plan_transfer
from hf_kvbridge.transfer.prefill import transfer_prefill
from hf_kvbridge.transfer.steps import TransferDecision
from tests.conftest import VOCAB, qwen3


@pytest.mark.parametrize(
    "length, knobs, want",
    [
        (12, {}, (0, 12, 0, None)),
        (12, {"sink_tokens": 3}, (3, 12, 0, None)),
        (12, {"sink_tokens": 3, "padding": 2}, (5, 12, 0, None)),
        (12, {"gate_threshold": 0.9, "gate_probe_tokens": 4}, (0, 8, 0, "checked")),
        (12, {"sink_tokens": 2, "gate_threshold": 0.9, "gate_probe_tokens": 4}, (2, 8, 0, "checked")),
        (12, {"sink_tokens": 10, "gate_threshold": 0.9, "gate_probe_tokens": 4}, (12, 12, 0, "skipped")),
        (3, {"gate_threshold": 0.9, "gate_probe_tokens": 4}, (3, 3, 0, "skipped")),
        (20, {"recompute_fraction": 0.1}, (0, 20, 2, None)),  # ceil(0.1 · 20)
        (20, {"recompute_fraction": 0.1, "gate_threshold": 0.5, "gate_probe_tokens": 5}, (0, 15, 2, "checked")),
        (20, {"recompute_fraction": 0.01, "sink_tokens": 4}, (4, 20, 1, None)),  # any fraction recomputes one
        (20, {"recompute_fraction": 0.25, "sink_tokens": 4}, (4, 20, 4, None)),  # a share of the mapped 16, not of 20
        (20, {"recompute_fraction": 0.3, "gate_threshold": 0.5, "gate_probe_tokens": 10}, (0, 10, 3, "checked")),
        (12, {"start": 5, "gate_threshold": 0.9, "gate_probe_tokens": 4}, (5, 8, 0, "checked")),  # a continuation
        (12, {"start": 10, "gate_threshold": 0.9, "gate_probe_tokens": 4}, (12, 12, 0, "skipped")),
        (12, {"start": 4, "sink_tokens": 2, "recompute_fraction": 0.25}, (4, 12, 2, None)),
        (0, {"recompute_fraction": 0.5}, (0, 0, 0, None)),
        (-2, {}, (0, 0, 0, None)),
    ],
)
def test_plan_positions(length, knobs, want):
    plan = plan_transfer(length, **knobs)
    assert (plan.map_start, plan.map_end, plan.recompute_tokens, plan.gate) == want
    assert plan.length == max(0, length) and plan.probe_tokens == plan.length - plan.map_end
    assert plan.target_tokens == plan.length - plan.mapped_tokens + plan.recompute_tokens
    assert plan.recompute_start == plan.map_end - plan.recompute_tokens and plan.kind == "source_prefill"


def test_plan_is_frozen_and_reads_the_config():
    config = KVBridgeConfig(sink_tokens=1, gate_threshold=0.8, gate_probe_tokens=3, recompute_fraction=0.25)
    plan = plan_from_config(13, config)
    assert plan == plan_transfer(13, sink_tokens=1, gate_threshold=0.8, gate_probe_tokens=3, recompute_fraction=0.25)
    assert plan_prompt(15, config, hold_back=2) == plan and plan_prompt(13 + config.hold_back, config) == plan
    with pytest.raises(AttributeError):
        plan.map_end = 0


@pytest.fixture(scope="module")
def bridge(windows):
    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    train, heldout = collect_statistics(source, target, windows, heldout=[0, 1, 2, 3])
    return fit_bridge(source, target, train, heldout, top_k=2)


@pytest.mark.parametrize(
    "knobs",
    [
        {},
        {"sink_tokens": 3},
        {"gate_threshold": 0.0, "gate_probe_tokens": 4},
        {"recompute_fraction": 0.2, "gate_threshold": 0.0, "gate_probe_tokens": 3},
        {"sink_tokens": 10, "gate_threshold": 0.0, "gate_probe_tokens": 4},
    ],
)
def test_prefill_follows_the_plan(bridge, knobs, monkeypatch):
    for key, value in {"sink_tokens": 0, "gate_threshold": None, "recompute_fraction": 0.0, **knobs}.items():
        monkeypatch.setattr(bridge.config, key, value)
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(0))
    bridge.prefill(ids)
    plan = bridge.transfer_plan(14)
    decision = bridge.last_transfer
    assert decision["mapped_tokens"] == plan.mapped_tokens - plan.recompute_tokens
    assert decision["target_tokens"] == plan.target_tokens and decision["gate"] == plan.gate
    assert decision["recomputed_tokens"] == plan.recompute_tokens


def test_prefill_maps_what_the_plan_says(bridge, monkeypatch):
    """`prefill` takes its positions from `transfer_plan`, nothing of its own: a different plan maps differently."""
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(
        type(bridge), "transfer_plan", lambda self, length, padding=0: plan_transfer(length, sink_tokens=5)
    )
    bridge.prefill(ids)
    assert bridge.last_transfer["mapped_tokens"] == 9 and bridge.last_transfer["target_tokens"] == 5


def test_transfer_prefill_needs_no_bridge(bridge):
    """The core transfer takes models, a map function and a plan, and returns its decision; it records nothing."""
    source, target = bridge.source, bridge.target
    calls = []

    def map_fn(source_cache, position_ids, target_cache=None):
        calls.append(position_ids.shape[-1])
        return map_cache(source, target, bridge.mapper, bridge.source_layout, source_cache, position_ids, target_cache)

    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    plan = plan_transfer(12, sink_tokens=2, gate_threshold=0.0, gate_probe_tokens=3)
    bridge.transfer_counts.clear()
    bridge.last_transfer = None
    result = transfer_prefill(source, target, map_fn, plan, ids)
    assert calls == [7, 3]  # the mapped span, then the probe
    assert isinstance(result.decision, TransferDecision) and result.decision.gate == "checked"
    assert result.decision.rows_transferred == [True, True] and result.decision.counts() == {"transferred": 2}
    assert (result.decision.mapped_tokens, result.decision.target_tokens) == (7, 5)
    assert result.cache.get_seq_length() == 12 and result.source_outputs.logits.shape[:2] == (2, 12)
    transfer_prefill(source, target, bridge.map_cache, plan, ids)  # even bound to the bridge's own mapping
    assert bridge.transfer_counts == {} and bridge.last_transfer is None  # only prefill records
    cache, _ = bridge.prefill(ids)
    assert bridge.transfer_counts == {"transferred": 2}
    with pytest.raises(ValueError, match="plan covers 12 tokens"):
        transfer_prefill(source, target, map_fn, plan, ids[:, :10])


def test_vllm_connector_claims_the_plans_positions(bridge, monkeypatch):
    """The connector's scheduler side claims what `bridge.prefill` plans for the prompt less its hold-back, and its
    loads probe the plan's probe: no positions of its own."""
    pytest.importorskip("vllm")  # the connector's scheduler imports vLLM (the integration package loads it lazily)
    from hf_kvbridge.integrations import vllm

    for knobs in (
        {},
        {"gate_threshold": 0.9, "gate_probe_tokens": 4},
        {"recompute_fraction": 0.2},
        {"recompute_fraction": 0.3, "gate_threshold": 0.9, "gate_probe_tokens": 3},
    ):
        for key, value in {"gate_threshold": None, "recompute_fraction": 0.0, **knobs}.items():
            monkeypatch.setattr(bridge.config, key, value)
        for hold_back in (1, 3):
            scheduler = vllm.BridgeScheduler(
                bridge.config, hold_back=hold_back, requests_mode="all", salt_tag="kvbridge:t", count=lambda **_: None
            )
            for prompt in range(0, 40, 3):
                plan = bridge.transfer_plan(prompt - hold_back)  # what bridge.generate's prefill follows
                assert scheduler.plan(prompt) == plan == plan_prompt(prompt, bridge.config, hold_back=hold_back)
                end = scheduler.map_end(prompt)
                assert end == (plan.recompute_start if plan.mapped_tokens else 0)
                if end > 0:  # the load's probe is the plan's: [map_end, length)
                    request = SimpleNamespace(request_id="r", num_prompt_tokens=prompt, prompt_token_ids=[0] * prompt)
                    claim = vllm.scheduler._Claim(0, end, 0, "prefill")  # the cold path's claim of [0, end)
                    load = scheduler.load(request, 0, claim, list(range(8)), {"r": prompt})
                    want = (plan.map_end, plan.length) if plan.gate == "checked" else (end, end)
                    assert (load.probe_start, load.probe_end) == want
