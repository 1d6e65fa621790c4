"""`kvbridge bench vllm --source-throughput`'s rounds and summary (`hf_kvbridge.tools.bench.source_export`), without
vLLM: the modes interleaved in alternating order, the opted-in throughput paired with the not-opted-in one of its
round, the export's CPU time (the writer's and the engine step's) against the engine's time for the same tokens."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from hf_kvbridge.integrations.kv_store import StoreMetrics
from hf_kvbridge.tools.bench.source_export import ExportStepTimer, format_summary, source_rounds, spread, summarize


def test_rounds_alternate_their_order_and_pair_each_opted_in_batch_with_its_round():
    metrics = StoreMetrics()
    exports = SimpleNamespace(metrics=metrics, chunk_size=64, writer=SimpleNamespace(flush=lambda timeout: True))
    worker = SimpleNamespace(export_steps=lambda meta: time.sleep(0.001))
    timer = ExportStepTimer(worker)
    calls = []
    speed = {0: 2.0, 1: 1.0, 2: 4.0}  # the machine's speed drifts between rounds; the pairs see it alike

    def generate(prompts, flag):
        index = len(calls) // 2
        calls.append(("opted_in" if flag else "not_opted_in", prompts))
        seconds = 1.0 / speed[index] * (1.25 if flag else 1.0)  # exporting costs 20 % of the throughput
        if flag:
            worker.export_steps(None)
            metrics.add(writer_cpu_seconds=0.01 / speed[index], bytes_written=1000, put_seconds=0.001)
        return seconds, {"batch_seconds": seconds, "requests_per_s": 4 / seconds, "total_tokens_per_s": 100 / seconds}

    def pools(index, mode):
        return {128: [[index, mode == "opted_in"]]}

    rows = source_rounds(generate, pools, [128], {"not_opted_in": False, "opted_in": True}, 3, exports=exports,
                         timer=timer, log=lambda line: None)  # fmt: skip
    order = ["not_opted_in", "opted_in", "opted_in", "not_opted_in", "not_opted_in", "opted_in"]  # ABBA...
    assert [mode for mode, _ in calls] == order
    assert len({str(prompts) for _, prompts in calls}) == 6  # fresh prompts per round and mode
    opted = [row for row in rows if row["mode"] == "opted_in"]
    assert all(row["export_step_cpu_s"] >= 0 and row["export_step_s"] >= 0.001 for row in opted)
    assert all(row["export_cpu_s"] == pytest.approx(row["writer_cpu_s"] + row["export_step_cpu_s"]) for row in opted)
    assert [row["bytes_written"] for row in rows] == [0, 1000, 1000, 0, 0, 1000]
    for row in opted:  # the export's own CPU time, without the step's (measured): 1 % of the engine's time
        row["export_cpu_s"] = row["writer_cpu_s"]
    summary = summarize(rows, alone=[{"length": 128, "total_tokens_per_s": 250.0}])[0]
    assert summary["rounds"] == 3 and summary["writes_dropped"] == 0
    assert summary["opted_in_over_not_opted_in"] == pytest.approx({"median": 0.8, "min": 0.8, "max": 0.8, "n": 3})
    assert summary["export_cpu_share"]["median"] == pytest.approx(0.01)
    assert summary["not_opted_in_tokens_per_s"] == {"median": 200.0, "min": 100.0, "max": 400.0, "n": 3}
    assert summary["not_opted_in_over_alone"] == pytest.approx(0.8)
    assert "1.00%" in format_summary([summary]) and "0.800" in format_summary([summary])


def test_spread_and_a_timer_that_counts_even_a_failing_step():
    assert spread([]) is None and spread([3.0, None, 1.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}

    def fail(meta):
        time.sleep(0.002)
        raise RuntimeError("gather failed")

    worker = SimpleNamespace(export_steps=fail)
    timer = ExportStepTimer(worker)
    with pytest.raises(RuntimeError):
        worker.export_steps(None)
    assert timer.as_dict()["export_step_seconds"] >= 0.002


def test_a_local_store_servers_cpu_time_is_counted_over_each_opted_in_batch():
    """`store_pids`: the CPU time of the store server processes the benchmark started, over the batch and the drain
    (here a real process that spins while the batches run), beside the export's own, in the rows and the summary."""
    import subprocess
    import sys

    from hf_kvbridge.tools.bench.source_export import process_cpu_seconds

    server = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        exports = SimpleNamespace(
            metrics=StoreMetrics(), chunk_size=64, writer=SimpleNamespace(flush=lambda timeout: True)
        )

        def generate(prompts, flag):
            time.sleep(0.4)
            return 0.4, {"batch_seconds": 0.4, "requests_per_s": 10.0, "total_tokens_per_s": 1000.0}

        rows = source_rounds(generate, lambda index, mode: {128: [[index, mode]]}, [128],
                             {"not_opted_in": False, "opted_in": True}, 2, exports=exports,
                             store_pids=[server.pid], log=lambda line: None)  # fmt: skip
    finally:
        server.kill()
        server.wait()
    opted = [row for row in rows if row["mode"] == "opted_in"]
    assert all(0.05 < row["store_server_cpu_s"] < 1.0 for row in opted), opted  # it spun for most of 0.4 s
    summary = summarize(rows)[0]
    assert summary["store_server_cpu_s"]["n"] == 2 and summary["store_server_cpu_share"]["min"] > 0.1
    assert "the local store server's CPU" in format_summary([summary])
    assert process_cpu_seconds([server.pid]) is None  # gone: not a number
    no_server = source_rounds(lambda p, f: generate(p, f), lambda index, mode: {128: [[index]]}, [128],
                              {"opted_in": True}, 1, exports=exports, log=lambda line: None)  # fmt: skip
    assert "store_server_cpu_s" not in no_server[0] and "store_server_cpu_s" not in summarize(no_server)[0]
