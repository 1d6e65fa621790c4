"""`kvbridge bench`: `mapper` (the mapper against the target's re-prefill, per context length), `calibration`
(calibration at real layer shapes with random weights) and `vllm` (time to first token and throughput in vLLM, which
is imported only when that benchmark runs). Each module's `run_cli(args)` runs its command."""
