"""Defaults of the demo and the mapper benchmark that the command line names too, in one place.

Standard library only: the `kvbridge` command's light entry reads them (`kvbridge_cli._light`) to build its options
and their help without importing torch, and `tools/demo.py` and the `kvbridge bench mapper` command use the same
values. `kvbridge tune`'s defaults are its grid's (`tools/tune/grid.py`).
"""

# `kvbridge demo`: the pocket pair, and the calibration settings it uses instead of the library's defaults
DEMO_SOURCE = "pocket-s"
DEMO_TARGET = "pocket-l"
DEMO_SETTINGS = {"top_k": 6, "ridge_lambda": "auto", "head_mode": "all_heads", "seed": 0}

# `kvbridge demo`: (full, quick) sizes; quick is for tests and smoke runs. `num_sequences` and `seq_len` are the
# calibration windows (`--num-sequences`, `--seq-len` override them).
DEMO_SIZES = {
    "num_sequences": (128, 24),
    "seq_len": (512, 256),
    "nll_windows": (64, 12),
    "nll_context": (384, 128),
    "nll_continuation": (128, 32),
    "cloze_items": (120, 16),
    "cloze_context": (256, 96),
    "cloze_continuation": (24, 16),
    "timing_context": (1024, 256),
    "timing_repeats": (5, 2),
    "cosine_windows": (8, 4),
}

# `kvbridge bench mapper`: the context lengths timed when `--lengths` is not given (cut to the models' maximum
# positions)
BENCH_LENGTHS = (256, 1024, 4096)
