"""The PostgreSQL backend's lines, for people: what pg_locks shows, with the keys and clients.

An advisory lock is named by a 64-bit digest of the namespace and the key
(:mod:`._keys`), which cannot be turned back into the key, and a server
session by the server's process id, which is not the client's. So the
backend records, in two tables beside its sequence (made with it, in the
first schema of the ``search_path``):

- ``inturn_keys``: a key's portable name (:func:`inturn._order.portable_name`,
  as the Redis and the file backends record it) by namespace and lock id,
  written by a process as it first waits for the key, then again at most
  once per :data:`._sql.RECORD_EVERY` seconds while it uses the key: once
  per key per process, not per turn. The record goes ahead of the wait in
  the same round trip (a :class:`Record`, see :func:`._wire.send`), in a
  transaction of its own that commits before the wait begins: a new key
  costs no round trip more, its name is there while it waits, and a record
  that fails (a row lock held too long, the tables gone) leaves the wait
  as it is. :class:`Names` remembers which keys this process recorded, and
  when (a bounded number of them).
- ``inturn_sessions``: the client's host and process id by server session,
  written once per connection, in the round trip that readies it.

:func:`snapshot` joins them with ``pg_locks`` and ``pg_stat_activity`` at
the time of the call. Rows nobody needs (keys not recorded for twice
``RECORD_EVERY`` and not locked now, sessions that ended) are deleted by a
process along with a key it records, once per ``RECORD_EVERY``.

A user who may not make the tables (or write them) is told once, in the
log, what an owner runs; the turns go on, unseen by lines().
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from collections.abc import Callable, Generator, Hashable
from typing import Any, Final, Protocol, final

import psycopg
from psycopg import errors

from ..._describe import describe as show
from ..._errors import BackendUnavailable
from ..._order import portable_key, portable_name
from .._lines import HolderInfo, LineInfo, WaiterInfo
from . import _sql
from ._steps import Op, now, said
from ._wire import Ahead

logger = logging.getLogger("inturn.postgres")

#: Keys whose record a process remembers at most (the oldest recorded is forgotten first,
#: and recorded again at its next turn): a bounded number, so idle keys cost nothing more.
_REMEMBERED: Final = 10_000

#: Seconds before a key whose record failed (not for want of a privilege) is tried again.
_RETRY: Final = 60.0

#: What an owner runs for a user who may not make or write the tables.
_OWNER_RUNS: Final = (
    f"{_sql.TABLES} GRANT SELECT, INSERT, UPDATE, DELETE ON {_sql.KEYS}, {_sql.SESSIONS},"
    f" {_sql.LATEST} TO ..."
)


class Asking(Protocol):
    """What lines() uses of the backend's connections (a Connections): the rows of one
    statement, asked on a connection of its own, and the backend's name in its logs."""

    owner: str

    async def rows(self, sql: str, params: list[Any]) -> list[tuple[Any, ...]]: ...


@final
class Record(Ahead):
    """The statements that record a key, sent ahead of its wait; whether they tidy too."""

    __slots__ = ("tidy",)

    def __init__(self, statements: tuple[bytes, ...], tidy: bool) -> None:
        super().__init__(statements)
        self.tidy = tidy


def this_host() -> str:
    """This host's name, as the Redis backend records it, in characters SQL takes as they are."""
    return re.sub(r"[^A-Za-z0-9._:-]", "?", socket.gethostname())[:255] or "?"


@final
class Names:
    """Which keys this process recorded, and whether it records at all (see the module)."""

    __slots__ = ("_due", "_failing", "_host", "_tidy_at", "on", "owner")

    def __init__(self, owner: str) -> None:
        self.owner = owner  # the backend, as its logs name it
        #: False once the tables could not be made or written: nothing more is recorded.
        self.on = True
        # lock id -> when to record its key again (time.monotonic()), oldest first
        self._due: dict[int, float] = {}
        self._tidy_at = 0.0  # when this process tidies the tables next
        self._failing = False  # a record failed (said once), and none succeeded since
        self._host = this_host()

    def due(self, lock: int) -> bool:
        """Whether lock's key is to be recorded before its wait (usually: a dict lookup)."""
        if not self.on:
            return False
        at = self._due.get(lock)
        return at is None or now() >= at

    def session(self) -> str:
        """The statement that records the client of a session being readied ('' if off)."""
        if not self.on:
            return ""
        return _sql.recording_session(self._host, os.getpid())

    def record(self, key: Hashable, lock: int, namespace: str) -> Record:
        """The record of key (its lock: lock), tidying the tables if it is time: to send
        ahead of key's wait (see _wire.Ahead), then to give to :meth:`recorded`."""
        tidy = now() >= self._tidy_at
        return Record(_sql.recording_key(namespace, lock, portable_name(key), tidy), tidy)

    def recorded(self, key: Hashable, lock: int, record: Record) -> bool:
        """Note what record came to (nothing if its outcome never came: key stays due);
        True if the tables are gone (dropped meanwhile: :meth:`remaking` makes them)."""
        answer = record.outcome
        if answer is None:
            return False
        if isinstance(answer, errors.UndefinedTable):
            return True
        due = self._due
        if isinstance(answer, list):
            self._failing = False
            if record.tidy:
                self._tidy_at = now() + _sql.RECORD_EVERY
            due.pop(lock, None)  # (kept oldest first)
            due[lock] = now() + _sql.RECORD_EVERY
            if len(due) > _REMEMBERED:
                try:
                    del due[next(iter(due))]
                except (StopIteration, KeyError, RuntimeError):  # (another thread's, meanwhile)
                    pass
        elif self.on and not self._refused(answer):
            if not self._failing:  # (said once until a record succeeds again)
                self._failing = True
                logger.warning(
                    "inturn: %s could not record key %s for lines() (%s); its turns go on, "
                    "and it tries again in %g s",
                    self.owner,
                    show(key),
                    said(answer),
                    _RETRY,
                )
            due[lock] = now() + _RETRY
        return False

    def remaking(
        self, key: Hashable, lock: int, namespace: str, ask: Callable[[bytes], Any]
    ) -> Generator[Op, Any, None]:
        """Make the tables again (a record found them gone), then record key again.

        ask: the steps that send a statement on the turn's connection (and raise if
        it is lost, or does not answer in time: see _ready.Readiness.asking).
        """
        self.made((yield from ask(_sql.MAKE_TABLES)))
        if self.on:
            record = self.record(key, lock, namespace)
            record.outcome = yield from ask(b";".join(record.statements))
            self.recorded(key, lock, record)

    def made(self, answer: Any) -> None:
        """What making the tables came to: made (or by another session at once), or refused."""
        made = isinstance(answer, list | errors.DuplicateTable | errors.UniqueViolation)
        if not made and not self._refused(answer):
            self._off(answer, "could not make")

    def refused_session(self, answer: Any) -> bool:
        """Whether a readying script failed for its session's record (then recording is off,
        and the script is sent again without it)."""
        return self.on and self._refused(answer)

    def _refused(self, answer: Any) -> bool:
        """Whether answer says this user may not write the tables (then recording is off)."""
        if isinstance(answer, errors.InsufficientPrivilege | errors.ReadOnlySqlTransaction):
            self._off(answer, "may not make or write")
            return True
        return False

    def _off(self, error: psycopg.Error, what: str) -> None:
        if not self.on:
            return
        self.on = False
        logger.warning(
            "inturn: %s %s the tables %s and %s (%s), so lines() and python -m inturn "
            "inspect --postgres do not show this process's keys; its turns go on. Make them "
            "once as an owner: %s",
            self.owner,
            what,
            _sql.KEYS,
            _sql.SESSIONS,
            said(error),
            _OWNER_RUNS,
        )


async def snapshot(connections: Asking, namespace: str) -> list[LineInfo]:
    """Every line of namespace that someone holds or waits for, sorted by key (see
    PostgresBackend.lines)."""
    found: dict[int, tuple[bytes, list[tuple[Any, ...]]]] = {}
    try:
        rows = await _asked(connections, _sql.LINES_LATEST, [namespace])
    except BackendUnavailable as error:
        if not isinstance(error.__cause__, errors.UndefinedTable | errors.InsufficientPrivilege):
            raise
        # (no inturn_latest, or no right to read it: an owner of an older version's tables)
        rows = [(*row, None) for row in await _asked(connections, _sql.LINES, [namespace])]
    for row in rows:
        found.setdefault(row[0], (bytes(row[1]), []))[1].append(row[2:])
    lines = []
    for name, sessions in found.values():
        try:
            key = portable_key(name)
        except ValueError:
            continue  # (not a name this backend wrote)
        holder = None
        waiters = []
        for granted, server_pid, host, pid, seconds, ahead, called in sessions:
            since = max(0.0, seconds or 0.0)
            ago = None if called is None else max(0.0, called)
            if granted:
                holder = HolderInfo(host, pid or 0, since, server_pid=server_pid, latest_called=ago)
            else:
                waiter = WaiterInfo(host, pid or 0, since, server_pid=server_pid, latest_called=ago)
                waiters.append((ahead or 0, -since, waiter))
        waiters.sort(key=lambda waiter: waiter[:2])
        lines.append(LineInfo(key, holder, tuple(waiter[2] for waiter in waiters)))
    return sorted(lines, key=lambda line: portable_name(line.key))


async def namespaces(connections: Asking) -> list[str]:
    """The namespaces whose keys someone holds or waits for now, sorted."""
    return [row[0] for row in await _asked(connections, _sql.NAMESPACES, [])]


async def _asked(connections: Asking, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
    """The rows of sql, asked on a connection of its own; its failures said for people."""
    try:
        return await connections.rows(sql, params)
    except errors.UndefinedTable as error:
        raise BackendUnavailable(
            f"inturn: no process has recorded its keys in this database: the tables "
            f"{_sql.KEYS} and {_sql.SESSIONS} are not in the search_path ({said(error)}). "
            "A PostgresBackend makes them at its first turn; one whose user may not create "
            f"them says so in its log, and an owner makes them once: {_OWNER_RUNS}"
        ) from error
    except errors.InsufficientPrivilege as error:
        raise BackendUnavailable(
            f"inturn: this user may not read the tables of inturn's keys ({said(error)}); "
            f"an owner grants it: GRANT SELECT ON {_sql.KEYS}, {_sql.SESSIONS} TO ..."
        ) from error
    except (psycopg.Error, OSError, asyncio.TimeoutError) as error:
        why = said(error) if isinstance(error, psycopg.Error) else str(error) or "timed out"
        raise BackendUnavailable(
            f"inturn: PostgreSQL could not be asked for its lines ({why}) through "
            f"{connections.owner}"
        ) from error
