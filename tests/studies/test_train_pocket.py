"""The pocket training script's own behaviour (not the shipped models, which ``test_pocket.py`` checks)."""

from pathlib import Path

import pytest
import torch

from hf_kvbridge import pocket
from studies import train_pocket as train

TINY = train.PocketSpec("pocket-t", 1, 32, 2, 1, 16, 64, seed=5, steps=4, batch_size=2, lr=1e-3)


def _stream(n: int = 4 * train.SEQ_LEN) -> torch.Tensor:
    return torch.randint(0, train.VOCAB_SIZE, (n,), generator=torch.Generator().manual_seed(0))  # [n]


def test_held_out_monitoring_does_not_change_the_trained_weights(caplog):
    tokenizer = train.load_tokenizer(pocket.model_path("pocket-s"))
    plain = train.train_model(TINY, tokenizer, _stream(), use_bf16=False)
    with caplog.at_level("INFO", logger="studies.train_pocket"):
        watched = train.train_model(
            TINY, tokenizer, _stream(), use_bf16=False, heldout_ids=_stream(32 * train.SEQ_LEN), eval_every=2
        )
    assert "step    2 held-out ppl" in caplog.text  # the probe ran mid-training...
    for (name, a), b in zip(plain.state_dict().items(), watched.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)  # ...and left every weight as it was


def test_a_bad_tokenizer_folder_fails_before_any_download(tmp_path: Path):
    # --deb points at a file that does not exist: reaching the download/extract step would fail differently.
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        argv = ["--out", str(tmp_path / "out"), "--deb", str(tmp_path / "missing.deb"), "--tokenizer", str(tmp_path)]
        train.main(argv)
    assert not (tmp_path / "out").exists()


def test_negative_eval_every_is_rejected(tmp_path: Path):
    with pytest.raises(SystemExit, match="--eval-every -1"):
        train.main(["--out", str(tmp_path / "out"), "--eval-every", "-1"])
