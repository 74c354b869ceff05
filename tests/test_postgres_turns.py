"""Turns of a KeyedQueue on PostgreSQL: one connection per turn, and transaction=True.

Against a real server (tests/support/pg_server.py). What every backend does is in
test_backend_conformance.py; the faults across processes are in
test_postgres_faults.py.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

from inturn import BackendUnavailable, KeyedQueue, LeaseLost  # noqa: E402
from inturn.backends.postgres import PostgresBackend  # noqa: E402

from support.helpers import PATIENCE  # noqa: E402
from support.pg_checks import advisory_locks_left  # noqa: E402


def _backend(url: str, **settings: Any) -> PostgresBackend:
    return PostgresBackend.from_url(url, namespace=f"t-{uuid.uuid4().hex[:12]}", **settings)


@pytest.fixture
async def admin(postgres_url: str) -> AsyncIterator[Any]:
    """A session of the test's own, to look at pg_locks and the tables."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as session:
        yield session


@pytest.fixture
async def table(admin: Any) -> AsyncIterator[str]:
    """A table of its own: rows (n int primary key, note text)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    await admin.execute(f"CREATE TABLE {name} (n int PRIMARY KEY, note text)")
    yield name
    await admin.execute(f"DROP TABLE {name}")


async def _holders(admin: Any) -> list[int]:
    """The server pids holding advisory locks, one entry per lock."""
    cursor = await admin.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted ORDER BY pid"
    )
    return [int(pid) for (pid,) in await cursor.fetchall()]


async def _rows(admin: Any, table: str) -> list[int]:
    cursor = await admin.execute(f"SELECT n FROM {table} ORDER BY n")
    return [int(n) for (n,) in await cursor.fetchall()]


# -- one connection per turn -------------------------------------------------------------


async def test_a_turn_on_several_keys_holds_them_on_one_connection(
    postgres_url: str, admin: Any
) -> None:
    backend = _backend(postgres_url, max_sessions=1)
    queue = KeyedQueue(backend=backend)
    try:
        async with queue.keyed("a", "b", "c"):
            holders = await _holders(admin)
        assert len(holders) == 3
        assert len(set(holders)) == 1
    finally:
        await backend.aclose()
    assert await advisory_locks_left(postgres_url) == []


async def test_turns_on_several_keys_never_deadlock_over_connections(postgres_url: str) -> None:
    """Two connections, three turns of two keys each, all started at once.

    With a connection per key, ("a", "b") and ("c", "d") could each hold one
    connection and wait for a second: neither would ever finish.
    """
    backend = _backend(postgres_url, max_sessions=2)
    queue = KeyedQueue(backend=backend)
    inside: list[tuple[str, ...]] = []

    async def turn(*keys: str) -> None:
        async with queue.keyed(*keys):
            inside.append(keys)
            await asyncio.sleep(0)

    try:
        await asyncio.wait_for(
            asyncio.gather(turn("a", "b"), turn("c", "d"), turn("b", "c"), turn("d", "e")),
            PATIENCE,
        )
        assert sorted(inside) == [("a", "b"), ("b", "c"), ("c", "d"), ("d", "e")]
    finally:
        await backend.aclose()


async def test_turns_beyond_max_sessions_wait_here_and_all_run(
    postgres_url: str, admin: Any
) -> None:
    """Five keys at once on two connections: three wait in this process, none on the server."""
    backend = _backend(postgres_url, max_sessions=2)
    queue = KeyedQueue(backend=backend)
    gate = asyncio.Event()
    entered: list[str] = []

    async def hold(key: str) -> None:
        async with queue.keyed(key):
            entered.append(key)
            await gate.wait()

    try:
        tasks = [asyncio.create_task(hold(key)) for key in "vwxyz"]
        deadline = asyncio.get_running_loop().time() + PATIENCE
        while len(entered) < 2:
            assert asyncio.get_running_loop().time() < deadline, "two turns never entered"
            await asyncio.sleep(0.01)
        for _ in range(20):  # the others stay out: no third connection is made
            await asyncio.sleep(0.005)
            assert len(entered) == 2
            assert len(await _holders(admin)) == 2
        gate.set()
        await asyncio.wait_for(asyncio.gather(*tasks), PATIENCE)
        assert sorted(entered) == list("vwxyz")
    finally:
        gate.set()
        await backend.aclose()


async def test_a_timeout_covers_the_wait_for_a_connection(postgres_url: str) -> None:
    backend = _backend(postgres_url, max_sessions=1)
    queue = KeyedQueue(backend=backend)
    held, done = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with queue.keyed("a"):
            held.set()
            await done.wait()

    async def other() -> None:
        async with queue.keyed("b", timeout=0.1):
            pytest.fail("ran without a connection")

    try:
        holder = asyncio.create_task(hold())
        await held.wait()
        with pytest.raises(TimeoutError, match="the work did not run"):
            await other()
        done.set()
        await holder
        async with queue.keyed("b", timeout=PATIENCE):  # and the slot came back
            pass
    finally:
        await backend.aclose()


async def test_a_nested_turn_takes_its_keys_on_the_enclosing_turns_connection(
    postgres_url: str, admin: Any
) -> None:
    """One connection is enough for a turn inside a turn: it cannot wait for a second."""
    backend = _backend(postgres_url, max_sessions=1)
    queue = KeyedQueue(backend=backend)
    try:
        async with queue.keyed("outer"):
            # (in this task: a timeout, not wait_for, which would run it in another)
            async with queue.keyed("inner", timeout=PATIENCE):
                holders = await _holders(admin)
            after_inner = await _holders(admin)
        assert len(holders) == 2
        assert len(set(holders)) == 1
        assert len(after_inner) == 1  # the inner key was freed at the inner block's end
    finally:
        await backend.aclose()
    assert await advisory_locks_left(postgres_url) == []


async def test_a_nested_turn_whose_session_ended_under_it_raises_lease_lost(
    postgres_url: str, admin: Any
) -> None:
    """The inner turn learns it at its own end, not only the turn around it."""
    backend = _backend(postgres_url, max_sessions=1)
    queue = KeyedQueue(backend=backend)

    async def inner() -> None:
        async with queue.keyed("inner", timeout=PATIENCE):
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_locks"
                " WHERE locktype = 'advisory' AND granted AND pid <> pg_backend_pid()"
            )

    async def outer() -> None:
        async with queue.keyed("outer"):
            with pytest.raises(LeaseLost, match="'inner'"):
                await inner()

    try:
        with pytest.raises(LeaseLost, match="'outer'"):
            await outer()
        assert await queue.run("outer", lambda: "again") == "again"  # a new session
    finally:
        await backend.aclose()


async def test_tasks_started_inside_a_turn_take_connections_of_their_own(
    postgres_url: str, admin: Any
) -> None:
    """They see the turn as their current one, but must not share its connection."""
    backend = _backend(postgres_url, max_sessions=3)
    queue = KeyedQueue(backend=backend)

    async def inner(key: str) -> list[int]:
        async with queue.keyed(key):
            await asyncio.sleep(0)  # (both inner turns are held at once)
            return await _holders(admin)

    try:
        async with queue.keyed("outer"):
            seen = await asyncio.wait_for(asyncio.gather(inner("x"), inner("y")), PATIENCE)
        assert all(len(holders) >= 2 for holders in seen)
    finally:
        await backend.aclose()
    assert await advisory_locks_left(postgres_url) == []


async def test_a_connection_the_server_ended_in_the_pool_is_replaced(own_postgres: Any) -> None:
    """After a server restart, the pool's idle connection is stale: the next turn still runs."""
    backend = _backend(own_postgres.url)
    queue = KeyedQueue(backend=backend)
    try:
        assert await queue.run("k", lambda: "before") == "before"
        own_postgres.stop("fast")
        own_postgres.start()
        assert await queue.run("k", lambda: "after") == "after"
    finally:
        await backend.aclose()


async def _session_ends(admin: Any, pid: int) -> bool:
    """Whether the server's session pid is gone (asked until it is, or PATIENCE ran out)."""
    deadline = asyncio.get_running_loop().time() + PATIENCE
    while True:
        cursor = await admin.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", [pid])
        row = await cursor.fetchone()
        if row is not None and row[0] == 0:
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.02)


async def test_a_threads_turn_that_ends_after_aclose_closes_its_connection(
    postgres_url: str, admin: Any
) -> None:
    """aclose() while a thread holds a key: the connection is closed when the turn ends,
    not kept by a place nothing will close (left to the collector, with a ResourceWarning)."""
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)
    inside, leave = threading.Event(), threading.Event()

    def hold() -> None:
        with queue.keyed("k"):
            inside.set()
            assert leave.wait(PATIENCE)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert await asyncio.to_thread(inside.wait, PATIENCE)
        (pid,) = await _holders(admin)
        await backend.aclose()
    finally:
        leave.set()
        await asyncio.to_thread(thread.join, PATIENCE)
    assert await _session_ends(admin, pid)


async def test_a_tasks_turn_that_ends_after_aclose_closes_its_connection(
    postgres_url: str, admin: Any
) -> None:
    """The same for a task's turn: aclose() from another task while it holds its key."""
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)
    inside, leave = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with queue.keyed("k"):
            inside.set()
            await leave.wait()

    holder = asyncio.create_task(hold())
    try:
        await asyncio.wait_for(inside.wait(), PATIENCE)
        (pid,) = await _holders(admin)
        await backend.aclose()
    finally:
        leave.set()
        await asyncio.wait_for(holder, PATIENCE)
    assert await _session_ends(admin, pid)
    await backend.aclose()


# -- transaction=True ----------------------------------------------------------------------


async def test_a_transaction_turn_commits_when_the_block_ends(
    postgres_url: str, admin: Any, table: str
) -> None:
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)
    try:
        async with queue.keyed("acct-1", "acct-2", transaction=True) as turn:
            await turn.connection.execute(f"INSERT INTO {table} VALUES (1, 'x')")
            assert await _rows(admin, table) == []  # not committed yet
        assert await _rows(admin, table) == [1]
    finally:
        await backend.aclose()
    assert await advisory_locks_left(postgres_url) == []


async def test_a_transaction_turn_rolls_back_on_an_exception(
    postgres_url: str, admin: Any, table: str
) -> None:
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)
    try:

        async def fails() -> None:
            async with queue.keyed("acct-1", transaction=True) as turn:
                await turn.connection.execute(f"INSERT INTO {table} VALUES (1, 'x')")
                1 / 0  # noqa: B018

        with pytest.raises(ZeroDivisionError):
            await fails()
        assert await _rows(admin, table) == []
        async with queue.keyed("acct-1", transaction=True) as turn:  # the connection is clean
            await turn.connection.execute(f"INSERT INTO {table} VALUES (2, 'y')")
        assert await _rows(admin, table) == [2]
    finally:
        await backend.aclose()
    assert await advisory_locks_left(postgres_url) == []


async def test_the_next_holder_sees_the_writes_of_the_one_before(
    postgres_url: str, admin: Any, table: str
) -> None:
    """The key is free only once the commit finished: each turn reads its predecessor's row."""
    namespace = f"t-{uuid.uuid4().hex[:12]}"  # one namespace: as three processes of one app
    queues = [
        KeyedQueue(backend=PostgresBackend.from_url(postgres_url, namespace=namespace))
        for _ in range(3)
    ]
    seen: list[int] = []

    async def step(queue: KeyedQueue, n: int) -> None:
        async with queue.keyed("counter", transaction=True) as turn:
            cursor = await turn.connection.execute(f"SELECT count(*) FROM {table}")
            row = await cursor.fetchone()
            seen.append(int(row[0]))
            await turn.connection.execute(f"INSERT INTO {table} VALUES (%s, 'x')", (n,))

    try:
        await asyncio.wait_for(
            asyncio.gather(*(step(queues[n % 3], n) for n in range(12))), PATIENCE
        )
        assert sorted(seen) == list(range(12))
    finally:
        for queue in queues:
            await queue.aclose()


async def test_a_commit_the_database_refuses_raises_its_error_after_the_work(
    postgres_url: str, admin: Any, table: str
) -> None:
    name = f"{table}_deferred"
    await admin.execute(f"CREATE TABLE {name} (n int UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)
    ran = []

    async def work() -> None:
        async with queue.keyed("k", transaction=True) as turn:
            await turn.connection.execute(f"INSERT INTO {name} VALUES (1), (1)")
            ran.append(True)

    try:
        with pytest.raises(psycopg.errors.UniqueViolation):
            await work()
        assert ran
        cursor = await admin.execute(f"SELECT count(*) FROM {name}")
        assert (await cursor.fetchone())[0] == 0
    finally:
        await backend.aclose()
        await admin.execute(f"DROP TABLE {name}")
    assert await advisory_locks_left(postgres_url) == []


async def test_a_failed_statement_the_work_swallowed_is_not_committed_silently(
    postgres_url: str, admin: Any, table: str
) -> None:
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)
    try:

        async def swallows() -> None:
            async with queue.keyed("k", transaction=True) as turn:
                await turn.connection.execute(f"INSERT INTO {table} VALUES (1, 'kept?')")
                try:
                    await turn.connection.execute("SELECT 1 / 0")
                except psycopg.errors.DivisionByZero:
                    pass

        with pytest.raises(psycopg.errors.InFailedSqlTransaction, match="rolled back"):
            await swallows()
        assert await _rows(admin, table) == []
    finally:
        await backend.aclose()
    assert await advisory_locks_left(postgres_url) == []


async def test_a_commit_inside_the_block_does_not_free_the_keys(
    postgres_url: str, admin: Any, table: str
) -> None:
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)
    try:
        async with queue.keyed("k", transaction=True) as turn:
            await turn.connection.execute(f"INSERT INTO {table} VALUES (1, 'x')")
            await turn.connection.commit()
            assert len(await _holders(admin)) == 1
        assert await _rows(admin, table) == [1]
    finally:
        await backend.aclose()
    assert await advisory_locks_left(postgres_url) == []


async def test_a_transaction_turn_on_a_loop_per_job(postgres_url: str, table: str) -> None:
    """asyncio.run() per job: a loop the backend does not serve directly gets its own connection."""
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)

    async def job(n: int) -> None:
        async with queue.keyed("k", transaction=True) as turn:
            await turn.connection.execute(f"INSERT INTO {table} VALUES (%s, 'x')", (n,))

    def jobs() -> None:
        for n in range(4):
            asyncio.run(job(n))

    thread = threading.Thread(target=jobs)
    thread.start()
    await asyncio.to_thread(thread.join, PATIENCE * 4)
    assert not thread.is_alive()
    async with await psycopg.AsyncConnection.connect(postgres_url) as check:
        cursor = await check.execute(f"SELECT n FROM {table} ORDER BY n")
        assert [n for (n,) in await cursor.fetchall()] == [0, 1, 2, 3]
    await backend.aclose()


async def test_turn_connection_exists_only_inside_a_transaction_turn(postgres_url: str) -> None:
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)
    try:
        turn = queue.keyed("k", transaction=True)
        with pytest.raises(RuntimeError, match="transaction=True"):
            turn.connection  # noqa: B018
        async with queue.keyed("k") as plain:
            with pytest.raises(RuntimeError, match="transaction=True"):
                plain.connection  # noqa: B018
    finally:
        await backend.aclose()


def test_transaction_true_is_refused_at_once_where_it_cannot_be_served(
    postgres_url: str,
) -> None:
    with pytest.raises(TypeError, match="needs a backend that takes turns in a database"):
        KeyedQueue().keyed("k", transaction=True)
    queue = KeyedQueue(backend=_backend(postgres_url))
    with pytest.raises(TypeError, match="transaction must be True or False, got 'yes'"):
        queue.keyed("k", transaction="yes")  # type: ignore[arg-type]


def test_a_threads_transaction_turn_commits_or_rolls_back(postgres_url: str) -> None:
    """A thread's turn gets a sync connection, in a transaction, as a task's gets an async one."""
    backend = _backend(postgres_url)
    queue = KeyedQueue(backend=backend)
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE TABLE {name} (n int PRIMARY KEY)")

        def rows() -> list[int]:
            return [n for (n,) in admin.execute(f"SELECT n FROM {name} ORDER BY n").fetchall()]

        def fails() -> None:
            with queue.keyed("a", "b", transaction=True) as turn:
                turn.connection.execute(f"INSERT INTO {name} VALUES (2)")
                raise KeyError("rolled back")

        try:
            with queue.keyed("a", "b", transaction=True) as turn:
                assert isinstance(turn.connection, psycopg.Connection)
                turn.connection.execute(f"INSERT INTO {name} VALUES (1)")
                assert rows() == []  # not committed yet
            assert rows() == [1]
            with pytest.raises(KeyError, match="rolled back"):
                fails()
            assert rows() == [1]
        finally:
            admin.execute(f"DROP TABLE {name}")
            asyncio.run(backend.aclose())


async def test_a_pool_of_your_own_serves_its_loop_and_gets_its_connections_back(
    postgres_url: str,
) -> None:
    from psycopg_pool import AsyncConnectionPool

    pool = AsyncConnectionPool(postgres_url, min_size=1, max_size=3, open=False)
    await pool.open(wait=True)
    backend = PostgresBackend(pool, namespace=f"t-{uuid.uuid4().hex[:12]}")
    queue = KeyedQueue(backend=backend)
    try:
        assert await asyncio.gather(*(queue.run(k, lambda k=k: k) for k in "abc")) == list("abc")
        assert pool.get_stats()["pool_size"] <= 3  # (its own bound: max_sessions is its max_size)
        await backend.aclose()
        assert pool.get_stats()["pool_available"] == pool.get_stats()["pool_size"]
        assert not pool.closed  # the backend leaves a pool of yours open
    finally:
        await pool.close()


async def test_a_timeout_waiting_for_a_connection_of_your_pool_names_its_max_size(
    postgres_url: str,
) -> None:
    # Issue 31: a pool of your own with max_size=1 held by a turn on another key.
    from psycopg_pool import AsyncConnectionPool

    pool = AsyncConnectionPool(postgres_url, min_size=1, max_size=1, open=False)
    await pool.open(wait=True)
    backend = PostgresBackend(pool, namespace=f"t-{uuid.uuid4().hex[:12]}")
    queue = KeyedQueue(backend=backend)
    entered, leave = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        entered.set()
        await leave.wait()

    holder = asyncio.create_task(queue.run("a", hold))
    try:
        await asyncio.wait_for(entered.wait(), PATIENCE)
        with pytest.raises(TimeoutError) as late:
            async with queue.keyed("b", timeout=0.3):
                pytest.fail("the block ran without a connection")
        leave.set()
        await asyncio.wait_for(holder, PATIENCE)
    finally:
        leave.set()
        await backend.aclose()
        await pool.close()
    assert str(late.value) == (
        "inturn: the turn for key 'b' was not reached within 0.3 s: it was waiting for a "
        "connection of the pool (all max_size=1 of your pool held by turns); the work did "
        "not run. Raise your pool's max_size"
    )


async def test_missing_privileges_are_named_and_the_work_does_not_run(own_postgres: Any) -> None:
    """A user who may not make the sequence of tokens, then one who may not use it."""
    async with await psycopg.AsyncConnection.connect(own_postgres.url, autocommit=True) as admin:
        await admin.execute("CREATE ROLE plain LOGIN")  # PostgreSQL 15: no CREATE on public
        url = own_postgres.url.replace("postgres@", "plain@", 1)
        ran: list[str] = []
        for fix in ("CREATE SEQUENCE inturn_token", "GRANT USAGE ON SEQUENCE inturn_token"):
            backend = _backend(url)
            try:
                with pytest.raises(BackendUnavailable, match=fix) as raised:
                    await KeyedQueue(backend=backend).run("k", ran.append, "ran")
                assert "the work did not run" in str(raised.value)
            finally:
                await backend.aclose()
            await admin.execute("CREATE SEQUENCE IF NOT EXISTS inturn_token")  # (no grant)
        assert ran == []


@pytest.mark.parametrize("keys", [("a",), ("a", "b")], ids=["one key", "two keys"])
async def test_statements_deallocated_under_a_plain_turn_still_unlock_its_keys(
    postgres_url: str, keys: tuple[str, ...]
) -> None:
    """A plain turn's unlock (one key's statement, or an array's) finds the statements
    gone (DEALLOCATE ALL, as a pool's reset runs): it unlocks unprepared, and holds."""
    backend = _backend(postgres_url, max_sessions=1)
    try:
        session = backend.session(len(keys), False, False)  # (a plain turn's, as the queue's)
        grants = [await session.acquire(key, None) for key in keys]
        await session.connection.execute("DEALLOCATE ALL")
        await session.close(None)
        assert [grant.lost for grant in grants] == [False] * len(keys)
        assert await advisory_locks_left(postgres_url) == []
        assert await KeyedQueue(backend=backend).run("a", lambda: "again") == "again"
    finally:
        await backend.aclose()


async def test_statements_deallocated_by_the_work_still_unlock_the_keys(
    postgres_url: str, table: str
) -> None:
    """The work may run DEALLOCATE ALL (or DISCARD) on its connection: the keys are unlocked
    all the same, and the next turn prepares the statements again."""
    backend = _backend(postgres_url, max_sessions=1)
    queue = KeyedQueue(backend=backend)
    try:
        async with queue.keyed("a", "b", transaction=True) as turn:
            await turn.connection.execute(f"INSERT INTO {table} VALUES (1, 'x')")
            await turn.connection.execute("DEALLOCATE ALL")
        assert not turn.lease_lost
        assert await advisory_locks_left(postgres_url) == []
        assert await queue.run("a", lambda: "again") == "again"  # (the same connection)
    finally:
        await backend.aclose()
