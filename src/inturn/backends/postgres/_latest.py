"""Latest work shared across processes on PostgreSQL (``across="processes"``).

The rule is the backends' (``backends/_judge.py``); here is how PostgreSQL
keeps what it judges, in the table ``inturn_latest`` beside the advisory
locks (see ``_sql``):

- A turn of latest work *posts* before it waits: a row of its server
  session (``pid``) with when its process's newest work was called, and
  whether the post is fresh. Its first post also takes the key's *intent
  lock*, a shared advisory lock that the session holds until the turn ends,
  and the turn's fate lock (below).
- A post counts while its session holds the key's intent lock (``pg_locks``
  says so). A session ends with its client's process (the server sees the socket
  close; a waiter, within ``client_connection_check_interval``), and its
  locks with it, so a post of a process that died no longer counts.
- What ran last is the row of pid 0, written by the holder's release in a
  statement of its own before the unlock, so every turn granted after it
  reads it. It stays when the line empties (tidied with the key's name).
- A turn that finds newer work behind it (the rule says: join again,
  behind it) *stands by* instead: in one statement, it gives the key up and
  waits until the newest of those turns ends, on that turn's *fate lock*
  (an exclusive advisory lock each turn of latest work holds from its first
  post to its end; the standby takes it shared, and lets it go at once).
  Every turn that stands by behind one newer turn wakes when it ends, at
  once, without taking the key again: the newer work ran (they are
  answered: Replaced, by the JUDGE that rides behind the standby, which
  also takes the post away and lets the locks go in the same statement),
  or it did not (its process died, or its caller gave up), and they join
  the key's line again with a fresh post. Its post
  counts meanwhile (it holds the intent lock). So a burst spread over N
  processes hands the key on N times, not 2N. (A turn whose post goes
  away takes it away before it lets its locks go, so a turn woken from
  standing by sees what it did; a session that ends lets its locks go one
  by one, so a standby may wake while the post of the turn it stood by
  behind still counts: it stands by again, uncounted, up to :data:`DYING`
  times.)
- Joining the line again (for posts that may not be fresh, or after a
  standby) is one statement: the unlock, if it holds the key, then the
  wait, in the server, so the session is in line again a few microseconds
  after it let go (its fresh post is written first).
- A wait's JUDGE is sent behind it in the same round trip (see
  ``_wire.Ahead``): the server reads the line the moment it grants the lock
  (or wakes a standby), and the client learns both at once.

Times: see ``backends/_stamps.py`` (PostgreSQL's ``clock_timestamp()`` is the
server's clock).
"""

from __future__ import annotations

import time
from collections.abc import Generator, Hashable
from typing import Any, Final, NamedTuple

import psycopg
from psycopg import errors

from ..._describe import describe as show
from ..._errors import BackendUnavailable
from .._stamps import CLOCK, Judged, Post, Ran, Stamp
from . import _sql
from ._keys import fate_id
from ._ready import logger
from ._steps import ASK, CLOSE, Ended, Limits, Op, checking, ending, now, said
from ._wire import PIPELINES, Ahead, Outcome, Rows

_OK: Final = psycopg.pq.ConnStatus.OK

#: How many times a turn that stood by behind one whose fate lock came free, whose post still
#: counts (its session is ending: its locks go one by one), stands by again uncounted.
DYING: Final = 100

#: What a user is told to run when the table is missing, or may not be written.
_FIX: Final = (
    f"an owner makes it with the SQL in the docs (docs/backends.md), and grants SELECT, "
    f"INSERT, UPDATE, DELETE ON {_sql.LATEST} to this user"
)


def post(namespace: str, lock: int, called: int, fresh: bool, fate: int | None) -> bytes:
    """This session's post of a call made at ``called`` (monotonic ns), to send ahead of its
    wait (``fate``: its turn's first post, which takes the intent lock and that fate lock)."""
    age = (time.monotonic_ns() - called) // 1000
    return _sql.posting(namespace, lock, CLOCK, called, age, fresh, fate)


def leave(namespace: str, lock: int, ran: tuple[int, bool] | None) -> bytes:
    """The statement that takes this session's post on lock away, and records what ran
    (``ran``: its call's time, monotonic ns, and whether it returned), if it ran; its
    locks go after it, with :func:`let_go`."""
    if ran is None:
        return _sql.leaving(namespace, lock, None)
    called, ok = ran
    age = (time.monotonic_ns() - called) // 1000
    return _sql.leaving(namespace, lock, (CLOCK, called, age, ok))


def let_go(lock: int, pid: int) -> bytes:
    """The statement that lets server session pid's intent lock and fate lock on lock go."""
    return _sql.letting_go(lock, fate_id(lock, pid))


def posted(outcome: Outcome | None, key: Hashable) -> None:
    """Check the outcome of a post (or a leave, before the wait: None, it never came).

    :raises ~inturn.BackendUnavailable: it failed: the table is missing, or
        this user may not write it; the work did not run.
    """
    if isinstance(outcome, psycopg.Error) or outcome is None:
        why = "no answer" if outcome is None else said(outcome)
        raise BackendUnavailable(
            f"inturn: PostgreSQL could not record the latest work for key {show(key)} in "
            f"the table {_sql.LATEST} ({why}); if the table is missing or this user may not "
            f"write it, {_FIX}; the work did not run"
        )


def unlocking(
    connection: Any,
    locks: list[int],
    until: float,
    leaves: tuple[bytes, ...],
    let_go: tuple[bytes, ...],
) -> Generator[Op, Any, tuple[Ended, Outcome | None]]:
    """Unlock locks (see _steps.ending), turns of latest work among them taking their posts
    away (and recording what ran) in ``leaves``, committed ahead of the unlock, and letting
    their intent and fate locks go in ``let_go``, behind it; a connection whose locks did not
    go is closed (they go with its session). What ending learnt, and the leaves' outcome."""
    ahead = Ahead(leaves, let_go)
    if PIPELINES:
        ended = yield from ending(connection, locks, until, ahead)
    else:  # (libpq before 14: a round trip before, one after)
        ahead.outcome = yield (ASK, connection, b";".join(leaves), None, False, until)
        ended = yield from ending(connection, locks, until)
        ahead.after = yield (ASK, connection, b";".join(let_go), None, False, until)
    if not isinstance(ahead.after, list) and connection.pgconn.status == _OK:
        yield (CLOSE, connection)
    return ended, ahead.outcome


def left(outcome: Outcome | None, keys: list[Hashable]) -> None:
    """Log a release of latest work that could not record what ran (outcome: its leave's)."""
    if isinstance(outcome, list):
        return
    why = "no answer" if outcome is None else said(outcome)
    logger.error(
        "inturn: PostgreSQL could not record in the table %s what latest work ran on %s "
        "(%s): a turn of older work waiting behind it may run after it; %s",
        _sql.LATEST,
        ", ".join(show(key) for key in keys),
        why,
        _FIX,
    )


class Behind(NamedTuple):
    """A post in line behind the turn judged: its server session, and whether it waits for
    the key's lock (else it stands by, or is on its way into the line)."""

    post: Post
    pid: int
    waits: bool


def judged(outcome: Outcome | None, key: Hashable) -> tuple[Judged, list[Behind], bool]:
    """JUDGE's rows, read: what the turn judges by, the posts behind it, and whether its post
    was taken away, and its locks let go, as it judged (see _sql.judging: unless).

    :raises ~inturn.BackendUnavailable: JUDGE failed (the table is missing, or
        this user may not read it); the work did not run.
    """
    if not isinstance(outcome, list):
        why = "no answer" if outcome is None else said(outcome)
        raise BackendUnavailable(
            f"inturn: PostgreSQL could not read the latest work for key {show(key)} in the "
            f"table {_sql.LATEST} ({why}); if the table is missing or this user may not "
            f"read it, {_FIX}; the work did not run"
        )
    rows: Rows = outcome
    now_us = 0
    ran = None
    behind: list[Behind] = []
    left = False
    for kind, at, clock, mono, flag, waits, pid in rows:
        if kind == b"0":
            now_us = int(at or 0)
            continue
        if kind == b"3":
            left = True
            continue
        stamp = Stamp((clock or b"").decode("ascii"), int(mono or 0), int(at or 0))
        if kind == b"1":
            ran = Ran(stamp, flag == b"t")
        else:
            behind.append(Behind(Post(stamp, flag == b"t"), int(pid or 0), waits == b"t"))
    return Judged(now_us, ran, [waiting.post for waiting in behind]), behind, left


def newest_of(behind: list[Behind]) -> Behind:
    """The post of behind whose call is the newest (see ``_stamps.Stamp``)."""
    newest = behind[0]
    for waiting in behind[1:]:
        if waiting.post.called > newest.post.called:
            newest = waiting
    return newest


def alive(post: Post) -> bool:
    """Every post JUDGE returns counts (it returns only those of sessions in line)."""
    return True


def standing_by(
    connection: Any, pid: int, sql: bytes, ahead: Ahead | None, until: float | None, limits: Limits
) -> Generator[Op, Any, Outcome | None]:
    """Stand by (sql, see _sql.standing_by) by until: its outcome, rows once the turn it
    waits on ended (or ``DeadlockDetected``: turns of several hosts standing by on each
    other, whose calls' times the server could not order; or ``LockNotAvailable``: the
    time ran out), with ``ahead``'s in it. A connection that gave no answer (None), or
    failed otherwise, or a caller interrupted meanwhile (raised), is closed: its session
    ends, and its locks with it (it may hold the fate lock it waited on).
    """
    check = now() + limits.unreachable_after
    bound = None if until is None else until + limits.margin / 2
    if bound is not None and bound < check:
        check = bound
    try:
        answer: Outcome | None = yield (ASK, connection, sql, None, False, check, ahead)
        if answer is None:
            answer = yield from checking(pid, bound, limits)
    except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
        raise
    except BaseException:
        yield (CLOSE, connection)
        raise
    if isinstance(answer, list | errors.LockNotAvailable | errors.DeadlockDetected):
        return answer
    yield (CLOSE, connection)
    return answer
