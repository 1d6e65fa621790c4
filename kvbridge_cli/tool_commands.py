"""The subcommands of the tools: `eval`, `inspect`, `bench`, `tune`, `demo`."""

from __future__ import annotations

from ._light import core
from .arguments import (
    MODEL_DTYPES,
    POCKET_DATA,
    _calibration_data,
    _comma_list,
    _eval_modes,
    _heldout_data,
    _kv_mode,
    _layer_count,
    _lengths,
    _Parser,
    _positive_float,
    _positive_int,
    _ridge_lambda,
    _share,
    _tune_top_k,
    _yes_no,
)
from .settings_options import add_settings_options

_constants = core("constants")
_pocket = core("pocket")
_defaults = core("tools.defaults")  # the demo's and the mapper benchmark's defaults
_grid = core("tools.tune.grid")  # the tune grid's and search's defaults

# the pocket models the demo offers: all of them (pocket-x has another KV layout, mapped like the others)
DEMO_MODELS = _pocket.POCKET_MODELS
BENCH_DTYPES = ("float32", "bfloat16", "float16")
# The settings fields `demo` and `tune` offer, with the defaults those commands deliberately use instead of the
# library's (None: the command picks the value, as its --help says). Every other command-line option of theirs is
# their own.
DEMO_SETTINGS = {**_defaults.DEMO_SETTINGS, "num_sequences": None, "seq_len": None}


def _full(name: str) -> int:
    return _defaults.DEMO_SIZES[name][0]


def _quick(name: str) -> int:
    return _defaults.DEMO_SIZES[name][1]


DEMO_SIZES_HELP = {
    name: f"default {_full(name)}; {_quick(name)} with --quick" for name in ("num_sequences", "seq_len")
}
TUNE_SETTINGS = {
    "num_sequences": _grid.DEFAULT_NUM_SEQUENCES,
    "seq_len": _grid.DEFAULT_SEQ_LEN,
    "heldout_fraction": _grid.DEFAULT_HELDOUT_FRACTION,
    "seed": _grid.DEFAULT_SEED,
    "text_field": _grid.DEFAULT_TEXT_FIELD,
    "hidden_state_layers": _grid.DEFAULT_HIDDEN_STATE_LAYERS,
}


def add_eval(sub) -> None:
    ev = sub.add_parser(
        "eval",
        help="source, target and bridge through lm-eval (--tasks), and on held-out text (--heldout: NLL, retention "
        "and next-token KL with paired bootstrap intervals, a retrieval probe)",
    )
    ev.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    ev.add_argument("--tasks", help="comma-separated lm-eval tasks or groups (--tasks and/or --heldout)")
    ev.add_argument("--include-path", help="extra lm-eval task folder, e.g. eval_tasks/pocket")
    ev.add_argument("--limit", type=float, help="documents per task (an int, or a fraction < 1)")
    ev.add_argument("--num-fewshot", type=int)
    ev.add_argument("--batch-size", type=int, default=1)
    ev.add_argument("--device", help="default: cuda when available, else cpu")
    ev.add_argument("--dtype", default="auto", choices=MODEL_DTYPES, help="the models' dtype (auto: the checkpoint's)")
    ev.add_argument("--revision", help="revision of the bridge repo on the Hub")
    ev.add_argument("--rolling-stride", type=int, help="chunk size of rolling log-likelihood (default 256)")
    ev.add_argument("--bootstrap-iters", type=int, default=100000, help="lm-eval's, for non-mean metrics")
    modes = _constants.EVAL_MODES
    ev.add_argument("--modes", type=_eval_modes, default=",".join(modes), help=f"subset of {','.join(modes)}")
    ev.add_argument("--output", help="write the results (table rows and each mode's lm-eval results) as JSON")
    ev.add_argument("--write-card", action="store_true", help="put the table into the checkpoint's README.md")
    add_heldout_options(ev)


def add_heldout_options(ev) -> None:
    """`kvbridge eval --heldout`: the bridge against its target on windows of held-out text (`tools.fidelity`);
    the defaults are `kvbridge demo`'s own measurement (64 windows of 384 + 128 tokens)."""
    ev.add_argument(
        "--heldout",
        type=_heldout_data,
        help=f"held-out text ('{POCKET_DATA}': the pocket family's held-out split, or a .txt/.jsonl file or folder, "
        "or a dataset): per mode the continuation NLL, context-benefit retention and KL(target ‖ mode) with paired "
        "bootstrap 95%% intervals, the gap recovered, the zero/random-cache controls and the retrieval probe",
    )
    ev.add_argument("--windows", type=_positive_int, default=_full("nll_windows"), help="held-out windows")
    ev.add_argument("--context-len", type=_positive_int, default=_full("nll_context"), help="tokens the bridge maps")
    ev.add_argument("--continuation-len", type=_positive_int, default=_full("nll_continuation"), help="tokens scored")
    ev.add_argument(
        "--probe-items", type=int, default=32, help="retrieval-probe facts (0: no probe); one held-out window each"
    )
    ev.add_argument("--probe-context", type=_positive_int, default=512, help="tokens of each probe's context")
    ev.add_argument("--bootstrap", type=_positive_int, default=2000, help="bootstrap resamples of the windows")
    ev.add_argument(
        "--both-directions",
        action="store_true",
        help="with --heldout: also the reverse direction, from the checkpoint's reverse mapper (calibrated with "
        "--bidirectional) or --reverse",
    )
    ev.add_argument("--reverse", help="with --heldout: the bridge of the other direction (a checkpoint or Hub id)")


def add_inspect(sub) -> None:
    inspect = sub.add_parser("inspect", help="diagnostics report of a saved bridge on held-out text (JSON + PNG)")
    inspect.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    inspect.add_argument(
        "--data",
        required=True,
        type=_heldout_data,
        help=f"held-out text: a .txt/.jsonl file or folder, '{POCKET_DATA}' (the pocket family's held-out split), "
        "or a dataset",
    )
    inspect.add_argument("--num-sequences", type=_positive_int, default=16)
    inspect.add_argument("--seq-len", type=_positive_int, default=256)
    inspect.add_argument("--batch-size", type=_positive_int, default=4)
    inspect.add_argument("--out", default="kvbridge-inspect", help="folder for report.json and the plots")


def add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: mapper vs re-prefill, calibration at real shapes, vLLM")
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)

    mapper = kinds.add_parser("mapper", help="mapper time vs the target's re-prefill, per context length")
    mapper.add_argument("bridge", nargs="?", help="bridge checkpoint (or use --shapes for random weights)")
    mapper.add_argument("--shapes", help="random-weight Qwen3 shapes, e.g. qwen3-0.6b:qwen3-4b")
    mapper.add_argument("--top-k", type=_positive_int, default=6, help="with --shapes")
    mapper.add_argument("--head-mode", choices=_constants.HEAD_MODES, default="all_heads", help="with --shapes")
    mapper.add_argument("--rank", type=_positive_int, help="with --shapes: a low-rank mapper of this rank")
    mapper.add_argument("--mapper-dtype", choices=BENCH_DTYPES, help="defaults to --dtype")
    mapper.add_argument(
        "--interleave", action="store_true", help="alternate source, mapper and target runs (in cascade order)"
    )
    mapper.add_argument(
        "--old-vs-new",
        action="store_true",
        help="time the old default mapping against the new one in alternating rounds (no prefills); JSON key "
        "old_vs_new",
    )
    mapper.add_argument(
        "--lengths",
        type=_lengths,
        help="context lengths in tokens (default "
        + ",".join(map(str, _defaults.BENCH_LENGTHS))
        + ", cut to the models' maximum positions)",
    )
    mapper.add_argument(
        "--schedule",
        choices=_constants.SCHEDULES,
        default=None,
        help="the mapping engine's schedule (default: by device, whole layers on CUDA, chunks on CPU)",
    )
    mapper.add_argument(
        "--end-to-end",
        action="store_true",
        help="also time to first token through bridge.generate_from_cache, warm and cold (JSON key ttft)",
    )
    mapper.add_argument(
        "--compile-hold-back",
        action="store_true",
        help="with --end-to-end: also a static cache with the hold-back through the target's compiled call",
    )
    mapper.add_argument("--batch", type=_positive_int, default=1)
    mapper.add_argument("--repeats", type=_positive_int, default=5)
    mapper.add_argument("--warmup", type=int, default=1)
    mapper.add_argument("--dtype", default="float32", choices=BENCH_DTYPES)
    mapper.add_argument("--device", default="cpu")
    mapper.add_argument("--threads", type=_positive_int, help="torch threads on CPU")
    mapper.add_argument("--json", help="write the rows as JSON here")

    cal = kinds.add_parser(
        "calibration",
        help="calibration at real layer shapes with random weights: tokens/s, statistics memory, peak RSS",
    )
    cal.add_argument("--pair", default="qwen3-0.6b:qwen3-1.7b", help="source:target Qwen3 shapes")
    cal.add_argument("--num-sequences", type=_positive_int, default=8)
    cal.add_argument("--seq-len", type=_positive_int, default=256)
    cal.add_argument("--batch-size", type=_positive_int, default=2)
    cal.add_argument("--heldout-fraction", type=float, default=0.125)
    cal.add_argument("--top-k", type=_positive_int, default=6)
    cal.add_argument("--head-mode", default="same_head", choices=_constants.HEAD_MODES)
    cal.add_argument("--kv-mode", default="joint", choices=_constants.KV_MODES)
    cal.add_argument("--statistics-memory", default="8GB")
    cal.add_argument("--statistics-dtype", default="float32", choices=_constants.STATISTICS_DTYPES)
    cal.add_argument("--statistics-device", default=None)
    cal.add_argument(
        "--float32-matmul-precision",
        default=None,
        choices=("highest", "high", "medium"),
        help="torch.set_float32_matmul_precision for the run: 'medium' lets float32 products (the statistics, and "
        "float32 models' forwards) run in bfloat16 with float32 accumulation on bfloat16 units",
    )
    cal.add_argument("--dtype", default="bfloat16")
    cal.add_argument("--device", default="cpu")
    cal.add_argument("--vocab", type=_positive_int, default=None, help="override the vocabulary size")
    cal.add_argument(
        "--layers",
        default=None,
        metavar="S:T",
        help="build only the first S source and T target layers (real layer shapes: a pair too large for this "
        "machine); the JSON's full_depth scales each stage to the whole pair",
    )
    cal.add_argument("--progress", action="store_true")
    cal.add_argument("--json", default=None, help="also write the result here")
    cal.add_argument("--memory-model", action="store_true", help="print the README's memory model table and exit")
    cal.add_argument(
        "--flop-model",
        action="store_true",
        help="print the FLOPs of each calibration stage and their time at rates probed on --device and on an H100 "
        "(datasheet peaks x assumed efficiencies), then exit; no models are built",
    )
    cal.add_argument(
        "--fit-passes",
        type=_positive_int,
        default=None,
        help="with --flop-model: this many fit passes instead of the plan within --statistics-memory",
    )

    dist = kinds.add_parser(
        "distill",
        help="distillation at real layer shapes with random weights: a training step's time by part, its memory "
        "against the plan, the whole run projected (or --flop-model: on paper)",
    )
    dist.add_argument("--pair", default="qwen3-0.6b:qwen3-1.7b", help="source:target Qwen3 shapes")
    dist.add_argument("--seq-len", type=_positive_int, default=512, help="window length (context + continuation)")
    dist.add_argument("--continuation-len", type=_positive_int, default=128, help="tokens of a window scored")
    dist.add_argument("--top-k", type=_positive_int, default=6)
    dist.add_argument("--head-mode", default="all_heads", choices=_constants.HEAD_MODES)
    dist.add_argument("--dtype", default="float32", choices=BENCH_DTYPES, help="the models' dtype")
    dist.add_argument("--device", default="cpu")
    dist.add_argument("--steps", type=_positive_int, default=3, help="one-window training steps (the first warms up)")
    dist.add_argument("--windows", type=_positive_int, default=256, help="the projected run's num_sequences")
    dist.add_argument("--epochs", type=_positive_int, default=2, help="the projected run's epochs")
    dist.add_argument("--pull-candidates", type=_positive_int, default=2, help="the projected run's pull strengths")
    dist.add_argument("--fit-passes", type=_positive_int, default=1, help="the calibration it is compared with")
    dist.add_argument(
        "--flop-model",
        action="store_true",
        help="no models: FLOPs, the memory plan and the run's time on an H100 (datasheet peaks x assumed "
        "efficiencies), with models in --dtype (use bfloat16 for a GPU)",
    )
    dist.add_argument("--threads", type=_positive_int, help="torch threads on CPU")
    dist.add_argument("--json", help="write the result here")

    store = kinds.add_parser(
        "store",
        help="the KV store's put and fetch (encoding and checks included) against raw pipelined SET/GET of the same "
        "bytes over the same connections, GB/s and ratios",
    )
    store.add_argument(
        "--store", default="local", help="a store URL of one server, or 'local': start a redis-server here (default)"
    )
    store.add_argument(
        "--shapes", default="qwen3-0.6b:qwen3-1.7b", help="SOURCE:TARGET shapes; the store holds the source K/V"
    )
    store.add_argument("--tokens", type=_lengths, default=[1000, 8000], help="prompt lengths, e.g. 1000,8000")
    store.add_argument("--chunk-size", type=_positive_int, help="tokens per stored chunk (default: the store's)")
    store.add_argument("--repeats", type=_positive_int, default=3, help="alternating rounds (medians reported)")
    store.add_argument("--dtype", default="bfloat16", choices=BENCH_DTYPES, help="the source K/V's dtype")
    store.add_argument(
        "--encoding", choices=_constants.STORE_ENCODINGS, default="source", help="how the store's chunks hold the K/V"
    )
    store.add_argument(
        "--connections", type=_positive_int, default=4, help="connections a fetch or write is spread over (and raw's)"
    )
    store.add_argument(
        "--retention",
        metavar="SOURCE:TARGET",
        help="instead: what each store encoding costs a bridge of this pocket pair (e.g. pocket-m:pocket-l, "
        "calibrated here): context-benefit retention with the source K/V encoded and decoded before the map, paired "
        "95%% CI",
    )
    store.add_argument("--windows", type=_positive_int, default=32, help="with --retention: held-out windows")
    store.add_argument("--json", help="write the result here")

    vllm = kinds.add_parser(
        "vllm", help="time to first token and throughput in vLLM, with and without the bridge (needs vLLM)"
    )
    vllm.add_argument("--bridge", help="a bridge checkpoint (default: calibrate the pocket pair here)")
    vllm.add_argument(
        "--pair", default="pocket-s:pocket-l", help="pocket pair to calibrate when --bridge is not given"
    )
    vllm.add_argument("--shapes", help="random Qwen3-shaped models instead, e.g. qwen3-0.6b:qwen3-8b (GPU)")
    vllm.add_argument("--lengths", type=_lengths, default=[512, 1024, 2000], help="prompt lengths in tokens")
    vllm.add_argument(
        "--store",
        help="a KV store URL (or 'local': start a redis-server here; 'local-cluster': a 3-master cluster) to time "
        "the warm path too: prompts whose source KV are in the store, mapped with no source prefill",
    )
    vllm.add_argument(
        "--chunk-sizes",
        type=_lengths,
        help="with --store: the store chunk sizes to time the warm path at, one engine each, e.g. 16,64,256 "
        "(default: the store's default)",
    )
    vllm.add_argument(
        "--fetch-parts",
        type=_lengths,
        help="with --store: the runs a load from the store is fetched in, each mapped while the next arrives, one "
        "engine each, e.g. 1,4 (1: fetch, then map; default 4)",
    )
    vllm.add_argument(
        "--source-throughput",
        action="store_true",
        help="with --store: also the source engine's throughput, alone and exporting (requests opted in and not, "
        "interleaved in each round), and the export's CPU time against the engine's time for the same tokens",
    )
    vllm.add_argument(
        "--source-rounds", type=_positive_int, help="with --source-throughput: rounds (default: --repeats)"
    )
    vllm.add_argument("--repeats", type=_positive_int, default=5, help="TTFT samples per length and mode")
    vllm.add_argument("--requests", type=_positive_int, default=8, help="requests per throughput batch")
    vllm.add_argument("--max-tokens", type=_positive_int, default=32, help="output tokens per throughput request")
    vllm.add_argument("--dtype", default="bfloat16")
    vllm.add_argument("--block-size", type=_positive_int, help="vLLM block size (CPU attention: multiple of 32)")
    vllm.add_argument("--kv-cache-gb", type=_positive_float, default=1.0)
    vllm.add_argument("--max-model-len", type=_positive_int, default=None)
    vllm.add_argument("--num-sequences", type=_positive_int, default=64)
    vllm.add_argument("--seq-len", type=_positive_int, default=512)
    vllm.add_argument("--top-k", type=_positive_int, default=6)
    vllm.add_argument("--json", help="write the results here")


def add_tune(sub) -> None:
    tune = sub.add_parser(
        "tune",
        help="search top-k, λ, kv mode, mapper, rank, recompute share and recomputed layers from one calibration; "
        "save the choice",
    )
    tune.add_argument("source", help="source model (Hub id, local path, or pocket/<name>)")
    tune.add_argument("target", help="target model (Hub id, local path, or pocket/<name>)")
    tune.add_argument(
        "--min-retention",
        type=_positive_float,
        help="quality target: the cheapest configuration whose context-benefit retention on the tuning windows "
        "reaches it is chosen",
    )
    tune.add_argument(
        "--max-cost",
        type=_positive_float,
        help="cost budget, FLOPs per context token (maps + recomputed tokens and layers) as a share of the target's "
        "own prefill; alone: the best retention within it; with --min-retention: the cheapest meeting the target "
        "within it",
    )
    tune.add_argument("--out", required=True, help="output folder for the chosen bridge checkpoint")
    tune.add_argument("--overwrite", action="store_true", help="replace bridge files in a non-empty --out")
    tune.add_argument("--json", default="kvbridge-tune.json", help="where to write every measured point")
    tune.add_argument(
        "--data",
        type=_calibration_data,
        default=_constants.DEFAULT_CALIBRATION_DATA,
        help=f"calibration data, as for kvbridge calibrate ('{POCKET_DATA}': the pocket family's calibration split)",
    )
    tune.add_argument(
        "--eval-data",
        type=_heldout_data,
        required=True,
        help=f"held-out text for the tuning and check windows (other documents each); '{POCKET_DATA}': the pocket "
        "family's held-out split",
    )
    grid = tune.add_argument_group("grid (comma-separated values)")
    grid.add_argument("--top-k", type=_comma_list(_tune_top_k, "top-k values"), default=list(_grid.DEFAULT_TOP_K))
    grid.add_argument(
        "--ridge-lambdas",
        type=_comma_list(_ridge_lambda, "λ values ('auto' or ≥ 0)"),
        default=list(_grid.DEFAULT_LAMBDAS),
    )
    grid.add_argument("--kv-modes", type=_comma_list(_kv_mode, "kv modes"), default=list(_grid.DEFAULT_KV_MODES))
    grid.add_argument(
        "--ranks",
        type=_comma_list(_positive_int, "ranks", allow_empty=True),
        default=list(_grid.DEFAULT_RANKS),
        help="ranks of the low-rank mapper ('none': ridge only)",
    )
    grid.add_argument(
        "--recompute-fractions", type=_comma_list(_share, "shares in [0, 1]"), default=list(_grid.DEFAULT_FRACTIONS)
    )
    grid.add_argument(
        "--recompute-layers",
        type=_comma_list(_layer_count, "layer counts"),
        default=list(_grid.DEFAULT_RECOMPUTE_LAYERS),
        help="top target layers the target recomputes over the whole context (layer recompute; their residual maps "
        "are fitted in the calibration pass); 0: the plain bridge",
    )
    grid.add_argument(
        "--mlp-hidden",
        type=_comma_list(_positive_int, "hidden widths", allow_empty=True),
        default=list(_grid.DEFAULT_MLP_HIDDEN),
        help="hidden widths of MLP mappers, trained from each top-k's ridge fit at the first λ and kv mode ('none': "
        "no MLP)",
    )
    grid.add_argument(
        "--mlp-loss", choices=_constants.MLP_LOSSES, default=_grid.DEFAULT_MLP_LOSS, help="the MLPs' training loss"
    )
    grid.add_argument(
        "--mlp-epochs",
        type=_positive_int,
        default=_grid.DEFAULT_MLP_EPOCHS,
        help="the MLPs' passes over the calibration windows",
    )
    grid.add_argument(
        "--hidden-states",
        type=_comma_list(_yes_no, "yes/no values"),
        default=list(_grid.DEFAULT_HIDDEN_STATES),
        help="no: maps of the source's K/V only; yes: ridge and low-rank joint maps that also read the source's "
        "hidden states (--hidden-state-layers, collected in the same calibration pass) (default: "
        + ",".join("yes" if h else "no" for h in _grid.DEFAULT_HIDDEN_STATES)
        + ")",
    )
    settings = tune.add_argument_group("calibration settings (tune's defaults)")
    add_settings_options(settings, TUNE_SETTINGS)
    tune.add_argument("--tune-windows", type=_positive_int, default=_grid.DEFAULT_TUNE_WINDOWS)
    tune.add_argument("--check-windows", type=_positive_int, default=_grid.DEFAULT_CHECK_WINDOWS)
    tune.add_argument(
        "--context", type=_positive_int, default=_grid.DEFAULT_CONTEXT, help="context tokens of each window"
    )
    tune.add_argument(
        "--continuation",
        type=_positive_int,
        default=_grid.DEFAULT_CONTINUATION,
        help="scored tokens after the context",
    )
    tune.add_argument("--dtype", choices=MODEL_DTYPES, help="the models' dtype (default: the checkpoint's)")


def add_demo(sub) -> None:
    demo = sub.add_parser(
        "demo",
        help="calibrate and measure a bridge of the shipped pocket family (offline)",
        description="Calibrates a pocket bridge and measures it (retention, cloze, speed); "
        f"{_full('num_sequences')} × {_full('seq_len')}-token calibration windows by default, "
        f"{_quick('num_sequences')} × {_quick('seq_len')} with --quick.",
    )
    demo.add_argument("--out", default="kvbridge-demo", help="parent folder; each run writes a new folder in it")
    demo.add_argument("--quick", action="store_true", help="smaller calibration and evaluation (for tests)")
    demo.add_argument(
        "--source", default=_defaults.DEMO_SOURCE, choices=DEMO_MODELS, help="pocket model that prefills"
    )
    demo.add_argument("--target", default=_defaults.DEMO_TARGET, choices=DEMO_MODELS, help="pocket model that decodes")
    settings = demo.add_argument_group("calibration settings (the demo's defaults)")
    add_settings_options(settings, DEMO_SETTINGS, DEMO_SIZES_HELP)
    demo.add_argument(
        "--threads", type=_positive_int, help="torch threads (default: the physical cores, fewer when others are busy)"
    )
