"""A real PgBouncer in front of the tests' PostgreSQL server: Debian's ``pgbouncer`` package.

``bouncer(server_url, mode)`` starts one on a free loopback port, in a
temporary directory, with trust authentication and ``pool_mode = mode``
(``session`` or ``transaction``), run as the ``postgres`` user when the
tests run as root (PgBouncer refuses root, as PostgreSQL does), and stops
it at the end of the block. Skipped (failed under CI) without the program.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg

from .helpers import PATIENCE, unavailable
from .pg_server import run_as
from .servers import free_port

__all__ = ("bouncer",)

_CONFIG = """\
[databases]
postgres = host=127.0.0.1 port={server_port} dbname=postgres

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {directory}/users.txt
pool_mode = {mode}
default_pool_size = 4
max_client_conn = 100
server_reset_query =
ignore_startup_parameters = extra_float_digits
logfile = {directory}/pgbouncer.log
pidfile = {directory}/pgbouncer.pid
"""


def _program() -> str | None:
    return shutil.which("pgbouncer") or next(
        (str(path) for path in (Path("/usr/sbin/pgbouncer"),) if path.exists()), None
    )


@contextmanager
def bouncer(server_url: str, mode: str) -> Iterator[str]:
    """The URL of a PgBouncer in pool_mode ``mode`` in front of server_url, for the block."""
    program = _program()
    if program is None:
        unavailable("PgBouncer (Debian's pgbouncer package)")
    assert program is not None
    server_port = psycopg.conninfo.conninfo_to_dict(server_url)["port"]
    port = free_port()
    directory = Path(tempfile.mkdtemp(prefix="inturn-pgbouncer-"))
    as_user = run_as()
    (directory / "users.txt").write_text('"postgres" ""\n')
    (directory / "pgbouncer.ini").write_text(
        _CONFIG.format(server_port=server_port, port=port, directory=directory, mode=mode)
    )
    if as_user:
        for path in (directory, *directory.iterdir()):
            os.chown(path, as_user["user"], as_user["group"])  # type: ignore[arg-type]
    process = subprocess.Popen(
        [program, str(directory / "pgbouncer.ini")],
        cwd=directory,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        **as_user,  # type: ignore[arg-type]
    )
    try:
        deadline = time.monotonic() + PATIENCE
        while not _answers(port):
            if process.poll() is not None or time.monotonic() > deadline:
                log = directory / "pgbouncer.log"
                said = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"PgBouncer did not start: {said}")
            time.sleep(0.02)
        yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    finally:
        process.terminate()
        try:
            process.wait(PATIENCE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False
