"""One turn on PostgreSQL: its connection, and the keys it holds on it.

A turn of a KeyedQueue takes all its keys through one :class:`PgSession`
(``inturn.backends.Session``), driven by a task (``acquire``, ``close``)
or by a thread (``acquire_sync``, ``close_sync``, called natively by the
queue's bridge). Its calls run one at a time: ``close`` waits for an
``acquire`` its caller gave up on.

Statements go through :mod:`._pg_wire`: a task's unlock is sent the moment
``close`` is called, and the future it returns is settled by the server's
answer (it goes on by itself, as ``Backend.release`` asks).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Generator, Hashable
from typing import TYPE_CHECKING, Any, Final, Literal, final

import psycopg
from psycopg import errors

from .._checks import missed
from .._errors import BackendUnavailable
from .._keys import describe as show
from . import _pg_sql, _pg_wire
from ._pg_connections import CONNECT_WAIT, Lease, logger, said
from ._pg_keys import lock_id

if TYPE_CHECKING:
    from ._base import Grant
    from ._pg_connections import Connections

__all__ = ("PgSession", "PostgresGrant")

_IN_ERROR: Final = psycopg.pq.TransactionStatus.INERROR

#: What a pooler in transaction mode does to a session, said once.
_MOVED: Final = (
    "a connection pooler in transaction mode (PgBouncer's pool_mode = transaction, or "
    "alike) ran one turn's statements on different server sessions, which breaks advisory "
    "locks; connect inturn to PostgreSQL directly, or through the pooler in session mode"
)


@final
class PostgresGrant:
    """The turn on one key: its advisory lock, held by the session of the turn."""

    __slots__ = ("key", "lock", "lost", "session", "token")

    def __init__(self, key: Hashable, token: int, lock: int, session: PgSession) -> None:
        self.key = key
        #: From the sequence ``inturn_token``, drawn after the grant: larger than
        #: every earlier grant's, of this key and every other.
        self.token = token
        #: True once the session that held the lock is known to have ended under it.
        self.lost = False
        self.lock = lock  # the advisory lock's id
        self.session = session

    def __repr__(self) -> str:
        return f"PostgresGrant(key={self.key!r}, token={self.token}, lost={self.lost})"


@final
class PgSession:
    """One turn's connection and the keys it holds on it (see the module)."""

    __slots__ = (
        "_busy",
        "_closed",
        "_connections",
        "_count",
        "_grants",
        "_lease",
        "_namespace",
        "_own",
        "_pid",
        "_transaction",
    )

    def __init__(
        self, connections: Connections, namespace: str, count: int, transaction: bool, own: bool
    ) -> None:
        self._connections = connections
        self._namespace = namespace
        self._count = count  # keys the turn will take
        self._transaction = transaction
        self._own = own  # a connection outside the pools (a short-lived loop)
        self._lease: Lease | None = None
        self._grants: list[PostgresGrant] = []
        self._busy: asyncio.Future[None] | None = None  # a task's acquire under way
        self._closed = False
        self._pid = 0  # the server session that holds the keys (its first grant's)

    @property
    def connection(self) -> Any:
        """The connection that holds the turn's keys."""
        lease = self._lease
        if lease is None or self._closed:
            raise RuntimeError("inturn: this turn's session has no connection (it ended)")
        return lease.connection

    def thread_loop(self) -> asyncio.AbstractEventLoop | None:
        """Where other loops' calls to the session run: as its backend's."""
        return self._connections.thread_loop()

    # -- a task's turn ------------------------------------------------------------------------

    async def acquire(self, key: Hashable, timeout: float | None) -> PostgresGrant:
        """Take key on the session's connection (the first key gets the connection)."""
        if self._closed:
            raise RuntimeError("inturn: this turn's session ended")
        lock = lock_id(self._namespace, key)
        loop = asyncio.get_running_loop()
        at = None if timeout is None else loop.time() + timeout
        busy = self._busy = loop.create_future()
        try:
            if self._lease is None:
                connections = self._connections
                if self._own:
                    self._lease = await connections.take_own(key, at)
                else:
                    self._lease = await connections.take(key, timeout, at)
            token = await self._wait(key, lock, timeout, at)
        finally:
            busy.set_result(None)
        grant = self._granted(key, token, lock)
        if self._transaction and len(self._grants) == self._count:
            # the work's first statement begins the transaction (no round trip here)
            await self.connection.set_autocommit(False)
        return grant

    async def _wait(self, key: Hashable, lock: int, timeout: float | None, at: float | None) -> int:
        """Wait for lock on the connection; return the token drawn with it."""
        connection = self.connection
        left = None if at is None else max(0.0, at - asyncio.get_running_loop().time())
        statement, params = _pg_sql.waiting(lock, timeout, left)
        for _ in range(2):
            try:
                reply, kept = _pg_wire.send_watched(connection, statement, params, prepared=True)
            except psycopg.OperationalError as error:
                raise _failed(key, error) from error
            try:
                rows = await reply
            except errors.InvalidSqlStatementName:  # deallocated by a pool's reset
                self._connections.forget(connection)
                await self._connections.ready(connection)
                continue
            except errors.LockNotAvailable:
                raise missed(f"the turn for key {show(key)}", timeout) from None
            except psycopg.Error as error:
                raise _failed(key, error) from error
            except BaseException:
                # Cancelled: cancel the server's wait; if the grant came all the same,
                # give it back, whatever comes next.
                await _shielded(self._call_off(kept, lock))
                raise
            return self._token(key, rows, timeout)
        raise _vanished(key)

    async def _call_off(self, reply: asyncio.Future[_pg_wire.Rows], lock: int) -> None:
        """Cancel the wait of reply; unlock lock if it was granted before the cancel landed."""
        connection = self.connection
        if not reply.done():
            try:
                await connection.cancel_safe(timeout=CONNECT_WAIT)
            except psycopg.Error:
                pass
            await asyncio.wait((reply,), timeout=CONNECT_WAIT)
        if not reply.done():  # no answer: end the session, and its locks with it
            _pg_wire.forget(connection)
            await connection.close()
            return
        if reply.cancelled() or reply.exception() is not None:
            return  # cancelled on the server (QueryCanceled), or the session ended
        await _unlock_now(connection, [lock])

    def release(self, grant: Grant) -> Awaitable[None]:
        """Unlock one grant now (a grant whose caller gave up); close() frees the rest."""
        return self._release_early(grant)

    async def _release_early(self, grant: Grant) -> None:
        if self._closed or grant not in self._grants:
            return
        assert isinstance(grant, PostgresGrant)
        self._grants.remove(grant)
        connection = self._lease.connection if self._lease is not None else None
        if connection is not None and not _ended(connection):
            await _unlock_now(connection, [grant.lock])

    def close(self, error: BaseException | None) -> Awaitable[None]:
        """Commit or roll back (a transaction's), unlock every key, give the connection back.

        A turn without a transaction, the common case: the unlock is sent at
        once, and the future returned is settled when the server answered.
        """
        lease, grants, busy = self._lease, self._grants, self._busy
        if (
            self._closed
            or self._transaction
            or (busy is not None and not busy.done())
            or lease is None
            or not grants
            or _ended(lease.connection)
        ):
            return self._close(error)
        self._closed = True
        connection = lease.connection
        locks = _pg_sql.unlocking([grant.lock for grant in grants])
        try:
            reply = _pg_wire.send(connection, _pg_sql.UNLOCK, locks, prepared=True)
        except psycopg.OperationalError:  # the session is gone, and its locks with it
            self._unlocked(None)
            return _nothing()
        done = asyncio.get_running_loop().create_future()
        reply.add_done_callback(lambda answer: self._answered(answer, done))
        return done

    def _answered(self, answer: asyncio.Future[_pg_wire.Rows], done: asyncio.Future[None]) -> None:
        """(A callback.) The unlock was answered: mark what was lost, give the connection back."""
        error = answer.exception()
        if isinstance(error, errors.InvalidSqlStatementName):  # deallocated by the work
            assert self._lease is not None
            connection = self._lease.connection
            self._connections.forget(connection)
            locks = _pg_sql.unlocking([grant.lock for grant in self._grants])
            try:
                again = _pg_wire.send(connection, _pg_sql.UNLOCK_SQL, locks)
            except psycopg.OperationalError:
                pass
            else:
                again.add_done_callback(lambda answer: self._answered(answer, done))
                return
        self._unlocked(None if error is not None else answer.result())
        done.set_result(None)

    async def _close(self, error: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        if self._busy is not None and not self._busy.done():
            await asyncio.wait((self._busy,))  # an acquire given up on, still under way
        lease = self._lease
        if lease is None:
            return
        connection = lease.connection
        failure: BaseException | None = None
        rows: _pg_wire.Rows | None = None
        try:
            if self._transaction:
                failure = await _finish(connection, commit=error is None)
                if not _ended(connection):
                    await connection.set_autocommit(True)
            if self._grants and not _ended(connection):
                locks = _pg_sql.unlocking([grant.lock for grant in self._grants])
                try:
                    unlock = _pg_wire.send(connection, _pg_sql.UNLOCK, locks, prepared=True)
                    rows = await asyncio.shield(unlock)
                except errors.InvalidSqlStatementName:  # deallocated by the work
                    self._connections.forget(connection)
                    rows = await asyncio.shield(
                        _pg_wire.send(connection, _pg_sql.UNLOCK_SQL, locks)
                    )
        except psycopg.Error:
            pass  # the session ended, or is ended by _unlocked, and its locks with it
        finally:
            self._unlocked(rows)
        if failure is not None:
            raise failure

    # -- a thread's turn ---------------------------------------------------------------------

    def acquire_sync(self, key: Hashable, timeout: float | None) -> PostgresGrant:
        """As :meth:`acquire`, for a thread, on a sync connection, blocking it while it waits."""
        if self._closed:
            raise RuntimeError("inturn: this turn's session ended")
        lock = lock_id(self._namespace, key)
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._lease is None:
            self._lease = self._connections.take_sync(key, timeout, deadline)
        connection = self._lease.connection
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        statement, params = _pg_sql.waiting(lock, timeout, left)
        for _ in range(2):
            try:
                _pg_wire.send_sync(connection, statement, params, prepared=True)
            except psycopg.OperationalError as error:
                raise _failed(key, error) from error
            try:
                rows = _pg_wire.answer_sync(connection) or []
            except errors.InvalidSqlStatementName:
                self._connections.forget(connection)
                self._connections.ready_sync(connection)
                continue
            except errors.LockNotAvailable:
                raise missed(f"the turn for key {show(key)}", timeout) from None
            except psycopg.Error as error:
                raise _failed(key, error) from error
            except BaseException:  # interrupted (a signal handler's exception)
                self._call_off_sync(lock)
                raise
            grant = self._granted(key, self._token(key, rows, timeout), lock)
            if self._transaction and len(self._grants) == self._count:
                connection.autocommit = False  # (the work's first statement begins it)
            return grant
        raise _vanished(key)

    def _call_off_sync(self, lock: int) -> None:
        """As :meth:`_call_off`, for a thread; an interrupt meanwhile ends the session."""
        connection = self.connection
        try:
            try:
                connection.cancel_safe(timeout=CONNECT_WAIT)
            except psycopg.Error:
                pass
            rows = _pg_wire.answer_sync(connection, CONNECT_WAIT)
        except psycopg.Error:
            return  # cancelled on the server (QueryCanceled), or the session ended
        except BaseException:
            connection.close()
            raise
        if rows is None:
            connection.close()  # no answer: end the session, and its locks with it
            return
        _unlock_now_sync(connection, [lock])

    def release_sync(self, grant: Grant) -> None:
        """As :meth:`release`, for a thread."""
        if self._closed or grant not in self._grants:
            return
        assert isinstance(grant, PostgresGrant)
        self._grants.remove(grant)
        _unlock_now_sync(self.connection, [grant.lock])

    def close_sync(self, error: BaseException | None) -> None:
        """As :meth:`close`, for a thread."""
        if self._closed:
            return
        self._closed = True
        lease = self._lease
        if lease is None:
            return
        connection = lease.connection
        rows: _pg_wire.Rows | None = None
        failure: BaseException | None = None
        try:
            if self._transaction:
                failure = _finish_sync(connection, commit=error is None)
                if not _ended(connection):
                    connection.autocommit = True
            if self._grants and not _ended(connection):
                locks = _pg_sql.unlocking([grant.lock for grant in self._grants])
                try:
                    _pg_wire.send_sync(connection, _pg_sql.UNLOCK, locks, prepared=True)
                    rows = _pg_wire.answer_sync(connection, CONNECT_WAIT)
                except errors.InvalidSqlStatementName:
                    self._connections.forget(connection)
                    _pg_wire.send_sync(connection, _pg_sql.UNLOCK_SQL, locks)
                    rows = _pg_wire.answer_sync(connection, CONNECT_WAIT)
        except psycopg.Error:
            pass  # the session ended, or is ended by _unlocked, and its locks with it
        finally:
            self._unlocked(rows)
        if failure is not None:
            raise failure

    # -- both ---------------------------------------------------------------------------------

    def _token(self, key: Hashable, rows: _pg_wire.Rows, timeout: float | None) -> int:
        """The token of a granted wait (its rows); checks that the server session is the same."""
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

    def _granted(self, key: Hashable, token: int, lock: int) -> PostgresGrant:
        grant = PostgresGrant(key, token, lock, self)
        self._grants.append(grant)
        return grant

    def _unlocked(self, rows: _pg_wire.Rows | None) -> None:
        """Mark lost each grant whose key was not held (rows of the unlock); give the
        connection back.

        rows None: the unlock got no answer. If the session ended, its grants
        are lost; if it lives, it is ended now, and its locks with it (a
        connection is never kept holding a lock).
        """
        grants, self._grants = self._grants, []
        lease = self._lease
        if rows is None and grants and lease is not None and not _ended(lease.connection):
            lease.connection.pgconn.finish()  # (the turn held its keys until now)
            rows = [(b"t", str(self._pid).encode())] * len(grants)
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
        self._lease = None
        if lease is not None:
            lease.give_back()


async def _unlock_now(connection: psycopg.AsyncConnection[Any], locks: list[int]) -> None:
    """Unlock locks at once; a session that cannot is ended, and its locks with it."""
    unlock = _pg_wire.send(connection, _pg_sql.UNLOCK, _pg_sql.unlocking(locks), prepared=True)
    try:
        await asyncio.shield(unlock)
    except psycopg.Error:
        await connection.close()


def _unlock_now_sync(connection: psycopg.Connection[Any], locks: list[int]) -> None:
    """As :func:`_unlock_now`, for a thread (a session interrupted meanwhile is ended too)."""
    try:
        _pg_wire.send_sync(connection, _pg_sql.UNLOCK, _pg_sql.unlocking(locks), prepared=True)
        if _pg_wire.answer_sync(connection, CONNECT_WAIT) is None:
            connection.close()
    except psycopg.Error:
        connection.close()
    except BaseException:
        connection.close()
        raise


def _failed(key: Hashable, error: Exception) -> BackendUnavailable:
    reason = said(error) if isinstance(error, psycopg.Error) else str(error)
    fix = ""
    if isinstance(error, errors.InsufficientPrivilege):
        fix = (
            f"; the user needs USAGE on the sequence of fencing tokens: GRANT USAGE ON "
            f"SEQUENCE {_pg_sql.SEQUENCE} TO ..."
        )
    return BackendUnavailable(
        f"inturn: PostgreSQL failed the wait for key {show(key)} ({reason}){fix}; "
        "the work did not run"
    )


def _vanished(key: Hashable) -> BackendUnavailable:
    return BackendUnavailable(
        "inturn: the statements the backend prepared on its connection vanished twice "
        f"while it took key {show(key)}; {_MOVED}; the work did not run"
    )


def _ended(connection: Any) -> bool:
    """Whether connection's session is over (closed here, or lost)."""
    return bool(connection.broken or connection.closed)


def _ending(
    connection: Any, *, commit: bool
) -> Generator[Literal["commit", "rollback"], None, BaseException | None]:
    """End the turn's transaction: the call to make on connection (each thrown its error,
    if any); returns the error to raise after the work, if any.

    Written once for both kinds of connection: :func:`_finish` and
    :func:`_finish_sync` make the calls.
    """
    if _ended(connection):
        if commit:
            return BackendUnavailable(
                "inturn: the connection of the turn's transaction was lost before it could "
                "commit; the server rolled the work's writes back, and the keys were freed"
            )
        return None
    if not commit or connection.info.transaction_status == _IN_ERROR:
        yield "rollback"
        if commit:  # the work swallowed a failed statement: nothing of it was kept
            return errors.InFailedSqlTransaction(
                "inturn: a statement of the turn's transaction failed and the work went on; "
                "the transaction was rolled back, so none of its writes were kept"
            )
        return None
    try:
        yield "commit"
    except psycopg.OperationalError as error:
        if _ended(connection):
            return BackendUnavailable(
                f"inturn: the connection was lost at COMMIT ({said(error)}): whether the "
                "turn's writes were kept is unknown; the keys were freed"
            )
        return error
    except psycopg.Error as error:  # refused at COMMIT (a deferred constraint, say)
        if sys.version_info >= (3, 11):  # pragma: no branch
            error.add_note("inturn: the work ran, but its transaction did not commit")
        return error
    return None


async def _finish(
    connection: psycopg.AsyncConnection[Any], *, commit: bool
) -> BaseException | None:
    """End the turn's transaction (see _ending); the error to raise after the work, if any."""
    steps = _ending(connection, commit=commit)
    try:
        call = next(steps)
        while True:
            try:
                await getattr(connection, call)()
            except psycopg.Error as error:
                call = steps.throw(error)
            else:
                call = steps.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def _finish_sync(connection: psycopg.Connection[Any], *, commit: bool) -> BaseException | None:
    """As :func:`_finish`, on a thread's connection."""
    steps = _ending(connection, commit=commit)
    try:
        call = next(steps)
        while True:
            try:
                getattr(connection, call)()
            except psycopg.Error as error:
                call = steps.throw(error)
            else:
                call = steps.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def _shielded(step: Any) -> None:
    """Run step to its end even if the caller is cancelled again meanwhile."""
    task = asyncio.ensure_future(step)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait((task,))  # the cleanup goes on: wait for it, then be cancelled
        raise


async def _nothing() -> None:
    return None
