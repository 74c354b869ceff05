"""PostgresBackend.lines() and ``python -m inturn inspect --postgres``, against a real server.

What pg_locks shows, named: each line's key as the user gave it, its holder
and its waiters in the server's queue order, with the client's host and
pid (recorded by the backend in ``inturn_keys`` and ``inturn_sessions``)
and the server's pid. Orderings come from the server's own state (a
session waits in ``pg_locks``), polled with a deadline, never from sleeps.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

from psycopg.conninfo import conninfo_to_dict, make_conninfo  # noqa: E402

from inturn import BackendUnavailable, KeyedQueue  # noqa: E402
from inturn.__main__ import main  # noqa: E402
from inturn.backends import LineInfo  # noqa: E402
from inturn.backends.postgres import PostgresBackend, _session, _sql  # noqa: E402

from support.faults import Proxy  # noqa: E402
from support.helpers import PATIENCE  # noqa: E402
from support.pg_checks import advisory_locks_left  # noqa: E402
from support.processes import Worker  # noqa: E402
from support.servers import free_port  # noqa: E402

WORKER = Path(__file__).parent / "support" / "pg_worker.py"


@pytest.fixture
def namespace() -> str:
    return f"l-{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def backend(postgres_url: str, namespace: str) -> AsyncIterator[PostgresBackend]:
    made = PostgresBackend.from_url(postgres_url, namespace=namespace)
    yield made
    await made.aclose()


@pytest.fixture
async def admin(postgres_url: str) -> AsyncIterator[Any]:
    """A session of the test's own, to look at the server and to change its tables."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as session:
        yield session


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Wait until check() holds (the server's state, asked again), PATIENCE at most."""
    deadline = asyncio.get_running_loop().time() + PATIENCE
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"never reached: {what}")
        await asyncio.sleep(0.005)


async def lines_until(
    backend: PostgresBackend, check: Callable[[list[LineInfo]], bool], what: str
) -> list[LineInfo]:
    """backend.lines(), asked until check(lines) holds; those lines."""
    seen: list[list[LineInfo]] = []

    async def asked() -> bool:
        seen.append(await backend.lines())
        return check(seen[-1])

    await until(asked, what)
    return seen[-1]


async def start(url: str, namespace: str, command: str, key: str, workers: list[Worker]) -> Worker:
    """A worker process on the backend (tests/support/pg_worker.py): ``hold`` or ``take`` key."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(WORKER),
        url,
        namespace,
        command,
        key,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    worker = Worker(process, f"{command} {key}")
    workers.append(worker)
    return worker


async def server_pids(admin: Any) -> dict[int, bool]:
    """Every session in an advisory lock's line: its server pid -> granted."""
    cursor = await admin.execute("SELECT pid, granted FROM pg_locks WHERE locktype = 'advisory'")
    return {int(pid): bool(granted) for pid, granted in await cursor.fetchall()}


# -- who holds, who waits ------------------------------------------------------------------


async def test_lines_show_the_holder_and_the_waiters_of_other_processes_in_turn_order(
    postgres_url: str,
    namespace: str,
    backend: PostgresBackend,
    admin: Any,
    workers: list[Worker],
) -> None:
    holder = await start(postgres_url, namespace, "hold", "order-17", workers)
    await holder.expect("holding")
    waiters = []
    for n in range(1, 4):
        # each joins once the one before it is in the server's queue
        waiters.append(await start(postgres_url, namespace, "take", "order-17", workers))
        await lines_until(
            backend, lambda lines, n=n: len(lines) == 1 and len(lines[0].waiters) == n, f"{n}"
        )
    [line] = await backend.lines()
    assert line.key == "order-17"
    host = socket.gethostname()
    assert line.holder is not None
    assert (line.holder.host, line.holder.pid) == (host, holder.pid)
    assert [(w.host, w.pid) for w in line.waiters] == [(host, w.pid) for w in waiters]
    # the server's pids: the sessions in pg_locks, the holder's granted
    locked = await server_pids(admin)
    assert locked[line.holder.server_pid or 0] is True
    assert [locked[w.server_pid or 0] for w in line.waiters] == [False] * 3
    assert line.holder.token is None
    assert line.holder.held_for >= 0.0
    # the first waiter waited longest
    times = [w.waiting_for for w in line.waiters]
    assert times == sorted(times, reverse=True)
    await holder.release()
    for worker in waiters:
        await worker.expect("holding")
        await worker.expect("released")
    await lines_until(backend, lambda lines: lines == [], "every line emptied")


async def test_a_turns_keys_of_every_kind_come_back_as_they_were_given(
    backend: PostgresBackend,
) -> None:
    keys = ("1", b"1", 1, -7, 10**5000, "é\0/\n", b"\xff\xfe", b"\xff" * 200)
    async with KeyedQueue(backend=backend).keyed(*keys):
        lines = await backend.lines()
    assert [line.key for line in lines] == list(backend.order(keys))
    for line in lines:
        assert line.holder is not None
        assert (line.holder.host, line.holder.pid) == (socket.gethostname(), os.getpid())
        assert line.waiters == ()
    # one session holds every key of the turn
    assert len({line.holder.server_pid for line in lines if line.holder is not None}) == 1
    assert await backend.lines() == []


async def test_a_thread_and_a_task_waiting_are_shown_in_the_servers_queue_order(
    postgres_url: str, namespace: str, backend: PostgresBackend
) -> None:
    queues = [
        KeyedQueue(backend=PostgresBackend.from_url(postgres_url, namespace=namespace))
        for _ in range(3)
    ]
    gate = asyncio.Event()
    try:
        async with queues[0].keyed(b"k"):
            task = asyncio.create_task(queues[1].run(b"k", gate.wait))
            await lines_until(backend, lambda lines: len(lines[0].waiters) == 1, "the task")
            thread = asyncio.create_task(asyncio.to_thread(queues[2].run_sync, b"k", lambda: None))
            [line] = await lines_until(backend, lambda lines: len(lines[0].waiters) == 2, "both")
            first, second = line.waiters
            assert first.server_pid != second.server_pid
            assert first.waiting_for >= second.waiting_for
        [line] = await lines_until(
            backend, lambda lines: len(lines) == 1 and len(lines[0].waiters) == 1, "handed on"
        )
        # the task got the key; the thread still waits
        assert line.holder is not None
        assert line.holder.server_pid == first.server_pid
        assert line.waiters[0].server_pid == second.server_pid
        gate.set()
        await asyncio.wait_for(asyncio.gather(task, thread), PATIENCE)
    finally:
        for queue in queues:
            await queue.backend.aclose()  # type: ignore[union-attr]


async def test_a_namespace_shows_its_own_lines_only(
    postgres_url: str, namespace: str, backend: PostgresBackend
) -> None:
    other = PostgresBackend.from_url(postgres_url, namespace=f"{namespace}-other")
    try:
        async with KeyedQueue(backend=other).keyed("k"), KeyedQueue(backend=backend).keyed("j"):
            assert [line.key for line in await backend.lines()] == ["j"]
            assert [line.key for line in await other.lines()] == ["k"]
            found = await backend.namespaces()
            assert {namespace, f"{namespace}-other"} <= set(found)
            assert found == sorted(found)
    finally:
        await other.aclose()


@pytest.mark.parametrize("conninfo", ["a string", "a function"])
async def test_a_pool_of_your_own_shows_its_lines(
    postgres_url: str, namespace: str, conninfo: str
) -> None:
    from psycopg_pool import AsyncConnectionPool

    async def made() -> str:
        return postgres_url

    # (a string: lines() connects with it; a function: lines() takes one of the pool's)
    given = postgres_url if conninfo == "a string" else made
    pool = AsyncConnectionPool(given, min_size=1, max_size=3, open=False)
    await pool.open(wait=True)
    backend = PostgresBackend(pool, namespace=namespace)
    try:
        async with KeyedQueue(backend=backend).keyed(b"k"):
            [line] = await backend.lines()
        assert line.key == b"k"
        assert line.holder is not None
        assert line.holder.pid == os.getpid()
        await backend.aclose()
        assert pool.get_stats()["pool_available"] == pool.get_stats()["pool_size"]
    finally:
        await pool.close()


async def test_a_killed_holder_leaves_the_lines_as_its_session_ends(
    postgres_url: str, namespace: str, backend: PostgresBackend, workers: list[Worker]
) -> None:
    holder = await start(postgres_url, namespace, "hold", "k", workers)
    await holder.expect("holding")
    [line] = await backend.lines()
    assert line.holder is not None
    assert line.holder.pid == holder.pid
    holder.kill()
    await lines_until(backend, lambda lines: lines == [], "the killed holder's session ended")


# -- what the backend records ------------------------------------------------------------


async def test_a_process_records_a_key_once_not_per_turn(
    admin: Any, namespace: str, backend: PostgresBackend
) -> None:
    queue = KeyedQueue(backend=backend)
    await queue.run("k", lambda: None)
    cursor = await admin.execute(
        "SELECT xmin::text FROM inturn_keys WHERE namespace = %s", [namespace]
    )
    [(version,)] = await cursor.fetchall()
    for _ in range(3):
        await queue.run("k", lambda: None)
    cursor = await admin.execute(
        "SELECT xmin::text FROM inturn_keys WHERE namespace = %s", [namespace]
    )
    assert await cursor.fetchall() == [(version,)]  # (not written again)
    # a row taken away under a process that recorded it: its turns are no longer named
    await admin.execute("DELETE FROM inturn_keys WHERE namespace = %s", [namespace])
    async with queue.keyed("k"):
        assert await backend.lines() == []


@pytest.fixture
async def proxied(postgres_url: str, namespace: str) -> AsyncIterator[tuple[Proxy, KeyedQueue]]:
    """A queue whose backend reaches the server through a Proxy, and that proxy."""
    port = int(conninfo_to_dict(postgres_url).get("port") or 5432)
    proxy = Proxy(port).start()
    url = make_conninfo(postgres_url, port=proxy.port)
    backend = PostgresBackend.from_url(url, namespace=namespace)
    try:
        yield proxy, KeyedQueue(backend=backend)
    finally:
        proxy.thaw()
        await backend.aclose()
        proxy.close()


def taking(queue: KeyedQueue, way: str) -> Callable[[str], Awaitable[str]]:
    """A turn on a key, by way ("task", or "thread": in a thread of its own), that
    returns the key."""

    async def turn(key: str) -> str:
        if way == "task":
            return await queue.run(key, lambda: key)
        return await asyncio.to_thread(queue.run_sync, key, lambda: key)

    return turn


async def recorded(admin: Any, namespace: str) -> list[bytes]:
    """The names of namespace's keys in the table of keys."""
    cursor = await admin.execute(
        "SELECT name FROM inturn_keys WHERE namespace = %s ORDER BY 1", [namespace]
    )
    return [bytes(row[0]) for row in await cursor.fetchall()]


@pytest.mark.parametrize("way", ["task", "thread"])
async def test_a_new_keys_record_goes_out_with_its_wait_in_one_round_trip(
    proxied: tuple[Proxy, KeyedQueue], admin: Any, namespace: str, way: str
) -> None:
    # Before issue 45, a process's first turn on a key sent its record and waited for the
    # answer before it sent the wait: a round trip more per new key.
    proxy, queue = proxied
    turn = taking(queue, way)
    assert await turn("known") == "known"  # (a connection readied and kept, and the tables)
    proxy.hold_replies()  # (the server's answers to the kept connection wait)
    proxy.forget()
    new = asyncio.ensure_future(turn("new"))
    try:
        # both go out before any answer comes back: the wait does not wait for the record
        sent = await asyncio.to_thread(proxy.hears, b"inturn_wait", PATIENCE)
        assert sent is not None, "the wait was not sent before the record's answer came"
        assert sent.count(b"INSERT INTO inturn_keys") == 1
        assert sent.index(b"INSERT INTO inturn_keys") < sent.index(b"inturn_wait")
    finally:
        proxy.thaw()
        done = await asyncio.wait_for(asyncio.gather(new, return_exceptions=True), PATIENCE)
    assert done == ["new"]
    assert await recorded(admin, namespace) == [b"s:known", b"s:new"]


@pytest.mark.parametrize("way", ["task", "thread"])
async def test_without_pipeline_mode_a_new_keys_record_goes_first_in_a_round_trip_of_its_own(
    backend: PostgresBackend,
    admin: Any,
    namespace: str,
    way: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # (a libpq before 14 has no pipeline mode: psycopg's Pipeline.is_supported() is False)
    monkeypatch.setattr(_session, "PIPELINES", False)
    turn = taking(KeyedQueue(backend=backend), way)
    assert [await turn(key) for key in ("known", "new", "new")] == ["known", "new", "new"]
    assert await recorded(admin, namespace) == [b"s:known", b"s:new"]


@pytest.mark.parametrize("way", ["task", "thread"])
async def test_a_connection_lost_with_a_record_and_its_wait_in_flight_leaves_no_lock(
    proxied: tuple[Proxy, KeyedQueue], postgres_url: str, admin: Any, namespace: str, way: str
) -> None:
    # The record and the wait went out together; the server granted the lock, but its
    # answer never came back: the turn fails, the session (and its lock) ends with the
    # connection, and the key, whose record was never answered, is recorded again.
    proxy, queue = proxied
    turn = taking(queue, way)
    assert await turn("known") == "known"
    proxy.hold_replies()
    proxy.forget()
    new = asyncio.ensure_future(turn("new"))
    try:
        assert await asyncio.to_thread(proxy.hears, b"inturn_wait", PATIENCE) is not None
        await until(lambda: _granted_to_someone(admin), "the server granted the wait that went out")
    finally:
        proxy.cut()
        proxy.thaw()
        [failed] = await asyncio.wait_for(asyncio.gather(new, return_exceptions=True), PATIENCE)
    assert isinstance(failed, BackendUnavailable), repr(failed)
    assert await advisory_locks_left(postgres_url) == []
    await admin.execute("DELETE FROM inturn_keys WHERE namespace = %s", [namespace])
    assert await turn("new") == "new"  # (a new connection)
    assert await recorded(admin, namespace) == [b"s:new"]


async def _granted_to_someone(admin: Any) -> bool:
    cursor = await admin.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
    )
    row = await cursor.fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("way", ["task", "thread"])
async def test_a_record_that_finds_the_tables_gone_makes_them_and_the_turn_goes_on(
    backend: PostgresBackend, admin: Any, namespace: str, way: str
) -> None:
    # (the record goes with the wait; the tables are made again after the grant, before
    # the work, and the key recorded then)
    turn = taking(KeyedQueue(backend=backend), way)
    assert await turn("known") == "known"
    await admin.execute("DROP TABLE inturn_keys, inturn_sessions, inturn_latest")
    try:
        assert await turn("new") == "new"
        assert await recorded(admin, namespace) == [b"s:new"]
    finally:
        await admin.execute(_sql.MAKE_TABLES.decode())


async def test_a_record_leaves_the_sessions_settings_as_they_were(
    backend: PostgresBackend,
) -> None:
    # (a record waits 250 ms at most for a row lock, and does not wait for its WAL to
    # be flushed: for its own transaction only, never for the work's)
    async with KeyedQueue(backend=backend).keyed("new", transaction=True) as turn:
        cursor = await turn.connection.execute(
            "SELECT name, setting, reset_val FROM pg_settings"
            " WHERE name IN ('lock_timeout', 'synchronous_commit') ORDER BY 1"
        )
        found = await cursor.fetchall()
    assert [name for name, _, _ in found] == ["lock_timeout", "synchronous_commit"]
    assert [setting for _, setting, _ in found] == [reset for _, _, reset in found]


async def test_rows_nobody_needs_are_tidied_by_the_next_process_that_records_a_key(
    postgres_url: str, admin: Any, namespace: str, backend: PostgresBackend
) -> None:
    queue = KeyedQueue(backend=backend)
    await queue.run("old", lambda: None)
    async with queue.keyed("held"):
        # both recorded more than 2 * RECORD_EVERY ago; "held" is locked now
        await admin.execute(
            "UPDATE inturn_keys SET seen = now() - make_interval(secs => %s) WHERE namespace = %s",
            [2 * _sql.RECORD_EVERY + 60, namespace],
        )
        # a session that ended without a word (no server process has its pid)
        await admin.execute(
            "INSERT INTO inturn_sessions VALUES (2147483647, now(), 'gone', 1)"
            " ON CONFLICT (pid) DO NOTHING"
        )
        newcomer = PostgresBackend.from_url(postgres_url, namespace=namespace)
        try:
            await KeyedQueue(backend=newcomer).run("new", lambda: None)  # (tidies: its first)
        finally:
            await newcomer.aclose()
        cursor = await admin.execute(
            "SELECT name FROM inturn_keys WHERE namespace = %s ORDER BY 1", [namespace]
        )
        assert [bytes(row[0]) for row in await cursor.fetchall()] == [b"s:held", b"s:new"]
        assert [line.key for line in await backend.lines()] == ["held"]
    cursor = await admin.execute("SELECT count(*) FROM inturn_sessions WHERE pid = 2147483647")
    assert await cursor.fetchone() == (0,)  # (the sessions that ended: tidied too)


async def test_a_record_held_up_by_a_lock_on_the_table_gives_up_and_the_turn_goes_on(
    postgres_url: str, namespace: str, backend: PostgresBackend, caplog: pytest.LogCaptureFixture
) -> None:
    queue = KeyedQueue(backend=backend)
    await queue.run("first", lambda: None)  # (the tables are there)
    async with await psycopg.AsyncConnection.connect(postgres_url) as dba:
        await dba.execute("LOCK TABLE inturn_keys IN EXCLUSIVE MODE")  # (left open)
        with caplog.at_level(logging.WARNING, logger="inturn.postgres"):
            ran = [await asyncio.wait_for(queue.run(k, lambda k=k: k), PATIENCE) for k in "ab"]
        await dba.rollback()
    assert ran == ["a", "b"]
    [record] = caplog.records  # (said once until a record succeeds)
    assert "could not record key 'a' for lines() (55P03: " in record.getMessage()
    assert "its turns go on" in record.getMessage()


def documented_sql() -> str:
    """The Backends page's SQL for an owner (its one ``sql`` block), as written."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "backends.md").read_text()
    [block] = [part.split("```", 1)[0] for part in text.split("```sql\n")[1:]]
    assert block.count(" TO app;") == 2
    return block


@pytest.fixture
async def plain(postgres_url: str, admin: Any) -> AsyncIterator[tuple[str, str]]:
    """A database of this test's own, and the URL of a user with no CREATE in it (as
    PostgreSQL 15 makes public), whom its owner let use the sequence of tokens."""
    tag = f"t{uuid.uuid4().hex[:10]}"
    await admin.execute(f"CREATE ROLE {tag} LOGIN")
    await admin.execute(f"CREATE DATABASE {tag}")
    owner_url = postgres_url.rsplit("/", 1)[0] + f"/{tag}"
    async with await psycopg.AsyncConnection.connect(owner_url, autocommit=True) as owner:
        await owner.execute("CREATE SEQUENCE inturn_token AS bigint")
        await owner.execute(f"GRANT USAGE ON SEQUENCE inturn_token TO {tag}")
    try:
        yield owner_url, owner_url.replace("postgres@", f"{tag}@", 1)
    finally:
        await admin.execute(f"DROP DATABASE {tag} WITH (FORCE)")
        await admin.execute(f"DROP ROLE {tag}")


async def test_a_user_who_may_not_make_the_tables_is_told_what_an_owner_runs(
    plain: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    owner_url, url = plain
    backend = PostgresBackend.from_url(url, namespace="shop")
    try:
        with caplog.at_level(logging.WARNING, logger="inturn.postgres"):
            assert await KeyedQueue(backend=backend).run("k", lambda: "ran") == "ran"
            assert await KeyedQueue(backend=backend).run("j", lambda: "ran") == "ran"
        [record] = caplog.records  # (said once)
        said = record.getMessage()
        assert "inturn_keys" in said
        assert "permission denied" in said
        assert "turns go on" in said
        assert "CREATE TABLE IF NOT EXISTS inturn_keys" in said
        assert (
            "GRANT SELECT, INSERT, UPDATE, DELETE ON inturn_keys, inturn_sessions, inturn_latest"
            in said
        )
        with pytest.raises(BackendUnavailable, match="CREATE TABLE IF NOT EXISTS inturn_keys"):
            await backend.lines()
    finally:
        await backend.aclose()
    # what the Backends page says an owner runs, run as written: the user's keys are shown
    async with await psycopg.AsyncConnection.connect(owner_url, autocommit=True) as owner:
        user = url.split("//", 1)[1].split("@", 1)[0]
        await owner.execute(documented_sql().replace(" TO app;", f" TO {user};"))
    backend = PostgresBackend.from_url(url, namespace="shop")
    try:
        async with KeyedQueue(backend=backend).keyed("k"):
            [line] = await backend.lines()
        assert line.key == "k"
        assert line.holder is not None
        assert line.holder.pid == os.getpid()
    finally:
        await backend.aclose()


# -- python -m inturn inspect --postgres -------------------------------------------------


async def test_inspect_postgres_shows_the_lines_as_json_for_scripts(
    postgres_url: str, namespace: str, backend: PostgresBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["inspect", "--postgres", postgres_url, "--namespace", namespace]
    loop = asyncio.get_running_loop()
    async with KeyedQueue(backend=backend).keyed("hot"):
        assert await loop.run_in_executor(None, main, command) == 0
        text = capsys.readouterr().out
        assert await loop.run_in_executor(None, main, [*command, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    assert text.startswith(f"namespace {namespace!r}: 1 active line\n  'hot'\n")
    assert f"held by {socket.gethostname()} pid {os.getpid()} (server pid " in text
    assert report["where"] == f"namespace {namespace!r}"
    [line] = report["lines"]
    assert line["key"] == "'hot'"
    assert line["holder"]["pid"] == os.getpid()
    assert line["holder"]["host"] == socket.gethostname()
    assert isinstance(line["holder"]["server_pid"], int)
    assert line["waiters"] == []


async def test_inspect_postgres_of_an_empty_namespace_names_those_with_lines(
    postgres_url: str, namespace: str, backend: PostgresBackend, capsys: pytest.CaptureFixture[str]
) -> None:
    command = ["inspect", "--postgres", postgres_url, "--namespace", "shpo"]
    loop = asyncio.get_running_loop()
    async with KeyedQueue(backend=backend).keyed("k"):
        assert await loop.run_in_executor(None, main, command) == 0
        text = capsys.readouterr().out
        assert await loop.run_in_executor(None, main, [*command, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
    assert text.startswith("namespace 'shpo': no active lines; namespaces with lines: ")
    assert repr(namespace) in text
    assert namespace in report["namespaces_with_lines"]
    assert report["lines"] == []


def test_inspect_postgres_of_a_wrong_url_says_how_to_write_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["inspect", "--postgres", "localhost:5432"])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert "postgresql://" in err
    assert "Traceback" not in err


def test_inspect_postgres_of_a_port_nobody_listens_on_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    port = free_port()  # (nobody listens on it)
    with pytest.raises(SystemExit) as exit:
        main(["inspect", "--postgres", f"postgresql://postgres@127.0.0.1:{port}/postgres"])
    assert exit.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("inturn: PostgreSQL could not be asked for its lines ("), err
    assert f"127.0.0.1:{port}" in err
    assert err.count("\n") == 1
