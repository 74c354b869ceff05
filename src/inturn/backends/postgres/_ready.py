"""Readying a PostgresBackend's connection: once per connection, before its first wait.

Written once as steps (:mod:`._steps`), for both kinds of connection:
autocommit on, the sequence of fencing tokens and the tables of lines()
(:mod:`._lines`) made on first use (a race with another session making
them at the same moment is no error; a user who may not make the tables
is told so in the log, and its turns go on), then, in one round trip, the
record of the session's client, the session's settings and the backend's
statements (:func:`._sql.prepare`). Bounded by the turn's time and
``unreachable_after``: a connection that does not answer in time, or
whose caller is interrupted meanwhile, is closed.
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable, Generator, Hashable
from typing import Any, final

import psycopg
from psycopg import errors

from ..._checks import Waited, missed
from ..._describe import describe as show
from ..._errors import BackendUnavailable
from . import _sql, _wire
from ._lines import Names
from ._steps import ASK, AUTOCOMMIT, CLOSE, Limits, Op, lost, now, said

#: The backend's logger, under the core's "inturn".
logger = logging.getLogger("inturn.postgres")


@final
class Ready:
    """What readying a connection learnt: its server session, and the role's timeouts."""

    __slots__ = ("pid", "reader", "role_timeouts")

    def __init__(
        self, pid: int, role_timeouts: tuple[bytes, bytes] | None, reader: select.poll
    ) -> None:
        self.pid = pid
        #: The poller of the connection's socket (see _places.stale).
        self.reader = reader
        #: The role's own statement_timeout and lock_timeout (in ms), which a transaction
        #: turn's work gets back (see _sql.waiting); None if both are 0, as the backend's
        #: sessions run.
        self.role_timeouts = role_timeouts


@final
class Readiness:
    """Which connections of a backend are readied, and the steps that ready one."""

    __slots__ = ("_made", "_pooled", "limits", "names", "owner", "posted")

    def __init__(self, limits: Limits, owner: str) -> None:
        self.limits = limits
        self.owner = owner  # the backend, as its logs name it
        self._made = False  # whether the sequence and the tables were found or made
        self._pooled = False  # a pooler was seen between the backend and the server
        #: What this process recorded for lines() (see _lines).
        self.names = Names(owner)
        #: Whether a post of latest work went through (see _latest): until then, and after
        #: one failed, a first post takes a round trip of its own before its wait.
        self.posted = False

    def sequence_gone(self) -> None:
        """The sequence of tokens vanished (a restore): make it again at the next ready."""
        self._made = False

    def until(self, timeout: float | None, until: float | None) -> float:
        """Connecting and readying: the turn's time left, at most unreachable_after.

        (timeout=0 asks for the key at once, not for a connection at once: it
        gets the margin for them.)
        """
        bound = now() + self.limits.unreachable_after
        return bound if until is None else min(bound, self.late(timeout, until))

    def late(self, timeout: float | None, until: float) -> float:
        """When a turn that must connect first has run out of time (see until())."""
        return until + self.limits.margin if timeout == 0 else until

    def readying(
        self, connection: Any, key: Hashable, timeout: float | None, until: float | None
    ) -> Generator[Op, Any, Ready]:
        """Autocommit, the sequence made, the settings and statements; what it learnt.

        (Once per connection: the lease that holds it keeps what it learnt, and
        so does the place that keeps it between turns.)
        """
        if not connection.autocommit:  # a pool of the caller's
            yield (AUTOCOMMIT, connection, True)
        ask = self.asking(connection, key, timeout, until)
        names = self.names
        for _ in range(3):
            if not self._made:
                found = yield from ask(_sql.FIND)
                row = found[0] if isinstance(found, list) and found else (None, None)
                if row[0] != b"t":
                    made = yield from ask(_sql.MAKE_SEQUENCE)
                    self._refused(made)
                if row[1] != b"t" and names.on:
                    names.made((yield from ask(_sql.MAKE_TABLES)))
                self._made = True
            version = connection.info.server_version
            rows = yield from ask(_sql.prepare(version, names.session()))
            if isinstance(rows, errors.DuplicatePreparedStatement):  # (by another backend)
                ours = yield from ask(_sql.PREPARED)
                if isinstance(ours, list) and ours:
                    yield from ask(b";".join(row[0] or b"" for row in ours))
                continue
            if isinstance(rows, errors.UndefinedTable):  # the sequence or a table is gone
                self._made = False
                continue
            if names.refused_session(rows):  # (recording is off now: readied without it)
                continue
            if not isinstance(rows, list):
                raise self._failed_ready(key, rows)
            return self._readied(connection, rows)
        raise BackendUnavailable(
            f"inturn: {self.owner} could not ready a connection for key {show(key)} "
            "(its statements, its sequence or its tables vanished again and again); "
            "the work did not run"
        )

    def asking(
        self,
        connection: Any,
        key: Hashable,
        timeout: float | None,
        until: float | None,
        turns: bool = False,
        doing: str = "readying a new connection",
    ) -> Callable[..., Generator[Op, Any, Any]]:
        """ask(sql, params=None): the steps of one statement that readies connection for
        key, bounded by until() (see _asking); ``turns``: by the turn's own time if it has
        one, as its wait is (a statement of the turn's, on a connection that answered);
        ``doing``: what the statement does, as an error about it says."""
        bound = self.late(timeout, until) if turns and until is not None else None
        if bound is None:
            bound = self.until(timeout, until)

        def ask(sql: bytes, params: list[bytes | None] | None = None) -> Any:
            return self._asking(connection, sql, params, bound, key, timeout, until, doing)

        return ask

    def _asking(
        self,
        connection: Any,
        sql: bytes,
        params: list[bytes | None] | None,
        bound: float,
        key: Hashable,
        timeout: float | None,
        until: float | None,
        doing: str,
    ) -> Generator[Op, Any, Any]:
        """One statement that readies connection: its outcome; a connection that does not
        answer by bound, or was interrupted meanwhile, is closed."""
        try:
            answer = yield (ASK, connection, sql, params, False, bound)
        except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
            raise
        except BaseException:
            yield (CLOSE, connection)
            raise
        if answer is None or lost(answer):
            yield (CLOSE, connection)
            if answer is None and until is not None and now() >= self.late(timeout, until):
                raise missed((key,), Waited.ANSWER, timeout, f" from PostgreSQL ({doing})")
            why = (
                f"no answer within {self.limits.unreachable_after:g} s"
                if answer is None
                else said(answer)
            )
            raise BackendUnavailable(
                f"inturn: PostgreSQL failed {doing} for key {show(key)} ({why}) "
                f"through {self.owner}; the work did not run"
            )
        return answer

    def _readied(self, connection: Any, rows: _wire.Rows) -> Ready:
        row = rows[0] if rows else (b"0", None, b"0")
        pid = int(row[1] or 0) if rows else connection.info.backend_pid
        timeouts = (row[0] or b"0", row[2] or b"0")
        reader = _wire.reader(connection.pgconn.socket)
        ready = Ready(pid, None if timeouts == (b"0", b"0") else timeouts, reader)
        if pid != connection.info.backend_pid and not self._pooled:
            self._pooled = True
            logger.warning(
                "inturn: %s: a connection pooler sits between this process and PostgreSQL "
                "(the server session is not the one the connection was told of); advisory "
                "locks hold only if it keeps one server session per client, as PgBouncer's "
                "pool_mode = session does; in transaction mode, connect inturn to "
                "PostgreSQL directly",
                self.owner,
            )
        return ready

    def _refused(self, made: Any) -> None:
        """Whether making the sequence failed for good (raised here) or not."""
        if isinstance(made, list | errors.DuplicateTable | errors.UniqueViolation):
            return  # made, or made at the same moment by another session
        if isinstance(made, errors.InsufficientPrivilege):
            raise BackendUnavailable(
                f"inturn: the sequence {_sql.SEQUENCE} of fencing tokens does not exist "
                f"and this user may not create it ({said(made)}); make it once as an owner: "
                f"CREATE SEQUENCE {_sql.SEQUENCE}; GRANT USAGE ON SEQUENCE "
                f"{_sql.SEQUENCE} TO ...; the work did not run"
            ) from made
        raise made

    def _failed_ready(self, key: Hashable, error: psycopg.Error) -> BackendUnavailable:
        failure = BackendUnavailable(
            f"inturn: PostgreSQL refused to ready a connection for key {show(key)} "
            f"({said(error)}) through {self.owner}; the work did not run"
        )
        failure.__cause__ = error
        return failure
