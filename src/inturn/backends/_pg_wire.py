"""The PostgreSQL backend's own statements, sent through psycopg's libpq handle.

Measured on the benchmark's VM (one process, 3,000 uncontended lock and
unlock pairs): psycopg's ``AsyncConnection.execute`` costs about 100 µs of
client CPU per statement, and a turn is two statements; sent with the
connection's ``PGconn`` (``psycopg.pq``, a public API) and answered through
the event loop's reader, the pair costs 127 µs instead of 207. So this
module is that part, and only it: the connection stays psycopg's (its pool,
and ``turn.connection`` for the work), and the backend sends statements
here only while nobody else uses the connection (before the work has it,
and after).

A statement is sent at once, by :func:`send` itself, not by a task that
starts later: the release of a turn reaches the server without waiting for
the event loop's next round. A thread's turns use :func:`send_sync` and
:func:`answer_sync` on psycopg's sync connections, waiting in ``poll()``.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import Sequence
from typing import Any, Final

import psycopg
from psycopg import errors, pq

from .._tasks import retrieve

__all__ = ("Rows", "answer_sync", "forget", "readable", "send", "send_sync", "send_watched")

#: A statement's rows, in text format: each a tuple of its values (None for NULL).
Rows = list[tuple[bytes | None, ...]]

_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_COMMAND_OK: Final = pq.ExecStatus.COMMAND_OK
_SQLSTATE: Final = pq.DiagnosticField.SQLSTATE


def send(
    connection: psycopg.AsyncConnection[Any],
    sql: bytes,
    params: Sequence[bytes | None] | None = None,
    *,
    prepared: bool = False,
) -> asyncio.Future[Rows]:
    """Send a statement on connection now; the future of its rows.

    ``sql`` with ``params`` (``$1``..., text); or, ``prepared``, the name of
    a statement prepared on the connection, with its params; or, without
    params, one or more statements separated by ``;`` (the simple protocol).

    The future fails with the psycopg error of the server's answer
    (``LockNotAvailable``, ``QueryCanceled``...), or ``OperationalError``
    if the connection was lost; it is settled whatever becomes of its
    awaiters (shield it to wait for it from a task that may be cancelled).

    :raises psycopg.OperationalError: the statement could not be sent.
    """
    loop = asyncio.get_running_loop()
    pgconn = connection.pgconn
    _send(pgconn, sql, params, prepared)
    answer: asyncio.Future[Rows] = loop.create_future()
    _Reply(loop, pgconn, (answer,))
    return answer


def send_watched(
    connection: psycopg.AsyncConnection[Any],
    sql: bytes,
    params: Sequence[bytes | None] | None = None,
    *,
    prepared: bool = False,
) -> tuple[asyncio.Future[Rows], asyncio.Future[Rows]]:
    """As :func:`send`, with two futures of the same answer: one to await, one to keep.

    A task awaits the first directly (a cancellation of the task cancels it);
    the second is settled by the answer all the same, for what comes after
    (whether a wait that was cancelled got its lock). Cheaper than
    ``asyncio.shield``, which costs the awaiting task a turn of the loop.
    """
    loop = asyncio.get_running_loop()
    pgconn = connection.pgconn
    _send(pgconn, sql, params, prepared)
    answer: asyncio.Future[Rows] = loop.create_future()
    kept: asyncio.Future[Rows] = loop.create_future()
    kept.add_done_callback(retrieve)  # (most often nobody looks at it)
    _Reply(loop, pgconn, (answer, kept))
    return answer, kept


def _send(
    pgconn: pq.abc.PGconn, sql: bytes, params: Sequence[bytes | None] | None, prepared: bool
) -> None:
    if prepared:
        pgconn.send_query_prepared(sql, params)
    elif params is None:
        pgconn.send_query(sql)
    else:
        pgconn.send_query_params(sql, params)


def send_sync(
    connection: psycopg.Connection[Any],
    sql: bytes,
    params: Sequence[bytes | None] | None = None,
    *,
    prepared: bool = False,
) -> None:
    """As :func:`send`, for a thread: the statement is sent when it returns.

    :raises psycopg.OperationalError: the statement could not be sent.
    """
    pgconn = connection.pgconn
    _send(pgconn, sql, params, prepared)
    while pgconn.flush():  # (rare: the statement did not fit the socket's buffer)
        _poll(pgconn.socket, select.POLLOUT, None)


def answer_sync(connection: psycopg.Connection[Any], wait: float | None = None) -> Rows | None:
    """The rows of the statement sent last on connection, waiting for them in this thread.

    An exception raised while it waits (a signal handler's) leaves the
    answer to come: call it again to collect it. ``wait``: seconds at most;
    None if no answer came in time.

    :raises psycopg.Error: as :func:`send`'s future.
    """
    pgconn = connection.pgconn
    deadline = None if wait is None else time.monotonic() + wait
    results: list[pq.abc.PGresult] = []
    while True:
        pgconn.consume_input()
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                return _rows(results)
            results.append(result)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return None
        _poll(pgconn.socket, select.POLLIN, left)


def _poll(fd: int, events: int, wait: float | None) -> None:
    """Wait until fd is ready for events, or wait seconds pass (None: as long as it takes)."""
    poller = select.poll()
    poller.register(fd, events)
    poller.poll(None if wait is None else max(0, int(wait * 1000) + 1))


def readable(fd: int) -> bool:
    """Whether fd has something to read now (no wait)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _rows(results: list[pq.abc.PGresult]) -> Rows:
    """The rows of a statement's results; raises the error of one that failed."""
    rows: Rows = []
    for result in results:
        if result.status == _TUPLES_OK:
            width = result.nfields
            rows.extend(
                tuple(result.get_value(row, column) for column in range(width))
                for row in range(result.ntuples)
            )
        elif result.status != _COMMAND_OK:
            raise _error(result)
    return rows


def forget(connection: psycopg.AsyncConnection[Any]) -> None:
    """Stop waiting for an answer on connection (before closing it): its future stays unsettled."""
    loop = asyncio.get_running_loop()
    fd = connection.pgconn.socket
    loop.remove_reader(fd)
    loop.remove_writer(fd)


class _Reply:
    """Reads one statement's answer when the socket has it, and settles the future."""

    __slots__ = ("answers", "fd", "loop", "pgconn", "results")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        pgconn: pq.abc.PGconn,
        answers: tuple[asyncio.Future[Rows], ...],
    ) -> None:
        self.loop = loop
        self.pgconn = pgconn
        self.answers = answers
        self.fd = pgconn.socket
        self.results: list[pq.abc.PGresult] = []
        if pgconn.flush():  # (rare: the statement did not fit the socket's buffer)
            loop.add_writer(self.fd, self._flush)
        loop.add_reader(self.fd, self._read)

    def _flush(self) -> None:
        try:
            if self.pgconn.flush():
                return
        except psycopg.OperationalError as error:
            self._fail(error)
            return
        self.loop.remove_writer(self.fd)

    def _read(self) -> None:
        pgconn = self.pgconn
        try:
            pgconn.consume_input()
            while not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    self._settle()
                    return
                self.results.append(result)
        except psycopg.OperationalError as error:
            self._fail(error)

    def _settle(self) -> None:
        self._stop()
        try:
            rows = _rows(self.results)
        except psycopg.Error as error:
            self._fail(error)
            return
        for answer in self.answers:
            if not answer.done():
                answer.set_result(rows)

    def _fail(self, error: Exception) -> None:
        self._stop()
        for answer in self.answers:
            if not answer.done():
                answer.set_exception(error)

    def _stop(self) -> None:
        self.loop.remove_reader(self.fd)
        self.loop.remove_writer(self.fd)


def _error(result: pq.abc.PGresult) -> psycopg.Error:
    """The psycopg error of a failed statement's result, by its SQLSTATE."""
    message = (result.error_message or b"").decode("utf-8", "replace").strip()
    state = (result.error_field(_SQLSTATE) or b"").decode("ascii", "replace")
    try:
        kind = errors.lookup(state)
    except KeyError:
        kind = psycopg.DatabaseError
    return kind(message or f"SQLSTATE {state}")
