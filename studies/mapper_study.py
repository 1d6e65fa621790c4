"""Mapper comparison (`python -m studies.mapper_study`): ridge, its cheaper forms (same-head, low rank, bfloat16
weights), residual MLP (MSE and attention loss) and the attention-weighted closed form, side by side on the pocket
family's hardest pair, with their cost.

1. Every candidate pair (default `pocket-s → pocket-l`, `pocket-m → pocket-l`, `pocket-l → pocket-s`; pairs whose
   models are not installed are skipped, and with no `pocket-l` the study falls back to `pocket-s ↔ pocket-m`) gets a
   ridge bridge on the calibration split, scored by context-benefit retention (continuation NLL) on held-out windows.
2. On the pair with the lowest retention, the other mappers are fitted on the same calibration windows and scored on
   the same held-out windows: retention, attention-output cosine, held-out R² (linear mappers), cloze accuracy
   (optional), fit time, mapper size (parameters and bytes), and speed: `map_cache` on one context against the
   target's re-prefill of it (medians), the warm speedup, the FLOP-ratio bound and the fraction of it
   reached.

Mapper names: `ridge`, `ridge_same_head`, `low_rank_<rank>` (e.g. `low_rank_32`), `mlp_mse`, `mlp_attention`,
`ridge_attention_weighted`; a linear one with `_bf16` appended keeps its weights (and so its products) in bfloat16.

Prints a table and writes JSON. The command's defaults take about 3 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_PAIRS = "pocket-s:pocket-l,pocket-m:pocket-l,pocket-l:pocket-s"
FALLBACK_PAIRS = "pocket-s:pocket-m,pocket-m:pocket-s"
MAPPERS = (
    "ridge",
    "ridge_same_head",
    "low_rank_32",
    "low_rank_8",
    "ridge_bf16",
    "mlp_mse",
    "mlp_attention",
    "ridge_attention_weighted",
)


def _parse_pairs(text: str) -> list[tuple[str, str]]:
    return [tuple(item.split(":", 1)) for item in text.split(",") if item]


def _installed(name: str) -> bool:
    from hf_kvbridge import pocket

    try:
        pocket.model_path(name)
    except FileNotFoundError:
        return False
    return True


def mapper_size(mapper) -> dict:
    """Parameters (everything in the state dict, buffers included) and bytes as saved."""
    state = mapper.state_dict()
    return {
        "parameters": int(sum(t.numel() for t in state.values())),
        "bytes": int(sum(t.numel() * t.element_size() for t in state.values())),
    }


def prepare_pair(
    source_name: str,
    target_name: str,
    *,
    num_sequences: int = 48,
    seq_len: int = 256,
    top_k: int = 6,
    ridge_lambda: float = 0.01,
    head_mode: str = "all_heads",
    nll_windows: int = 16,
    nll_context: int = 256,
    nll_continuation: int = 64,
    cloze_items: int = 0,
    batch_size: int = 8,
    timing_context: int = 1024,
    timing_repeats: int = 3,
    seed: int = 0,
) -> dict:
    """Loads a pocket pair, cuts calibration and held-out windows, fits the ridge bridge (timed) and times the
    target's re-prefill: everything the mappers of one pair share (see `compare_mappers` for the arguments)."""
    import torch
    from transformers import AutoTokenizer

    from hf_kvbridge import pocket
    from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
    from hf_kvbridge.fitting.calibration.checks import split_heldout
    from hf_kvbridge.fitting.calibration.data_pass import collect_statistics
    from hf_kvbridge.fitting.data import token_windows
    from hf_kvbridge.tools.evaluation import build_cloze, heldout_windows

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(pocket.model_path(target_name))
    source, target = pocket.load_model(source_name), pocket.load_model(target_name)
    windows = token_windows(pocket.load_texts("calibration"), tokenizer, num_sequences, seq_len)
    heldout_texts = pocket.load_texts("heldout")
    eval_windows = heldout_windows(heldout_texts, tokenizer, nll_context + nll_continuation, nll_windows)
    cloze = build_cloze(heldout_windows(heldout_texts, tokenizer, 96 + 16, cloze_items), 96) if cloze_items else None
    timing_ids = heldout_windows(heldout_texts, tokenizer, timing_context, 1)
    started = time.perf_counter()
    _, heldout_ids = split_heldout(len(windows), 0.1, seed)
    train, heldout = collect_statistics(source, target, windows, heldout=heldout_ids, batch_size=batch_size)
    ridge = fit_bridge(source, target, train, heldout, top_k=top_k, ridge_lambda=ridge_lambda, head_mode=head_mode)
    ridge.calibration_statistics = (train, heldout)
    ridge_s = time.perf_counter() - started
    return {
        "pair": {"source": source_name, "target": target_name},
        "windows": windows,
        "eval_windows": eval_windows,
        "cloze": cloze,
        "timing_ids": timing_ids,
        "bridges": {"ridge": (ridge, ridge_s)},
        "settings": {
            "num_sequences": int(len(windows)),
            "seq_len": seq_len,
            "top_k": top_k,
            "ridge_lambda": ridge_lambda,
            "head_mode": head_mode,
            "nll_windows": int(len(eval_windows)),
            "nll_context": nll_context,
            "nll_continuation": nll_continuation,
            "cloze_items": cloze_items,
            "batch_size": batch_size,
            "timing_context": int(timing_ids.shape[1]),
            "timing_repeats": timing_repeats,
            "seed": seed,
            "torch_threads": torch.get_num_threads(),
        },
    }


def _linear_variant(ridge, name: str):
    """The closed-form variants of the ridge bridge: `ridge_same_head`, `low_rank_<rank>`; `None` for others."""
    from hf_kvbridge.fitting.calibration.calibrate import fit_bridge
    from hf_kvbridge.fitting.mapper_fits import refit

    train, heldout = ridge.calibration_statistics
    config = ridge.config
    if name == "ridge_same_head":
        bridge = fit_bridge(
            ridge.source,
            ridge.target,
            train,
            heldout,
            top_k=config.top_k,
            ridge_lambda=config.ridge_lambda,
            head_mode="same_head",
            selected_layers=config.selected_layers,
        )
        bridge.calibration_statistics = ridge.calibration_statistics
        return bridge
    if name.startswith("low_rank_") and name[len("low_rank_") :].isdigit():
        return refit(ridge, "low_rank", rank=int(name[len("low_rank_") :]))
    return None


def _bf16_r2(bridge) -> dict | None:
    """Held-out R² of a linear mapper whose weights are rounded to bfloat16: the training-split fit of the same kind,
    rounded, measured on the held-out statistics."""
    import torch

    from hf_kvbridge.fitting.layer_selection import mapped_heldout_r2
    from hf_kvbridge.fitting.solve import effective_ridge_lambda
    from hf_kvbridge.mappers import KVMapper
    from hf_kvbridge.mappers.low_rank import LowRankKVMapper

    train, heldout = bridge.calibration_statistics
    config = bridge.config
    args = (train, config.selected_layers, config.head_mode, effective_ridge_lambda(config))
    if config.mapper_type == "low_rank":
        mapper = LowRankKVMapper.from_statistics(*args, rank=config.mapper_kwargs["rank"])
    elif config.mapper_type == "ridge":
        mapper = KVMapper.from_statistics(*args)
    else:
        return None
    r2 = mapped_heldout_r2(mapper.to(torch.bfloat16), heldout)
    return {"k": r2[:, 0].tolist(), "v": r2[:, 1].tolist()}


def measure_mapper(
    context: dict,
    name: str,
    *,
    mlp_hidden: int = 128,
    mlp_epochs: int = 2,
    mlp_lr: float = 3e-3,
    mlp_steps_per_batch: int = 8,
) -> dict:
    """Fits mapper `name` on a prepared pair (unless already there) and measures it (see `compare_mappers`)."""
    import torch

    from hf_kvbridge.errors import ConfigurationError
    from hf_kvbridge.fitting.attention import attention_output_cosine
    from hf_kvbridge.fitting.mapper_fits import refit
    from hf_kvbridge.tools.evaluation import cloze_accuracy, continuation_nll

    ridge, ridge_s = context["bridges"]["ridge"]
    windows, batch_size = context["windows"], context["settings"]["batch_size"]
    mlp = {"hidden": mlp_hidden, "epochs": mlp_epochs, "lr": mlp_lr, "steps_per_batch": mlp_steps_per_batch}
    fitters = {
        "mlp_mse": lambda: refit(ridge, "mlp", windows=windows, loss="mse", batch_size=batch_size, **mlp),
        "mlp_attention": lambda: refit(ridge, "mlp", windows=windows, loss="attention", batch_size=batch_size, **mlp),
        "ridge_attention_weighted": lambda: refit(
            ridge, "ridge_attention_weighted", windows=windows, batch_size=batch_size
        ),
    }
    base_name, bf16 = (name[: -len("_bf16")], True) if name.endswith("_bf16") else (name, False)
    if base_name not in context["bridges"]:
        started = time.perf_counter()
        if base_name in fitters:
            bridge = fitters[base_name]()
        else:
            bridge = _linear_variant(ridge, base_name)
            if bridge is None:
                raise ConfigurationError(f"unknown mapper {name!r}; known: {MAPPERS} (any rank for low_rank_<rank>)")
        # on top of the ridge fit it starts from (statistics pass, selection, solve)
        context["bridges"][base_name] = (bridge, time.perf_counter() - started + ridge_s)
    bridge, fit_s = context["bridges"][base_name]
    r2 = bridge.config.heldout_r2 if bridge.config.mapper_type in ("ridge", "low_rank") else None
    if bf16:
        r2 = _bf16_r2(bridge)
        if r2 is None:
            raise ConfigurationError(f"{name!r}: only the closed-form linear mappers have a bfloat16 variant here")
        bridge = bridge.with_mapper(copy.deepcopy(bridge.mapper), bridge.config)
        bridge.mapper.to(torch.bfloat16)  # after __init__, which keeps a float32 target's mapper in float32
    nll = continuation_nll(bridge, context["eval_windows"], context["settings"]["nll_context"], batch_size=batch_size)
    cos = attention_output_cosine(bridge, context["eval_windows"][:4])
    speed = _speed(bridge, context)
    row = {
        "retention": nll["context_benefit_retention"],
        "nll": nll["nll"],
        "attention_cosine": float(cos.mean()),
        "attention_cosine_per_layer": cos.tolist(),
        "heldout_r2": r2,
        "heldout_r2_mean": None if r2 is None else (sum(r2["k"]) + sum(r2["v"])) / (2 * len(r2["k"])),
        "fit_seconds": fit_s,
        **mapper_size(bridge.mapper),
        **speed,
        "mapper_dtype": str(bridge.mapper.layout_dtype()),
        "mapper_kwargs": bridge.config.mapper_kwargs,
    }
    if context["cloze"] is not None:
        row["cloze"] = cloze_accuracy(bridge, context["cloze"])
    pair = context["pair"]
    logger.info("%s → %s %s: retention %.3f", pair["source"], pair["target"], name, row["retention"])
    return row


def _speed(bridge, context: dict) -> dict:
    """Mapper against the target's re-prefill on the timing context (`bench.mapper_vs_prefill`, runs in a row)."""
    from hf_kvbridge.tools.bench.mapper import mapper_vs_prefill

    row = mapper_vs_prefill(bridge, context["timing_ids"], repeats=context["settings"]["timing_repeats"])
    return {
        "map_ms": row["mapper_s"] * 1e3,
        "target_prefill_ms": row["target_prefill_s"] * 1e3,
        "mapper_flops_per_token": bridge.mapper.flops_per_token(),
        "warm_speedup": row["warm_speedup"],
        "flop_ratio_bound": row["flop_ratio_bound"],
        "fraction_of_bound": row["fraction_of_bound"],
    }


def compare_mappers(
    source_name: str,
    target_name: str,
    *,
    mappers: tuple[str, ...] = MAPPERS,
    context: dict | None = None,
    mlp_hidden: int = 128,
    mlp_epochs: int = 2,
    mlp_lr: float = 3e-3,
    mlp_steps_per_batch: int = 8,
    **settings,
) -> dict:
    r"""Fits each mapper of `mappers` for one pocket pair and measures quality and cost on held-out text.

    Args:
        source_name, target_name (`str`): pocket model names (e.g. `"pocket-s"`, `"pocket-l"`).
        mappers (`tuple[str, ...]`, *optional*): names from the module docstring (`"ridge"`, `"ridge_same_head"`,
            `"low_rank_32"`, `"ridge_bf16"`, `"mlp_mse"`, ...); the ridge bridge is always fitted: the others start
            from it or from its statistics.
        context (`dict`, *optional*): a `prepare_pair` result to reuse (its ridge fit and windows).
        mlp_hidden, mlp_epochs, mlp_lr, mlp_steps_per_batch: the MLP mappers' training (`train_mlp_mapper`).
        settings: `prepare_pair`'s: `num_sequences` (48), `seq_len` (256), `top_k` (6), `ridge_lambda` (0.01),
            `head_mode`, `nll_windows` (16), `nll_context` (256), `nll_continuation` (64), `cloze_items` (0: no
            cloze), `batch_size` (8), `timing_context` (1024), `timing_repeats` (3), `seed` (0).

    Returns:
        `dict` with the settings and, per mapper, `retention` (context-benefit retention of the continuation NLL),
        `nll`, `attention_cosine`, `heldout_r2` (closed-form linear mappers: fitted on the training split, measured
        on the held-out one), `fit_seconds` (the MLP and weighted fits include the ridge fit they start from),
        `parameters`, `bytes`, speed (`map_ms`, `target_prefill_ms`, `warm_speedup`, `flop_ratio_bound`,
        `fraction_of_bound`, `mapper_flops_per_token`), and `cloze` if asked for.

    Example:

    ```python
    >>> from studies.mapper_study import compare_mappers
    >>> result = compare_mappers("pocket-s", "pocket-m", mappers=("ridge", "mlp_mse"))  # doctest: +SKIP
    >>> result["mappers"]["mlp_mse"]["retention"]  # doctest: +SKIP
    ```
    """
    context = context or prepare_pair(source_name, target_name, **settings)
    mlp = {
        "mlp_hidden": mlp_hidden,
        "mlp_epochs": mlp_epochs,
        "mlp_lr": mlp_lr,
        "mlp_steps_per_batch": mlp_steps_per_batch,
    }
    rows = {name: measure_mapper(context, name, **mlp) for name in mappers}
    ridge = context["bridges"]["ridge"][0]
    return {
        "pair": context["pair"],
        "selected_layers": ridge.config.selected_layers,
        "settings": {**context["settings"], **mlp},
        "mappers": rows,
    }


def format_table(result: dict) -> str:
    """The study's table: one row per mapper."""
    pair, settings = result["pair"], result["settings"]
    lines = [
        f"{pair['source']} → {pair['target']}: {settings['nll_windows']} held-out windows, context "
        f"{settings['nll_context']} + {settings['nll_continuation']} tokens; speed on {settings['timing_context']} "
        f"tokens, {settings['torch_threads']} threads (target re-prefill ms / mapper ms, medians)",
        f"{'mapper':<26}{'retention':>10}{'attn cos':>9}{'R²':>7}{'cloze':>7}{'fit s':>7}{'MB':>7}{'target ms':>10}"
        f"{'map ms':>8}{'warm ×':>8}{'bound ×':>8}{'of bound':>9}",
    ]
    for name, row in result["mappers"].items():
        cloze = f"{row['cloze']['accuracy']['bridge']:.3f}" if "cloze" in row else "-"
        r2 = "-" if row["heldout_r2_mean"] is None else f"{row['heldout_r2_mean']:.3f}"
        lines.append(
            f"{name:<26}{row['retention']:>10.3f}{row['attention_cosine']:>9.4f}{r2:>7}{cloze:>7}"
            f"{row['fit_seconds']:>7.1f}{row['bytes'] / 1e6:>7.2f}{row['target_prefill_ms']:>10.1f}"
            f"{row['map_ms']:>8.2f}{row['warm_speedup']:>8.1f}{row['flop_ratio_bound']:>8.1f}"
            f"{row['fraction_of_bound']:>9.2f}"
        )
    return "\n".join(lines)


def run_study(args: argparse.Namespace) -> int:
    """`python -m studies.mapper_study`: the study from parsed arguments."""
    settings = {
        "num_sequences": args.num_sequences,
        "seq_len": args.seq_len,
        "top_k": args.top_k,
        "ridge_lambda": args.ridge_lambda,
        "head_mode": args.head_mode,
        "nll_windows": args.nll_windows,
        "nll_context": args.nll_context,
        "nll_continuation": args.nll_continuation,
        "cloze_items": args.cloze_items,
        "batch_size": args.batch_size,
        "timing_context": args.timing_context,
        "timing_repeats": args.timing_repeats,
        "seed": args.seed,
    }
    mlp = {
        "mlp_hidden": args.mlp_hidden,
        "mlp_epochs": args.mlp_epochs,
        "mlp_lr": args.mlp_lr,
        "mlp_steps_per_batch": args.mlp_steps_per_batch,
    }
    started = time.perf_counter()
    search, context = [], None
    if args.pair:
        source, target = _parse_pairs(args.pair)[0]
    else:
        pairs = [p for p in _parse_pairs(args.pairs) if _installed(p[0]) and _installed(p[1])]
        if not pairs:
            pairs = [p for p in _parse_pairs(FALLBACK_PAIRS) if _installed(p[0]) and _installed(p[1])]
            print(f"none of {args.pairs} is installed; falling back to {FALLBACK_PAIRS}")
        if not pairs:
            print("error: no pocket pair is installed")
            return 2
        hardest = None
        for pair in pairs:
            candidate = prepare_pair(*pair, **settings)
            retention = measure_mapper(candidate, "ridge", **mlp)["retention"]
            search.append({"source": pair[0], "target": pair[1], "ridge_retention": retention})
            print(f"ridge {pair[0]} → {pair[1]}: context-benefit retention {retention:.3f}")
            if hardest is None or retention < hardest:
                hardest, context = retention, candidate  # keep only the hardest pair's models and fits
        source, target = context["pair"]["source"], context["pair"]["target"]
        print(f"hardest pair: {source} → {target}\n")
    mappers = tuple(name.strip() for name in args.mappers.split(",") if name.strip())
    result = compare_mappers(source, target, mappers=mappers, context=context, **mlp, **settings)
    result["pair_search"] = search
    result["study_seconds"] = time.perf_counter() - started
    result["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    print(format_table(result))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {args.json}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pairs", default=DEFAULT_PAIRS, help="candidate SOURCE:TARGET pairs; the hardest is studied")
    parser.add_argument("--pair", help="study this SOURCE:TARGET pair directly (skips the search for the hardest)")
    parser.add_argument(
        "--mappers",
        default=",".join(MAPPERS),
        help="comma-separated mapper names: ridge, ridge_same_head, low_rank_<rank> (e.g. low_rank_32), mlp_mse, "
        "mlp_attention, ridge_attention_weighted; a linear one with _bf16 appended keeps its weights in bfloat16 "
        f"(default: {','.join(MAPPERS)})",
    )
    parser.add_argument("--num-sequences", type=int, default=128, help="calibration windows")
    parser.add_argument("--seq-len", type=int, default=256, help="calibration window length")
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--ridge-lambda", type=float, default=0.01)
    parser.add_argument("--head-mode", choices=["all_heads", "same_head"], default="all_heads")
    parser.add_argument("--nll-windows", type=int, default=64)
    parser.add_argument("--nll-context", type=int, default=256)
    parser.add_argument("--nll-continuation", type=int, default=64)
    parser.add_argument("--cloze-items", type=int, default=100, help="cloze items per mapper (0: skip the cloze)")
    parser.add_argument("--mlp-hidden", type=int, default=128)
    parser.add_argument("--mlp-epochs", type=int, default=3)
    parser.add_argument("--mlp-lr", type=float, default=3e-3)
    parser.add_argument("--mlp-steps-per-batch", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--timing-context", type=int, default=1024)
    parser.add_argument("--timing-repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="kvbridge-mappers.json", help="where to write the results")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m studies.mapper_study", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run_study(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
