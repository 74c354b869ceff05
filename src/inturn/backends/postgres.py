"""The PostgreSQL backend: one FIFO line per key in the server's advisory-lock queue.

::

    from inturn import KeyedQueue
    from inturn.backends.postgres import PostgresBackend

    backend = PostgresBackend.from_url("postgresql://app@db/shop", namespace="shop")
    shop = KeyedQueue(backend=backend)

Installed with ``pip install "inturn[postgres]"`` (psycopg 3 and psycopg_pool).
See :class:`PostgresBackend` for what it guarantees.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import select
import sys
import threading
import weakref
from collections.abc import Awaitable, Hashable
from typing import Any, Final, final

from .._checks import missed
from .._errors import BackendUnavailable
from .._keys import describe as show
from .._keys import order_portable
from . import _pg_wire
from ._base import Grant
from ._pg_keys import lock_id

try:
    import psycopg
    from psycopg import errors
    from psycopg_pool import AsyncConnectionPool, PoolClosed, PoolTimeout
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "inturn's PostgreSQL backend needs psycopg 3 and psycopg_pool: "
        "pip install 'inturn[postgres]'"
    ) from error

__all__ = ("PostgresBackend", "PostgresGrant")

#: Its own logger, under the core's "inturn": a pooler seen in between (WARNING),
#: a pooler in transaction mode caught moving a turn's statements (ERROR).
logger = logging.getLogger("inturn.postgres")

_NAMESPACE = re.compile(r"[A-Za-z0-9_.:\-]{1,100}")

#: The sequence that fencing tokens are drawn from (in the search_path's first schema).
SEQUENCE: Final = "inturn_token"

#: How often a waiting session checks that its client is still there (PostgreSQL 14+).
_CHECK_INTERVAL: Final = "1s"

#: Seconds to wait for a connection to the server (once this process has a session
#: slot free for it): past it, the server counts as unreachable.
_CONNECT_WAIT: Final = 10.0

# The backend's statements, prepared on each connection it uses (once, in one round
# trip) and then sent by name through _pg_wire: the server plans them once.
#
# inturn_wait: wait for the lock, then draw the token. OFFSET 0 keeps each subquery
# apart, so the settings come first, then the lock, then nextval; set_config(...,
# true) lasts for this statement's transaction only (the session is in autocommit).
# $2 is lock_timeout in ms ('0': none). client_connection_check_interval (14+)
# makes a waiter whose client died leave the queue.
_WAIT_SQL: Final = (
    "PREPARE inturn_wait (int8, text) AS SELECT nextval('" + SEQUENCE + "'), pg_backend_pid()"
    " FROM ("
    " SELECT pg_advisory_lock($1) FROM ("
    "  SELECT set_config('lock_timeout', $2, true){check} OFFSET 0"
    " ) AS settings OFFSET 0"
    ") AS granted;"
)
_CHECK: Final = ", set_config('client_connection_check_interval', '" + _CHECK_INTERVAL + "', true)"
_PREPARE_REST: Final = (
    # timeout=0: ask once; no row if the key is busy.
    "PREPARE inturn_try (int8) AS SELECT nextval('" + SEQUENCE + "'), pg_backend_pid() FROM ("
    " SELECT pg_try_advisory_lock($1) AS got OFFSET 0"
    ") AS tried WHERE got;"
    # The end of a turn: unlock each of its keys; whether each was held, in order.
    "PREPARE inturn_unlock (int8[]) AS SELECT pg_advisory_unlock(id), pg_backend_pid()"
    " FROM unnest($1) WITH ORDINALITY AS locks(id, n) ORDER BY n;"
    # Which server session this is: not the one the client was told of at connect
    # when a pooler sits in between.
    "SELECT pg_backend_pid();"
)
_WAIT: Final = b"inturn_wait"
_TRY: Final = b"inturn_try"
_UNLOCK: Final = b"inturn_unlock"
# The same, unprepared (a pool of the caller's may DEALLOCATE ALL when it resets
# a connection: then the unlock is sent as it is, and the rest prepared again).
_UNLOCK_SQL: Final = (
    b"SELECT pg_advisory_unlock(id), pg_backend_pid()"
    b" FROM unnest($1::int8[]) WITH ORDINALITY AS locks(id, n) ORDER BY n"
)
_MAKE_SEQUENCE: Final = f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint"


@final
class PostgresGrant:
    """The turn on one key: its advisory lock, held by the session of the turn."""

    __slots__ = ("_lock", "_session", "key", "lost", "token")

    def __init__(self, key: Hashable, token: int, lock: int, session: _Session) -> None:
        self.key = key
        #: From the sequence ``inturn_token``, drawn after the grant: larger than
        #: every earlier grant's, of this key and every other.
        self.token = token
        #: True once the session that held the lock is known to have ended under it.
        self.lost = False
        self._lock = lock
        self._session = session

    def __repr__(self) -> str:
        return f"PostgresGrant(key={self.key!r}, token={self.token}, lost={self.lost})"


@final
class _Place:
    """What the backend keeps for one event loop: a pool, and the slots of its sessions."""

    __slots__ = ("idle", "pool", "slots")

    def __init__(self, pool: AsyncConnectionPool[Any], size: int) -> None:
        self.pool = pool
        # One per connection this process may hold: taken before a connection is
        # asked of the pool, so that a pool that does not answer means a server
        # that cannot be reached, never one busy with this process's other keys.
        self.slots = asyncio.Semaphore(size)
        # Connections the backend took from the pool and keeps between turns, the
        # last used on top: the pool's getconn and putconn cost about 40 µs a turn.
        self.idle: list[psycopg.AsyncConnection[Any]] = []

    def take_idle(self) -> psycopg.AsyncConnection[Any] | None:
        """The connection used last that is still good; None if there is none."""
        idle = self.idle
        while idle:
            connection = idle.pop()
            if not _stale(connection):
                return connection
            _detach(self.pool.putconn(connection))  # (the pool discards a bad one)
        return None

    async def empty(self) -> None:
        """Give the idle connections back to the pool."""
        idle, self.idle = self.idle, []
        for connection in idle:
            await self.pool.putconn(connection)


@final
class PostgresBackend:
    """Lines shared by every process and host that uses the same database and namespace.

    A key is a session-level advisory lock, named by a 64-bit id digested
    from the namespace and the key (BLAKE2b: two keys sharing an id share a
    line, which never breaks exclusion; with 2**64 ids, a collision among a
    million keys has odds of about 1 in 40 million). A turn waits with
    ``pg_advisory_lock`` on a connection of its own: the server queues it
    behind the holder in arrival order and wakes it when the holder unlocks
    or its session ends.

    - Exclusion per key across every process and host, while the holder's
      session lives; FIFO across processes in the server's lock-queue order.
    - No polling: each waiting key is one ``pg_advisory_lock`` call, and the
      server shows the waiter with ``wait_event = 'advisory'``.
    - One round trip takes a key (the lock, then the fencing token from the
      sequence ``inturn_token``), and one frees every key of a turn.
    - A holder or waiter whose process dies frees its place as soon as the
      server sees its connection close (a waiter within about a second, by
      ``client_connection_check_interval``, on PostgreSQL 14+).
    - ``timeout`` is the server's ``lock_timeout``; cancelling a wait
      cancels the server's query, and a lock granted just then is given back.
    - A holder whose session ended under it (server restart,
      ``pg_terminate_backend``, failover) learns it when its turn ends: its
      grant is ``lost``, and the call raises :exc:`~inturn.LeaseLost` after
      the work. A waiter whose session ended gets
      :exc:`~inturn.BackendUnavailable`; a connection that went stale in
      the pool meanwhile is replaced before the first wait.
    - Connections are bounded: a turn takes one connection, however many
      keys it holds, once it has the head of each key's line in this
      process (so at most one per key), and ``max_sessions`` at most per
      event loop. A turn beyond them waits in this process for one to come
      free (within its ``timeout``); a turn holding one never waits for
      another, so turns cannot deadlock over them. A turn nested inside
      another takes a second connection.
    - ``keyed(..., transaction=True)`` runs the block in a transaction on
      the turn's connection (``turn.connection``): it commits when the block
      ends, rolls back on an exception, and the keys are unlocked only
      after that. A commit that fails raises the database's error after
      the work (the writes did not happen).

    Not guaranteed: a holder cut off from the server (a partition, a frozen
    process) keeps the key until the server ends its session: set
    ``idle_session_timeout`` (PostgreSQL 14+; a holder's session is idle
    while the work runs, so it must exceed the longest work) or TCP
    keepalives (``tcp_keepalives_idle``, ``_interval``, ``_count``, or
    ``tcp_user_timeout``) on the server. The holder learns it only when its
    turn ends. Session locks need a session per holder: a PgBouncer in
    transaction pooling mode breaks them; connect to PostgreSQL directly or
    through PgBouncer in session mode.

    Fencing tokens come from one sequence, ``inturn_token``, shared by every
    namespace: ``nextval`` writes no row, and a number that grows for every
    key grows for each. It is made on first use (``CREATE SEQUENCE IF NOT
    EXISTS``), which needs the CREATE privilege on the first schema of the
    ``search_path``; without it, make it once as an owner and ``GRANT USAGE``
    on it.

    :param pool_or_conninfo: a conninfo string or URL (the backend makes a
        pool per event loop), or a ``psycopg_pool.AsyncConnectionPool`` of
        your own (one event loop's; the backend neither opens nor closes
        it, and turns on autocommit on the connections it takes).
    :param namespace: keeps the lines of different apps apart (letters,
        digits and ``_.:-``).
    :param max_sessions: connections per event loop at most (a pool the
        backend makes).
    :raises ValueError: a bad namespace or max_sessions.
    """

    __slots__ = (
        "__weakref__",
        "_conninfo",
        "_given",
        "_given_loop",
        "_lock",
        "_max_sessions",
        "_namespace",
        "_places",
        "_pooled",
        "_prepared",
        "_sequence_ready",
    )

    #: Each event loop costs a pool of sessions: a queue serves its first loop
    #: directly, and every other one, like its threads, through one loop.
    prefers_one_loop: Final = True

    #: ``keyed(..., transaction=True)`` is served (see :class:`PostgresBackend`).
    transactions: Final = True

    def __init__(
        self,
        pool_or_conninfo: str | AsyncConnectionPool[Any],
        *,
        namespace: str = "inturn",
        max_sessions: int = 20,
    ) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise ValueError(
                "inturn: namespace must be 1 to 100 letters, digits or '_.:-', "
                f"got {show(namespace)}"
            )
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int):
            raise TypeError(f"inturn: max_sessions must be an int, got {show(max_sessions)}")
        if max_sessions < 1:
            raise ValueError(f"inturn: max_sessions must be >= 1, got {show(max_sessions)}")
        if isinstance(pool_or_conninfo, str):
            self._conninfo: str | None = pool_or_conninfo
            self._given: AsyncConnectionPool[Any] | None = None
        elif isinstance(pool_or_conninfo, AsyncConnectionPool):
            self._conninfo = None
            self._given = pool_or_conninfo
        else:
            raise TypeError(
                "inturn: PostgresBackend takes a conninfo string or URL, or a "
                f"psycopg_pool.AsyncConnectionPool, got {show(pool_or_conninfo)}"
            )
        self._namespace = namespace
        self._max_sessions = max_sessions
        # By event loop: its pool and session slots.
        self._places: dict[asyncio.AbstractEventLoop, _Place] = {}
        self._given_loop: asyncio.AbstractEventLoop | None = None  # where a given pool is used
        self._lock = threading.Lock()  # held to change _places
        self._sequence_ready = False
        # The connections that have the backend's statements prepared.
        self._prepared: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()
        self._pooled = False  # a pooler was seen between the backend and the server

    @classmethod
    def from_url(
        cls, url: str, *, namespace: str = "inturn", max_sessions: int = 20
    ) -> PostgresBackend:
        """A backend on ``url`` (``postgresql://user@host:port/db?sslmode=...``)."""
        if not isinstance(url, str):
            raise TypeError(f"inturn: url must be a str, got {show(url)}")
        return cls(url, namespace=namespace, max_sessions=max_sessions)

    @property
    def namespace(self) -> str:
        """The namespace of this backend's lines."""
        return self._namespace

    def order(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """Sort keys into the order every process computes (by their portable names).

        :raises TypeError: a key is not a ``str``, ``bytes`` or ``int``.
        """
        return order_portable(keys)

    def thread_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop a given pool serves (threads' calls must run there); None otherwise."""
        loop = self._given_loop
        if self._given is not None and loop is not None and loop.is_running():
            return loop
        return None

    def session(self, count: int, transaction: bool, own: bool) -> _Session:
        """A turn's session: its keys on one connection (see ``inturn.backends.Session``)."""
        return _Session(self, count, transaction, own)

    # -- the seam's per-key calls (a turn of a KeyedQueue uses a session) ---------------

    async def acquire(self, key: Hashable, timeout: float | None) -> PostgresGrant:
        """Wait in key's advisory-lock queue on a connection of its own; return once held.

        ``timeout`` covers waiting for a free session slot (all are taken)
        and the server's ``lock_timeout``; 0 asks once
        (``pg_try_advisory_lock``, one round trip).

        :raises TimeoutError: the turn was not reached within ``timeout``;
            the session left the queue.
        :raises ~inturn.BackendUnavailable: PostgreSQL could not be reached,
            or refused; the turn was not taken.
        """
        session = _Session(self, 1, False, False)
        try:
            return await session.acquire(key, timeout)
        except BaseException:
            await _shielded(session.close(None))
            raise

    async def release(self, grant: Grant) -> None:
        """Unlock grant's key (the server wakes the next waiter); return its connection.

        Never fails: a session that ended under the holder marks the grant
        ``lost``.
        """
        if not isinstance(grant, PostgresGrant):
            raise TypeError(
                f"inturn: {self!r} cannot release {show(grant)}, which it did not grant"
            )
        await grant._session.close(None)

    async def aclose(self) -> None:
        """Close the pools the backend made: their sessions end, and their locks with them.

        A pool of the caller's is left open. The backend may be used again
        afterwards (it makes new pools).
        """
        with self._lock:
            places = list(self._places.items())
            self._places.clear()
        loop = asyncio.get_running_loop()
        for owner, place in places:
            closing = place.empty() if place.pool is self._given else _close(place)
            if owner is loop:
                await closing
            elif owner.is_running():  # another thread's loop: close it there
                there = asyncio.run_coroutine_threadsafe(closing, owner)
                await asyncio.wait((asyncio.wrap_future(there),), timeout=_CONNECT_WAIT)
            else:
                closing.close()  # its loop ended: its connections went with it

    def __repr__(self) -> str:
        if self._conninfo is None:
            where = f"pool {self._given.name!r}" if self._given is not None else "?"
        else:
            where = _where(self._conninfo)
        return f"PostgresBackend({where!r}, namespace={self._namespace!r})"

    # -- connections (for _Session) -----------------------------------------------------

    async def _place(self) -> _Place:
        """The pool and slots of the running event loop (made and opened on its first call)."""
        loop = asyncio.get_running_loop()
        place = self._places.get(loop)
        if place is None:
            with self._lock:
                for other in [other for other in self._places if other.is_closed()]:
                    del self._places[other]  # its loop ended without closing it
                place = self._places.get(loop)
                if place is None:
                    place = self._places[loop] = self._new_place(loop)
        if place.pool.closed and place.pool is not self._given:
            try:
                await place.pool.open(wait=False)
            except PoolClosed:  # pragma: no cover - opened meanwhile by another task
                pass
        return place

    def _new_place(self, loop: asyncio.AbstractEventLoop) -> _Place:
        given = self._given
        if given is not None:
            if self._given_loop is not None and self._given_loop is not loop:
                raise RuntimeError(
                    "inturn: a PostgresBackend on a pool of your own serves that pool's "
                    "event loop only; give it a conninfo to serve several"
                )
            self._given_loop = loop
            return _Place(given, given.max_size)
        assert self._conninfo is not None
        pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
            self._conninfo,
            min_size=1,
            max_size=self._max_sessions,
            kwargs={"autocommit": True},
            timeout=_CONNECT_WAIT,
            check=_check,
            open=False,
            name=f"inturn-{self._namespace}",
        )
        return _Place(pool, self._max_sessions)

    async def _connect_own(self, wait: float) -> psycopg.AsyncConnection[Any]:
        """A connection outside the pools, for a turn on a short-lived event loop."""
        if self._conninfo is None:
            raise RuntimeError(
                "inturn: a PostgresBackend on a pool of your own serves that pool's "
                "event loop only; give it a conninfo to serve several"
            )
        return await psycopg.AsyncConnection.connect(
            self._conninfo, autocommit=True, connect_timeout=max(1, math.ceil(wait))
        )

    async def _ready(self, connection: psycopg.AsyncConnection[Any]) -> None:
        """Prepare the backend's statements on connection (once), after making the sequence."""
        if connection in self._prepared:
            return
        if not self._sequence_ready:
            await self._make_sequence(connection)
        check = _CHECK if connection.info.server_version >= 140000 else ""
        script = (_WAIT_SQL.format(check=check) + _PREPARE_REST).encode()
        try:
            rows = await asyncio.shield(_pg_wire.send(connection, script))
        except errors.DuplicatePreparedStatement:  # (prepared before, by this backend)
            rows = []
        self._prepared.add(connection)
        if rows and int(rows[-1][0] or 0) != connection.info.backend_pid and not self._pooled:
            self._pooled = True
            logger.warning(
                "inturn: %r: a connection pooler sits between this process and PostgreSQL "
                "(the server session is not the one the connection was told of); advisory "
                "locks hold only if it keeps one server session per client, as PgBouncer's "
                "pool_mode = session does; in transaction mode, connect inturn to "
                "PostgreSQL directly",
                self,
            )

    def _forget(self, connection: psycopg.AsyncConnection[Any]) -> None:
        """The statements prepared on connection are gone (DEALLOCATE ALL by its pool)."""
        self._prepared.discard(connection)

    async def _make_sequence(self, connection: psycopg.AsyncConnection[Any]) -> None:
        """Make the sequence of fencing tokens if it is missing (once per backend)."""
        found = await connection.execute("SELECT to_regclass(%s) IS NOT NULL", (SEQUENCE,))
        row = await found.fetchone()
        if not (row and row[0]):
            try:
                await connection.execute(_MAKE_SEQUENCE)
            except errors.UniqueViolation:  # made at the same moment by another process
                pass
            except errors.InsufficientPrivilege as error:
                raise BackendUnavailable(
                    f"inturn: the sequence {SEQUENCE} of fencing tokens does not exist and "
                    f"this user may not create it ({error}); make it once as an owner: "
                    f"CREATE SEQUENCE {SEQUENCE}; GRANT USAGE ON SEQUENCE {SEQUENCE} TO ..."
                ) from error
        self._sequence_ready = True


@final
class _Session:
    """One turn's connection and the keys it holds on it (``inturn.backends.Session``).

    Its calls run on one event loop, one at a time: close() waits for an
    acquire the caller gave up on (a thread's, through the backend loop).
    """

    __slots__ = (
        "_backend",
        "_busy",
        "_closed",
        "_connection",
        "_count",
        "_grants",
        "_own",
        "_pid",
        "_place",
        "_transaction",
    )

    def __init__(self, backend: PostgresBackend, count: int, transaction: bool, own: bool) -> None:
        self._backend = backend
        self._count = count  # keys the turn will take
        self._transaction = transaction
        self._own = own  # a connection outside the pools (a short-lived loop)
        self._place: _Place | None = None  # whose slot and pool the connection is from
        self._connection: psycopg.AsyncConnection[Any] | None = None
        self._grants: list[PostgresGrant] = []
        self._busy: asyncio.Future[None] | None = None  # an acquire under way
        self._closed = False
        self._pid = 0  # the server session that holds the keys (its first grant's)

    @property
    def connection(self) -> psycopg.AsyncConnection[Any]:
        """The connection that holds the turn's keys."""
        connection = self._connection
        if connection is None or self._closed:
            raise RuntimeError("inturn: this turn's session has no connection (it ended)")
        return connection

    def thread_loop(self) -> asyncio.AbstractEventLoop | None:
        """Where threads' calls to the session run: as its backend's."""
        return self._backend.thread_loop()

    # -- taking keys ----------------------------------------------------------------------

    async def acquire(self, key: Hashable, timeout: float | None) -> PostgresGrant:
        """Take key on the session's connection (the first key gets the connection)."""
        if self._closed:
            raise RuntimeError("inturn: this turn's session ended")
        backend = self._backend
        lock = lock_id(backend._namespace, key)
        loop = asyncio.get_running_loop()
        at = None if timeout is None else loop.time() + timeout
        busy = self._busy = loop.create_future()
        try:
            if self._connection is None:
                await self._connect(key, timeout, at)
            token = await self._wait(key, lock, timeout, at)
        finally:
            busy.set_result(None)
        grant = PostgresGrant(key, token, lock, self)
        self._grants.append(grant)
        if self._transaction and len(self._grants) == self._count:
            # the work's first statement begins the transaction (no round trip here)
            await self.connection.set_autocommit(False)
        return grant

    async def _connect(self, key: Hashable, timeout: float | None, at: float | None) -> None:
        """Get the connection: a free slot (waiting here for one), then one of the pool."""
        backend = self._backend
        loop = asyncio.get_running_loop()
        if self._own:
            wait = _CONNECT_WAIT if at is None else max(0.0, min(at - loop.time(), _CONNECT_WAIT))
            try:
                self._connection = await backend._connect_own(wait)
            except psycopg.OperationalError as error:
                raise _unreachable(backend, key, error) from error
        else:
            place = await backend._place()
            await _take_slot(place.slots, key, timeout, at)
            self._place = place
            self._connection = place.take_idle() or await self._from_pool(place, key, timeout, at)
        connection = self.connection
        try:
            if not connection.autocommit:  # a pool of the caller's
                await connection.set_autocommit(True)
            await backend._ready(connection)
        except psycopg.Error as error:
            raise BackendUnavailable(
                f"inturn: PostgreSQL failed the session for key {show(key)} "
                f"({_said(error)}); the work did not run"
            ) from error

    async def _from_pool(
        self, place: _Place, key: Hashable, timeout: float | None, at: float | None
    ) -> psycopg.AsyncConnection[Any]:
        loop = asyncio.get_running_loop()
        # (timeout=0 asks for the key at once, not for a connection at once)
        left = _CONNECT_WAIT if at is None or timeout == 0 else max(0.0, at - loop.time())
        try:
            got: psycopg.AsyncConnection[Any] = await place.pool.getconn(
                timeout=min(left, _CONNECT_WAIT) or 0.001
            )
        except PoolTimeout as error:
            if left < _CONNECT_WAIT:
                raise missed(f"the turn for key {show(key)}", timeout) from None
            raise _unreachable(self._backend, key, error) from error
        except PoolClosed as error:
            raise BackendUnavailable(
                f"inturn: {self._backend!r} was closed; the work did not run"
            ) from error
        return got

    async def _wait(self, key: Hashable, lock: int, timeout: float | None, at: float | None) -> int:
        """Wait for lock on the connection; return the token drawn with it."""
        connection = self.connection
        statement, params = _statement(lock, timeout, at)
        for _ in range(2):
            try:
                reply = _pg_wire.send(connection, statement, params, prepared=True)
            except psycopg.OperationalError as error:
                raise _failed(key, error) from error
            try:
                rows = await asyncio.shield(reply)
            except errors.LockNotAvailable:
                raise missed(f"the turn for key {show(key)}", timeout) from None
            except errors.InvalidSqlStatementName:  # deallocated by a pool's reset
                self._backend._forget(connection)
                await self._backend._ready(connection)
                continue
            except psycopg.Error as error:
                raise _failed(key, error) from error
            except BaseException:
                # Cancelled: cancel the server's wait; if the grant came all the same,
                # give it back, whatever comes next.
                await _shielded(self._call_off(reply, lock))
                raise
            if not rows:  # timeout=0, and the key was busy
                raise missed(f"the turn for key {show(key)}", timeout)
            token, pid = int(rows[0][0] or 0), int(rows[0][1] or 0)
            if self._pid and pid != self._pid:
                logger.error("inturn: %s", _MOVED)
                raise BackendUnavailable(
                    f"inturn: {_MOVED}; the work did not run, and the server session "
                    f"{pid} may hold key {show(key)} until the pooler closes it"
                )
            self._pid = pid
            return token
        raise BackendUnavailable(
            "inturn: the statements the backend prepared on its connection vanished twice "
            f"while it took key {show(key)}; {_MOVED}; the work did not run"
        )

    async def _call_off(self, reply: asyncio.Future[_pg_wire.Rows], lock: int) -> None:
        """Cancel the wait of reply; unlock lock if it was granted before the cancel landed."""
        connection = self.connection
        if not reply.done():
            try:
                await connection.cancel_safe(timeout=_CONNECT_WAIT)
            except psycopg.Error:
                pass
            await asyncio.wait((reply,), timeout=_CONNECT_WAIT)
        if not reply.done():  # no answer: end the session, and its locks with it
            _pg_wire.forget(connection)
            await connection.close()
            return
        if reply.cancelled() or reply.exception() is not None:
            return  # cancelled on the server (QueryCanceled), or the session ended
        try:
            await asyncio.shield(
                _pg_wire.send(connection, _UNLOCK, _unlocking([lock]), prepared=True)
            )
        except psycopg.Error:
            await connection.close()  # its locks go with it; close() sees it closed

    # -- giving keys back -------------------------------------------------------------------

    def release(self, grant: Grant) -> Any:
        """Unlock one grant now (a grant whose caller gave up); close() frees the rest."""
        assert isinstance(grant, PostgresGrant)
        return self._release_early(grant)

    async def _release_early(self, grant: PostgresGrant) -> None:
        if self._closed or grant not in self._grants:
            return
        self._grants.remove(grant)
        connection = self._connection
        if connection is None or _ended(connection):
            return
        try:
            await asyncio.shield(
                _pg_wire.send(connection, _UNLOCK, _unlocking([grant._lock]), prepared=True)
            )
        except psycopg.Error:
            await connection.close()

    def close(self, error: BaseException | None) -> Awaitable[None]:
        """Commit or roll back (a transaction's), unlock every key, give the connection back.

        A turn without a transaction, the common case: the unlock is sent at
        once, and the future returned is settled when the server answered
        (see ``Backend.release``: it goes on by itself).
        """
        connection, grants, busy = self._connection, self._grants, self._busy
        if (
            self._closed
            or self._transaction
            or (busy is not None and not busy.done())
            or connection is None
            or not grants
            or _ended(connection)
        ):
            return self._close(error)
        self._closed = True
        self._connection, self._grants = None, []
        try:
            reply = _pg_wire.send(
                connection, _UNLOCK, _unlocking([grant._lock for grant in grants]), prepared=True
            )
        except psycopg.OperationalError:  # the session is gone, and its locks with it
            self._unlocked(connection, grants, None)
            return _nothing()
        done = asyncio.get_running_loop().create_future()
        reply.add_done_callback(lambda answer: self._answered(connection, grants, answer, done))
        return done

    def _answered(
        self,
        connection: psycopg.AsyncConnection[Any],
        grants: list[PostgresGrant],
        answer: asyncio.Future[_pg_wire.Rows],
        done: asyncio.Future[None],
    ) -> None:
        """(A callback.) The unlock was answered: mark what was lost, give the connection back."""
        error = answer.exception()
        if isinstance(error, errors.InvalidSqlStatementName):  # deallocated by the work
            self._backend._forget(connection)
            try:
                again = _pg_wire.send(
                    connection, _UNLOCK_SQL, _unlocking([grant._lock for grant in grants])
                )
            except psycopg.OperationalError:
                pass
            else:
                again.add_done_callback(
                    lambda answer: self._answered(connection, grants, answer, done)
                )
                return
        self._unlocked(connection, grants, None if error is not None else answer.result())
        done.set_result(None)

    def _unlocked(
        self,
        connection: psycopg.AsyncConnection[Any],
        grants: list[PostgresGrant],
        rows: _pg_wire.Rows | None,
    ) -> None:
        """Mark lost each grant whose key was not held (rows of the unlock, None: none was)."""
        for n, grant in enumerate(grants):
            if rows is None or n >= len(rows) or rows[n][0] != b"t":
                grant.lost = True  # the session ended or was reset under it
        if rows and int(rows[0][1] or 0) != self._pid:
            logger.error(
                "inturn: %s; the turn on %s was not exclusive, and the server session %d "
                "may hold it until the pooler closes it",
                _MOVED,
                ", ".join(show(grant.key) for grant in grants),
                self._pid,
            )
        self._give_back(connection)

    async def _close(self, error: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        if self._busy is not None and not self._busy.done():
            await asyncio.wait((self._busy,))  # an acquire given up on, still under way
        connection, self._connection = self._connection, None
        grants, self._grants = self._grants, []
        if connection is None:
            self._free_slot()
            return
        failure: BaseException | None = None
        rows: _pg_wire.Rows | None = None
        try:
            if self._transaction:
                failure = await _finish(connection, commit=error is None)
                if not _ended(connection):
                    await connection.set_autocommit(True)
            if grants and not _ended(connection):
                locks = [grant._lock for grant in grants]
                rows = await asyncio.shield(
                    _pg_wire.send(connection, _UNLOCK, _unlocking(locks), prepared=True)
                )
        except psycopg.Error:
            pass  # the session ended, and its locks with it
        finally:
            if grants:
                self._unlocked(connection, grants, rows)
            else:
                self._give_back(connection)
        if failure is not None:
            raise failure

    def _give_back(self, connection: psycopg.AsyncConnection[Any]) -> None:
        """Keep connection for the next turn, or give it back (closing a bad one); free the slot."""
        place, self._place = self._place, None
        if place is None:
            _detach(connection.close())
            return
        if _ended(connection) or connection.info.transaction_status != _IDLE:
            _detach(place.pool.putconn(connection))  # (the pool closes or resets it)
        else:
            place.idle.append(connection)
        place.slots.release()

    def _free_slot(self) -> None:
        place, self._place = self._place, None
        if place is not None:
            place.slots.release()


#: What a pooler in transaction mode does to a session, said once.
_MOVED: Final = (
    "a connection pooler in transaction mode (PgBouncer's pool_mode = transaction, or "
    "alike) ran one turn's statements on different server sessions, which breaks advisory "
    "locks; connect inturn to PostgreSQL directly, or through the pooler in session mode"
)


def _failed(key: Hashable, error: Exception) -> BackendUnavailable:
    said = _said(error) if isinstance(error, psycopg.Error) else str(error)
    return BackendUnavailable(
        f"inturn: PostgreSQL failed the wait for key {show(key)} ({said}); the work did not run"
    )


def _unlocking(locks: list[int]) -> list[bytes | None]:
    """The parameters of _UNLOCK (and _UNLOCK_SQL) for locks: one int8 array."""
    return [("{" + ",".join(map(str, locks)) + "}").encode()]


def _stale(connection: psycopg.AsyncConnection[Any]) -> bool:
    """Whether the server ended connection's session while it sat idle (no round trip).

    A session the server ended (a restart, ``pg_terminate_backend``,
    ``idle_session_timeout``) left its socket readable, with the server's
    goodbye or the end of the stream; reading that marks the connection
    bad. (A session cut off without a word, by a partition, is found out
    by its first statement instead.)
    """
    pgconn = connection.pgconn
    for _ in range(3):  # (the goodbye, then the end of the stream)
        if pgconn.status != _OK or not _readable(pgconn.socket):
            break
        try:
            pgconn.consume_input()
        except psycopg.OperationalError:
            break
    return pgconn.status != _OK


async def _check(connection: psycopg.AsyncConnection[Any]) -> None:
    """The pool's check of a connection it hands out: refuse one whose session ended."""
    if _stale(connection):
        raise psycopg.OperationalError("inturn: the session ended while the connection was idle")


async def _close(place: _Place) -> None:
    await place.empty()
    await place.pool.close()


async def _nothing() -> None:
    return None


def _detach(step: Any) -> None:
    """Run step in a task of its own, its outcome retrieved (a connection's cleanup)."""
    task = asyncio.ensure_future(step)
    task.add_done_callback(_consume)


def _consume(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _readable(fd: int) -> bool:
    """Whether fd has something to read now (no wait)."""
    if _poll is None:  # pragma: no cover - Windows
        return bool(select.select([fd], [], [], 0)[0])
    poller = _poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


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


def _statement(
    lock: int, timeout: float | None, at: float | None
) -> tuple[bytes, list[bytes | None]]:
    """The prepared statement that waits for lock within the time left, and its parameters."""
    if timeout == 0:
        return _TRY, [str(lock).encode()]
    left = None if at is None else max(0.0, at - asyncio.get_running_loop().time())
    limit = "0" if left is None else str(max(1, math.ceil(left * 1000)))
    return _WAIT, [str(lock).encode(), limit.encode()]


async def _finish(
    connection: psycopg.AsyncConnection[Any], *, commit: bool
) -> BaseException | None:
    """End the turn's transaction: commit if asked, else roll back; the error to raise, if any."""
    if connection.broken or connection.closed:
        if commit:
            return BackendUnavailable(
                "inturn: the connection of the turn's transaction was lost before it could "
                "commit; the server rolled the work's writes back, and the keys were freed"
            )
        return None
    if not commit or connection.info.transaction_status == _IN_ERROR:
        await connection.rollback()
        if commit:  # the work swallowed a failed statement: nothing of it was kept
            return errors.InFailedSqlTransaction(
                "inturn: a statement of the turn's transaction failed and the work went on; "
                "the transaction was rolled back, so none of its writes were kept"
            )
        return None
    try:
        await connection.commit()
    except psycopg.OperationalError as error:
        if _ended(connection):
            return BackendUnavailable(
                f"inturn: the connection was lost at COMMIT ({_said(error)}): whether the "
                "turn's writes were kept is unknown; the keys were freed"
            )
        return error
    except psycopg.Error as error:  # refused at COMMIT (a deferred constraint, say)
        if sys.version_info >= (3, 11):  # pragma: no branch
            error.add_note("inturn: the work ran, but its transaction did not commit")
        return error
    return None


def _ended(connection: psycopg.AsyncConnection[Any]) -> bool:
    """Whether connection's session is over (closed here, or lost)."""
    return connection.broken or connection.closed


def _unreachable(backend: PostgresBackend, key: Hashable, error: Exception) -> BackendUnavailable:
    return BackendUnavailable(
        f"inturn: could not connect to PostgreSQL within {_CONNECT_WAIT:g} s for key "
        f"{show(key)} ({_said(error) if isinstance(error, psycopg.Error) else error}) "
        f"through {backend!r}; the work did not run"
    )


def _where(conninfo: str) -> str:
    """Where a conninfo points, without credentials: host:port/dbname."""
    try:
        parts = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError:
        return "?"
    host = parts.get("host") or "localhost"
    port = parts.get("port") or 5432
    return f"{host}:{port}/{parts.get('dbname') or ''}"


def _said(error: psycopg.Error) -> str:
    """What PostgreSQL or the connection said, on one line, with its SQLSTATE."""
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{error.sqlstate}: {text}" if error.sqlstate else text


async def _shielded(step: Any) -> None:
    """Run step to its end even if the caller is cancelled again meanwhile."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait((task,))  # the cleanup goes on: wait for it, then be cancelled
        raise


_IN_ERROR: Final = psycopg.pq.TransactionStatus.INERROR
_IDLE: Final = psycopg.pq.TransactionStatus.IDLE
_OK: Final = psycopg.pq.ConnStatus.OK
_poll = getattr(select, "poll", None)
