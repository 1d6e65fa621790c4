"""The ridge fit of a [`KVMapper`]: the closed-form centered ridge map of every target layer and head group
(`hf_kvbridge.fitting.solve.solve_ridge`), the base every other mapper type starts from.

Importing this module attaches the three functions to the runtime class, as `KVMapper.from_statistics` (a
classmethod), `KVMapper.fit_targets` and `KVMapper.ridge_solutions`: the fitting side knows the runtime class, never
the reverse, so a served bridge loads none of this.

Example:

```python
>>> from hf_kvbridge.fitting.mapper_fits.ridge import from_statistics
>>> mapper = from_statistics(KVMapper, stats, [[0], [1]], "all_heads", 0.01)  # doctest: +SKIP
```
"""

from __future__ import annotations

from ...mappers.base import KVMapper
from ...utils.heads import target_heads_of
from ..solve import map_group_lambda, solve_ridge


def from_statistics(
    cls: type[KVMapper],
    stats,
    selected_layers: list[list[int]],
    head_mode: str,
    ridge_lambda: float | dict,
    kv_mode: str = "joint",
) -> KVMapper:
    """Solves the ridge problems of every target layer (and group: head, K/V).

    `ridge_lambda` is one relative λ for every map, or the per-layer choices `{"k": [[...]], "v": [[...]]}` of
    `hf_kvbridge.fitting.solve.choose_ridge_lambdas` (see `hf_kvbridge.fitting.solve.map_group_lambda`).
    """
    key = stats.shape_key
    mapper = cls(selected_layers, *key[2:4], head_mode, kv_mode=kv_mode, **target_heads_of(key))
    mapper.fit_targets(stats, range(len(mapper.selected_layers)), ridge_lambda)
    return mapper


def fit_targets(mapper: KVMapper, stats, targets, ridge_lambda: float | dict) -> None:
    """Solves the ridge problems of target layers `targets` from `stats` (statistics holding at least their
    selected source layers, e.g. one pass's `BlockStatistics`) into this mapper's weights, in place."""
    for t in targets:
        layer_map = mapper.layers[t]
        for g, _, _, weight, bias in mapper.ridge_solutions(stats, t, ridge_lambda):
            layer_map.weight.data[g] = weight.to(layer_map.weight.dtype)
            layer_map.bias.data[g] = bias.to(layer_map.bias.dtype)


def ridge_solutions(
    mapper: KVMapper,
    stats,
    target_layer: int,
    ridge_lambda: float | dict,
    source_layers: list[int] | None = None,
    stats_target: int | None = None,
):
    """Yields `(group, x_idx, y_idx, weight (p, q), bias (q,))`, the ridge solution of each map of target layer
    `target_layer` in this mapper's group order (`heads.map_groups` for its `head_mode` and `kv_mode`), with
    that map's λ; the mapper types that start from the ridge (low rank, attention-weighted) reshape these.

    Args:
        source_layers (`list[int]`, *optional*), stats_target (`int`, *optional*): where the selected source
            layers and the target layer sit in `stats`; default to the selected layers and `target_layer`
            (statistics of the whole model pair). Statistics of one target layer's own selection (as the
            attention-weighted fit keeps) pass `range(k)` and `0`.
    """
    layers = mapper.selected_layers[target_layer] if source_layers is None else list(source_layers)
    row = target_layer if stats_target is None else stats_target
    for g, (x_idx, y_idx) in enumerate(stats.map_groups(layers, row, mapper.head_mode, mapper.kv_mode)):
        lam = map_group_lambda(
            ridge_lambda,
            target_layer,
            g,
            mapper.head_mode,
            mapper.kv_mode,
            mapper.target_kv_heads,
            mapper.target_head_dim,
        )
        yield (g, x_idx, y_idx, *solve_ridge(stats, x_idx, y_idx, lam))


KVMapper.from_statistics = classmethod(from_statistics)
KVMapper.fit_targets = fit_targets
KVMapper.ridge_solutions = ridge_solutions
