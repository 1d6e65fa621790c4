"""The `kvbridge` command functions: each runs one command line that `kvbridge_cli` parsed and checked, handing plain
arguments to the tools and the core; `main.run(args)` dispatches them.

| module | commands |
|---|---|
| `main` | `run`: the dispatch, one-line errors, Ctrl-C |
| `bridge` | `calibrate`, `generate`, `chat`, `push`, `serve`, `store` |
| `evaluate` | `eval`, `inspect` |
| `bench`, `tune`, `demo` | `bench mapper / calibration / vllm`, `tune`, `demo` |
"""
