"""Commands users run, built on the core: the demo, evaluation, inspect, tune and the benchmarks (`tools.bench`).

The studies behind the README's figures live outside the package, in the repository's `studies/` folder.
"""
