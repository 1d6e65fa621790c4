"""The CLI's answer to a user's mistakes: one line saying what is wrong and what to do, a non-zero exit, no traceback;
bad arguments refused before any work; `--debug` shows the traceback; Ctrl-C exits 130 with one line."""

import os
import signal
import subprocess
import sys
import time

import pytest
from transformers import Qwen3Config, Qwen3ForCausalLM

import hf_kvbridge
from hf_kvbridge.errors import CheckpointNotFoundError
from hf_kvbridge.persistence import resolve_checkpoint
from kvbridge_cli import main
from tests.conftest import CORPUS, VOCAB, make_tokenizer, sigint_as_in_a_terminal


@pytest.fixture(scope="module")
def saved_bridge(saved_pair, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli-errors") / "bridge"
    hf_kvbridge.calibrate(
        saved_pair["small"], saved_pair["large"], CORPUS, num_sequences=12, seq_len=32, top_k=2
    ).save_pretrained(out)
    return out


def _one_line_error(capsys, code: int, expected_code: int, *needles: str) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == expected_code, captured.err
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err + captured.out
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _no_calibration(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("calibration started before the arguments were checked")

    monkeypatch.setattr(hf_kvbridge, "calibrate", refuse)


def test_missing_bridge_folder_says_it_does_not_exist(tmp_path, capsys):
    missing = tmp_path / "no-such-bridge"
    code = main(["generate", str(missing), "hello"])
    _one_line_error(capsys, code, 1, str(missing), "does not exist")


def test_missing_bridge_name_says_not_found(monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = main(["generate", "no-such-bridge-here", "hello"])
    _one_line_error(capsys, code, 1, "no-such-bridge-here", "not found")


def test_resolve_checkpoint_raises_checkpoint_not_found(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        resolve_checkpoint(tmp_path / "nothing" / "here")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="not a kvbridge checkpoint"):
        resolve_checkpoint(tmp_path / "empty")


def test_missing_data_file_refused_before_any_work(saved_pair, tmp_path, monkeypatch, capsys):
    _no_calibration(monkeypatch)
    missing = tmp_path / "corpus.jsonl"
    args = [
        "calibrate",
        saved_pair["small"],
        saved_pair["large"],
        "--data",
        str(missing),
        "--out",
        str(tmp_path / "o"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    _one_line_error(capsys, exit_info.value.code, 2, str(missing), "does not exist", "--data pocket")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_bad_top_k_refused_at_parse_time(saved_pair, tmp_path, monkeypatch, capsys, value):
    _no_calibration(monkeypatch)
    args = ["calibrate", saved_pair["small"], saved_pair["large"], "--data", "pocket", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--top-k", value])
    _one_line_error(capsys, exit_info.value.code, 2, "--top-k", "'all'")


@pytest.mark.parametrize("command", ["calibrate", "distill", "eval", "tune"])
def test_an_unknown_model_dtype_is_refused_at_parse_time(
    saved_pair, saved_bridge, tmp_path, monkeypatch, capsys, command
):
    def refuse(*args, **kwargs):
        raise AssertionError("a bridge was loaded before the arguments were checked")

    _no_calibration(monkeypatch)
    monkeypatch.setattr(hf_kvbridge.KVBridgeForCausalLM, "from_pretrained", refuse)
    args = {
        "calibrate": [saved_pair["small"], saved_pair["large"], "--data", "pocket", "--out", str(tmp_path / "o")],
        "distill": [str(saved_bridge), "--data", "pocket", "--out", str(tmp_path / "o")],
        "eval": [str(saved_bridge), "--heldout", "pocket"],
        "tune": [
            saved_pair["small"],
            saved_pair["large"],
            "--data",
            "pocket",
            "--eval-data",
            "pocket",
            "--out",
            str(tmp_path / "o"),
        ],
    }[command]
    with pytest.raises(SystemExit) as exit_info:
        main([command, *args, "--dtype", "float33"])
    _one_line_error(capsys, exit_info.value.code, 2, "--dtype", "float33", "float32")


def test_too_long_prompt(saved_bridge, capsys):
    prompt = " ".join(CORPUS) * 20  # far more tokens than the tiny models' 256 positions
    code = main(["generate", str(saved_bridge), prompt, "--max-new-tokens", "2"])
    _one_line_error(capsys, code, 1, "the prompt is", "at most 256 positions")


def test_prompt_plus_new_tokens_past_the_maximum(saved_bridge, capsys):
    code = main(["generate", str(saved_bridge), "The quick brown", "--max-new-tokens", "300"])
    _one_line_error(capsys, code, 1, "--max-new-tokens", "256 positions")


def test_too_long_calibration_window_refused_before_work(saved_pair, tmp_path, monkeypatch, capsys):
    _no_calibration(monkeypatch)
    args = ["calibrate", saved_pair["small"], saved_pair["large"], "--data", "pocket", "--out", str(tmp_path / "o")]
    code = main([*args, "--seq-len", "1000"])
    _one_line_error(capsys, code, 1, "--seq-len", "256 positions")


def test_bench_lengths_past_the_maximum(saved_bridge, capsys):
    code = main(["bench", "mapper", str(saved_bridge), "--lengths", "64,512", "--repeats", "1"])
    _one_line_error(capsys, code, 1, "--lengths", "256")


def test_same_head_with_head_counts_that_do_not_divide(saved_pair, tmp_path, capsys):
    three = tmp_path / "three-heads"
    config = Qwen3Config(
        num_hidden_layers=2, hidden_size=48, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
        vocab_size=VOCAB, intermediate_size=64, max_position_embeddings=256, tie_word_embeddings=True,
    )  # fmt: skip
    Qwen3ForCausalLM(config).save_pretrained(three)
    make_tokenizer().save_pretrained(three)
    args = ["calibrate", saved_pair["small"], str(three), "--data", "pocket", "--out", str(tmp_path / "o")]
    code = main([*args, "--num-sequences", "4", "--seq-len", "32", "--head-mode", "same_head"])
    _one_line_error(capsys, code, 1, "2 KV heads", "has 3", "all_heads")


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(CheckpointNotFoundError):
        main(["generate", str(tmp_path / "missing"), "hello", "--debug"])
    with pytest.raises(CheckpointNotFoundError):
        main(["--debug", "generate", str(tmp_path / "missing"), "hello"])


def _run_kvbridge(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-c", "import sys; from kvbridge_cli import main; sys.exit(main())", *args]
    return subprocess.Popen(
        command,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=sigint_as_in_a_terminal,
        **kwargs,
    )


def test_real_process_exit_status_and_one_line(tmp_path):
    proc = _run_kvbridge("inspect", str(tmp_path / "gone"), "--data", "pocket")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert err.strip().count("\n") == 0 and "does not exist" in err and "Traceback" not in err


def test_ctrl_c_in_chat_exits_130_with_one_line(saved_bridge):
    proc = _run_kvbridge("chat", str(saved_bridge), stdin=subprocess.PIPE)
    deadline = time.monotonic() + 120
    line = ""
    while "/help" not in line and time.monotonic() < deadline:  # wait until the models are loaded
        line = proc.stdout.readline()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.strip()] == [err.strip()] and "interrupted" in err
