"""The PostgreSQL backend's statements, and their parameters in text format.

The backend prepares them on each connection it uses, once, in one round
trip (:func:`prepare`), then sends them by name: the server plans them
once. Every statement that takes or frees a lock also returns
``pg_backend_pid()``, the server session it ran in, so that a pooler that
moves a turn's statements between server sessions is caught.
"""

from __future__ import annotations

import math
from typing import Final

__all__ = (
    "FIND_SEQUENCE",
    "MAKE_SEQUENCE",
    "SEQUENCE",
    "TRY",
    "UNLOCK",
    "UNLOCK_SQL",
    "WAIT",
    "prepare",
    "unlocking",
    "waiting",
)

#: The sequence that fencing tokens are drawn from (in the search_path's first schema).
SEQUENCE: Final = "inturn_token"

FIND_SEQUENCE: Final = b"SELECT to_regclass($1) IS NOT NULL"
MAKE_SEQUENCE: Final = f"CREATE SEQUENCE IF NOT EXISTS {SEQUENCE} AS bigint".encode()

#: How often a waiting session checks that its client is still there (PostgreSQL 14+).
_CHECK_INTERVAL: Final = "1s"

# client_connection_check_interval (14+) makes a waiter whose client died leave the
# queue. It is armed when a statement starts, so it is set for the session: set in
# the waiting statement, it would come too late for that wait.
_CHECK: Final = "SET client_connection_check_interval = '" + _CHECK_INTERVAL + "';"
_STATEMENTS: Final = (
    # inturn_wait: wait for the lock, then draw the token. OFFSET 0 keeps each
    # subquery apart, so the setting comes first, then the lock, then nextval;
    # set_config(..., true) lasts for this statement's transaction only (the session
    # is in autocommit). $2 is lock_timeout in ms ('0': none).
    "PREPARE inturn_wait (int8, text) AS"
    " SELECT nextval('" + SEQUENCE + "'), pg_backend_pid() FROM ("
    " SELECT pg_advisory_lock($1) FROM ("
    "  SELECT set_config('lock_timeout', $2, true) OFFSET 0"
    " ) AS settings OFFSET 0"
    ") AS granted;"
    # timeout=0: ask once; no row if the key is busy.
    "PREPARE inturn_try (int8) AS"
    " SELECT nextval('" + SEQUENCE + "'), pg_backend_pid() FROM ("
    " SELECT pg_try_advisory_lock($1) AS got OFFSET 0"
    ") AS tried WHERE got;"
    # The end of a turn: unlock each of its keys; whether each was held, in order.
    "PREPARE inturn_unlock (int8[]) AS SELECT pg_advisory_unlock(id), pg_backend_pid()"
    " FROM unnest($1) WITH ORDINALITY AS locks(id, n) ORDER BY n;"
    # Which server session this is: not the one the client was told of at connect
    # when a pooler sits in between.
    "SELECT pg_backend_pid();"
)

WAIT: Final = b"inturn_wait"
TRY: Final = b"inturn_try"
UNLOCK: Final = b"inturn_unlock"

#: UNLOCK, unprepared: for a connection whose statements were deallocated meanwhile
#: (``DEALLOCATE ALL`` by a pool's reset, or by the work).
UNLOCK_SQL: Final = (
    b"SELECT pg_advisory_unlock(id), pg_backend_pid()"
    b" FROM unnest($1::int8[]) WITH ORDINALITY AS locks(id, n) ORDER BY n"
)


def prepare(server_version: int) -> bytes:
    """The script that prepares the statements (its last row: the server session's pid)."""
    check = _CHECK if server_version >= 140000 else ""
    return (check + _STATEMENTS).encode()


def waiting(
    lock: int, timeout: float | None, left: float | None
) -> tuple[bytes, list[bytes | None]]:
    """The statement that takes lock within left seconds (``timeout=0``: at once); its params."""
    if timeout == 0:
        return TRY, [str(lock).encode()]
    limit = "0" if left is None else str(max(1, math.ceil(left * 1000)))
    return WAIT, [str(lock).encode(), limit.encode()]


def unlocking(locks: list[int]) -> list[bytes | None]:
    """The parameters of UNLOCK (and UNLOCK_SQL) for locks: one int8 array."""
    return [("{" + ",".join(map(str, locks)) + "}").encode()]
