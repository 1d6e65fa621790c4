"""`SetPipeline`: pipelined `SET`s whose values are sent as the buffers they are made of, without joining them.

A saved chunk is a `ChunkPayload`: its header, then views into the K/V tensors (`format.encode_chunk_views`). The
`redis` client's own pipeline takes one `bytes` (or one buffer) per value, so a chunk would first be copied into one
payload: on a busy host that copy (and the fresh pages it fills) costs several times the send. This pipeline writes
the Redis protocol (RESP) of each `SET` itself and hands the header and the views to the client's connection
(one `sendmsg` for many parts on a plain socket; `send_packed_command`, a `sendall` each, on TLS), then reads one
reply per command: one round trip, as the client's pipeline, on the same connections, with the same timeouts and
errors.
"""

from __future__ import annotations

import socket
import ssl
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .format import ChunkPayload

CRLF = b"\r\n"

SMALL_PART = 16 << 10
"""Parts shorter than this (bytes) are joined with their neighbours before a `sendall` each (TLS sockets): one send
instead of many, for a copy of a few KB."""

SMALL_IOV = 512
"""Parts shorter than this (bytes) are joined with their neighbours before a `sendmsg` (the commands' own bytes, a
chunk's header, fp8 scales); longer ones (a short sub-chunk's 4 KB heads included) are sent where they are."""


def _bulk(arg: bytes) -> bytes:
    """One RESP bulk string: `$<length>\\r\\n<bytes>\\r\\n`."""
    return b"$%d\r\n%s\r\n" % (len(arg), arg)


def set_command(key: str, value: bytes | ChunkPayload, px: int | None = None) -> list:
    """The RESP of `SET key value [PX px]` as parts: the value's own parts (a `ChunkPayload`'s views) are not copied.

    Example:

    ```python
    >>> b"".join(set_command("k", b"ab", px=5))
    b'*5\\r\\n$3\\r\\nSET\\r\\n$1\\r\\nk\\r\\n$2\\r\\nab\\r\\n$2\\r\\nPX\\r\\n$1\\r\\n5\\r\\n'
    ```
    """
    parts = getattr(value, "parts", None) or (value,)  # a ChunkPayload's, or the one buffer
    size = len(value)
    head = b"*%d\r\n$3\r\nSET\r\n%s$%d\r\n" % (3 if px is None else 5, _bulk(key.encode()), size)
    tail = CRLF if px is None else CRLF + _bulk(b"PX") + _bulk(b"%d" % px)
    return [head, *parts, tail]


def _coalesced(parts: list, small_part: int) -> list:
    """`parts` (byte buffers) with runs of those shorter than `small_part` joined (one buffer instead of many)."""
    out: list = []
    small: list = []
    for part in parts:
        if memoryview(part).nbytes < small_part:
            small.append(part)
            continue
        if small:
            out.append(b"".join(small))
            small = []
        out.append(part)
    if small:
        out.append(b"".join(small))
    return out


IOV_BATCH = 512
"""Buffers handed to one `sendmsg` (Linux takes up to 1,024)."""


def send_parts(sock: socket.socket, parts: list) -> None:
    """Sends every byte of `parts` (byte buffers), in order, with `sendmsg` (scatter-gather: one system call for many
    buffers, where `sendall` takes one each; on loopback, 64 KB parts cost 1.6× the CPU time through `sendall`)."""
    parts = list(parts)
    sizes = [memoryview(part).nbytes for part in parts]
    at = 0
    while at < len(parts):
        sent = sock.sendmsg(parts[at : at + IOV_BATCH])
        while sent:  # past the buffers sent whole, into the one sent in part
            if sent >= sizes[at]:
                sent -= sizes[at]
                at += 1
            else:
                parts[at] = memoryview(parts[at]).cast("B")[sent:]
                sizes[at] -= sent
                sent = 0
        while at < len(parts) and not sizes[at]:
            at += 1


def _send(connection, parts: list) -> None:
    """`connection.send_packed_command(parts)`, with one `sendmsg` for many parts on a plain socket (TLS sockets, and
    clients without a socket of their own, send them one `sendall` each)."""
    if getattr(connection, "_sock", None) is None:
        connection.connect()
    sock = getattr(connection, "_sock", None)
    if not isinstance(sock, socket.socket) or isinstance(sock, ssl.SSLSocket) or not hasattr(sock, "sendmsg"):
        connection.send_packed_command(_coalesced(parts, SMALL_PART))
        return
    import redis

    try:
        send_parts(sock, _coalesced(parts, SMALL_IOV))
    except TimeoutError:  # socket.timeout: the socket's timeout, as the client's own send reports it
        raise redis.TimeoutError("Timeout writing to socket") from None
    except OSError as err:
        raise redis.ConnectionError(f"Error {err.errno} while writing to socket. {err.strerror}.") from err


def _connection(pool):
    """A connection of the client's pool (redis ≥ 5.3 takes no command name; 5.0–5.2 need one)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("SET")


class SetPipeline:
    """`SET`s sent together on one connection of a `redis.Redis` client and answered together (as
    `client.pipeline(transaction=False)`), values given as `bytes` or as a `ChunkPayload` whose parts are sent as they
    are.

    Args:
        client (`redis.Redis`): the client whose connection pool lends the connection.

    Example:

    ```python
    >>> pipe = SetPipeline(redis.Redis.from_url(url))  # doctest: +SKIP
    >>> payload = encode_chunk_views(keys, values, model_id=mid, start=0, token_ids=ids)  # doctest: +SKIP
    >>> pipe.set("key", payload, px=60_000)  # doctest: +SKIP
    >>> pipe.execute()  # doctest: +SKIP
    [True]
    ```
    """

    def __init__(self, client: Any):
        self.client = client
        self._parts: list = []  # byte buffers
        self._count = 0
        self.cpu_seconds = 0.0  # the thread CPU time of its `execute`s (sends and replies), summed

    def set(self, key: str, value: bytes | ChunkPayload, px: int | None = None) -> SetPipeline:
        """Queues `SET key value [PX px]`."""
        self._parts += set_command(key, value, px)
        self._count += 1
        return self

    def __len__(self) -> int:
        return self._count

    def execute(self) -> list[bool]:
        """Sends the queued commands and reads their replies; raises the first error reply (a `redis.ResponseError`)
        after reading them all, or the client's connection or timeout error (the connection is then dropped)."""
        if not self._count:
            return []
        began = time.thread_time()
        try:
            return self._execute()
        finally:
            self.cpu_seconds += time.thread_time() - began

    def _execute(self) -> list[bool]:
        parts, count = self._parts, self._count
        self._parts, self._count = [], 0
        pool = self.client.connection_pool
        connection = _connection(pool)
        replies: list[Any] = []
        try:
            _send(connection, parts)
            for _ in range(count):
                try:
                    replies.append(connection.read_response() in (b"OK", "OK", True))
                except self._response_error() as err:  # the rest of the replies are read before it is raised
                    replies.append(err)
        except BaseException:
            connection.disconnect()  # replies may be left unread on it
            raise
        finally:
            pool.release(connection)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return replies

    @staticmethod
    def _response_error() -> type[Exception]:
        import redis

        return redis.ResponseError
