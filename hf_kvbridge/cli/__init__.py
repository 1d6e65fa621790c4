"""The `kvbridge` command functions: each runs one command line that `kvbridge_cli` parsed and checked, handing plain
arguments to the tools and the core; `main.run(args)` dispatches them.

| module | commands |
|---|---|
| `main` | `run`: the dispatch, one-line errors, Ctrl-C |
| `bridge` | `calibrate`, `generate`, `chat`, `push`, `serve`, `store` |
| `evaluate` | `eval`, `inspect` |
| `bench`, `tune`, `demo` | `bench mapper / calibration / vllm`, `tune`, `demo` |
"""


def keywords(args, *names: str) -> dict:
    """The options `names` of a parsed command line as keyword arguments (`revision=args.revision, ...`).

    Example:

    ```python
    >>> import argparse
    >>> keywords(argparse.Namespace(seed=0, top_k=2, out="x"), "seed", "top_k")
    {'seed': 0, 'top_k': 2}
    ```
    """
    return {name: getattr(args, name) for name in names}


def model_load_kwargs(args) -> dict:
    """`from_pretrained`'s keywords for a command's models from its `--dtype` (`auto` or none: the checkpoint's own)
    and `--device-map`, where the command has it.

    Example:

    ```python
    >>> import argparse
    >>> model_load_kwargs(argparse.Namespace(dtype="float32", device_map=None))
    {'dtype': 'float32'}
    ```
    """
    load_kwargs = {}
    if args.dtype and args.dtype != "auto":
        load_kwargs["dtype"] = args.dtype
    if getattr(args, "device_map", None):
        load_kwargs["device_map"] = args.device_map
    return load_kwargs
