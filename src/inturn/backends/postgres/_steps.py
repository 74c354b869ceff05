"""The PostgreSQL backend's protocol, written once as steps for two drivers.

Each operation of the backend (take a connection, ready it, wait for a
lock, give back a lock a failed wait may hold, end a turn) is a generator
that yields the I/O it needs as an *op* (a tuple whose first item is one of
the verbs below) and is sent the op's answer; :mod:`._drive` performs
the ops for a task (callbacks on the event loop) or for a thread (blocking,
with deadlines). Nothing here does I/O, and nothing here knows which driver
runs it. An interrupt of the caller (a task's cancellation, a signal
handler's exception in a thread) is thrown in at the op it waited on; the
steps then give back what the interrupted op may have taken, and re-raise.

Times are ``time.monotonic()`` seconds; every wait has a bound, or is
checked every ``unreachable_after`` seconds (see :class:`Limits`).

The ops and their answers:

- ``(ASK, connection, sql, params, prepared, until[, ahead])``: send a
  statement now (see :func:`._wire.send`; ``ahead``, a :class:`._wire.Ahead`:
  with those statements ahead of it in the same round trip, their outcome
  put in it); its outcome (rows, or its psycopg error: the
  ``OperationalError`` of one that could not be sent), or None if it did
  not come by ``until`` (None: no bound).
- ``(ANSWER, until)``: as ASK, for the statement asked last, still running.
  Asked again after a wait given up on, it gives the outcome kept meanwhile.
- ``(CANCEL, connection, until)``: ask the server to cancel the statement in
  flight (a cancel request on a connection of its own); None.
- ``(CLOSE, connection)``: close connection now (its session ends, and its
  locks with it); None.
- ``(PROBE, pid, until)``: whether server session pid still runs a statement, asked
  on a new connection; False if no answer came by ``until``.
- ``(AUTOCOMMIT, connection, on)``: psycopg's autocommit for the work; None.
- ``(SLOT, lease, until)``: one of the process's connection slots for
  ``lease``'s tier, waiting while all are taken, until ``until`` and for
  ``session_wait`` at most; whether one was taken (it is then the lease's).
- ``(CONNECT, lease, until)``: a new connection for lease; None, or the
  error that kept it from being made.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Generator
from typing import Any, Final, final

import psycopg
from psycopg import errors

from ..._errors import BackendUnavailable
from . import _sql
from ._wire import Ahead, Outcome, Rows

ASK: Final = 0
ANSWER: Final = 1
CANCEL: Final = 2
CLOSE: Final = 3
PROBE: Final = 4
AUTOCOMMIT: Final = 5
SLOT: Final = 6
CONNECT: Final = 7

_OK: Final = psycopg.pq.ConnStatus.OK
_IDLE: Final = psycopg.pq.TransactionStatus.IDLE
_IN_ERROR: Final = psycopg.pq.TransactionStatus.INERROR
_ACTIVE: Final = psycopg.pq.TransactionStatus.ACTIVE

#: An op: a verb, then its arguments.
Op = tuple[Any, ...]
#: An operation written as steps, returning T.
Steps = Generator[Op, Any, Any]


@final
class Limits:
    """The backend's bounds on what it waits for (seconds)."""

    __slots__ = ("margin", "session_wait", "unreachable_after")

    def __init__(self, session_wait: float | None, unreachable_after: float) -> None:
        #: How long a turn waits for a connection slot when all are taken (None: no bound).
        self.session_wait = session_wait
        #: How long a statement may go unanswered before the server is checked (or, for
        #: a statement that should answer at once, counted as unreachable).
        self.unreachable_after = unreachable_after
        #: What a turn may take beyond its timeout: half for the server's own
        #: lock_timeout answer to arrive, the rest to call the wait off.
        self.margin = 1.0


#: The clock of every bound: ``time.monotonic()`` (an event loop's ``time()`` may be
#: another, as uvloop's is).
now: Final = time.monotonic


def lost(outcome: Outcome | None) -> bool:
    """Whether an outcome says the connection itself is gone (its session with it).

    The client's own connection errors have no SQLSTATE; the server's that
    end a session are class 08 (connection) and 57P (shut down, terminated).
    Other ``OperationalError`` s (``QueryCanceled``, ``LockNotAvailable``) leave
    the session as it was.
    """
    if not isinstance(outcome, psycopg.OperationalError):
        return False
    state = outcome.sqlstate
    return state is None or state.startswith(("08", "57P"))


def first_check(bound: float | None, limits: Limits) -> float:
    """How long to wait for an answer before checking the server: bound, at most
    ``unreachable_after`` from now."""
    check = now() + limits.unreachable_after
    return check if bound is None or bound > check else bound


def checking(pid: int, bound: float | None, limits: Limits) -> Generator[Op, Any, Outcome | None]:
    """The outcome of the statement in flight, which did not come by its first check:
    while none comes, check every ``unreachable_after`` that the server still runs it in
    session pid (None: no answer by bound, or the server is not there)."""
    while bound is None or now() < bound:
        if not (yield (PROBE, pid, first_check(bound, limits))):
            # (the statement may have ended just now, its answer on the way)
            last: Outcome | None = yield (ANSWER, now() + limits.margin / 2)
            return last
        answer: Outcome | None = yield (ANSWER, first_check(bound, limits))
        if answer is not None:
            return answer
    return None


def waiting(
    lease: Any,
    lock: int,
    timeout: float | None,
    until: float | None,
    held: bool,
    last: bool,
    limits: Limits,
    ahead: Ahead | None = None,
    again: bool = False,
) -> Generator[Op, Any, Outcome | None]:
    """Wait for lock on the lease's connection, by ``until``: the outcome of the waiting
    statement (rows: granted; an error: not granted, and given back if it may have
    been), or None if no answer came (by ``until`` plus half the margin, or from a
    server that is not there).

    ``held``: the session holds lock already (two keys of one digest); ``last``: the
    last key of a transaction turn, whose work gets the role's timeouts back;
    ``ahead``: statements sent ahead of the wait in its round trip (the key's record, or
    a post of latest work), whose outcome, if it came, is in it when this returns (or
    raises); ``again``: the session holds lock, and gives it up as the wait begins (a turn
    of latest work joins its line again, see _latest).
    The lock is never kept when this does not return rows: a wait that failed after
    its grant, or that was given up on (no answer, an interrupt), is called off by
    :func:`giving_back`, within the margin. ``lease.unsure`` names the lock while
    that is not settled (an interrupt between two ops escapes the steps: the caller
    gives it back then); the caller clears it once it took the rows.
    """
    connection, ready = lease.connection, lease.ready
    if until is None:
        bound = left = None
        check = now() + limits.unreachable_after
    else:
        check = now()
        left = until - check if until > check else 0.0
        bound = until + limits.margin / 2
        check += limits.unreachable_after
        if bound < check:
            check = bound
    sql, params, prepared = _sql.waiting(
        lock, timeout, left, ready.role_timeouts if last else None, again
    )
    answer: Outcome | None
    lease.unsure = (lock, held)  # (until the outcome is taken: by the caller, if rows)
    try:
        answer = yield (ASK, connection, sql, params, prepared, check, ahead)
        if answer is None:
            answer = yield from checking(ready.pid, bound, limits)
    except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
        raise
    except BaseException:  # interrupted: the lock may come, or have come, all the same
        yield from giving_back(connection, lock, None, held, now() + limits.margin)
        lease.unsure = None
        raise
    if answer is None:
        # the turn's time ran out (the server's lock_timeout should have answered), or
        # the server is not there: give up on it
        end = now() + limits.margin / 2 if until is None else until + limits.margin
        yield from giving_back(connection, lock, None, held, end)
        lease.unsure = None
    elif not isinstance(answer, list):
        if not lost(answer):
            yield from giving_back(connection, lock, answer, held, now() + limits.margin)
        lease.unsure = None
    return answer


#: The outcome of a wait whose answer was not taken (an interrupt between two ops):
#: for :func:`giving_back`, whose lock may or may not be held.
UNSURE: Final = psycopg.DatabaseError("inturn: the outcome of a wait was not taken")


def giving_back(
    connection: Any, lock: int, answer: Outcome | None, held: bool, until: float
) -> Generator[Op, Any, None]:
    """Make sure connection's session does not keep lock after a wait that will not be used.

    ``answer``: the wait's outcome if known (None: it may still be running);
    ``held``: whether the session held lock already before the wait (two keys
    of one digest): then one hold cannot be told from the other, and the
    session is ended. Whatever cannot be done by until ends the session too:
    a connection is never kept holding a lock nobody uses.
    """
    try:
        if answer is None:
            answer = yield (ANSWER, now())  # (in already?)
        if answer is None:
            yield (CANCEL, connection, until)
            answer = yield (ANSWER, until)
        if answer is None or held:
            yield (CLOSE, connection)
            return
        if lost(answer) or isinstance(
            answer, errors.LockNotAvailable | errors.InvalidSqlStatementName
        ):
            return  # the session is gone, or the lock was certainly not granted
        if isinstance(answer, list):
            if not answer:
                return  # timeout=0, and the key was busy
            undo = (*_sql.unlocking([lock]), True)
        else:  # it failed after the grant, or where: ask the server
            undo = (_sql.UNDO, _sql.undoing(lock), False)
        undone = yield (ASK, connection, *undo, until)
        if not isinstance(undone, list):
            yield (CLOSE, connection)
    except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
        raise
    except BaseException:  # interrupted again: end the session, and its locks with it
        yield (CLOSE, connection)
        raise


#: What the end of a turn learnt: whether each lock was still held (None: unknown,
#: the session is gone or did not answer in time), and the server session that said
#: so (None: not asked).
Ended = tuple[list[bool] | None, int | None]


def ending(
    connection: Any, locks: list[int], until: float, ahead: Ahead | None = None
) -> Generator[Op, Any, Ended]:
    """Unlock locks: the end of a turn, or a grant given back early.

    A session that is gone, or could not answer by until, is ended here (a
    connection is never kept holding a lock); whether its keys were held
    until now is then unknown. ``ahead``: statements sent ahead of the unlock
    in its round trip (what latest work ran, see _latest), whose outcome is
    in it when this returns.
    """
    sql, params = _sql.unlocking(locks)
    try:
        answer = yield (ASK, connection, sql, params, True, until, ahead)
        if isinstance(answer, errors.InvalidSqlStatementName):  # deallocated (a pool's reset)
            params = _sql.unlocking_array(locks)
            answer = yield (ASK, connection, _sql.UNLOCK_SQL, params, False, until)
    except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
        raise
    except BaseException:  # a thread interrupted meanwhile: the session ends with its locks
        yield (CLOSE, connection)
        raise
    if isinstance(answer, list):
        return _held(answer)
    return (yield from _unlocked(connection, answer, len(locks)))


def ending_transaction(
    connection: Any, locks: list[int], commit: bool, pid: int, limits: Limits
) -> Generator[Op, Any, tuple[Ended, BaseException | None]]:
    """End a transaction turn: COMMIT (or ROLLBACK), then unlock locks and reset the
    session (see :func:`._sql.resetting`); returns what :func:`ending` does, and
    the error to raise after the work, if any."""
    try:
        failure, alive = yield from _finishing(connection, commit, pid, limits)
        if _ended(connection):  # (closed here, alive until then: its keys were held)
            return ([True] * len(locks) if alive else None, None), failure
        yield (AUTOCOMMIT, connection, True)
        reset = _sql.resetting(locks, connection.info.server_version)
        answer = yield (ASK, connection, reset, None, False, now() + limits.unreachable_after)
    except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
        raise
    except BaseException:  # a thread interrupted meanwhile: the session ends with its locks
        yield (CLOSE, connection)
        raise
    if isinstance(answer, list):
        answer = answer[: len(locks)]  # (the rest: pg_advisory_unlock_all's)
    return (yield from _unlocked(connection, answer, len(locks))), failure


def _held(rows: Rows) -> Ended:
    """What the rows of an unlock say: whether each lock was held; the server session."""
    return [row[0] == b"t" for row in rows], int(rows[0][1] or 0) if rows else None


def _unlocked(connection: Any, answer: Outcome | None, count: int) -> Generator[Op, Any, Ended]:
    """What an unlock's outcome says; a session that did not say it is ended."""
    if isinstance(answer, list):
        return _held(answer)
    yield (CLOSE, connection)
    if answer is None or lost(answer):
        return None, None
    # refused (a cancel request that came late, an administrator's): the session lived
    # until now, and its locks end with it
    return [True] * count, None


def _finishing(
    connection: Any, commit: bool, pid: int, limits: Limits
) -> Generator[Op, Any, tuple[BaseException | None, bool]]:
    """COMMIT, or ROLLBACK (asked for, or a statement failed): the error to raise, if any,
    and whether the connection was closed here while its session was alive.

    A COMMIT may take long (a large transaction, a synchronous standby): it
    is checked, not bounded (see :func:`checking`).
    """
    pgconn = connection.pgconn
    status = pgconn.transaction_status
    if _ended(connection):
        if not commit:
            return None, False
        return BackendUnavailable(
            "inturn: the connection of the turn's transaction was lost before it could "
            "commit; the server rolled the work's writes back, and the keys were freed"
        ), False
    if status == _IDLE:
        return None, False  # the work ran no statement
    if status == _ACTIVE:  # the work left a statement running: nothing else can be sent
        yield (CLOSE, connection)  # (the server rolls back as the session ends)
        return psycopg.OperationalError(
            "inturn: the turn's work left a statement running on turn.connection (an "
            "unfinished stream() or cursor), so its transaction could not end: none of its "
            "writes were kept; the connection was closed, and the keys were freed"
        ), True
    answer: Outcome | None
    if not commit or status == _IN_ERROR:
        answer = yield (ASK, connection, b"ROLLBACK", None, False, now() + limits.unreachable_after)
        alive = not (answer is None or lost(answer))
        if not isinstance(answer, list):
            yield (CLOSE, connection)  # (the server rolls back as the session ends)
        if commit:  # the work swallowed a failed statement: nothing of it was kept
            return errors.InFailedSqlTransaction(
                "inturn: a statement of the turn's transaction failed and the work went on; "
                "the transaction was rolled back, so none of its writes were kept"
            ), alive
        return None, alive
    answer = yield (ASK, connection, b"COMMIT", None, False, first_check(None, limits))
    if answer is None:
        answer = yield from checking(pid, None, limits)
    if isinstance(answer, list):
        return None, False
    if answer is None or lost(answer):
        yield (CLOSE, connection)
        why = "no answer came" if answer is None else said(answer)
        return BackendUnavailable(
            f"inturn: the connection was lost at COMMIT ({why}): whether the turn's writes "
            "were kept is unknown; the keys were freed"
        ), False
    refused: psycopg.Error = answer
    if sys.version_info >= (3, 11):  # pragma: no branch
        refused.add_note("inturn: the work ran, but its transaction did not commit")
    return refused, False


def _ended(connection: Any) -> bool:
    """Whether connection's session is over (closed here, or lost)."""
    return bool(connection.pgconn.status != _OK)


def said(error: psycopg.Error) -> str:
    """What PostgreSQL or the connection said, on one line, with its SQLSTATE."""
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{error.sqlstate}: {text}" if error.sqlstate else text
