"""The dtype a bridge's mapper computes in: the target's own half type, or, for a float32 target, float32 unless
PyTorch's float32 matmul precision allows bfloat16 and the device has bfloat16 matrix units."""

from __future__ import annotations

import contextlib

import torch

from ..errors import InvalidInputError

HALF_TYPES = (torch.bfloat16, torch.float16)


def bf16_matmul_units(device: torch.device | str) -> bool:
    """Whether `device` multiplies bfloat16 matrices in hardware: a CUDA device PyTorch reports bfloat16 support
    for, or a CPU whose oneDNN has bfloat16 instructions (avx512_bf16 or AMX). Without them a bfloat16 product is
    emulated: measured about 80–110× slower than float32 on an AVX2-only AMD EPYC.

    Example:

    ```python
    >>> isinstance(bf16_matmul_units("cpu"), bool)
    True
    ```
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
        return bool(check()) if check is not None else False
    return False


def resolve_mapper_dtype(
    target_dtype: torch.dtype, device: torch.device | str, mapper_dtype: torch.dtype | str | None = None
) -> torch.dtype:
    """The dtype a bridge keeps its mapper in, and so computes its products in.

    Args:
        target_dtype (`torch.dtype`): the target model's dtype.
        device: where the mapping runs (the target's execution device).
        mapper_dtype (`torch.dtype` or `str`, *optional*): asked for explicitly (`torch.bfloat16`, `"float32"`,
            ...); `"auto"` or `None` chooses:

            - the target's dtype when that is a half type (bfloat16 or float16);
            - for a float32 target, bfloat16 when PyTorch's float32 matmul precision allows bfloat16 inside float32
              matmuls (`bf16_matmul_allowed`: `torch.set_float32_matmul_precision("medium")`) and `device` has
              bfloat16 matrix units (`bf16_matmul_units`), else float32. At PyTorch's default, `"highest"`, a float32
              bridge maps in float32, and a bridge of a model with itself reproduces the model's own logits.

    Example:

    ```python
    >>> resolve_mapper_dtype(torch.bfloat16, "cpu")
    torch.bfloat16
    >>> resolve_mapper_dtype(torch.float32, "cpu", "float32")
    torch.float32
    ```
    """
    asked = mapper_dtype
    if isinstance(mapper_dtype, str) and mapper_dtype != "auto":
        mapper_dtype = getattr(torch, mapper_dtype.removeprefix("torch."), mapper_dtype)
    if mapper_dtype not in (None, "auto", torch.float32, *HALF_TYPES):
        raise InvalidInputError(f"mapper_dtype must be 'auto', float32, bfloat16 or float16, got {asked!r}")
    if isinstance(mapper_dtype, torch.dtype):
        return mapper_dtype
    if target_dtype in HALF_TYPES:
        return target_dtype
    if bf16_matmul_allowed(device) and bf16_matmul_units(device):
        return torch.bfloat16
    return torch.float32


def bf16_matmul_allowed(device: torch.device | str) -> bool:
    """Whether PyTorch's float32 matmul precision lets float32 products on `device` run in bfloat16:
    `torch.set_float32_matmul_precision("medium")`, or on CPU its backend form
    `torch.backends.mkldnn.matmul.fp32_precision = "bf16"`.

    Example:

    ```python
    >>> bf16_matmul_allowed("cpu")  # PyTorch's default precision is "highest"
    False
    ```
    """
    if torch.device(device).type == "cpu":
        backend = getattr(getattr(torch.backends.mkldnn, "matmul", None), "fp32_precision", None)
        if backend not in (None, "none"):
            return backend == "bf16"
    try:
        return torch.get_float32_matmul_precision() == "medium"
    except RuntimeError:  # set through the backend API for another backend: PyTorch refuses to summarise it
        return False


@contextlib.contextmanager
def float32_matmul_precision(value: str):
    """`torch.set_float32_matmul_precision(value)` inside the block, and what was set before afterwards (also when that
    was set through the backend API: each backend's setting is restored).

    Example:

    ```python
    >>> with float32_matmul_precision("medium"):
    ...     torch.get_float32_matmul_precision()
    'medium'
    ```
    """
    try:
        before = torch.get_float32_matmul_precision()
    except RuntimeError:  # set through the backend API: keep each backend's own setting
        before = None
    backends = [b for b in (torch.backends.mkldnn.matmul, torch.backends.cuda.matmul) if hasattr(b, "fp32_precision")]
    kept = [b.fp32_precision for b in backends]
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        if before is not None:
            torch.set_float32_matmul_precision(before)
        else:
            for backend, setting in zip(backends, kept):
                backend.fp32_precision = setting
