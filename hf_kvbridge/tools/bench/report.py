"""What a measurement reports: the JSON a measurement script writes (its figures beside the machine they were
measured on), and the fixed-width tables `kvbridge bench` prints.

Example:

```python
>>> import tempfile, json, os
>>> path = os.path.join(tempfile.mkdtemp(), "m.json")
>>> result = write_measurement(path, records=[{"p": 4096, "seconds": 1.5}])
wrote ...m.json
>>> sorted(json.load(open(path)))
['machine', 'records', 'threads', 'torch']
```
"""

from __future__ import annotations

import json
import platform
from collections.abc import Iterable, Sequence

import torch


def write_measurement(path: str, threads: int | None = None, **fields) -> dict:
    """Writes `fields` to `path` as JSON with the torch thread count (`threads`, default: torch's current one), the
    torch version and the processor, prints where, and returns what it wrote."""
    result = {
        "threads": threads or torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(),
        **fields,
    }
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")
    return result


def fixed_width(header: Sequence[str], rows: Iterable[Sequence[object]], width: int = 11) -> str:
    """`header`, then one line a row, each cell right-aligned in `width` characters and two spaces apart.

    Example:

    ```python
    >>> print(fixed_width(("tokens", "ms"), [(256, "1.5")], width=6))
    tokens      ms
       256     1.5
    ```
    """
    return "\n".join("  ".join(f"{cell:>{width}}" for cell in line) for line in [header, *rows])
