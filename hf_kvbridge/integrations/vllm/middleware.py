"""`KVBridgeParamsMiddleware`: the ASGI middleware `kvbridge serve` adds to vLLM's OpenAI server (`--middleware`). For
a POST to an endpoint that takes `kv_transfer_params`, once the server's own authentication would let it through:

- a `kv_transfer_params.kvbridge` that is not a boolean is answered with HTTP 400 before it reaches the engine
  (`parse_request_flag` decides; the connector applies the same rule where nothing can refuse: plain `vllm serve` or
  the offline `LLM` serve such a request unbridged, status `"refused"`);
- the semantic router's headers (vLLM semantic router, cross-model KV reuse) are read: `x-vsr-kv-mapper-id` equal to
  this server's mapper id (`kvbridge serve --mapper-id`, by default the bridge's Hub id or folder name) opts the
  request in, another id leaves it unbridged and its response says `x-vsr-kv-transfer-status: unsupported` (never a
  guess); `x-vsr-kv-cache-id` and `x-vsr-kv-source-pod` are recorded (in `kv_transfer_params.kvbridge_router`, so the
  connector puts them in the request's status and log line; lookups stay content-addressed). A mapper id that opts
  in with a body flag `false`, or another id with a body flag `true`, is answered 400 naming both;
- the response of a request the connector bridged (or refused) carries `x-vsr-kv-transfer-status` from the status
  in its body (`STATUS_HEADER_VALUES`: `mapped` → `applied`; `fallback`, `target`, `gated`, `refused` →
  `fallback_reprefill`); a response without one (not opted in, or a source engine's `exported`) carries none, which
  the router reads as unsupported. A streamed response's headers leave before the engine decides, and vLLM 0.32
  sends no `kv_transfer_params` in streamed chunks: a streamed response carries no transfer status (`unsupported`
  for another mapper id, which is known up front); the status is in the server's log line of the request.

Authentication first: vLLM 0.32 loads `--middleware a.b.Name` with `app.add_middleware(Name)`
(`vllm/entrypoints/serve/middleware/register.py`) after its own `AuthenticationMiddleware` (`--api-key`,
`VLLM_API_KEY`), so this one runs outside it. It therefore asks that same authentication object first (found in the
app it wraps): a request that fails it goes on untouched, and vLLM answers 401 before anything here reads the body.
If the server is known to require a key (`kvbridge serve` says so in `KVBRIDGE_SERVE_AUTH`) and the authentication
cannot be found, nothing here answers at all (the connector still refuses a bad flag).

It is pure ASGI: it reads the body, checks it, and hands the app the same body messages (re-encoded when router
headers added to it), then the client's own `receive` (so vLLM still sees a client that disconnects). It holds a
JSON response only until its last body message, to set the header; streamed responses pass through unchanged.

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
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from .configuration import FLAG_FIELD, PARAM_KEY, ROUTER_PARAM_KEY, parse_request_flag

logger = logging.getLogger("vllm.hf_kvbridge")  # under "vllm", so vLLM's handlers format and show it

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

MAPPER_ID_HEADER = "x-vsr-kv-mapper-id"
CACHE_ID_HEADER = "x-vsr-kv-cache-id"
SOURCE_POD_HEADER = "x-vsr-kv-source-pod"
STATUS_HEADER = "x-vsr-kv-transfer-status"
ROUTER_HEADERS = {MAPPER_ID_HEADER: "mapper_id", CACHE_ID_HEADER: "cache_id", SOURCE_POD_HEADER: "source_pod"}
MAX_HEADER_CHARS = 256

STATUS_HEADER_VALUES = {
    "mapped": "applied",  # the prompt's cache is the bridge's mapping of the source's
    "fallback": "fallback_reprefill",  # the mapping failed (source, mapper or store): the target prefilled
    "gated": "fallback_reprefill",  # the quality gate rejected the mapping: the target prefilled
    "target": "fallback_reprefill",  # nothing to map (too short, or the store held too little): the target prefilled
    "refused": "fallback_reprefill",  # the request's flag was refused (only where nothing answered 400)
    "unsupported": "unsupported",  # LoRA without a bridge of its own, prompt embeds, multi-modal (support.py)
}
"""The router's `x-vsr-kv-transfer-status` for each status of the connector; any other (a source engine's
`exported`) gets no header."""
UNSUPPORTED = "unsupported"

MAPPER_ID_ENV = "KVBRIDGE_MAPPER_ID"  # set by kvbridge serve: this server's mapper id
AUTH_ENV = "KVBRIDGE_SERVE_AUTH"  # set by kvbridge serve to "1" when the server requires an API key


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
    request = _json_object(body)
    params = request.get("kv_transfer_params") if request is not None else None
    if not isinstance(params, dict):  # absent, or not an object (which vLLM's own validation refuses)
        return None
    return parse_request_flag(params)[1]


def transfer_status_header(status: Any) -> str | None:
    """The `x-vsr-kv-transfer-status` value for a connector status (`None`: no header).

    Example:

    ```python
    >>> transfer_status_header("mapped"), transfer_status_header("gated"), transfer_status_header("exported")
    ('applied', 'fallback_reprefill', None)
    ```
    """
    return STATUS_HEADER_VALUES.get(status) if isinstance(status, str) else None


def default_mapper_id(bridge: str) -> str:
    """A bridge's mapper id for the router's `x-vsr-kv-mapper-id`: its Hub repo id as given (`org/name`), or the name
    of its local folder.

    Example:

    ```python
    >>> default_mapper_id("Qwen/qwen3-14b-32b-bridge"), default_mapper_id("/srv/bridges/qwen3-14b-32b-v1/")
    ('Qwen/qwen3-14b-32b-bridge', 'qwen3-14b-32b-v1')
    ```
    """
    from pathlib import Path

    path = Path(bridge).expanduser()
    if path.is_dir() or bridge.startswith((".", "/", "~")) or bridge.endswith("/"):
        return path.resolve().name
    return bridge


def _json_object(body: bytes) -> dict | None:
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return request if isinstance(request, dict) else None


def _find_authentication(app: Any) -> Any:
    """vLLM's `AuthenticationMiddleware` in the stack `app` starts (each middleware keeps the next one in `.app`),
    or `None`."""
    for _ in range(32):
        if app is None:
            return None
        if callable(getattr(app, "verify_token", None)) and hasattr(app, "api_tokens"):
            return app
        app = getattr(app, "app", None)
    return None


class KVBridgeParamsMiddleware:
    """Pure ASGI middleware: authentication first (vLLM's own), then HTTP 400 (OpenAI error body, `param` naming the
    field) for a non-boolean `kv_transfer_params.kvbridge` or a router header that contradicts the body, the router's
    headers turned into the body's opt-in, and `x-vsr-kv-transfer-status` on the response; every other request goes
    to `app` unchanged. See the module's docstring.

    Args:
        app: the ASGI app it wraps (vLLM passes it).
        max_body_bytes (`int`, *optional*, defaults to `8 MiB`): the most body bytes it holds to check. A longer body
            is passed on unchecked (what was read is replayed first): the connector still refuses its flag, and the
            request is served unbridged with status `"refused"`.
        mapper_id (`str`, *optional*): this server's mapper id (default: `KVBRIDGE_MAPPER_ID`, which `kvbridge serve`
            sets; without one, every `x-vsr-kv-mapper-id` is another mapper's).

    Example (what `kvbridge serve` does):

    ```text
    vllm serve TARGET --kv-transfer-config '...' --middleware hf_kvbridge.integrations.vllm.middleware.KVBridgeParamsMiddleware
    ```
    """  # noqa: E501 (a command line)

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        max_body_bytes: int = 8 << 20,
        mapper_id: str | None = None,
    ):
        self.app, self.max_body_bytes = app, int(max_body_bytes)
        self.mapper_id = mapper_id if mapper_id is not None else os.environ.get(MAPPER_ID_ENV) or None
        self._auth: Any = None
        self._auth_resolved = False
        if self.mapper_id is not None:  # built when the server starts
            logger.info(
                "KVBridgeParamsMiddleware: mapper id %r (requests with %s: %s opt in; another id is answered %s)",
                self.mapper_id, MAPPER_ID_HEADER, self.mapper_id, UNSUPPORTED,
            )  # fmt: skip

    def _authentication(self) -> tuple[Any, bool]:
        """`(vLLM's authentication, usable)`: usable is `False` when the server requires a key and it was not
        found (then nothing here answers)."""
        if not self._auth_resolved:
            self._auth, self._auth_resolved = _find_authentication(self.app), True
            if self._auth is None and os.environ.get(AUTH_ENV) == "1":
                logger.warning(
                    "KVBridgeParamsMiddleware: the server requires an API key but its authentication middleware was "
                    "not found; malformed kv_transfer_params flags are refused by the connector (status refused) "
                    "instead of a 400, so that nothing answers before authentication"
                )
        return self._auth, self._auth is not None or os.environ.get(AUTH_ENV) != "1"

    def _authenticated(self, scope: Scope) -> bool:
        auth, usable = self._authentication()
        if not usable:
            return False
        if auth is None:
            return True
        from starlette.datastructures import Headers

        return bool(auth.verify_token(Headers(scope=scope)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in GUARDED_PATHS:
            await self.app(scope, receive, send)
            return
        if not self._authenticated(scope):  # the server's own authentication answers (401), before any check here
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
        headers = _router_headers(scope)
        unsupported = False
        if last["type"] == "http.request" and not last.get("more_body", False):
            body = b"".join(m.get("body", b"") for m in messages)
            reason = body_refusal(body)
            if reason is not None:
                await _bad_request(send, reason, FLAG_FIELD)
                return
            if headers:
                try:
                    body, unsupported = self._route(body, headers)
                except _Refused as refused:
                    await _bad_request(send, str(refused), refused.param)
                    return
                messages = [{"type": "http.request", "body": body, "more_body": False}]
                scope = _with_content_length(scope, len(body))
        await self.app(scope, _replay(messages, receive), _status_sender(send, unsupported))

    def _route(self, body: bytes, headers: dict[str, str]) -> tuple[bytes, bool]:
        """The body with the router's headers applied (opt-in and what to record), and whether the request names
        another mapper (`unsupported`). Raises `_Refused` for a header that contradicts the body."""
        for name, value in headers.items():
            if len(value) > MAX_HEADER_CHARS or not value.isprintable():
                raise _Refused(f"{name} must be printable and at most {MAX_HEADER_CHARS} characters", name)
        request = _json_object(body)
        if request is None:  # not a JSON object: vLLM's own 400
            return body, False
        params = request.get("kv_transfer_params")
        if params is None:
            params = {}
        if not isinstance(params, dict):  # vLLM's own validation refuses it
            return body, False
        flag = params.get(PARAM_KEY)
        mapper = headers.get(MAPPER_ID_HEADER)
        params = dict(params)
        unsupported = False
        if mapper is not None:
            ours = self.mapper_id is not None and mapper == self.mapper_id
            if flag is not None and flag != ours:
                wanted = f"this server's mapper id ({self.mapper_id!r})" if ours else (
                    f"another mapper than this server's ({self.mapper_id!r})"
                )  # fmt: skip
                raise _Refused(
                    f"{MAPPER_ID_HEADER} is {mapper!r}, {wanted}, but {FLAG_FIELD} is {json.dumps(flag)}: the header "
                    f"and the body disagree; send one of them, or both alike",
                    f"{MAPPER_ID_HEADER}, {FLAG_FIELD}",
                )
            params[PARAM_KEY] = ours
            unsupported = not ours
        if params.get(PARAM_KEY) is True or mapper is not None:
            params[ROUTER_PARAM_KEY] = {ROUTER_HEADERS[name]: value for name, value in headers.items()}
        request["kv_transfer_params"] = params
        return json.dumps(request).encode(), unsupported


class _Refused(Exception):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _router_headers(scope: Scope) -> dict[str, str]:
    """The router's `x-vsr-kv-*` request headers (the first of each), decoded."""
    found: dict[str, str] = {}
    for raw_name, raw_value in scope.get("headers") or []:
        name = raw_name.decode("latin-1").lower()
        if name in ROUTER_HEADERS and name not in found:
            found[name] = raw_value.decode("latin-1").strip()
    return found


def _with_content_length(scope: Scope, length: int) -> Scope:
    headers = [(k, v) for k, v in scope.get("headers") or [] if k.lower() != b"content-length"]
    return {**scope, "headers": [*headers, (b"content-length", str(length).encode())]}


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = deque(messages)

    async def replayed() -> Message:
        return pending.popleft() if pending else await receive()

    return replayed


def _status_sender(send: Send, unsupported: bool) -> Send:
    """`send`, adding `x-vsr-kv-transfer-status` to the response: `unsupported` at once for another mapper id; else,
    for a JSON response, the header its body's `kv_transfer_params.kvbridge.status` maps to (the response is held until
    its last body message). Anything else (a stream) passes through unchanged."""
    held: list[Message] = []

    async def sender(message: Message) -> None:
        if message["type"] == "http.response.start":
            if unsupported:
                await send(_with_header(message, UNSUPPORTED))
                return
            content_type = dict(message.get("headers") or []).get(b"content-type", b"")
            if content_type.startswith(b"application/json"):
                held.append(message)
                return
            await send(message)
            return
        if not held:
            await send(message)
            return
        held.append(message)
        if message["type"] == "http.response.body" and message.get("more_body", False):
            return
        start, body_messages = held[0], held[1:]
        held.clear()
        body = b"".join(m.get("body", b"") for m in body_messages)
        value = transfer_status_header(_status_of(body))
        await send(start if value is None else _with_header(start, value))
        for m in body_messages:
            await send(m)

    return sender


def _status_of(body: bytes) -> Any:
    response = _json_object(body)
    params = response.get("kv_transfer_params") if response is not None else None
    status = params.get(PARAM_KEY) if isinstance(params, dict) else None
    return status.get("status") if isinstance(status, dict) else None


def _with_header(start: Message, value: str) -> Message:
    headers = [(k, v) for k, v in start.get("headers") or [] if k.lower() != STATUS_HEADER.encode()]
    return {**start, "headers": [*headers, (STATUS_HEADER.encode(), value.encode())]}


async def _bad_request(send: Send, reason: str, param: str) -> None:
    error = {"message": reason, "type": "BadRequestError", "param": param, "code": 400}
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})
