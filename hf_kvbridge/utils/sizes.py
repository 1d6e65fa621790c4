"""Byte sizes as people write them: `"16GB"`, `"512MiB"`, `1e9`, read and printed. Standard library only (the
settings validate a memory budget with it before torch is imported)."""

from __future__ import annotations

import re

from ..errors import ConfigurationError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20,
          "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: int | float | str, name: str = "statistics_memory") -> int:
    """`"16GB"` → 16·10⁹, `"16GiB"` → 16·2³⁰, `1e9` → 10⁹; a value that is none of these is refused, naming the
    setting `name`.

    Example:

    ```python
    >>> parse_bytes("1.5GB")
    1500000000
    ```
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b|b)?\s*", str(value).lower())
    if not match or float(match.group(1)) <= 0:
        raise ConfigurationError(f"{name} must be a size such as '16GB', '512MiB' or a byte count, got {value!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def format_bytes(n: int | float) -> str:
    """`1.6e10` → `'16.0 GB'`."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"
