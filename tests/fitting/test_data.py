"""Calibration data in every supported form becomes the same token windows."""

import gzip
import json

import pytest
from datasets import Dataset

from hf_kvbridge.fitting.data import CalibrationDataError, token_windows
from tests.conftest import CORPUS, make_tokenizer


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_forms_agree(tok, tmp_path):
    expected = token_windows(CORPUS, tok, num_sequences=5, seq_len=20)
    assert expected.shape == (5, 20)
    (tmp_path / "docs.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in CORPUS))
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt") as handle:
        handle.write("\n".join(json.dumps({"text": t}) for t in CORPUS))
    folder = tmp_path / "folder"
    folder.mkdir()
    for i, text in enumerate(CORPUS):
        (folder / f"{i:03d}.txt").write_text(text)
    for data in (
        tmp_path / "docs.jsonl",
        str(tmp_path / "docs.jsonl.gz"),
        folder,
        Dataset.from_dict({"text": CORPUS}),
    ):
        assert token_windows(data, tok, num_sequences=5, seq_len=20).equal(expected), data


def test_windows_are_joined_with_eos(tok):
    windows = token_windows(["a b", "c d"] * 50, tok, num_sequences=2, seq_len=8)
    assert (windows == tok.eos_token_id).any()


def test_fewer_windows_than_asked_is_allowed(tok):
    assert token_windows(CORPUS[:2], tok, num_sequences=100, seq_len=16).shape[0] < 100


def test_errors_name_the_problem(tok, tmp_path):
    with pytest.raises(CalibrationDataError, match="fewer than one window"):
        token_windows(["hi"], tok, num_sequences=1, seq_len=512)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(CalibrationDataError, match="bad.jsonl:2"):
        token_windows(tmp_path / "bad.jsonl", tok, num_sequences=1, seq_len=4)
    with pytest.raises(CalibrationDataError, match="'content' column"):
        token_windows(Dataset.from_dict({"text": ["x"]}), tok, 1, 4, text_field="content")
    with pytest.raises(CalibrationDataError, match="not a file"):
        token_windows(str(tmp_path / "nope.txt"), tok, 1, 4)


def test_offline_dataset_name_explains_what_to_do(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(CalibrationDataError, match="Offline, pass local data"):
        token_windows("HuggingFaceFW/fineweb-edu", tok, 1, 4)
