"""Calibration at scale: 2-process torch.distributed (gloo) equals one process; a killed run resumes exactly."""

import json
import os
import subprocess
import sys
import textwrap

import torch

from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from tests.conftest import qwen3

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIR = (
    "from tests.conftest import qwen3\nsource, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)\n"
)
WINDOWS = "windows = torch.randint(0, 128, (20, 24), generator=torch.Generator().manual_seed(0))\n"
# kill -9 the script itself at the N-th forward pass (`argv[1]`, none without it), mid-batch; `calls[0]` counts them
KILL_HOOK = """
import os, signal, sys
import hf_kvbridge.fitting.calibration.data_pass as data_pass
kill_after = int(sys.argv[1]) if len(sys.argv) > 1 else -1
real, calls = data_pass.cache_rows, [0]
def cache_rows(*args, **kwargs):
    calls[0] += 1
    if calls[0] == kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
data_pass.cache_rows = cache_rows
""".replace("\n", "\n        ")


def _reference():
    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    windows = torch.randint(0, 128, (20, 24), generator=torch.Generator().manual_seed(0))
    stats = collect_statistics(source, target, windows, heldout=[3, 7, 11], batch_size=2)
    return stats, fit_bridge(source, target, *stats, top_k=2)


def _torchrun(script) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def test_two_process_gloo_equals_single_process(tmp_path):
    script = tmp_path / "dist.py"
    script.write_text(
        textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
        from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
        dist.init_process_group("gloo")
        {PAIR.replace(chr(10), chr(10) + "        ")}
        {WINDOWS}
        stats = collect_statistics(source, target, windows, heldout=[3, 7, 11], batch_size=2)
        bridge = fit_bridge(source, target, *stats, top_k=2)
        if dist.get_rank() == 0:
            torch.save({{"count": stats[0].count, "xx": stats[0].xx, "state": bridge.mapper.state_dict(),
                         "selected": bridge.config.selected_layers}}, {str(tmp_path / "out.pt")!r})
        dist.destroy_process_group()
    """)
    )
    result = _torchrun(script)
    assert result.returncode == 0, result.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    stats, bridge = _reference()
    assert out["count"] == stats[0].count
    torch.testing.assert_close(out["xx"], stats[0].xx)
    assert out["selected"] == bridge.config.selected_layers
    for key, value in bridge.mapper.state_dict().items():
        torch.testing.assert_close(out["state"][key], value, atol=1e-5, rtol=1e-5)


def test_killed_calibration_resumes_to_the_same_mapper(tmp_path):
    checkpoint = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
        {PAIR.replace(chr(10), chr(10) + "        ")}
        {WINDOWS}
        {KILL_HOOK}
        collect_statistics(source, target, windows, heldout=[3, 7, 11], batch_size=2,
                           checkpoint_dir={str(checkpoint)!r}, checkpoint_every=2)
        print("finished after", calls[0] // 2, "batches")
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    killed = subprocess.run([sys.executable, "-c", script, "13"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert killed.returncode == -9
    progress = json.loads((checkpoint / "progress.json").read_text())
    assert progress["batches_done"] == 6  # killed in batch 7: the checkpoint after batch 6 survives
    resumed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "finished after 5 batches" in resumed.stdout  # 9 train + 2 held-out batches: only the last 5 ran again
    from hf_kvbridge.fitting.statistics.dense import KVStatistics

    train = KVStatistics.load(checkpoint / "statistics-0.safetensors")
    heldout = KVStatistics.load(checkpoint / "statistics-1.safetensors")
    stats, bridge = _reference()
    assert train.count == stats[0].count and heldout.count == stats[1].count
    torch.testing.assert_close(train.xy, stats[0].xy)
    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    again = fit_bridge(source, target, train, heldout, top_k=2)
    for key, value in bridge.mapper.state_dict().items():
        torch.testing.assert_close(again.mapper.state_dict()[key], value)


def test_two_processes_split_fit_statistics_by_target_layer(tmp_path):
    """On a memory budget, each rank accumulates only its own target layers' fit statistics (from every rank's rows);
    the fitted mapper equals the single-process one."""
    budget = "fit_bytes(2, 1, 64, torch.float64)"  # one target layer per pass: 3 passes over 2 ranks
    script = tmp_path / "split.py"
    script.write_text(
        textwrap.dedent(f"""
        import torch, torch.distributed as dist
        import hf_kvbridge.fitting.statistics.blocks as statistics
        from hf_kvbridge.fitting.budget import fit_bytes
        from hf_kvbridge.fitting.calibration.calibrate import fit_bridge_in_passes
        dist.init_process_group("gloo")
        {PAIR.replace(chr(10), chr(10) + "        ")}
        {WINDOWS}
        held = []
        real = statistics.BlockStatistics.__init__
        def record(self, *args, **kwargs):
            real(self, *args, **kwargs)
            held.append(list(self.targets))
        statistics.BlockStatistics.__init__ = record
        bridge, _ = fit_bridge_in_passes(source, target, windows, [3, 7, 11], statistics_memory={budget}, top_k=2,
                                         statistics_dtype=torch.float64, batch_size=2)
        torch.save({{"state": bridge.mapper.state_dict(), "selected": bridge.config.selected_layers,
                    "r2": bridge.config.heldout_r2, "held": held}}, {str(tmp_path)!r} + f"/out{{dist.get_rank()}}.pt")
        dist.destroy_process_group()
    """)
    )
    result = _torchrun(script)
    assert result.returncode == 0, result.stderr[-3000:]
    from hf_kvbridge.fitting.budget import fit_bytes
    from hf_kvbridge.fitting.calibration.calibrate import fit_bridge_in_passes

    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    windows = torch.randint(0, 128, (20, 24), generator=torch.Generator().manual_seed(0))
    want, _ = fit_bridge_in_passes(
        source, target, windows, [3, 7, 11], statistics_memory=fit_bytes(2, 1, 64, torch.float64), top_k=2,
        statistics_dtype=torch.float64, batch_size=2,
    )  # fmt: skip
    outs = [torch.load(tmp_path / f"out{rank}.pt") for rank in range(2)]
    # fit statistics (train + held-out) each rank built: rank 0 target layers 0 and 2, rank 1 target layer 1
    assert outs[0]["held"] == [[0], [0], [2], [2]] and outs[1]["held"] == [[1], [1], [], []]
    for out in outs:
        assert out["selected"] == want.config.selected_layers
        assert out["r2"] == want.config.heldout_r2
        for key, value in want.mapper.state_dict().items():
            torch.testing.assert_close(out["state"][key], value, atol=1e-9, rtol=1e-7)


def test_killed_budgeted_calibration_resumes_to_the_same_mapper(tmp_path):
    """On a memory budget (a selection pass, then one fit pass per target layer), a run killed -9 in the middle of the
    second fit pass resumes from its checkpoints: the passes already done are not run again, and the mapper equals an
    uninterrupted run's."""
    checkpoint = tmp_path / "ckpt"
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        import hf_kvbridge.fitting.calibration.budgeted_fit as calibration
        from hf_kvbridge.fitting.budget import fit_bytes
        {PAIR.replace(chr(10), chr(10) + "        ")}
        {WINDOWS}
        {KILL_HOOK}
        bridge, _ = calibration.fit_in_passes(
            source, target, windows, [3, 7, 11], statistics_memory=fit_bytes(2, 1, 64, torch.float32, 4), top_k=2,
            batch_size=2, head_mode="same_head", kv_mode="separate", checkpoint_dir={str(checkpoint)!r})
        torch.save(bridge.mapper.state_dict(), {str(tmp_path / "mapper.pt")!r})
        print("forward batches", calls[0] // 2)
    """)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    # 11 batches a pass (9 train + 2 held-out), 2 models each: the selection pass and fit pass 0 are calls 1–44
    killed = subprocess.run([sys.executable, "-c", script, "51"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # 4 passes of 11 batches in all; the selection pass and fit pass 0 were checkpointed whole and are not run again,
    # fit pass 1 (killed before its first checkpoint, every 10 batches) and fit pass 2 are
    assert "forward batches 22" in resumed.stdout, resumed.stdout
    from hf_kvbridge.fitting.budget import fit_bytes
    from hf_kvbridge.fitting.calibration.calibrate import fit_bridge_in_passes

    source, target = qwen3(layers=2, seed=1), qwen3(layers=3, hidden=48, seed=2)
    windows = torch.randint(0, 128, (20, 24), generator=torch.Generator().manual_seed(0))
    want, _ = fit_bridge_in_passes(
        source, target, windows, [3, 7, 11], statistics_memory=fit_bytes(2, 1, 64, torch.float32, 4), top_k=2,
        batch_size=2, head_mode="same_head", kv_mode="separate",
    )  # fmt: skip
    got = torch.load(tmp_path / "mapper.pt")
    for key, value in want.mapper.state_dict().items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-6)
