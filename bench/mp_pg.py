"""A PostgreSQL server for the PostgreSQL rows of bench/multiproc.py and bench/latest_across.py.

``INTURN_POSTGRES_URL`` names a server to use as it is. Otherwise a cluster
is made with ``initdb`` in a temporary directory (trust authentication, no
fsync) and started with ``pg_ctl start --wait`` on a free port of the
loopback interface, then stopped and deleted at the end. ``initdb`` and
``pg_ctl`` are taken from PATH, else from Debian's newest
/usr/lib/postgresql/N/bin; as root (PostgreSQL refuses it) they run as the
``postgres`` user, which Debian's package creates. (This mirrors the tests'
tests/support/pg_server.py, which the benchmark does not import.)

Where no server can be had (no ``initdb``, no ``postgres`` user as root, a
start that fails), :func:`postgres_server` says why and yields None, and the
PostgreSQL scenarios are left out.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .mp_servers import free_port

__all__ = ("ENV", "postgres_bindir", "postgres_server")

#: The environment variable naming a server to use instead of starting one.
ENV = "INTURN_POSTGRES_URL"

#: Where Debian's postgresql packages put their programs.
_DEBIAN = Path("/usr/lib/postgresql")

#: A throwaway server: no durability, room for every worker's sessions.
SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "200",
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


def _run_as() -> dict[str, Any]:
    """subprocess arguments that run PostgreSQL's programs as a user they accept."""
    if os.geteuid() != 0:
        return {}
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise RuntimeError("PostgreSQL refuses root, and there is no 'postgres' user") from None
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _run(directory: Path, as_user: dict[str, Any], *args: str) -> None:
    result = subprocess.run(
        args,
        cwd=directory,  # (a root's cwd may be unreadable to the postgres user)
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"},
        check=False,
        **as_user,
    )
    if result.returncode != 0:
        log = directory / "server.log"
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"{Path(args[0]).name} failed: {result.stderr.strip()}\n{tail}")


def _start(bindir: Path, directory: Path, as_user: dict[str, Any], port: int) -> None:
    """initdb a cluster in directory/data and start it on port."""
    data = str(directory / "data")
    _run(
        directory,
        as_user,
        *(str(bindir / "initdb"), "--pgdata", data, "--username", "postgres"),
        *("--auth", "trust", "--no-sync", "--encoding", "UTF8", "--locale", "C.UTF-8"),
    )
    options = " ".join(
        ["-p", str(port), "-k", str(directory)]
        + [f"-c {name}={value}" for name, value in SETTINGS.items()]
    )
    _run(
        directory,
        as_user,
        *(str(bindir / "pg_ctl"), "start", "--wait", "--timeout", "60"),
        *("--pgdata", data, "--log", str(directory / "server.log"), "--options", options),
    )


@contextmanager
def postgres_server(log: Callable[[str], None], who: str = "multiproc") -> Iterator[str | None]:
    """The URL of a PostgreSQL server for the length of the block (None if there is none).

    who begins each line logged (the benchmark that asked).
    """
    url = os.environ.get(ENV)
    if url:
        log(f"{who}: PostgreSQL at {url} (from {ENV})")
        yield url
        return
    bindir = postgres_bindir()
    if bindir is None:
        log(
            f"{who}: no initdb on PATH or in /usr/lib/postgresql (Debian's postgresql "
            f"package), and no {ENV}: no PostgreSQL scenarios"
        )
        yield None
        return
    directory = Path(tempfile.mkdtemp(prefix="inturn-bench-pg-"))
    as_user: dict[str, Any] = {}
    try:
        as_user = _run_as()
        if as_user:
            os.chown(directory, as_user["user"], as_user["group"])
        port = free_port()
        _start(bindir, directory, as_user, port)
    except (RuntimeError, OSError, subprocess.SubprocessError) as error:
        _remove(bindir, directory, as_user)
        why = " ".join(str(error).split())[:500]
        log(f"{who}: could not start PostgreSQL ({why}): no PostgreSQL scenarios")
        yield None
        return
    try:
        log(f"{who}: started PostgreSQL from {bindir} on 127.0.0.1:{port}")
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        _remove(bindir, directory, as_user)


def _remove(bindir: Path, directory: Path, as_user: dict[str, Any]) -> None:
    """Stop the server if it runs (a start that timed out may have left one), delete its files."""
    try:
        if (directory / "data" / "postmaster.pid").exists():
            _run(
                directory,
                as_user,
                *(str(bindir / "pg_ctl"), "stop", "--wait", "--mode", "immediate"),
                *("--pgdata", str(directory / "data")),
            )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
