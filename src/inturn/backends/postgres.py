"""The PostgreSQL backend: one FIFO line per key in the server's advisory-lock queue.

::

    from inturn import KeyedQueue
    from inturn.backends.postgres import PostgresBackend

    backend = PostgresBackend.from_url("postgresql://app@db/shop", namespace="shop")
    shop = KeyedQueue(backend=backend)

Installed with ``pip install "inturn[postgres]"`` (psycopg 3 and psycopg_pool).
A first draft (issue 20): async callers, and threads through the queue's
backend loop; no ``transaction=True`` yet.

How a line is kept. A key is a session-level advisory lock, named by a
64-bit id digested from the namespace and the key (``_pg_keys.lock_id``).
A waiter runs ``pg_advisory_lock(id)`` on a session of its own: the server
queues it behind the holder in arrival order and wakes it when the holder
unlocks or its session ends, so nothing polls and a killed holder frees
the key at once. Each waiter or holder of this process takes one
connection from a pool (``max_sessions`` at most, per event loop).

One round trip takes a turn: the statement sets ``lock_timeout`` (and
``client_connection_check_interval``, so a waiter whose client died leaves
the queue) for itself only, waits for the lock, and then draws the fencing
token from the sequence ``inturn_token``. The settings are local to the
statement's own transaction (the connection is in autocommit), so a pool
that the caller lends keeps its own settings.

Fencing tokens come from one sequence, ``inturn_token``, shared by every
namespace: ``nextval`` after the grant, in the same statement. A sequence
rather than a table of counters per key: ``nextval`` writes no row (no
commit to wait for, no dead tuples per grant), and a number that grows
for every key grows for each. It is made on first use
(``CREATE SEQUENCE IF NOT EXISTS``), which needs the CREATE privilege on the
first schema of the ``search_path``; without it, make it once as an owner
and ``GRANT USAGE`` on it.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import weakref
from collections.abc import Hashable
from typing import Any, Final, final

from .._checks import missed
from .._errors import BackendUnavailable
from .._keys import describe as show
from .._keys import order_portable
from ._base import Grant
from ._pg_keys import lock_id, lock_parts

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

_NAMESPACE = re.compile(r"[A-Za-z0-9_.:\-]{1,100}")

#: The sequence that fencing tokens are drawn from (in the search_path's first schema).
SEQUENCE: Final = "inturn_token"

#: How often a waiting session checks that its client is still there (PostgreSQL 14+).
_CHECK_INTERVAL: Final = "1s"

#: Seconds to wait for a session from the pool where the caller gave no time limit
#: (or 0): past it, the server counts as unreachable.
_SESSION_WAIT: Final = 30.0

# Wait for the lock, then draw the token. OFFSET 0 keeps each subquery apart, so
# the settings come first, then the lock, then nextval; set_config(..., true)
# lasts for this statement's transaction only.
_WAIT: Final = (
    "SELECT nextval('" + SEQUENCE + "') FROM ("
    " SELECT pg_advisory_lock(%s) FROM ("
    "  SELECT set_config('lock_timeout', %s, true) OFFSET 0"
    " ) AS settings OFFSET 0"
    ") AS granted"
)
_WAIT_CHECKED: Final = (
    "SELECT nextval('" + SEQUENCE + "') FROM ("
    " SELECT pg_advisory_lock(%s) FROM ("
    "  SELECT set_config('lock_timeout', %s, true),"
    "   set_config('client_connection_check_interval', '" + _CHECK_INTERVAL + "', true)"
    "  OFFSET 0"
    " ) AS settings OFFSET 0"
    ") AS granted"
)
# timeout=0: ask once; no row if the key is busy.
_TRY: Final = (
    "SELECT nextval('" + SEQUENCE + "') FROM ("
    " SELECT pg_try_advisory_lock(%s) AS got OFFSET 0"
    ") AS tried WHERE got"
)
# After a cancelled wait: unlock the key if the grant came just as it was cancelled
# (one row, true), else nothing (the wait left the queue when it was cancelled).
_UNDO: Final = (
    "SELECT pg_advisory_unlock(%s) FROM pg_locks"
    " WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND classid = %s AND objid = %s AND objsubid = 1"
)
_UNLOCK: Final = "SELECT pg_advisory_unlock(%s)"
_MAKE_SEQUENCE: Final = f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint"


@final
class PostgresGrant:
    """The turn on one key: a session of the pool that holds the key's advisory lock."""

    __slots__ = ("_connection", "_lock", "_pool", "_released", "key", "lost", "token")

    def __init__(
        self,
        key: Hashable,
        token: int,
        lock: int,
        connection: psycopg.AsyncConnection[Any],
        pool: AsyncConnectionPool[Any],
    ) -> None:
        self.key = key
        #: From the sequence ``inturn_token``, drawn after the grant: larger than
        #: every earlier grant's, of this key and every other.
        self.token = token
        #: True once the session that held the lock is known to have ended under it.
        self.lost = False
        self._lock = lock
        self._connection = connection
        self._pool = pool
        self._released = False

    def __repr__(self) -> str:
        return f"PostgresGrant(key={self.key!r}, token={self.token}, lost={self.lost})"


@final
class PostgresBackend:
    """Lines shared by every process and host that uses the same database and namespace.

    - Exclusion per key across every process and host, while the holder's
      session lives; FIFO across processes in the server's lock-queue order.
    - No polling: each waiting key is one ``pg_advisory_lock`` call.
    - A holder or waiter whose process dies frees its place as soon as the
      server sees its connection close (a waiter within about a second,
      by ``client_connection_check_interval``, on PostgreSQL 14+).
    - ``timeout`` is the server's ``lock_timeout``; cancelling a wait
      cancels the server's query, and a lock granted just then is given back.
    - A holder whose session ended under it (server restart,
      ``pg_terminate_backend``) learns it at release: its grant is ``lost``,
      and its call raises :exc:`~inturn.LeaseLost` after the work.

    Not guaranteed: a holder cut off from the server (a partition) keeps the
    key until the server ends its session (TCP keepalives,
    ``idle_session_timeout``), and learns it only at release. Session locks
    need a session per holder: a PgBouncer in transaction pooling mode
    breaks them; connect to PostgreSQL directly or in session mode.

    :param pool_or_conninfo: a conninfo string or URL (the backend makes a
        pool per event loop), or a ``psycopg_pool.AsyncConnectionPool`` of
        your own (one event loop's; the backend neither opens nor closes
        it, and turns on autocommit on the connections it takes).
    :param namespace: keeps the lines of different apps apart (letters,
        digits and ``_.:-``).
    :param max_sessions: connections per event loop at most (a pool the
        backend makes); each key this process waits for or holds takes one,
        and a key beyond them waits in this process for one to come free.
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
        "_pools",
        "_sequence_ready",
        "_sessions",
    )

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
        # By event loop: the pool the backend made for it (a conninfo was given).
        self._pools: dict[asyncio.AbstractEventLoop, AsyncConnectionPool[Any]] = {}
        self._given_loop: asyncio.AbstractEventLoop | None = None  # where a given pool is used
        self._lock = threading.Lock()  # held to change _pools
        self._sequence_ready = False
        # What each session is known to be: its server's version (for the settings).
        self._sessions: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], int] = (
            weakref.WeakKeyDictionary()
        )

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

    #: Each event loop costs a pool of sessions: a queue serves its first loop
    #: directly, and every other one, like its threads, through one loop.
    prefers_one_loop: Final = True

    def thread_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop a given pool serves (threads' calls must run there); None otherwise."""
        loop = self._given_loop
        if self._given is not None and loop is not None and loop.is_running():
            return loop
        return None

    # -- sessions ---------------------------------------------------------------------

    async def _pool(self) -> AsyncConnectionPool[Any]:
        """The pool of the running event loop (made and opened on its first call)."""
        loop = asyncio.get_running_loop()
        if self._given is not None:
            if self._given_loop is None:
                self._given_loop = loop
            elif self._given_loop is not loop:
                raise RuntimeError(
                    "inturn: a PostgresBackend on a pool of your own serves that pool's "
                    "event loop only; give it a conninfo to serve several"
                )
            return self._given
        pool = self._pools.get(loop)
        if pool is None:
            with self._lock:
                for other in [other for other in self._pools if other.is_closed()]:
                    del self._pools[other]  # its loop ended without closing it
                pool = self._pools.get(loop)
                if pool is None:
                    assert self._conninfo is not None
                    pool = self._pools[loop] = AsyncConnectionPool(
                        self._conninfo,
                        min_size=1,
                        max_size=self._max_sessions,
                        kwargs={"autocommit": True},
                        timeout=_SESSION_WAIT,
                        open=False,
                        name=f"inturn-{self._namespace}",
                    )
        if pool.closed:
            try:
                await pool.open(wait=False)
            except PoolClosed:  # pragma: no cover - opened meanwhile by another task
                pass
        return pool

    async def _session(
        self, pool: AsyncConnectionPool[Any], key: Hashable, timeout: float | None
    ) -> psycopg.AsyncConnection[Any]:
        """A connection of pool, in autocommit, with the sequence made (once)."""
        wait = timeout or _SESSION_WAIT
        try:
            connection: psycopg.AsyncConnection[Any] = await pool.getconn(timeout=wait)
        except PoolTimeout as error:
            if timeout:
                raise missed(f"the turn for key {show(key)}", timeout) from None
            raise BackendUnavailable(
                f"inturn: no session of {self!r} within {wait:g} s: PostgreSQL could not be "
                f"reached ({error}), or max_sessions={self._max_sessions} are all taken by "
                "other keys; the work did not run"
            ) from error
        except PoolClosed as error:
            raise BackendUnavailable(
                f"inturn: {self!r} was closed; the work did not run"
            ) from error
        try:
            if not connection.autocommit:  # a pool of the caller's
                await connection.set_autocommit(True)
            if connection not in self._sessions:
                self._sessions[connection] = connection.info.server_version
            if not self._sequence_ready:
                await self._make_sequence(connection)
        except BaseException:
            await _discard(pool, connection)
            raise
        return connection

    async def _make_sequence(self, connection: psycopg.AsyncConnection[Any]) -> None:
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

    # -- taking and giving back turns --------------------------------------------------

    async def acquire(self, key: Hashable, timeout: float | None) -> PostgresGrant:
        """Wait in key's advisory-lock queue on a session of the pool; return once held.

        ``timeout`` covers waiting for a session of the pool (when all are
        taken) and the server's ``lock_timeout``; 0 asks once
        (``pg_try_advisory_lock``, one round trip).

        :raises TimeoutError: the turn was not reached within ``timeout``;
            the session left the queue.
        :raises ~inturn.BackendUnavailable: PostgreSQL could not be reached,
            or refused; the turn was not taken.
        """
        lock = lock_id(self._namespace, key)
        loop = asyncio.get_running_loop()
        at = None if timeout is None else loop.time() + timeout
        pool = await self._pool()
        connection = await self._session(pool, key, timeout)
        try:
            if timeout == 0:
                cursor = await connection.execute(_TRY, (lock,))
            else:
                left = None if at is None else max(0.0, at - loop.time())
                limit = "0" if left is None else str(max(1, math.ceil(left * 1000)))
                checked = self._sessions.get(connection, 0) >= 140000
                cursor = await connection.execute(
                    _WAIT_CHECKED if checked else _WAIT, (lock, limit)
                )
            row = await cursor.fetchone()
        except asyncio.CancelledError:
            # psycopg cancelled the server's query on the way out; the grant may
            # have come just before: give it back, in a task a second cancel cannot stop.
            await _shielded(_undo(pool, connection, lock))
            raise
        except errors.LockNotAvailable:
            await _return(pool, connection)
            raise missed(f"the turn for key {show(key)}", timeout) from None
        except psycopg.Error as error:
            await _undo(pool, connection, lock)
            raise BackendUnavailable(
                f"inturn: PostgreSQL failed the wait for key {show(key)} ({_said(error)}); "
                "the work did not run"
            ) from error
        except BaseException:
            await _shielded(_undo(pool, connection, lock))
            raise
        if row is None:  # timeout=0, and the key was busy
            await _return(pool, connection)
            raise missed(f"the turn for key {show(key)}", timeout)
        return PostgresGrant(key, int(row[0]), lock, connection, pool)

    async def release(self, grant: Grant) -> None:
        """Unlock grant's key (the server wakes the next waiter); return the session.

        Never fails: a session that ended under the holder marks the grant
        ``lost`` and is dropped from the pool.
        """
        if not isinstance(grant, PostgresGrant):
            raise TypeError(
                f"inturn: {self!r} cannot release {show(grant)}, which it did not grant"
            )
        if grant._released:
            return
        grant._released = True
        connection, pool = grant._connection, grant._pool
        try:
            cursor = await connection.execute(_UNLOCK, (grant._lock,))
            row = await cursor.fetchone()
        except psycopg.Error:
            grant.lost = True  # the session is gone, and the lock with it
            await _discard(pool, connection)
            return
        except BaseException:
            await _discard(pool, connection)  # closing the session frees the lock
            raise
        if not (row and row[0]):
            grant.lost = True  # not held any more: the session was reset under it
        await _return(pool, connection)

    async def aclose(self) -> None:
        """Close the pools the backend made: their sessions end, and their locks with them.

        A pool of the caller's is left open. The backend may be used again
        afterwards (it makes new pools).
        """
        with self._lock:
            pools = list(self._pools.items())
            self._pools.clear()
        loop = asyncio.get_running_loop()
        for owner, pool in pools:
            if owner is loop:
                await pool.close()
            elif owner.is_running():  # another thread's loop: close it there
                closing = asyncio.run_coroutine_threadsafe(pool.close(), owner)
                await asyncio.wait((asyncio.wrap_future(closing),), timeout=_SESSION_WAIT)

    def __repr__(self) -> str:
        if self._conninfo is None:
            where = f"pool {self._given.name!r}" if self._given is not None else "?"
        else:
            where = _where(self._conninfo)
        return f"PostgresBackend({where!r}, namespace={self._namespace!r})"


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


async def _undo(
    pool: AsyncConnectionPool[Any], connection: psycopg.AsyncConnection[Any], lock: int
) -> None:
    """After a wait that failed: make sure lock is not held, then return the session.

    A session in an unknown state is closed instead: that frees its locks too.
    """
    if connection.closed or connection.info.transaction_status != _IDLE:
        await _discard(pool, connection)
        return
    try:
        await connection.execute(_UNDO, (lock, *lock_parts(lock)))
    except psycopg.Error:
        await _discard(pool, connection)
        return
    await _return(pool, connection)


async def _return(pool: AsyncConnectionPool[Any], connection: psycopg.AsyncConnection[Any]) -> None:
    try:
        await pool.putconn(connection)
    except PoolClosed:  # pragma: no cover - the backend was closed meanwhile
        await connection.close()


async def _discard(
    pool: AsyncConnectionPool[Any], connection: psycopg.AsyncConnection[Any]
) -> None:
    """Close a session (its locks and place in queues go with it) and give its slot back."""
    try:
        await connection.close()
    finally:
        await _return(pool, connection)


_IDLE: Final = psycopg.pq.TransactionStatus.IDLE
