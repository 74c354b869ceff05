"""The PostgreSQL backend through faults and deployments, in real processes against a real server.

Every test here drives real worker processes (tests/support/pg_worker.py) or real
threads, forks and event loops through the public API, and brings faults
about on purpose: SIGKILL of a holder or a waiter, SIGSTOP of a holder,
``pg_terminate_backend``, a restart of the server, a pool too small for
the keys. Orderings come from checkpoints on the server's own state (a
session in ``pg_locks`` waits, a session is gone from
``pg_stat_activity``), read from an admin session of the test's own, never
from sleeps.

Each process's sessions carry an ``application_name`` of their own (in the
URL), which is how the test tells them apart on the server; the backend's
lock ids are never computed here. Bounds on how long a fault may take to
show are generous, for a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

from inturn import BackendUnavailable, KeyedQueue, LeaseLost  # noqa: E402
from inturn.backends.postgres import PostgresBackend  # noqa: E402

from support.helpers import PATIENCE  # noqa: E402
from support.latest_across import crashes_at_every_step  # noqa: E402
from support.pg_server import PostgresServer, new_server  # noqa: E402
from support.pg_worker import increment_sync  # noqa: E402
from support.processes import Worker, stopped  # noqa: E402

pytestmark = pytest.mark.server

WORKER = Path(__file__).parent / "support" / "pg_worker.py"

#: How long a fault may take to show beyond what causes it (a session's end
#: seen by the server, a waiter woken): far below PATIENCE, so that "promptly"
#: means something, and far above what it takes on a loaded machine.
PROMPTLY = 5.0

#: What the backend gives a waiting session as ``client_connection_check_interval``:
#: a waiter whose process died leaves the server's queue within it.
CHECK_INTERVAL = 1.0


def named(url: str, name: str) -> str:
    """url, with the sessions it opens named ``name`` in pg_stat_activity."""
    return f"{url}{'&' if '?' in url else '?'}application_name={name}"


async def within(seconds: float, awaitable: Awaitable[Any]) -> Any:
    """Await awaitable; fail the test if it takes longer than seconds."""
    return await asyncio.wait_for(awaitable, seconds)


class Site:
    """One server as this test sees it: its workers and backends, and an admin session.

    Everything this test starts is named ``TAG-...`` on the server, and its
    lines are in namespace TAG.
    """

    def __init__(self, url: str, admin: Any, workers: list[Worker]) -> None:
        self.url = url
        self.admin = admin
        self.workers = workers
        self.tag = f"pgf{uuid.uuid4().hex[:10]}"
        self.namespace = self.tag
        self.backends: list[PostgresBackend] = []

    def url_of(self, name: str) -> str:
        return named(self.url, f"{self.tag}-{name}")

    def backend(self, name: str, **options: Any) -> PostgresBackend:
        """A backend of this process whose sessions are named ``TAG-name``."""
        made = PostgresBackend.from_url(self.url_of(name), namespace=self.namespace, **options)
        self.backends.append(made)
        return made

    async def start(self, name: str, command: str, *args: str) -> Worker:
        """A worker process whose sessions are named ``TAG-name``."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(WORKER),
            self.url_of(name),
            self.namespace,
            command,
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        worker = Worker(process, name)
        self.workers.append(worker)
        return worker

    async def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        cursor = await self.admin.execute(sql, params)
        return list(await cursor.fetchall())

    async def waiting(self) -> list[str]:
        """The names of this test's sessions that wait for an advisory lock."""
        rows = await self.rows(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND NOT l.granted AND a.application_name LIKE %s",
            f"{self.tag}-%",
        )
        return sorted(row[0].removeprefix(f"{self.tag}-") for row in rows)

    async def locks(self) -> list[tuple[str, bool]]:
        """This test's sessions' advisory locks: (name, granted) each."""
        rows = await self.rows(
            "SELECT a.application_name, l.granted FROM pg_locks l"
            " JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND a.application_name LIKE %s ORDER BY 1",
            f"{self.tag}-%",
        )
        return [(row[0].removeprefix(f"{self.tag}-"), row[1]) for row in rows]

    async def sessions(self, name: str) -> list[int]:
        """The server pids of the sessions named ``TAG-name``."""
        rows = await self.rows(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s ORDER BY 1",
            f"{self.tag}-{name}",
        )
        return [row[0] for row in rows]

    async def holder_session(self, name: str) -> int:
        """The server pid of the session named ``TAG-name`` that holds an advisory lock."""
        rows = await self.rows(
            "SELECT l.pid FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted AND a.application_name = %s",
            f"{self.tag}-{name}",
        )
        assert len(rows) == 1, f"{name} holds {len(rows)} advisory locks"
        return int(rows[0][0])

    async def until(
        self, check: Callable[[], Awaitable[bool]], what: str, limit: float = PATIENCE
    ) -> float:
        """Wait until check() holds on the server (limit seconds at most); return how long."""
        loop = asyncio.get_running_loop()
        began = loop.time()
        while not await check():
            if loop.time() - began > limit:
                raise AssertionError(f"the server did not reach within {limit:g} s: {what}")
            await asyncio.sleep(0.002)
        return loop.time() - began

    async def until_waiting(self, *names: str, limit: float = PATIENCE) -> float:
        """Wait until exactly the sessions of names wait for advisory locks."""

        async def check() -> bool:
            return await self.waiting() == sorted(names)

        return await self.until(check, f"waiting: {sorted(names)}", limit)

    async def counter(self, table: str) -> int:
        (row,) = await self.rows(f"SELECT value FROM {table}")
        return int(row[0])

    async def aclose(self) -> None:
        for backend in self.backends:
            await within(PATIENCE, backend.aclose())


@pytest.fixture
async def site(postgres_url: str, workers: list[Worker]) -> AsyncIterator[Site]:
    """The session's server, as this test sees it."""
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
        made = Site(postgres_url, admin, workers)
        yield made
        await made.aclose()


@pytest.fixture
async def own_site(workers: list[Worker]) -> AsyncIterator[Callable[..., Awaitable[Site]]]:
    """Sites on servers of this test's own (``await own_site(settings)``), removed at its end.

    ``site.server`` is the PostgresServer, to stop and start again.
    """
    made: list[tuple[PostgresServer, Site]] = []

    async def make(settings: dict[str, str] | None = None) -> Site:
        server = await asyncio.to_thread(new_server, settings)
        admin = await psycopg.AsyncConnection.connect(server.url, autocommit=True)
        one = Site(server.url, admin, workers)
        one.server = server  # type: ignore[attr-defined]
        made.append((server, one))
        return one

    yield make
    for server, one in made:
        for worker in workers:
            await worker.close()
        await one.aclose()
        await one.admin.close()
        await asyncio.to_thread(server.remove)


@pytest.fixture
async def table(site: Site) -> AsyncIterator[str]:
    """A table of one integer row, 0, for read-modify-write increments."""
    name = f"{site.tag}_counter"
    await site.admin.execute(f"CREATE TABLE {name} (value int NOT NULL)")
    await site.admin.execute(f"INSERT INTO {name} VALUES (0)")
    yield name
    await site.admin.execute(f"DROP TABLE {name}")


async def tokens_of(*workers: Worker) -> list[int]:
    """The token each of workers (``take``) reports, once each has released its key."""
    tokens = []
    for worker in workers:
        (token,) = await worker.expect("holding")
        await worker.expect("released")
        tokens.append(int(token))
    return tokens


# -- exclusion and order across processes --------------------------------------------------


async def test_no_update_is_lost_between_processes(site: Site, table: str) -> None:
    # Four processes read the row, then write what they read plus one, in
    # two statements: without the key between them, two would write the same value.
    n = 50
    workers = [await site.start(f"w{i}", "increment", "k", table, str(n)) for i in range(4)]
    for worker in workers:
        await worker.expect("done")
    assert await site.counter(table) == 4 * n
    assert await site.locks() == []


async def test_processes_take_the_key_in_the_order_they_joined_its_line(site: Site) -> None:
    holder = await site.start("holder", "hold", "k")
    (first,) = await holder.expect("holding")
    waiters = []
    for i in range(4):
        # each joins once the one before it is visibly in the server's queue
        waiters.append(await site.start(f"w{i}", "take", "k"))
        await site.until_waiting(*(f"w{j}" for j in range(i + 1)))
    await holder.release()
    tokens = await tokens_of(*waiters)
    # (a token is drawn right after the grant, and grants of one key follow one another)
    assert [int(first), *tokens] == sorted([int(first), *tokens]), tokens
    assert await site.locks() == []


# -- a killed process ----------------------------------------------------------------------


async def test_a_killed_holder_hands_the_key_to_the_next_process_at_once(site: Site) -> None:
    holder = await site.start("holder", "hold", "k")
    (token,) = await holder.expect("holding")
    waiter = await site.start("waiter", "take", "k")
    await site.until_waiting("waiter")
    holder.kill()
    began = time.monotonic()
    (next_token,) = await waiter.expect("holding")
    # The server sees the holder's connection close: no lease to run out, no timeout.
    assert time.monotonic() - began < PROMPTLY
    assert int(next_token) > int(token)
    await waiter.expect("released")
    assert await site.locks() == []


async def test_a_killed_waiter_leaves_the_line_and_the_others_keep_their_order(
    site: Site,
) -> None:
    holder = await site.start("holder", "hold", "k")
    await holder.expect("holding")
    waiters = {}
    for name in ("w1", "w2", "w3"):
        waiters[name] = await site.start(name, "take", "k")
        await site.until_waiting(*waiters)
    waiters["w2"].kill()
    # The waiting session checks its client every CHECK_INTERVAL: gone within it.
    await site.until_waiting("w1", "w3", limit=CHECK_INTERVAL + PROMPTLY)
    assert await site.sessions("w2") == []
    await holder.release()
    first, third = await tokens_of(waiters["w1"], waiters["w3"])
    assert first < third
    assert await site.locks() == []


# -- a session ended by the server -----------------------------------------------------


async def test_a_holder_whose_session_is_terminated_raises_lease_lost_after_its_work(
    site: Site,
) -> None:
    holder = await site.start("holder", "hold", "k")
    (token,) = await holder.expect("holding")
    waiter = await site.start("waiter", "take", "k")
    await site.until_waiting("waiter")
    pid = await site.holder_session("holder")
    await site.rows("SELECT pg_terminate_backend(%s)", pid)
    # the next process has the key while the holder is still in its block
    (next_token,) = await waiter.expect("holding")
    assert int(next_token) > int(token)
    await waiter.expect("released")
    await holder.go()  # the work ends; the release finds the session gone
    assert await holder.expect("raised") == ["LeaseLost", "True"]
    assert await site.locks() == []


@pytest.mark.parametrize("mode", ["fast", "immediate"])
async def test_a_restart_ends_the_turns_across_it_and_the_backend_works_after_it(
    own_site: Callable[..., Awaitable[Site]], mode: str
) -> None:
    site = await own_site()
    server: PostgresServer = site.server  # type: ignore[attr-defined]
    one, two = KeyedQueue(backend=site.backend("one")), KeyedQueue(backend=site.backend("two"))
    holding, gate = asyncio.Event(), asyncio.Event()

    async def hold() -> str:
        holding.set()
        await gate.wait()
        return "ran"

    holder = asyncio.create_task(one.run("k", hold))
    await within(PATIENCE, holding.wait())
    # one's pool also keeps an idle session, from another key's turn meanwhile:
    # it goes stale in the restart, as every pooled session does
    assert await one.run("other", lambda: "warm") == "warm"
    ran: list[str] = []
    waiter = asyncio.create_task(two.run("k", ran.append, "waiter"))
    await site.until_waiting("two")
    await site.admin.close()
    await asyncio.to_thread(server.stop, mode)
    # The waiter's session ended: it is told at once that its work did not run.
    with pytest.raises(BackendUnavailable, match="did not run"):
        await within(PROMPTLY, waiter)
    assert ran == []
    await asyncio.to_thread(server.start)
    site.admin = await psycopg.AsyncConnection.connect(server.url, autocommit=True)
    gate.set()
    # The holder's work ran to its end; its session did not outlive the restart.
    with pytest.raises(LeaseLost):
        await within(PROMPTLY, holder)
    # After the restart, fresh turns on the same backends work at the first try:
    # no stale pooled session may fail them.
    for queue in (one, two):
        for key in ("k", "other", "new"):
            assert await within(PATIENCE, queue.run(key, lambda: "again")) == "again"


async def test_a_frozen_holder_is_ended_by_idle_session_timeout(
    own_site: Callable[..., Awaitable[Site]],
) -> None:
    # idle_session_timeout (PostgreSQL 14+) ends a session that is idle outside a
    # transaction for that long, whatever session-level advisory locks it holds:
    # a holder's session is idle while its work runs, so a frozen holder loses the
    # key after it. (Any holder whose work takes longer does too: the setting is a
    # bound on a turn's length.) TCP keepalives are not needed on loopback: the
    # frozen process's kernel still answers them; they are for a vanished host.
    site = await own_site({"idle_session_timeout": "1s"})
    server: PostgresServer = site.server  # type: ignore[attr-defined]
    holder = await site.start("holder", "hold", "k")
    (token,) = await holder.expect("holding")
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        await site.until(_async(lambda: stopped(holder.pid)), "the holder stopped")
        queue = KeyedQueue(backend=site.backend("waiter"))
        async with queue.keyed("k", timeout=1.0 + PROMPTLY) as turn:
            assert turn.token > int(token)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    assert "idle-session timeout" in server.log.read_text()
    await holder.go()
    assert await holder.expect("raised") == ["LeaseLost", "True"]


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def checked() -> bool:
        return check()

    return checked


# -- sync callers, forks and event loops -------------------------------------------------


async def test_threads_and_another_process_share_a_key(site: Site, table: str) -> None:
    # Threads of this process (run_sync, and with keyed()) and a worker process
    # increment one row under one key; the key is held first, so that all wait.
    queue = KeyedQueue(backend=site.backend("threads"))
    gatekeeper = KeyedQueue(backend=site.backend("gatekeeper"))
    n = 20
    failures: list[BaseException] = []

    def increments(i: int) -> None:
        try:
            with psycopg.connect(site.url, autocommit=True) as connection:
                for _ in range(n):
                    if i % 2:
                        queue.run_sync("k", increment_sync, connection, table)
                    else:
                        with queue.keyed("k"):
                            increment_sync(connection, table)
        except BaseException as error:
            failures.append(error)
            raise

    async with gatekeeper.keyed("k"):
        worker = await site.start("worker", "increment", "k", table, str(n))
        threads = [threading.Thread(target=increments, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        # the process and this process's line both wait on the server
        await site.until_waiting("threads", "worker")
    await worker.expect("done")
    for thread in threads:
        await asyncio.to_thread(thread.join, PATIENCE)
    assert failures == []
    assert await site.counter(table) == 5 * n


async def test_a_child_forked_after_the_backend_was_used_takes_turns(
    site: Site, table: str
) -> None:
    n = 20
    worker = await site.start("forking", "fork-increment", "k", table, str(n))
    assert await worker.expect("done") == ["0"]
    assert await site.counter(table) == 2 * n


def test_an_event_loop_per_job_reuses_sessions(postgres_url: str) -> None:
    # asyncio.run() per job, as a sync app calling async code does: every job
    # works, and once the process is known to run a loop per job (the queue
    # serves its first loops directly, then every later one through one loop
    # of its own), no job opens a session on the server.
    name = f"pgf{uuid.uuid4().hex[:10]}"
    backend = PostgresBackend.from_url(named(postgres_url, name), namespace=name)
    queue = KeyedQueue(backend=backend)
    with psycopg.connect(postgres_url, autocommit=True) as admin:

        def sessions() -> set[int]:
            rows = admin.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (name,)
            ).fetchall()
            return {pid for (pid,) in rows}

        for i in range(4):  # the direct loops, and the first through the backend's loop
            assert asyncio.run(queue.run("k", lambda i=i: i)) == i
        before = sessions()
        seen = set(before)
        jobs = 12
        try:
            for i in range(jobs):
                assert asyncio.run(queue.run("k", lambda i=i: i)) == i
                seen |= sessions()
        finally:
            asyncio.run(backend.aclose())
    assert seen == before, f"{len(seen - before)} new sessions in {jobs} jobs"


# -- a pool smaller than the keys --------------------------------------------------------


async def test_keys_beyond_max_sessions_wait_for_a_session(site: Site) -> None:
    queue = KeyedQueue(backend=site.backend("pool", max_sessions=2))
    started: list[str] = []
    gate = asyncio.Event()
    most = 0
    watching = True

    async def watch() -> None:
        nonlocal most
        while watching:
            most = max(most, len(await site.sessions("pool")))
            await asyncio.sleep(0.002)

    async def work(key: str) -> str:
        started.append(key)
        await gate.wait()
        return key

    watcher = asyncio.create_task(watch())
    keys = [f"k{i}" for i in range(5)]
    turns = asyncio.gather(*(queue.run(key, work, key) for key in keys))
    await site.until(_async(lambda: len(started) == 2), "two turns began")
    # both sessions are held by the two turns; the other three wait in this process
    assert len(await site.sessions("pool")) == 2
    assert len(started) == 2
    gate.set()
    assert sorted(await within(PATIENCE, turns)) == keys
    watching = False
    await watcher
    assert most <= 2, f"{most} sessions of a backend with max_sessions=2"


async def test_multi_key_turns_beyond_max_sessions_do_not_deadlock(site: Site) -> None:
    # Two sessions, three turns of two keys each that overlap: a turn must not
    # hold a session for one key while it waits for a session for its next.
    queue = KeyedQueue(backend=site.backend("pool", max_sessions=2))
    entered: list[tuple[str, ...]] = []
    gate = asyncio.Event()

    async def block(keys: tuple[str, ...]) -> None:
        async with queue.keyed(*keys):
            entered.append(keys)
            await gate.wait()

    sets = [("a", "b"), ("c", "d"), ("b", "c")]
    turns = asyncio.gather(*(block(keys) for keys in sets))
    try:
        deadline = asyncio.get_running_loop().time() + PATIENCE / 3
        while not entered:
            assert asyncio.get_running_loop().time() < deadline, (
                f"no turn of {sets} began with max_sessions=2: deadlocked"
            )
            await asyncio.sleep(0.002)
        gate.set()
        await within(PATIENCE / 3, turns)
    finally:
        gate.set()
        turns.cancel()
        await asyncio.gather(turns, return_exceptions=True)
    assert sorted(entered) == sorted(sets)


# -- latest work shared across processes, killed at every step ----------------------------


@pytest.mark.parametrize("victim", ["newest", "older"])
async def test_a_crash_at_any_step_of_latest_work_across_processes_loses_no_update(
    postgres_url: str, namespace: str, workers: list[Worker], victim: str
) -> None:
    """Latest work (across="processes") killed before and after each statement of its turn
    (the worker's OpTripwire on the session's steps), beside a work of this process's that
    waits too: the newest work a live process waits for runs (the killed one's, if it ran),
    and once the server saw the victim's session end, the key is free and no post is left.

    A newest victim posts, waits, judges and runs (this process's older work joins the
    line again behind it); an older victim joins again behind this process's newer work,
    then learns that it ran.
    """
    spec = f"postgres:{postgres_url}#{namespace}"
    assert await crashes_at_every_step(spec, postgres_url, namespace, workers, victim) > 8
