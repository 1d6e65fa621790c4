"""`start_local_server`: a Redis or Valkey server on 127.0.0.1 for single-host setups and the tests;
`start_local_cluster`: a cluster of them (its masters on one host), for the tests and for trying a cluster's store.

It runs the installed `redis-server` (Debian: `apt-get install redis-server`) or `valkey-server` with no persistence
(`save ""`, `appendonly no`: the store is a cache, rebuilt by the engines), a `maxmemory` limit and the
`allkeys-lru` policy (full means: evict the least recently used chunks), listening on loopback only, optionally over
TLS only. The settings go through a config file in a private temporary folder, so a password never shows in the
process list.
"""

from __future__ import annotations

import contextlib
import logging
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from urllib.parse import quote

from ...errors import InvalidInputError, MissingDependencyError, StoreUnavailableError
from .redis_store import _redis_module

logger = logging.getLogger(__name__)

SERVER_BINARIES = ("redis-server", "valkey-server")
"""The servers looked for on PATH, in this order."""

START_TIMEOUT_S = 15.0
"""Seconds a started server has to answer PING."""

_SIZE = re.compile(r"^\d+(?:[kmg]b?|b)?$", re.IGNORECASE)


def check_memory_size(value: str) -> str:
    """A `maxmemory` value the server takes (`1gb`, `512mb`, `100000`); raises `InvalidInputError` otherwise."""
    if not isinstance(value, str) or not _SIZE.match(value.strip()):
        raise InvalidInputError(f"maxmemory must be a size such as 512mb, 4gb or a number of bytes, got {value!r}")
    return value.strip().lower()


def find_server_binary(binary: str | None = None) -> str:
    """The path of `binary`, or of the first of `SERVER_BINARIES` on PATH; `MissingDependencyError` if none."""
    if binary is not None:
        found = shutil.which(binary)
        if found is None:
            raise MissingDependencyError(f"KV store server {binary!r} not found (not on PATH, or not executable)")
        return found
    for name in SERVER_BINARIES:
        found = shutil.which(name)
        if found is not None:
            return found
    raise MissingDependencyError(
        "no redis-server or valkey-server on PATH: install Debian's redis-server (apt-get install redis-server) "
        "or Valkey (apt-get install valkey-server)"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _quote(value: str) -> str:
    """A value in the server's config syntax: double-quoted, backslashes and quotes escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _parent_death_signal():
    """On Linux, a function for the child to run before exec so the server gets SIGTERM when its parent thread ends
    (`prctl(PR_SET_PDEATHSIG)`), even a parent killed with SIGKILL; `None` elsewhere. libc is loaded here, in the
    parent: the child runs only the call, nothing that could wait on a lock another thread held at the fork."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # the finalizer still stops the server at a normal exit
        return None
    pr_set_pdeathsig, sigterm = 1, int(signal.SIGTERM)
    return lambda: prctl(pr_set_pdeathsig, sigterm)


def _stop_process(process: subprocess.Popen, folder: str) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
    shutil.rmtree(folder, ignore_errors=True)


class LocalServer:
    """A running local Redis/Valkey server (made by `start_local_server`); a context manager that stops it.

    Attributes:
        url (`str`): `redis://[:password@]127.0.0.1:PORT/0` (`rediss://` over TLS), for `open_store`.
        port (`int`), binary (`str`), pid (`int`), password (`str` or `None`), tls (`bool`).
    """

    def __init__(
        self, process: subprocess.Popen, folder: str, port: int, binary: str, password: str | None, tls: bool = False
    ):
        self._process = process
        self._folder = folder
        self.port = port
        self.binary = binary
        self.password = password
        self.tls = tls
        self.pid = process.pid
        auth = f":{quote(password, safe='')}@" if password else ""  # the client unquotes it
        self.url = f"{'rediss' if tls else 'redis'}://{auth}127.0.0.1:{port}/0"
        self._finalizer = weakref.finalize(self, _stop_process, process, folder)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"LocalServer({Path(self.binary).name} on 127.0.0.1:{self.port}, {state})"

    @property
    def running(self) -> bool:
        return self._process.poll() is None

    def log(self) -> str:
        """The server's log so far."""
        with contextlib.suppress(OSError):
            return (Path(self._folder) / "server.log").read_text(errors="replace")
        return ""

    def wait(self) -> int:
        """Blocks until the server exits; returns its exit status."""
        return self._process.wait()

    def stop(self) -> None:
        """Stops the server (idempotent); its data is gone."""
        self._finalizer()

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _write_config(
    folder: str,
    port: int,
    maxmemory: str,
    password: str | None,
    tls: tuple[str, str] | None = None,
    extra_config: list[str] = (),
) -> Path:
    listen = [f"port {port}"] if tls is None else [
        "port 0", f"tls-port {port}", f"tls-cert-file {_quote(tls[0])}", f"tls-key-file {_quote(tls[1])}",
        "tls-auth-clients no",  # the server proves who it is; clients authenticate with a password or ACL user
    ]  # fmt: skip
    lines = [
        "bind 127.0.0.1",
        *listen,
        "protected-mode yes",
        'save ""',
        "appendonly no",
        f"dir {_quote(folder)}",
        f"logfile {_quote(str(Path(folder) / 'server.log'))}",
        "daemonize no",
        f"maxmemory {maxmemory}",
        "maxmemory-policy allkeys-lru",
    ]
    if password:
        lines.append(f"requirepass {_quote(password)}")
    lines.extend(extra_config)
    path = Path(folder) / "server.conf"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return path


def _wait_until_ready(server: LocalServer, timeout: float) -> None:
    redis = _redis_module()

    tls = {"ssl": True, "ssl_cert_reqs": "none"} if server.tls else {}
    client = redis.Redis(host="127.0.0.1", port=server.port, password=server.password, socket_timeout=1.0,
                         socket_connect_timeout=1.0, **tls)  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while True:
            if not server.running:
                raise StoreUnavailableError(
                    f"{server.binary} exited at start-up (status {server._process.returncode}): "
                    + " / ".join(server.log().strip().splitlines()[-3:])
                )
            try:
                if client.ping():
                    return
            except (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError):
                return  # it answered (its users are configured with extra_config)
            except redis.exceptions.RedisError:
                pass
            if time.monotonic() > deadline:
                raise StoreUnavailableError(
                    f"{server.binary} on 127.0.0.1:{server.port} did not answer PING within {timeout:.0f} s: "
                    + " / ".join(server.log().strip().splitlines()[-3:])
                )
            time.sleep(0.05)
    finally:
        client.close()


def start_local_server(
    *,
    port: int | None = None,
    maxmemory: str = "1gb",
    password: str | None = None,
    binary: str | None = None,
    tls: tuple[str, str] | None = None,
    extra_config: list[str] | None = None,
) -> LocalServer:
    """Starts a Redis/Valkey server on 127.0.0.1 and waits until it answers.

    Args:
        port (`int`, *optional*): the port; default: a free one.
        maxmemory (`str`, *optional*, defaults to `"1gb"`): the server's memory limit; past it, it evicts the least
            recently used keys (`allkeys-lru`).
        password (`str`, *optional*): require this password (`requirepass`); it is in the returned `url`.
        binary (`str`, *optional*): the server program; default: `redis-server`, else `valkey-server`, on PATH.
        tls (`(cert_file, key_file)`, *optional*): serve TLS only, with this certificate and private key (PEM; the
            certificate's subjectAltName must name 127.0.0.1 for clients that verify it); `.url` is then `rediss://`.
        extra_config (list of `str`, *optional*): more lines of server configuration (e.g. ACL users:
            `"user alice on >secret ~kvbridge:* +@all"`).

    Returns:
        `LocalServer`: with `.url`; stop it with `.stop()` or a `with` block. It is also stopped at interpreter
        exit and, on Linux, when the thread that started it ends (start it from a thread that lives as long as its
        users, e.g. the main thread).

    Example:

    ```python
    >>> with start_local_server(maxmemory="256mb") as server:  # doctest: +SKIP
    ...     store = open_store(server.url)
    ```
    """
    program = find_server_binary(binary)
    maxmemory = check_memory_size(maxmemory)
    if port is not None and not (isinstance(port, int) and 0 < port < 65536):
        raise InvalidInputError(f"port must be a TCP port number in [1, 65535], got {port!r}")
    attempts_left = 1 if port is not None else 3  # a free port can be taken between the probe and the bind
    while True:
        attempts_left -= 1
        chosen = port if port is not None else free_port()
        folder = tempfile.mkdtemp(prefix="kvbridge-store-")
        config = _write_config(folder, chosen, maxmemory, password, tls, list(extra_config or []))
        process = subprocess.Popen(
            [program, str(config)],
            cwd=folder,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, not the server; we stop it
            preexec_fn=_parent_death_signal(),
        )
        server = LocalServer(process, folder, chosen, program, password, tls is not None)
        try:
            _wait_until_ready(server, START_TIMEOUT_S)
        except StoreUnavailableError:
            log = server.log()
            server.stop()
            if attempts_left > 0 and "Address already in use" in log:
                continue
            raise
        logger.info("started %s (pid %d) on 127.0.0.1:%d, maxmemory %s", program, server.pid, chosen, maxmemory)
        return server


class LocalCluster:
    """A running local Redis/Valkey cluster (made by `start_local_cluster`); a context manager that stops it.

    Attributes:
        url (`str`): `redis-cluster://[:password@]127.0.0.1:PORT,...` naming every master, for `open_store`.
        masters (list of `LocalServer`): its servers (each one can be stopped, or signalled by its `pid`).
    """

    def __init__(self, masters: list[LocalServer], password: str | None):
        self.masters = masters
        self.password = password
        auth = f":{quote(password, safe='')}@" if password else ""
        self.url = f"redis-cluster://{auth}" + ",".join(f"127.0.0.1:{m.port}" for m in masters)

    def __repr__(self) -> str:
        return f"LocalCluster({len(self.masters)} masters on {', '.join(str(m.port) for m in self.masters)})"

    def stop(self) -> None:
        """Stops every server (idempotent)."""
        for master in self.masters:
            master.stop()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    for _ in range(50):
        port = free_port()
        if port + 10000 < 65536:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise StoreUnavailableError("no free pair of ports (PORT, PORT + 10000) for a cluster node on 127.0.0.1")


def start_local_cluster(
    masters: int = 3,
    *,
    maxmemory: str = "256mb",
    node_timeout_ms: int = 1000,
    password: str | None = None,
    binary: str | None = None,
) -> LocalCluster:
    """Starts a Redis/Valkey cluster of `masters` masters (no replicas) on 127.0.0.1 and waits until it serves.

    Each master is a `start_local_server` with `cluster-enabled yes`, `cluster-require-full-coverage no` (the others
    keep serving their slots when one master is gone), `cluster-allow-reads-when-down yes` (a master cut off from the
    majority of masters refuses writes but still serves its chunks: they are content-addressed, a read cannot be
    stale) and `cluster-node-timeout node_timeout_ms`; the slots are split between them by `redis-cli --cluster
    create` (or `valkey-cli`).

    Example:

    ```python
    >>> with start_local_cluster(3) as cluster:  # doctest: +SKIP
    ...     store = open_store(cluster.url)
    ```
    """
    if isinstance(masters, bool) or not isinstance(masters, int) or masters < 3:
        raise InvalidInputError(f"a Redis cluster needs at least 3 masters, got {masters!r}")
    program = find_server_binary(binary)
    cli = shutil.which(str(Path(program).with_name(Path(program).name.replace("-server", "-cli"))))
    cli = cli or shutil.which("redis-cli") or shutil.which("valkey-cli")
    if cli is None:
        raise MissingDependencyError("a cluster is created with redis-cli (or valkey-cli), which is not on PATH")
    config = ["cluster-enabled yes", "cluster-config-file nodes.conf", f"cluster-node-timeout {int(node_timeout_ms)}",
              "cluster-require-full-coverage no", "cluster-allow-reads-when-down yes"]  # fmt: skip
    if password:
        config.append(f"masterauth {_quote(password)}")
    servers: list[LocalServer] = []
    try:
        for _ in range(masters):
            servers.append(start_local_server(port=_free_cluster_port(), maxmemory=maxmemory, password=password,
                                              binary=program, extra_config=config))  # fmt: skip
        auth = ["-a", password, "--no-auth-warning"] if password else []
        created = subprocess.run(
            [cli, *auth, "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in servers), "--cluster-replicas", "0",
             "--cluster-yes"],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        if created.returncode != 0:
            raise StoreUnavailableError(f"{Path(cli).name} --cluster create failed: {created.stdout[-500:]}")
        redis = _redis_module()
        deadline = time.monotonic() + START_TIMEOUT_S
        for server in servers:  # every master must see the whole cluster before it serves
            client = redis.Redis(host="127.0.0.1", port=server.port, password=password, socket_timeout=1.0)
            try:
                while client.execute_command("CLUSTER INFO").get("cluster_state") != "ok":  # a dict in redis-py
                    if time.monotonic() > deadline:
                        raise StoreUnavailableError(
                            f"the cluster on 127.0.0.1 did not reach state ok within {START_TIMEOUT_S:.0f} s"
                        )
                    time.sleep(0.1)
            finally:
                client.close()
    except BaseException:
        for server in servers:
            server.stop()
        raise
    cluster = LocalCluster(servers, password)
    logger.info("started a cluster of %d masters on 127.0.0.1 (%s)", masters, ", ".join(str(s.port) for s in servers))
    return cluster
