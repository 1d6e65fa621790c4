"""How good is a mapped cache? Attention-output cosine per target layer, and plots of the calibration R².

Attention-output cosine (the paper's predictor of downstream quality): the target's *own* queries attend over the
mapped K/V and over the true K/V of the same tokens, through the target's attention and `o_proj`; the cosine of the
two outputs is averaged over tokens.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from .rope import apply_rotary


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    return base.layers


@torch.no_grad()
def attention_output_cosine(bridge, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cosine, per target layer, between attention outputs over mapped and over true K/V.

    Args:
        bridge ([`KVBridgeForCausalLM`]): the bridge to diagnose.
        input_ids (`torch.LongTensor` of shape `(batch, seq)`): unpadded held-out text.

    Returns:
        `torch.Tensor` of shape `(target_layers,)`, float64.

    Example:

    ```python
    >>> cos = attention_output_cosine(bridge, heldout_ids)  # doctest: +SKIP
    >>> cos.mean()  # doctest: +SKIP
    ```
    """
    target = bridge.target
    layers = _decoder_layers(target)
    captured: dict[int, dict] = {}

    def capture(idx):
        def hook(module, args, kwargs):
            captured[idx] = {
                "hidden_states": kwargs.get("hidden_states", args[0] if args else None),
                "position_embeddings": kwargs.get("position_embeddings"),
            }

        return hook

    handles = [
        layer.self_attn.register_forward_pre_hook(capture(i), with_kwargs=True) for i, layer in enumerate(layers)
    ]
    try:
        ids = input_ids.to(target.device)
        true_cache = target(input_ids=ids, use_cache=True, logits_to_keep=1).cache
    finally:
        for handle in handles:
            handle.remove()
    source_cache = bridge.source(input_ids=input_ids.to(bridge.source.device), use_cache=True, logits_to_keep=1).cache
    mapped = bridge.map_cache(source_cache)
    out = torch.zeros(len(layers), dtype=torch.float64)
    for t, layer in enumerate(layers):
        attn = layer.self_attn
        hidden = captured[t]["hidden_states"]  # (B, T, hidden)
        cos, sin = captured[t]["position_embeddings"]  # (B, T, d)
        batch, seq, _ = hidden.shape
        head_dim = true_cache.layers[t].keys.shape[-1]
        query = attn.q_proj(hidden).view(batch, seq, -1, head_dim)
        if getattr(attn, "q_norm", None) is not None:
            query = attn.q_norm(query)
        query = apply_rotary(query.transpose(1, 2), cos, sin)  # (B, H_q, T, d)
        outputs = []
        for cache in (true_cache, mapped):
            keys, values = cache.layers[t].keys, cache.layers[t].values  # (B, H_kv, T, d)
            rep = query.shape[1] // keys.shape[1]
            attended = nn.functional.scaled_dot_product_attention(
                query,
                keys.repeat_interleave(rep, 1),
                values.repeat_interleave(rep, 1),
                is_causal=True,
                scale=attn.scaling,
            )  # (B, H_q, T, d)
            outputs.append(attn.o_proj(attended.transpose(1, 2).reshape(batch, seq, -1)).double())
        out[t] = nn.functional.cosine_similarity(outputs[0], outputs[1], dim=-1).mean()
    return out


def _pyplot():
    """matplotlib's pyplot on the non-interactive Agg backend (plots are written to files, never shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_r2_vs_k(table: dict, path) -> None:
    """Line plot of held-out R² (K and V) against the number of source layers."""
    plt = _pyplot()
    labels = list(table)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(labels, [table[k]["k"] for k in labels], marker="o", label="K")
    ax.plot(labels, [table[k]["v"] for k in labels], marker="s", label="V")
    ax.set_xlabel("source layers per target layer (top-k)")
    ax.set_ylabel("held-out R² (mean over target layers)")
    ax.set_ylim(top=1.0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_layer_bars(values, path, ylabel: str, title: str) -> None:
    """Bar chart of one number per target layer (e.g. attention-output cosine)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(range(len(values)), values, color="tab:blue")
    ax.set_xlabel("target layer")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    low = min(values)
    ax.set_ylim(min(0.0, low - 0.05), 1.0)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_r2_heatmap(r2: torch.Tensor, path, title: str = "held-out single-layer R² (mean of K, V)") -> None:
    """Heatmap of the source→target single-layer R² matrix `(target_layers, source_layers)`."""
    plt = _pyplot()
    matrix = r2.mean(-1).numpy() if r2.dim() == 3 else r2.numpy()
    fig, ax = plt.subplots(figsize=(1.2 + 0.6 * matrix.shape[1], 1.2 + 0.45 * matrix.shape[0]))
    image = ax.imshow(matrix, cmap="viridis", aspect="auto", vmin=min(0.0, float(matrix.min())), vmax=1.0)
    ax.set_xlabel("source layer")
    ax.set_ylabel("target layer")
    ax.set_xticks(range(matrix.shape[1]))
    ax.set_yticks(range(matrix.shape[0]))
    for (i, j), value in np.ndenumerate(matrix):
        ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white" if value < 0.6 else "black", fontsize=7)
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
