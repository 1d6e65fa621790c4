#!/usr/bin/env bash
# The GPU run of issue 40 on one lent H200, in at most 5 minutes, from this checkout (no install: the machine has a
# CUDA PyTorch, transformers and accelerate, no registry, no lm-eval, datasets or vLLM): one process
# (`python -m hf_kvbridge.tools.bench.gpu`) that builds each model pair once and runs every step under a time limit,
# rewriting ${OUT:-.}/bench-gpu.json after each step (a step that fails or runs out of time is recorded, the next one
# runs). What it measures, with random weights (weights do not change timings), bfloat16:
#   - the λ searches on one map of the paper's calibration shape (p = 12,288), and the paper's calibration of
#     Qwen3-0.6B -> 1.7B shapes (all heads, joint, top-6, auto-λ, 16 x 1,024 tokens) with its projection to 500 x 1,024;
#   - the vLLM connector's paged-cache read and rotary helpers on CUDA tensors against their CPU results;
#   - Qwen3-14B -> 32B shapes (about 100 GB of GPU memory): the map (all-heads top-6, same-head top-6, rank 512) against
#     the 32B's re-prefill at 1K-32K tokens, the whole-layer schedule and the chunked one, ops per target layer, the
#     GPU's busy time and kernels, FLOP and memory floors; time to first token through generate_from_cache at 8K and
#     1K, warm and cold, eager and with the hold-back compiled on a static cache (compile time apart);
#   - Qwen3-0.6B -> 1.7B shapes: the same table and time to first token at 1K and 8K.
#
#   OUT=/tmp/gpu bash scripts/bench_gpu.sh          # on the GPU machine
#   SMOKE=1 OUT=/tmp/smoke bash scripts/bench_gpu.sh  # every step at tiny shapes on the CPU (the test suite runs it)
#
# Environment: LENGTHS (default 1024,4096,8192,16384,32768), BUDGET_S (the run's total, default 290), PYTHON.
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-.}"
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
smoke=()
if [ -n "${SMOKE:-}" ]; then smoke=(--smoke); fi
# a hard stop a little after the run's own budget, should a step hang in native code
timeout --kill-after=10 "${TIMEOUT_S:-330}" "$py" -m hf_kvbridge.tools.bench.gpu --out "$out" "${smoke[@]}"
