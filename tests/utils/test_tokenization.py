"""Tokenizer identity, not vocabulary size: what a pair must share."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken

import hf_kvbridge
from hf_kvbridge.errors import KVLayoutError
from hf_kvbridge.utils.tokenization import check_same_tokenizer, tokenizer_difference
from tests.conftest import CORPUS, make_tokenizer, qwen3


def test_identical_tokenizers_saved_separately_are_the_same(tmp_path):
    from transformers import AutoTokenizer

    for name in ("a", "b"):
        make_tokenizer().save_pretrained(tmp_path / name)
    first, second = (AutoTokenizer.from_pretrained(tmp_path / name) for name in ("a", "b"))
    assert first is not second
    assert tokenizer_difference(first, second) is None


def test_same_vocabulary_size_other_vocabulary_is_named():
    other = make_tokenizer([s[::-1] for s in CORPUS])  # same size, other tokens
    assert len(other.get_vocab()) == len(make_tokenizer().get_vocab())
    with pytest.raises(KVLayoutError, match=r"'source s' and 'target t' use different tokenizers \(token .* is id"):
        check_same_tokenizer(make_tokenizer(), other, "source s", "target t")


def test_other_special_tokens_are_named():
    first, second = make_tokenizer(), make_tokenizer()
    second.add_special_tokens({"additional_special_tokens": [AddedToken("<tool>", special=True)]})
    assert "vocabulary sizes" in tokenizer_difference(first, second)
    third = make_tokenizer()
    third.eos_token = "<pad>"  # same vocabulary, another special-token assignment
    assert "special tokens" in tokenizer_difference(first, third)


def test_other_merges_with_the_same_vocabulary_are_named():
    first, second = make_tokenizer(), make_tokenizer()
    state = second.backend_tokenizer.to_str()
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(state)
    spec["model"]["merges"] = spec["model"]["merges"][::-1]  # the same tokens, merged in another order
    second = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<eos>", pad_token="<pad>"
    )
    assert tokenizer_difference(first, second) == "the BPE merges differ"


def test_calibrate_refuses_a_pair_with_other_tokenizers(tmp_path):
    other = make_tokenizer([s[::-1] for s in CORPUS])
    paths = {}
    for name, tokenizer, seed in (("a", make_tokenizer(), 0), ("b", other, 1)):
        model = qwen3(seed=seed)
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
        paths[name] = str(tmp_path / name)
    with pytest.raises(KVLayoutError, match=f"source {paths['a']}.*target {paths['b']}.*use different tokenizers"):
        hf_kvbridge.calibrate(paths["a"], paths["b"], CORPUS, num_sequences=4, seq_len=16)
