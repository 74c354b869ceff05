"""The PostgreSQL backend's statements, and their parameters in text format.

The backend prepares them on each connection it uses, once, in one round
trip (:func:`prepare`), then sends them by name: the server plans them
once. Every statement that takes or frees a lock also returns
``pg_backend_pid()``, the server session it ran in, so that a pooler that
moves a turn's statements between server sessions is caught.

What a session is set to, once, when it is readied (and again after a
transaction turn's work had it): ``statement_timeout = 0`` and
``lock_timeout = 0``, so that a role's timeouts never cut a wait short (the
wait is bounded by the turn's own ``timeout``, as a ``lock_timeout`` of that
statement's only), and ``client_connection_check_interval`` (14+), so that a
waiter whose client died leaves the server's queue. Statement timeouts are
armed when a statement starts, so they are set for the session: set in the
waiting statement itself, they would come too late for that wait; and an
untimed wait, the usual, then sets nothing (two ``set_config`` calls cost
the server more than the advisory lock and its unlock). A transaction
turn's work gets the role's own ``statement_timeout`` and ``lock_timeout``
back for its statements (the last wait of the turn sets them, see
:data:`WAIT_AFTER`).
"""

from __future__ import annotations

import math
from typing import Final

from ._keys import lock_parts

#: The sequence that fencing tokens are drawn from (in the search_path's first schema).
SEQUENCE: Final = "inturn_token"
#: The tables that let lines() name what pg_locks shows (beside the sequence): the key of
#: each lock id a process took (its portable name), and the client of each server
#: session the backend readied (see _lines).
KEYS: Final = "inturn_keys"
SESSIONS: Final = "inturn_sessions"

#: Whether the sequence is there; whether the tables are.
FIND: Final = (
    f"SELECT to_regclass('{SEQUENCE}') IS NOT NULL,"
    f" to_regclass('{KEYS}') IS NOT NULL AND to_regclass('{SESSIONS}') IS NOT NULL"
).encode()
MAKE_SEQUENCE: Final = f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint".encode()
#: The tables, as an owner makes them (also what a user who may not is told to run).
TABLES: Final = (
    f"CREATE TABLE IF NOT EXISTS {KEYS} (namespace text NOT NULL, lock_id int8 NOT NULL,"
    " name bytea NOT NULL, seen timestamptz NOT NULL DEFAULT now(),"
    " PRIMARY KEY (namespace, lock_id));"
    f" CREATE TABLE IF NOT EXISTS {SESSIONS} (pid int4 PRIMARY KEY, started timestamptz,"
    " host text NOT NULL, client_pid int4 NOT NULL);"
)
MAKE_TABLES: Final = TABLES.encode()

#: How often a waiting session checks that its client is still there (PostgreSQL 14+).
_CHECK_INTERVAL: Final = "1s"

# The session's settings (see the module): the timeouts off, the client check on.
_SETTINGS: Final = "SET statement_timeout = 0; SET lock_timeout = 0;"
_CHECK: Final = "SET client_connection_check_interval = '" + _CHECK_INTERVAL + "';"

# The lock, then the token. OFFSET 0 keeps each subquery apart, so that they run
# inside out. The session's lock_timeout is 0 (see the module), so an untimed wait
# (WAIT_UNTIMED, the usual) sets nothing; a timed one sets it with set_config(...,
# true), for this statement's transaction only (the session is in autocommit): the
# turn's time left ($2 in ms, '0': none) for the advisory wait, and '0' again for
# nextval, so that a LockNotAvailable always means "the lock was not granted"
# (nextval held up by a DDL of another session is bounded by the client instead,
# and then the lock is given back). The _AFTER variants (the last key of a
# transaction turn whose role has a timeout of its own) also set the session's
# statement_timeout and lock_timeout to their last two parameters from the next
# statement on, for the turn's work (a SET after a SET LOCAL of one transaction
# outlasts it).
_UNTIMED: Final = "  SELECT pg_advisory_lock($1) OFFSET 0 ) AS granted;"
_GRANTED: Final = (
    "  SELECT set_config('lock_timeout', '0', true) FROM ("
    "   SELECT pg_advisory_lock($1) FROM ("
    "    SELECT set_config('lock_timeout', $2, true) OFFSET 0"
    "   ) AS settings OFFSET 0"
    "  ) AS granted OFFSET 0"
    " ) AS unbounded;"
)
_TRIED: Final = "  SELECT pg_try_advisory_lock($1) AS got OFFSET 0 ) AS tried WHERE got;"
_TOKEN: Final = " SELECT nextval('" + SEQUENCE + "'), pg_backend_pid()"
_AFTER: Final = (
    ", set_config('statement_timeout', $3, false), set_config('lock_timeout', $4, false)"
)
_WAIT_UNTIMED: Final = "PREPARE inturn_wait_untimed (int8) AS" + _TOKEN + " FROM (" + _UNTIMED
_WAIT: Final = "PREPARE inturn_wait (int8, text) AS" + _TOKEN + " FROM (" + _GRANTED
_WAIT_AFTER: Final = (
    "PREPARE inturn_wait_after (int8, text, text, text) AS" + _TOKEN + _AFTER + " FROM (" + _GRANTED
)
# timeout=0: ask once; no row if the key is busy ($2: unused; the parameters are WAIT's).
_TRY: Final = "PREPARE inturn_try (int8, text) AS" + _TOKEN + " FROM (" + _TRIED
_TRY_AFTER: Final = (
    "PREPARE inturn_try_after (int8, text, text, text) AS" + _TOKEN + _AFTER + " FROM (" + _TRIED
)
# The end of a turn: unlock each of its keys; whether each was held, in order. (A turn's
# usual, one key: without the array, its unnest and its sort, which cost the server
# more than the unlock itself.)
_UNLOCK: Final = (
    "PREPARE inturn_unlock (int8[]) AS SELECT pg_advisory_unlock(id), pg_backend_pid()"
    " FROM unnest($1) WITH ORDINALITY AS locks(id, n) ORDER BY n;"
)
_UNLOCK_ONE: Final = (
    "PREPARE inturn_unlock_one (int8) AS SELECT pg_advisory_unlock($1), pg_backend_pid();"
)
# Which server session this is (not the one the client was told of at connect when a
# pooler sits in between), and the role's own statement_timeout and lock_timeout (in
# ms): the first row.
_WHO: Final = (
    "SELECT (SELECT reset_val FROM pg_settings WHERE name = 'statement_timeout'),"
    " pg_backend_pid(),"
    " (SELECT reset_val FROM pg_settings WHERE name = 'lock_timeout');"
)

WAIT_UNTIMED: Final = b"inturn_wait_untimed"
WAIT: Final = b"inturn_wait"
WAIT_AFTER: Final = b"inturn_wait_after"
TRY: Final = b"inturn_try"
TRY_AFTER: Final = b"inturn_try_after"
UNLOCK: Final = b"inturn_unlock"
UNLOCK_ONE: Final = b"inturn_unlock_one"

#: UNLOCK, unprepared: for a connection whose statements were deallocated meanwhile
#: (``DEALLOCATE ALL`` by a pool's reset).
UNLOCK_SQL: Final = (
    b"SELECT pg_advisory_unlock(id), pg_backend_pid()"
    b" FROM unnest($1::int8[]) WITH ORDINALITY AS locks(id, n) ORDER BY n"
)

#: After a wait that failed or was given up on, when the lock may have been granted
#: before it failed: unlock it once if this session holds it (else no row). A
#: session-level advisory lock outlives the statement that took it.
UNDO: Final = (
    b"SELECT pg_advisory_unlock($1) FROM pg_locks"
    b" WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted"
    b" AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    b" AND classid = $2::oid AND objid = $3::oid AND objsubid = 1"
)

#: The statements of ours a connection has, to deallocate (prepared by another backend).
PREPARED: Final = (
    b"SELECT 'DEALLOCATE ' || name FROM pg_prepared_statements WHERE name LIKE 'inturn\\_%'"
)

#: Whether a server session is still there and still running a statement (asked on a
#: connection of its own, while a statement of that session has gone unanswered for
#: long): a session that finished its statement, whose answer never came, is as lost
#: to its client as one that is gone. (The same role sees its sessions' state.)
PROBE: Final = b"SELECT count(*) FROM pg_stat_activity WHERE pid = $1 AND state = 'active'"


def prepare(server_version: int, record: str = "") -> bytes:
    """The script that readies a session: its settings, the statements (first row: _WHO);
    ``record``: :func:`recording_session`'s statement, or ''."""
    check = _CHECK if server_version >= 140000 else ""
    return (
        _WHO
        + record
        + _SETTINGS
        + check
        + _WAIT_UNTIMED
        + _WAIT
        + _WAIT_AFTER
        + _TRY
        + _TRY_AFTER
        + _UNLOCK
        + _UNLOCK_ONE
    ).encode()


def resetting(locks: list[int], server_version: int) -> bytes:
    """Unlock locks (rows as UNLOCK's), then undo what a transaction turn's work may have
    set on the session: its settings, role, temporary tables, listens, cursors and any
    session advisory lock of its own; the backend's settings again. Simple protocol."""
    ids = "{" + ",".join(map(str, locks)) + "}"
    check = _CHECK if server_version >= 140000 else ""
    return (
        "SELECT pg_advisory_unlock(id), pg_backend_pid() FROM unnest('" + ids + "'::int8[])"
        " WITH ORDINALITY AS locks(id, n) ORDER BY n;"
        "CLOSE ALL; RESET SESSION AUTHORIZATION; RESET ALL; UNLISTEN *; DISCARD TEMP;"
        "SELECT pg_advisory_unlock_all();" + _SETTINGS + check
    ).encode()


def waiting(
    lock: int, timeout: float | None, left: float | None, after: tuple[bytes, bytes] | None
) -> tuple[bytes, list[bytes | None]]:
    """The statement that takes lock within left seconds (None: no bound; ``timeout=0``:
    at once); its params. ``after``: the session's statement_timeout and lock_timeout
    once it is done (None: as they are)."""
    if after is None:
        if left is None:  # (the usual)
            return WAIT_UNTIMED, [b"%d" % lock]
        if timeout == 0:
            return TRY, [b"%d" % lock, b"0"]
        return WAIT, [b"%d" % lock, b"%d" % max(1, math.ceil(left * 1000))]
    limit = b"0" if left is None or timeout == 0 else b"%d" % max(1, math.ceil(left * 1000))
    return TRY_AFTER if timeout == 0 else WAIT_AFTER, [b"%d" % lock, limit, *after]


def unlocking(locks: list[int]) -> tuple[bytes, list[bytes | None]]:
    """The prepared statement that unlocks locks (rows as UNLOCK's), and its parameters."""
    if len(locks) == 1:  # (a turn's usual)
        return UNLOCK_ONE, [b"%d" % locks[0]]
    return UNLOCK, unlocking_array(locks)


def unlocking_array(locks: list[int]) -> list[bytes | None]:
    """The parameters of UNLOCK and UNLOCK_SQL for locks: one int8 array."""
    return [("{" + ",".join(map(str, locks)) + "}").encode()]


def undoing(lock: int) -> list[bytes | None]:
    """The parameters of UNDO for lock: its id, and how pg_locks shows it."""
    classid, objid = lock_parts(lock)
    return [str(lock).encode(), str(classid).encode(), str(objid).encode()]


# -- what lines() reads, and what the backend records for it (see _lines) ---------------

#: Seconds between two records of one key by one process (the row's ``seen``): a row not
#: seen for twice as long, whose lock nobody holds or waits for, is tidied away.
RECORD_EVERY: Final = 3600

#: A row of pg_locks (``l``) that is an advisory lock of this database taken with one
#: int8, and that int8 (see _keys.lock_parts).
_ADVISORY: Final = (
    "l.locktype = 'advisory' AND l.objsubid = 1 AND l.pid IS NOT NULL"
    " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
)
_LOCK_ID: Final = "((l.classid::int8 << 32) | l.objid::int8)"

#: A record's transaction does not wait for its WAL to reach the disk (or a synchronous
#: standby): one lost in a crash costs lines() a name until it is recorded again, never a
#: turn, and a turn on a new key costs no disk flush.
_NO_FLUSH: Final = "set_config('synchronous_commit', 'off', true)"

#: Rows nobody needs: keys not recorded for 2 * RECORD_EVERY and not locked now (any
#: process that uses a key records it again within RECORD_EVERY), sessions that ended.
_TIDY: Final = (
    (
        f"DELETE FROM {KEYS} WHERE seen < now() - interval '{2 * RECORD_EVERY} seconds'"
        f" AND lock_id NOT IN (SELECT {_LOCK_ID} FROM pg_locks l WHERE {_ADVISORY})"
    ).encode(),
    (
        f"DELETE FROM {SESSIONS} WHERE pid NOT IN"
        " (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)"
    ).encode(),
)


def recording_session(host: str, pid: int) -> str:
    """The statement that records the client (host, process id) of the session it runs in.

    host: letters, digits and ``._:-`` only (see _lines.this_host).
    """
    return (
        f"SELECT {_NO_FLUSH}; INSERT INTO {SESSIONS} (pid, started, host, client_pid)"
        f" SELECT pid, backend_start, '{host}', {pid:d} FROM pg_stat_activity"
        " WHERE pid = pg_backend_pid() ON CONFLICT (pid) DO UPDATE SET"
        " started = excluded.started, host = excluded.host, client_pid = excluded.client_pid;"
    )


#: How long recording a key may wait for a lock (another process's record or tidy, of a
#: row, or an owner's of the table): past it, it gives up (and tries again later); the
#: turn goes on.
_RECORD_WAIT: Final = "250ms"
#: A record's settings, for its transaction only.
_RECORD_SETTINGS: Final = (
    f"SELECT set_config('lock_timeout', '{_RECORD_WAIT}', true), {_NO_FLUSH}"
).encode()


def recording_key(namespace: str, lock: int, name: bytes, tidy: bool) -> tuple[bytes, ...]:
    """The statements that record the key whose portable name is name (its lock: lock), once
    per RECORD_EVERY / 2 whoever records it; ``tidy``: :data:`_TIDY` too. One statement
    each, without parameters, for one transaction: sent ahead of a wait (see
    ``_wire.Ahead``), or joined by ``;`` (namespace: letters, digits and ``_.:-`` only, as
    PostgresBackend checks). The settings come first, in a statement of their own: a
    statement that writes a table waits for the table's lock as it is parsed."""
    record = (
        f"INSERT INTO {KEYS} (namespace, lock_id, name)"
        f" VALUES ('{namespace}', {lock:d}, decode('{name.hex()}', 'hex'))"
        " ON CONFLICT (namespace, lock_id) DO UPDATE SET seen = now()"
        f" WHERE {KEYS}.seen < now() - interval '{RECORD_EVERY // 2} seconds'"
    ).encode()
    return (_RECORD_SETTINGS, record, *_TIDY) if tidy else (_RECORD_SETTINGS, record)


#: lines() of namespace %s: each lock id with a recorded key, and each session in its
#: line (psycopg's execute): the lock, the key's portable name, granted, the server
#: session, its client's host and pid (NULL if not recorded), seconds since it waits or
#: holds (NULL if this role may not see the session's times), and for a waiter, how many
#: sessions are ahead of it in the server's queue (the holder, then waiters).
LINES: Final = (
    f"SELECT k.lock_id, k.name, l.granted, l.pid, s.host, s.client_pid,"
    " extract(epoch FROM now() - CASE WHEN NOT l.granted THEN a.query_start"
    " WHEN a.state = 'idle' THEN a.state_change"
    " ELSE coalesce(a.xact_start, a.query_start) END)::float8,"
    " CASE WHEN NOT l.granted THEN cardinality(pg_blocking_pids(l.pid)) END"
    f" FROM pg_locks l JOIN {KEYS} k ON k.namespace = %s AND k.lock_id = {_LOCK_ID}"
    " LEFT JOIN pg_stat_activity a ON a.pid = l.pid"
    f" LEFT JOIN {SESSIONS} s ON s.pid = l.pid"
    " AND (a.backend_start IS NULL OR s.started = a.backend_start)"
    f" WHERE {_ADVISORY}"
)

#: The namespaces whose keys someone holds or waits for now (psycopg's execute).
NAMESPACES: Final = (
    f"SELECT DISTINCT k.namespace FROM pg_locks l JOIN {KEYS} k ON k.lock_id = {_LOCK_ID}"
    f" WHERE {_ADVISORY} ORDER BY 1"
)
