#!/usr/bin/env bash
# TTFT and throughput in vLLM with and without the bridge on one GPU, Qwen3-shaped random weights (random weights
# time like real ones): Qwen3-0.6B -> Qwen3-8B shapes in bfloat16, pocket tokenizer, random top-6 all-heads mapper.
# Needs a CUDA vLLM (`pip install vllm`) and this package; ~20 GB of GPU memory and of disk for the saved models.
# Writes JSON into ${OUT:-.}.
set -euo pipefail
out="${OUT:-.}"
kvbridge bench vllm --shapes "${SHAPES:-qwen3-0.6b:qwen3-8b}" \
    --lengths "${LENGTHS:-1024,4096,16384}" --repeats "${REPEATS:-5}" --requests "${REQUESTS:-16}" \
    --max-tokens "${MAX_TOKENS:-64}" --kv-cache-gb "${KV_CACHE_GB:-40}" --json "$out/vllm-bench-gpu.json"
