"""Time to first token through the bridge's warm-cascade call (`KVBridgeForCausalLM.generate_from_cache`), against
the target's own: `kvbridge bench mapper --end-to-end`.

- **target**: the target's forward over the whole prompt (logits of the last token only) and its argmax: the least a
  target alone does before its first token.
- **warm**: a source cache of the prompt (without its `hold_back` last tokens) is already there (a cascade, a router):
  `generate_from_cache(..., max_new_tokens=1)`, i.e. the map and the target's hold-back forward.
- **cold**: the source's prefill, then the same call; and `bridge.generate(max_new_tokens=1)` (`cold_generate`), the
  bridge as one model through transformers' `generate`.

With `static=True` the mapped cache is a `StaticCache` (kept by the bridge), and with `compile_hold_back=True` the
hold-back runs through the target's compiled call; the first call (which compiles) is timed apart
(`first_call_s`), the medians are of the calls after it.

Example:

```python
>>> row = time_to_first_token(bridge, input_ids, repeats=3)  # doctest: +SKIP
>>> row["warm_speedup"]  # doctest: +SKIP
```
"""

from __future__ import annotations

import copy
import time

import torch

from ...utils.cache import output_cache
from ...utils.devices import execution_device
from .report import fixed_width
from .timing import interleaved_medians, random_prompts, synchronize


@torch.no_grad()
def time_to_first_token(
    bridge,
    input_ids: torch.Tensor,
    *,
    repeats: int = 5,
    warmup: int = 1,
    static: bool = False,
    compile_hold_back: bool = False,
    compile_config=None,
) -> dict:
    """Warm, cold and target-alone time to first token for one prompt `(batch, seq)` (see the module docstring).

    Args:
        static (`bool`), compile_hold_back (`bool`): map into a kept `StaticCache`; run the hold-back through the
            target's compiled call (needs `static`).
        compile_config (`CompileConfig`, *optional*): how to compile it (transformers' default otherwise: inductor,
            "reduce-overhead").

    Returns:
        `dict`: seconds (`target_ttft_s`, `warm_ttft_s`, `cold_ttft_s`, `cold_generate_s`, `first_call_s`), the warm
        and cold speed-ups over the target alone, and the settings.
    """
    device = bridge.device
    hold = bridge.config.hold_back
    ids = input_ids.to(device)
    source_ids = input_ids[:, :-hold].to(execution_device(bridge.source))
    options: dict = {"max_new_tokens": 1, "do_sample": False}
    if static:
        options["cache_implementation"] = "static"
    if compile_hold_back:
        options["compile_hold_back"] = True
    if compile_config is not None:
        config = copy.deepcopy(bridge.target.generation_config)
        config.compile_config = compile_config
        config.max_new_tokens, config.do_sample = 1, False
        options = {key: value for key, value in options.items() if key not in ("max_new_tokens", "do_sample")}
        options["generation_config"] = config

    def source_cache():
        return output_cache(bridge.source.model(input_ids=source_ids, use_cache=True))

    held = source_cache()
    fns = {
        "target": lambda: bridge.target(input_ids=ids, logits_to_keep=1).logits.argmax(-1),
        "warm": lambda: bridge.generate_from_cache(held, ids, **options),
        "cold": lambda: bridge.generate_from_cache(source_cache(), ids, **options),
        "cold_generate": lambda: bridge.generate(ids, max_new_tokens=1, do_sample=False),
    }
    synchronize(device)
    started = time.perf_counter()
    fns["warm"]()  # the first call: compiles where asked
    synchronize(device)
    first = time.perf_counter() - started
    seconds = interleaved_medians(fns, device, repeats, warmup)
    return {
        "context_tokens": int(input_ids.shape[1]),
        "batch": int(input_ids.shape[0]),
        "static_cache": static,
        "compiled_hold_back": compile_hold_back,
        "first_call_s": first,
        "target_ttft_s": seconds["target"],
        "warm_ttft_s": seconds["warm"],
        "cold_ttft_s": seconds["cold"],
        "cold_generate_s": seconds["cold_generate"],
        "warm_speedup": seconds["target"] / seconds["warm"],
        "cold_speedup": seconds["target"] / seconds["cold"],
        "cold_generate_speedup": seconds["target"] / seconds["cold_generate"],
        "repeats": repeats,
        "device": str(device),
    }


def end_to_end(
    bridge, lengths: list[int], *, batch: int = 1, repeats: int = 5, warmup: int = 1, compile_hold_back: bool = False
) -> list[dict]:
    """`kvbridge bench mapper --end-to-end`: `time_to_first_token` at each length on random token ids, eager on a
    dynamic cache and, with `compile_hold_back`, also on a static cache with the hold-back compiled."""
    variants = [{}] + ([{"static": True, "compile_hold_back": True}] if compile_hold_back else [])
    return [
        time_to_first_token(bridge, ids, repeats=repeats, warmup=warmup, **variant)
        for ids in random_prompts(bridge.target_layout.vocab_size, lengths, batch, seed=1)
        for variant in variants
    ]


def format_ttft(rows: list[dict]) -> str:
    """`time_to_first_token` rows as a fixed-width table."""
    header = ("tokens", "cache", "target ms", "warm ms", "warm ×", "cold ms", "cold ×", "generate ms", "first s")
    table = []
    for r in rows:
        kind = ("static" if r["static_cache"] else "dynamic") + (", comp." if r["compiled_hold_back"] else "")
        cells = (
            r["context_tokens"],
            kind,
            f"{r['target_ttft_s'] * 1e3:.1f}",
            f"{r['warm_ttft_s'] * 1e3:.1f}",
            f"{r['warm_speedup']:.2f}",
            f"{r['cold_ttft_s'] * 1e3:.1f}",
            f"{r['cold_speedup']:.2f}",
            f"{r['cold_generate_s'] * 1e3:.1f}",
            f"{r['first_call_s']:.1f}",
        )
        table.append(cells)
    return fixed_width(header, table)
