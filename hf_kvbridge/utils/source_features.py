"""Richer source features: the source's hidden states (residual stream at chosen layers) as mapper inputs beside its
K/V.

The K/V of a source layer is a projection of its residual stream (for Qwen3-14B 2,048 numbers per token and layer,
out of a hidden state of 5,120): what the projection drops is lost to a K/V-only map. With `hidden_state_layers`,
chosen entries of the source's `output_hidden_states` (entry `i`: what source layer `i` receives, entry `L_s`: the
final normed output) become extra *feature blocks* of the per-target-layer ridge map, with no machinery of their
own: a hidden state of width `D_s` is laid out as `c = ⌈D_s / W⌉` blocks of the width `W = H_s·2d_s` of one source
layer's K/V rows (zero-padded at the end), numbered after the `L_s` K/V blocks:

```
feature block:   0 … L_s − 1        L_s … L_s + c − 1           …
holds:           K/V of layer s     hidden state h[0], pieces    the next chosen hidden state
```

So [`KVStatistics`] / [`SelectionStatistics`] / [`BlockStatistics`] accumulate them as more "source layers",
selection ranks K/V blocks and hidden-state blocks together by held-out single-block R² (top-k over all of them),
the budget plans them like any block, the ridge solve and λ choice are unchanged, and [`KVMapper`] holds and applies
the weights (a selected block index `≥ L_s` reads hidden-state features; the mapping engine writes them into its
row slot, `hf_kvbridge.mappers.engine`). Hidden-state features carry no rotation (keys still go to content space as
before). Layer recompute (`hf_kvbridge.transfer.layer_recompute`) maps the same hidden states to a residual stream;
here they feed the K/V maps themselves.

The halves of a block mean nothing for a hidden state, so these features need `head_mode="all_heads"` and
`kv_mode="joint"` (where a block's row is exactly a slice of the hidden state). Hidden states are not in a KV store
and a vLLM engine exports only K/V: serving refuses such a bridge at start-up (`check_servable`). A checkpoint that
uses them records `HIDDEN_FEATURES_FORMAT_VERSION`, which readers of the K/V-only format refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..constants import HIDDEN_FEATURES_FORMAT_VERSION, KEY_NORM_FORMAT_VERSION, KV_FORMAT_VERSION
from ..errors import ConfigurationError, KVLayoutError, ServingConfigError

HIDDEN_STATE_CHOICES = ("all",)
"""Named values of `hidden_state_layers` besides a list: `"all"` (every entry of `output_hidden_states`)."""

FEATURE_MAPPER_TYPES = ("ridge", "low_rank", "ridge_attention_weighted")
"""The mapper types fitted with hidden-state blocks among their source features: from the statistics (`ridge`,
`low_rank`) or from forward passes that read the hidden states (`ridge_attention_weighted`); the MLP's fit reads K/V
rows only."""


def check_hidden_state_layers_value(value) -> None:
    """Refuses a `hidden_state_layers` that is neither `None`, `"all"` nor a list of integers (standard library
    only: the command line checks it before importing torch)."""
    if value is None or value in HIDDEN_STATE_CHOICES or (isinstance(value, int) and not isinstance(value, bool)):
        return
    if (
        not isinstance(value, (list, tuple))
        or not value
        or any(not isinstance(i, int) or isinstance(i, bool) for i in value)
    ):
        raise ConfigurationError(
            "hidden_state_layers must be None (K/V features only), 'all', an integer or a non-empty list of integers "
            f"(entries of the source's output_hidden_states, negatives counting from the end), got {value!r}"
        )


def resolve_hidden_state_layers(value, source_layers: int) -> list[int]:
    """The entries of the source's `output_hidden_states` (`0 … L_s`) that `value` names: sorted, unique, negatives
    counted from the end (`-1`: the final normed output), as transformers' `vision_feature_layer` counts them.

    Example:

    ```python
    >>> resolve_hidden_state_layers([-1, 1], source_layers=3)
    [1, 3]
    >>> resolve_hidden_state_layers("all", source_layers=2)
    [0, 1, 2]
    ```
    """
    check_hidden_state_layers_value(value)
    if value is None:
        return []
    states = source_layers + 1
    if value == "all":
        return list(range(states))
    value = [value] if isinstance(value, int) else list(value)
    bad = [i for i in value if not -states <= i < states]
    if bad:
        raise ConfigurationError(
            f"hidden_state_layers {bad} lie outside the source's {states} hidden states (output_hidden_states "
            f"entries 0…{source_layers}, or -{states}…-1 from the end); pick entries in that range"
        )
    return sorted({i % states for i in value})


def check_feature_modes(head_mode: str, kv_mode: str, mapper_type: str = "ridge", bidirectional: bool = False) -> None:
    """Refuses the settings hidden-state features cannot run with, before any work."""
    if head_mode != "all_heads" or kv_mode != "joint":
        raise ConfigurationError(
            f"hidden_state_layers needs head_mode='all_heads' and kv_mode='joint' (a hidden state has no heads and no "
            f"key/value halves), got head_mode={head_mode!r}, kv_mode={kv_mode!r}"
        )
    if mapper_type not in FEATURE_MAPPER_TYPES:
        raise ConfigurationError(
            f"hidden_state_layers works with a mapper_type of {', '.join(map(repr, FEATURE_MAPPER_TYPES))}, not "
            f"{mapper_type!r}, whose fit reads K/V rows only; use mapper_type='ridge'"
        )
    if bidirectional:
        raise ConfigurationError(
            "hidden_state_layers fits the source → target map only; calibrate with bidirectional=False"
        )


@dataclass(frozen=True)
class SourceFeatures:
    """The feature blocks a mapper reads: the `kv_layers` K/V blocks of the source, then `pieces` blocks per chosen
    hidden state.

    Args:
        kv_layers (`int`): the source's layers `L_s` (blocks `0 … L_s − 1` are their K/V).
        hidden_states (`tuple[int, ...]`): the entries of `output_hidden_states` read, in block order.
        hidden_size (`int`): the source's hidden size `D_s`.
        block_width (`int`): features per block, `H_s·2d_s`.

    Example:

    ```python
    >>> features = SourceFeatures(kv_layers=3, hidden_states=(3,), hidden_size=80, block_width=32)
    >>> features.pieces, features.num_blocks, features.block(4)
    (3, 6, (3, 1))
    ```
    """

    kv_layers: int
    hidden_states: tuple[int, ...]
    hidden_size: int
    block_width: int

    @property
    def pieces(self) -> int:
        """Blocks per hidden state, `⌈D_s / W⌉` (the last one zero-padded)."""
        return -(-self.hidden_size // self.block_width)

    @property
    def num_blocks(self) -> int:
        """All feature blocks: K/V, then hidden-state pieces."""
        return self.kv_layers + len(self.hidden_states) * self.pieces

    def block(self, index: int) -> tuple[int, int] | None:
        """`(hidden state, piece)` that block `index` holds, or `None` for a K/V block."""
        if index < self.kv_layers:
            return None
        j, piece = divmod(index - self.kv_layers, self.pieces)
        return self.hidden_states[j], piece

    def describe(self, index: int) -> str:
        """A block's name for logs and diagnostics: `"kv 2"`, `"hidden 3"`, or `"hidden 3 [2/3]"` for a piece."""
        where = self.block(index)
        if where is None:
            return f"kv {index}"
        return f"hidden {where[0]}" + (f" [{where[1] + 1}/{self.pieces}]" if self.pieces > 1 else "")

    def piece(self, hidden_states, index: int):
        """Block `index`'s features from the source's `output_hidden_states` (`(B, T, D_s)` each): `(B, T, W)`,
        zero-padded past `D_s` (a view when no padding is needed)."""
        import torch

        state, piece = self.block(index)
        hidden = hidden_states[state]
        lo, hi = piece * self.block_width, (piece + 1) * self.block_width
        part = hidden[..., lo : min(hi, self.hidden_size)]
        if hi <= self.hidden_size:
            return part
        return torch.nn.functional.pad(part, (0, hi - self.hidden_size))  # (B, T, W)

    def rows(self, hidden_states, device=None):
        """Every hidden-state block side by side as float32 statistics rows `(B·T, (num_blocks − L_s)·W)`, to append
        to the K/V rows of `content_rows.forward_rows` (which hold the K/V blocks in the same per-block layout)."""
        import torch

        first = hidden_states[0]
        batch, seq, _ = first.shape
        device = device if device is not None else first.device
        blocks = [self.piece(hidden_states, i).float().to(device) for i in range(self.kv_layers, self.num_blocks)]
        return torch.cat(blocks, -1).reshape(batch * seq, -1)

    def write_block(self, mapper, rows, slot: int, part) -> None:
        """Writes one hidden-state block `part` `(B, T, W)` into slot `slot` of a `KVMapper.new_rows` buffer: in the
        `all_heads`/`joint` layout a block's row is `(H, 2, d)` flattened, the block's features in order."""
        batch, seq, _ = part.shape
        heads, dim = mapper.source_kv_heads, mapper.source_head_dim
        kv = part.reshape(batch, seq, heads, 2, dim).transpose(1, 2)  # (B, H, T, 2, d)
        mapper.write_rows(rows, slot, kv[..., 0, :], kv[..., 1, :])

    def as_dict(self) -> dict:
        """The `config.source_features` record."""
        return {
            "kv_layers": self.kv_layers,
            "hidden_state_layers": list(self.hidden_states),
            "hidden_size": self.hidden_size,
            "block_width": self.block_width,
            "pieces": self.pieces,
        }

    @classmethod
    def from_config(cls, config) -> SourceFeatures | None:
        """The features a `KVBridgeConfig` records (`config.source_features`), or `None` for a K/V-only bridge."""
        record = getattr(config, "source_features", None)
        if not record:
            return None
        return cls(
            int(record["kv_layers"]),
            tuple(int(i) for i in record["hidden_state_layers"]),
            int(record["hidden_size"]),
            int(record["block_width"]),
        )

    @classmethod
    def for_models(cls, source_layout, source_hidden_size: int, hidden_state_layers) -> SourceFeatures | None:
        """The features of `hidden_state_layers` (a setting's value) for a source of `source_layout` and hidden size;
        `None` when the value asks for none."""
        states = resolve_hidden_state_layers(hidden_state_layers, source_layout.num_layers)
        if not states:
            return None
        return cls(source_layout.num_layers, tuple(states), int(source_hidden_size), source_layout.features_per_layer)


def source_blocks(features: SourceFeatures | None, kv_layers: int) -> int:
    """The source "layers" (feature blocks) a mapper reads: the `kv_layers` K/V blocks, and with `features` its
    hidden-state blocks after them (`features.num_blocks` in all)."""
    return kv_layers if features is None else features.num_blocks


def check_source_features(features: SourceFeatures, source_layout, source_hidden_size: int, name: str) -> None:
    """Refuses recorded `features` that do not fit the source (`KVLayoutError`, naming what differs)."""
    found = (source_layout.num_layers, int(source_hidden_size), source_layout.features_per_layer)
    recorded = (features.kv_layers, features.hidden_size, features.block_width)
    if found != recorded or max(features.hidden_states, default=0) > source_layout.num_layers:
        raise KVLayoutError(
            f"the bridge's hidden-state features were calibrated for a source of {recorded[0]} layers, hidden size "
            f"{recorded[1]} and K/V blocks of {recorded[2]} (hidden states {list(features.hidden_states)}), but "
            f"source {name!r} has {found[0]} layers, hidden size {found[1]} and K/V blocks of {found[2]}; use the "
            "source the bridge was calibrated for"
        )


def required_format_version(config) -> int:
    """The checkpoint format a config needs: `HIDDEN_FEATURES_FORMAT_VERSION` with hidden-state features (readers of
    the K/V-only format must refuse it, not load it as a K/V-only bridge), else `KV_FORMAT_VERSION` (which every
    reader since the first loads); `KEY_NORM_FORMAT_VERSION` when the mapped keys are put back on the target's
    key-norm sphere (`config.key_norm`: older readers would map without it)."""
    version = HIDDEN_FEATURES_FORMAT_VERSION if getattr(config, "source_features", None) else KV_FORMAT_VERSION
    return max(version, KEY_NORM_FORMAT_VERSION) if getattr(config, "key_norm", False) else version


def check_servable(config, bridge: str, where: str = "vLLM") -> None:
    """Refuses a bridge whose mapper reads the source's hidden states where only K/V arrives (a vLLM target's
    connector, a store-only target): the store holds K/V and the source engine exports only K/V.

    Example:

    ```python
    >>> from hf_kvbridge import KVBridgeConfig
    >>> check_servable(KVBridgeConfig(), "my-bridge")  # a K/V-only bridge serves
    ```
    """
    record = getattr(config, "source_features", None)
    if record:
        raise ServingConfigError(
            f"bridge {bridge} maps from the source's hidden states (hidden_state_layers "
            f"{record.get('hidden_state_layers')}) beside its K/V, but {where} receives only the source's K/V (a KV "
            "store holds no hidden states): serve a bridge calibrated with hidden_state_layers=None, or run this one "
            "with the transformers bridge"
        )
