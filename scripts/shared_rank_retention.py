"""Retention of one rank-r bottleneck shared by all target layers of a step (reduced-rank regression of the stacked
ridge maps in standardised output units), against the ridge mapper, on a pocket pair (docs/benchmarks.md,
"Old default vs new default"). Weights are kept full-size: this measures quality, not speed.

    HF_HUB_OFFLINE=1 PYTHONPATH=. python scripts/shared_rank_retention.py pocket-s pocket-l 3 96,128
    HF_HUB_OFFLINE=1 PYTHONPATH=. python scripts/shared_rank_retention.py pocket-m pocket-l 6 256

Arguments: source, target, top-k, ranks. 128 × 256 calibration tokens, auto-λ, 64 held-out windows of 256 + 64.
"""

import copy
import json
import sys

import torch
from transformers import AutoTokenizer

from hf_kvbridge import pocket
from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
from hf_kvbridge.fitting.calibration.checks import split_heldout
from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
from hf_kvbridge.fitting.data import token_windows
from hf_kvbridge.tools.evaluation import continuation_nll, heldout_windows
from hf_kvbridge.utils.heads import map_groups

torch.set_num_threads(2)
torch.manual_seed(0)
src_name, tgt_name, top_k = sys.argv[1], sys.argv[2], int(sys.argv[3])
ranks = [int(r) for r in sys.argv[4].split(",")]
tok = AutoTokenizer.from_pretrained(pocket.model_path(tgt_name))
source, target = pocket.load_model(src_name), pocket.load_model(tgt_name)
windows = token_windows(pocket.load_texts("calibration"), tok, 128, 256)
ev = heldout_windows(pocket.load_texts("heldout"), tok, 256 + 64, 64)
_, hid = split_heldout(len(windows), 0.1, 0)
train, heldout = collect_statistics(source, target, windows, heldout=hid, batch_size=8)
bridge = fit_bridge(source, target, train, heldout, top_k=top_k)
stats = train + heldout
m = bridge.mapper
base = continuation_nll(bridge, ev, 256)["context_benefit_retention"]
print("ridge retention", base, "selected", m.selected_layers, flush=True)
# group targets by source set
groups = {}
for t, layers in enumerate(m.selected_layers):
    groups.setdefault(tuple(sorted(layers)), []).append(t)
res = {"base": base}
for r in ranks:
    mm = copy.deepcopy(m)
    for sources, targets in groups.items():
        sources = list(sources)
        Ws, stds, mys = [], [], []
        for t in targets:
            ((x_idx, y_idx),) = map_groups(stats, sources, t, "all_heads", "joint")
            mx, my, cxx, _, var_y = stats.moments(x_idx, y_idx)
            Ws.append(m._in_source_order(m.layers[t].weight.double(), t, sources)[0])
            stds.append(var_y.clamp_min(0).sqrt())
            mys.append(my)
        W = torch.cat(Ws, 1)
        S = torch.cat(stds).clamp_min(1e-30)
        my = torch.cat(mys)
        sc = W / S
        M = sc.T @ cxx @ sc
        ev_, vec = torch.linalg.eigh((M + M.T) / 2)
        frac = ev_.flip(0).cumsum(0) / ev_.sum()
        U = vec[:, -r:]
        Wr = sc @ U @ U.T * S
        b = my - mx @ Wr
        q = m.out_width
        for i, t in enumerate(targets):
            blk = Wr[:, i * q : (i + 1) * q]
            order = m.selected_layers[t]
            span = blk.shape[0] // len(sources)
            w_sel = torch.cat([blk[sources.index(s) * span : (sources.index(s) + 1) * span] for s in order])
            mm.layers[t].weight.data[0] = w_sel.float()
            mm.layers[t].bias.data[0] = b[i * q : (i + 1) * q].float()
        print(
            "group",
            sources,
            len(targets),
            "p",
            W.shape[0],
            "q",
            W.shape[1],
            "var frac at r",
            r,
            float(frac[r - 1]),
            flush=True,
        )
    br = bridge.with_mapper(mm, bridge.config)
    ret = continuation_nll(br, ev, 256)["context_benefit_retention"]
    res[r] = ret
    print("rank", r, "retention", ret, "delta", ret - base, flush=True)
print(json.dumps(res))
