"""A cascade on one host: a KV store, the source engine and the target engine, and a conversation that switches from
the source to the target mid-way, through the OpenAI client with token-id prompts.

```bash
python scripts/cascade_conversation.py BRIDGE_DIR [--turns 4 --switch-at 2 --port 8701]
```

Starts `kvbridge store serve`'s server (a local redis-server), `kvbridge serve BRIDGE --role source` (the bridge's
source, exporting its requests' KV) and `kvbridge serve BRIDGE --role target --no-source-weights` (the bridge's target,
mapping from the store, no source weights in its worker), all on 127.0.0.1; sends the conversation's turns as
completions with `prompt` = the token ids of the conversation so far (so the store's chained chunk keys match the
ids the source generated; the chat API would re-tokenise replies) and prints, per turn, which engine answered and
where the target's cache came from (`kv_transfer_params["kvbridge"]`). Stops everything at the end. CPU settings
(float32, block size 32, a small KV cache); a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the engine on port {port} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(2)
    raise SystemExit(f"the engine on port {port} did not start within {timeout:.0f} s")


def engine(bridge: str, role: str, port: int, store: str, chunk: int, log: Path, *extra: str) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "kvbridge_cli", "serve", bridge, "--role", role, "--store", store,
        "--chunk-size", str(chunk), *extra,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--block-size", "32",
        "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20), "--enforce-eager",
    ]  # fmt: skip
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bridge", help="a bridge checkpoint folder (e.g. from `kvbridge calibrate`)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--switch-at", type=int, default=2, help="the first turn the target answers")
    parser.add_argument("--port", type=int, default=8701, help="the source's port; the target's is the next")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--chunk-size", type=int, default=64, help="the store's chunk (the same on both engines)")
    parser.add_argument("--context-tokens", type=int, default=600, help="a document the first turn asks about")
    args = parser.parse_args(argv)

    from openai import OpenAI
    from transformers import AutoTokenizer

    from hf_kvbridge import pocket
    from hf_kvbridge.integrations.kv_store import start_local_server
    from hf_kvbridge.integrations.vllm import served_model

    tokenizer = AutoTokenizer.from_pretrained(served_model(args.bridge, "target"))
    document = tokenizer.decode(tokenizer(pocket.load_texts("heldout")[0])["input_ids"][: args.context_tokens])
    users = [
        f"{document}\n\nWhat does this text explain?",
        "And a tuple?",
        "Which of the two can be a dictionary key, and why?",
        "Summarise the difference in one sentence.",
    ]
    logs = Path("cascade-logs")
    logs.mkdir(exist_ok=True)
    with start_local_server(maxmemory="1gb") as store:
        procs = {
            "source": engine(args.bridge, "source", args.port, store.url, args.chunk_size, logs / "source.log"),
            "target": engine(
                args.bridge,
                "target",
                args.port + 1,
                store.url,
                args.chunk_size,
                logs / "target.log",
                "--no-source-weights",
            ),
        }
        try:
            for name, port in (("source", args.port), ("target", args.port + 1)):
                wait_ready(port, procs[name])
            clients = {
                "source": OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="-"),
                "target": OpenAI(base_url=f"http://127.0.0.1:{args.port + 1}/v1", api_key="-"),
            }
            models = {"source": served_model(args.bridge, "source"), "target": served_model(args.bridge, "target")}
            history: list[int] = []
            for turn in range(args.turns):
                name = "target" if turn >= args.switch_at else "source"
                user = users[turn % len(users)]
                history = history + tokenizer(f"\nuser: {user}\nassistant:", add_special_tokens=False)["input_ids"]
                reply = clients[name].completions.create(
                    model=models[name], prompt=history, max_tokens=args.max_tokens, temperature=0,
                    extra_body={"kv_transfer_params": {"kvbridge": True}, "return_token_ids": True},
                )  # fmt: skip
                choice = reply.choices[0]
                token_ids = (
                    getattr(choice, "token_ids", None) or tokenizer(choice.text, add_special_tokens=False)["input_ids"]
                )
                history = history + list(token_ids)
                status = (getattr(reply, "kv_transfer_params", None) or {}).get("kvbridge")
                print(f"turn {turn + 1} [{name}] {len(history)} tokens so far: {choice.text.strip()[:70]!r}")
                print(f"    kvbridge: {json.dumps(status)}")
        finally:
            for proc in procs.values():
                proc.terminate()
            for proc in procs.values():
                proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
