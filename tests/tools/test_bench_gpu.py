"""`scripts/bench_gpu.sh` and `hf_kvbridge.tools.bench.gpu`, the GPU run, in its smoke mode on the CPU."""

import json


def test_gpu_script_runs_every_step_at_tiny_shapes_without_the_optional_packages(tmp_path):
    """`scripts/bench_gpu.sh` (run for real on a lent GPU) in its smoke mode: one process runs every step at tiny
    shapes on the CPU, with `datasets`, `lm_eval` and `vllm` made unimportable (the GPU machine has none of them),
    and the one JSON holds each step's status and result: the schedules' maps and op counts, time to first token
    eager and compiled, the calibration, the λ searches agreeing, the vLLM helpers equal."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    blocker = tmp_path / "site"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\n"
        "class _Absent:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('datasets', 'lm_eval', 'vllm'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (absent on the GPU machine)')\n"
        "sys.meta_path.insert(0, _Absent())\n"
    )
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "SMOKE": "1", "PYTHONPATH": str(blocker)}
    done = subprocess.run(["bash", str(root / "scripts" / "bench_gpu.sh")], env=env, cwd=tmp_path, text=True,
                          capture_output=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "bench-gpu.json").read_text())
    steps = result["steps"]
    assert result["smoke"] and {name: step["status"] for name, step in steps.items()} == dict.fromkeys(steps, "ok")
    names = {"device", "lambda_search", "vllm_helpers", "exactness", "calibration", "build_large", "table_32",
             "table_64", "ttft_same_head_64", "ttft_all_heads_32", "small_pair"}  # fmt: skip
    assert names <= set(steps), sorted(steps)
    row = steps["table_64"]["result"]["same_head"]
    assert row["layers_ops_per_target_layer"] <= 12 < row["chunked_ops_per_target_layer"]
    assert row["floor_s"] > 0 and row["fraction_of_floor"] > 0
    ttft = steps["ttft_all_heads_32"]["result"]
    assert ttft["compiled"]["compiled_hold_back"] and ttft["eager"]["warm_ttft_s"] > 0
    search = steps["lambda_search"]["result"]
    assert search["cholesky_max_r2_difference"] < 1e-9 and search["eigh32_max_r2_difference"] < 1e-4
    helpers = steps["vllm_helpers"]["result"]
    assert helpers["read_slots_equal"] and helpers["reads_back"] and helpers["rotary_max_abs_difference"] == 0
    assert steps["calibration"]["result"]["lambda_seconds"] >= 0
    exact = steps["exactness"]["result"]
    assert exact["all_heads_float32_default"] < 1e-6 and exact["same_head_bfloat16_default"] < 1e-2
