"""`kvbridge bench`: `mapper` (the mapper against the target's re-prefill, per context length), `calibration`
(calibration at real layer shapes with random weights) and `vllm` (time to first token and throughput in vLLM, which
is imported only when that benchmark runs), as library functions of plain arguments; the `kvbridge bench` command
functions that call them are in `hf_kvbridge.cli.bench`.

What the benchmarks, `kvbridge tune`, the demo, the scripts and the studies measure with, as public names:
`shapes` (public Qwen3 layer shapes, their configs, random-weight models and bridges), `timing` (medians of timed
runs, peak memory) and `flop_model` (the one FLOP model: prefill, mapping and calibration FLOPs; a device's rates).
"""
