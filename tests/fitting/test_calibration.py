"""`calibrate`, the orchestration (`hf_kvbridge.fitting.calibration.calibrate`): models loaded by reference through
`loading.load_model`, the pair checked once, the memory plan (`budget.statistics_budget`) before any text is read,
one data pass's rows however the batches are split, and the provenance a calibrated bridge records."""

from __future__ import annotations

import inspect

import pytest
import torch

import hf_kvbridge
import hf_kvbridge.fitting.calibration.calibrate as calibrate_module
import hf_kvbridge.fitting.calibration.checks as checks
import hf_kvbridge.utils.layout as layout
from hf_kvbridge.errors import StatisticsMemoryError
from hf_kvbridge.fitting.budget import (
    FitShape,
    StatisticsBudget,
    dense_bytes,
    fit_bytes,
    plan_residual,
    selection_bytes,
    statistics_budget,
)
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from tests.conftest import CORPUS, VOCAB, make_tokenizer, qwen3

SMALL = {"num_sequences": 8, "seq_len": 16, "top_k": 2, "batch_size": 4, "statistics_dtype": "float64"}


def _pair():
    return qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)


def test_calibrate_checks_the_pair_once(monkeypatch):
    """One dense calibration checks that the two models can be bridged once (`layout.check_matched`), and the data
    pass, the fit and the bridge's assembly take the layouts it found."""
    calls = []
    real = layout.check_matched

    def counting(*args, **kwargs):  # the bridge's own constructor checks its parts again (`bridge_parts`): not counted
        if not any(frame.filename.endswith("bridge_parts.py") for frame in inspect.stack()):
            calls.append(args[2:])
        return real(*args, **kwargs)

    monkeypatch.setattr(layout, "check_matched", counting)
    monkeypatch.setattr(checks, "check_matched", counting)
    source, target = _pair()
    bridge = hf_kvbridge.calibrate(source, target, CORPUS, tokenizer=make_tokenizer(), **SMALL)
    assert bridge.config.calibration["statistics"] == "dense"
    assert len(calls) == 1, calls


def test_models_given_by_reference_load_through_load_model(monkeypatch, saved_pair, tokenizer):
    """A model given by its reference loads through `loading.load_model` (its revision passed on, the load keywords
    with it) and is named by the reference it was given; the checkpoint records it."""
    loaded = []
    real = calibrate_module.load_model

    def spying(reference, revision=None, **kwargs):
        loaded.append((reference, revision, sorted(kwargs)))
        return real(reference, revision, **kwargs)

    monkeypatch.setattr(calibrate_module, "load_model", spying)
    bridge = hf_kvbridge.calibrate(
        saved_pair["small"], saved_pair["large"], CORPUS, tokenizer=tokenizer, dtype=torch.float32, **SMALL
    )
    assert loaded == [(saved_pair["small"], None, ["dtype"]), (saved_pair["large"], None, ["dtype"])]
    assert bridge.source.config.name_or_path == saved_pair["small"]
    assert bridge.config.source_name_or_path == saved_pair["small"]
    assert bridge.config.target_name_or_path == saved_pair["large"]
    assert not bridge.source.training and not bridge.target.training


def test_the_memory_plan_is_dense_when_it_fits_and_blocks_when_not():
    """`statistics_budget` keeps every layer pair's dense statistics when they fit the budget, goes by blocks (a
    selection pass, then fit passes) when they do not, and refuses what no plan fits, naming the bytes."""
    shape = {"shape": FitShape(4, 6, num_kv_heads=2, head_dim=8, top_k=2, dtype=torch.float32, groups=1), "blocks": 4,
             "statistics_device": "cpu", "batch_tokens": 64}  # fmt: skip
    dense = dense_bytes(4, 6, 2 * 2 * 8)
    assert statistics_budget(statistics_memory=dense, **shape) == StatisticsBudget(dense, "dense", None, dense)
    small = fit_bytes(2, 1, 2 * 2 * 8, torch.float32, 1)  # one target layer a pass fits, every layer at once not
    assert selection_bytes(4, 6, 2, 8, torch.float32) < small < dense
    assert statistics_budget(statistics_memory=small, **shape).mode == "blocks"
    with_residual = statistics_budget(statistics_memory=dense, residual=(3, 1, 32), **shape)
    assert with_residual.mode == "blocks" and with_residual.residual_mode in ("dense", "blocks")
    assert with_residual.fit_budget <= dense
    with pytest.raises(StatisticsMemoryError, match="statistics_memory allows 100 B"):
        statistics_budget(statistics_memory=100, **shape)
    assert statistics_budget(statistics_memory="1GB", bidirectional=True, **shape).budget == 10**9


def test_the_default_budget_is_half_the_free_memory(monkeypatch):
    import hf_kvbridge.fitting.budget as budget

    monkeypatch.setattr(budget, "free_bytes", lambda device=None: 8 * 10**9)
    shape = {"shape": FitShape(4, 6, num_kv_heads=2, head_dim=8, top_k=2, dtype=torch.float32, groups=1), "blocks": 4,
             "statistics_device": "cpu", "batch_tokens": 64}  # fmt: skip
    assert statistics_budget(statistics_memory=None, **shape) == StatisticsBudget(4 * 10**9, "dense", None, 4 * 10**9)


def test_a_batch_gives_the_same_rows_in_any_batching():
    """The data pass sums the rows of one helper per batch: batches of 1, 3 and 8 windows give the same statistics
    (with hidden-state feature rows and the residual rows of layer recompute riding along)."""
    from hf_kvbridge.fitting.calibration.residual import residual_collection
    from hf_kvbridge.fitting.statistics.dense import KVStatistics
    from hf_kvbridge.utils.source_features import SourceFeatures

    source, target = _pair()
    windows = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(3))
    src = layout.KVLayout.from_config(source.config)
    features = SourceFeatures.for_models(src, 32, "all")
    results = []
    for batch_size in (1, 3, 8):
        residual = residual_collection(KVStatistics, source, target, [1])
        train, held = collect_statistics(
            source, target, windows, heldout=[2, 5], batch_size=batch_size, residual=residual, features=features
        )
        results.append((train, held, *residual.parts))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert a.count == b.count
            torch.testing.assert_close(a.xx, b.xx, rtol=1e-9, atol=1e-8)
            torch.testing.assert_close(a.xy, b.xy, rtol=1e-9, atol=1e-8)


def test_a_calibrated_bridge_records_its_provenance():
    source, target = _pair()
    bridge = hf_kvbridge.calibrate(source, target, CORPUS, tokenizer=make_tokenizer(), **SMALL)
    record = bridge.config.calibration
    assert record["num_sequences"] == 8 and record["seq_len"] == 16 and record["tokens"] == 8 * 16
    assert record["statistics"] == "dense" and record["statistics_memory"] > 0
    assert record["hf_kvbridge_version"] == hf_kvbridge.__version__ and record["torch_version"] == torch.__version__
    assert {"forward_seconds", "statistics_seconds", "seconds", "transformers_version"} <= set(record)
    assert record["bidirectional"] is False


def test_the_residual_plan_counts_the_hidden_state_blocks():
    """With hidden-state blocks beside the K/V layers (`blocks` > source layers), layer recompute's residual
    statistics are planned beside K/V statistics of every block: a budget that fits them beside the source layers'
    statistics alone is refused."""
    shape = FitShape(4, 6, num_kv_heads=2, head_dim=8, top_k=2, dtype=torch.float32, groups=1)
    residual, budget = (5, 1, 32), 874_000
    assert plan_residual(budget, "blocks", shape, *residual) == ("blocks", "dense", budget)  # K/V layers only: fits
    options = {"statistics_memory": budget, "statistics_device": "cpu", "batch_tokens": 64, "residual": residual}
    with pytest.raises(StatisticsMemoryError, match="residual statistics"):
        statistics_budget(shape, blocks=8, **options)
    assert statistics_budget(shape, blocks=4, **options) == StatisticsBudget(budget, "blocks", "dense", budget)
