"""What a PostgreSQL server holds for the tests: advisory locks left behind."""

from __future__ import annotations

import asyncio

import psycopg

#: Seconds a release still in flight (it runs in a task of its own) may take.
PATIENCE = 5.0


async def advisory_locks_left(url: str) -> list[tuple[int, int, bool]]:
    """Advisory locks held or waited for on the server: (classid, objid, granted) each.

    Asked again until none is left or PATIENCE runs out, since a release
    completes in a task of its own after the work returned.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PATIENCE
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as connection:
        while True:
            cursor = await connection.execute(
                "SELECT classid::int8, objid::int8, granted FROM pg_locks"
                " WHERE locktype = 'advisory' ORDER BY 1, 2"
            )
            left = [(int(c), int(o), bool(g)) for c, o, g in await cursor.fetchall()]
            if not left or loop.time() > deadline:
                return left
            await asyncio.sleep(0.01)
