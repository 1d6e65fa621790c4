#!/usr/bin/env bash
# Real-size latency of the mapper vs the target's re-prefill on one GPU, with random weights (weights don't change
# timings): Qwen3-14B -> Qwen3-32B shapes in bfloat16; all-heads top-6, same-head, and a rank-512 low-rank mapper.
# Needs a CUDA torch and ~100 GB of GPU memory (32B + 14B in bf16 + the mapper). Writes JSON into ${OUT:-.}.
set -euo pipefail
out="${OUT:-.}"
lengths="${LENGTHS:-1024,4096,16384}"
common=(--shapes qwen3-14b:qwen3-32b --top-k 6 --dtype bfloat16 --device cuda --lengths "$lengths"
        --repeats "${REPEATS:-10}" --warmup "${WARMUP:-3}")
kvbridge bench mapper "${common[@]}" --head-mode all_heads --json "$out/bench-qwen3-14b-32b-all_heads.json"
kvbridge bench mapper "${common[@]}" --head-mode same_head --json "$out/bench-qwen3-14b-32b-same_head.json"
kvbridge bench mapper "${common[@]}" --head-mode all_heads --rank "${RANK:-512}" --json "$out/bench-qwen3-14b-32b-rank.json"
