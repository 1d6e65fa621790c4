"""`hf_kvbridge.distill`: a bridge's map trained on the target's next-token KL, on the shipped pocket family.

Oracles: the differentiable map equals the mapping engine's; a source == target bridge stays the identity (the
distilled bridge reproduces the target's logits); held-out KL goes down against the closed form on calibration
windows the training never saw; a stopped run resumes to the same result as an unstopped one."""

import copy
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

import hf_kvbridge
from hf_kvbridge import pocket
from hf_kvbridge.errors import CalibrationDataError, CheckpointFileError, ConfigurationError, InvalidInputError
from hf_kvbridge.fitting.calibration import distill as distill_module
from hf_kvbridge.fitting.calibration.checks import split_heldout
from hf_kvbridge.fitting.calibration.differentiable import PreconditionedMap, differentiable_map_cache, source_rows
from hf_kvbridge.fitting.calibration.distill import heldout_scores
from hf_kvbridge.fitting.data import token_windows
from hf_kvbridge.tools.evaluation import heldout_windows
from hf_kvbridge.utils.cache import output_cache

TINY = {"num_sequences": 24, "seq_len": 96, "continuation_len": 24, "batch_size": 4, "evals_per_epoch": 2}
CALIBRATION = {"num_sequences": 24, "seq_len": 96, "top_k": 3, "ridge_lambda": 0.1}  # a fixed λ: no λ search


@pytest.fixture(scope="module")
def pocket_parts():
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path("pocket-l"))
    small, large = pocket.load_model("pocket-s"), pocket.load_model("pocket-l")
    return tokenizer, small, large, pocket.load_texts("calibration")


@pytest.fixture(scope="module")
def bridge(pocket_parts):
    tokenizer, small, large, texts = pocket_parts
    return hf_kvbridge.calibrate(small, large, texts, tokenizer=tokenizer, **CALIBRATION)


def _weights(mapper) -> list[torch.Tensor]:
    return [p for layer in mapper.layers for p in layer.parameters()]


def _assert_same_cache(got, ref):
    for ref_layer, got_layer in zip(ref.layers, got.layers):
        torch.testing.assert_close(got_layer.keys, ref_layer.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_layer.values, ref_layer.values, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "mapping",
    [
        {"head_mode": "all_heads"},
        {"head_mode": "same_head"},
        {"mapper_type": "low_rank", "rank": 8},
        {"key_norm": "off"},
    ],
)  # fmt: skip  (pocket-l has a key norm: "auto" is on)
def test_differentiable_map_equals_the_engine(pocket_parts, mapping):
    tokenizer, small, large, texts = pocket_parts
    bridge = hf_kvbridge.calibrate(small, large, texts, tokenizer=tokenizer, **{**CALIBRATION, **mapping})
    ids = torch.randint(0, small.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    mapper = copy.deepcopy(bridge.mapper).float()
    maps = PreconditionedMap(mapper, source_rows(bridge, mapper, ids))
    with torch.no_grad():
        _assert_same_cache(differentiable_map_cache(bridge, maps, ids), bridge.map_cache(_source_cache(small, ids)))
    # gradients reach every Δ
    cache = differentiable_map_cache(bridge, maps, ids)
    sum(layer.keys.sum() + layer.values.sum() for layer in cache.layers).backward()
    assert all(d.grad is not None and d.grad.abs().sum() > 0 for d in maps.deltas)
    # a moved Δ, folded into the mapper's own weights, maps in the engine as it does here
    with torch.no_grad():
        for d in maps.deltas:
            d.normal_(0, 0.05)
        moved = differentiable_map_cache(bridge, maps, ids)
    folded = bridge.with_mapper(maps.fold(), bridge.config)
    _assert_same_cache(moved, folded.map_cache(_source_cache(small, ids)))


def _source_cache(model, ids):
    with torch.no_grad():
        return output_cache(model(input_ids=ids, use_cache=True))


def test_distillation_lowers_kl_on_held_out_windows(bridge, pocket_parts):
    tokenizer, *_, texts = pocket_parts
    settings = {**TINY, "continuation_len": 32, "heldout_fraction": 0.25, "evals_per_epoch": 1}
    before = [p.detach().clone() for p in bridge.mapper.parameters()]
    distilled = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **settings, epochs=2, lr=1e-4, pull=[0.0])
    # the input bridge's mapper is θ₀, read during training and never written (the result is a copy)
    assert all(torch.equal(a, b) for a, b in zip(before, bridge.mapper.parameters(), strict=True))
    assert distilled.mapper is not bridge.mapper
    report = distilled.config.distillation
    assert report["heldout_kl"] < report["heldout_kl_closed_form"]
    # the figure is the saved map's own: recomputed from the distilled bridge on the held-out calibration windows
    windows = token_windows(texts, tokenizer, 24, 96)
    heldout = windows[split_heldout(len(windows), 0.25, 0)[1]]
    assert _kl(distilled, heldout) == pytest.approx(report["heldout_kl"], rel=1e-4)
    assert _kl(bridge, heldout) == pytest.approx(report["heldout_kl_closed_form"], rel=1e-4)
    assert bridge.mapper.layers[0].weight.requires_grad is False  # the input bridge is untouched and frozen
    assert not any(p.requires_grad for p in distilled.mapper.parameters())


def _kl(bridge, windows) -> float:
    return _scores(bridge, windows)["kl"]


def _scores(bridge, windows, continuation_len: int = 32) -> dict[str, float]:
    mapper = copy.deepcopy(bridge.mapper).float()
    context = windows.shape[1] - continuation_len
    maps = PreconditionedMap(mapper, source_rows(bridge, mapper, windows[:, :context]))
    return heldout_scores(bridge, maps, windows, continuation_len, 8, torch.autocast("cpu", enabled=False))


def test_the_texts_own_next_tokens_train_and_choose_the_map(bridge, pocket_parts):
    """`nll_weight` adds the student's NLL of the window's own next tokens to the KL, and `select_by="nll"` stops
    and picks by the held-out NLL: it falls, and the reported figures are the saved map's own."""
    tokenizer, *_, texts = pocket_parts
    settings = {**TINY, "continuation_len": 32, "heldout_fraction": 0.25, "evals_per_epoch": 1}
    distilled = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **settings, epochs=2, lr=1e-4, pull=[0.0],
                                    nll_weight=1.0, select_by="nll")  # fmt: skip
    report = distilled.config.distillation
    assert report["select_by"] == "nll" and report["nll_weight"] == 1.0 and "NLL" in report["objective"]
    assert report["heldout_nll"] < report["heldout_nll_closed_form"]
    heldout = token_windows(texts, tokenizer, 24, 96)[split_heldout(24, 0.25, 0)[1]]
    assert _scores(distilled, heldout)["nll"] == pytest.approx(report["heldout_nll"], rel=1e-4)
    assert _scores(bridge, heldout)["nll"] == pytest.approx(report["heldout_nll_closed_form"], rel=1e-4)
    assert "NLL" in distilled.config.calibration["distillation"]  # the card's line says what trained it
    # the same run on the KL alone, chosen by the same held-out NLL, gives another map: the weight trains
    kl_only = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **settings, epochs=2, lr=1e-4, pull=[0.0],
                                  select_by="nll")  # fmt: skip
    assert kl_only.config.distillation["best_step"] > 0
    moved = [(a - b).abs().max() for a, b in zip(_weights(distilled.mapper), _weights(kl_only.mapper), strict=True)]
    assert max(moved) > 1e-4


def test_a_single_scored_token_distils_on_the_kl(bridge, pocket_parts):
    """`continuation_len=1` scores one token a window: the KL trains, and the NLL (no next token within the window)
    is reported as 0 rather than a division by zero."""
    tokenizer, *_, texts = pocket_parts
    distilled = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **{**TINY, "continuation_len": 1}, epochs=1,
                                    pull=[0.0])  # fmt: skip
    report = distilled.config.distillation
    assert report["heldout_nll"] == report["heldout_nll_closed_form"] == 0.0
    assert report["heldout_kl_closed_form"] > 0


def test_identity_pair_stays_the_identity(pocket_parts):
    tokenizer, small, _, texts = pocket_parts
    identity = hf_kvbridge.calibrate(small, small, texts, tokenizer=tokenizer, **{**CALIBRATION, "ridge_lambda": 1e-6})
    distilled = hf_kvbridge.distill(identity, texts, tokenizer=tokenizer, **TINY, epochs=1, lr=1e-4, pull=[0.0])
    ids = heldout_windows(pocket.load_texts("heldout"), tokenizer, 96, 2)
    with torch.no_grad():
        target = small(input_ids=ids).logits[:, 64:]
        bridged = distilled(ids, prefill_length=65).logits[:, 64:]
    torch.testing.assert_close(bridged, target, atol=2e-3, rtol=1e-3)
    assert distilled.config.distillation["heldout_kl"] < 1e-4
    # the student's NLL is the target's own of the text's next tokens within each window's continuation
    windows = token_windows(texts, tokenizer, 4, 96)
    with torch.no_grad():
        logits = small(input_ids=windows).logits[:, 64:-1]  # (B, 31, V): positions 64..94 predict tokens 65..95
    own = torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 65:].flatten())
    assert _scores(identity, windows)["nll"] == pytest.approx(float(own), rel=1e-4)


def test_a_stopped_run_resumes_to_the_same_result(bridge, pocket_parts, tmp_path, monkeypatch):
    tokenizer, *_, texts = pocket_parts
    settings = {"num_sequences": 12, "seq_len": 64, "continuation_len": 16, "batch_size": 4, "evals_per_epoch": 2,
                "epochs": 1, "pull": [0.0, 1.0], "lr": 1e-4}  # fmt: skip
    whole = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **settings)
    evaluations = []
    real = distill_module.heldout_scores

    def stop_on_the_third(*args):
        evaluations.append(1)
        if len(evaluations) == 3:  # baseline, one evaluation of the first run, then stopped
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(distill_module, "heldout_scores", stop_on_the_third)
    with pytest.raises(KeyboardInterrupt):
        hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, checkpoint_dir=tmp_path, **settings)
    assert (tmp_path / distill_module.STATE_NAME).is_file()  # the stopped run kept its last checkpoint
    monkeypatch.setattr(distill_module, "heldout_scores", real)
    resumed = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, checkpoint_dir=tmp_path, **settings)
    for a, b in zip(_weights(whole.mapper), _weights(resumed.mapper)):
        torch.testing.assert_close(a, b)
    assert resumed.config.distillation["heldout_kl_by_pull"] == whole.config.distillation["heldout_kl_by_pull"]
    # other settings against that checkpoint: refused, not silently mixed
    with pytest.raises(CheckpointFileError, match="another distillation"):
        hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, checkpoint_dir=tmp_path, **{**settings, "lr": 1e-3})


def test_the_teacher_cache_changes_the_cost_not_the_result(bridge, pocket_parts, monkeypatch):
    """With the teacher's last hidden states cached, each window's teacher runs the whole target once (the training
    windows, and the held-out ones at the baseline), then its LM head alone; the distilled map and its held-out KL
    are the uncached run's. A target whose logits are not its LM head of those states is left uncached (checked on
    a window first), and a budget too small for a window caches nothing: both still give the same result."""
    tokenizer, *_, texts = pocket_parts
    settings = {**TINY, "epochs": 2, "pull": [0.0, 1.0], "lr": 1e-4}
    train, heldout = (len(ids) for ids in split_heldout(TINY["num_sequences"], 0.1, 0))
    whole_target = []
    real_states = distill_module._last_states
    monkeypatch.setattr(
        distill_module, "_last_states", lambda t, ids, c: whole_target.append(len(ids)) or real_states(t, ids, c)
    )
    uncached = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **settings, teacher_cache=0)
    assert whole_target == []
    cached = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **settings)
    assert sum(whole_target) == 1 + train + heldout  # the check's window, then every window once
    for a, b in zip(_weights(uncached.mapper), _weights(cached.mapper), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    report, reference = cached.config.distillation, uncached.config.distillation
    assert report["heldout_kl_by_pull"] == pytest.approx(reference["heldout_kl_by_pull"], rel=1e-5)
    whole_target.clear()
    tiny = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **settings, teacher_cache="1KB")
    assert tiny.config.distillation["heldout_kl_by_pull"] == pytest.approx(reference["heldout_kl_by_pull"], rel=1e-5)
    assert sum(whole_target) > 2 * (train + heldout)  # nothing was kept: every teacher ran the whole target
    # logits that are not the LM head of the last states (a final soft-capping, say): the check turns the cache off
    monkeypatch.setattr(distill_module, "_head", lambda t, states: 2 * t.get_output_embeddings()(states))
    capped = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **settings)
    assert capped.config.distillation["heldout_kl_by_pull"] == pytest.approx(reference["heldout_kl_by_pull"], rel=1e-5)


def _count_forwards(monkeypatch, bridge) -> list:
    calls = []
    for model in (bridge.source, bridge.target):
        monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1) or pytest.fail("a forward ran"))
    return calls


def test_bad_input_is_refused_before_any_work(bridge, pocket_parts, monkeypatch):
    tokenizer, *_ = pocket_parts
    _count_forwards(monkeypatch, bridge)
    with pytest.raises(CalibrationDataError):  # every text shorter than one window
        hf_kvbridge.distill(bridge, ["a few words", "and a few more"], tokenizer=tokenizer, **TINY)
    with pytest.raises(ConfigurationError, match="cannot hold one window"):
        hf_kvbridge.distill(bridge, ["text " * 500], tokenizer=tokenizer, **TINY, memory="1KB")
    with pytest.raises(ConfigurationError, match="continuation_len"):
        hf_kvbridge.distill(bridge, ["text " * 500], tokenizer=tokenizer, **{**TINY, "continuation_len": 96})
    with pytest.raises(ConfigurationError, match="continuation_len must be at least 2"):
        hf_kvbridge.distill(bridge, ["text " * 500], tokenizer=tokenizer, **{**TINY, "continuation_len": 1},
                            select_by="nll")  # fmt: skip
    with pytest.raises(ConfigurationError, match="nll_weight"):
        hf_kvbridge.distill(bridge, ["text " * 500], tokenizer=tokenizer, **TINY, nll_weight=-1.0)
    with pytest.raises(ConfigurationError, match="select_by"):
        hf_kvbridge.distill(bridge, ["text " * 500], tokenizer=tokenizer, **TINY, select_by="loss")
    with pytest.raises(ConfigurationError, match="fields of DistillationSettings"):
        hf_kvbridge.distill(bridge, ["text " * 500], tokenizer=tokenizer, top_k=3)


def test_a_bridge_without_its_models_is_refused(bridge):
    hollow = copy.copy(bridge)  # the same bridge whose target holds no weights
    hollow._modules = {**bridge._modules, "target": copy.deepcopy(bridge.target).to("meta")}
    with pytest.raises(InvalidInputError, match="target model is not loaded"):
        hf_kvbridge.distill(hollow, ["text " * 500], **TINY)


def test_the_checkpoint_round_trips(bridge, pocket_parts, tmp_path):
    tokenizer, small, large, texts = pocket_parts
    distilled = hf_kvbridge.distill(bridge, texts, tokenizer=tokenizer, **TINY, epochs=1, pull=[0.0], lr=1e-4)
    distilled.save_pretrained(tmp_path / "d")
    loaded = hf_kvbridge.KVBridgeForCausalLM.from_pretrained(tmp_path / "d", source_model=small, target_model=large)
    for a, b in zip(_weights(distilled.mapper), _weights(loaded.mapper)):
        torch.testing.assert_close(a, b)
    assert loaded.config.distillation == distilled.config.distillation
    assert loaded.mapper.flops_per_token() == bridge.mapper.flops_per_token()  # same runtime cost
    card = (tmp_path / "d" / "README.md").read_text()
    assert "| distillation | map trained on the target's next-token KL" in card


def test_cli_help_needs_no_torch():
    code = "import sys; from kvbridge_cli import main\ntry: main(['distill', '--help'])\nexcept SystemExit: pass\n"
    code += "assert 'torch' not in sys.modules, 'torch imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "--continuation-len" in run.stdout and "--pull" in run.stdout


def test_kvbridge_distill_saves_a_bridge(bridge, tmp_path, capsys, monkeypatch):
    from kvbridge_cli import main

    bridge.save_pretrained(tmp_path / "closed")
    read, loaded_bridges = hf_kvbridge.KVBridgeForCausalLM.from_pretrained, []
    monkeypatch.setattr(  # the real loading, with the bridge it loaded kept to check its models' dtype
        hf_kvbridge.KVBridgeForCausalLM,
        "from_pretrained",
        lambda *a, **k: loaded_bridges.append(read(*a, **k)) or loaded_bridges[-1],
    )
    options = ["--num-sequences", "12", "--seq-len", "64", "--continuation-len", "16", "--batch-size", "4",
               "--epochs", "1", "--pull", "0", "--dtype", "float32", "--out", str(tmp_path / "distilled")]  # fmt: skip
    assert main(["distill", str(tmp_path / "closed"), "--data", "pocket", *options]) == 0
    # --dtype reaches both models (the pocket checkpoints are float16 on disk: 5x slower on this CPU)
    assert [m.dtype for m in (loaded_bridges[0].source, loaded_bridges[0].target)] == [torch.float32] * 2
    monkeypatch.undo()
    assert "held-out KL per token" in capsys.readouterr().out
    loaded = hf_kvbridge.KVBridgeForCausalLM.from_pretrained(tmp_path / "distilled")
    assert loaded.config.distillation["pull_candidates"] == [0.0]
    assert not (tmp_path / "distilled" / "distill-checkpoint").exists()  # removed once the bridge is saved
