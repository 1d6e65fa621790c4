"""Measurements and studies built on the core: the demo, evaluation, drift, studies, inspect and benchmarks."""
