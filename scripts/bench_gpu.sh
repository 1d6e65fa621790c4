#!/usr/bin/env bash
# Real-size latency of the mapper vs the target's re-prefill on one GPU, with random weights (weights don't change
# timings): Qwen3-14B -> Qwen3-32B shapes in bfloat16, all-heads top-6 and same-head mappers.
# Needs a CUDA torch and ~100 GB of GPU memory (32B + 14B in bf16 + the mapper). Writes JSON into ${OUT:-.}.
set -euo pipefail
out="${OUT:-.}"
lengths="${LENGTHS:-1024,4096,16384,32768}"
for mode in all_heads same_head; do
  kvbridge bench --shapes qwen3-14b:qwen3-32b --head-mode "$mode" --top-k 6 --dtype bfloat16 --device cuda \
    --lengths "$lengths" --repeats "${REPEATS:-10}" --warmup "${WARMUP:-3}" --json "$out/bench-qwen3-14b-32b-$mode.json"
done
