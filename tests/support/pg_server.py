"""A real PostgreSQL server for the tests: Debian's ``postgresql`` package, started with pg_ctl.

A test session that asks for ``postgres_url`` initialises a cluster in a
temporary directory (initdb, trust authentication, no fsync), starts it with
``pg_ctl start -w`` on a free port of the loopback interface and stops it at
the end. ``INTURN_POSTGRES_URL`` points the tests at an existing server instead.

PostgreSQL refuses to run as root; run as root (as in CI), initdb and pg_ctl
run as the ``postgres`` user (which Debian's package creates) through
``subprocess``'s ``user=``/``group=``, and the temporary directory is given
to that user. pytest-postgresql was tried first: its ``postgresql_proc``
runs pg_ctl as the current user (refused as root), and with pg_ctl wrapped
in ``runuser -u postgres`` its initdb cannot write into pytest's temporary
directory (``/tmp/pytest-of-root`` is mode 0700).

:class:`PostgresServer` can also be made by a test of its own, with short
``idle_session_timeout`` or TCP keepalive settings (``settings=``), and be
stopped (``mode="immediate"``: a crash) and started again on the same port.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from .helpers import unavailable
from .servers import free_port

#: Where Debian's postgresql packages put their programs, newest first.
_DEBIAN = Path("/usr/lib/postgresql")

#: Settings for a throwaway test server: no durability, and room for many sessions.
DEFAULT_SETTINGS: Mapping[str, str] = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
    # a test's lock graph may wait for long; the default 1 s check costs nothing here
    "deadlock_timeout": "1s",
}


def postgres_bindir() -> Path | None:
    """The directory of initdb and pg_ctl: from PATH, else Debian's newest version."""
    if initdb := shutil.which("initdb"):
        return Path(initdb).parent
    if _DEBIAN.is_dir():
        versions = sorted(
            (p for p in _DEBIAN.iterdir() if (p / "bin" / "initdb").exists()),
            key=lambda p: int(p.name) if p.name.isdigit() else 0,
        )
        if versions:
            return versions[-1] / "bin"
    return None


def run_as() -> dict[str, object]:
    """subprocess arguments that run PostgreSQL's programs as a user they accept."""
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("PostgreSQL refuses root, and there is no 'postgres' user") from None
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


class PostgresServer:
    """One PostgreSQL cluster in a temporary directory, on a fixed loopback port.

    ``settings`` are passed to the server as ``-c name=value`` on top of
    :data:`DEFAULT_SETTINGS` (say ``{"idle_session_timeout": "2s",
    "tcp_keepalives_idle": "1"}``); :meth:`start` may be called again after
    :meth:`stop` and keeps the port.
    """

    def __init__(self, bindir: Path, settings: Mapping[str, str] | None = None) -> None:
        self.bindir = bindir
        self.settings = {**DEFAULT_SETTINGS, **(settings or {})}
        self.port = free_port()
        self.directory = Path(tempfile.mkdtemp(prefix="inturn-pg-"))
        self.as_user = run_as()
        if self.as_user:
            os.chown(self.directory, self.as_user["user"], self.as_user["group"])  # type: ignore[arg-type]
        self.data = self.directory / "data"
        self.log = self.directory / "server.log"
        self.initialised = False
        self.startup = 0.0  # seconds the last start() took, initdb included

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        result = subprocess.run(
            args,
            cwd=self.directory,  # (a root's cwd may be unreadable to the postgres user)
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"},
            **self.as_user,  # type: ignore[arg-type]
        )
        if result.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{args[0]} failed: {result.stderr.strip()}\n{log}")

    def start(self) -> PostgresServer:
        began = time.monotonic()
        if not self.initialised:
            self._run(
                str(self.bindir / "initdb"),
                "--pgdata",
                str(self.data),
                "--username",
                "postgres",
                "--auth",
                "trust",
                "--no-sync",
                "--encoding",
                "UTF8",
                "--locale",
                "C.UTF-8",
            )
            self.initialised = True
        options = " ".join(
            ["-p", str(self.port), "-k", str(self.directory)]
            + [f"-c {name}={value}" for name, value in self.settings.items()]
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "start",
            "--wait",
            "--timeout",
            "60",
            "--pgdata",
            str(self.data),
            "--log",
            str(self.log),
            "--options",
            options,
        )
        self.startup = time.monotonic() - began
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: "fast" (sessions are ended), or "immediate" (as if it crashed)."""
        if (self.data / "postmaster.pid").exists():
            self._run(
                str(self.bindir / "pg_ctl"),
                "stop",
                "--wait",
                "--pgdata",
                str(self.data),
                "--mode",
                mode,
            )

    def remove(self) -> None:
        """Stop the server and delete its directory."""
        try:
            self.stop(mode="immediate")
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)


def new_server(settings: Mapping[str, str] | None = None) -> PostgresServer:
    """A started server (a test's own, to restart or to give short timeouts); skip without one."""
    bindir = postgres_bindir()
    if bindir is None:
        unavailable("a PostgreSQL server (initdb and pg_ctl: Debian's postgresql package)")
    assert bindir is not None
    server = PostgresServer(bindir, settings)
    try:
        return server.start()
    except BaseException:
        server.remove()
        raise


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """The URL of the session's PostgreSQL server, as superuser ``postgres`` (trust auth)."""
    if url := os.environ.get("INTURN_POSTGRES_URL"):
        yield url
        return
    server = new_server()
    try:
        yield server.url
    finally:
        server.remove()


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server of this test's own, which it may stop and start again."""
    server = new_server()
    try:
        yield server
    finally:
        server.remove()
