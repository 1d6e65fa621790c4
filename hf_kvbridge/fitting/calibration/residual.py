"""The residual maps of layer recompute (`hf_kvbridge.transfer.layer_recompute`), fitted from the same passes as the
K/V maps.

**The residual map** is a ridge map per calibrated `n`, from the hidden states of the top-k source layers at the same
token (`output_hidden_states`: entry `i` is what source layer `i` receives, entry `L_s` the final normed output) to
the hidden state entering target layer `L_t − n` (entry `L_t − n` of the target's own `output_hidden_states`). It is
fitted by the same machinery as the K/V maps, with no solver of its own: a hidden state of width `D` is laid out as
one "KV head" of head dim `D / 2` (its first half in the key slot, its second half in the value slot), so
[`KVStatistics`] / [`SelectionStatistics`] / [`BlockStatistics`] accumulate it, `selection.single_layer_r2` and
`select_layers` choose the source layers by held-out R², `solve.choose_ridge_lambdas` picks λ (per half) and
[`KVMapper`] holds and applies the weights ([`ResidualMapper`]). The halves mean nothing here: on a memory budget,
selection scores each half from the same half of each source layer (as the K/V selection scores head from head).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ...mappers.residual import ResidualMapper
from ...utils.layout import hidden_layout, hidden_size
from ..layer_selection import mapper_r2, select_layers, single_layer_r2
from ..solve import LAMBDA_GRID, choose_ridge_lambdas
from ..statistics.dense import KVStatistics

logger = logging.getLogger(__name__)


@dataclass
class ResidualCollection:
    """What a calibration pass accumulates for the residual maps, beside the K/V statistics.

    Args:
        source_states (`list[int]`): the source hidden states read (entries of `output_hidden_states`).
        target_states (`list[int]`): the target hidden states predicted (`L_t − n` per calibrated `n`).
        parts (`list`): the statistics to fill, `[train, held-out]` (`KVStatistics`, `SelectionStatistics` or
            `BlockStatistics` of the hidden layout, see `residual_statistics`).
    """

    source_states: list[int]
    target_states: list[int]
    parts: list = field(default_factory=list)

    def rows(self, source_hidden, target_hidden) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows `(N, S·D_s)` and `(N, T·D_t)` of one batch from the two models' `output_hidden_states`."""
        return hidden_rows(source_hidden, self.source_states), hidden_rows(target_hidden, self.target_states)


def hidden_rows(hidden_states, states: list[int], device=None) -> torch.Tensor:
    """The hidden states `states` (entries of `output_hidden_states`, `(B, T, D)` each) side by side, as float32
    statistics rows `(B·T, len(states)·D)` on `device` (default: where they are)."""
    first = hidden_states[states[0]]
    batch, seq, _ = first.shape
    device = device if device is not None else first.device
    return torch.cat([hidden_states[s].float().to(device) for s in states], -1).view(batch * seq, -1)


def residual_statistics(
    kind: type,
    source_hidden: int,
    target_hidden: int,
    source_states: int,
    targets: int,
    *,
    device=None,
    dtype: torch.dtype = torch.float32,
    sources: list[int] | None = None,
):
    """Empty statistics of `kind` (`KVStatistics`, `SelectionStatistics` or `BlockStatistics`) for the residual maps:
    `source_states` source hidden states of `source_hidden` features against `targets` target hidden states of
    `target_hidden`, in the hidden layout (one KV head of `D / 2`). `sources` (block statistics): the kept source
    states."""
    heads, dim = hidden_layout(source_hidden, "source")
    _, target_dim = hidden_layout(target_hidden, "target")
    heads_kw = {"target_kv_heads": 1, "target_head_dim": target_dim}
    if kind is KVStatistics:
        return KVStatistics(source_states, targets, heads, dim, device, **heads_kw)
    if sources is not None:
        return kind(source_states, targets, heads, dim, sources, list(range(targets)), dtype, device, **heads_kw)
    return kind(source_states, targets, heads, dim, dtype, device, **heads_kw)


def fit_residual_map(
    train,
    heldout,
    recompute_layers: list[int],
    source_hidden: int,
    target_hidden: int,
    *,
    top_k: int | None,
    ridge_lambda: float | str = "auto",
    selected_layers: list[list[int]] | None = None,
    layer_r2: torch.Tensor | None = None,
) -> tuple[ResidualMapper, dict]:
    """Selects source hidden states and fits the residual map of every `recompute_layers` value, as `fit_bridge` fits
    the K/V maps: held-out single-layer R² (`selection.single_layer_r2`) or the given `selected_layers` (a budgeted
    calibration's choice, with its `layer_r2`), top-k, λ per map by held-out R² when `"auto"`, refit on all tokens.

    `train` and `heldout` hold all calibration tokens; `heldout` is merged into `train` for the final fit (in place).

    Returns:
        `(mapper, summary)`: the [`ResidualMapper`] and the `config.residual_map` record (values, selected source
        hidden states with their single-layer R², held-out R² of each map, chosen λ, hidden sizes).
    """
    _, target_dim = hidden_layout(target_hidden, "target")
    if selected_layers is None:
        layer_r2 = single_layer_r2(train, heldout, "all_heads", ridge_lambda)  # (N, S, 2)
        selected_layers = select_layers(layer_r2, top_k)
    lambdas = None
    if ridge_lambda == "auto":
        lambdas, fitted = choose_ridge_lambdas(
            train, heldout, selected_layers, "all_heads", 1, target_dim, LAMBDA_GRID
        )
    else:
        fitted = mapper_r2(train, heldout, selected_layers, "all_heads", ridge_lambda)  # (N, 2)
    mapper = ResidualMapper(selected_layers, source_hidden, target_hidden, recompute_layers)
    mapper.fit_targets(train.merge_(heldout), range(len(recompute_layers)), lambdas or ridge_lambda)
    summary = {
        "recompute_layers": list(recompute_layers),
        "selected_layers": [list(layers) for layers in mapper.selected_layers],
        "selected_layer_r2": None
        if layer_r2 is None
        else [[round(float(layer_r2[t, s].mean()), 6) for s in layers] for t, layers in enumerate(selected_layers)],
        "heldout_r2": [round(float(r2), 6) for r2 in fitted.mean(-1)],
        "ridge_lambda": ridge_lambda,
        "ridge_lambdas": lambdas,
        "source_hidden_size": int(source_hidden),
        "target_hidden_size": int(target_hidden),
    }
    return mapper, summary


def residual_collection(
    kind, source, target, recompute_layers: list[int], device=None, dtype=torch.float32, sources=None
) -> ResidualCollection:
    """The residual statistics of layer recompute for `recompute_layers` to fill in a pass of `collect_statistics`
    (`kind`: `KVStatistics`, `SelectionStatistics`, or `BlockStatistics` of the `sources` kept), with the hidden
    states they read: every source hidden state, and the target's entering layer `L_t − n` for each `n`.

    Example:

    ```python
    >>> residual = residual_collection(KVStatistics, source, target, [1, 2])  # doctest: +SKIP
    >>> train, held = collect_statistics(source, target, windows, heldout=[0], residual=residual)  # doctest: +SKIP
    >>> mapper, summary = fit_residual_map(*residual.parts, [1, 2], 32, 48, top_k=2)  # doctest: +SKIP
    ```
    """
    source_states = source.config.get_text_config(decoder=True).num_hidden_layers + 1
    target_layers = target.config.get_text_config(decoder=True).num_hidden_layers
    shape = (hidden_size(source), hidden_size(target), source_states, len(recompute_layers))
    return ResidualCollection(
        list(range(source_states)),
        [target_layers - n for n in recompute_layers],
        [residual_statistics(kind, *shape, device=device, dtype=dtype, sources=sources) for _ in range(2)],
    )
