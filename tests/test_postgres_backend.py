"""What only the PostgreSQL backend does, against a real server (tests/support/pg_server.py).

The guarantees every backend keeps are in test_backend_conformance.py. Here:
the constructor's checks, no trace in ``pg_locks`` after a timeout or a
cancellation (also one that races the grant), tokens across backends, a
holder or waiter whose session is terminated, and the import boundary.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

from inturn import BackendUnavailable, KeyedQueue, LeaseLost  # noqa: E402
from inturn.backends.postgres import PostgresBackend, _wire  # noqa: E402
from inturn.backends.postgres._keys import lock_id, lock_parts  # noqa: E402

from support.helpers import PATIENCE  # noqa: E402
from support.pg_checks import advisory_locks_left  # noqa: E402


@pytest.fixture
async def backend(postgres_url: str) -> AsyncIterator[PostgresBackend]:
    made = PostgresBackend.from_url(postgres_url, namespace=f"t-{uuid.uuid4().hex[:12]}")
    yield made
    await made.aclose()


@pytest.fixture
async def admin(postgres_url: str) -> AsyncIterator[Any]:
    """A session of the test's own, to look at pg_locks and to end other sessions."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as session:
        yield session


async def waiters(admin: Any, lock: int) -> int:
    """How many sessions wait (not granted) for the advisory lock ``lock``."""
    cursor = await admin.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
        " AND classid = %s AND objid = %s AND objsubid = 1",
        lock_parts(lock),
    )
    row = await cursor.fetchone()
    return int(row[0])


async def until(check: Any, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + PATIENCE
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"never reached: {what}")
        await asyncio.sleep(0.005)


def test_importing_inturn_imports_no_psycopg() -> None:
    code = "import sys, inturn, inturn.backends; print('psycopg' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        ({"namespace": "has space"}, ValueError),
        ({"namespace": ""}, ValueError),
        ({"max_sessions": 0}, ValueError),
        ({"max_sessions": True}, TypeError),
        ({"max_sessions": 1.5}, TypeError),
        ({"session_wait": -1}, ValueError),
        ({"session_wait": "30"}, TypeError),
        ({"unreachable_after": 0}, ValueError),
        ({"unreachable_after": None}, ValueError),
        ({"unreachable_after": True}, TypeError),
    ],
)
def test_bad_settings_are_refused(args: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match="inturn: "):
        PostgresBackend("postgresql://localhost/x", **args)


def test_a_pool_or_conninfo_only() -> None:
    with pytest.raises(TypeError, match="conninfo"):
        PostgresBackend(42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("postgress://me:secret@db/shop", "'postgress' is not a PostgreSQL URL's scheme"),
        ("POSTGRESQL://me:secret@db/shop", "'POSTGRESQL' is not a PostgreSQL URL's scheme"),
        ("jdbc:postgresql://db/shop", "'jdbc:postgresql' is not a PostgreSQL URL's scheme"),
        ("localhost:5432", "'localhost:5432' is neither a PostgreSQL URL nor a conninfo string"),
        ("host=db password=secret dbname", "cannot read the conninfo"),
        ("postgresql://db/shop?nosuch=1", 'invalid URI query parameter: "nosuch"'),
    ],
)
def test_a_wrong_url_is_refused_with_how_to_write_it(url: str, said: str) -> None:
    """Refused at from_url, with the example of a right one, not at the first turn."""
    with pytest.raises(ValueError, match=r"^inturn: ") as refused:
        PostgresBackend.from_url(url)
    message = str(refused.value)
    assert said in message
    assert "postgresql://user:password@host:5432/dbname" in message
    assert "host=host port=5432 dbname=dbname user=user" in message
    assert "secret" not in message  # (a password is never written out)
    assert refused.value.__cause__ is None  # (nor left in psycopg's error's message)


@pytest.mark.parametrize(
    ("url", "where"),
    [
        ("postgres://db:6543/shop", "db:6543/shop"),
        ("host=db dbname=shop", "db:5432/shop"),
        ("", "localhost:5432/"),  # (libpq's defaults: PGHOST, PGDATABASE, ...)
    ],
)
def test_every_form_libpq_reads_is_taken(url: str, where: str) -> None:
    assert repr(PostgresBackend.from_url(url)) == f"PostgresBackend({where!r}, namespace='inturn')"


@pytest.fixture
def http_port() -> Iterator[int]:
    """The port of an HTTP server of this test's own (it answers every request)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("mode", ["task", "thread"])
@pytest.mark.parametrize("other", ["redis", "http"])
def test_a_url_at_another_kind_of_server_says_what_answered_at_once(
    request: pytest.FixtureRequest, other: str, mode: str
) -> None:
    """Issue 42: a URL at a port where another server listens (a typo, a wrong service)
    failed after unreachable_after (10 s), saying only "(timed out)": that server waits for
    a line end that PostgreSQL's first message never has. Now the turn fails within a
    second or two, naming what answered, and the work does not run."""
    if other == "redis":
        port = int(request.getfixturevalue("redis_url").rsplit(":", 1)[1].split("/")[0])
    else:
        port = request.getfixturevalue("http_port")
    backend = PostgresBackend.from_url(f"postgresql://me@127.0.0.1:{port}/db", namespace="t")
    queue, ran = KeyedQueue(backend=backend), []

    def turn() -> None:
        if mode == "task":
            asyncio.run(queue.run("k", ran.append, 1))
        else:
            queue.run_sync("k", ran.append, 1)

    began = time.monotonic()
    with pytest.raises(BackendUnavailable) as refused:
        turn()
    took = time.monotonic() - began
    said = str(refused.value)
    assert f"127.0.0.1:{port} is not a PostgreSQL server" in said
    assert ("+PONG" if other == "redis" else "<!DOCTYPE HTML") in said  # (http.server's)
    assert "did not run" in said
    assert ran == []
    assert took < backend._connections.limits.unreachable_after / 2  # (not its timeout)
    asyncio.run(backend.aclose())


def test_repr_names_the_server_without_credentials() -> None:
    backend = PostgresBackend.from_url("postgresql://me:secret@db.example:6543/shop", namespace="s")
    assert repr(backend) == "PostgresBackend('db.example:6543/shop', namespace='s')"


async def test_a_timed_out_wait_leaves_the_servers_queue(
    backend: PostgresBackend, admin: Any
) -> None:
    grant = await backend.acquire("k", None)
    with pytest.raises(TimeoutError, match=r"within 0\.05 s"):
        await backend.acquire("k", 0.05)
    assert await waiters(admin, lock_id(backend.namespace, "k")) == 0
    await backend.release(grant)
    assert not grant.lost


async def test_a_cancelled_wait_leaves_the_servers_queue(
    backend: PostgresBackend, admin: Any
) -> None:
    lock = lock_id(backend.namespace, "k")
    grant = await backend.acquire("k", None)
    waiter = asyncio.create_task(backend.acquire("k", None))
    await until(lambda: _is(waiters(admin, lock), 1), "the waiter queued")
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert await waiters(admin, lock) == 0
    await backend.release(grant)
    again = await backend.acquire("k", 0)  # nobody else holds it
    await backend.release(again)


async def _is(count: Any, n: int) -> bool:
    return bool(await count == n)


@pytest.mark.parametrize("delay", [0, 1, 2, 3, 5, 8])
async def test_a_wait_cancelled_as_it_is_granted_leaves_no_lock(
    backend: PostgresBackend, admin: Any, postgres_url: str, delay: int
) -> None:
    """The grant and the cancel race; whichever wins, the key ends up free."""
    lock = lock_id(backend.namespace, "k")
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as other:
        await other.execute("SELECT pg_advisory_lock(%s)", (lock,))
        waiter = asyncio.create_task(backend.acquire("k", None))
        await until(lambda: _is(waiters(admin, lock), 1), "the waiter queued")
        await other.execute("SELECT pg_advisory_unlock(%s)", (lock,))
        for _ in range(delay):
            await asyncio.sleep(0)
        waiter.cancel()
        try:
            grant = await waiter
        except asyncio.CancelledError:
            pass
        else:  # the grant was complete before the cancel arrived
            await backend.release(grant)
    assert await advisory_locks_left(postgres_url) == []


async def test_tokens_grow_across_backends(postgres_url: str) -> None:
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    one = PostgresBackend.from_url(postgres_url, namespace=namespace)
    two = PostgresBackend.from_url(postgres_url, namespace=namespace)
    try:
        tokens = []
        for backend in (one, two, one, two):
            grant = await backend.acquire("k", None)
            tokens.append(grant.token)
            await backend.release(grant)
        assert tokens == sorted(set(tokens))
    finally:
        await one.aclose()
        await two.aclose()


async def test_a_holder_whose_session_is_terminated_learns_it(
    backend: PostgresBackend, admin: Any
) -> None:
    queue = KeyedQueue(backend=backend)

    async def work() -> str:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
            " AND granted AND pid <> pg_backend_pid()"
        )
        return "ran"

    with pytest.raises(LeaseLost, match="could no longer vouch"):
        await queue.run("k", work)
    # and the next turn works, on a new session
    assert await queue.run("k", lambda: "again") == "again"


async def test_a_waiter_whose_session_is_terminated_gets_backend_unavailable(
    backend: PostgresBackend, admin: Any
) -> None:
    lock = lock_id(backend.namespace, "k")
    grant = await backend.acquire("k", None)
    waiter = asyncio.create_task(backend.acquire("k", None))
    await until(lambda: _is(waiters(admin, lock), 1), "the waiter queued")
    await admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory'"
        " AND NOT granted AND pid <> pg_backend_pid()"
    )
    with pytest.raises(BackendUnavailable, match="the work did not run"):
        await waiter
    await backend.release(grant)
    assert not grant.lost


async def test_a_waiter_waits_in_the_servers_lock_queue_without_polling(
    backend: PostgresBackend, admin: Any
) -> None:
    """One statement per wait: the waiter's session sits in the lock queue (wait event
    'advisory') and sends nothing more while it waits."""
    lock = lock_id(backend.namespace, "k")
    grant = await backend.acquire("k", None)
    waiter = asyncio.create_task(backend.acquire("k", None))
    await until(lambda: _is(waiters(admin, lock), 1), "the waiter queued")

    async def state() -> tuple[Any, ...]:
        cursor = await admin.execute(
            "SELECT a.wait_event_type, a.wait_event, a.query_start, a.xact_start"
            " FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND NOT l.granted"
        )
        row = await cursor.fetchone()
        assert row is not None
        return tuple(row)

    first = await state()
    assert first[:2] == ("Lock", "advisory")
    for _ in range(20):  # while it waits, its one statement is still the one running
        await asyncio.sleep(0.01)
        assert await state() == first
    await backend.release(grant)
    await backend.release(await waiter)


async def names_of_sessions_holding(admin: Any, lock: int) -> list[str]:
    """The application_name of each session that holds the advisory lock ``lock``."""
    cursor = await admin.execute(
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE l.locktype = 'advisory' AND l.granted"
        " AND l.classid = %s AND l.objid = %s AND l.objsubid = 1",
        lock_parts(lock),
    )
    return [row[0] for row in await cursor.fetchall()]


@pytest.mark.parametrize("shape", ["task", "thread"])
async def test_a_turns_session_is_named_for_operators(
    postgres_url: str, admin: Any, shape: str
) -> None:
    # pg_stat_activity shows "inturn <namespace>" for the sessions that hold turns
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    backend = PostgresBackend.from_url(postgres_url, namespace=namespace)
    queue = KeyedQueue(backend=backend)
    lock = lock_id(namespace, "k")
    try:
        if shape == "task":
            async with queue.keyed("k"):
                names = await names_of_sessions_holding(admin, lock)
        else:

            def in_a_thread() -> list[str]:
                with queue.keyed("k"):
                    return asyncio.run(names_of_sessions_holding_now(postgres_url, lock))

            names = await asyncio.to_thread(in_a_thread)
    finally:
        await backend.aclose()
    assert names == [f"inturn {namespace}"]


async def names_of_sessions_holding_now(url: str, lock: int) -> list[str]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as session:
        return await names_of_sessions_holding(session, lock)


@pytest.mark.parametrize("where", ["url", "environment"])
async def test_an_application_name_of_the_users_is_kept(
    postgres_url: str, admin: Any, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    namespace = f"t-{uuid.uuid4().hex[:12]}"
    url = postgres_url
    if where == "url":
        url += ("&" if "?" in url else "?") + "application_name=billing"
    else:
        monkeypatch.setenv("PGAPPNAME", "billing")
    backend = PostgresBackend.from_url(url, namespace=namespace)
    try:
        async with KeyedQueue(backend=backend).keyed("k"):
            names = await names_of_sessions_holding(admin, lock_id(namespace, "k"))
    finally:
        await backend.aclose()
    assert names == ["billing"]


async def test_a_statement_the_socket_cannot_take_at_once_leaves_no_writer_behind(
    postgres_url: str,
) -> None:
    """A statement larger than the socket's buffer is finished by the event loop's writer,
    which goes once it is written, or once the connection is closed while it still
    writes: the loop is asked to remove a writer only where one was added (issue 45:
    asking it to remove one it does not have cost a task's turn two KeyErrors)."""
    loop = asyncio.get_running_loop()
    big = b"x" * (1 << 20)  # (1 MiB: far beyond the socket's buffer, made small below)
    for closed_first in (False, True):
        connection = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
        fd = connection.pgconn.socket
        # (a small send buffer: the server, reading as it comes, never empties it in time)
        with socket.socket(fileno=os.dup(fd)) as same:
            same.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        try:
            reply = _wire.ask(connection, b"SELECT length($1)", [big], False, loop)
            assert reply.writing
            if closed_first:
                _wire.discard(connection, reply)
            else:
                assert await _wire.answer(reply) == [(b"%d" % len(big),)]
            assert not reply.writing
            assert not loop.remove_writer(fd)
            assert not loop.remove_reader(fd)
        finally:
            await connection.close()
