"""Where the mapper's time goes, in CPU time on one thread (which a loaded machine hardly changes): the old default
mapping (rotations computed per call), the new one (rotations kept in the workspace) and the one matrix product of
the same shape alone, in alternating rounds.

    PYTHONPATH=. python scripts/mapper_time_split.py --shapes small-3l-2x64:small-8l-2x64 --top-k 3 --repeats 15

The product alone bounds what any exact change to the rest of the mapping (RoPE, copies, cache build) can save.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_kvbridge.mappers.engine import Workspace, map_cache
from hf_kvbridge.tools.bench.shapes import qwen3_shape_config, random_bridge
from hf_kvbridge.utils.cache import output_cache


@torch.no_grad()
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="small-3l-2x64:small-8l-2x64")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--lengths", default="256,1024,2048")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    source_name, target_name = args.shapes.split(":")
    bridge = random_bridge(qwen3_shape_config(source_name), qwen3_shape_config(target_name), top_k=args.top_k)
    old_workspace, rows = Workspace(reuse_rotations=False), []
    for length in map(int, args.lengths.split(",")):
        ids = torch.randint(0, bridge.target_layout.vocab_size, (1, length))
        cache = output_cache(bridge.source.model(input_ids=ids, use_cache=True))
        inputs = len(bridge.mapper.selected_layers[0]) * bridge.mapper.row_width
        outputs = len(bridge.mapper.selected_layers) * bridge.mapper.out_width
        x, weight = torch.randn(length, inputs), torch.randn(inputs, outputs)
        bias, out = torch.randn(outputs), torch.empty(length, outputs)
        fns = {
            "old": lambda c=cache: map_cache(
                bridge.source, bridge.target, bridge.mapper, bridge.source_layout, c, workspace=old_workspace
            ),
            "new": lambda c=cache: bridge.map_cache(c),
            "product": lambda x=x, w=weight, b=bias, o=out: torch.addmm(b, x, w, out=o),
        }
        for fn in fns.values():
            fn()
        times = {name: [] for name in fns}
        for _ in range(args.repeats):
            for name, fn in fns.items():
                start = time.process_time()
                fn()
                times[name].append(time.process_time() - start)
        row = {name: statistics.median(values) for name, values in times.items()}
        row.update(tokens=length, new_over_old=row["new"] / row["old"], product_over_old=row["product"] / row["old"])
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"shapes": args.shapes, "top_k": args.top_k, "threads": args.threads, "rows": rows}, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
