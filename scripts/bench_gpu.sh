#!/usr/bin/env bash
# The real-size GPU run, on one lent GPU, in at most 6 minutes, with random weights (weights don't change timings):
#   1. the mapper against the target's re-prefill at Qwen3-14B -> Qwen3-32B shapes, bfloat16, weights created on the
#      GPU: all-heads top-6 (the paper's map), same-head, and a rank-512 low-rank mapper, at 1K / 4K / 8K tokens;
#   2. a calibration throughput run (tokens/s; forwards vs statistics, selection, λ search and solves; the projection to
#      the paper's 500 × 1,024 tokens): Qwen3-0.6B -> 1.7B shapes, same-head top-6 with the statistics on the GPU (the
#      paper's all-heads map needs a float64 solve of p = 12,288 per target layer, 28 of them: more than this run's
#      minutes);
#   3. the calibration FLOP model with rates probed on the GPU (bf16, float32 and float64 products, a float64 eigh):
#      the paper's all-heads map of Qwen3-0.6B -> 1.7B and of Qwen3-14B -> 32B at the paper's 500 x 1,024 tokens, next to
#      the H100 datasheet model it checks.
# One JSON, ${OUT:-.}/bench-gpu.json, holds every step's result and exit status (a step that fails or runs past its
# limit does not stop the others). Needs a CUDA torch and transformers (the lent machine's python3 has both) and about
# 100 GB of GPU memory (32B + 14B in bf16 + the mapper). Runs the package from this checkout with `python -m`, since
# that machine has no registry access and no install step:
#
#   OUT=/tmp/gpu bash scripts/bench_gpu.sh
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${OUT:-.}"
mkdir -p "$out"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
lengths="${LENGTHS:-1024,4096,8192}"
common=(--shapes qwen3-14b:qwen3-32b --top-k 6 --dtype bfloat16 --device cuda --lengths "$lengths"
        --repeats "${REPEATS:-5}" --warmup "${WARMUP:-2}")
declare -A status

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, keep its exit status
    local name="$1" limit="$2"
    shift 2
    echo "== $name (at most ${limit} s)"
    timeout "$limit" "$@"
    status[$name]=$?
}

step mapper_all_heads 90 "$py" -m kvbridge_cli bench mapper "${common[@]}" --head-mode all_heads \
    --json "$out/mapper-all_heads.json"
step mapper_same_head 75 "$py" -m kvbridge_cli bench mapper "${common[@]}" --head-mode same_head \
    --json "$out/mapper-same_head.json"
step mapper_low_rank 75 "$py" -m kvbridge_cli bench mapper "${common[@]}" --head-mode all_heads \
    --rank "${RANK:-512}" --json "$out/mapper-low_rank.json"
step calibration 80 "$py" -m kvbridge_cli bench calibration --pair qwen3-0.6b:qwen3-1.7b --device cuda \
    --statistics-device cuda --dtype bfloat16 --head-mode same_head --kv-mode separate --top-k 6 \
    --num-sequences "${NUM_SEQUENCES:-32}" --seq-len 1024 --batch-size 4 --statistics-memory 40GB \
    --json "$out/calibration.json"
flop=(bench calibration --flop-model --device cuda --dtype bfloat16 --head-mode all_heads --kv-mode joint --top-k 6
      --num-sequences 500 --seq-len 1024 --statistics-memory 40GB)
step flop_model_small 20 "$py" -m kvbridge_cli "${flop[@]}" --pair qwen3-0.6b:qwen3-1.7b \
    --json "$out/flop-model-small.json"
step flop_model_large 20 "$py" -m kvbridge_cli "${flop[@]}" --pair qwen3-14b:qwen3-32b \
    --json "$out/flop-model-large.json"

statuses=""
for name in "${!status[@]}"; do statuses+="$name=${status[$name]} "; done
"$py" - "$out" $statuses <<'EOF'
import json, os, sys

import torch

out, steps = sys.argv[1], dict(arg.split("=") for arg in sys.argv[2:])
files = {"mapper_all_heads": "mapper-all_heads.json", "mapper_same_head": "mapper-same_head.json",
         "mapper_low_rank": "mapper-low_rank.json", "calibration": "calibration.json",
         "flop_model_small": "flop-model-small.json", "flop_model_large": "flop-model-large.json"}
result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__}
for name, file in files.items():
    path = os.path.join(out, file)
    result[name] = {"exit_status": int(steps.get(name, -1)),
                    "result": json.load(open(path)) if os.path.exists(path) else None}
with open(os.path.join(out, "bench-gpu.json"), "w") as f:
    json.dump(result, f, indent=2)
print("wrote", os.path.join(out, "bench-gpu.json"), {name: r["exit_status"] for name, r in result.items()
                                                      if isinstance(r, dict)})
EOF
