"""Model shapes for timing and memory figures: public Qwen3 layer shapes, the `PretrainedConfig`s and random-weight
models and bridges built from them.

Weights do not change timings or memory, so real-size shapes can be measured with random weights. Two tables:
`QWEN3_SHAPES` (and the `SMALL_SHAPES` of the same form) with the vocabulary cut to 1024, for timing the mapper
(embeddings and the LM head are not part of what is timed); `CHECKPOINT_SHAPES`, the same layers with the real
vocabulary and tying, for calibration, whose forwards and memory include them.

Example:

```python
>>> from hf_kvbridge.tools.bench.shapes import qwen3_shape_config, random_bridge
>>> bridge = random_bridge(qwen3_shape_config("small-3l-2x64"), qwen3_shape_config("small-8l-2x64"), top_k=3)
>>> bridge.config.mapper_type, len(bridge.config.selected_layers)
('ridge', 8)
```
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, Qwen3Config, Qwen3ForCausalLM

from ...configuration import KVBridgeConfig
from ...errors import InvalidInputError
from ...mappers import KVMapper
from ...utils.devices import execution_device
from ...utils.layout import check_matched

# Public Qwen3 shapes (layers, hidden, heads, KV heads, head dim, MLP width); vocab is cut to 1024 for random-weight
# benchmarks: embeddings and the LM head are not part of what is timed.
QWEN3_SHAPES = {
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072),
    "qwen3-1.7b": (28, 2048, 16, 8, 128, 6144),
    "qwen3-4b": (36, 2560, 32, 8, 128, 9728),
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288),
    "qwen3-14b": (40, 5120, 40, 8, 128, 17408),
    "qwen3-32b": (64, 5120, 64, 8, 128, 25600),
}


# Small shapes of the same form: 3 and 8 layers with 2 KV heads × 64, the KV layout of issue 25's held-out mapper
# pair (the mapper's time depends on the layers and the KV layout only; hidden and MLP sizes are ours).
SMALL_SHAPES = {
    "small-3l-2x64": (3, 256, 4, 2, 64, 512),
    "small-8l-2x64": (8, 256, 4, 2, 64, 512),
}

# layer shapes of real checkpoints (hidden, layers, attention heads, KV heads, head dim, MLP width, vocabulary, tied):
# `QWEN3_SHAPES` with the real vocabulary and tying, which the calibration's forwards and memory include
QWEN3_VOCAB = 151936
UNTIED = {"qwen3-8b", "qwen3-14b", "qwen3-32b"}
CHECKPOINT_SHAPES = {
    name: (hidden, layers, heads, kv_heads, head_dim, mlp, QWEN3_VOCAB, name not in UNTIED)
    for name, (layers, hidden, heads, kv_heads, head_dim, mlp) in QWEN3_SHAPES.items()
}


def shape_pair(text: str, flag: str, known) -> tuple[str, str]:
    """`SOURCE:TARGET` of `flag` split into two names of `known`, or an `InvalidInputError` that says what is wrong,
    before any model is built.

    Example:

    ```python
    >>> shape_pair("qwen3-0.6b:qwen3-1.7b", "--shapes", QWEN3_SHAPES)
    ('qwen3-0.6b', 'qwen3-1.7b')
    ```
    """
    names = text.split(":")
    if len(names) != 2:
        raise InvalidInputError(
            f"{flag} takes SOURCE:TARGET, two shape names joined by ':'; got {text!r} (known: {', '.join(known)})"
        )
    for name in names:
        if name not in known:
            raise InvalidInputError(f"unknown shape {name!r} in {flag} {text}; known: {', '.join(known)}")
    return names[0], names[1]


def qwen3_shape_config(name: str, vocab_size: int = 1024, max_positions: int = 40960) -> PretrainedConfig:
    """A `Qwen3Config` with the shape of a public Qwen3 model, or of `SMALL_SHAPES` (for random-weight timing only)."""
    shapes = {**QWEN3_SHAPES, **SMALL_SHAPES}
    if name not in shapes:
        raise InvalidInputError(f"unknown shape {name!r}; known: {', '.join(shapes)}")
    layers, hidden, heads, kv_heads, head_dim, mlp = shapes[name]
    return Qwen3Config(
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=mlp,
        vocab_size=vocab_size,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
    )


def random_bridge(
    source_config: PretrainedConfig,
    target_config: PretrainedConfig,
    *,
    top_k: int = 6,
    head_mode: str = "all_heads",
    dtype: torch.dtype = torch.float32,
    mapper_dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    rank: int | None = None,
):
    """A bridge of randomly initialised models and a random mapper: the timings of a real one of these shapes.

    Each target layer reads the `top_k` source layers closest in relative depth. With `rank`, the mapper is a
    `LowRankKVMapper` of that rank.
    """
    check_matched(source_config, target_config, "source", "target")
    with torch.device(device):
        source = AutoModelForCausalLM.from_config(source_config, dtype=dtype).eval()
        target = AutoModelForCausalLM.from_config(target_config, dtype=dtype).eval()
    return random_mapper_bridge(source, target, top_k=top_k, head_mode=head_mode, mapper_dtype=mapper_dtype, rank=rank)


def depth_selection(source_layers: int, target_layers: int, k: int) -> list[list[int]]:
    """For each target layer, the `k` source layers closest in relative depth (a random-weight bridge's selection).

    Example:

    ```python
    >>> depth_selection(4, 2, 2)
    [[0, 1], [2, 3]]
    ```
    """
    selected = []
    for t in range(target_layers):
        depth = (t + 0.5) / target_layers * source_layers
        selected.append(sorted(range(source_layers), key=lambda s: abs(s + 0.5 - depth))[:k])
    return selected


def random_mapper_bridge(
    source, target, *, top_k: int = 6, head_mode: str = "all_heads", mapper_dtype=None, rank: int | None = None
):
    """A bridge of `source` and `target` (models already built: several mappers over one pair) with a random mapper,
    as `random_bridge` makes it."""
    from ...modeling import KVBridgeForCausalLM

    src, tgt = check_matched(source.config, target.config, "source", "target")
    k = min(top_k, src.num_layers)
    selected = depth_selection(src.num_layers, tgt.num_layers, k)
    with torch.device(execution_device(target)):  # the weights made where they map
        if rank is None:
            mapper = KVMapper(selected, src.num_kv_heads, src.head_dim, head_mode)
        else:
            from ...mappers.low_rank import LowRankKVMapper

            mapper = LowRankKVMapper(selected, src.num_kv_heads, src.head_dim, head_mode, rank=rank)
    with torch.no_grad():
        for name, weight in mapper.named_parameters():
            if not name.endswith("bias"):
                weight.normal_(std=weight.shape[1] ** -0.5)
    config = KVBridgeConfig(
        top_k=k,
        head_mode=head_mode,
        selected_layers=selected,
        mapper_type="ridge" if rank is None else "low_rank",
        mapper_kwargs=None if rank is None else {"rank": rank},
    )
    bridge = KVBridgeForCausalLM(config, source, target, mapper)  # moves the mapper to the target's device
    if mapper_dtype is not None:
        bridge.mapper.to(dtype=mapper_dtype)
    return bridge


def shape_config(name: str, vocab: int | None = None, layers: int | None = None) -> Qwen3Config:
    """The `Qwen3Config` of the layer shapes `name` (a key of `CHECKPOINT_SHAPES`), with its first `layers` layers
    only if given."""
    if name not in CHECKPOINT_SHAPES:
        raise InvalidInputError(f"unknown shape {name!r}; known: {', '.join(CHECKPOINT_SHAPES)}")
    hidden, depth, heads, kv_heads, head_dim, mlp, vocab_size, tied = CHECKPOINT_SHAPES[name]
    return Qwen3Config(
        hidden_size=hidden,
        num_hidden_layers=layers or depth,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=mlp,
        vocab_size=vocab or vocab_size,
        tie_word_embeddings=tied,
        max_position_embeddings=4096,
    )


def random_model(
    name: str, dtype: torch.dtype, device: str = "cpu", vocab: int | None = None, layers: int | None = None
) -> Qwen3ForCausalLM:
    """A Qwen3 with the layer shapes of `name` (a key of `CHECKPOINT_SHAPES`) and random weights, built directly in
    `dtype` (its first `layers` layers only, if given)."""
    config = shape_config(name, vocab, layers)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # no float32 copy of the weights on the way
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    model.config.name_or_path = name
    return model
