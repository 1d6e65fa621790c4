"""The runtime every mapper shares: `KVMapper`, a linear map per target layer (and head group) from the selected
source layers' content-space KV rows to the target layer's, with the row layout and the product of one step over
one chunk (target layers that read the same source layers are mapped by one wide product of stacked weights). The
schedule (which steps, which slots, how many tokens per chunk) is the mapping engine's (`hf_kvbridge.mappers.engine`).
Subclasses change the per-layer map (`make_layer`, `map_layer`, `map_targets`): low rank, residual MLP.
No fitting here: the ridge fit (`KVMapper.from_statistics`, `fit_targets`, `ridge_solutions`) lives on the fitting
side, `hf_kvbridge.fitting.mapper_fits.ridge`, which attaches it to this class when imported."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..constants import HEAD_MODES, KV_MODES, MAPPER_KWARGS
from ..errors import MapperError
from ..utils.heads import HeadLayouts, same_head_sources, target_heads_of
from ..utils.key_norm import project_keys


def kv_view(buffer: torch.Tensor, order: str, sizes: dict[str, int]) -> torch.Tensor:
    """`buffer`, whose dimensions are laid out in `order` (letters of `sizes`: `k` K/V, `n` layers, `b` batch, `t`
    tokens, `h` KV heads, `d` head dim), as a `(2, n, B, H, T, d)` view: keys, then values."""
    return buffer.view(*(sizes[c] for c in order)).permute(*(order.index(c) for c in "knbhtd"))


@dataclass(frozen=True)
class MapperType:
    """One entry of the mapper registry (`hf_kvbridge.mappers.MAPPER_REGISTRY`).

    Args:
        name (`str`): the `mapper_type` saved in the config.
        mapper_class (`type[KVMapper]`): what `from_pretrained` builds (with `mapper_class.from_config`) before
            loading the weights.
        fit (`Callable`, *optional*): a type of your own's `fit(ridge_mapper, *, source, target, windows,
            statistics, ridge_lambda, batch_size, progress, **kwargs)`, returning the new [`KVMapper`] (with its
            `fit_summary`, and its `fit_config` where it sets more of the config). Left out (`None`) by the shipped
            types: their fits live on the fitting side (`hf_kvbridge.fitting.mapper_fits.FITS`, read by `fit_of`), so
            a served bridge loads none of them. Mappers never import calibration or modeling.
        linear (`bool`, *optional*, defaults to `False`): its weights are a plain `KVMapper`'s (lazy per-layer
            loading works).
        kv_modes (`tuple[str, ...]`): the `kv_mode`s it fits and maps (`CalibrationSettings` refuses the others
            before any work); every type so far supports both.
        description (`str`): one line for `--help` and the docs.
        kwargs (`tuple[str, ...]`, *optional*): the `mapper_kwargs` its `fit` accepts (validated before any work);
            defaults to `constants.MAPPER_KWARGS[name]`, where the shipped types name theirs so that the settings and
            the command line read them without importing the mappers (none for a type of your own not named there).
    """

    name: str
    mapper_class: type
    fit: Callable | None = None
    linear: bool = False
    description: str = ""
    kv_modes: tuple[str, ...] = KV_MODES
    kwargs: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.kwargs is None:  # the shipped types' keywords are named once, where the settings read them
            object.__setattr__(self, "kwargs", MAPPER_KWARGS.get(self.name, ()))


class LayerMap(nn.Module):
    """The affine map of one target layer: `weight (G, p_g, out_g)`, `bias (G, out_g)`, `G` head groups."""

    def __init__(self, groups: int, in_features: int, out_features: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(groups, in_features, out_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(groups, out_features, dtype=dtype), requires_grad=False)


class KVMapper(nn.Module, HeadLayouts):
    """Maps content-space source KV rows to content-space target KV rows, one target layer at a time.

    Args:
        selected_layers (`list[list[int]]`): for each target layer, the source layers whose rows are concatenated,
            in this order (the order is part of the artifact).
        num_kv_heads (`int`), head_dim (`int`): the source's KV layout (and the target's, unless given).
        head_mode (`str`): `"all_heads"` (each target head sees all heads of the selected layers) or `"same_head"`
            (target head h sees only its source heads: head h for equal counts, see `layout.same_head_sources`).
        kv_mode (`str`, *optional*, defaults to `"joint"`): `"joint"` (keys and values → keys and values) or
            `"separate"` (keys from keys, values from values: half the weights and FLOPs).
        target_kv_heads (`int`, *optional*), target_head_dim (`int`, *optional*): the target's KV layout when it
            differs from the source's.

    The map of a target layer is `G` independent affine maps ("groups") over its own input features (`H_s`, `d_s`
    the source's heads and head dim, `H_t`, `d_t` the target's, `r = max(1, H_s / H_t)` source heads per target
    head in `same_head` mode):

    | head_mode, kv_mode | G | input width per source layer | output width |
    |---|---|---|---|
    | all_heads, joint | 1 | H_s·2d_s | H_t·2d_t |
    | same_head, joint | H_t | r·2d_s | 2d_t |
    | all_heads, separate | 2 (K, V) | H_s·d_s | H_t·d_t |
    | same_head, separate | 2H_t (K of each head, then V) | r·d_s | d_t |

    Example:

    ```python
    >>> mapper = KVMapper([[0], [1, 0]], num_kv_heads=2, head_dim=4, head_mode="same_head")
    >>> keys = values = torch.randn(1, 2, 5, 4)  # (B, H, T, d) of one source layer
    >>> rows = [mapper.layout_rows(keys, values)] * 2  # one per selected source layer
    >>> mapped = mapper.map_layer(1, rows)  # (H, B·T, 2d)
    >>> [t.shape for t in mapper.split_rows(mapped, batch=1, seq=5)]
    [torch.Size([1, 2, 5, 4]), torch.Size([1, 2, 5, 4])]
    ```
    """

    def __init__(
        self,
        selected_layers: list[list[int]],
        num_kv_heads: int,
        head_dim: int,
        head_mode: str,
        kv_mode: str = "joint",
        *,
        target_kv_heads: int | None = None,
        target_head_dim: int | None = None,
    ):
        super().__init__()
        if head_mode not in HEAD_MODES:
            raise MapperError(f"head_mode must be one of {HEAD_MODES}, got {head_mode!r}")
        if kv_mode not in KV_MODES:
            raise MapperError(f"kv_mode must be one of {KV_MODES}, got {kv_mode!r}")
        self.selected_layers = [list(map(int, layers)) for layers in selected_layers]
        self._set_head_layouts(num_kv_heads, head_dim, target_kv_heads, target_head_dim)
        self.head_mode, self.kv_mode = head_mode, kv_mode
        # same_head: the source heads each target head reads (refuses head counts where neither divides the other)
        self.head_sources = (
            None if head_mode == "all_heads" else same_head_sources(self.source_kv_heads, self.target_kv_heads)
        )
        self.groups = (1 if head_mode == "all_heads" else self.target_kv_heads) * (1 if kv_mode == "joint" else 2)
        # one plain matrix product per layer only for all_heads + joint; every other mode is a batched product
        self.grouped = self.groups > 1
        width, out = self.row_width, self.out_width
        self.layers = nn.ModuleList(
            self.make_layer(self.groups, len(layers) * width, out) for layers in self.selected_layers
        )
        # the target's key-norm gains `(L_t, d_t)` when mapped keys are put back on its key norm's sphere
        # (`set_key_norm`, `hf_kvbridge.utils.key_norm`); saved with the weights, `None` (not saved) otherwise
        self.register_buffer("key_norm_gain", None)

    # what a fit (`MapperType.fit`) records about itself: `fit_summary` becomes the new bridge's mapper_kwargs,
    # `fit_config` holds other config fields it sets (`heldout_r2`); both `None` for a ridge mapper
    fit_summary: dict | None = None
    fit_config: dict | None = None

    def head_kwargs(self) -> dict:
        """The `target_kv_heads` / `target_head_dim` keywords that rebuild this mapper's layouts (none if matched)."""
        return target_heads_of((0, 0, *self._head_key()))

    @staticmethod
    def layout_kwargs(config, layout) -> dict:
        """`num_kv_heads`, `head_dim` (the source's) and the target's keywords for a mapper of `config` (a
        `KVBridgeConfig`, whose `source_fingerprint` holds the source layout) and the target's `layout`."""
        source = getattr(config, "source_fingerprint", None) or {}
        heads, dim = source.get("num_kv_heads", layout.num_kv_heads), source.get("head_dim", layout.head_dim)
        if (heads, dim) == (layout.num_kv_heads, layout.head_dim):
            return {"num_kv_heads": heads, "head_dim": dim}
        return {
            "num_kv_heads": heads,
            "head_dim": dim,
            "target_kv_heads": layout.num_kv_heads,
            "target_head_dim": layout.head_dim,
        }

    @classmethod
    def from_config(cls, config, layout, **mapper_kwargs) -> KVMapper:
        """An empty mapper shaped for `config` (a `KVBridgeConfig`; the source layout is its `source_fingerprint`'s)
        and the target's `layout`, to load weights into; `mapper_kwargs` are a subclass's own arguments (a rank)."""
        mapper = cls(
            config.selected_layers,
            head_mode=config.head_mode,
            kv_mode=getattr(config, "kv_mode", "joint"),
            **mapper_kwargs,
            **cls.layout_kwargs(config, layout),
        )
        if getattr(config, "key_norm", False):  # its gains are loaded with the weights
            mapper.set_key_norm(torch.ones(len(mapper.selected_layers), mapper.target_head_dim))
        return mapper

    def set_key_norm(self, gains: torch.Tensor | None) -> None:
        """Puts mapped keys back on the target's key-norm sphere (`hf_kvbridge.utils.key_norm`) with these gains
        `(L_t, d_t)` (`key_norm_gains(target)`), or stops doing so (`None`). The mapping engine and `distill` apply
        it after each target layer's map, before the target's rotary embedding."""
        if gains is None:
            self.key_norm_gain = None
            return
        shape = (len(self.selected_layers), self.target_head_dim)
        if tuple(gains.shape) != shape:
            raise MapperError(f"key-norm gains must be {shape} (target layers × head dim), got {tuple(gains.shape)}")
        if not torch.isfinite(gains).all() or bool((gains == 0).any()):
            raise MapperError("key-norm gains must be finite and nonzero (mapped keys are divided by them)")
        device = next((p.device for p in self.parameters() if p.device.type != "meta"), torch.device("cpu"))
        self.key_norm_gain = gains.detach().to(device=device, dtype=torch.float32)

    def project_mapped_keys(self, keys: torch.Tensor, targets: list[int]) -> torch.Tensor:
        """`keys` `(n, B, H, T, d)`, the mapped content-space keys of target layers `targets`, rescaled in place onto
        the target's key-norm sphere when the mapper has gains (`set_key_norm`); unchanged otherwise."""
        if self.key_norm_gain is not None:
            project_keys(keys, self.key_norm_gain[targets])
        return keys

    def make_layer(self, groups: int, in_features: int, out_features: int) -> nn.Module:
        """The map of one target layer (`groups` head groups of `in_features → out_features`)."""
        return LayerMap(groups, in_features, out_features)

    def layout_dtype(self) -> torch.dtype:
        """dtype of the mapper's inputs (its weights' dtype)."""
        return self.layers[0].bias.dtype

    def layer_weight(self, target_layer: int) -> torch.Tensor:
        """Target layer `target_layer`'s weight `(G, p, q)` as one matrix per head group (inputs in selected order)."""
        return self.layers[target_layer].weight

    def flops_per_token(self) -> int:
        """Matmul FLOPs of mapping one token to every target layer: 2 × the weights a token's rows meet."""
        return sum(2 * layer.weight.numel() for layer in self.layers)

    def materialize(self, target_layer: int) -> None:
        """Makes target layer `target_layer`'s weights available; a no-op here (see `LazyKVMapper`)."""

    def release(self, target_layer: int) -> None:
        """Lets go of target layer `target_layer`'s weights after mapping; a no-op here (see `LazyKVMapper`)."""

    def new_rows(
        self, batch: int, seq: int, num_layers: int, device=None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """An uninitialised buffer for the rows of `num_layers` source layers side by side, in the mapper's input
        layout: `(B·T, L·H_s·2d_s)` for `all_heads`, `(H_t, B·T, L·r·2d_s)` for `same_head` (see `write_rows`).

        Args:
            out (`torch.Tensor`, *optional*): a flat tensor of at least that many elements to use as storage (a
                reused workspace); a new tensor otherwise.
        """
        width = num_layers * self.row_width
        shape = (self.groups, batch * seq, width) if self.grouped else (batch * seq, width)
        if out is None:
            return torch.empty(shape, dtype=self.layout_dtype(), device=device)
        return out[: math.prod(shape)].view(shape)

    @property
    def heads_per_group(self) -> int:
        """Source heads one group reads: all of them (`all_heads`), or `r = max(1, H_s / H_t)` (`same_head`)."""
        return self.source_kv_heads if self.head_mode == "all_heads" else len(self.head_sources[0])

    @property
    def row_width(self) -> int:
        """Width of one source layer in the mapper's input layout, per group: `H_s·2d_s` for `all_heads`, `r·2d_s`
        for `same_head`, half of that when `kv_mode="separate"`."""
        return self.heads_per_group * (2 if self.kv_mode == "joint" else 1) * self.source_head_dim

    @property
    def out_width(self) -> int:
        """Width of one target layer in the mapper's output layout, per group: `H_t·2d_t` for `all_heads`, `2d_t`
        for `same_head`, half of that when `kv_mode="separate"`."""
        heads = self.target_kv_heads if self.head_mode == "all_heads" else 1
        return heads * (2 if self.kv_mode == "joint" else 1) * self.target_head_dim

    @property
    def slot_features(self) -> int:
        """Elements one source layer's rows take per token in a `new_rows` buffer: `H_s·2d_s`, more in `same_head`
        mode when target heads share a source head (each reads its own copy)."""
        return (self.groups if self.grouped else 1) * self.row_width

    def layer_rows(self, rows: torch.Tensor, index: int, count: int = 1) -> torch.Tensor:
        """Layers `index … index+count-1` of a `new_rows` buffer, side by side (a view): the input of a map."""
        return rows[..., index * self.row_width : (index + count) * self.row_width]

    def write_rows(self, rows: torch.Tensor, index: int, keys: torch.Tensor, values: torch.Tensor, write_keys=None):
        """Writes one source layer's keys and values, `(B, H_s, T, d_s)` each, into layer `index` of a `new_rows`
        buffer; per head the key then the value.

        Args:
            write_keys (`Callable`, *optional*): `write_keys(keys, out)` writes the keys into `out` (a `(B, H, T, d)`
                view of the buffer); used to strip RoPE straight into the buffer. Defaults to a copy.
        """
        batch, heads, seq, dim = values.shape
        layers = rows.shape[-1] // self.row_width
        write_keys = write_keys or (lambda k, out: out.copy_(k))
        if self.head_mode == "all_heads":
            if self.kv_mode == "separate":
                slot = rows.view(2, batch, seq, layers, heads, dim)[:, :, :, index]  # (2, B, T, H, d)
                key_view, value_view = slot[0].transpose(1, 2), slot[1].transpose(1, 2)
            else:
                slot = rows.view(batch, seq, layers, heads, 2, dim)[:, :, index]  # (B, T, H, 2, d)
                key_view, value_view = slot[:, :, :, 0].transpose(1, 2), slot[:, :, :, 1].transpose(1, 2)
            write_keys(keys, key_view)
            value_view.copy_(values)
            return
        groups, per = self.target_kv_heads, self.heads_per_group  # group g reads `per` source heads
        if self.kv_mode == "separate":
            slot = rows.view(2, groups, batch, seq, layers, per, dim)[:, :, :, :, index]  # (2, G, B, T, r, d)
            key_slot, value_slot = slot[0], slot[1]
        else:
            slot = rows.view(groups, batch, seq, layers, per, 2, dim)[:, :, :, index]  # (G, B, T, r, 2, d)
            key_slot, value_slot = slot[..., 0, :], slot[..., 1, :]  # (G, B, T, r, d)
        if groups > heads:  # target heads g·rep … g·rep+rep-1 read source head g: write the first copy, then copy it
            rep = groups // heads
            key_copies = key_slot[:, :, :, 0].unflatten(0, (heads, rep))  # (H_s, rep, B, T, d)
            value_copies = value_slot[:, :, :, 0].unflatten(0, (heads, rep))
            write_keys(keys, key_copies[:, 0].transpose(0, 1))  # (B, H_s, T, d) view
            value_copies[:, 0].transpose(0, 1).copy_(values)
            key_copies[:, 1:].copy_(key_copies[:, :1])
            value_copies[:, 1:].copy_(value_copies[:, :1])
            return
        for j in range(per):  # member j of group g is source head g·per + j
            write_keys(keys[:, j::per], key_slot[:, :, :, j].transpose(0, 1))  # (B, G, T, d) view
            value_slot[:, :, :, j].transpose(0, 1).copy_(values[:, j::per])

    def row_views(self, rows: torch.Tensor, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where every slot's keys and values go in a `new_rows` buffer, as two `(L, B, H_s, T, d_s)` views (slot,
        batch, source head, token, dim), so that one op can write all the slots; `None` where the layout has no such
        view (`same_head` with a source head read by several groups, or several heads per group: `write_rows`
        writes those).

        Example:

        ```python
        >>> mapper = KVMapper([[0], [1, 0]], num_kv_heads=2, head_dim=4, head_mode="all_heads")
        >>> keys, values = mapper.row_views(mapper.new_rows(1, 5, 2), batch=1, seq=5)
        >>> keys.shape
        torch.Size([2, 1, 2, 5, 4])
        ```
        """
        heads = self.source_kv_heads
        if self.head_mode == "same_head" and self.target_kv_heads != heads:  # replicated or several source heads per
            return None  # group: no single view
        layers = rows.shape[-1] // self.row_width
        sizes = {"k": 2, "n": layers, "b": batch, "t": seq, "h": heads, "d": self.source_head_dim}
        keys, values = kv_view(rows, self.row_orders[self.kv_mode, self.head_mode], sizes).unbind(0)  # (L, B, H, T, d)
        return keys, values

    def layout_rows(self, keys: torch.Tensor, values: torch.Tensor, write_keys=None) -> torch.Tensor:
        """One source layer's keys and values, `(B, H_s, T, d_s)` each, in the mapper's input layout: `(B·T, H_s·2d_s)`
        for `all_heads`, `(H_t, B·T, r·2d_s)` for `same_head` (`new_rows` + `write_rows` for a single layer)."""
        batch, _, seq, _ = values.shape
        rows = self.new_rows(batch, seq, 1, device=values.device)
        self.write_rows(rows, 0, keys, values, write_keys)
        return rows

    # how `new_rows` and `map_layer`'s output lay out their dimensions, per (kv_mode, head_mode), read by `row_views`
    # and `split_rows` (`kv_view`): `k` K/V, `n` layers (source slots; target layers, 1 here), `b` batch, `t` tokens,
    # `h` KV heads, `d` head dim; `targets_orders`: the same for `map_targets`' `n` layers side by side (a subclass
    # with another layout overrides it)
    row_orders = {
        ("separate", "all_heads"): "kbtnhd",
        ("separate", "same_head"): "khbtnd",
        ("joint", "all_heads"): "btnhkd",
        ("joint", "same_head"): "hbtnkd",
    }
    targets_orders = row_orders

    def split_rows(
        self, mapped: torch.Tensor, batch: int, seq: int, layers: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output's content-space keys and values, `(B, H_t, T, d_t)` each (views).

        With `layers=n`, `mapped` holds `n` target layers side by side (a `map_targets` output) and the keys and
        values are `(n, B, H, T, d)` views, so one elementwise op can cover all `n` layers.
        """
        order = (self.row_orders if layers is None else self.targets_orders)[self.kv_mode, self.head_mode]
        n, heads, dim = 1 if layers is None else layers, self.target_kv_heads, self.target_head_dim
        kv = kv_view(mapped, order, {"k": 2, "n": n, "b": batch, "t": seq, "h": heads, "d": dim})  # (2, n, B, H, T, d)
        if layers is None:
            kv = kv[:, 0]
        return kv[0], kv[1]

    def map_layer(self, target_layer: int, rows: list[torch.Tensor]) -> torch.Tensor:
        """Maps the selected source layers' rows to target layer `target_layer`'s rows.

        One matrix product per selected source layer, accumulated in place (no concatenated copy of the inputs).

        Args:
            rows (`list[torch.Tensor]`): one tensor per selected source layer, in the selected order, from
                `layout_rows`.

        Returns:
            `torch.Tensor` in the same layout: the target layer's content-space keys and values.
        """
        layer_map = self.layers[target_layer]
        return self.accumulated_product(rows, layer_map.weight, layer_map.bias)  # (B·T, H·2d) or (H, B·T, 2d)

    def accumulated_product(
        self,
        parts: list[torch.Tensor],
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`cat(parts, -1) @ weight (+ bias)` without the concatenation: each part meets its own block of weight rows,
        in order, and the products are accumulated in place.

        Args:
            parts (`list[torch.Tensor]`): inputs in the mapper's layout, `(B·T, ·)` for `all_heads`, `(H, B·T, ·)` for
                `same_head` (views of a row buffer are fine).
            weight (`torch.Tensor` of shape `(G, p, N)`), bias (`(G, N)`, *optional*).
            out (`torch.Tensor`, *optional*): flat storage for the result.

        Returns:
            `(B·T, N)` for `all_heads` (G = 1), `(G, B·T, N)` for `same_head`.
        """
        shape = (*parts[0].shape[:-1], weight.shape[-1])
        if out is None:
            result = torch.empty(shape, dtype=parts[0].dtype, device=parts[0].device)
        else:
            result = out[: math.prod(shape)].view(shape)
        if self.grouped:
            return self._accumulate(parts, weight, None if bias is None else bias.unsqueeze(1), result)
        return self._accumulate(parts, weight[0], None if bias is None else bias[0], result)  # one plain matrix

    def _accumulate(self, parts: list[torch.Tensor], weight, bias, into: torch.Tensor) -> torch.Tensor:
        """`cat(parts, -1) @ weight + bias` written into `into` (any row stride), the products accumulated in place;
        `weight (p, N)` and `bias (N,)` for one group, else `(G, p, N)` and `(G, 1, N)`; `bias` may be `None`."""
        start = 0
        for i, x in enumerate(parts):  # x (B·T, w) or (G, B·T, w)
            whole = len(parts) == 1 and x.shape[-1] == weight.shape[-2]
            block = weight if whole else weight[..., start : start + x.shape[-1], :]
            start += x.shape[-1]
            if i > 0 and self.grouped:
                into.baddbmm_(x, block)
            elif i > 0:
                into.addmm_(x, block)
            elif bias is None:
                torch.matmul(x, block, out=into)
            elif self.grouped:
                torch.baddbmm(bias, x, block, out=into)
            else:
                torch.addmm(bias, x, block, out=into)
        return into

    # -- mapping several target layers at once -------------------------------------------------------------------
    # Target layers that read the same set of source layers are mapped with one wide matrix product (their weights'
    # row blocks put in one order and stacked along the output). One product per layer is narrow (output H·2d) and
    # runs far below a CPU's or GPU's peak; the stacked product runs near it. Exact: same weights, same sums.
    groupable = True  # False where `map_layer` is not one affine map per layer (MLP) or weights load lazily
    max_group_bytes = 2**28  # stacked weights are a copy: don't stack more than this per group
    # hints to the mapping engine's schedule (`hf_kvbridge.mappers.engine.schedule`): chunks of tokens whose working
    # set is about `max_chunk_bytes` (None: the whole sequence at once), with products of at least `min_chunk_rows`
    # rows
    max_chunk_bytes: int | None = 2**26
    min_chunk_rows = 512

    def _stacked(self, sources: list[int], targets: list[int]):
        """`_stack(sources, targets)`, cached until any parameter of those target layers or their layer order
        changes. Parameters made under `torch.inference_mode()` (a bridge loaded in a vLLM worker, say) have no
        version counter, so in-place edits to them cannot be seen: their stack is rebuilt on every call instead."""
        params = [p for t in targets for p in self.layers[t].parameters()]  # one walk over the modules per call
        if any(p.is_inference() for p in params):
            return self._stack(sources, targets)
        versions = (
            tuple((p._version, p.data_ptr()) for p in params),
            tuple(tuple(self.selected_layers[t]) for t in targets),
        )
        key = (tuple(sources), tuple(targets))
        cache = self.__dict__.setdefault("_stacked_cache", {})
        if key not in cache or cache[key][0] != versions:
            cache[key] = (versions, self._stack(sources, targets))
        return cache[key][1]

    def _stack(self, sources: list[int], targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Weights `(G, k·span, n·out)` and bias `(G, n·out)` of `targets`, inputs in `sources` order (the layer's
        own tensors, no copy, for one target whose selected order is `sources`)."""
        if len(targets) == 1 and list(sources) == self.selected_layers[targets[0]]:
            return self.layers[targets[0]].weight, self.layers[targets[0]].bias
        weight = torch.cat([self._in_source_order(self.layers[t].weight, t, sources) for t in targets], dim=2)
        return weight, torch.cat([self.layers[t].bias for t in targets], dim=1)

    def _in_source_order(self, weight: torch.Tensor, target: int, sources: list[int]) -> torch.Tensor:
        """Target layer `target`'s `(G, k·span, ·)` input weights with their row blocks moved from its selected order
        to `sources` order."""
        order = self.selected_layers[target]
        span = weight.shape[1] // len(order)
        return torch.cat([weight[:, order.index(s) * span : (order.index(s) + 1) * span] for s in sources], dim=1)

    def step_product(
        self,
        sources: list[int],
        rows: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        slots: dict[int, int] | None = None,
    ) -> torch.Tensor:
        """`[rows of sources] @ weight (+ bias)`, the source layers read from a `new_rows` buffer (layer `s` at index
        `slots[s]`, default `s`): one product when they sit side by side in `sources` order (a view), otherwise one
        product per source layer accumulated in place (as fast, and no gathered copy of the inputs); see
        `accumulated_product` for the shapes."""
        index = [s if slots is None else slots[s] for s in sources]
        return self.accumulated_product(self.slot_parts(rows, index), weight, bias, out)

    def slot_parts(self, rows: torch.Tensor, index: list[int]) -> list[torch.Tensor]:
        """The rows of slots `index` of a `new_rows` buffer, as one product reads them: one wide view when the slots
        sit side by side in that order, else one view per slot."""
        if index == list(range(index[0], index[0] + len(index))):
            return [self.layer_rows(rows, index[0], len(index))]
        return [self.layer_rows(rows, i) for i in index]

    def _product_operands(self, sources: list[int], targets: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`_stacked(sources, targets)` in the form `_accumulate` takes them, made once per stack: `(weight (p, N),
        bias (N,))` for one group (`all_heads` + `joint`), else `(weight (G, p, N), bias (G, 1, N))`."""
        weight, bias = self._stacked(sources, targets)
        cache = self.__dict__.setdefault("_stacked_cache", {})
        key = ("operands", tuple(sources), tuple(targets))
        kept = cache.get(key)
        if kept is None or kept[0] is not weight or kept[1] is not bias:  # the stack was rebuilt
            operands = (weight, bias.unsqueeze(1)) if self.grouped else (weight[0], bias[0])
            kept = cache[key] = (weight, bias, operands)
        return kept[2]

    def map_targets(
        self,
        sources: list[int],
        targets: list[int],
        rows: torch.Tensor,
        out: torch.Tensor | None = None,
        slots: dict[int, int] | None = None,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Maps one step of `hf_kvbridge.mappers.engine.mapping_steps` over one chunk of rows.

        Args:
            sources, targets: the step.
            rows (`torch.Tensor`): a `new_rows` buffer holding (at least) the step's source layers, layer `s` at
                index `slots[s]` (default: at index `s`).
            out (`torch.Tensor`, *optional*): flat storage for the result (a reused workspace).
            slots (`dict[int, int]`, *optional*): where each source layer sits in `rows`
                (`hf_kvbridge.mappers.engine.row_slots`).
            into (`torch.Tensor`, *optional*): a view to write the result into, of the result's shape and any row
                stride (the `"layers"` schedule's buffer of every target layer's rows); only for a `groupable`
                mapper that keeps this class's product (`hf_kvbridge.mappers.engine` checks).

        Returns:
            the `len(targets)` target layers side by side in `map_layer`'s layout (`split_rows(..., layers=n)` takes
            them apart).
        """
        if into is not None:
            weight, bias = self._product_operands(sources, targets)  # (p, n·out), (n·out,) or with groups
            index = [s if slots is None else slots[s] for s in sources]
            return self._accumulate(self.slot_parts(rows, index), weight, bias, into)
        if len(targets) == 1 and sources == self.selected_layers[targets[0]]:
            self.materialize(targets[0])
            index = [s if slots is None else slots[s] for s in sources]
            # a groupable map takes side-by-side slots as one wide view, one product (`map_layer` of the others
            # reads one part per source layer)
            parts = self.slot_parts(rows, index) if self.groupable else [self.layer_rows(rows, i) for i in index]
            mapped = self.map_layer(targets[0], parts)
            self.release(targets[0])
            return mapped
        weight, bias = self._stacked(sources, targets)  # (G, k·span, n·out), (G, n·out)
        return self.step_product(sources, rows, weight, bias, out, slots)  # (B·T, n·H·2d) or (H, B·T, n·2d)
