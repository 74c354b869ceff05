"""What the deployment tests' apps share: a counter per SQLite row, and the queue chosen by env.

The environment says which queue guards the counters:

- ``INTURN_DEPLOY_BACKEND``: ``file`` (a FileBackend in ``INTURN_DEPLOY_DIRECTORY``),
  ``redis`` (a RedisBackend on ``INTURN_DEPLOY_REDIS_URL``, namespace
  ``INTURN_DEPLOY_NAMESPACE``), ``local`` (``inturn.default_queue``: in process
  only, so it guards one worker's threads and nothing between workers) or
  ``none`` (no inturn at all);
- ``INTURN_DEPLOY_DB``: the SQLite database, with a table ``counters(id, n)``;
- ``INTURN_DEPLOY_LEASE``: the Redis backend's lease, in seconds (default 10).

The queue is made at import: under ``gunicorn --preload``, in the master,
before it forks the workers.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
import time
from typing import Any

import inturn
from inturn import KeyedQueue, current_turn

#: The process that imported this module, and so made the queue: under
#: --preload gunicorn's master, else the worker itself.
MADE_IN = os.getpid()

#: Seconds between a counter's read and its write: widens the window in
#: which another request's read-modify-write interleaves (and loses one).
PAUSE = 0.001


def make_queue() -> KeyedQueue | None:
    """The queue the environment asks for, or None for no inturn."""
    kind = os.environ["INTURN_DEPLOY_BACKEND"]
    if kind == "none":
        return None
    if kind == "local":
        return inturn.default_queue
    if kind == "file":
        from inturn.backends.file import FileBackend

        return KeyedQueue(backend=FileBackend(os.environ["INTURN_DEPLOY_DIRECTORY"]))
    if kind == "redis":
        from inturn.backends.redis import RedisBackend

        backend = RedisBackend.from_url(
            os.environ["INTURN_DEPLOY_REDIS_URL"],
            namespace=os.environ["INTURN_DEPLOY_NAMESPACE"],
            lease=float(os.environ.get("INTURN_DEPLOY_LEASE", "10")),
        )
        return KeyedQueue(backend=backend)
    raise ValueError(f"INTURN_DEPLOY_BACKEND must be file, redis, local or none, got {kind!r}")


def connect() -> sqlite3.Connection:
    """A connection that leaves every statement to commit on its own.

    No transaction spans the read and the write (autocommit, never ``BEGIN
    IMMEDIATE``), WAL lets readers and a writer go on at once, and a long
    busy timeout makes a writer wait for the lock instead of failing: SQLite
    itself serializes nothing of the read-modify-write, so without inturn
    interleaved updates really get lost.
    """
    return sqlite3.connect(os.environ["INTURN_DEPLOY_DB"], timeout=60, isolation_level=None)


def read(db: sqlite3.Connection, row_id: int) -> int:
    (n,) = db.execute("SELECT n FROM counters WHERE id = ?", (row_id,)).fetchone()
    return int(n)


def write(db: sqlite3.Connection, row_id: int, n: int) -> None:
    db.execute("UPDATE counters SET n = ? WHERE id = ?", (n, row_id))


def add_one(row_id: int) -> dict[str, Any]:
    """Add one to a row's counter by a read-modify-write; what it read, and who did it."""
    db = connect()
    try:
        n = read(db, row_id)
        time.sleep(PAUSE)
        write(db, row_id, n + 1)
    finally:
        db.close()
    return report(n)


async def add_one_async(row_id: int) -> dict[str, Any]:
    """add_one, pausing in the event loop between the read and the write."""
    db = connect()
    try:
        n = read(db, row_id)
        await asyncio.sleep(PAUSE)
        write(db, row_id, n + 1)
    finally:
        db.close()
    return report(n)


def report(n: int) -> dict[str, Any]:
    """A request's answer: the value it read, its turn's fencing token, and who served it."""
    turn = current_turn()  # None without a shared backend
    return {
        "read": n,
        "token": None if turn is None else turn.token,
        "pid": os.getpid(),
        "thread": threading.get_ident(),
        "made_in": MADE_IN,
    }
