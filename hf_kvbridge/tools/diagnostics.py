"""How good is a mapped cache? Attention-output cosine per target layer, and plots of the calibration R².

Attention-output cosine (the paper's predictor of downstream quality): the target's *own* queries attend over the
mapped K/V and over the true K/V of the same tokens, through the target's attention and `o_proj`; the cosine of the
two outputs is averaged over tokens.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import ConfigurationError
from ..fitting.attention import attention_output_cosine, target_queries
from ..utils.cache import output_cache


def pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (plots are written to files, never shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def wrapped_title(ax, title: str, width: int = 60) -> None:
    """A title wrapped to the figure, so that nothing is clipped."""
    import textwrap

    ax.set_title(textwrap.fill(title, width), fontsize=9)


def plot_r2_vs_k(table: dict, path, title: str = "held-out R² of the mapper") -> None:
    """Line plot of held-out R² (K and V) against the number of source layers, on the full 0–1 scale."""
    plt = pyplot()
    labels = list(table)
    fig, ax = plt.subplots(figsize=(5.5, 3.8), layout="constrained")
    for key, marker, name in (("k", "o", "K"), ("v", "s", "V")):
        values = [table[k][key] for k in labels]
        (line,) = ax.plot(labels, values, marker=marker, label=name)
        for x, y in zip(labels, values):  # the values themselves: the 0–1 axis does not show small gains
            ax.annotate(
                f"{y:.3f}",
                (x, y),
                textcoords="offset points",
                xytext=(0, 6 if key == "k" else -12),
                ha="center",
                fontsize=7,
                color=line.get_color(),
            )
    ax.set_xlabel("source layers per target layer (top-k)")
    ax.set_ylabel("held-out R² (mean over target layers)")
    ax.set_ylim(0.0, 1.05)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    wrapped_title(ax, title)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_layer_bars(values, path, ylabel: str, title: str) -> None:
    """Bar chart of one number per target layer (e.g. attention-output cosine), on a scale from 0 (or below) to 1."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.8), layout="constrained")
    ax.bar(range(len(values)), values, color="tab:blue")
    for i, value in enumerate(values):
        ax.text(i, value, f"{value:.2f}", ha="center", va="bottom", fontsize=7)
    ax.set_xlabel("target layer")
    ax.set_ylabel(ylabel)
    ax.set_xticks(range(len(values)))
    wrapped_title(ax, title)
    low = min(values)
    ax.set_ylim(min(0.0, low - 0.05), 1.05)
    ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_r2_heatmap(
    r2: torch.Tensor,
    path,
    title: str = "held-out single-layer R² (mean of K, V)",
    colorbar_label: str = "held-out R² (mean of K and V)",
) -> None:
    """Heatmap of the source→target single-layer R² matrix `(target_layers, source_layers)`."""
    plt = pyplot()
    matrix = r2.mean(-1).numpy() if r2.dim() == 3 else r2.numpy()
    fig, ax = plt.subplots(
        figsize=(max(5.5, 2.5 + 0.6 * matrix.shape[1]), max(3.8, 1.6 + 0.45 * matrix.shape[0])), layout="constrained"
    )
    image = ax.imshow(matrix, cmap="viridis", aspect="auto", vmin=min(0.0, float(matrix.min())), vmax=1.0)
    ax.set_xlabel("source layer")
    ax.set_ylabel("target layer")
    ax.set_xticks(range(matrix.shape[1]))
    ax.set_yticks(range(matrix.shape[0]))
    for (i, j), value in np.ndenumerate(matrix):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black", fontsize=7)
    wrapped_title(ax, title, width=50)
    fig.colorbar(image, ax=ax, label=colorbar_label)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _causal_logit_energy(queries: torch.Tensor, keys: torch.Tensor, centered: bool = False) -> torch.Tensor:
    """Per KV head, `Σ (q·k)²` over causal (query ≥ key) pairs and the query heads sharing that KV head.

    Args:
        queries (`torch.Tensor` of shape `(B, H_q, T, d)`), keys (`(B, H_kv, T, d)`).
        centered (`bool`, *optional*, defaults to `False`): subtract from each query's logits their mean over the
            keys it sees first (softmax ignores a shift shared by all keys of a query).

    Returns:
        `torch.Tensor` of shape `(H_kv,)`, float64.
    """
    batch, q_heads, seq, dim = queries.shape
    kv_heads = keys.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=queries.device).tril()
    seen = causal.sum(-1, keepdim=True)  # (T, 1): keys each query sees
    total = torch.zeros(kv_heads, dtype=torch.float64)
    for b in range(batch):  # one window at a time: H_q·T² logits
        q = queries[b].float().view(kv_heads, q_heads // kv_heads, seq, dim)  # (H_kv, rep, T, d)
        logits = (q @ keys[b].float().unsqueeze(1).transpose(-1, -2)) * causal  # (H_kv, rep, T_query, T_key)
        if centered:
            logits = (logits - logits.sum(-1, keepdim=True) / seen) * causal
        total += logits.square().sum((1, 2, 3)).double().cpu()
    return total


@torch.no_grad()
def layer_ridge_lambdas(config, target_layers: int) -> dict[str, list[float]]:
    """The ridge λ each target layer's map was fitted with, for K and V: the chosen one of an auto-λ bridge
    (geometric mean over its head groups in `same_head` mode), or the one number of a fixed-λ bridge."""
    chosen = getattr(config, "ridge_lambdas", None)
    if not chosen:
        value = float(config.ridge_lambda)
        return {"k": [value] * target_layers, "v": [value] * target_layers}

    def mean(groups: list[float]) -> float:  # the one value of an all_heads layer as it is
        if len(set(groups)) == 1:
            return groups[0]
        return float(f"{math.exp(sum(map(math.log, groups)) / len(groups)):.3g}")

    return {kv: [mean(groups) for groups in chosen[kv]] for kv in ("k", "v")}


def inspect_bridge(
    bridge,
    data,
    *,
    num_sequences: int = 16,
    seq_len: int = 256,
    tokenizer=None,
    batch_size: int = 4,
    heldout_fraction: float = 0.25,
    seed: int = 0,
    text_field: str = "text",
) -> dict:
    r"""A diagnostics report of a bridge on `data` (use text the mapper was not calibrated on).

    One streamed pass (batches of `batch_size` windows) measures:

    - `mapper_r2`: R² of the *fitted mapper* (any mapper type, measured directly from its outputs) per target layer
      and KV head, for K (content space) and V; `mapper_r2_layer` averages over heads;
    - `attention_cosine`: attention-output cosine per target layer ([`attention_output_cosine`]);
    - `key_error`: relative key error in the target's query subspace per target layer and KV head,
      `Σ (q·(k̂ − k))² / Σ (q·k)²` over causal query/key pairs with the target's own queries and post-RoPE keys
      (0 is perfect; it is the relative error of the attention logits); `key_error_layer` pools the heads;
      `key_error_centered_layer` first centers each query's logits over the keys it sees, so an error that shifts
      all of a query's logits alike (which softmax ignores) does not count;
    - `ridge_lambda`: how λ was set (`"auto"` or the number) and `ridge_lambda_layer` the λ of each target layer's
      K and V maps ([`layer_ridge_lambdas`]); `ridge_lambdas` the per-head-group choices of an auto-λ bridge;
    - `single_layer_r2`: the source→target single-layer R² matrix `(target_layers, source_layers)` (mean of K
      and V; `single_layer_r2_kv` keeps both), fitted on a train part of `data` and scored on the rest (split by
      window, `heldout_fraction`), as calibration does.

    Args:
        bridge ([`KVBridgeForCausalLM`]): the bridge to inspect.
        data: text as `calibrate` accepts it (strings, a `.txt`/`.jsonl` file or folder, a dataset), or a
            `torch.LongTensor` of token windows `(num_windows, seq_len)` used as is.
        num_sequences (`int`, *optional*, defaults to `16`), seq_len (`int`, *optional*, defaults to `256`): windows
            cut from the text.
        tokenizer (*optional*): defaults to the target's.
        batch_size (`int`, *optional*, defaults to `4`): windows per forward pass.
        heldout_fraction (`float`, *optional*, defaults to `0.25`): share of windows that scores the single-layer R².

    Returns:
        `dict` of plain lists and numbers (JSON-ready); see [`write_inspect_outputs`] for the files.

    Example:

    ```python
    >>> from hf_kvbridge.tools.diagnostics import inspect_bridge
    >>> report = inspect_bridge(bridge, "heldout.jsonl.gz", num_sequences=16, seq_len=256)  # doctest: +SKIP
    >>> report["attention_cosine"]  # one per target layer  # doctest: +SKIP
    ```
    """
    from ..fitting.calibration.checks import split_heldout
    from ..fitting.content_rows import cache_rows
    from ..fitting.layer_selection import single_layer_r2
    from ..fitting.statistics.dense import KVStatistics
    from ..mappers.mlp import rows_from_layout, source_rows_in_layout

    if getattr(bridge, "source_features", None) is not None:
        raise ConfigurationError(
            "inspect measures the mapper from the source's K/V rows, and this bridge also reads its hidden states "
            "(source_features); measure it with kvbridge eval (retention, NLL) or attention_output_cosine instead"
        )
    if isinstance(data, torch.Tensor):
        windows = data.long()
    else:
        from transformers import AutoTokenizer

        from ..fitting.data import token_windows
        from ..loading import resolve_model_reference

        if tokenizer is None:
            name = bridge.config.target_name_or_path or bridge.target.config.name_or_path
            tokenizer = AutoTokenizer.from_pretrained(resolve_model_reference(name))
        windows = token_windows(data, tokenizer, num_sequences, seq_len, text_field=text_field)
    source, target, mapper = bridge.source, bridge.target, bridge.mapper
    src, tgt = bridge.source_layout, bridge.target_layout
    heads, dim = tgt.num_kv_heads, tgt.head_dim
    width, x_width = heads * 2 * dim, src.features_per_layer  # features of one target / source layer
    num, seq = windows.shape
    train_ids, heldout_ids = split_heldout(num, heldout_fraction, seed)
    target_heads = {"target_kv_heads": heads, "target_head_dim": dim}
    parts = [  # train, held-out
        KVStatistics(src.num_layers, tgt.num_layers, src.num_kv_heads, src.head_dim, **target_heads) for _ in range(2)
    ]
    is_heldout = torch.zeros(num, dtype=torch.bool)
    is_heldout[heldout_ids] = True
    sse = torch.zeros(tgt.num_layers, width, dtype=torch.float64)  # mapper residuals per output column
    y_sum, y_sq = torch.zeros_like(sse), torch.zeros_like(sse)
    key_err = torch.zeros(tgt.num_layers, heads, dtype=torch.float64)
    key_ref = torch.zeros_like(key_err)
    shift_err, shift_ref = torch.zeros_like(key_err), torch.zeros_like(key_err)  # per-query centered logits
    cosine = torch.zeros(tgt.num_layers, dtype=torch.float64)
    param = next(iter(mapper.parameters()))
    for start in range(0, num, batch_size):
        ids = windows[start : start + batch_size]
        batch = ids.shape[0]
        x = cache_rows(source, ids, "cpu")  # (B·T, L_s·H·2d)
        y = cache_rows(target, ids, "cpu")  # (B·T, L_t·H·2d)
        held_rows = is_heldout[start : start + batch].repeat_interleave(seq)  # (B·T,)
        for part, mask in ((parts[0], ~held_rows), (parts[1], held_rows)):
            if mask.any():
                part.update(x[mask], y[mask])
        x_mapper = x.to(param.device, param.dtype)
        for t, layers in enumerate(mapper.selected_layers):
            rows = [source_rows_in_layout(mapper, x_mapper[:, s * x_width : (s + 1) * x_width]) for s in layers]
            pred = rows_from_layout(mapper, mapper.map_layer(t, rows)).double().cpu()  # (B·T, H·2d)
            truth = y[:, t * width : (t + 1) * width].double()
            sse[t] += (pred - truth).square().sum(0)
            y_sum[t] += truth.sum(0)
            y_sq[t] += truth.square().sum(0)
        queries, true_cache = target_queries(target, ids)
        source_cache = output_cache(source(input_ids=ids.to(source.device), use_cache=True, logits_to_keep=1))
        mapped = bridge.map_cache(source_cache)
        for t in range(tgt.num_layers):
            true_keys = true_cache.layers[t].keys.float()  # (B, H, T, d), post-RoPE
            error = mapped.layers[t].keys.float().to(true_keys.device) - true_keys
            key_err[t] += _causal_logit_energy(queries[t], error)
            key_ref[t] += _causal_logit_energy(queries[t], true_keys)
            shift_err[t] += _causal_logit_energy(queries[t], error, centered=True)
            shift_ref[t] += _causal_logit_energy(queries[t], true_keys, centered=True)
        cosine += attention_output_cosine(bridge, ids) * batch
    tokens = num * seq
    sst = (y_sq - y_sum.square() / tokens).clamp_min(torch.finfo(torch.float64).tiny)
    per_head = 1 - sse.view(-1, heads, 2, dim).sum(-1) / sst.view(-1, heads, 2, dim).sum(-1)  # (L_t, H, 2)
    single = single_layer_r2(parts[0], parts[1], mapper.head_mode, bridge.config.ridge_lambda)  # (L_t, L_s, 2)
    key_error = key_err / key_ref.clamp_min(torch.finfo(torch.float64).tiny)  # (L_t, H)
    cosine = cosine / num

    def rounded(tensor: torch.Tensor):
        return torch.round(tensor.double(), decimals=6).tolist()

    return {
        "source": bridge.config.source_name_or_path or source.config.name_or_path,
        "target": bridge.config.target_name_or_path or target.config.name_or_path,
        "mapper_type": bridge.config.mapper_type,
        "head_mode": mapper.head_mode,
        "selected_layers": mapper.selected_layers,
        "windows": num,
        "seq_len": seq,
        "tokens": tokens,
        "ridge_lambda": bridge.config.ridge_lambda,
        "ridge_lambdas": getattr(bridge.config, "ridge_lambdas", None),
        "ridge_lambda_layer": layer_ridge_lambdas(bridge.config, tgt.num_layers),
        "single_layer_split": {"train_windows": len(train_ids), "heldout_windows": len(heldout_ids)},
        "mapper_r2": {"k": rounded(per_head[..., 0]), "v": rounded(per_head[..., 1])},
        "mapper_r2_layer": {"k": rounded(per_head[..., 0].mean(1)), "v": rounded(per_head[..., 1].mean(1))},
        "attention_cosine": rounded(cosine),
        "key_error": rounded(key_error),
        "key_error_layer": rounded(key_err.sum(1) / key_ref.sum(1).clamp_min(torch.finfo(torch.float64).tiny)),
        "key_error_centered_layer": rounded(
            shift_err.sum(1) / shift_ref.sum(1).clamp_min(torch.finfo(torch.float64).tiny)
        ),
        "single_layer_r2": rounded(single.mean(-1)),
        "single_layer_r2_kv": rounded(single),
        "summary": {
            "mapper_r2_k": round(float(per_head[..., 0].mean()), 6),
            "mapper_r2_v": round(float(per_head[..., 1].mean()), 6),
            "attention_cosine": round(float(cosine.mean()), 6),
            "key_error": round(float(key_err.sum() / key_ref.sum().clamp_min(1e-300)), 6),
            "key_error_centered": round(float(shift_err.sum() / shift_ref.sum().clamp_min(1e-300)), 6),
        },
    }


def plot_layer_series(series: dict, path, ylabel: str, title: str, ylim: tuple[float, float] | None = None) -> None:
    """Grouped bars, one group per target layer and one bar per named series (e.g. `{"K": [...], "V": [...]}`);
    the legend sits below the axes, so it covers no bar."""
    plt = pyplot()
    names = list(series)
    layers = len(series[names[0]])
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(5.5, 0.6 * layers + 3), 3.8), layout="constrained")
    for i, name in enumerate(names):
        ax.bar(np.arange(layers) + (i - (len(names) - 1) / 2) * width, series[name], width, label=name)
    ax.set_xlabel("target layer")
    ax.set_ylabel(ylabel)
    wrapped_title(ax, title)
    ax.set_xticks(range(layers))
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3, axis="y")
    if len(names) > 1:
        fig.legend(loc="outside lower center", ncol=len(names), fontsize=8)
    fig.savefig(path, dpi=120)
    plt.close(fig)


INSPECT_FILES = ("report.json", "r2_heatmap.png", "attention_cosine.png", "mapper_r2.png", "key_error.png")


def write_inspect_outputs(report: dict, out) -> list[str]:
    """Writes an [`inspect_bridge`] report into folder `out` (created if needed): `report.json`, the single-layer R²
    heatmap, and per-layer bars of attention cosine, mapper R² (K, V) and key error. Returns the file names."""
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    pair = f"{report['source']} → {report['target']} ({report['mapper_type']})"
    plot_r2_heatmap(
        torch.tensor(report["single_layer_r2"]),
        out / "r2_heatmap.png",
        f"{pair}: R² of each target layer's K/V from one source layer alone (held-out text)",
    )
    plot_layer_bars(
        report["attention_cosine"],
        out / "attention_cosine.png",
        "attention-output cosine (1 = same)",
        f"{pair}: target attention output over mapped vs its own K/V",
    )
    r2 = report["mapper_r2_layer"]
    plot_layer_series(
        {"K": r2["k"], "V": r2["v"]},
        out / "mapper_r2.png",
        "R² of the mapped K/V (1 = exact)",
        f"{pair}: how much of the target's own K/V the mapper explains, per layer",
        ylim=(min(0.0, *r2["k"], *r2["v"]), 1.0),
    )
    plot_layer_series(
        {"all logits": report["key_error_layer"], "each query's shift removed": report["key_error_centered_layer"]},
        out / "key_error.png",
        "attention-logit error (0 = exact)",
        f"{pair}: error of the target's attention logits (its queries · mapped keys), relative to their size",
        ylim=(0.0, max(1.0, *report["key_error_layer"], *report["key_error_centered_layer"])),
    )
    return list(INSPECT_FILES)
