"""The fit of `mapper_type="low_rank"` (`hf_kvbridge.mappers.low_rank` holds the map): each ridge solution `W` of a
target layer and head group truncated to the rank-`r` map whose standardised predictions on the calibration inputs
are closest to the full ridge's (reduced-rank regression on top of ridge, `reduce_rank`)."""

from __future__ import annotations

import torch

from ...errors import MapperError
from ...mappers.base import KVMapper
from ...mappers.low_rank import LowRankKVMapper
from ...utils.heads import target_heads_of
from ..layer_selection import mapped_heldout_r2
from ..statistics.dense import KVStatistics


def reduce_rank(
    weight: torch.Tensor, cxx: torch.Tensor, out_std: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The factors `(A (p, r), B (r, q))` of the rank-`rank` map closest to `weight (p, q)` in predictions on inputs
    of covariance `cxx (p, p)`, each output divided by `out_std (q,)` (float64 in, float64 out)."""
    scale = out_std.clamp_min(torch.finfo(torch.float64).tiny)
    scaled = weight / scale  # W S⁻¹ (p, q)
    gram = scaled.T @ cxx @ scaled  # (q, q): covariance of the standardised ridge predictions
    _, vectors = torch.linalg.eigh((gram + gram.T) / 2)  # ascending eigenvalues
    top = vectors[:, -rank:].flip(-1)  # (q, r): largest first
    return scaled @ top, top.T * scale  # A = W S⁻¹ U_r (p, r), B = U_rᵀ S (r, q)


def low_rank_from_statistics(
    cls: type[LowRankKVMapper],
    stats: KVStatistics,
    selected_layers: list[list[int]],
    head_mode: str,
    ridge_lambda: float | dict,
    rank: int = 64,
    kv_mode: str = "joint",
) -> LowRankKVMapper:
    """Solves each ridge problem, as [`KVMapper.from_statistics`] (same λ, one number or per layer, same groups
    for `head_mode` and `kv_mode`), and keeps its best rank-`rank` part."""
    key = stats.shape_key
    mapper = cls(selected_layers, *key[2:4], head_mode, rank=rank, kv_mode=kv_mode, **target_heads_of(key))
    for t in range(len(mapper.selected_layers)):
        layer = mapper.layers[t]
        for g, x_idx, y_idx, weight, _ in mapper.ridge_solutions(stats, t, ridge_lambda):
            mx, my, cxx, _, var_y = stats.moments(x_idx, y_idx)
            down, up = reduce_rank(weight, cxx, var_y.clamp_min(0).sqrt(), layer.down.shape[-1])
            layer.down.data[g] = down.to(layer.down.dtype)
            layer.up.data[g] = up.to(layer.up.dtype)
            layer.bias.data[g] = (my - mx @ down @ up).to(layer.bias.dtype)
    return mapper


def fit_low_rank(
    base: KVMapper,
    *,
    statistics: tuple[KVStatistics, KVStatistics] | None,
    ridge_lambda: float | dict,
    rank: int = 64,
    **_ignored,
) -> LowRankKVMapper:
    r"""The ridge maps of `base` (its layers, head mode and kv mode, with λ `ridge_lambda`: the per-layer λ chosen
    for the ridge base when it was fitted with `ridge_lambda="auto"`) reduced to rank `rank`.

    Args:
        base ([`KVMapper`]): a fitted ridge mapper (its selection is reused).
        statistics (`tuple`): the `(train, held-out)` calibration statistics.
        ridge_lambda (`float` or `dict`): the λ of the maps (`solve.effective_ridge_lambda(config)`).
        rank (`int`, *optional*, defaults to `64`): the rank of each map (per target layer and head group, see
            [`LowRankKVMapper`]).

    Returns:
        [`LowRankKVMapper`] fitted on train + held-out; its `fit_summary` is `{"rank": rank}` and its `fit_config`
        holds the held-out R² of the rank-`rank` maps (fitted on the training statistics, measured on the held-out
        ones) as `heldout_r2`, which `hf_kvbridge.fitting.mapper_fits.refit` writes into the new bridge's config.

    Example:

    ```python
    >>> from hf_kvbridge.fitting.mapper_fits import refit
    >>> cheap = refit(bridge, "low_rank", rank=32)  # doctest: +SKIP
    >>> cheap.mapper.flops_per_token() < bridge.mapper.flops_per_token()  # doctest: +SKIP
    True
    ```
    """
    if statistics is None:
        raise MapperError(
            "the low-rank fit needs the calibration statistics (train, held-out): calibrate with "
            "keep_statistics=True or pass statistics="
        )
    train, heldout = statistics
    args = (base.selected_layers, base.head_mode, ridge_lambda)
    kwargs = {"rank": rank, "kv_mode": base.kv_mode}
    r2 = mapped_heldout_r2(LowRankKVMapper.from_statistics(train, *args, **kwargs), heldout)  # (L_t, 2)
    mapper = LowRankKVMapper.from_statistics(train + heldout, *args, **kwargs)
    mapper.fit_summary = {"rank": int(rank)}
    mapper.fit_config = {
        "heldout_r2": {"k": [round(float(v), 6) for v in r2[:, 0]], "v": [round(float(v), 6) for v in r2[:, 1]]}
    }
    return mapper


LowRankKVMapper.from_statistics = classmethod(low_rank_from_statistics)  # the fitting side attaches its fit
