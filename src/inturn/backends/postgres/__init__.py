"""The PostgreSQL backend: one FIFO line per key in the server's advisory-lock queue.

::

    from inturn import KeyedQueue
    from inturn.backends.postgres import PostgresBackend

    backend = PostgresBackend.from_url("postgresql://app@db/shop", namespace="shop")
    shop = KeyedQueue(backend=backend)

Installed with ``pip install "inturn[postgres]"`` (psycopg 3.2+). See
:class:`PostgresBackend` for what it guarantees.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Hashable
from typing import Any, Final, final

from ..._describe import describe as show
from ..._order import order_portable
from .._base import Capabilities, Grant, Newest

try:
    import psycopg
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "inturn's PostgreSQL backend needs psycopg 3: pip install 'inturn[postgres]'"
    ) from error
try:  # (only for a pool of the caller's)
    from psycopg_pool import AsyncConnectionPool
except ImportError:  # pragma: no cover - depends on the install
    AsyncConnectionPool = None  # type: ignore[assignment, misc]

from ..._checks import check_seconds
from .._lines import LineInfo
from .._urls import refused_conninfo
from . import _lines
from ._connections import Connections
from ._session import PgSession, PostgresGrant
from ._steps import Limits

__all__ = ("PostgresBackend", "PostgresGrant")

_NAMESPACE = re.compile(r"[A-Za-z0-9_.:\-]{1,100}")


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
      sequence ``inturn_token``), and one frees every key of a turn. A key
      new to the process costs no more: its name is recorded (see below) in
      the same round trip as its lock (libpq 14+, as ``psycopg[binary]``
      has; an older libpq records it in a round trip of its own first).
    - A holder or waiter whose process dies frees its place as soon as the
      server sees its connection close (a waiter within about a second, by
      ``client_connection_check_interval``, on PostgreSQL 14+).
    - No lock left behind: a wait that fails or is given up on (a timeout,
      a cancellation, a thread's interrupt, a missing privilege) after the
      server granted its lock gives it back before it raises (unlocked, or
      looked up in ``pg_locks`` and unlocked, or the session ended).
    - Nothing hangs: a turn ends within its ``timeout`` plus 1 s whatever
      the network or the server does (a thread that must open a new
      connection to a silent server: 2 s, libpq's least connect timeout);
      ``timeout`` covers the wait for a connection, connecting, readying it
      and the server's ``lock_timeout``. Without one, an answer overdue by
      ``unreachable_after`` is checked on a new connection: a server that
      does not answer that either is :exc:`~inturn.BackendUnavailable`
      within twice ``unreachable_after`` plus 1 s. Leaving a turn is
      bounded by ``unreachable_after``: an unlock without an answer closes
      the connection, and the turn raises :exc:`~inturn.LeaseLost` (a
      transaction turn's COMMIT is checked like a wait: twice
      ``unreachable_after`` plus 1 s through a partition).
    - A holder whose session ended under it (server restart,
      ``pg_terminate_backend``, failover) learns it when its turn ends: its
      grant is ``lost``, and the call raises :exc:`~inturn.LeaseLost` after
      the work. A waiter whose session ended gets
      :exc:`~inturn.BackendUnavailable`; a kept connection whose session
      the server ended meanwhile is replaced before the turn, without a
      round trip.
    - Connections are bounded: a turn takes one connection, however many
      keys it holds, once it has the head of each key's line in this
      process (so at most one per key), and ``max_sessions`` at most per
      event loop and for the threads of a process, per level of nesting: a
      turn started inside another turn (a task made in its block,
      ``asyncio.to_thread``, ``contextvars.copy_context().run``, a turn of
      the same task nested in a transaction turn) takes its connection from
      the next level's, so a holder that waits for such turns never holds
      the connections they need; a turn of the same task nested in a plain
      turn takes its keys on the enclosing turn's connection. Any other
      wait for a connection is bounded by ``session_wait``: past it, the
      turn fails with :exc:`~inturn.BackendUnavailable` (the work did not
      run). Connections are kept open between turns: a loop's until it
      shuts down, the others until :meth:`aclose`.
    - Sessions run with ``statement_timeout = 0`` (a role's never cuts a
      wait short); a transaction turn's work gets the role's own back, and
      its connection is reset after it (settings, role, temporary tables,
      listens, the work's own advisory locks) before it serves another.
    - ``keyed(..., transaction=True)`` runs the block in a transaction on
      the turn's connection (``turn.connection``): it commits when the block
      ends, rolls back on an exception, and the keys are unlocked only
      after that. A commit that fails raises the database's error after
      the work (the writes did not happen).
    - A raw ``os.fork()`` inside a turn: the child's copy of the turn ends in
      the child without a word to the server; the parent keeps the key.

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

    Beside it, two tables let :meth:`lines` name what ``pg_locks`` shows (a
    lock id is a digest, a server pid not the client's): ``inturn_keys``, a
    key's name by namespace and lock id, written by a process as it first
    waits for the key (sent ahead of the wait in the same round trip, in a
    transaction of its own, whose failure never fails the wait) and then at
    most once an hour while it uses it (not per turn), and
    ``inturn_sessions``, the client's host and process id of each session,
    written in the round trip that readies a connection. A process deletes
    the rows nobody needs (keys unused for two hours and not locked,
    sessions that ended) once an hour, with a key it records. They are made
    on first use as the sequence is, and need SELECT, INSERT, UPDATE and
    DELETE: a user who may not make or write them is told once in the log
    (``inturn.postgres``) what an owner runs, and its turns go on, unseen by
    :meth:`lines`.

    Threads' turns (``with``, ``run_sync``, a decorated ``def``) wait in
    their own thread, on sync connections of the process's own.

    The connections it opens have ``application_name`` ``inturn
    <namespace>`` (in ``pg_stat_activity``), unless the conninfo, a pool's
    kwargs or ``PGAPPNAME`` names them otherwise.

    :param pool_or_conninfo: a URL (``postgresql://user:password@host:5432/dbname``,
        or ``postgres://``), a conninfo string (``host=... dbname=...``),
        or a ``psycopg_pool.AsyncConnectionPool`` of your own (its event loop
        takes its connections from it, turns on their autocommit and gives
        them back at :meth:`aclose`; threads and other loops connect with
        its conninfo).
    :param namespace: keeps the lines of different apps apart (letters,
        digits and ``_.:-``).
    :param max_sessions: connections at most per event loop, and for the
        threads of a process, per level of nesting (a pool of your own: its
        ``max_size``).
    :param session_wait: seconds a turn waits for a connection when all are
        taken, at most (``None``: as long as it takes, which can deadlock a
        holder that waits for turns outside its context).
    :param unreachable_after: seconds without an answer from PostgreSQL after
        which the backend checks the server, or counts it as unreachable.
    :raises ValueError: a bad namespace, max_sessions, session_wait or
        unreachable_after; a conninfo or URL that libpq cannot read (another
        scheme, no ``=``, ...), refused here, not at the first turn: the
        message says what is wrong and how a right one looks, without the
        password.
    """

    __slots__ = ("__weakref__", "_connections", "_namespace", "_where")

    #: Threads block on sync connections; each event loop costs connections of
    #: its own (a queue serves its first loop directly, and every other one
    #: through one loop); a turn's keys are held on one connection, and
    #: ``keyed(..., transaction=True)`` is served (see :class:`PostgresBackend`).
    capabilities: Final[Capabilities] = Capabilities(
        blocking=True, one_loop=True, sessions=True, transactions=True, latest=True
    )

    def __init__(
        self,
        pool_or_conninfo: str | AsyncConnectionPool[Any],
        *,
        namespace: str = "inturn",
        max_sessions: int = 20,
        session_wait: float | None = 30.0,
        unreachable_after: float = 10.0,
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
        session_wait = check_seconds("session_wait", session_wait, zero=True)
        after = check_seconds("unreachable_after", unreachable_after, zero=False)
        if after is None:
            raise ValueError("inturn: unreachable_after must be a number of seconds, got None")
        if isinstance(pool_or_conninfo, str):
            self._where = _where(pool_or_conninfo)
        elif AsyncConnectionPool is not None and isinstance(pool_or_conninfo, AsyncConnectionPool):
            self._where = f"pool {pool_or_conninfo.name!r}"
        else:
            raise TypeError(
                "inturn: PostgresBackend takes a conninfo string or URL, or a "
                f"psycopg_pool.AsyncConnectionPool, got {show(pool_or_conninfo)}"
            )
        self._namespace = namespace
        limits = Limits(session_wait, after)
        self._connections = Connections(
            pool_or_conninfo, max_sessions, limits, repr(self), f"inturn {namespace}"
        )

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "inturn",
        max_sessions: int = 20,
        session_wait: float | None = 30.0,
        unreachable_after: float = 10.0,
    ) -> PostgresBackend:
        """A backend on ``url`` (``postgresql://user@host:port/db?sslmode=...``).

        ``url`` may be a conninfo string too (``host=... dbname=...``); see
        :class:`PostgresBackend` for the other arguments. Nothing connects yet.

        :raises TypeError: url is not a ``str``.
        :raises ValueError: libpq cannot read url, or a bad setting (as
            :class:`PostgresBackend`).
        """
        if not isinstance(url, str):
            raise TypeError(f"inturn: url must be a str, got {show(url)}")
        return cls(
            url,
            namespace=namespace,
            max_sessions=max_sessions,
            session_wait=session_wait,
            unreachable_after=unreachable_after,
        )

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
        """The loop a given pool serves (other loops' calls must run there); None otherwise."""
        return self._connections.thread_loop()

    def session(self, count: int, transaction: bool, own: bool, depth: int = 0) -> PgSession:
        """A turn's session: its keys on one connection (see ``inturn.backends.TurnSession``)."""
        return PgSession(self._connections, self._namespace, count, transaction, own, depth)

    # -- the seam's per-key calls (a KeyedQueue's turn takes its keys through a session) --

    async def acquire(self, key: Hashable, timeout: float | None) -> PostgresGrant:
        """Wait in key's advisory-lock queue on a connection of its own; return once held.

        ``timeout`` covers waiting for a free session slot (all are taken),
        connecting and the server's ``lock_timeout``, with 1 s of margin; 0
        asks once (``pg_try_advisory_lock``, one round trip).

        :raises TimeoutError: the turn was not reached within ``timeout``;
            the session left the queue.
        :raises ~inturn.BackendUnavailable: PostgreSQL could not be reached,
            or refused; the turn was not taken.
        """
        session = self.session(1, False, False)
        try:
            return await session.acquire(key, timeout)
        except BaseException:
            await session.close(None)
            raise

    def acquire_sync(
        self, key: Hashable, timeout: float | None, into: list[Grant] | None = None
    ) -> PostgresGrant:
        """As :meth:`acquire`, for a thread, blocking it while it waits (``into``: see
        :meth:`inturn.backends.BlockingBackend.acquire_sync`)."""
        session = self.session(1, False, False)
        try:
            return session.acquire_sync(key, timeout, into)
        except BaseException:
            session.close_sync(None)
            raise

    async def acquire_latest(
        self, key: Hashable, timeout: float | None, newest: Newest
    ) -> PostgresGrant:
        """As :meth:`acquire`, for latest work shared across processes (``across="processes"``).

        The session posts when its process's newest work was called
        (``newest()``) in the table ``inturn_latest``, then waits; once it
        holds the key, it runs only if no newer work waits in the line or ran
        since; else it joins the line again behind the newer work, or raises
        Replaced once newer work ran (see :class:`~inturn.backends.LatestBackend`
        and ``_latest``). A call's time is exact among the processes of one
        host, and PostgreSQL's clock (to within a call's latency) among hosts.

        :raises ~inturn.backends.Replaced: newer work of another process ran
            in this work's place.
        :raises TimeoutError: as :meth:`acquire`.
        :raises ~inturn.BackendUnavailable: as :meth:`acquire`; also when the
            table ``inturn_latest`` is missing, or this user may not write it.
        """
        session = self.session(1, False, False)
        try:
            return await session.acquire_latest(key, timeout, newest)
        except BaseException:
            await session.close(None)
            raise

    def acquire_latest_sync(
        self,
        key: Hashable,
        timeout: float | None,
        newest: Newest,
        into: list[Grant] | None = None,
    ) -> PostgresGrant:
        """As :meth:`acquire_latest`, blocking this thread (see :meth:`acquire_sync`)."""
        session = self.session(1, False, False)
        try:
            return session.acquire_latest_sync(key, timeout, newest, into)
        except BaseException:
            session.close_sync(None)
            raise

    async def release(self, grant: Grant) -> None:
        """Unlock grant's key (the server wakes the next waiter).

        Never fails: a session that ended under the holder marks the grant ``lost``.
        """
        await self._session_of(grant).close(None)

    def release_sync(self, grant: Grant) -> None:
        """As :meth:`release`, for a thread."""
        self._session_of(grant).close_sync(None)

    def _session_of(self, grant: Grant) -> PgSession:
        if not isinstance(grant, PostgresGrant):
            raise TypeError(
                f"inturn: {self!r} cannot release {show(grant)}, which it did not grant"
            )
        return grant.session

    async def lines(self) -> list[LineInfo]:
        """A snapshot of every line of this namespace on the server: holder and waiters in order.

        For operators (``python -m inturn inspect --postgres``) and tests. One
        statement, on a connection of its own, reads ``pg_locks`` (a
        consistent snapshot of the server's lock table) and
        ``pg_stat_activity`` with the keys and the clients the backend
        recorded (the tables ``inturn_keys`` and ``inturn_sessions``); the
        answer may be stale by the time it returns. Sorted by key; each key
        as the user gave it.

        - The holder is the session that holds the key's advisory lock; the
          waiters are in the order of the server's lock queue (the sessions
          ahead of each, by ``pg_blocking_pids``), the order they will get it.
        - ``pid`` and ``host`` are the client's, as its process recorded them
          (0 and None if it could not); ``server_pid`` is the server's
          process of the session (for ``pg_terminate_backend``). No token:
          it is drawn per turn and not recorded.
        - ``waiting_for`` counts from when the waiting statement began.
          ``held_for`` counts from when the holder's session last finished a
          statement, which for a turn's usual is the grant of its last key
          (a turn on several keys held its first ones longer); while a
          ``transaction=True`` turn's work runs, from when its transaction
          began. Times need the role of the sessions, a superuser or
          ``pg_read_all_stats``: others see 0.
        - Left out: a lock no process of this namespace recorded a key for
          (a process that may not write the tables, which says so in its
          log; another app's advisory locks; another namespace's). Two keys
          that share a lock id share a line, shown under the key recorded first.

        Needs SELECT on the tables, found through the ``search_path`` as the
        backend made them.

        :raises ~inturn.BackendUnavailable: PostgreSQL could not be reached in
            ``unreachable_after``, or refused; the tables are not there yet (no
            process made them: the message says what an owner runs).
        """
        return await _lines.snapshot(self._connections, self._namespace)

    async def namespaces(self) -> list[str]:
        """The namespaces whose keys someone holds or waits for now on the server, sorted.

        For operators: ``python -m inturn inspect`` names them when the
        namespace it was given has none (a misspelt one, say).

        :raises ~inturn.BackendUnavailable: as :meth:`lines`.
        """
        return await _lines.namespaces(self._connections)

    async def aclose(self) -> None:
        """Close the connections the backend keeps: their sessions end, and their locks with them.

        A pool of the caller's gets its connections back, and is left open.
        The backend may be used again afterwards.
        """
        await self._connections.aclose()

    def __repr__(self) -> str:
        return f"PostgresBackend({self._where!r}, namespace={self._namespace!r})"


def _where(conninfo: str) -> str:
    """Where a conninfo points, without credentials: host:port/dbname.

    :raises ValueError: libpq cannot read conninfo (the message says why, and
        how a right one looks).
    """
    try:
        parts = psycopg.conninfo.conninfo_to_dict(conninfo)
    except psycopg.ProgrammingError as error:
        # (from None: libpq's message is in ours, password hidden; its error may show it)
        raise refused_conninfo(conninfo, str(error).strip()) from None
    host = parts.get("host") or "localhost"
    port = parts.get("port") or 5432
    return f"{host}:{port}/{parts.get('dbname') or ''}"
