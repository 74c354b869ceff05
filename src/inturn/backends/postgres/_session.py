"""One turn on PostgreSQL: its connection, and the keys it holds on it.

A turn of a KeyedQueue takes all its keys through one :class:`PgSession`
(``inturn.backends.TurnSession``), driven by a task (``acquire``, ``release``,
``close``) or by a thread (``acquire_sync``, ``release_sync``,
``close_sync``, called natively by the queue). Each is written once, as
steps (:mod:`._steps`), and driven by :class:`._drive.Run` for a task
or :func:`._drive.drive_sync` for a thread. Its calls run one at a time:
``close`` waits for an ``acquire`` its caller gave up on.

A task's unlock is sent the moment ``close`` is called, and the future it
returns is settled by the server's answer (it goes on by itself, as
``Backend.release`` asks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Generator, Hashable
from typing import TYPE_CHECKING, Any, Final, final

import psycopg
from psycopg import errors

from ..._checks import Waited, missed
from ..._describe import describe as show
from ..._errors import BackendUnavailable
from . import _latest, _sql
from ._drive import Run, drive_sync
from ._keys import lock_id
from ._latest_turn import LatestTurn
from ._lines import Record
from ._places import Lease
from ._ready import logger
from ._steps import (
    AUTOCOMMIT,
    UNSURE,
    Ended,
    Op,
    ending,
    ending_transaction,
    giving_back,
    lost,
    now,
    said,
    waiting,
)
from ._wire import PIPELINES, Ahead, discard

if TYPE_CHECKING:
    from .._base import Grant, Newest
    from ._connections import Connections
    from ._wire import Outcome, Rows

_OK: Final = psycopg.pq.ConnStatus.OK

#: What a pooler in transaction mode does to a session, said once.
_MOVED: Final = (
    "a connection pooler in transaction mode (PgBouncer's pool_mode = transaction, or "
    "alike) ran one turn's statements on different server sessions, which breaks advisory "
    "locks; connect inturn to PostgreSQL directly, or through the pooler in session mode"
)


@final
class PostgresGrant:
    """The turn on one key: its advisory lock, held by the session of the turn."""

    __slots__ = ("key", "latest", "lock", "lost", "ran_", "session", "token")

    def __init__(
        self, key: Hashable, token: int, lock: int, session: PgSession, latest: bool = False
    ) -> None:
        #: The key held.
        self.key = key
        #: From the sequence ``inturn_token``, drawn after the grant: larger than
        #: every earlier grant's, of this key and every other.
        self.token = token
        #: True once the session that held the lock is known to have ended under it,
        #: or could not confirm at the end of the turn that it still held it.
        self.lost = False
        self.lock = lock  # the advisory lock's id
        self.session = session
        self.latest = latest  # a turn of latest work shared across processes (see _latest)
        self.ran_: tuple[int, bool] | None = None  # what its work ran (see ran)

    def ran(self, called: int, ok: bool) -> None:
        """Note what latest work ran on this grant (see ``inturn.backends.LatestGrant``): its
        release records it in the key's line, for the turns behind it."""
        self.ran_ = (called, ok)

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
        "_generation",
        "_grants",
        "_lease",
        "_namespace",
        "_pid",
        "_tier",
        "_transaction",
    )

    def __init__(
        self,
        connections: Connections,
        namespace: str,
        count: int,
        transaction: bool,
        own: bool,
        depth: int = 0,
    ) -> None:
        self._connections = connections
        self._namespace = namespace
        self._count = count  # keys the turn will take
        self._transaction = transaction
        # the tier of connection slots (see _connections); None: a connection of its
        # own, outside the slots (a short-lived loop)
        self._tier: int | None = None if own else depth
        self._lease: Lease | None = None
        self._grants: list[PostgresGrant] = []
        self._busy: Run | None = None  # a task's acquire, or early release, under way
        self._closed = False
        self._pid = 0  # the server session that holds the keys (its first grant's)
        self._generation = connections.generation  # (a forked child's differs)

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
        """Take key on the session's connection (the first key gets the connection).

        Cancelled, it calls the wait off before it raises: the lock is not
        kept (a grant that came just then is given back).
        """
        return await self._acquire(key, timeout, None)

    async def acquire_latest(
        self, key: Hashable, timeout: float | None, newest: Newest
    ) -> PostgresGrant:
        """As :meth:`acquire`, for latest work shared across processes: see
        :meth:`.PostgresBackend.acquire_latest`.

        :raises ~inturn.backends.Replaced: newer work of another process ran
            in this work's place (the key is not held).
        """
        return await self._acquire(key, timeout, newest)

    async def _acquire(
        self, key: Hashable, timeout: float | None, newest: Newest | None
    ) -> PostgresGrant:
        run = self._busy = Run(self._acquiring(key, timeout, newest), self._connections)
        try:
            grant: PostgresGrant = await run.result
        except asyncio.CancelledError:
            if run.result.done() and not run.result.cancelled():
                run.result.exception()  # (retrieved: the caller was cancelled meanwhile)
            if run.done and run.value is not None:
                # granted as the caller was cancelled: give it back now
                run = self._busy = Run(self._releasing(run.value), self._connections)
            else:
                run.interrupt(asyncio.CancelledError())
            await run.ended()  # (cancelled again: the rest goes on by itself)
            await self._settled()
            raise
        except BaseException:
            await self._settled()
            raise
        return grant

    async def _settled(self) -> None:
        """After an acquire that failed: give back a lock it may hold without a grant."""
        if self._lease is not None and self._lease.unsure is not None:
            await self._run(self._undoing())

    def release(self, grant: Grant) -> Awaitable[None]:
        """Unlock one grant now (a grant whose caller gave up); close() frees the rest.

        After an acquire its caller gave up on, once its call-off is done (one
        statement at a time on the connection). Completes even if its caller
        is cancelled.
        """
        if self._generation != self._connections.generation and self._inherited():
            return self._done()
        return self._after_busy(lambda: self._run(self._releasing(grant)))

    def close(self, error: BaseException | None) -> Awaitable[None]:
        """Commit or roll back (a transaction's), unlock every key, give the connection back.

        The unlock is sent at once (after an acquire its caller gave up on, once
        that is done), and the future returned is settled when the server
        answered (or when ``unreachable_after`` passed without an answer: the
        connection is then closed). Completes even if its caller is cancelled.
        """
        if self._closed or (self._generation != self._connections.generation and self._inherited()):
            return self._done()
        return self._after_busy(lambda: Run(self._ending(error), self._connections).result)

    def _run(self, steps: Generator[Op, Any, Any]) -> asyncio.Future[Any]:
        run = self._busy = Run(steps, self._connections)
        return run.result

    def _after_busy(self, start: Callable[[], asyncio.Future[Any]]) -> asyncio.Future[Any]:
        """start() now, or once the run under way on the connection is done."""
        busy = self._busy
        if busy is None or busy.done:
            return start()
        later: asyncio.Future[Any] = busy.loop.create_future()
        busy.on_end(lambda: _forward(start(), later))
        return later

    def _done(self) -> asyncio.Future[None]:
        """A release with nothing to do (a forked child of a task has no running loop:
        the future is of the loop the turn was taken in)."""
        busy = self._busy
        loop = asyncio.get_running_loop() if busy is None else busy.loop
        done: asyncio.Future[None] = loop.create_future()
        done.set_result(None)
        return done

    # -- a thread's turn ---------------------------------------------------------------------

    def acquire_sync(
        self, key: Hashable, timeout: float | None, into: list[Grant] | None = None
    ) -> PostgresGrant:
        """As :meth:`acquire`, for a thread, on a sync connection, blocking it while it waits.

        Interrupted (a signal handler's exception), even between two of its
        statements, it gives back a lock it may hold without a grant. With
        ``into``, the grant goes into it too: an interrupt on its way there
        leaves the lock to this session's close, which its caller's clean-up
        makes (the lock is the session's connection's).
        """
        return self._acquire_sync(key, timeout, None, into)

    def acquire_latest_sync(
        self,
        key: Hashable,
        timeout: float | None,
        newest: Newest,
        into: list[Grant] | None = None,
    ) -> PostgresGrant:
        """As :meth:`acquire_latest`, for a thread (see :meth:`acquire_sync`)."""
        return self._acquire_sync(key, timeout, newest, into)

    def _acquire_sync(
        self,
        key: Hashable,
        timeout: float | None,
        newest: Newest | None,
        into: list[Grant] | None,
    ) -> PostgresGrant:
        try:
            steps = self._acquiring(key, timeout, newest)
            grant: PostgresGrant = drive_sync(steps, self._connections)
        except BaseException:
            if self._lease is not None and self._lease.unsure is not None:
                try:
                    drive_sync(self._undoing(), self._connections)
                except BaseException:  # interrupted again: end the session, and its locks
                    if self._lease is not None:
                        discard(self._lease.connection)
                    raise
            raise
        if into is not None:
            into.append(grant)
        return grant

    def release_sync(self, grant: Grant) -> None:
        """As :meth:`release`, for a thread."""
        if not self._inherited():
            drive_sync(self._releasing(grant), self._connections)

    def close_sync(self, error: BaseException | None) -> None:
        """As :meth:`close`, for a thread."""
        if self._closed or (self._generation != self._connections.generation and self._inherited()):
            return
        drive_sync(self._ending(error), self._connections)

    # -- the steps, for both ------------------------------------------------------------------

    def _acquiring(
        self, key: Hashable, timeout: float | None, newest: Newest | None = None
    ) -> Generator[Op, Any, Any]:
        """Take key (the first key: a connection for the session first); its grant.

        ``newest``: a turn of latest work shared across processes, which posts
        its process's newest work before it waits, and judges once granted
        (see _latest_turn).
        """
        if self._generation != self._connections.generation:
            self._adopt()  # (a turn nested, in a forked child, in its copy of the parent's)
        if self._closed:
            raise RuntimeError("inturn: this turn's session ended")
        connections = self._connections
        lock = lock_id(self._namespace, key)
        until = None if timeout is None else now() + timeout
        lease = self._lease
        if lease is None:
            tier = self._tier
            lease = self._lease = None if tier is None else connections.kept(tier)  # (fast verb)
            if lease is None:
                lease = self._lease = yield from connections.taking(key, timeout, until, tier)
        names = connections.ready.names
        # the key's name, sent ahead of its wait (once per key per process: see _lines)
        record = names.record(key, lock, self._namespace) if names.due(lock) else None
        remake = False
        if record is not None and (not PIPELINES or newest is not None):
            # (libpq before 14, or a post goes ahead of the wait: a round trip first)
            ask = connections.ready.asking(
                lease.connection, key, timeout, until, True, "recording the key's name"
            )
            record.outcome = yield from ask(b";".join(record.statements))
            remake, record = names.recorded(key, lock, record), None
        if newest is None:
            answer = yield from self._waited(key, lock, timeout, until, record, remake)
        else:
            turn = LatestTurn(
                connections,
                self._namespace,
                lease,
                key,
                lock,
                (timeout, until),
                newest,
                lambda ahead, remake: self._waited(key, lock, timeout, until, ahead, remake),
                lambda answer: self._refusal(key, timeout, until, answer),
            )
            answer = yield from turn.taking(remake)
        grant = PostgresGrant(
            key, self._token(key, answer, timeout), lock, self, newest is not None
        )
        self._grants.append(grant)
        lease.unsure = None
        if self._transaction and len(self._grants) >= self._count:
            yield (AUTOCOMMIT, lease.connection, False)  # (the work's first statement begins it)
        return grant

    def _waited(
        self,
        key: Hashable,
        lock: int,
        timeout: float | None,
        until: float | None,
        ahead: Record | Ahead | None,
        remake: bool,
    ) -> Generator[Op, Any, Rows]:
        """Wait for lock on the session's connection: the rows of its grant (``ahead``: the
        key's record, or a post, sent ahead of the wait; ``remake``: its record found the
        tables gone)."""
        connections = self._connections
        lease = self._lease
        assert lease is not None
        grants = self._grants
        held = bool(grants) and lock in [grant.lock for grant in grants]
        last = self._transaction and len(grants) + 1 >= self._count
        limits = connections.limits
        answer = yield from waiting(lease, lock, timeout, until, held, last, limits, ahead)
        if isinstance(ahead, Record):
            remake = connections.ready.names.recorded(key, lock, ahead)
        if not isinstance(answer, list):
            if ahead is not None:
                ahead.after = None  # (what was sent behind ran after the wait that failed)
            answer = yield from self._again(key, lock, timeout, until, held, last, answer)
        if not answer:  # timeout=0, and the key was busy
            lease.unsure = None
            raise missed((key,), Waited.LINE, timeout)
        if remake and (until is None or now() < until):
            # the tables were dropped meanwhile: made again before the work (rare; with no
            # time left, by a later turn on a new key, as this key stays due)
            ask = connections.ready.asking(
                lease.connection, key, timeout, until, True, "recording the key's name"
            )
            yield from connections.ready.names.remaking(key, lock, self._namespace, ask)
        return answer

    def _again(
        self,
        key: Hashable,
        lock: int,
        timeout: float | None,
        until: float | None,
        held: bool,
        last: bool,
        answer: Outcome | None,
    ) -> Generator[Op, Any, Rows]:
        """After a wait that did not take lock: wait again on a connection readied again
        (its statements were deallocated by a pool's reset, or the sequence is gone after
        a restore), or raise why not."""
        connections = self._connections
        lease = self._lease
        assert lease is not None
        if isinstance(answer, errors.InvalidSqlStatementName | errors.UndefinedTable):
            readiness = connections.ready
            if isinstance(answer, errors.UndefinedTable):
                readiness.sequence_gone()
            lease.ready = None  # (if readying fails, the connection is not kept)
            lease.ready = yield from readiness.readying(lease.connection, key, timeout, until)
            answer = yield from waiting(lease, lock, timeout, until, held, last, connections.limits)
            if isinstance(answer, list):
                return answer
            if isinstance(answer, errors.InvalidSqlStatementName | errors.UndefinedTable):
                raise BackendUnavailable(
                    "inturn: the statements the backend prepared on its connection vanished "
                    f"twice while it took key {show(key)}; {_MOVED}; the work did not run"
                )
        raise self._refusal(key, timeout, until, answer)

    def _undoing(self) -> Generator[Op, Any, None]:
        """Give back the lock the session may hold without a grant (see Lease.unsure)."""
        lease = self._lease
        if lease is None:
            return
        unsure, lease.unsure = lease.unsure, None
        if unsure is None or lease.connection.pgconn.status != _OK:
            return
        lock, held = unsure
        until = now() + self._connections.limits.margin
        yield from giving_back(lease.connection, lock, UNSURE, held, until)

    def _releasing(self, grant: Grant) -> Generator[Op, Any, None]:
        """Unlock one grant of the session now."""
        if self._closed or self._inherited() or grant not in self._grants:
            return
        assert isinstance(grant, PostgresGrant)
        self._grants.remove(grant)
        connection = self._lease.connection if self._lease is not None else None
        if connection is None or connection.pgconn.status != _OK:
            grant.lost = True  # the session ended under it
            return
        until = now() + self._limits_wait()
        held, _ = yield from self._unlocking(connection, [grant], until)
        if held is None or not held[0]:
            grant.lost = True

    def _unlocking(
        self, connection: Any, grants: list[PostgresGrant], until: float
    ) -> Generator[Op, Any, Ended]:
        """Unlock grants' keys (see ending); a grant of latest work first takes its post away
        and records what ran, in a statement of its own sent ahead of the unlock, and lets
        its intent lock and fate lock go behind it (see _latest)."""
        locks = [grant.lock for grant in grants]
        latest = [grant for grant in grants if grant.latest]
        if not latest:  # (the usual)
            return (yield from ending(connection, locks, until))
        leaves = tuple(_latest.leave(self._namespace, grant.lock, grant.ran_) for grant in latest)
        let_go = tuple(_latest.let_go(grant.lock, self._pid) for grant in latest)
        ended, outcome = yield from _latest.unlocking(connection, locks, until, leaves, let_go)
        _latest.left(outcome, [grant.key for grant in latest])
        return ended

    def _ending(self, error: BaseException | None) -> Generator[Op, Any, None]:
        """End the turn: commit or roll back, unlock every key, give the connection back."""
        self._closed = True
        lease = self._lease
        if lease is None:
            return
        connection = lease.connection
        locks = [grant.lock for grant in self._grants]
        ended: Ended = (None, None)  # (the session ended under the turn)
        failure: BaseException | None = None
        try:
            if connection.pgconn.status != _OK:
                pass
            elif self._transaction:
                pid = lease.ready.pid if lease.ready is not None else 0
                limits = self._connections.limits
                ended, failure = yield from ending_transaction(
                    connection, locks, error is None, pid, limits
                )
            elif locks:
                until = now() + self._connections.limits.unreachable_after
                ended = yield from self._unlocking(connection, self._grants, until)
        except BaseException:  # a thread interrupted meanwhile: held until now, so not lost
            ended = ([True] * len(locks), None)
            raise
        finally:
            self._unlocked(ended)
        if failure is not None:
            raise failure

    def _limits_wait(self) -> float:
        return self._connections.limits.unreachable_after

    # -- both ---------------------------------------------------------------------------------

    def _adopt(self) -> None:
        """(In a forked child.) Leave what the parent holds; start afresh in this process."""
        self._inherited()
        self._closed = False
        self._busy = None
        self._pid = 0
        self._generation = self._connections.generation

    def _inherited(self) -> bool:
        """In a forked child, a session of the parent's: what it holds is left alone.

        The child never speaks on the parent's connection (its locks are the
        parent's); its own part of the turn ends without a word to the server.
        """
        if self._generation == self._connections.generation:
            return False
        self._closed = True
        self._lease = None
        self._grants = []
        return True

    def _refusal(
        self, key: Hashable, timeout: float | None, until: float | None, answer: Outcome | None
    ) -> Exception:
        """Why a wait did not take its lock (the lock is not kept: see waiting())."""
        if isinstance(answer, errors.LockNotAvailable):
            return missed((key,), Waited.LINE, timeout)
        if answer is None and until is not None and now() >= until:
            return missed((key,), Waited.ANSWER, timeout, " from PostgreSQL")
        if answer is None:
            wait = self._limits_wait()
            return BackendUnavailable(
                f"inturn: PostgreSQL did not answer the wait for key {show(key)}, nor a check "
                f"on a new connection, within {wait:g} s each; its connection was closed, and "
                "the work did not run"
            )
        assert isinstance(answer, psycopg.Error)
        reason = said(answer)
        fix = ""
        if isinstance(answer, errors.InsufficientPrivilege):
            fix = (
                f"; the user needs USAGE on the sequence of fencing tokens: GRANT USAGE ON "
                f"SEQUENCE {_sql.SEQUENCE} TO ..."
            )
        what = "lost its session during" if lost(answer) else "failed"
        failure = BackendUnavailable(
            f"inturn: PostgreSQL {what} the wait for key {show(key)} ({reason}){fix}; "
            "the work did not run"
        )
        failure.__cause__ = answer
        return failure

    def _token(self, key: Hashable, rows: Rows, timeout: float | None) -> int:
        """The token of a granted wait (its rows); checks that the server session is the same."""
        if not rows:  # timeout=0, and the key was busy
            raise missed((key,), Waited.LINE, timeout)
        token, pid = int(rows[0][0] or 0), int(rows[0][1] or 0)
        if self._pid and pid != self._pid:
            logger.error("inturn: %s", _MOVED)
            raise BackendUnavailable(
                f"inturn: {_MOVED}; the work did not run, and the server session "
                f"{pid} may hold key {show(key)} until the pooler closes it"
            )
        self._pid = pid
        return token

    def _unlocked(self, ended: Ended) -> None:
        """Mark lost each grant whose key was not held to the end; give the connection back."""
        held, pid = ended
        grants, self._grants = self._grants, []
        for n, grant in enumerate(grants):
            if held is None or n >= len(held) or not held[n]:
                grant.lost = True  # the session ended or was reset under it, or it is unknown
        if pid is not None and self._pid and pid != self._pid:
            logger.error(
                "inturn: %s; the turn on %s was not exclusive, and the server session %d "
                "may hold it until the pooler closes it",
                _MOVED,
                ", ".join(show(grant.key) for grant in grants),
                self._pid,
            )
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.give_back()


def _forward(source: asyncio.Future[Any], target: asyncio.Future[Any]) -> None:
    """Settle target as source settles (source: an ending, which settles by itself)."""

    def settle(done: asyncio.Future[Any]) -> None:
        if target.done():
            if not done.cancelled():
                done.exception()  # (retrieved: the caller gave up)
            return
        if done.cancelled():
            target.cancel()
        elif (error := done.exception()) is not None:
            target.set_exception(error)
        else:
            target.set_result(None)

    source.add_done_callback(settle)
