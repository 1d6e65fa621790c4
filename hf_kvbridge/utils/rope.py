"""Rotary position embeddings: strip a model's rotation from cached keys, and apply another model's.

Cached keys are post-RoPE. The mapper works in *content space*: `K_c = R_s⁻¹ K_s`, map, `K̂_t = R_t (W K_c + b)`.
Frequencies and `attention_scaling` (YaRN multiplies cos/sin by it) come from the model's own `rotary_emb`, never
from `config.rope_theta`, so every rotary type transformers ships for these families is handled by the model itself.

The rotation is the rotate-half convention of Llama/Qwen/Mistral: `k * cos + rotate_half(k) * sin`.

**Fused rotation** (`rotate_kv`, the operator `torch.ops.kvbridge.rotate_kv`): rotates a list of layers' keys and
copies their values in one dispatched op, the mapping engine's whole-layer schedule's one pass per layer over the
keys and values. Its CPU kernel is the eager rotation below (two multiplies and two fused multiply-adds over the key
halves, then a copy of the values); on CUDA it is one Triton kernel per layer (`hf_kvbridge.utils.rope_triton`: keys
and
values read once, rotated in float32, written once, in any strides and dtypes), or the eager rotation where Triton is
not installed.
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn

from ..errors import KVLayoutError
from .devices import execution_device

logger = logging.getLogger(__name__)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """`[x1, x2] → [-x2, x1]` over the last dimension (the rotate-half RoPE convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_module(model: nn.Module) -> nn.Module:
    """The `rotary_emb` module of a decoder (`model.model.rotary_emb` for `*ForCausalLM`)."""
    base = getattr(model, "base_model", model)
    for candidate in (base, getattr(base, "model", None), getattr(model, "model", None)):
        if candidate is not None and hasattr(candidate, "rotary_emb"):
            return candidate.rotary_emb
    raise KVLayoutError(
        f"{type(model).__name__} has no `rotary_emb` module; cannot factor RoPE out of its cache (the bridge maps "
        "decoder models whose `model.rotary_emb` computes cos/sin, such as Llama, Qwen, Mistral)."
    )


@torch.no_grad()
def check_rotary(model: nn.Module, head_dim: int, name: str) -> None:
    """Refuses a model whose cached keys this module cannot un-rotate and re-rotate, naming the reason.

    Support is decided from what the model exposes, not from a list of model types: it must have one `rotary_emb`
    module, called as `rotary_emb(x, position_ids)`, whose cos/sin span the whole head (no partial rotary) and follow
    the rotate-half layout that transformers builds as `cat(freqs, freqs)` (interleaved rotary, as in Cohere, pairs
    adjacent dimensions instead and is refused). Models with one rotary per layer type (Gemma 3) are refused.

    Example:

    ```python
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=16)
    >>> check_rotary(LlamaForCausalLM(config), head_dim=16, name="llama")  # passes silently
    ```
    """
    try:
        rotary = rotary_module(model)
    except ValueError as err:
        raise KVLayoutError(f"{name}: {err}") from None
    parameters = inspect.signature(rotary.forward).parameters
    required = [p for p in list(parameters)[2:] if parameters[p].default is inspect.Parameter.empty]
    if required:
        raise KVLayoutError(
            f"{name}: its rotary embedding needs {required} (one rotary per layer type, as in Gemma 3); the bridge "
            "supports one rotary per model."
        )
    positions = torch.tensor([[0, 1, 7, 123]])
    cos, sin = rotary_cos_sin(model, positions.to(execution_device(model)))
    if cos.shape[-1] != head_dim:
        raise KVLayoutError(
            f"{name}: its rotary embedding covers {cos.shape[-1]} of {head_dim} head dimensions (partial rotary); "
            "the bridge supports rotary over the whole head."
        )
    if _halves(cos, sin) is None:
        raise KVLayoutError(
            f"{name}: its rotary embedding is not the rotate-half layout (cos/sin halves differ, e.g. interleaved "
            "rotary); the bridge would strip and re-apply the wrong rotation."
        )


@torch.no_grad()
def rotary_cos_sin(model: nn.Module, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32):
    """cos/sin of `model`'s own rotary embedding at `position_ids`.

    Args:
        model (`nn.Module`): a decoder with a `rotary_emb` module.
        position_ids (`torch.LongTensor` of shape `(batch, seq)`): per-row positions (left padding allowed).
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): dtype of the returned tensors.

    Returns:
        `(cos, sin)`, each `(batch, seq, head_dim)`, already multiplied by the module's `attention_scaling`.
    """
    rotary = rotary_module(model)
    probe = torch.empty(0, dtype=dtype, device=position_ids.device)
    cos, sin = rotary(probe, position_ids)
    return cos.to(dtype), sin.to(dtype)


def _halves(cos: torch.Tensor, sin: torch.Tensor):
    """cos/sin of the first half of the dims, `(B, 1, T, d/2)`, when both halves are equal (rotate-half RoPE as
    transformers builds it: `cat(freqs, freqs)`); `None` otherwise."""
    half = cos.shape[-1] // 2
    cos_h, sin_h = cos[..., :half], sin[..., :half]
    if torch.equal(cos_h, cos[..., half:]) and torch.equal(sin_h, sin[..., half:]):
        return cos_h.unsqueeze(1), sin_h.unsqueeze(1)
    return None


def _rotate(keys: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor, out: torch.Tensor | None):
    """`[k1·c − k2·s, k2·c + k1·s]` written into `out`: the rotate-half rotation with half-size cos/sin."""
    half = keys.shape[-1] // 2
    k1, k2 = keys[..., :half], keys[..., half:]
    out = torch.empty_like(keys) if out is None else out
    first, second = out[..., :half], out[..., half:]
    torch.mul(k1, cos_h, out=first).addcmul_(k2, sin_h, value=-1)  # in place: no temporaries
    torch.mul(k2, cos_h, out=second).addcmul_(k1, sin_h)
    return out


class Rotation:
    """A rotation at fixed positions, prepared once and applied to many layers' keys (`rotation(keys, out=None)`).

    Same result as `apply_rotary(keys, cos, sin, out)`, without re-checking the cos/sin halves for every layer.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, halves=False):
        self.halves = _halves(cos, sin) if halves is False else halves
        self.cos, self.sin = cos, sin
        self._tables = None

    @property
    def half_tables(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos/sin of the first half of the dims, `(B, T, d/2)` views made once, for `rotate_kv`; `None` when the
        rotation is not rotate-half (then only `__call__` applies it)."""
        if self._tables is None and self.halves is not None:
            self._tables = (self.halves[0][:, 0], self.halves[1][:, 0])
        return self._tables

    def narrow(self, start: int, end: int) -> Rotation:
        """The same rotation at tokens `[start, end)` only (views, no copy)."""
        halves = None if self.halves is None else tuple(t[:, :, start:end] for t in self.halves)  # (B, 1, T, d/2)
        return Rotation(self.cos[:, start:end], self.sin[:, start:end], halves)  # (B, T, d)

    def __call__(self, keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.halves is not None:
            return _rotate(keys, *self.halves, out=out)
        return apply_rotary(keys, self.cos, self.sin, out=out)


def apply_rotary(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Rotates content-space keys into position space, exactly as transformers' `apply_rotary_pos_emb` does.

    Args:
        keys (`torch.Tensor` of shape `(batch, heads, seq, head_dim)`).
        cos, sin (`torch.Tensor` of shape `(batch, seq, head_dim)`), from `rotary_cos_sin`.
        out (`torch.Tensor`, *optional*): where to write the result (any strides), e.g. a view into a buffer.
    """
    halves = _halves(cos, sin)
    if halves is not None:
        return _rotate(keys, *halves, out=out)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, d) broadcast over heads
    result = keys * cos + rotate_half(keys) * sin
    return result if out is None else out.copy_(result)


def inverse_cos_sin(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the inverse rotation, divided by `a² = cos² + sin²` (`a` = attention_scaling, read off the
    values so no scaling is taken from a config): `strip_rotary(k, cos, sin) == apply_rotary(k, *inverse_cos_sin)`."""
    scale_sq = cos * cos + sin * sin
    return cos / scale_sq, -sin / scale_sq


def strip_rotary(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rotary`: recovers content-space keys from cached (rotated) keys.

    With `c = a·cos θ`, `s = a·sin θ` (`a` = attention_scaling), `apply` is `a·R(θ)`, so its inverse is
    `R(-θ) / a = (k·c - rotate_half(k)·s) / a²`, and `a² = c² + s²` elementwise.

    Args:
        keys (`torch.Tensor` of shape `(batch, heads, seq, head_dim)`): cached keys.
        cos, sin (`torch.Tensor` of shape `(batch, seq, head_dim)`): the cos/sin the keys were rotated with.
    """
    return apply_rotary(keys, *inverse_cos_sin(cos, sin))


# -- the fused rotation: one dispatched op for many layers ------------------------------------------------------------
_ROTATE_KV_SCHEMA = (
    "rotate_kv(Tensor[] keys, Tensor[] values, Tensor cos, Tensor sin, Tensor(a!)[] key_out, Tensor(b!)[] value_out)"
    " -> ()"
)


def _rotate_kv_eager(keys, values, cos, sin, key_out, value_out) -> None:
    """`rotate_kv`'s CPU kernel (and CUDA's without Triton): the eager rotation per layer, then the values' copy."""
    cos_h, sin_h = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, d/2): broadcast over heads
    for k, out in zip(keys, key_out):
        _rotate(k, cos_h, sin_h, out)
    for v, out in zip(values, value_out):
        out.copy_(v)


@functools.cache
def triton_rotate_kv():
    """`hf_kvbridge.utils.rope_triton.rotate_kv`, the CUDA kernel of `rotate_kv`, where Triton can be imported, else
    `None` (logged once; CUDA rotations then run eagerly)."""
    try:
        from .rope_triton import rotate_kv as kernel
    except ImportError as err:
        logger.info("Triton unavailable (%s): CUDA rotations run eagerly", err)
        return None
    return kernel


def _rotate_kv_cuda(keys, values, cos, sin, key_out, value_out) -> None:
    kernel = triton_rotate_kv()
    if kernel is None or (values and len(values) != len(keys)):  # the kernel pairs each key with its value
        _rotate_kv_eager(keys, values, cos, sin, key_out, value_out)
    else:
        kernel(keys, values, cos, sin, key_out, value_out)


@functools.cache
def _rotate_kv_op():
    """`torch.ops.kvbridge.rotate_kv`, defined on first use (an operator of the dispatcher, not a `custom_op`: its
    call costs what an ATen op's does, a few µs, where `torch.library.custom_op`'s Python wrapper costs ~40 µs)."""
    namespace = getattr(torch.ops, "kvbridge", None)
    if namespace is None or not hasattr(namespace, "rotate_kv"):
        library = torch.library.Library("kvbridge", "FRAGMENT")
        library.define(_ROTATE_KV_SCHEMA)
        library.impl("rotate_kv", _rotate_kv_eager, "CompositeExplicitAutograd")
        library.impl("rotate_kv", _rotate_kv_cuda, "CUDA")
        _rotate_kv_op.library = library  # the registrations live as long as this object
    return torch.ops.kvbridge.rotate_kv.default


def rotate_kv(
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    rotation: tuple[torch.Tensor, torch.Tensor],
    key_out: list[torch.Tensor],
    value_out: list[torch.Tensor],
) -> None:
    """Rotates each of `keys` into `key_out` and copies each of `values` into `value_out`, in one dispatched op.

    Exact to the eager rotation (`Rotation.__call__`) within the output dtype's rounding: float32 to a few ulp (the
    Triton kernel fuses the multiply-adds), bfloat16 to one rounding (it rounds once, the eager path twice).

    Args:
        keys, values (`list[torch.Tensor]`): tensors of shape `(batch, heads, seq, head_dim)`, or `(n, batch,
            heads, seq, head_dim)` for `n` layers at once, any strides and dtypes (`values` may be empty).
        rotation (`tuple[torch.Tensor, torch.Tensor]`): `Rotation.half_tables`, the half-size cos/sin, float32
            `(batch, seq, head_dim / 2)` each.
        key_out, value_out (`list[torch.Tensor]`): where to write, one per input, of the inputs' shapes (views into
            a larger buffer are fine), in any dtype.

    Example:

    ```python
    >>> rotation = Rotation(*rotary_cos_sin(model, torch.arange(5)[None]))  # doctest: +SKIP
    >>> keys = values = torch.randn(1, 2, 5, 16)
    >>> out = [torch.empty(1, 2, 5, 16) for _ in range(2)]
    >>> rotate_kv([keys], [values], rotation.half_tables, [out[0]], [out[1]])  # doctest: +SKIP
    ```
    """
    _rotate_kv_op()(keys, values, rotation[0], rotation[1], key_out, value_out)
