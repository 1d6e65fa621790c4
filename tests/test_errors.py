"""Bad input gets a clear error that names the problem; nothing on disk is overwritten silently."""

import pytest
import torch

import hf_kvbridge
from hf_kvbridge import (
    CalibrationDataError,
    KVBridgeForCausalLM,
    KVLayoutError,
    MapperFileError,
    StatisticsError,
)
from hf_kvbridge.calibration import collect_statistics, fit_bridge
from hf_kvbridge.errors import ContextLengthError
from hf_kvbridge.statistics import KVStatistics
from tests.conftest import CORPUS, VOCAB, make_tokenizer, qwen3


@pytest.fixture(scope="module")
def bridge(saved_pair):
    return hf_kvbridge.calibrate(
        saved_pair["small"], saved_pair["large"], CORPUS, num_sequences=16, seq_len=32, top_k=2, batch_size=4
    )


def test_different_vocabularies_name_both_models_and_sizes():
    a, b = qwen3(), qwen3(vocab=VOCAB + 8)
    a.config.name_or_path, b.config.name_or_path = "org/small", "org/large"
    with pytest.raises(KVLayoutError, match=rf"'org/small' has vocab size = {VOCAB}.*'org/large'.*= {VOCAB + 8}"):
        hf_kvbridge.calibrate(a, b, CORPUS, tokenizer=make_tokenizer(), num_sequences=4, seq_len=16)


def test_different_vocab_size():
    with pytest.raises(KVLayoutError, match="vocab size"):
        hf_kvbridge.calibrate(
            qwen3(), qwen3(vocab=VOCAB + 8), CORPUS, tokenizer=make_tokenizer(), num_sequences=4, seq_len=16
        )


def test_different_tokenizers(tmp_path):
    other = make_tokenizer([s[::-1] for s in CORPUS])  # same size, different merges
    paths = []
    for name, tok, seed in (("a", make_tokenizer(), 0), ("b", other, 1)):
        qwen3(seed=seed).save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
        paths.append(str(tmp_path / name))
    with pytest.raises(KVLayoutError, match="different tokenizers"):
        hf_kvbridge.calibrate(*paths, CORPUS, num_sequences=4, seq_len=16)


def test_layer_types_other_than_full_and_sliding_are_refused():
    from hf_kvbridge.layout import check_supported

    config = qwen3(layers=2).config
    config.layer_types = ["full_attention", "linear_attention"]  # e.g. a hybrid linear-attention model
    with pytest.raises(KVLayoutError, match=r"layers of type \['linear_attention'\] found"):
        check_supported(config, "hybrid")


def test_wrong_pair_for_mapper(bridge, tmp_path):
    bridge.save_pretrained(tmp_path / "b")
    with pytest.raises(KVLayoutError, match="wrong mapper"):
        KVBridgeForCausalLM.from_pretrained(tmp_path / "b", target_model=qwen3(layers=4, hidden=48))
    with pytest.raises(KVLayoutError, match="num_layers: expected 2, got 3"):
        KVBridgeForCausalLM.from_pretrained(tmp_path / "b", source_model=qwen3(layers=3))


@pytest.mark.parametrize("damage", ["truncate", "garbage", "missing"])
def test_corrupt_mapper_file(bridge, tmp_path, damage):
    bridge.save_pretrained(tmp_path / "b")
    weights = tmp_path / "b" / "mapper.safetensors"
    if damage == "truncate":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    else:
        weights.unlink()
    with pytest.raises(MapperFileError, match="mapper.safetensors"):
        KVBridgeForCausalLM.from_pretrained(tmp_path / "b", source_model=bridge.source, target_model=bridge.target)


@pytest.mark.parametrize("data", [[], ["", "   "]])
def test_empty_calibration_data(data):
    with pytest.raises(CalibrationDataError, match="empty"):
        hf_kvbridge.calibrate(qwen3(), qwen3(seed=1), data, tokenizer=make_tokenizer(), num_sequences=4, seq_len=16)


def test_fewer_tokens_than_features():
    source, target = qwen3(layers=2), qwen3(layers=2, seed=1)
    windows = torch.randint(0, VOCAB, (3, 8))  # 16 train tokens for 2·2·2·16 = 128 features
    train, heldout = collect_statistics(source, target, windows, heldout=[0])
    with pytest.raises(StatisticsError, match=r"fewer calibration tokens \(16\) than mapper input features \(128\)"):
        fit_bridge(source, target, train, heldout, top_k=2)


def test_nan_statistics_are_refused():
    source, target = qwen3(), qwen3(seed=1)
    with torch.no_grad():
        source.model.layers[0].self_attn.v_proj.weight[0, 0] = float("nan")
    with pytest.raises(StatisticsError, match="NaN/Inf"):
        collect_statistics(source, target, torch.randint(0, VOCAB, (4, 16)), heldout=[0])
    stats = KVStatistics(1, 1, 1, 2)
    stats.update(torch.full((3, 4), float("inf")), torch.zeros(3, 4))
    with pytest.raises(StatisticsError, match="non-finite"):
        stats.check_finite()


def test_single_token_prompt_falls_back_to_target(bridge):
    ids = torch.tensor([[5]])
    torch.testing.assert_close(bridge(ids).logits, bridge.target(ids).logits)
    got = bridge.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(got, bridge.target.generate(ids, max_new_tokens=4, do_sample=False))


def test_prompt_longer_than_max_positions(bridge):
    ids = torch.zeros(1, 257, dtype=torch.long)
    with pytest.raises(ContextLengthError, match="at most 256 positions"):
        bridge(ids)
    with pytest.raises(ContextLengthError, match="at most 256 positions"):
        bridge.generate(ids, max_new_tokens=1)


def test_save_refuses_non_empty_foreign_dir(bridge, tmp_path):
    target_dir = tmp_path / "mine"
    target_dir.mkdir()
    (target_dir / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        bridge.save_pretrained(target_dir)
    assert sorted(p.name for p in target_dir.iterdir()) == ["notes.txt"]
    bridge.save_pretrained(target_dir, overwrite=True)
    assert (target_dir / "notes.txt").read_text() == "keep me"
    assert (target_dir / "mapper.safetensors").is_file()
