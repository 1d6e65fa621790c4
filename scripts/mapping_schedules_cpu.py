"""The mapping engine's schedules on this CPU, side by side with another checkout's engine (today's), in one run.

    flock /tmp/kvbridge-cpu.lock python scripts/mapping_schedules_cpu.py --baseline /work/main --threads 2 \\
        --json mapping-schedules-cpu.json

For each bridge (random weights; the map's time depends on the shapes only) and length, one source cache is mapped in
alternating rounds (`interleaved_medians`) by: the baseline checkout's `map_cache` with its own `KVMapper` holding the
same weights (today's engine), this checkout's default on the CPU (`schedule="chunked"`), and this checkout's
whole-layer schedule (`schedule="layers"`, the GPU's). Reports medians, their ratios to the baseline, the largest
relative difference of the caches (all three compute the same map) and the ops each dispatches per target layer.

The baseline checkout is imported under another package name (a copy of its `hf_kvbridge/` in a temporary folder),
so both engines live in one process. Importing public names only from this checkout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from hf_kvbridge.tools.bench.ops import count_ops
from hf_kvbridge.tools.bench.shapes import qwen3_shape_config, random_bridge
from hf_kvbridge.tools.bench.timing import interleaved_medians
from hf_kvbridge.utils.cache import output_cache

BRIDGES = {  # name: (source shape, target shape, top_k, head_mode); pocket-* are the shipped models' configs
    "issue-25 pair, all heads, top-3": ("small-3l-2x64", "small-8l-2x64", 3, "all_heads"),
    "issue-25 pair, same head, top-3": ("small-3l-2x64", "small-8l-2x64", 3, "same_head"),
    "pocket-s -> pocket-l, all heads, top-2": ("pocket-s", "pocket-l", 2, "all_heads"),
}


def shape_config(name: str):
    if name.startswith("pocket-"):
        from transformers import AutoConfig

        from hf_kvbridge.pocket import model_path

        return AutoConfig.from_pretrained(model_path(name))
    return qwen3_shape_config(name)


def baseline_engine(checkout: Path, folder: Path):
    """The baseline checkout's engine module and `KVMapper` class, imported as the package `kvbaseline`."""
    shutil.copytree(checkout / "hf_kvbridge", folder / "kvbaseline")
    (folder / "kvbaseline" / "__init__.py").write_text("")  # its Auto-class registrations stay this checkout's
    sys.path.insert(0, str(folder))
    engine = importlib.import_module("kvbaseline.mappers.engine")
    base = importlib.import_module("kvbaseline.mappers.base")
    return engine, base.KVMapper


def mappings(engine, bridge, baseline, workspace, cache) -> dict:
    """The three mappings of `cache`: the baseline's engine and mapper, and this checkout's two schedules."""
    return {
        "baseline": lambda: engine.map_cache(bridge.source, bridge.target, baseline, bridge.source_layout, cache,
                                             workspace=workspace, target_layout=bridge.target_layout),
        "chunked": lambda: bridge.map_cache(cache, schedule="chunked"),
        "layers": lambda: bridge.map_cache(cache, schedule="layers"),
    }  # fmt: skip


def relative_difference(a, b) -> float:
    worst = 0.0
    for x, y in zip(a.layers, b.layers):
        for p, q in ((x.keys, y.keys), (x.values, y.values)):
            worst = max(worst, float((p.double() - q.double()).norm() / q.double().norm().clamp_min(1e-30)))
    return worst


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="a checkout whose engine is today's (e.g. /work/main)")
    parser.add_argument("--lengths", default="256,512,1024,2048")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    device = torch.device("cpu")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        engine, BaselineMapper = baseline_engine(Path(args.baseline), Path(folder))
        for name, (source_shape, target_shape, top_k, head_mode) in BRIDGES.items():
            bridge = random_bridge(shape_config(source_shape), shape_config(target_shape), top_k=top_k,
                                   head_mode=head_mode)  # fmt: skip
            mapper = bridge.mapper
            heads, dim = mapper.source_kv_heads, mapper.source_head_dim
            baseline = BaselineMapper(mapper.selected_layers, heads, dim, head_mode)
            baseline.load_state_dict(mapper.state_dict())
            workspace = engine.Workspace()
            layers = bridge.target_layout.num_layers
            for length in lengths:
                ids = torch.randint(0, bridge.target_layout.vocab_size, (1, length),
                                    generator=torch.Generator().manual_seed(length))  # fmt: skip
                cache = output_cache(bridge.source.model(input_ids=ids, use_cache=True))
                fns = mappings(engine, bridge, baseline, workspace, cache)
                seconds = interleaved_medians(fns, device, args.repeats, 2)
                reference = fns["baseline"]()
                row = {"bridge": name, "tokens": length, "threads": torch.get_num_threads(), "repeats": args.repeats,
                       "load_average": os.getloadavg()}  # fmt: skip
                for key, fn in fns.items():
                    row[f"{key}_s"] = seconds[key]
                    row[f"{key}_over_baseline"] = seconds[key] / seconds["baseline"]
                    row[f"{key}_ops_per_target_layer"] = count_ops(fn).total / layers
                    row[f"{key}_relative_difference"] = relative_difference(fn(), reference)
                rows.append(row)
                print(
                    f"{name:34} {length:5}  baseline {seconds['baseline'] * 1e3:7.2f} ms  chunked "
                    f"{seconds['chunked'] * 1e3:7.2f} ({row['chunked_over_baseline']:.3f}×)  layers "
                    f"{seconds['layers'] * 1e3:7.2f} ({row['layers_over_baseline']:.3f}×)  ops/layer "
                    f"{row['baseline_ops_per_target_layer']:.1f} / {row['chunked_ops_per_target_layer']:.1f} / "
                    f"{row['layers_ops_per_target_layer']:.1f}  load {row['load_average'][0]:.1f}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps({"baseline": args.baseline, "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
