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
#: The table of latest work shared across processes (see _latest): each waiting turn's
#: post, by its server session (pid), and what ran last in each line (pid 0).
LATEST: Final = "inturn_latest"

#: Whether the sequence is there; whether the tables are.
FIND: Final = (
    f"SELECT to_regclass('{SEQUENCE}') IS NOT NULL,"
    f" to_regclass('{KEYS}') IS NOT NULL AND to_regclass('{SESSIONS}') IS NOT NULL"
    f" AND to_regclass('{LATEST}') IS NOT NULL"
).encode()
MAKE_SEQUENCE: Final = f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint".encode()
#: The tables, as an owner makes them (also what a user who may not is told to run).
TABLES: Final = (
    f"CREATE TABLE IF NOT EXISTS {KEYS} (namespace text NOT NULL, lock_id int8 NOT NULL,"
    " name bytea NOT NULL, seen timestamptz NOT NULL DEFAULT now(),"
    " PRIMARY KEY (namespace, lock_id));"
    f" CREATE TABLE IF NOT EXISTS {SESSIONS} (pid int4 PRIMARY KEY, started timestamptz,"
    " host text NOT NULL, client_pid int4 NOT NULL);"
    f" CREATE TABLE IF NOT EXISTS {LATEST} (namespace text NOT NULL, lock_id int8 NOT NULL,"
    " pid int4 NOT NULL, clock text NOT NULL, mono int8 NOT NULL, at int8 NOT NULL,"
    " fresh bool NOT NULL, ok bool NOT NULL, intent bool NOT NULL,"
    " seen timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (namespace, lock_id, pid));"
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
    lock: int,
    timeout: float | None,
    left: float | None,
    after: tuple[bytes, bytes] | None,
    again: bool = False,
) -> tuple[bytes, list[bytes | None], bool]:
    """The statement that takes lock within left seconds (None: no bound; ``timeout=0``:
    at once); its params; whether it is prepared. ``after``: the session's
    statement_timeout and lock_timeout once it is done (None: as they are); ``again``
    (never with after: a turn of latest work has no transaction): the session holds lock,
    and gives it up in the same statement first (it joins the line again: see _latest)."""
    if left is None and after is None:  # (the usual)
        return (
            (_AGAIN_UNTIMED, [b"%d" % lock], False)
            if again
            else (WAIT_UNTIMED, [b"%d" % lock], True)
        )
    limit = b"0" if left is None or timeout == 0 else b"%d" % max(1, math.ceil(left * 1000))
    if again:
        return _again(timeout), [b"%d" % lock] if timeout == 0 else [b"%d" % lock, limit], False
    if after is None:
        return TRY if timeout == 0 else WAIT, [b"%d" % lock, limit], True
    return TRY_AFTER if timeout == 0 else WAIT_AFTER, [b"%d" % lock, limit, *after], True


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


# -- latest work shared across processes (see _latest) ----------------------------------

#: The server's clock, in µs (what a post's ``at`` is on).
_NOW_US: Final = "(extract(epoch FROM clock_timestamp()) * 1000000)::int8"


def intent(lock: int) -> tuple[int, int]:
    """The two int4 of lock's *intent* lock: a shared advisory lock that a turn of latest work
    holds from its post on, which ``pg_locks`` shows as lock's ``classid`` and ``objid`` with
    ``objsubid = 2`` (see _latest)."""
    high, low = lock_parts(lock)
    return high - (high >> 31 << 32), low - (low >> 31 << 32)


def posting(
    namespace: str,
    lock: int,
    clock: str,
    mono: int,
    age: int,
    fresh: bool,
    fate: int | None,
) -> bytes:
    """The statement that posts this session's turn of latest work on lock: its call made at
    mono on the host whose clock id is clock (alphanumeric), ``age`` µs ago. ``fate``: the
    turn's first post, which takes the key's intent lock and the turn's *fate lock* (that
    id, exclusive: turns that stand by behind it wait for it, see _latest) too, before its
    row is there for others to see, and fails if the turn may not take its post away
    again (DELETE). For an :class:`~._wire.Ahead` (no parameters;
    namespace: letters, digits and ``_.:-`` only, as PostgresBackend checks)."""
    taken = rights = ""
    if fate is not None:
        high, low = intent(lock)
        taken = (
            f" FROM (SELECT pg_advisory_lock({fate:d}),"
            f" pg_advisory_lock_shared({high:d}, {low:d}) OFFSET 0) AS taken"
        )
        rights = f"WITH rights AS (DELETE FROM {LATEST} WHERE false) "  # (leaving's, checked)
    return (
        f"{rights}INSERT INTO {LATEST}"
        " (namespace, lock_id, pid, clock, mono, at, fresh, ok, intent)"
        f" SELECT '{namespace}', {lock:d}, pg_backend_pid(), '{clock}', {mono:d},"
        f" {_NOW_US} - {age:d}, {str(fresh).lower()}, false, true{taken}"
        " ON CONFLICT (namespace, lock_id, pid) DO UPDATE SET clock = excluded.clock,"
        " mono = excluded.mono, at = excluded.at, fresh = excluded.fresh"
    ).encode()


def leaving(namespace: str, lock: int, ran: tuple[str, int, int, bool] | None) -> bytes:
    """The statement that takes this session's post on lock away, and records what ran
    (``ran``: its call's clock id, time and age in µs, and whether it returned), if it
    ran: committed before :func:`letting_go` lets its locks go, so that a turn that
    learns of it (granted the key, or woken from standing by) sees both. For an
    :class:`~._wire.Ahead`, as :func:`posting`."""
    gone = (
        f"DELETE FROM {LATEST} WHERE namespace = '{namespace}' AND lock_id = {lock:d}"
        " AND pid = pg_backend_pid()"
    )
    if ran is None:
        return gone.encode()
    clock, mono, age, ok = ran
    return (
        f"WITH gone AS ({gone}) INSERT INTO {LATEST} (namespace, lock_id, pid, clock, mono,"
        f" at, fresh, ok, intent) VALUES ('{namespace}', {lock:d}, 0, '{clock}', {mono:d},"
        f" {_NOW_US} - {age:d}, false, {str(ok).lower()}, false)"
        " ON CONFLICT (namespace, lock_id, pid) DO UPDATE SET clock = excluded.clock,"
        " mono = excluded.mono, at = excluded.at, ok = excluded.ok, seen = now()"
    ).encode()


def letting_go(lock: int, fate: int) -> bytes:
    """The statement that lets a turn of latest work's fate lock and intent lock go (after
    :func:`leaving`). For an :class:`~._wire.Ahead`, as :func:`posting`."""
    high, low = intent(lock)
    return (
        f"SELECT pg_advisory_unlock({fate:d}), pg_advisory_unlock_shared({high:d}, {low:d})"
    ).encode()


def standing_by(lock: int | None, fate: int, left: float | None) -> bytes:
    """The statement that stands a turn of latest work by: it gives lock up first (if it
    holds it: not None), then waits until the turn whose fate lock is fate ends (its
    shared lock, let go at once), within left seconds (None: no bound). No parameters."""
    given = (
        f" FROM (SELECT pg_advisory_unlock({lock:d}) OFFSET 0) AS given" if lock is not None else ""
    )
    if left is None:
        return (
            f"SELECT pg_advisory_unlock_shared({fate:d}) FROM (SELECT"
            f" pg_advisory_lock_shared({fate:d}){given} OFFSET 0) AS waited"
        ).encode()
    limit = max(1, math.ceil(left * 1000))
    return (
        f"SELECT pg_advisory_unlock_shared({fate:d}) FROM (SELECT"
        f" pg_advisory_lock_shared({fate:d}) FROM (SELECT set_config('lock_timeout',"
        f" '{limit:d}', true){given} OFFSET 0) AS settings OFFSET 0) AS waited"
    ).encode()


def judging(namespace: str, lock: int, unless: tuple[str, int, int, int] | None = None) -> bytes:
    """What a turn of latest work on lock judges by, its turn come: the server's clock
    (first row: 0, µs), what ran last (a row 1, if any: at, clock, mono, ok), and the post
    of each other session in line (rows 2: at, clock, mono, fresh, whether it waits for
    the lock, its pid). A session is in line while it holds the key's intent lock (every
    turn of latest work does, from its post to its end): a post left by a session that
    ended never counts, even if another session gets its pid.

    ``unless`` (a turn standing by: its call's clock id, time and server µs, and its fate
    lock): if what ran is as new as that call (as the backends compare two, see
    ``_stamps``), the same statement takes the session's post away and lets its locks go,
    and says so (a row 3): the turn is answered without a round trip more.

    Without parameters: sent behind a wait (see ``_wire.Ahead``; namespace: as
    :func:`posting`)."""
    classid, objid = lock_parts(lock)
    mine = f"namespace = '{namespace}' AND lock_id = {lock:d}"
    left = with_ = ""
    if unless is not None:
        clock, mono, at, fate = unless
        high, low = intent(lock)
        with_ = (
            f"WITH gone AS (DELETE FROM {LATEST} WHERE {mine} AND pid = pg_backend_pid()"
            f" AND EXISTS (SELECT FROM {LATEST} WHERE {mine} AND pid = 0 AND CASE WHEN"
            f" clock = '{clock}' THEN mono >= {mono:d} ELSE at >= {at:d} END) RETURNING pid) "
        )
        # (the intent lock first: once the fate lock goes, the turns standing by behind
        # this one wake, and its post no longer counts)
        left = (
            f" UNION ALL SELECT 3, NULL, NULL, NULL, pg_advisory_unlock_shared({high:d},"
            f" {low:d}), pg_advisory_unlock({fate:d}), NULL FROM gone"
        )
    return (
        f"{with_}SELECT 0, {_NOW_US}, NULL::text, NULL::int8, NULL::bool, NULL::bool,"
        " NULL::int4"
        f" UNION ALL SELECT 1, at, clock, mono, ok, NULL, NULL FROM {LATEST}"
        f" WHERE {mine} AND pid = 0"
        f" UNION ALL SELECT 2, p.at, p.clock, p.mono, p.fresh, w.waits, p.pid FROM {LATEST} p"
        " JOIN (SELECT l.pid, bool_or(l.objsubid = 1) AS waits,"
        " bool_or(l.objsubid = 2) AS intends FROM pg_locks l"
        f" WHERE l.locktype = 'advisory' AND l.classid = {classid:d} AND l.objid = {objid:d}"
        " AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        " AND ((l.objsubid = 1 AND NOT l.granted) OR (l.objsubid = 2 AND l.granted))"
        " GROUP BY l.pid) w ON w.pid = p.pid AND w.intends"
        f" WHERE p.namespace = '{namespace}' AND p.lock_id = {lock:d}"
        f" AND p.pid <> 0 AND p.pid <> pg_backend_pid(){left}"
    ).encode()


# A turn joining its line again: its lock given up and asked for again in one statement,
# so that it waits again the moment it let go (see _latest). Unprepared: rare.
_GIVEN: Final = " FROM (SELECT pg_advisory_unlock($1) OFFSET 0) AS given OFFSET 0"
_AGAIN_UNTIMED: Final = (
    _TOKEN + " FROM (SELECT pg_advisory_lock($1)" + _GIVEN + ") AS granted"
).encode()


def _again(timeout: float | None) -> bytes:
    """The statement that gives lock up and waits for it again, as WAIT (or TRY)."""
    if timeout == 0:
        return (
            _TOKEN + " FROM (SELECT pg_try_advisory_lock($1) AS got" + _GIVEN + ") AS tried"
            " WHERE got"
        ).encode()
    return (
        _TOKEN + " FROM (SELECT set_config('lock_timeout', '0', true) FROM ("
        "SELECT pg_advisory_lock($1) FROM (SELECT set_config('lock_timeout', $2, true)"
        + _GIVEN
        + ") AS settings OFFSET 0) AS granted OFFSET 0) AS unbounded"
    ).encode()


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
    (
        f"DELETE FROM {LATEST} WHERE CASE WHEN pid = 0"
        f" THEN seen < now() - interval '{2 * RECORD_EVERY} seconds'"
        f" AND lock_id NOT IN (SELECT {_LOCK_ID} FROM pg_locks l WHERE {_ADVISORY})"
        " ELSE pid NOT IN (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL) END"
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

#: LINES, and for each session, seconds since the latest work it waits for (or holds) was
#: called, if it posted (NULL otherwise): a table of its own, which an owner of an older
#: version may not have made yet (then LINES is asked).
LINES_LATEST: Final = LINES.replace(
    " FROM pg_locks l",
    f", (SELECT ({_NOW_US} - p.at) / 1e6 FROM {LATEST} p WHERE p.namespace = k.namespace"
    " AND p.lock_id = k.lock_id AND p.pid = l.pid)::float8 FROM pg_locks l",
    1,
)

#: The namespaces whose keys someone holds or waits for now (psycopg's execute).
NAMESPACES: Final = (
    f"SELECT DISTINCT k.namespace FROM pg_locks l JOIN {KEYS} k ON k.lock_id = {_LOCK_ID}"
    f" WHERE {_ADVISORY} ORDER BY 1"
)
