"""One turn of latest work shared across processes on a PostgreSQL session, as steps.

What ``PgSession._acquiring`` runs instead of a plain wait for a turn of
latest work (see ``_latest`` for what the table and the locks hold): post,
wait for the key, judge by the backends' rule, and, as the rule says, run,
stand by behind newer work, join the line again, or leave (Replaced). The
session lends it its connection and two of its steps (the wait, and the
error of a wait that did not take the key).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Hashable
from typing import TYPE_CHECKING, Any, final

import psycopg
from psycopg import errors

from ..._checks import Waited, missed
from .._base import Replaced
from .._judge import judge
from .._stamps import Stamp
from . import _latest, _sql
from ._keys import fate_id
from ._steps import ASK, CLOSE, Op, now, waiting
from ._wire import PIPELINES, Ahead

if TYPE_CHECKING:
    from .._base import Newest
    from ._connections import Connections
    from ._places import Lease
    from ._wire import Outcome, Rows

_OK = psycopg.pq.ConnStatus.OK

#: The session's wait for the key: (ahead, remake) -> its grant's rows (see PgSession).
Wait = Callable[[Ahead | None, bool], Generator[Op, Any, "Rows"]]
#: The error of a wait that did not take the key (its outcome).
Refusal = Callable[["Outcome | None"], Exception]


@final
class LatestTurn:
    """A turn of latest work on key (its lock), on a session's lease (see the module)."""

    __slots__ = (
        "connections",
        "key",
        "lease",
        "lock",
        "namespace",
        "newest",
        "pid",
        "refusal",
        "timeout",
        "until",
        "wait",
    )

    def __init__(
        self,
        connections: Connections,
        namespace: str,
        lease: Lease,
        key: Hashable,
        lock: int,
        times: tuple[float | None, float | None],
        newest: Newest,
        wait: Wait,
        refusal: Refusal,
    ) -> None:
        assert lease.ready is not None
        self.connections = connections
        self.namespace = namespace
        self.lease = lease
        self.pid = lease.ready.pid  # its server session (its fate lock's)
        self.key = key
        self.lock = lock
        self.timeout, self.until = times  # the turn's, and when it runs out (monotonic)
        self.newest = newest
        self.wait = wait
        self.refusal = refusal

    def taking(self, remake: bool) -> Generator[Op, Any, Rows]:
        """Post, wait for the key, judge: the rows of the grant the work runs on. A turn
        that will not run takes its post away (``remake``: see PgSession._waited).

        :raises ~inturn.backends.Replaced: newer work ran; the key is not held.
        """
        try:
            ahead = yield from self._posting(self.newest(), True)
            try:
                rows = yield from self.wait(ahead, remake)
            except Exception:
                if ahead is not None and isinstance(ahead.outcome, psycopg.Error):
                    self._posts(ahead)  # (its post failed: that is what the caller is told)
                raise
            return (yield from self._judging(rows, self._posts(ahead)))
        except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
            raise
        except Replaced:
            raise  # (its post was taken away: see _judging)
        except BaseException:
            yield from self._unposting()
            raise

    def _posting(
        self, called: int, first: bool, unless: Stamp | None = None
    ) -> Generator[Op, Any, Ahead | None]:
        """This session's post (``first``: its turn's first, which takes the locks), and its
        JUDGE behind: to send with its wait (``unless``: a standby's, with when its call was
        made: see _sql.judging).

        A first post goes in a round trip of its own until one went through
        (the table missing, or a right, is said before the wait; a table
        dropped meanwhile is made again), as every post does without
        pipelines (libpq before 14, when the JUDGE goes after the wait: None).
        """
        fate = fate_id(self.lock, self.pid)
        statement = _latest.post(
            self.namespace, self.lock, called, not first, fate if first else None
        )
        ready = self.connections.ready
        answered = None if unless is None else (unless.clock, unless.mono, unless.server, fate)
        behind = (_sql.judging(self.namespace, self.lock, answered),)
        if PIPELINES and (not first or ready.posted):
            return Ahead((statement,), behind)
        ask = self._asking("posting latest work")
        outcome = yield from ask(statement)
        if isinstance(outcome, errors.UndefinedTable):  # (dropped: made again, if it may)
            ready.names.made((yield from ask(_sql.MAKE_TABLES)))
            outcome = yield from ask(statement)
        _latest.posted(outcome, self.key)
        ready.posted = True
        return Ahead((), behind) if PIPELINES else None

    def _posts(self, ahead: Ahead | None) -> Outcome | None:
        """What was sent behind a wait (its JUDGE), once its post went through (see
        _latest.posted; one that failed sends the next first post alone, see _posting)."""
        if ahead is None:
            return None
        if ahead.statements:
            if not isinstance(ahead.outcome, list):
                self.connections.ready.posted = False
            _latest.posted(ahead.outcome, self.key)
        return ahead.after

    def _asking(self, doing: str) -> Callable[..., Generator[Op, Any, Any]]:
        """ask(sql): one statement of the turn on its connection, by the turn's time."""
        connection = self.lease.connection
        return self.connections.ready.asking(
            connection, self.key, self.timeout, self.until, True, doing
        )

    def _judging(self, rows: Rows, judged: Outcome | None) -> Generator[Op, Any, Rows]:
        """Granted (rows; judged: its JUDGE's outcome, if it was sent behind the wait):
        judge, by the backends' rule; the rows of the grant it runs on.

        Where the rule says to join the line again behind newer work, the turn
        stands by on the newest's fate lock, and once that turn ended, is
        answered (newer work ran) or joins the key's line again (see _latest).

        :raises ~inturn.backends.Replaced: newer work ran; the post (and the key,
            if it held it) was given back.
        """
        lease, key, lock, timeout, until = self.lease, self.key, self.lock, self.timeout, self.until
        limits = self.connections.limits
        ask = self._asking("judging latest work")
        again = dying = 0
        holding = True  # (False: it stood by, and holds no key)
        target: int | None = None  # the server session of the turn it stood by behind
        while True:
            if judged is None or isinstance(judged, Exception):  # (not sent behind)
                judged = yield from ask(_sql.judging(self.namespace, lock))
            found, behind, left = _latest.judged(judged, key)
            called, seen = self.newest(), time.monotonic_ns()
            me = found.me(called, seen)
            if (
                target is not None
                and dying < _latest.DYING
                and any(waiting.pid == target for waiting in behind)
            ):
                dying += 1  # (its session is ending: see _latest)
                again -= 1  # (standing by behind it again is not counted)
            verdict = judge(found.ran, me, again, found.behind, _latest.alive)
            if not isinstance(verdict, bool):  # newer work ran
                if not left:  # (else it was taken away as it woke)
                    yield from self._leaving(holding)
                raise Replaced(key, verdict.called.local(found.now_us, seen), verdict.ok)
            if verdict and holding:
                return rows
            newer = [waiting for waiting in behind if waiting.post.called > me]
            if not verdict:
                again += 1
            if not verdict and newer and timeout != 0:
                # stand by until the newest turn behind ends (its post and its locks go as
                # it wakes, if newer work than its call ran: see _sql.judging)
                ahead = yield from self._posting(called, left, me)
                target = _latest.newest_of(newer).pid
                wait = None if until is None else max(0.0, until - now())
                sql = _sql.standing_by(lock if holding else None, fate_id(lock, target), wait)
                lease.unsure = None
                answer = yield from _latest.standing_by(
                    lease.connection, self.pid, sql, ahead, until, limits
                )
                if not isinstance(answer, list | errors.DeadlockDetected):
                    raise self.refusal(answer)
                holding = False
            else:  # join the key's line again (giving it up first, in the same statement)
                ahead = yield from self._posting(called, left)
                answer = yield from waiting(
                    lease, lock, timeout, until, False, False, limits, ahead, again=holding
                )
                if not isinstance(answer, list):
                    raise self.refusal(answer)
                if not answer:  # timeout=0, and the key was busy
                    lease.unsure = None
                    raise missed((key,), Waited.LINE, timeout)
                holding, rows, target = True, answer, None
            judged = self._posts(ahead)

    def _leaving(self, holding: bool) -> Generator[Op, Any, None]:
        """Newer work ran: the post away, and the key if it holds it, in one round trip;
        its locks go after."""
        if not holding:
            yield from self._unposting()
            return
        lease = self.lease
        until = now() + self.connections.limits.margin
        leave = _latest.leave(self.namespace, self.lock, None)
        let_go = _latest.let_go(self.lock, self.pid)
        yield from _latest.unlocking(lease.connection, [self.lock], until, (leave,), (let_go,))
        lease.unsure = None

    def _unposting(self) -> Generator[Op, Any, None]:
        """Take the post away, then let its locks go (a turn that will not run); a connection
        that cannot is closed (its session ends, and its locks with it)."""
        connection = self.lease.connection
        if connection.pgconn.status != _OK:
            return
        until = now() + self.connections.limits.margin
        leave = _latest.leave(self.namespace, self.lock, None)
        let_go = _latest.let_go(self.lock, self.pid)
        try:
            if PIPELINES:
                answer = yield (ASK, connection, let_go, None, False, until, Ahead((leave,)))
            else:
                answer = yield (ASK, connection, leave, None, False, until)
                if isinstance(answer, list):
                    answer = yield (ASK, connection, let_go, None, False, until)
        except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
            raise
        except BaseException:  # interrupted again: end the session, and its locks with it
            yield (CLOSE, connection)
            raise
        if not isinstance(answer, list):
            yield (CLOSE, connection)
