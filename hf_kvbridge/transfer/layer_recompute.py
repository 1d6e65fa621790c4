"""Layer recompute: the target computes its top `n` layers itself over the whole prompt, from a residual stream mapped
in closed form from the source, while its lower `L_t − n` layers get mapped K/V as usual.

```
prompt ──source prefill (hidden states)──▶ source K/V ──mapper──▶ target K/V of layers 0 … L_t − n − 1
                                       └──▶ hidden states of chosen source layers ──residual map──▶ hidden state
                                            entering target layer L_t − n ──target layers L_t − n … L_t − 1──▶
                                            their own K/V (attending to the sinks' own K/V and to each other)
```

Cost: `n / L_t` of the target's prefill, plus the two maps. `n = L_t` starts from the target's own embeddings (the
target prefills the mapped span itself, no residual map); `n = 0` is the plain bridge.

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

from dataclasses import dataclass, field

import torch
from torch import nn

from ..attention import decoder_layers
from ..cache import CACHE_KWARG
from ..configuration import check_recompute_layers
from ..errors import ConfigurationError, KVLayoutError
from ..layout import KVLayout
from ..loading import layer_devices
from ..mappers import KVMapper
from ..rope import rotary_module
from ..selection import mapper_r2, select_layers, single_layer_r2
from ..solve import LAMBDA_GRID, choose_ridge_lambdas
from ..statistics.dense import KVStatistics


def hidden_size(model: nn.Module) -> int:
    """Width of `model`'s residual stream (`config.hidden_size` of its text config)."""
    return int(model.config.get_text_config(decoder=True).hidden_size)


def hidden_layout(width: int, what: str = "model") -> tuple[int, int]:
    """`(num_kv_heads, head_dim)` of a hidden state of `width` features laid out as statistics rows: `(1, width // 2)`.

    Raises `KVLayoutError` for an odd width (the layout puts one half in the key slot and one in the value slot)."""
    if width % 2:
        raise KVLayoutError(
            f"the {what}'s hidden size {width} is odd; layer recompute lays hidden states out in two halves and needs "
            "an even hidden size (use recompute_layers=0)"
        )
    return 1, width // 2


def calibrated_layers(config) -> list[int]:
    """The `recompute_layers` values a bridge's residual map was calibrated for (`config.residual_map`)."""
    residual = getattr(config, "residual_map", None) or {}
    return [int(n) for n in residual.get("recompute_layers", [])]


def normalize_recompute_layers(value, target_layers: int | None = None) -> list[int]:
    """The residual maps a calibration fits for `recompute_layers` (`int` or list of ints): sorted, unique, without
    `0` (the plain bridge) and without `target_layers` (which starts from the target's own embeddings)."""
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else list(value or [])
    for n in values:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ConfigurationError(f"recompute_layers must be integers ≥ 0 (top target layers), got {value!r}")
        if target_layers is not None and n > target_layers:
            raise ConfigurationError(
                f"recompute_layers={n} exceeds the target's {target_layers} layers; pick values in 0…{target_layers}"
            )
    return sorted({n for n in values if n > 0 and n != target_layers})


def check_layer_recompute(config, layout: KVLayout, residual_mapper: ResidualMapper | None = None) -> int:
    """The `config.recompute_layers` a bridge with target `layout` and `residual_mapper` can run, or a clear error.

    Refuses a value outside `0 … L_t` or one its residual map was not calibrated for (naming those it was:
    `configuration.check_recompute_layers`), a residual map missing from a bridge that needs one, and sliding-window
    layers among the top `n` (their cache keeps only a window, which the top layers' own pass would have to
    reproduce; recompute them with `hold_back` instead).
    """
    n = check_recompute_layers(
        getattr(config, "recompute_layers", 0) or 0, layout.num_layers, calibrated_layers(config)
    )
    if n == 0:
        return 0
    windowed = [t for t in range(layout.num_layers - n, layout.num_layers) if layout.window(t) is not None]
    if windowed:
        raise KVLayoutError(
            f"layer recompute runs the target's top {n} layers over the whole prompt, but layers {windowed} attend "
            "over a sliding window; use recompute_layers=0 (or a hold_back) with this target"
        )
    if n < layout.num_layers and (residual_mapper is None or n not in residual_mapper.recompute_layers):
        raise ConfigurationError(
            f"recompute_layers={n} needs the residual map of its checkpoint, and this bridge holds none for it; load "
            "the bridge with from_pretrained (which reads residual.safetensors) or calibrate with "
            f"recompute_layers={n}"
        )
    return n


class ResidualMapper(KVMapper):
    """The residual maps of layer recompute: for each calibrated `n` (`recompute_layers`), a ridge map from the hidden
    states of its selected source layers to the hidden state entering target layer `L_t − n`.

    A [`KVMapper`] whose "target layers" are the calibrated `n` values (in `recompute_layers` order) and whose
    "source layers" are the source's hidden states (`0 … L_s`), laid out as one KV head of `D / 2` (see the module
    docstring); its weights are one `(1, k·D_s, D_t)` matrix and a `(1, D_t)` bias per `n`.

    Args:
        selected_layers (`list[list[int]]`): per calibrated `n`, the source hidden states read, best first.
        source_hidden (`int`), target_hidden (`int`): the two hidden sizes.
        recompute_layers (`list[int]`): the calibrated `n` values, one per entry of `selected_layers`.

    Example:

    ```python
    >>> mapper = ResidualMapper([[3, 2]], source_hidden=8, target_hidden=12, recompute_layers=[2])
    >>> hidden = [torch.randn(1, 5, 8) for _ in range(4)]  # the source's hidden states, (B, T, D_s) each
    >>> mapper.map_hidden(hidden, 2).shape
    torch.Size([1, 5, 12])
    ```
    """

    def __init__(self, selected_layers, source_hidden: int, target_hidden: int, recompute_layers: list[int]):
        heads, dim = hidden_layout(source_hidden, "source")
        _, target_dim = hidden_layout(target_hidden, "target")
        super().__init__(
            selected_layers, heads, dim, "all_heads", "joint", target_kv_heads=1, target_head_dim=target_dim
        )
        if len(recompute_layers) != len(self.selected_layers):
            raise ConfigurationError(
                f"the residual map has {len(self.selected_layers)} maps for recompute_layers {recompute_layers}; give "
                "one list of source hidden states per value"
            )
        self.recompute_layers = [int(n) for n in recompute_layers]
        self.source_hidden, self.target_hidden = int(source_hidden), int(target_hidden)

    groupable = False  # one map per n, never several at once

    @classmethod
    def from_config(cls, config, layout=None) -> ResidualMapper:
        """An empty residual mapper shaped as `config.residual_map` records, to load weights into (`layout` is not
        needed: the record holds both hidden sizes)."""
        residual = config.residual_map
        return cls(
            residual["selected_layers"],
            residual["source_hidden_size"],
            residual["target_hidden_size"],
            residual["recompute_layers"],
        )

    @torch.no_grad()
    def map_hidden(self, hidden_states, recompute_layers: int) -> torch.Tensor:
        """The hidden state entering target layer `L_t − recompute_layers`, mapped from the source's.

        Args:
            hidden_states (`tuple[torch.Tensor]`): the source's `output_hidden_states`, `L_s + 1` tensors of
                `(B, T, D_s)` (only the selected ones are read).
            recompute_layers (`int`): a calibrated `n`.

        Returns:
            `torch.Tensor` of shape `(B, T, D_t)`, in the mapper's dtype, on its device.
        """
        t = self.recompute_layers.index(recompute_layers)
        weight = self.layers[t].weight
        batch, seq, _ = hidden_states[0].shape
        rows = [
            hidden_states[s].reshape(batch * seq, -1).to(weight.device, weight.dtype) for s in self.selected_layers[t]
        ]
        return self.map_layer(t, rows).view(batch, seq, self.target_hidden)  # (B·T, D_t) → (B, T, D_t)


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


@torch.no_grad()
def recompute_top_layers(
    target: nn.Module,
    cache,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    first: int,
    start_layer: int,
) -> torch.Tensor:
    """Runs `target`'s layers `start_layer … L_t − 1` over tokens `[first, first + S)` from the residual `hidden`,
    writing their own K/V into `cache` in place, as the model's own forward calls its layers (its rotary embedding,
    one causal mask over the real tokens, the cache).

    Each of those layers' cache entries is cut back to the first `first` tokens (the attention sinks, or what a
    session had cached before, the target's own) and gets the new tokens' K/V; the layers below keep theirs (the
    mapped ones). The top layers then attend to exactly what a plain prefill would give them there.

    Args:
        target ([`PreTrainedModel`]): the target (full-attention top layers, see `check_layer_recompute`).
        cache (`DynamicCache`): the target cache of `first + S` tokens.
        hidden (`torch.Tensor` of shape `(B, S, D_t)`): the residual entering layer `start_layer`.
        attention_mask (`torch.Tensor` of shape `(B, first + S)`): 1 for real tokens.
        positions (`torch.LongTensor` of shape `(B, S)`): the new tokens' positions.
        first (`int`): tokens cached before the new ones.
        start_layer (`int`): `L_t − n`.

    Returns:
        the hidden state after the last layer, `(B, S, D_t)` (before the final norm).
    """
    layers = decoder_layers(target)
    places = layer_devices(target, len(layers))
    batch, seq, _ = hidden.shape
    end = first + seq
    for i in range(start_layer, len(layers)):  # the top layers keep only the tokens before the span (their own)
        layer = cache.layers[i]  # a full-attention `DynamicLayer` (`check_layer_recompute`); its `update` appends
        layer.keys, layer.values = layer.keys[:, :, :first], layer.values[:, :, :first]
    device = places[start_layer]
    real = attention_mask[:, :end].to(device).bool()  # (B, first + S)
    columns = torch.arange(end, device=device)
    queries = torch.arange(first, end, device=device)
    allowed = (columns[None, :] <= queries[:, None])[None] & real[:, None, :]  # (B, S, first + S): causal, real keys
    dtype = hidden.dtype
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
    mask = mask.unsqueeze(1)  # (B, 1, S, first + S), additive
    hidden, positions = hidden.to(device), positions.to(device)
    embeddings = rotary_module(target)(hidden, positions)  # (cos, sin), each (B, S, d)
    for i in range(start_layer, len(layers)):
        place = places[i]
        if hidden.device != place:
            hidden, mask, positions = hidden.to(place), mask.to(place), positions.to(place)
            embeddings = tuple(e.to(place) for e in embeddings)
        out = layers[i](
            hidden,
            attention_mask=mask,
            position_embeddings=embeddings,
            position_ids=positions,
            use_cache=True,
            **{CACHE_KWARG: cache},
        )
        hidden = out[0] if isinstance(out, tuple) else out  # (B, S, D_t)
    return hidden
