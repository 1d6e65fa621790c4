"""What the commands users run do, built on the core, as library functions of plain arguments: the demo, evaluation,
inspect, tune and the benchmarks (`tools.bench`); the `kvbridge` command functions that call them are in
`hf_kvbridge.cli`.

The studies behind the README's figures live outside the package, in the repository's `studies/` folder.
"""
