"""`kvbridge bench store`: the store's put and fetch beside raw SET/GET of the same bytes, on a real local redis."""

import json

import pytest

from hf_kvbridge.errors import InvalidInputError
from hf_kvbridge.tools.bench.store import run_store_benchmark
from kvbridge_cli import main

FIELDS = ("fetch_gbps", "raw_get_gbps", "fetch_over_raw", "put_gbps", "raw_set_gbps", "put_over_raw")


def test_bench_store_moves_the_same_bytes_as_raw_set_and_get_and_writes_its_json(tmp_path, capsys):
    out = tmp_path / "store.json"
    args = ["bench", "store", "--store", "local", "--shapes", "small-3l-2x64:small-8l-2x64", "--tokens", "100,300",
            "--chunk-size", "64", "--repeats", "2", "--json", str(out)]  # fmt: skip
    assert main(args) == 0
    result = json.loads(out.read_text())
    assert "fetch" in capsys.readouterr().out
    assert result["connections"] >= 1 and isinstance(result["encoding"], str)
    assert [row["tokens"] for row in result["rows"]] == [100, 300]
    for row in result["rows"]:
        assert all(row[name] > 0 for name in FIELDS)
        moved = row["bytes_moved"]
        # 3 layers × 2 heads × 64 × K and V × 2 bytes = 1536 bytes of bfloat16 K/V a token, plus headers and ids
        assert row["payload_bytes"] > 1536 * row["tokens"]
        assert moved["put"] == moved["raw_set"] == row["payload_bytes"]
        assert moved["fetch"] == moved["raw_get"] == row["payload_bytes"]
        assert row["fetch_over_raw"] == pytest.approx(row["fetch_gbps"] / row["raw_get_gbps"], rel=0.01)
        # 100 tokens: 1 chunk of 64, 2 sub-chunks of 16, a remainder of 4; 300: 4 chunks, 2 sub-chunks, 12 more
        assert row["entries"] == {100: 4, 300: 7}[row["tokens"]]


def test_bench_store_refuses_bad_settings():
    with pytest.raises(InvalidInputError, match="unknown shape"):
        run_store_benchmark("local", "qwen3-0.6b:nope", [10])
    with pytest.raises(InvalidInputError, match="one master"):
        run_store_benchmark("redis-cluster://127.0.0.1:7000", "qwen3-0.6b:qwen3-1.7b", [10])
