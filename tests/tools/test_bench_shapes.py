"""The benchmarks' model shapes (`hf_kvbridge.tools.bench.shapes`): a bad pair of names is refused with the known
ones, before any model is built."""

import pytest

from hf_kvbridge.tools.bench import shapes
from kvbridge_cli import main


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["bench", "mapper", "--shapes", "qwen3-0.6b", "--lengths", "16"], "--shapes takes SOURCE:TARGET"),
        (["bench", "mapper", "--shapes", "qwen3-0.6b:qwen3-9b", "--lengths", "16"], "unknown shape 'qwen3-9b'"),
        (["bench", "calibration", "--pair", "qwen3-0.6b", "--flop-model"], "--pair takes SOURCE:TARGET"),
        (["bench", "calibration", "--pair", "foo:qwen3-1.7b", "--flop-model"], "unknown shape 'foo'"),
        (["bench", "calibration", "--pair", "qwen3-0.6b:a:b"], "--pair takes SOURCE:TARGET"),
        (["bench", "calibration", "--pair", "small-3l-2x64:small-8l-2x64"], "unknown shape 'small-3l-2x64'"),
    ],
)
def test_bench_names_a_bad_pair_of_shapes_and_the_known_ones(argv, expected, capsys, monkeypatch):
    """A malformed or unknown `--shapes` / `--pair` is refused with the known names, before any model is built."""
    from hf_kvbridge.tools.bench import calibration

    def no_build(*args, **kwargs):
        raise AssertionError("a model was built for a bad pair")

    monkeypatch.setattr(calibration, "random_model", no_build)
    monkeypatch.setattr(shapes, "random_bridge", no_build)
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert expected in err and "known: qwen3-0.6b, qwen3-1.7b" in err and "a model was built" not in err
