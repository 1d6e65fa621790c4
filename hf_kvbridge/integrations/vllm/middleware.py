"""`KVBridgeParamsMiddleware`: the ASGI middleware `kvbridge serve` adds to vLLM's OpenAI server (`--middleware`), so
that a request whose `kv_transfer_params.kvbridge` is not a boolean is answered with HTTP 400 before it reaches the
engine (`parse_request_flag` decides; the connector applies the same rule where nothing can refuse: plain
`vllm serve` or the offline `LLM` serve such a request unbridged, status `"refused"`).

vLLM 0.32 loads `--middleware a.b.Name` with `app.add_middleware(Name)` (`vllm/entrypoints/serve/middleware/
register.py`), after its own middleware, so this one runs outermost of them (before `--api-key` authentication: a
refused flag is answered 400 even without a key, which tells nothing about the server). It is pure ASGI: it reads the
body of a POST to an endpoint that takes `kv_transfer_params`, checks it, and hands the app the same body messages,
then the client's own `receive` (so vLLM still sees a client that disconnects). It never touches the response, so
streaming responses pass through unchanged.

```text
kvbridge serve DIR   # adds --middleware hf_kvbridge.integrations.vllm.middleware.KVBridgeParamsMiddleware
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "TARGET", "prompt": "hi", "kv_transfer_params": {"kvbridge": "yes"}}'
{"error": {"message": "kv_transfer_params.kvbridge must be a boolean (JSON true / false) or absent, not 'yes' (str)",
 "type": "BadRequestError", "param": "kv_transfer_params.kvbridge", "code": 400}}
```
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from .configuration import FLAG_FIELD, parse_request_flag

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# vLLM 0.32's POST endpoints whose request body has a top-level `kv_transfer_params` (the OpenAI completions, chat,
# batch chat and responses APIs, Anthropic messages, Cohere chat, token-in-token-out generate).
GUARDED_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/chat/completions/batch",
        "/v1/responses",
        "/v1/messages",
        "/cohere/v2/chat",
        "/inference/v1/generate",
    }
)
MIDDLEWARE_PATH = "hf_kvbridge.integrations.vllm.middleware.KVBridgeParamsMiddleware"  # what --middleware takes


def body_refusal(body: bytes) -> str | None:
    """Why a request body's `kv_transfer_params.kvbridge` is refused, or `None` when it is fine or cannot be read
    (a body that is not a JSON object is vLLM's to reject, with its own 400).

    Example:

    ```python
    >>> body_refusal(b'{"prompt": "hi", "kv_transfer_params": {"kvbridge": true}}') is None
    True
    >>> body_refusal(b'{"prompt": "hi", "kv_transfer_params": {"kvbridge": 1}}')
    'kv_transfer_params.kvbridge must be a boolean (JSON true / false) or absent, not 1 (int)'
    ```
    """
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    params = request.get("kv_transfer_params") if isinstance(request, dict) else None
    if not isinstance(params, dict):  # absent, or not an object (which vLLM's own validation refuses)
        return None
    return parse_request_flag(params)[1]


class KVBridgeParamsMiddleware:
    """Pure ASGI middleware: HTTP 400 (OpenAI error body, `param` = `"kv_transfer_params.kvbridge"`) for a request
    whose `kv_transfer_params.kvbridge` is neither `true`, `false` nor absent; every other request goes to `app`
    unchanged.

    Args:
        app: the ASGI app it wraps (vLLM passes it).
        max_body_bytes (`int`, *optional*, defaults to `8 MiB`): the most body bytes it holds to check. A longer body
            is passed on unchecked (what was read is replayed first): the connector still refuses its flag, and the
            request is served unbridged with status `"refused"`.

    Example (what `kvbridge serve` does):

    ```text
    vllm serve TARGET --kv-transfer-config '...' --middleware hf_kvbridge.integrations.vllm.middleware.KVBridgeParamsMiddleware
    ```
    """  # noqa: E501 (a command line)

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_body_bytes: int = 8 << 20):
        self.app, self.max_body_bytes = app, int(max_body_bytes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in GUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []  # the body as received, to replay
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away: let the app see it
                break
            size += len(message.get("body", b""))
            if not message.get("more_body", False) or size > self.max_body_bytes:
                break
        last = messages[-1]
        if last["type"] == "http.request" and not last.get("more_body", False):
            reason = body_refusal(b"".join(m.get("body", b"") for m in messages))
            if reason is not None:
                await _bad_request(send, reason)
                return
        await self.app(scope, _replay(messages, receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = deque(messages)

    async def replayed() -> Message:
        return pending.popleft() if pending else await receive()

    return replayed


async def _bad_request(send: Send, reason: str) -> None:
    error = {"message": reason, "type": "BadRequestError", "param": FLAG_FIELD, "code": 400}
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
