"""Deadlines and node health for store calls: what keeps a dead or hung store server from stalling vLLM's scheduler.

A prefix lookup runs in vLLM's scheduler, between two engine steps. `within` runs a call on a worker thread and waits
for it at most `seconds`: a server that stopped answering (a hung process, a lost network) costs the caller that long
and no more, while the client's own socket timeout ends the abandoned call soon after. `NodeHealth` remembers, per
server, the last failure: for `cooldown_s` seconds after it, calls to that server are answered at once as failed,
without asking (a circuit breaker), so a burst of requests pays the deadline once per cool-down, not once each; the
first call after the cool-down asks again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

T = TypeVar("T")


class DeadlineExceeded(Exception):
    """A store call did not finish within its deadline (the call goes on, unobserved, until its socket timeout)."""


def within(pool: ThreadPoolExecutor, seconds: float, fn: Callable[[], T]) -> T:
    """`fn()` run on `pool`, waited for at most `seconds`; raises `DeadlineExceeded` past it (and what `fn` raises).

    Example:

    ```python
    >>> from concurrent.futures import ThreadPoolExecutor
    >>> within(ThreadPoolExecutor(1), 0.5, lambda: 42)
    42
    ```
    """
    future: Future = pool.submit(fn)
    try:
        return future.result(timeout=seconds)
    except FutureTimeout:
        future.cancel()  # not started yet (every worker busy with a hung server): never run it
        raise DeadlineExceeded(f"no answer within {seconds * 1000:.0f} ms") from None


class NodeHealth:
    """The servers (nodes) that failed within the last `cooldown_s` seconds.

    Example:

    ```python
    >>> health = NodeHealth(cooldown_s=1.0)
    >>> health.failed("127.0.0.1:7000"); health.is_down("127.0.0.1:7000"), health.is_down("127.0.0.1:7001")
    (True, False)
    ```
    """

    def __init__(self, cooldown_s: float = 1.0):
        self.cooldown_s = float(cooldown_s)
        self._failed_at: dict[str, float] = {}
        self._lock = threading.Lock()

    def failed(self, node: str) -> None:
        """Records a failure of `node` now."""
        with self._lock:
            self._failed_at[node] = time.monotonic()

    def succeeded(self, node: str) -> None:
        """Records that `node` answered: it is up."""
        with self._lock:
            self._failed_at.pop(node, None)

    def is_down(self, node: str) -> bool:
        """Whether `node` failed less than `cooldown_s` seconds ago (calls to it are then not made)."""
        with self._lock:
            failed_at = self._failed_at.get(node)
            if failed_at is None:
                return False
            if time.monotonic() - failed_at >= self.cooldown_s:
                del self._failed_at[node]  # cool-down over: the next call asks again
                return False
            return True

    def down(self) -> list[str]:
        """The nodes down now."""
        with self._lock:
            nodes = list(self._failed_at)
        return [node for node in nodes if self.is_down(node)]
