"""Latest work shared across processes on PostgreSQL (``across="processes"``).

The rule is the backends' (``backends/_judge.py``); here is how PostgreSQL
keeps what it judges, in the table ``inturn_latest`` beside the advisory
locks (see ``_sql``):

- A turn of latest work *posts* before it waits: a row of its server
  session (``pid``) with when its process's newest work was called, and
  whether the post is fresh. Its first post also takes the key's *intent
  lock*, a shared advisory lock that the session holds until the turn ends.
- A post counts while its session holds the key's intent lock (or, if its
  post could not take it, waits for the key's lock: ``pg_locks`` says so).
  A session ends with its client's process (the server sees the socket
  close; a waiter, within ``client_connection_check_interval``), and its
  locks with it, so a post of a process that died no longer counts.
- What ran last is the row of pid 0, written by the holder's release in a
  statement of its own before the unlock, so every turn granted after it
  reads it. It stays when the line empties (tidied with the key's name).
- Joining the line again is one statement: the unlock, then the wait, in
  the server, so the session is in line again a few microseconds after it
  let go (its fresh post is written first). A turn that finds only posts
  whose sessions hold the intent lock but do not wait yet (between their
  post and their wait) joins again without counting it toward
  :data:`~inturn.backends._judge.AGAIN`, at most :data:`TRANSIT` times: it
  gives them the moment they need to queue.

Times: see ``backends/_stamps.py`` (PostgreSQL's ``clock_timestamp()`` is the
server's clock).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from typing import Final

import psycopg

from ..._describe import describe as show
from ..._errors import BackendUnavailable
from .._stamps import CLOCK, Judged, Post, Ran, Stamp
from . import _sql
from ._ready import logger
from ._steps import said
from ._wire import Ahead, Outcome, Rows

#: How many times a turn joins its line again, uncounted, for posts that do not wait yet
#: (see the module); past it, those count too.
TRANSIT: Final = 20

#: What a user is told to run when the table is missing, or may not be written.
_FIX: Final = (
    f"an owner makes it with the SQL in the docs (docs/backends.md), and grants SELECT, "
    f"INSERT, UPDATE, DELETE ON {_sql.LATEST} to this user"
)


def post(namespace: str, lock: int, called: int, fresh: bool, first: bool) -> Ahead:
    """This session's post of a call made at ``called`` (monotonic ns), to send ahead of its
    wait (``first``: its turn's first post, which takes the intent lock)."""
    age = (time.monotonic_ns() - called) // 1000
    return Ahead((_sql.posting(namespace, lock, CLOCK, called, age, fresh, first),))


def leave(namespace: str, lock: int, ran: tuple[int, bool] | None) -> bytes:
    """The statement that takes this session's post on lock away, and records what ran
    (``ran``: its call's time, monotonic ns, and whether it returned), if it ran."""
    if ran is None:
        return _sql.leaving(namespace, lock, None)
    called, ok = ran
    age = (time.monotonic_ns() - called) // 1000
    return _sql.leaving(namespace, lock, (CLOCK, called, age, ok))


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


def judged(outcome: Outcome, key: Hashable) -> tuple[Judged, list[Post]]:
    """JUDGE's rows, read: what the turn judges by, and the posts among them that wait.

    :raises ~inturn.BackendUnavailable: JUDGE failed (the table is missing, or
        this user may not read it); the work did not run.
    """
    if not isinstance(outcome, list):
        raise BackendUnavailable(
            f"inturn: PostgreSQL could not read the latest work for key {show(key)} in the "
            f"table {_sql.LATEST} ({said(outcome)}); if the table is missing or this user "
            f"may not read it, {_FIX}; the work did not run"
        )
    rows: Rows = outcome
    now_us = 0
    ran = None
    behind: list[Post] = []
    waiting: list[Post] = []
    for kind, at, clock, mono, flag, waits in rows:
        if kind == b"0":
            now_us = int(at or 0)
            continue
        stamp = Stamp((clock or b"").decode("ascii"), int(mono or 0), int(at or 0))
        if kind == b"1":
            ran = Ran(stamp, flag == b"t")
            continue
        behind.append(Post(stamp, flag == b"t"))
        if waits == b"t":
            waiting.append(behind[-1])
    return Judged(now_us, ran, behind), waiting


def alive(post: Post) -> bool:
    """Every post JUDGE returns counts (it returns only those of sessions in line)."""
    return True
