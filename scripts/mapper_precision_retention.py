"""Retention of a float32 bridge mapping with its float32 mapper (PyTorch's default matmul precision) against the same
bridge under `torch.set_float32_matmul_precision("medium")`, where it maps with a bfloat16 copy of the mapper on a
device with bfloat16 matrix units (`KVBridgeForCausalLM.mapping_mapper`; docs/benchmarks.md, "Old default vs new
default"). Paired over the same held-out windows; the models are the pocket family in float32. Under "medium"
PyTorch runs the models' own float32 products in bfloat16 too, so the mapper alone in bfloat16
(`mapper_dtype=torch.bfloat16`, models at the default precision) is measured beside it.

    HF_HUB_OFFLINE=1 PYTHONPATH=. python scripts/mapper_precision_retention.py --out precision_retention.json

Per pair and top-k: 128 × 256 calibration tokens, auto-λ, 64 held-out windows of 256 + 64 tokens.
"""

import argparse
import json

import torch
from transformers import AutoTokenizer

from hf_kvbridge import pocket
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.checks import split_heldout
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.data import token_windows
from hf_kvbridge.modeling import KVBridgeForCausalLM
from hf_kvbridge.tools.evaluation import continuation_nll, heldout_windows
from hf_kvbridge.utils.precision import bf16_matmul_units, float32_matmul_precision

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--pairs", nargs="+", default=["pocket-s:pocket-l", "pocket-l:pocket-s"])
parser.add_argument("--top-k", default="3,6", help="comma-separated top-k values")
parser.add_argument("--windows", type=int, default=64)
parser.add_argument("--out", default="precision_retention.json")
args = parser.parse_args()

torch.set_num_threads(2)
torch.manual_seed(0)
rows = []
for pair in args.pairs:
    src_name, tgt_name = pair.split(":")
    tok = AutoTokenizer.from_pretrained(pocket.model_path(tgt_name))
    source, target = pocket.load_model(src_name), pocket.load_model(tgt_name)  # float32
    windows = token_windows(pocket.load_texts("calibration"), tok, 128, 256)
    ev = heldout_windows(pocket.load_texts("heldout"), tok, 256 + 64, args.windows)
    _, hid = split_heldout(len(windows), 0.1, 0)
    train, heldout = collect_statistics(source, target, windows, heldout=hid, batch_size=8)
    for top_k in (int(k) for k in args.top_k.split(",")):
        bridge = fit_bridge(source, target, train, heldout, top_k=top_k)
        old = continuation_nll(bridge, ev, 256)
        with float32_matmul_precision("medium"):  # the models' own float32 products may run in bfloat16 too
            new_dtype = str(bridge.mapping_mapper().layout_dtype())
            new = continuation_nll(bridge, ev, 256)
        # the mapper alone in bfloat16, the models at PyTorch's default precision
        bf16 = KVBridgeForCausalLM(bridge.config, source, target, bridge.mapper, mapper_dtype=torch.bfloat16)
        mapper_only = continuation_nll(bf16, ev, 256)
        row = {
            "pair": pair,
            "top_k": top_k,
            "windows": len(ev),
            "old_mapper_dtype": str(bridge.mapper.layout_dtype()),
            "new_mapper_dtype": new_dtype,
            "old_retention": old["context_benefit_retention"],
            "new_retention": new["context_benefit_retention"],
            "retention_change": new["context_benefit_retention"] - old["context_benefit_retention"],
            "bf16_mapper_only_retention": mapper_only["context_benefit_retention"],
            "bf16_mapper_only_change": mapper_only["context_benefit_retention"] - old["context_benefit_retention"],
            "old_bridge_nll": old["nll"]["bridge"],
            "new_bridge_nll": new["nll"]["bridge"],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
payload = {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_bf16_units": bf16_matmul_units("cpu")}
with open(args.out, "w") as handle:
    json.dump({**payload, "threads": torch.get_num_threads(), "rows": rows}, handle, indent=2)
print(f"wrote {args.out}")
