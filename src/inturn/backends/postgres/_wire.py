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

A statement is sent at once, by :func:`send` itself; its answer is read
into a :class:`Reply` (by the event loop's reader for a task, by
:func:`answer_sync` in a thread), which keeps it whatever becomes of those
who wait for it: a wait given up on can still learn later what the server
did. A connection is closed by :func:`discard` only, which first takes its
socket out of the event loop's selector (a socket left there would haunt
the next connection given the same descriptor number).

A statement may have others sent *ahead* of it in the same round trip
(:class:`Ahead`: libpq's pipeline mode, each group ended by a sync, so each
is a transaction of its own and an error in one never touches the other).
The connection leaves pipeline mode as the statement's answer is complete;
one whose answer never comes is closed, as any is.
"""

from __future__ import annotations

import asyncio
import select
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

import psycopg
from psycopg import errors, pq

from ..._tasks import add_reader, remove_reader

#: A statement's rows, in text format: each a tuple of its values (None for NULL).
Rows = list[tuple[bytes | None, ...]]

#: What a statement came to: its rows, or its error (psycopg's, by the server's
#: SQLSTATE: ``LockNotAvailable``, ``QueryCanceled``...; ``OperationalError`` if the
#: connection was lost).
Outcome = Rows | psycopg.Error

_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_COMMAND_OK: Final = pq.ExecStatus.COMMAND_OK
_SYNCED: Final = pq.ExecStatus.PIPELINE_SYNC
_SQLSTATE: Final = pq.DiagnosticField.SQLSTATE


#: Whether libpq has pipeline mode (14+): without it, there is no :class:`Ahead`, and
#: what would go ahead of a statement goes in a round trip of its own before it.
PIPELINES: Final = psycopg.Pipeline.is_supported()


class Ahead:
    """Statements sent ahead of another in its round trip, as one transaction of their own
    (see the module); their outcome once in (None until then, or if it never came).

    ``behind``: statements sent after it in the same round trip, as a transaction of
    their own too, run by the server as soon as it is done (a wait's: at the grant);
    their outcome is :attr:`after`.
    """

    __slots__ = ("after", "behind", "outcome", "statements")

    def __init__(self, statements: tuple[bytes, ...], behind: tuple[bytes, ...] = ()) -> None:
        #: One statement each, without parameters (the extended protocol's).
        self.statements = statements
        self.behind = behind
        self.outcome: Outcome | None = None
        self.after: Outcome | None = None

    @property
    def groups(self) -> int:
        """How many groups (transactions, each ended by a sync) the round trip sends."""
        return 1 + bool(self.statements) + bool(self.behind)


class Reply:
    """One statement's answer, for a task: read by the event loop's reader as it arrives,
    kept once complete (:attr:`outcome`, None until then), and :attr:`callback` called."""

    __slots__ = ("ahead", "callback", "fd", "loop", "outcome", "pgconn", "results", "writing")

    def __init__(
        self, pgconn: pq.abc.PGconn, loop: asyncio.AbstractEventLoop, ahead: Ahead | None = None
    ) -> None:
        self.pgconn = pgconn
        self.loop = loop
        self.ahead = ahead
        self.outcome: Outcome | None = None
        self.callback: Callable[[], None] | None = None
        self.results: list[pq.abc.PGresult] = []
        fd = self.fd = pgconn.socket
        # Whether the loop writes the rest of the statement (rare: it did not fit the
        # socket's buffer). NOTE: only then is there a writer to remove: asking the loop
        # to remove one it does not have costs it a KeyError (about 2k instructions).
        self.writing = bool(pgconn.flush())
        if self.writing:
            loop.add_writer(fd, self._flush)
        add_reader(loop, fd, self._read)

    def _read(self) -> None:
        outcome = collect(self.pgconn, self.results, self.ahead)
        if outcome is not None:
            self.outcome = outcome
            self._done()

    def _flush(self) -> None:
        try:
            if self.pgconn.flush():
                return
        except psycopg.OperationalError as error:
            self.outcome = error
            self._done()
            return
        self.writing = False
        self.loop.remove_writer(self.fd)

    def _done(self) -> None:
        self.stop()
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()

    def stop(self) -> None:
        """Stop reading (the answer is in, or the connection is being closed)."""
        remove_reader(self.loop, self.fd)
        if self.writing:
            self.writing = False
            self.loop.remove_writer(self.fd)


def collect(
    pgconn: pq.abc.PGconn, results: list[pq.abc.PGresult], ahead: Ahead | None = None
) -> Outcome | None:
    """Read what the socket has of the answer into results; its outcome once complete.

    ``ahead``: the statements sent ahead of it (see :func:`send`), whose
    outcome goes into it once the answer is complete. Called again after an
    interrupt (with the same results), it goes on where it was; a result an
    interrupt made it lose (between libpq's hand and the list) makes the
    outcome :data:`LOST`, never that of another statement, nor "no rows".
    """
    try:
        pgconn.consume_input()
        if ahead is None:
            while not pgconn.is_busy():
                result = pgconn.get_result()
                if result is None:
                    return _outcome(results)
                results.append(result)
            return None
        # (pipeline mode: a None between two statements' results, a sync result after each
        # group; two Nones in a row: nothing more to come, its last sync read before)
        nothing = False
        while not pgconn.is_busy():
            result = pgconn.get_result()
            if result is None:
                if nothing:
                    break
                nothing = True
                continue
            nothing = False
            results.append(result)
            if result.status == _SYNCED and _synced(results) == ahead.groups:
                break
        else:
            return None
        pgconn.exit_pipeline_mode()
    except psycopg.OperationalError as error:
        return error
    return _split(results, ahead)


#: The outcome of a statement whose answer was read in part only (an interrupt took a
#: result between libpq and the list): what the statement did is not known.
LOST: Final = psycopg.DatabaseError("inturn: a result of the statement was lost as it was read")


def _synced(results: list[pq.abc.PGresult]) -> int:
    """How many groups of a pipeline results holds (by their sync results)."""
    return sum(1 for result in results if result.status == _SYNCED)


def _split(results: list[pq.abc.PGresult], ahead: Ahead) -> Outcome:
    """The outcome of a statement sent with ahead (results: every group's, each with its
    sync result), and ahead's (before it, behind it) into it."""
    syncs = [n for n, result in enumerate(results) if result.status == _SYNCED]
    if len(syncs) != ahead.groups:
        ahead.outcome = ahead.after = LOST
        return LOST
    starts = [0, *(sync + 1 for sync in syncs)]
    groups = [_outcome(results[start:end]) for start, end in zip(starts, syncs, strict=False)]
    if ahead.statements:
        ahead.outcome = groups.pop(0)
    if ahead.behind:
        ahead.after = groups.pop()
    return groups[0]


def send(
    connection: Any,
    sql: bytes,
    params: Sequence[bytes | None] | None = None,
    *,
    prepared: bool = False,
    ahead: Ahead | None = None,
) -> None:
    """Send a statement on connection now (a thread's: flushed when it returns).

    ``sql`` with ``params`` (``$1``..., text); or, ``prepared``, the name of
    a statement prepared on the connection, with its params; or, without
    params, one or more statements separated by ``;`` (the simple protocol).
    Its answer is read by :func:`answer_sync`, or by a :class:`Reply` (a
    task's: :func:`ask`). ``ahead``: statements sent before it in the same
    round trip, in a transaction of their own (``sql`` then has params, or
    is prepared: the extended protocol, one statement; only if
    :data:`PIPELINES`).

    :raises psycopg.OperationalError: the statement could not be sent.
    """
    pgconn = connection.pgconn
    if ahead is not None:
        try:
            pgconn.enter_pipeline_mode()
            if ahead.statements:
                for statement in ahead.statements:
                    pgconn.send_query_params(statement, None)
                pgconn.pipeline_sync()
            if prepared:
                pgconn.send_query_prepared(sql, params)
            else:
                pgconn.send_query_params(sql, params)
            pgconn.pipeline_sync()
            if ahead.behind:
                for statement in ahead.behind:
                    pgconn.send_query_params(statement, None)
                pgconn.pipeline_sync()
        except BaseException:  # (half sent, in pipeline mode: of no more use)
            discard(connection)
            raise
    elif prepared:
        pgconn.send_query_prepared(sql, params)
    elif params is None:
        pgconn.send_query(sql)
    else:
        pgconn.send_query_params(sql, params)


def ask(
    connection: Any,
    sql: bytes,
    params: Sequence[bytes | None] | None,
    prepared: bool,
    loop: asyncio.AbstractEventLoop,
    ahead: Ahead | None = None,
) -> Reply:
    """(A task's.) As :func:`send`; the reply that the loop reads the answer into.

    :raises psycopg.OperationalError: the statement could not be sent.
    """
    send(connection, sql, params, prepared=prepared, ahead=ahead)
    return Reply(connection.pgconn, loop, ahead)


async def answer(reply: Reply) -> Outcome:
    """The outcome of reply (a task's), once it is complete."""
    if reply.outcome is None:
        assert reply.loop is not None
        arrived: asyncio.Future[None] = reply.loop.create_future()
        reply.callback = lambda: settle(arrived)
        try:
            await arrived
        finally:
            reply.callback = None
    assert reply.outcome is not None
    return reply.outcome


def settle(future: asyncio.Future[None]) -> None:
    """Settle future (if nobody did)."""
    if not future.done():
        future.set_result(None)


def answer_sync(
    pgconn: pq.abc.PGconn,
    results: list[pq.abc.PGresult],
    until: float | None,
    fresh: bool,
    ahead: Ahead | None = None,
) -> Outcome | None:
    """(A thread's.) The outcome of the statement sent last on pgconn, read into results
    (and ``ahead``'s, if it was sent with some), waiting for it until ``until``
    (monotonic); None if it did not come in time.

    ``fresh``: just sent (its bytes may still wait to go out, and its answer
    is waited for before the socket is read: measured on loopback, it is not
    in yet two times out of three, and a read first is then a system call
    for nothing); else what the socket has is read first. An exception
    raised while it waits (a signal handler's) leaves the answer to come:
    call it again, with the same results, to collect it.
    """
    fd = pgconn.socket
    if fresh:
        while pgconn.flush():  # (rare: the statement did not fit the socket's buffer)
            _poll(fd, select.POLLOUT, None)
    read = not fresh
    while True:
        if read:
            outcome = collect(pgconn, results, ahead)
            if outcome is not None:
                return outcome
        if until is None:
            reader(fd).poll()
        else:
            left = until - time.monotonic()
            if left <= 0:
                return None if read else collect(pgconn, results, ahead)
            reader(fd).poll(int(left * 1000) + 1)
        read = True


def _poll(fd: int, events: int, wait: float | None) -> None:
    """Wait until fd is ready for events, or wait seconds pass (None: as long as it takes)."""
    poller = select.poll()
    poller.register(fd, events)
    poller.poll(None if wait is None else max(0, int(wait * 1000) + 1))


#: A poller for each socket whose answers a thread waits for, by descriptor: making one
#: per wait cost a turn about 2 µs of its three waits (a descriptor is one open socket,
#: which one thread at a time uses; a later socket given the same number is polled alike).
_READERS: dict[int, select.poll] = {}


def reader(fd: int) -> select.poll:
    """The poller of fd's input (see _READERS): ``poll(0)`` says at once whether fd has
    something to read."""
    poller = _READERS.get(fd)
    if poller is None:
        poller = _READERS[fd] = select.poll()
        poller.register(fd, select.POLLIN)
    return poller


def discard(connection: Any, reply: Reply | None = None) -> None:
    """Close connection now, without a word to the server (its session ends, and its locks).

    Its socket leaves the running event loop's selector first (``reply``'s,
    if one is still being read).
    """
    if reply is not None:
        reply.stop()
    pgconn = connection.pgconn
    if isinstance(connection, psycopg.AsyncConnection) and pgconn.status == pq.ConnStatus.OK:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            fd = pgconn.socket
            loop.remove_reader(fd)
            loop.remove_writer(fd)
    pgconn.finish()


def _outcome(results: list[pq.abc.PGresult]) -> Outcome:
    """The rows of a statement's results, or the error of one that failed (:data:`LOST`:
    none, as a statement has one at least)."""
    if not results:
        return LOST
    rows: Rows = []
    for result in results:
        status = result.status
        if status == _TUPLES_OK:
            value, columns = result.get_value, range(result.nfields)
            for row in range(result.ntuples):
                rows.append(tuple([value(row, column) for column in columns]))
        elif status != _COMMAND_OK:
            return _error(result)
    return rows


def _error(result: pq.abc.PGresult) -> psycopg.Error:
    """The psycopg error of a failed statement's result, by its SQLSTATE."""
    message = (result.error_message or b"").decode("utf-8", "replace").strip()
    state = (result.error_field(_SQLSTATE) or b"").decode("ascii", "replace")
    try:
        kind = errors.lookup(state)
    except KeyError:
        kind = psycopg.DatabaseError
    return kind(message or f"SQLSTATE {state}")
