"""`kvbridge bench vllm --source-throughput`: what exporting costs the source engine, in rounds interleaved in one run.

The source engine with the connector serves, round after round, a batch of requests that do not opt in and a batch
of requests that do (their prompt and reply K/V exported), in alternating order (ABBA: a drift of the machine falls
on both alike), each batch of fresh prompts (no store hits); the source alone (no connector, an engine of its own)
runs the same rounds. Per round and length the opted-in throughput is set against the not-opted-in one of the same
round (a paired ratio), and the export's own CPU time against the engine's time for the same tokens:

- `export_cpu_s`: the writer threads' CPU time (`StoreMetrics.writer_cpu_seconds`: encoding and sending, counted on
  the writer thread and the threads a save sends on) plus the engine step's part of the export (the worker's
  `export_steps`: the gather out of the paged cache, its thread CPU time, counted here by wrapping it);
- `engine_s`: the wall time of the not-opted-in batch of the same round (the same number of requests, prompt and
  reply tokens: the source engine's compute time for those tokens), and `engine_cpu_s` its process CPU time (every
  thread of the engine);
- `export_cpu_share` = `export_cpu_s / engine_s` (the goal: ≤ 5 %), and `export_cpu_share_of_engine_cpu`;
- `staging_allocated`: buffers the step's gather had to allocate (fresh pages) rather than reuse from the worker's
  staging pool, which reserves a step's worth at start-up (`BridgeWorker.register_kv_caches`);
- `store_server_cpu_s`: with a store this benchmark started on this machine (`--store local`), the store server
  processes' own CPU time over the batch and the writer's drain: what a co-located store takes from the engine's
  cores (a remote store's host pays it instead); `None` where the server is not ours or `/proc` is not there.

Each is reported per length as the median and the range (min, max) over the rounds.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any


class ExportStepTimer:
    """Counts the thread CPU time and wall time of the connector worker's `export_steps` (the engine step's part of
    an export), by wrapping that method on the worker instance.

    Example:

    ```python
    >>> timer = ExportStepTimer(get_kv_transfer_group().worker)  # doctest: +SKIP
    >>> timer.cpu_seconds, timer.seconds  # doctest: +SKIP
    (0.0, 0.0)
    ```
    """

    def __init__(self, worker: Any):
        self.cpu_seconds = 0.0
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._pool = getattr(worker, "staging", None)
        original = worker.export_steps

        def export_steps(meta) -> None:
            began, began_cpu = time.perf_counter(), time.thread_time()
            try:
                original(meta)
            finally:
                with self._lock:
                    self.cpu_seconds += time.thread_time() - began_cpu
                    self.seconds += time.perf_counter() - began

        worker.export_steps = export_steps

    def as_dict(self) -> dict[str, float]:
        with self._lock:
            allocated = {} if self._pool is None else {"staging_allocated": self._pool.allocated}
            return {"export_step_cpu_seconds": self.cpu_seconds, "export_step_seconds": self.seconds, **allocated}


def process_cpu_seconds(pids: list[int] | None) -> float | None:
    """The CPU time (user + system, seconds) the processes `pids` have used so far, read from `/proc` (Linux); `None`
    without pids, or where a process cannot be read.

    Example:

    ```python
    >>> import os
    >>> process_cpu_seconds([os.getpid()]) >= 0.0
    True
    >>> process_cpu_seconds(None) is None
    True
    ```
    """
    if not pids:
        return None
    ticks = 0
    try:
        for pid in pids:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after the command's name
            ticks += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of stat(5)
    except (OSError, IndexError, ValueError):
        return None
    return ticks / os.sysconf("SC_CLK_TCK")


def spread(values: list[float]) -> dict[str, float] | None:
    """`{"median", "min", "max", "n"}` of `values` (`None` when there are none).

    Example:

    ```python
    >>> spread([0.9, 1.1, 1.0])
    {'median': 1.0, 'min': 0.9, 'max': 1.1, 'n': 3}
    ```
    """
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def source_rounds(
    generate, pools, lengths: list[int], modes: dict[str, bool | None], rounds: int, *, exports=None, timer=None,
    store_pids: list[int] | None = None, log=print,
) -> list[dict[str, Any]]:  # fmt: skip
    """The rows of `rounds` interleaved rounds: per round, length and mode one batch (`generate(prompts, flag)` →
    `(seconds, row)`, `pools(round, mode)` → length → prompts), the modes in alternating order; with `exports` (the
    worker's `PrefixKVStore`) an opted-in row also carries what its export wrote and cost (the writer drained after
    each batch), with `timer` (`ExportStepTimer`) the engine step's part, with `store_pids` (the local store's server
    processes) their CPU time over the batch and the drain (`store_server_cpu_s`)."""
    rows = []
    names = list(modes)
    for index in range(rounds):
        order = names if index % 2 == 0 else names[::-1]
        prompts = {mode: pools(index, mode) for mode in order}
        for length in lengths:
            for mode in order:
                before = exports.metrics.as_dict() if exports is not None else {}
                step = timer.as_dict() if timer is not None else {}
                server_cpu = process_cpu_seconds(store_pids) if exports is not None else None
                began_cpu = time.process_time()
                seconds, row = generate(prompts[mode][length], modes[mode])
                row.update(round=index, length=length, mode=mode, engine_cpu_s=time.process_time() - began_cpu)
                if exports is not None:
                    drain = time.perf_counter()
                    exports.writer.flush(timeout=300)
                    now, step_now = exports.metrics.as_dict(), timer.as_dict() if timer is not None else {}
                    written = now["bytes_written"] - before["bytes_written"]
                    put = now["put_seconds"] - before["put_seconds"]
                    writer_cpu = now["writer_cpu_seconds"] - before["writer_cpu_seconds"]
                    step_cpu = step_now.get("export_step_cpu_seconds", 0.0) - step.get("export_step_cpu_seconds", 0.0)
                    row.update(
                        chunk_size=exports.chunk_size,
                        chunks_written=now["chunks_written"] - before["chunks_written"],
                        bytes_written=written,
                        writes_dropped=now["writes_dropped"] - before["writes_dropped"],
                        write_errors=now["write_errors"] - before["write_errors"],
                        write_gbps=written / put / 1e9 if put > 0 else None,
                        writer_drain_s=time.perf_counter() - drain,
                        writer_cpu_s=writer_cpu,
                        writer_cpu_share=writer_cpu / seconds,
                        export_step_cpu_s=step_cpu,
                        export_step_s=step_now.get("export_step_seconds", 0.0) - step.get("export_step_seconds", 0.0),
                        export_cpu_s=writer_cpu + step_cpu,
                    )
                    if "staging_allocated" in step_now:
                        row["staging_allocated"] = step_now["staging_allocated"] - step["staging_allocated"]
                    server_now = process_cpu_seconds(store_pids)
                    if server_cpu is not None and server_now is not None:
                        row["store_server_cpu_s"] = server_now - server_cpu
                rows.append(row)
                extra = f"   wrote {row['bytes_written'] / 1e6:8.1f} MB" if row.get("bytes_written") else ""
                log(f"round {index}  {length:>6} tokens  source {mode:<13} {row['requests_per_s']:7.2f} req/s   "
                    f"{row['total_tokens_per_s']:9.1f} tok/s{extra}")  # fmt: skip
    return rows


def summarize(rows: list[dict[str, Any]], alone: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per length: each mode's throughput (tokens/s, median and range over the rounds), the opted-in over the
    not-opted-in throughput of the same round, and the export's CPU time against the engine's time for the same tokens
    (`export_cpu_share`); with `alone` (the source without a connector) its throughput and the exporting engine's
    not-opted-in median over it."""
    out = []
    for length in sorted({row["length"] for row in rows}):
        by_round: dict[int, dict[str, dict]] = {}
        for row in rows:
            if row["length"] == length:
                by_round.setdefault(row["round"], {})[row["mode"]] = row
        pairs = [r for r in by_round.values() if "opted_in" in r and "not_opted_in" in r]
        summary: dict[str, Any] = {"length": length, "rounds": len(by_round)}
        for mode in ("not_opted_in", "opted_in"):
            summary[f"{mode}_tokens_per_s"] = spread([r[mode]["total_tokens_per_s"] for r in by_round.values()
                                                      if mode in r])  # fmt: skip
        summary["opted_in_over_not_opted_in"] = spread(
            [p["opted_in"]["total_tokens_per_s"] / p["not_opted_in"]["total_tokens_per_s"] for p in pairs]
        )
        summary["export_cpu_s"] = spread([p["opted_in"]["export_cpu_s"] for p in pairs])
        summary["engine_s"] = spread([p["not_opted_in"]["batch_seconds"] for p in pairs])
        summary["export_cpu_share"] = spread(
            [p["opted_in"]["export_cpu_s"] / p["not_opted_in"]["batch_seconds"] for p in pairs]
        )
        summary["export_cpu_share_of_engine_cpu"] = spread(
            [p["opted_in"]["export_cpu_s"] / p["not_opted_in"]["engine_cpu_s"] for p in pairs
             if p["not_opted_in"]["engine_cpu_s"] > 0]
        )  # fmt: skip
        server = [p["opted_in"].get("store_server_cpu_s") for p in pairs]
        if server and None not in server:  # a co-located store's CPU time, against the same engine time
            summary["store_server_cpu_s"] = spread(server)
            summary["store_server_cpu_share"] = spread(
                [p["opted_in"]["store_server_cpu_s"] / p["not_opted_in"]["batch_seconds"] for p in pairs]
            )
        summary["writes_dropped"] = sum(p["opted_in"]["writes_dropped"] for p in pairs)
        if alone:
            own = [row["total_tokens_per_s"] for row in alone if row["length"] == length]
            summary["alone_tokens_per_s"] = spread(own)
            not_opted = summary["not_opted_in_tokens_per_s"]
            if own and not_opted:
                summary["not_opted_in_over_alone"] = not_opted["median"] / statistics.median(own)
        out.append(summary)
    return out


def format_summary(summary: list[dict[str, Any]]) -> str:
    """`summarize`'s rows as text: medians with their ranges."""

    def cell(value: dict | None, fmt: str) -> str:
        if not value:
            return "-"
        return f"{format(value['median'], fmt)} [{format(value['min'], fmt)}, {format(value['max'], fmt)}]"

    lines = []
    for row in summary:
        lines.append(
            f"{row['length']:>6} tokens, {row['rounds']} rounds: opted in / not "
            f"{cell(row['opted_in_over_not_opted_in'], '.3f')}; export CPU {cell(row['export_cpu_s'], '.4f')} s = "
            f"{cell(row['export_cpu_share'], '.2%')} of the engine's {cell(row['engine_s'], '.3f')} s for the same "
            f"tokens ({cell(row['export_cpu_share_of_engine_cpu'], '.2%')} of its CPU time)"
            + (
                f"; the local store server's CPU {cell(row['store_server_cpu_s'], '.4f')} s = "
                f"{cell(row['store_server_cpu_share'], '.2%')}"
                if row.get("store_server_cpu_s")
                else ""
            )
        )
    return "\n".join(lines)
