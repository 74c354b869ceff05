"""Whether what listens at a PostgreSQL URL's host and port is PostgreSQL: asked before connecting.

A server of another kind (Redis, an HTTP server: a port mistyped, a
service moved) waits for a line end that PostgreSQL's first message never
has, and libpq waits out its whole connect timeout, then says only "timed
out". So until a backend has made a connection, each is preceded by a
probe: libpq's first message (an SSLRequest) on a TCP connection of its
own, which PostgreSQL answers at once with one byte (``S`` or ``N``). If
nothing answers it in time, a line of text (``PING``) is sent on a second
one, which another kind of server answers (Redis: ``+PONG``, HTTP: an
error page), and the connection fails at once, naming what answered.
A probe that cannot connect, is closed, or gets no answer decides nothing:
libpq then tries, and says why it could not. (The line never reaches a
PostgreSQL server that answered the first message; one too slow to answer
it in time drops the line, and logs it as a startup packet of a wrong length.)
"""

from __future__ import annotations

import _thread
import asyncio
import socket
import struct
import threading
from typing import Final

import psycopg

from ..._describe import describe as show

#: libpq's first message (an SSLRequest: its length, then the code 1234 5679).
_FIRST: Final = struct.pack("!ii", 8, 80877103)
#: A line that servers of other kinds answer (Redis: +PONG; HTTP: a 400, or its page).
_LINE: Final = b"PING\r\n"
#: How PostgreSQL answers an SSLRequest: S (go on in TLS), N (in the clear), or an error (E).
_POSTGRES: Final = (b"S", b"N", b"E")
#: Seconds each probe waits for its answer at most (PostgreSQL's comes in a round trip).
PROBE_FOR: Final = 1.0


def target(conninfo: str) -> tuple[str, int] | None:
    """The one TCP host and port conninfo names; None if it names another kind of place
    (a Unix socket, several hosts, libpq's defaults), which the probe leaves to libpq."""
    try:
        params = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.Error:
        return None
    host = str(params.get("hostaddr") or params.get("host") or "")
    port = str(params.get("port") or "5432")
    if not host or host.startswith(("/", "@")) or "," in host or "," in port:
        return None
    return (host, int(port)) if port.isdigit() else None


def refusal(
    where: tuple[str, int], first: bytes | None, second: bytes | None
) -> psycopg.OperationalError | None:
    """The error for what answered the probes at where (first: libpq's first message;
    second: the line), unless it is PostgreSQL, or nothing conclusive answered."""
    if first:
        if first[:1] in _POSTGRES:
            return None
        what = f"it answered PostgreSQL's first message with {show(_line(first))}"
    elif first is None and second:
        what = f"it said nothing to PostgreSQL's first message, and {show(_line(second))} to PING"
    else:
        return None
    return psycopg.OperationalError(
        f"{where[0]}:{where[1]} is not a PostgreSQL server: {what}; check the URL's host and port"
    )


def _line(answer: bytes) -> bytes:
    """The first line of answer."""
    return answer.split(b"\n", 1)[0].rstrip(b"\r")


def check_sync(where: tuple[str, int], bound: float) -> psycopg.OperationalError | None:
    """The error for what listens at where, if the probes show it is not PostgreSQL
    (each waits bound seconds at most); else None.

    The probes run in a thread of their own (started in one call): an
    exception that a signal handler raises in the caller's thread meanwhile
    never leaves a socket half made, to be closed by the collector.
    """
    done = threading.Lock()
    done.acquire()
    found: list[psycopg.OperationalError | None] = []

    def probe() -> None:
        try:
            found.append(_checked(where, bound))
        finally:
            done.release()

    _thread.start_new_thread(probe, ())
    if not done.acquire(timeout=2 * bound + 1.0):
        return None
    return found[0] if found else None


def _checked(where: tuple[str, int], bound: float) -> psycopg.OperationalError | None:
    """check_sync's probes, in this thread."""
    try:
        first = _ask_sync(where, _FIRST, bound)
        second = _ask_sync(where, _LINE, bound) if first is None else None
    except OSError:  # (could not connect, or reset: libpq says why)
        return None
    return refusal(where, first, second)


def _ask_sync(where: tuple[str, int], message: bytes, bound: float) -> bytes | None:
    """What answers message at where (b"": closed), or None if nothing within bound."""
    with socket.create_connection(where, timeout=bound) as asking:
        asking.sendall(message)
        try:
            return asking.recv(256)
        except TimeoutError:
            return None


async def check(where: tuple[str, int], bound: float) -> psycopg.OperationalError | None:
    """As check_sync, on the running event loop."""
    try:
        first = await _ask(where, _FIRST, bound)
        second = await _ask(where, _LINE, bound) if first is None else None
    except OSError:
        return None
    return refusal(where, first, second)


async def _ask(where: tuple[str, int], message: bytes, bound: float) -> bytes | None:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*where), bound)
    except asyncio.TimeoutError:
        raise OSError("no connection in time") from None
    try:
        writer.write(message)
        return await asyncio.wait_for(reader.read(256), bound)
    except asyncio.TimeoutError:
        return None
    finally:
        writer.close()
