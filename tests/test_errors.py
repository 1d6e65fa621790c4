"""Bad input gets a clear error that names the problem; nothing on disk is overwritten silently; the package raises
its own error classes (`hf_kvbridge.errors`), never a bare `ValueError`/`TypeError`/`RuntimeError`."""

import ast
from pathlib import Path

import pytest
import torch

import hf_kvbridge
from hf_kvbridge import (
    CalibrationDataError,
    KVBridgeConfig,
    KVBridgeForCausalLM,
    KVLayoutError,
    MapperFileError,
    StatisticsError,
)
from hf_kvbridge.errors import (
    CheckpointExistsError,
    CheckpointFileError,
    ConfigurationError,
    ContextLengthError,
    EvaluationError,
    InvalidInputError,
)
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.statistics.dense import KVStatistics
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
    from hf_kvbridge.utils.layout import check_supported

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


def test_fewer_tokens_than_features_unregularised_is_refused_and_a_ridge_fit_warns(caplog):
    """λ = 0 from fewer tokens than inputs has no unique answer and is refused; auto-λ is well posed at any count
    (the paper's map of 12,288 inputs on a few thousand tokens) and fits, with a warning."""
    source, target = qwen3(layers=2), qwen3(layers=2, seed=1)
    windows = torch.randint(0, VOCAB, (3, 8))  # 16 train tokens for 2·2·2·16 = 128 features
    train, heldout = collect_statistics(source, target, windows, heldout=[0])
    with pytest.raises(StatisticsError, match=r"fewer calibration tokens \(16\) than mapper input features \(128\)"):
        fit_bridge(source, target, train, heldout, top_k=2, ridge_lambda=0.0)
    with caplog.at_level("WARNING", logger="hf_kvbridge.fitting.calibration"):
        bridge = fit_bridge(source, target, train, heldout, top_k=2)
    assert "16 training tokens for maps of 128 input features" in caplog.text
    assert all(torch.isfinite(p).all() for p in bridge.mapper.parameters())
    assert bridge.config.ridge_lambdas and all(lam > 0 for row in bridge.config.ridge_lambdas["k"] for lam in row)


@pytest.mark.parametrize("entry", ["calibrate", "fit_in_passes"])
def test_an_unregularised_fit_from_too_few_tokens_is_refused_before_any_pass(entry, monkeypatch):
    import hf_kvbridge.fitting.calibration.budgeted_fit as calibration
    import hf_kvbridge.fitting.calibration.calibrate as calibrate_module

    def no_pass(*args, **kwargs):
        raise AssertionError("a pass over the data ran before the token count was checked")

    monkeypatch.setattr(calibration, "collect_statistics", no_pass)
    monkeypatch.setattr(calibrate_module, "collect_statistics", no_pass)
    source, target = qwen3(layers=2), qwen3(layers=2, seed=1)
    message = r"fewer calibration tokens \(48\) than mapper input features \(128\)"
    with pytest.raises(StatisticsError, match=message):
        if entry == "calibrate":
            hf_kvbridge.calibrate(source, target, CORPUS, tokenizer=make_tokenizer(), num_sequences=4, seq_len=16,
                                  ridge_lambda=0.0, top_k=2)  # fmt: skip
        else:  # 3 of 4 windows of 16 tokens train
            windows = torch.randint(0, VOCAB, (4, 16))
            calibration.fit_in_passes(source, target, windows, [0], statistics_memory=10**9, top_k=2,
                                             ridge_lambda=0.0)  # fmt: skip


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


# -- the library's own error classes ------------------------------------------------------------------------------

PACKAGE = Path(__file__).resolve().parents[1] / "hf_kvbridge"
BUILTINS = {"ValueError", "TypeError", "RuntimeError"}


def bare_raises(path: Path) -> list[str]:
    """`line: raise X(...)` for every `raise ValueError/TypeError/RuntimeError` in `path` (read with `ast`: strings
    and comments do not count); the library raises its own classes from `hf_kvbridge.errors` instead."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(exc, ast.Name) and exc.id in BUILTINS:
                found.append((node.lineno, exc.id))
    return [f"{line}: raise {name}" for line, name in sorted(found)]


def _package_bare_raises() -> dict[str, list[str]]:
    found = {p.relative_to(PACKAGE).as_posix(): bare_raises(p) for p in sorted(PACKAGE.rglob("*.py"))}
    return {name: lines for name, lines in found.items() if lines}


def test_no_bare_builtin_raises_anywhere_in_the_package():
    """Every error the package raises on purpose is a `KVBridgeError` (which still derives from the builtin)."""
    assert _package_bare_raises() == {}


def test_the_raise_checker_sees_bare_raises_and_spares_the_librarys(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        '"""raise ValueError( in a docstring"""\n'
        "from hf_kvbridge.errors import InvalidInputError\n"
        "def f(x):\n"
        "    if x:\n"
        "        raise ValueError(f'bad {x}')\n"
        "    raise InvalidInputError('bad')  # raise TypeError( in a comment\n"
        "def g():\n"
        "    raise RuntimeError\n"
    )
    assert bare_raises(path) == ["5: raise ValueError", "8: raise RuntimeError"]


def test_every_error_class_derives_from_kvbridge_error_and_a_builtin():
    import hf_kvbridge.errors as errors

    for name in errors.__all__:
        cls = getattr(errors, name)
        assert issubclass(cls, errors.KVBridgeError)
        if cls is not errors.KVBridgeError:
            assert any(issubclass(cls, b) for b in (ValueError, OSError, ImportError, MemoryError)), name


def test_bad_config_values_raise_configuration_error():
    from hf_kvbridge.utils.sizes import parse_bytes

    with pytest.raises(ConfigurationError, match=r"head_mode must be one of .*got 'per_token'"):
        KVBridgeConfig(head_mode="per_token")
    with pytest.raises(ConfigurationError, match="gate_probe_tokens=0"):
        KVBridgeConfig(gate_probe_tokens=0)
    with pytest.raises(ConfigurationError, match=r"recompute_fraction must lie in \[0, 1\], got 1.5"):
        KVBridgeConfig(recompute_fraction=1.5)
    with pytest.raises(ValueError, match="statistics_memory must be a size such as '16GB'.*got 'lots'"):
        parse_bytes("lots")  # still a ValueError for callers that catch the builtin


def test_bad_call_arguments_raise_invalid_input_error(tokenizer):
    from hf_kvbridge.controls import control_cache
    from hf_kvbridge.fitting.data import token_windows
    from hf_kvbridge.fitting.layer_selection import select_layers
    from hf_kvbridge.loading import load_model
    from hf_kvbridge.pocket import model_path

    with pytest.raises(InvalidInputError, match="top_k must be ≥ 1"):
        select_layers(torch.zeros(2, 2, 2), top_k=0)
    with pytest.raises(InvalidInputError, match="num_sequences=0"):
        token_windows(CORPUS, tokenizer, num_sequences=0, seq_len=16)
    with pytest.raises(InvalidInputError, match=r"control mode must be one of .*'half_cache'"):
        control_cache(None, "half_cache")
    with pytest.raises(InvalidInputError, match="unknown pocket model 'pocket-q'; available: pocket-s"):
        model_path("pocket-q")
    with pytest.raises(InvalidInputError, match="does not record this model.*source_model="):
        load_model("")


def test_layout_and_cache_mismatches_raise_kv_layout_error():
    from hf_kvbridge.utils.cache import check_cache_shape
    from hf_kvbridge.utils.rope import rotary_module

    with pytest.raises(KVLayoutError, match="Linear has no `rotary_emb` module"):
        rotary_module(torch.nn.Linear(2, 2))
    model = qwen3(layers=2)
    cache = model(torch.randint(0, VOCAB, (1, 5)), use_cache=True).past_key_values
    with pytest.raises(KVLayoutError, match="target cache has 2 layers, expected 3"):
        check_cache_shape(cache, 3, 2, 16, "target")
    with pytest.raises(KVLayoutError, match=r"target cache layer 0 keys have shape \(1, 2, 5, 16\), expected"):
        check_cache_shape(cache, 2, 4, 16, "target")


def test_evaluation_refusals_raise_evaluation_error(tokenizer):
    from hf_kvbridge.integrations.lm_eval import rolling_chunks
    from hf_kvbridge.tools.evaluation import heldout_windows

    with pytest.raises(EvaluationError, match=r"rolling_stride must be in \[1, max_length=20\], got 0"):
        list(rolling_chunks(list(range(10)), 7, max_length=20, stride=0))
    with pytest.raises(EvaluationError, match="no held-out document has 4096 tokens; use shorter windows"):
        heldout_windows(["a short text"], tokenizer, 4096, 4)


def test_checkpoint_file_problems_raise_checkpoint_errors(bridge, tmp_path):
    from hf_kvbridge.persistence import read_config_dict

    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointExistsError, match="is a file; save the bridge into a folder"):
        bridge.save_pretrained(tmp_path / "file")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointFileError, match=r"cannot read the bridge config .*config.json.*save it again"):
        read_config_dict(tmp_path / "bad")
    assert issubclass(CheckpointExistsError, FileExistsError) and issubclass(CheckpointFileError, OSError)
