"""The connections of a PostgresBackend: where a turn's session gets one, and gives it back.

- Per event loop, and for the threads of a process, a *place*: a semaphore
  of ``max_sessions`` slots and the connections kept between turns (the
  last used on top). A turn takes a slot first, waiting in this process
  while all are taken (within its timeout), then a kept connection, or a
  new one: so a connection that cannot be made means a server that cannot
  be reached, never one busy with this process's other keys.
- Kept connections cost a turn no connect and no pool's ``getconn`` and
  ``putconn`` (about 40 µs); one the server ended meanwhile is found
  without a round trip (:func:`stale`) and replaced. A loop's are closed
  when it shuts down (``asyncio.run()`` does), the rest by ``aclose()``.
  No background task and no thread: nothing is left running when a loop
  or the process ends.
- With a ``psycopg_pool.AsyncConnectionPool`` of the caller's, its loop's
  connections come from it (``getconn``), and go back to it at ``aclose()``.
- The backend's statements, prepared once per connection
  (:mod:`._pg_sql`), and the sequence of fencing tokens made on first use.
- A pooler in between is noticed once (the server session is not the one
  the connection was told of) and logged.
- Fork: a child leaves its parent's connections alone (closing them would
  end the parent's sessions) and makes its own.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Generator, Hashable
from typing import Any, Final, final

import psycopg
from psycopg import errors

from .._checks import missed
from .._errors import BackendUnavailable
from .._keys import describe as show
from .._tasks import retrieve
from . import _pg_sql, _pg_wire

__all__ = ("CONNECT_WAIT", "Connections", "Lease", "logger", "said", "stale")

#: The backend's logger, under the core's "inturn".
logger = logging.getLogger("inturn.postgres")

#: Seconds to wait for a connection to the server (once this process has a session
#: slot free for it): past it, the server counts as unreachable.
CONNECT_WAIT: Final = 10.0

_OK: Final = psycopg.pq.ConnStatus.OK
_IDLE: Final = psycopg.pq.TransactionStatus.IDLE

#: Connections a forked child inherited: its parent's, never to be used nor closed
#: (closing one would end the parent's session), so they are kept from the collector.
_INHERITED: list[object] = []
_ALL: weakref.WeakSet[Connections] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for connections in list(_ALL):
        connections.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@final
class Lease:
    """A session's connection, and the slot it holds; given back once."""

    __slots__ = ("_place", "connection")

    def __init__(self, connection: Any, place: _Place | _ThreadPlace | None) -> None:
        self.connection = connection
        self._place = place  # None: a connection of its own, closed when given back

    def abandon(self) -> None:
        """After a take that failed: give back the connection, or the slot alone if none yet."""
        if self.connection is not None or self._place is None:
            self.give_back()
            return
        place, self._place = self._place, None
        place.slots.release()

    def give_back(self) -> None:
        """Keep the connection for the next turn, or close it (a bad one, or one's own)."""
        place, self._place = self._place, None
        connection = self.connection
        if place is not None:
            place.give_back(connection)
        elif isinstance(connection, psycopg.AsyncConnection):
            _detach(connection.close())
        else:
            connection.close()


@final
class _Place:
    """What the backend keeps for one event loop: its slots, and idle connections."""

    __slots__ = ("given", "guard", "idle", "slots")

    def __init__(self, size: int, given: Any = None) -> None:
        self.slots = asyncio.Semaphore(size)
        self.idle: list[psycopg.AsyncConnection[Any]] = []
        self.given = given  # the caller's pool, whose connections these are
        # closes the idle connections when the loop shuts down (see _guard)
        self.guard: AsyncGenerator[None, None] | None = None

    def take_idle(self) -> psycopg.AsyncConnection[Any] | None:
        """The connection used last that is still good; None if there is none."""
        idle = self.idle
        while idle:
            connection = idle.pop()
            if not stale(connection):
                return connection
            self._drop(connection)
        return None

    def give_back(self, connection: psycopg.AsyncConnection[Any]) -> None:
        if _reusable(connection):
            self.idle.append(connection)
        else:
            self._drop(connection)
        self.slots.release()

    def _drop(self, connection: psycopg.AsyncConnection[Any]) -> None:
        # (the caller's pool closes or resets a connection it gets back in a bad state)
        _detach(connection.close() if self.given is None else self.given.putconn(connection))

    async def close(self) -> None:
        """Close the idle connections (or give them back to the caller's pool)."""
        idle, self.idle = self.idle, []
        for connection in idle:
            if self.given is None:
                await connection.close()
            else:
                await self.given.putconn(connection)


@final
class _ThreadPlace:
    """The same for the threads of this process."""

    __slots__ = ("idle", "slots")

    def __init__(self, size: int) -> None:
        self.slots = threading.BoundedSemaphore(size)
        self.idle: collections.deque[psycopg.Connection[Any]] = collections.deque()

    def take_idle(self) -> psycopg.Connection[Any] | None:
        while True:
            try:
                connection = self.idle.pop()
            except IndexError:
                return None
            if not stale(connection):
                return connection
            connection.close()

    def give_back(self, connection: psycopg.Connection[Any]) -> None:
        try:
            if _reusable(connection):
                self.idle.append(connection)
            else:
                connection.close()
        finally:
            self.slots.release()

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


@final
class Connections:
    """Where the sessions of one backend get their connections (see the module)."""

    __slots__ = (
        "__weakref__",
        "_conninfo",
        "_given",
        "_given_loop",
        "_kwargs",
        "_lock",
        "_places",
        "_pooled",
        "_prepared",
        "_sequence_ready",
        "_size",
        "_threads",
        "owner",
    )

    def __init__(self, source: Any, size: int, owner: str) -> None:
        """source: a conninfo, or a ``psycopg_pool.AsyncConnectionPool`` of the caller's."""
        self._kwargs: dict[str, Any] = {"autocommit": True}
        if isinstance(source, str):
            self._conninfo: str | None = source
            self._given: Any = None
        else:
            # (a pool's conninfo and kwargs may be callables: then only its loop is served)
            self._conninfo = source.conninfo if isinstance(source.conninfo, str) else None
            if isinstance(source.kwargs, dict):
                self._kwargs = {**source.kwargs, "autocommit": True}
            self._given = source
        self._size = size
        self.owner = owner  # the backend, as its logs name it
        self._places: dict[asyncio.AbstractEventLoop, _Place] = {}
        self._given_loop: asyncio.AbstractEventLoop | None = None
        self._threads: _ThreadPlace | None = None
        self._lock = threading.Lock()  # held to change _places and _threads
        self._sequence_ready = False
        # The connections that have the backend's statements prepared.
        self._prepared: weakref.WeakSet[Any] = weakref.WeakSet()
        self._pooled = False  # a pooler was seen between the backend and the server
        _ALL.add(self)

    def thread_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop a given pool serves (other loops' calls must run there); None otherwise."""
        loop = self._given_loop
        if self._given is not None and loop is not None and loop.is_running():
            return loop
        return None

    # -- for tasks ----------------------------------------------------------------------

    async def take(self, key: Hashable, timeout: float | None, at: float | None) -> Lease:
        """A slot, then a connection, prepared; waiting here while all slots are taken.

        :raises TimeoutError: none came in time (``at``, by the loop's clock).
        :raises ~inturn.BackendUnavailable: the server could not be reached.
        """
        place = await self._place()
        await _take_slot(place.slots, key, timeout, at)
        lease = Lease(None, place)
        try:
            lease.connection = place.take_idle() or await self._connect(place, key, timeout, at)
            await self.ready(lease.connection)
        except BaseException:
            lease.abandon()
            raise
        return lease

    async def take_own(self, key: Hashable, at: float | None) -> Lease:
        """A connection of its own (closed when given back), for a short-lived event loop."""
        lease = Lease(await self._connect(None, key, None, at), None)
        try:
            await self.ready(lease.connection)
        except BaseException:
            lease.abandon()
            raise
        return lease

    async def _connect(
        self, place: _Place | None, key: Hashable, timeout: float | None, at: float | None
    ) -> psycopg.AsyncConnection[Any]:
        """A new connection (from the caller's pool, if place has one)."""
        wait = _wait(timeout, None if at is None else at - asyncio.get_running_loop().time())
        try:
            if place is not None and place.given is not None:
                got: psycopg.AsyncConnection[Any] = await place.given.getconn(timeout=wait or 0.001)
                return got
            return await psycopg.AsyncConnection.connect(
                self._conninfo_for("another event loop than its own"),
                connect_timeout=max(1, math.ceil(wait)),
                **self._kwargs,
            )
        except psycopg.OperationalError as error:  # (psycopg_pool's errors are too)
            raise self._unreachable(key, timeout, wait, error) from error

    async def ready(self, connection: psycopg.AsyncConnection[Any]) -> None:
        """Autocommit, the sequence made, the statements prepared (once per connection)."""
        if connection in self._prepared:
            return
        if not connection.autocommit:  # a pool of the caller's
            await connection.set_autocommit(True)
        steps = self._readying(connection)
        answer: _pg_wire.Rows | BaseException | None = None
        while (sql := _next(steps, answer)) is not None:
            try:
                answer = await asyncio.shield(_pg_wire.send(connection, *sql))
            except psycopg.Error as error:
                answer = error

    def _readying(
        self, connection: Any
    ) -> Generator[tuple[bytes, list[bytes | None] | None], _pg_wire.Rows, None]:
        """The statements that ready connection, each sent back its rows (or thrown its error).

        Written once for both kinds of connection: :meth:`ready` and
        :meth:`ready_sync` send them.
        """
        for _ in range(2):
            if not self._sequence_ready:
                found = yield _pg_sql.FIND_SEQUENCE, [_pg_sql.SEQUENCE.encode()]
                if not (found and found[0][0] == b"t"):
                    try:
                        yield _pg_sql.MAKE_SEQUENCE, None
                    except psycopg.Error as error:
                        self._refused(error)
                self._sequence_ready = True
            try:
                rows = yield _pg_sql.prepare(connection.info.server_version), None
            except errors.DuplicatePreparedStatement:  # (prepared before, by this backend)
                rows = []
            except errors.UndefinedTable:  # the sequence is gone (a restore, a failover)
                self._sequence_ready = False
                continue
            self._prepared_on(connection, rows)
            return

    async def _place(self) -> _Place:
        """The slots and idle connections of the running event loop (made on its first call)."""
        loop = asyncio.get_running_loop()
        place = self._places.get(loop)
        if place is not None:
            return place
        with self._lock:
            for other in [other for other in self._places if other.is_closed()]:
                del self._places[other]  # its loop ended without shutting down
            place = self._places.get(loop)
            if place is None:
                if self._given is not None and self._given_loop in (None, loop):
                    self._given_loop = loop
                    place = _Place(self._given.max_size, self._given)
                else:
                    place = _Place(self._size)
                self._places[loop] = place
        if place.guard is None:
            place.guard = _guard(self, loop, place)
            await place.guard.asend(None)
        return place

    def _dropped(self, loop: asyncio.AbstractEventLoop, place: _Place) -> None:
        with self._lock:
            if self._places.get(loop) is place:
                del self._places[loop]

    # -- for threads ----------------------------------------------------------------------

    def take_sync(self, key: Hashable, timeout: float | None, deadline: float | None) -> Lease:
        """As :meth:`take`, for a thread (``deadline`` by ``time.monotonic()``)."""
        place = self._thread_place()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not place.slots.acquire(timeout=left):
            raise missed(f"the turn for key {show(key)}", timeout)
        lease = Lease(None, place)
        try:
            lease.connection = place.take_idle() or self._connect_sync(key, timeout, deadline)
            self.ready_sync(lease.connection)
        except BaseException:
            lease.abandon()
            raise
        return lease

    def _connect_sync(
        self, key: Hashable, timeout: float | None, deadline: float | None
    ) -> psycopg.Connection[Any]:
        wait = _wait(timeout, None if deadline is None else deadline - time.monotonic())
        try:
            return psycopg.Connection.connect(
                self._conninfo_for("threads"),
                connect_timeout=max(1, math.ceil(wait)),
                **self._kwargs,
            )
        except psycopg.OperationalError as error:
            raise self._unreachable(key, timeout, wait, error) from error

    def ready_sync(self, connection: psycopg.Connection[Any]) -> None:
        """As :meth:`ready`, for a thread's connection."""
        if connection in self._prepared:
            return
        steps = self._readying(connection)
        answer: _pg_wire.Rows | BaseException | None = None
        while (sql := _next(steps, answer)) is not None:
            try:
                _pg_wire.send_sync(connection, *sql)
                answer = _pg_wire.answer_sync(connection) or []
            except psycopg.Error as error:
                answer = error

    def _thread_place(self) -> _ThreadPlace:
        place = self._threads
        if place is None:
            with self._lock:
                place = self._threads
                if place is None:
                    place = self._threads = _ThreadPlace(self._size)
        return place

    # -- both -------------------------------------------------------------------------------

    def forget(self, connection: Any) -> None:
        """The statements prepared on connection are gone (``DEALLOCATE ALL``)."""
        self._prepared.discard(connection)

    def _conninfo_for(self, what: str) -> str:
        if self._conninfo is None:
            raise RuntimeError(
                f"inturn: {self.owner} is on a pool of your own whose conninfo is a function: "
                f"it cannot connect for {what}; give the backend a conninfo string"
            )
        return self._conninfo

    def _prepared_on(self, connection: Any, rows: _pg_wire.Rows) -> None:
        self._prepared.add(connection)
        if rows and int(rows[-1][0] or 0) != connection.info.backend_pid and not self._pooled:
            self._pooled = True
            logger.warning(
                "inturn: %s: a connection pooler sits between this process and PostgreSQL "
                "(the server session is not the one the connection was told of); advisory "
                "locks hold only if it keeps one server session per client, as PgBouncer's "
                "pool_mode = session does; in transaction mode, connect inturn to "
                "PostgreSQL directly",
                self.owner,
            )

    def _refused(self, error: psycopg.Error) -> None:
        if isinstance(error, errors.UniqueViolation):
            return  # made at the same moment by another process
        if isinstance(error, errors.InsufficientPrivilege):
            raise BackendUnavailable(
                f"inturn: the sequence {_pg_sql.SEQUENCE} of fencing tokens does not exist "
                f"and this user may not create it ({error}); make it once as an owner: "
                f"CREATE SEQUENCE {_pg_sql.SEQUENCE}; GRANT USAGE ON SEQUENCE "
                f"{_pg_sql.SEQUENCE} TO ...; the work did not run"
            ) from error
        raise error

    def _unreachable(
        self, key: Hashable, timeout: float | None, wait: float, error: psycopg.Error
    ) -> Exception:
        """TimeoutError if the turn's own time ran out first; else BackendUnavailable."""
        timed_out = type(error).__name__ == "PoolTimeout" or "timeout" in str(error).lower()
        if wait < CONNECT_WAIT and timed_out:
            return missed(f"the turn for key {show(key)}", timeout)
        reason = said(error)
        return BackendUnavailable(
            f"inturn: could not connect to PostgreSQL for key {show(key)} ({reason}) through "
            f"{self.owner}; the work did not run"
        )

    async def aclose(self) -> None:
        """Close the connections kept (their sessions end, and their locks with them)."""
        with self._lock:
            places = list(self._places.items())
            self._places.clear()
            threads, self._threads = self._threads, None
        if threads is not None:
            threads.close()
        loop = asyncio.get_running_loop()
        for owner, place in places:
            if owner is loop:
                await place.close()
            elif owner.is_running():  # another thread's loop: close them there
                there = asyncio.run_coroutine_threadsafe(place.close(), owner)
                await asyncio.wait((asyncio.wrap_future(there),), timeout=CONNECT_WAIT)
            # (else its loop ended: its connections are closed, or were left to the collector)

    def forked(self) -> None:
        """(In a forked child.) Leave the parent's connections alone; make new ones."""
        _INHERITED.append((self._places, self._threads, self._prepared))
        self._places = {}
        self._threads = None
        self._given_loop = None
        self._prepared = weakref.WeakSet()
        self._lock = threading.Lock()


def _next(
    steps: Generator[tuple[bytes, list[bytes | None] | None], _pg_wire.Rows, None],
    answer: _pg_wire.Rows | BaseException | None,
) -> tuple[bytes, list[bytes | None] | None] | None:
    """Send steps the answer to its last statement (or throw its error in); its next one."""
    try:
        if isinstance(answer, BaseException):
            return steps.throw(answer)
        return steps.send(answer)  # type: ignore[arg-type]  # (None: the first)
    except StopIteration:
        return None


def stale(connection: Any) -> bool:
    """Whether the server ended connection's session while it sat idle (no round trip).

    A session the server ended (a restart, ``pg_terminate_backend``,
    ``idle_session_timeout``) left its socket readable, with the server's
    goodbye or the end of the stream; reading that marks the connection
    bad. (A session cut off without a word, by a partition, is found out by
    its first statement instead.)
    """
    pgconn = connection.pgconn
    for _ in range(3):  # (the goodbye, then the end of the stream)
        if pgconn.status != _OK or not _pg_wire.readable(pgconn.socket):
            break
        try:
            pgconn.consume_input()
        except psycopg.OperationalError:
            break
    return bool(pgconn.status != _OK)


def _reusable(connection: Any) -> bool:
    return bool(
        not connection.broken
        and not connection.closed
        and connection.autocommit
        and connection.info.transaction_status == _IDLE
    )


def _wait(timeout: float | None, left: float | None) -> float:
    """Seconds to wait for a new connection: the turn's time left, at most CONNECT_WAIT.

    (timeout=0 asks for the key at once, not for a connection at once.)
    """
    if left is None or timeout == 0:
        return CONNECT_WAIT
    return max(0.0, min(left, CONNECT_WAIT))


async def _guard(
    connections: Connections, loop: asyncio.AbstractEventLoop, place: _Place
) -> AsyncGenerator[None, None]:
    """Close place's idle connections when its loop shuts down (``shutdown_asyncgens()``).

    ``asyncio.run`` closes every async generator still open after its tasks
    are done: a loop that ends leaves no connection behind.
    """
    try:
        yield
    finally:
        place.guard = None  # (it is this generator, closing)
        connections._dropped(loop, place)
        await place.close()


async def _take_slot(
    slots: asyncio.Semaphore, key: Hashable, timeout: float | None, at: float | None
) -> None:
    """Take one of this process's session slots by at (waiting here while all are taken).

    :raises TimeoutError: none came free in time.
    """
    if not slots.locked():
        await slots.acquire()  # (free: returns at once)
        return
    taking = asyncio.ensure_future(slots.acquire())
    left = None if at is None else max(0.0, at - asyncio.get_running_loop().time())
    try:
        await asyncio.wait((taking,), timeout=left)
    except BaseException:  # cancelled: give back a slot taken just then
        taking.cancel()
        await asyncio.wait((taking,))
        if not taking.cancelled() and taking.exception() is None:
            slots.release()
        raise
    if not taking.done():
        taking.cancel()
        await asyncio.wait((taking,))  # a slot it got just then is kept, not lost
    if taking.cancelled():
        raise missed(f"the turn for key {show(key)}", timeout)
    taking.result()


def said(error: psycopg.Error) -> str:
    """What PostgreSQL or the connection said, on one line, with its SQLSTATE."""
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{error.sqlstate}: {text}" if error.sqlstate else text


def _detach(step: Any) -> None:
    """Run step in a task of its own, its outcome retrieved (a connection's cleanup)."""
    asyncio.ensure_future(step).add_done_callback(retrieve)
