"""A model's KV layout, its fingerprint, and the check that a source and a target can be bridged.

A pair needs the same vocabulary (one tokenizer) and rotate-half RoPE in every layer of each model. Depth, width, the
number of KV heads, the head dimension and the rotary base or scaling may all differ: keys are stripped with the
source's own rotation and rotated with the target's. `heads.same_head_sources` says which source heads each target head
reads in `head_mode="same_head"` (equal head counts, or one dividing the other).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn
from transformers import PretrainedConfig

from ..constants import SUPPORTED_ROPE_TYPES
from ..errors import KVLayoutError
from .rope import check_rotary


def _jsonable(value: Any) -> Any:
    """Round-trips `value` through JSON so fingerprints compare equal after save/load (tuples → lists, etc.)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


@dataclass(frozen=True)
class KVLayout:
    """What the bridge needs to know about one decoder's KV cache.

    Args:
        model_type (`str`): the transformers `model_type` (e.g. `"qwen3"`).
        num_layers (`int`): number of decoder layers, one cache layer each.
        num_kv_heads (`int`): key/value heads per layer.
        head_dim (`int`): dimension of one key or value head.
        vocab_size (`int`): size of the embedding matrix.
        rope_parameters (`dict`): the model's `config.rope_parameters` (type, θ, scaling factors).
        max_position_embeddings (`int`): longest sequence the model accepts.
        layer_windows (`tuple`, *optional*): per layer, the sliding window it attends over (`None`: all tokens);
            `None` when every layer attends to all tokens.

    Example:

    ```python
    >>> from transformers import Qwen3Config
    >>> layout = KVLayout.from_config(Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=16))
    >>> layout.num_layers, layout.num_kv_heads, layout.head_dim
    (2, 2, 16)
    ```
    """

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_parameters: dict
    max_position_embeddings: int
    layer_windows: tuple[int | None, ...] | None = None

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> KVLayout:
        config = config.get_text_config(decoder=True)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        return cls(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            rope_parameters=_jsonable(dict(rope)),
            max_position_embeddings=config.max_position_embeddings,
            layer_windows=attention_windows(config),
        )

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (`None`: it attends to all tokens)."""
        return None if self.layer_windows is None else self.layer_windows[layer]

    def kept_tokens(self, layer: int, seq: int) -> int:
        """How many of `seq` tokens `layer`'s cache keeps: all, or the last `window - 1` (as transformers'
        `DynamicSlidingWindowLayer` does: the next token's attention adds itself)."""
        window = self.window(layer)
        return seq if window is None else min(seq, window - 1)

    @property
    def features_per_layer(self) -> int:
        """Width of one layer's cache row: all KV heads, key then value, `num_kv_heads * 2 * head_dim`."""
        return self.num_kv_heads * 2 * self.head_dim

    def fingerprint(self) -> dict:
        """The config facts a saved mapper depends on; stored in the checkpoint and compared on load.

        `layer_windows` is left out for full-attention models, so fingerprints saved before it existed still match.
        """
        facts = asdict(self)
        if facts["layer_windows"] is None:
            del facts["layer_windows"]
        return _jsonable(facts)


def attention_windows(config: PretrainedConfig) -> tuple[int | None, ...] | None:
    """Per decoder layer, the sliding window it attends over (`None`: all tokens), as transformers builds its cache
    layers (`config.layer_types`, else `sliding_window` on every layer); `None` when all layers are full attention."""
    text = config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is not None:
        windows = tuple(window if kind == "sliding_attention" else None for kind in types)
    elif window is not None and getattr(text, "use_sliding_window", True):
        windows = (window,) * text.num_hidden_layers
    else:
        return None
    return windows if any(w is not None for w in windows) else None


def allowed_sources(source: KVLayout, target: KVLayout) -> list[list[bool]]:
    """`allowed[t][s]`: may target layer `t` read source layer `s`?

    A target layer that attends to all tokens needs every token's K/V, which only the source's full-attention layers
    keep; a sliding target layer of window `W` needs the last `W - 1` tokens, which a source layer keeps when it is
    full or slides over a window at least as wide. Selection only picks allowed layers.
    """
    allowed = []
    for t in range(target.num_layers):
        need = target.window(t)
        allowed.append(
            [
                source.window(s) is None or (need is not None and source.window(s) >= need)
                for s in range(source.num_layers)
            ]
        )
    return allowed


def check_supported(config: PretrainedConfig, name: str) -> KVLayout:
    """Returns the layout of `config`, or raises `KVLayoutError` for what the bridge cannot map faithfully.

    Any decoder is judged by what its config says about its cache, not by its model type: refused are rotary types
    whose frequencies depend on more than the position, sliding-window or hybrid attention layers, layers without
    RoPE, and partial rotary embeddings. `rope.check_rotary` then checks the model's own rotary module.
    """
    text_config = config.get_text_config(decoder=True)
    layout = KVLayout.from_config(text_config)
    rope_type = layout.rope_parameters.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise KVLayoutError(
            f"{name}: rotary type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})."
        )
    partial = layout.rope_parameters.get("partial_rotary_factor", getattr(text_config, "partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise KVLayoutError(f"{name}: partial rotary embeddings (factor {partial}) are not supported.")
    no_rope = getattr(text_config, "no_rope_layers", None)
    if no_rope and not all(no_rope):
        skipped = [i for i, use in enumerate(no_rope) if not use]
        raise KVLayoutError(
            f"{name}: layers {skipped} use no rotary embedding (NoPE); the bridge strips RoPE from every layer's keys."
        )
    layer_types = getattr(text_config, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if other:
            raise KVLayoutError(
                f"{name}: layers of type {other} found; the bridge maps full-attention and sliding-window layers."
            )
    return layout


def check_matched(source: PretrainedConfig, target: PretrainedConfig, source_name: str, target_name: str):
    """Checks that `source` and `target` can be bridged (each supported, one vocabulary) and returns their
    `(source, target)` layouts. KV heads, head dims and rotary parameters may differ.

    Example:

    ```python
    >>> from transformers import Qwen3Config
    >>> small = Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, vocab_size=64)
    >>> large = Qwen3Config(num_hidden_layers=4, num_key_value_heads=4, head_dim=32, vocab_size=64)
    >>> src, tgt = check_matched(small, large, "small", "large")
    >>> (src.num_layers, src.num_kv_heads, src.head_dim), (tgt.num_layers, tgt.num_kv_heads, tgt.head_dim)
    ((2, 2, 16), (4, 4, 32))
    ```
    """
    src = check_supported(source, f"source model {source_name!r}")
    tgt = check_supported(target, f"target model {target_name!r}")
    if src.vocab_size != tgt.vocab_size:
        raise KVLayoutError(
            f"vocabularies differ: source {source_name!r} has vocab size = {src.vocab_size} but target "
            f"{target_name!r} has vocab size = {tgt.vocab_size}. The bridge maps between models that share a "
            "tokenizer."
        )
    return src, tgt


def check_models(source: nn.Module, target: nn.Module, source_name: str, target_name: str):
    """`check_matched` on the two models' configs, then `rope.check_rotary` on each model's own rotary module, and
    that every target layer has a source layer that keeps the tokens it needs (`allowed_sources`).

    Returns:
        the `(source, target)` [`KVLayout`]s.
    """
    src, tgt = check_matched(source.config, target.config, source_name, target_name)
    check_rotary(source, src.head_dim, f"source model {source_name!r}")
    check_rotary(target, tgt.head_dim, f"target model {target_name!r}")
    for t, row in enumerate(allowed_sources(src, tgt)):
        if not any(row):
            need = "all tokens" if tgt.window(t) is None else f"the last {tgt.window(t) - 1} tokens"
            raise KVLayoutError(
                f"target {target_name!r} layer {t} needs {need}, but no layer of source {source_name!r} keeps them "
                f"(source windows {list(src.layer_windows or [])}); no mapper can fill that layer."
            )
    return src, tgt


def check_fingerprint(expected: dict, layout: KVLayout, role: str, name: str) -> None:
    """Raises `KVLayoutError` when a loaded model's layout differs from the one a mapper was calibrated for."""
    actual = layout.fingerprint()
    diffs = [
        f"{k}: expected {expected.get(k)!r}, got {actual.get(k)!r}" for k in actual if expected.get(k) != actual[k]
    ]
    if diffs:
        raise KVLayoutError(
            f"This mapper was calibrated for a different {role} model than {name!r} (wrong mapper for this model "
            f"pair?): " + "; ".join(diffs)
        )


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
