"""The FLOP model, matrix-product FLOPs from the configs and weight shapes alone: a prefill's and a mapping's
(`prefill_flops`, `mapper_flops`), what a transfer costs beside the target's own prefill (`cost`, the cost axis of
`kvbridge tune`), what each stage of a calibration computes, and its time at a device's rates.

**A transfer's cost** (`cost`): the FLOPs per context token the transfer spends beyond the source's prefill, as a
share of the target's own prefill FLOPs per token:

- the target's prefill per token, `T = prefill_flops(target config, context) / context`: per layer
  2 × its attention and MLP weights, plus the attention products QKᵀ and AV (2 · 2 · q_dim per token and key, half
  the context on average by causality); no embeddings, no LM head. Every layer has the same shape, so a layer is
  `T / L_t`;
- token recompute (`recompute_fraction = f`): the target runs `f` of the context through all its layers, `f · T`
  (to first order: the recomputed tail attends to more than the average token);
- layer recompute (`recompute_layers = n`): the target runs its top `n` layers over the whole context, `n / L_t · T`;
  with token recompute too, the recomputed tokens pass through all layers again afterwards, so the two add:
  `(f + n / L_t) · T`;
- the mapper: 2 × the weights each token meets (`mapper.flops_per_token()`: the K/V maps of every target layer, as
  the bridge maps all of them even where the top layers overwrite them) plus, for `0 < n < L_t`, the residual map of
  that `n` (2 × its `k·D_s × D_t` weights; both in `map_flops_per_token`);
- `n = L_t` maps nothing and recomputes everything: cost exactly 1.

    cost = (mapper + residual map + (f + n / L_t) · T) / T

A cost of 0.1 means the transfer spends a tenth of what the target would spend prefilling the context itself; the
source's prefill is not counted (it has run anyway when its cache is handed over).

**A calibration** (`calibration_flops`):

    kvbridge bench calibration --flop-model --head-mode all_heads --num-sequences 500 --seq-len 1024

Stages, in FLOPs (2 per multiply-add, matmul work only; `L_s`, `L_t` layers, `H` KV heads of `d`, `k` = top-k, `g`
feature groups of `w` features a source layer, `Λ` = 13 λ of the auto-λ grid, `N` tokens, `P` fit passes):

- **forwards**: both models' prefills once for the selection pass and once per fit pass,
  `(1 + P) · (prefill(source) + prefill(target))` (`prefill_flops`: 2 × body weights a token
  plus the causal attention products);
- **selection statistics**: per token, per KV head and K/V, each source layer's `d × d` Gram block and its `d × d`
  cross blocks with every target layer: `2 · 2H · (L_s·d² + L_s·d·L_t·d)`;
- **selection scoring**: per head, K/V and source layer one eigendecomposition of `d × d` and the λ path's products
  with every target layer's `d` columns: `2H · L_s · (E·d³ + (4 + 2Λ)·d²·L_t·d)`;
- **fit statistics**: per token and fit pass (union `U` of its target layers' source layers, `T` target layers), the
  Gram's upper block triangle and each target layer's own `k` cross blocks: `2 · g · (U(U+1)/2 + k·T) · w²`. `U`
  depends on which source layers the selection picks: the model reports the two ends, every target layer of a
  pass reading the same `k` (`U = k`) and no two sharing one (`U = min(L_s, T·k)`, which is also how the passes
  are planned here, as in the memory model);
- **λ search**, per map (`L_t · g` maps of `p = k·w` inputs, `q = w` outputs, float64; `hf_kvbridge.fitting.solve`):
  the eigendecomposition `E·p³`, the held-out Gram block's rotation `4p³`, the two cross blocks' `4p²q`, and
  `Λ · 2p²q` for the λ path;
- **refit**, per map: a Cholesky factorisation `p³/3` and two triangular solves `2p²q`.

`E = 14/3` counts a symmetric eigendecomposition with eigenvectors as LAPACK's `syevd` does it (tridiagonal
reduction `4p³/3`, its back-transformation `2p³`, divide and conquer at most `4p³/3`).

A device's rates (`DeviceRates`) are sustained FLOP/s for four kinds of work: the forwards' products in the models'
dtype, float32 products (the statistics), float64 products (rotations, λ path, Cholesky, triangular solves) and the
float64 eigendecomposition. `probe_rates` measures them on this machine (or a GPU); `H100_SXM` takes NVIDIA's
datasheet peaks times stated efficiencies, which are assumptions, not measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from ...fitting.solve import LAMBDA_GRID
from ...mappers import KVMapper
from .timing import median_seconds

EIGH_FLOPS = 14 / 3  # × p³: syevd with eigenvectors (see the module docstring)


def prefill_flops(config: PretrainedConfig, tokens: int) -> float:
    """Matmul FLOPs of a causal decoder body over `tokens` tokens (no LM head): 2 × tokens × body weights, plus the
    attention products (QKᵀ and AV, halved by causality)."""
    c = config.get_text_config(decoder=True)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    attn_weights = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    mlp_weights = 3 * c.hidden_size * c.intermediate_size
    linear = 2 * tokens * (attn_weights + mlp_weights)
    attention = 2 * 2 * tokens * tokens * q / 2
    return float(c.num_hidden_layers * (linear + attention))


def mapper_flops(mapper: KVMapper, tokens: int) -> float:
    """Matmul FLOPs of mapping `tokens` tokens (`KVMapper.flops_per_token`: 2 × the weights each token meets)."""
    return float(tokens * mapper.flops_per_token())


COST_UNIT = (
    "FLOPs per context token (K/V and residual maps + the target's recomputed tokens and layers) / the target's own "
    "prefill FLOPs per token"
)


def target_flops_per_token(target_config, context: int) -> float:
    """The target's prefill FLOPs per token over a `context`-token prefill (`prefill_flops`)."""
    return prefill_flops(target_config, context) / context


def _recomputed_layers(bridge) -> tuple[int, int]:
    """`(n, L_t)`: the layers `bridge` recomputes (capped at the target's) and the target's layer count, read from the
    target's layout as the mapper bench reads it (a bridge built in memory may have no config fingerprint)."""
    target_layers = bridge.target_layout.num_layers
    return min(int(bridge.config.recompute_layers or 0), target_layers), target_layers


def map_flops_per_token(bridge) -> tuple[int, int]:
    """`(K/V maps, residual map)`: matmul FLOPs per context token of the maps `bridge`'s transfer runs, 2 × the
    weights a token meets: every target layer's K/V map (`mapper.flops_per_token()`), and the residual map of
    `config.recompute_layers` when `0 < n < L_t`; `(0, 0)` for `n = L_t` (nothing is mapped)."""
    n, target_layers = _recomputed_layers(bridge)
    if n == target_layers:
        return 0, 0
    residual = bridge.residual_mapper
    if n == 0 or residual is None or n not in residual.recompute_layers:
        return bridge.mapper.flops_per_token(), 0
    return bridge.mapper.flops_per_token(), 2 * residual.layers[residual.recompute_layers.index(n)].weight.numel()


def cost(bridge, target_flops: float) -> float:
    """FLOPs per context token the transfer of `bridge` spends (maps, recomputed tokens and layers), as a share of
    the target's own prefill FLOPs per token `target_flops` (the module docstring).

    Example:

    ```python
    >>> cost(bridge, target_flops_per_token(bridge.target.config, 192))  # doctest: +SKIP
    0.078
    ```
    """
    layers, target_layers = _recomputed_layers(bridge)
    if layers == target_layers:  # the target prefills the mapped span itself: nothing is mapped
        return 1.0
    recomputed = (float(bridge.config.recompute_fraction) + layers / target_layers) * target_flops
    return (sum(map_flops_per_token(bridge)) + recomputed) / target_flops


@dataclass(frozen=True)
class DeviceRates:
    """Sustained FLOP/s of one device for the four kinds of calibration work, and where the figures come from."""

    name: str
    forward: float  # products in the models' dtype (the prefills)
    float32: float  # float32 products (the statistics)
    float64: float  # float64 products, Cholesky and triangular solves
    eigh: float  # float64 symmetric eigendecomposition, counted at `EIGH_FLOPS · p³`
    source: str


# NVIDIA H100 SXM datasheet peaks (dense): BF16 tensor 989 TFLOP/s, FP32 67 TFLOP/s, FP64 tensor 67 TFLOP/s. The H200
# has the same compute peaks. The efficiencies are assumptions: 40 % of BF16 for 1K-token prefills, 70 % for large
# FP32 and FP64 products, 5 % for an eigendecomposition (its tridiagonal reduction is bound by memory bandwidth).
H100_EFFICIENCY = {"forward": 0.40, "float32": 0.70, "float64": 0.70, "eigh": 0.05}
H100_SXM = DeviceRates(
    name="NVIDIA H100 SXM (datasheet peaks × assumed efficiencies)",
    forward=989e12 * H100_EFFICIENCY["forward"],
    float32=67e12 * H100_EFFICIENCY["float32"],
    float64=67e12 * H100_EFFICIENCY["float64"],
    eigh=67e12 * H100_EFFICIENCY["eigh"],
    source="datasheet peaks: BF16 989, FP32 67, FP64 67 TFLOP/s; efficiencies "
    + ", ".join(f"{k} {v:.0%}" for k, v in H100_EFFICIENCY.items()),
)


@dataclass(frozen=True)
class CalibrationShape:
    """What a calibration computes on: the pair's layers and KV layout, the map and the text.

    Args:
        source_layers (`int`), target_layers (`int`), num_kv_heads (`int`), head_dim (`int`): a matched layout.
        top_k (`int`): source layers per target layer.
        groups (`int`): feature groups of a source layer (`hf_kvbridge.fitting.statistics.blocks.feature_groups`: 1
        for all
            heads jointly, 2 for all heads with K and V separate, `2H` for one head, K and V separate).
        sequences (`int`), seq_len (`int`): the calibration text.
        passes (`list[int]`): target layers in each fit pass.
    """

    source_layers: int
    target_layers: int
    num_kv_heads: int
    head_dim: int
    top_k: int
    groups: int
    sequences: int
    seq_len: int
    passes: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return self.sequences * self.seq_len

    @property
    def width(self) -> int:
        """`w`: features of one source layer in one group."""
        return self.num_kv_heads * 2 * self.head_dim // self.groups


def calibration_flops(shape: CalibrationShape, source_config, target_config, lambdas: int = len(LAMBDA_GRID)) -> dict:
    """FLOPs of each calibration stage (the module docstring's counts).

    Returns:
        `dict` with `forwards`, `selection_statistics`, `selection_scoring`, `fit_statistics_low`,
        `fit_statistics_high` (the union's two ends), `lambda_search` and `refit` (all maps), and `maps`.

    Example:

    ```python
    >>> from transformers import Qwen3Config
    >>> config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
    ...                      num_key_value_heads=1, head_dim=32)
    >>> shape = CalibrationShape(2, 2, 1, 32, top_k=1, groups=1, sequences=4, seq_len=16, passes=(2,))
    >>> flops = calibration_flops(shape, config, config)
    >>> flops["maps"], flops["refit"] == 2 * (64**3 / 3 + 2 * 64 * 64 * 64)
    (2, True)
    ```
    """
    s, t, h, d, k = shape.source_layers, shape.target_layers, shape.num_kv_heads, shape.head_dim, shape.top_k
    n, w, g = shape.tokens, shape.width, shape.groups
    forward_one = shape.sequences * (
        prefill_flops(source_config, shape.seq_len) + prefill_flops(target_config, shape.seq_len)
    )
    heads = 2 * h  # (KV head, K/V) blocks of the selection statistics

    def statistics(union: int, targets: int) -> float:
        return 2 * n * g * (union * (union + 1) / 2 + k * targets) * w * w

    p, q, maps = k * w, w, t * g
    return {
        "forwards": (1 + len(shape.passes)) * forward_one,
        "selection_statistics": 2 * n * heads * (s * d * d + s * d * t * d),
        "selection_scoring": heads * s * (EIGH_FLOPS * d**3 + (4 + 2 * lambdas) * d * d * t * d),
        "fit_statistics_low": sum(statistics(k, targets) for targets in shape.passes),
        "fit_statistics_high": sum(statistics(min(s, targets * k), targets) for targets in shape.passes),
        "lambda_search": maps * ((EIGH_FLOPS + 4) * p**3 + (4 + 2 * lambdas) * p * p * q),
        "eigh": maps * EIGH_FLOPS * p**3,
        "refit": maps * (p**3 / 3 + 2 * p * p * q),
        "maps": maps,
    }


def project_seconds(flops: dict, rates: DeviceRates) -> dict:
    """Seconds of each stage at `rates`, and the totals with the fit statistics at their two ends.

    The eigendecomposition runs at `rates.eigh`, the rest of the λ search and the refit at `rates.float64`, the
    statistics at `rates.float32` and the forwards at `rates.forward`.
    """
    eigh = flops["eigh"] / rates.eigh
    seconds = {
        "forwards": flops["forwards"] / rates.forward,
        "selection_statistics": flops["selection_statistics"] / rates.float32,
        "selection_scoring": flops["selection_scoring"] / rates.float64,
        "fit_statistics_low": flops["fit_statistics_low"] / rates.float32,
        "fit_statistics_high": flops["fit_statistics_high"] / rates.float32,
        "lambda_search": eigh + (flops["lambda_search"] - flops["eigh"]) / rates.float64,
        "refit": flops["refit"] / rates.float64,
    }
    rest = seconds["selection_statistics"] + seconds["selection_scoring"] + seconds["lambda_search"] + seconds["refit"]
    for end in ("low", "high"):
        overhead = rest + seconds[f"fit_statistics_{end}"]
        seconds[f"total_{end}"] = seconds["forwards"] + overhead
        seconds[f"overhead_over_forwards_{end}"] = overhead / seconds["forwards"]
    return seconds


def probe_rates(
    device: str = "cpu", forward_dtype: torch.dtype = torch.float32, n: int | None = None, eigh_n: int | None = None
) -> DeviceRates:
    """Measures `DeviceRates` on `device`: the median of 3 timed `n × n × n` products in `forward_dtype`, float32 and
    float64, and one float64 `eigh_n × eigh_n` eigendecomposition (counted at `EIGH_FLOPS · eigh_n³`), each after a
    warm-up (`tools.bench.timing.median_seconds`). Defaults: `n` = 2,048 and `eigh_n` = 1,536 on a CPU (seconds),
    8,192 and 4,096 on a GPU (which small products leave idle).

    Returns:
        [`DeviceRates`] named after the device and the thread count.
    """
    dev = torch.device(device)
    n = n or (8192 if dev.type == "cuda" else 2048)
    eigh_n = eigh_n or (4096 if dev.type == "cuda" else 1536)
    gen = torch.Generator(device=dev).manual_seed(0)

    def gemm_rate(dtype):
        a = torch.randn(n, n, generator=gen, device=dev, dtype=torch.float32).to(dtype)
        return 2 * n**3 / median_seconds(lambda: a @ a, dev, repeats=3)

    x = torch.randn(eigh_n, eigh_n, generator=gen, device=dev, dtype=torch.float64)
    sym = x @ x.T / eigh_n
    eigh = EIGH_FLOPS * eigh_n**3 / median_seconds(lambda: torch.linalg.eigh(sym), dev, repeats=1)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
    else:
        name = f"this CPU, {torch.get_num_threads()} threads"
    return DeviceRates(
        name=name,
        forward=gemm_rate(forward_dtype),
        float32=gemm_rate(torch.float32),
        float64=gemm_rate(torch.float64),
        eigh=eigh,
        source=f"probed: {n}³ products ({str(forward_dtype).removeprefix('torch.')} for the forwards), "
        f"float64 eigh of {eigh_n}",
    )
