"""Latest work shared across processes, in one process: queues on one place as processes.

Several KeyedQueues, each with a backend of its own on one place (a file
backend's directory, a Redis namespace, or a PostgreSQL one), share a key's line as processes
do: the backend cannot tell them apart (each queue keeps its own lines and
its own latest work).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import redis

from inturn import KeyedQueue
from inturn.backends import Backend
from inturn.backends.file import FileBackend
from inturn.backends.file._linefile import parse
from inturn.backends.postgres import PostgresBackend
from inturn.backends.postgres._keys import lock_id, lock_parts
from inturn.backends.redis import RedisBackend
from inturn.backends.redis._scripts import Line

from .file_checks import line_file
from .helpers import PATIENCE
from .processes import Worker, until


class Shared:
    """Where the queues of a test share their lines: a directory, a Redis namespace, or a
    PostgreSQL one.

    Its looks at key k's line are synchronous (a test's settle and a thread's
    wait_until take them): the file's records, Redis's keys read with a
    blocking client, or PostgreSQL's locks and table read on a connection of
    its own.
    """

    def __init__(self, directory: Path, url: str | None = None, namespace: str = "") -> None:
        self.directory = directory
        self.url = url
        self.namespace = namespace
        self.kind = "file" if url is None else url.partition(":")[0].removesuffix("ql")
        self._redis = redis.Redis.from_url(url) if self.kind == "redis" else None
        self._pg = Postgres(url, namespace) if url is not None and self.kind == "postgres" else None
        self.made: list[PostgresBackend] = []

    def backend(self) -> Backend:
        """A backend of its own on this place (a process's); PostgreSQL's are closed by
        :meth:`aclose` (their connections are its event loop's)."""
        if self.url is None:
            return FileBackend(self.directory)
        if self._pg is not None:
            made = PostgresBackend(self.url, namespace=self.namespace)
            self.made.append(made)
            return made
        return RedisBackend.from_url(self.url, namespace=self.namespace, lease=LEASE)

    async def aclose(self) -> None:
        """Close the PostgreSQL backends made here (on the loop they served), then close."""
        for made in self.made:
            await made.aclose()
        self.close()

    def posts(self) -> int:
        """How many posts of latest work key k's line holds now."""
        if self._pg is not None:
            return self._pg.posts()
        if self._redis is None:
            return len(parse(records(self.directory)).posts)
        info = Line(self.namespace, "k").names[3]
        return sum(b" @" in value for value in self._redis.hvals(info))

    def members(self) -> int:
        """How many turns key k's line has now (its holder, and its waiters)."""
        if self._pg is not None:
            return len(self._pg.pids())
        if self._redis is None:
            return len(FileBackend(self.directory).line("k"))
        line, q = Line(self.namespace, "k").names[:2]
        return self._redis.hexists(line, "holder") + self._redis.zcard(q)

    def pids(self) -> list[int]:
        """The processes of key k's line, in turn order (its holder first)."""
        if self._pg is not None:
            return self._pg.pids()
        if self._redis is None:
            return list(FileBackend(self.directory).line("k"))
        line, q, _, info = Line(self.namespace, "k").names[:4]
        members = [self._redis.hget(line, "holder"), *self._redis.zrange(q, 0, -1)]
        about = [self._redis.hget(info, member) for member in members if member is not None]
        return [int(found.split(b" @")[0].rsplit(b" ", 2)[1]) for found in about if found]

    def empty(self) -> bool:
        """Whether key k's line is gone (nobody holds it or waits: nothing is left)."""
        if self._pg is not None:
            return self._pg.empty()
        if self._redis is None:
            return not line_file(self.directory, "k").exists()
        return not self._redis.exists(*Line(self.namespace, "k").names)

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
        if self._pg is not None:
            self._pg.close()


class Postgres:
    """Key k's line in a PostgreSQL namespace, looked at on a connection of its own."""

    def __init__(self, url: str, namespace: str) -> None:
        self.connection = psycopg.connect(url, autocommit=True)
        self.namespace = namespace
        self.lock = lock_id(namespace, "k")
        self.parts = lock_parts(self.lock)

    def _rows(self, sql: str, *params: object) -> list[tuple[Any, ...]]:
        """sql's rows; none before a backend made its tables (a server's first turn)."""
        try:
            return self.connection.execute(sql.encode(), params).fetchall()
        except psycopg.errors.UndefinedTable:
            return []

    def pids(self) -> list[int]:
        """The client processes of key k's line, holder first, then the waiters in order."""
        rows = self._rows(
            "SELECT s.client_pid, l.granted, cardinality(pg_blocking_pids(l.pid))"
            " FROM pg_locks l LEFT JOIN inturn_sessions s ON s.pid = l.pid"
            " WHERE l.locktype = 'advisory' AND l.objsubid = 1"
            " AND l.classid = %s::oid AND l.objid = %s::oid",
            *self.parts,
        )
        rows.sort(key=lambda row: (not row[1], row[2]))
        return [int(row[0] or 0) for row in rows]

    def posts(self) -> int:
        """The posts of sessions still there."""
        rows = self._rows(
            "SELECT count(*) FROM inturn_latest WHERE namespace = %s AND lock_id = %s"
            " AND pid <> 0 AND pid IN (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL)",
            self.namespace,
            self.lock,
        )
        return int(rows[0][0]) if rows else 0

    def empty(self) -> bool:
        """No lock of key k (nor its intent lock) is held or waited for, and no post is left."""
        (locks,) = self._rows(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            " AND classid = %s::oid AND objid = %s::oid",
            *self.parts,
        )[0]
        return locks == 0 and self.posts() == 0

    def close(self) -> None:
        self.connection.close()


#: Redis's lease in these tests (s): long enough for a loaded machine's heartbeats.
LEASE = 2.0


def _shared(place: Path | Shared) -> Shared:
    return place if isinstance(place, Shared) else Shared(place)


class Holder:
    """A queue (a process of its own) whose plain turn holds key k until released: on a
    place, or a backend of its own."""

    def __init__(self, place: Path | Shared | Backend) -> None:
        backend = place if isinstance(place, Backend) else _shared(place).backend()
        self.queue = KeyedQueue(backend=backend)
        self.held = asyncio.Event()
        self.gate = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def hold(self) -> None:
        async def holding() -> None:
            self.held.set()
            await self.gate.wait()

        self.task = asyncio.create_task(self.queue.run("k", holding))
        await asyncio.wait_for(self.held.wait(), PATIENCE)

    async def release(self) -> None:
        self.gate.set()
        assert self.task is not None
        await asyncio.wait_for(self.task, PATIENCE)


def latest(place: Path | Shared, **settings: Any) -> KeyedQueue:
    """A queue whose latest work is the key's among the queues on place."""
    return KeyedQueue(
        backend=_shared(place).backend(), pending="latest", across="processes", **settings
    )


def records(directory: Path) -> list[str]:
    """Key k's line file's records now ([] if there is none)."""
    try:
        return line_file(directory, "k").read_bytes().decode("latin-1").splitlines()
    except FileNotFoundError:
        return []


def posts(place: Path | Shared) -> int:
    """How many posts of latest work key k's line holds now."""
    return _shared(place).posts()


async def key_free(place: Path | Shared) -> bool:
    """Whether key k is free: a plain turn takes it, alone in its line."""
    shared = _shared(place)
    queue = KeyedQueue(backend=shared.backend())
    try:
        async with queue.keyed("k", timeout=PATIENCE):
            return shared.members() == 1
    finally:
        await queue.aclose()


class Runs(list[str]):
    """Records the works that ran: work(name) is an async work that records itself, sync(name)
    a plain one."""

    def work(self, name: str) -> Callable[[], Any]:
        async def run() -> str:
            self.append(name)
            return name

        return run

    def sync(self, name: str) -> Callable[[], Any]:
        def run() -> str:
            self.append(name)
            return name

        return run


async def latest_killed_at(
    server: Worker, step: int, shared: Shared, victim: str
) -> tuple[list[str], list[str], str | None]:
    """While this process holds k and a latest work of its own waits, a victim's (a child
    of server, tests/support/worker.py's crash-each), killed before its step-th step (the
    newest work, or an older one, which queued first): the victim's reports, how it
    ended, and what this process's caller got."""
    holder = KeyedQueue(backend=shared.backend())
    latest = KeyedQueue(backend=shared.backend(), pending="latest", across="processes")
    me = os.getpid()
    gate = asyncio.Event()
    holding = asyncio.create_task(holder.run("k", gate.wait))
    await until(lambda: shared.pids() == [me], "the holder took the key")
    reports: list[str] = []

    async def ending() -> list[str]:
        while True:
            words = await server.report()
            if words[0] == "ended":
                return words[1:]
            reports.append(words[0])

    async def victim_queues() -> asyncio.Future[list[str]]:
        await server.send(str(step))
        (pid,) = await server.expect("forked")
        outcome = asyncio.ensure_future(ending())
        await until(lambda: int(pid) in shared.pids() or outcome.done(), "it queued")
        return outcome

    if victim == "older":
        outcome = await victim_queues()
    mine = asyncio.create_task(latest.run("k", lambda: "mine ran"))
    await until(lambda: shared.pids().count(me) == 2, "this process's work waits")
    if victim == "newest":
        outcome = await victim_queues()
    gate.set()
    await holding
    ended_as = await outcome
    try:
        answer = await asyncio.wait_for(mine, PATIENCE)
    finally:
        await holder.aclose()
        await latest.aclose()
    return reports, ended_as, answer


def no_update_lost(
    victim: str, step: int, reports: list[str], outcome: list[str], mine: str | None
) -> None:
    """Check what latest_killed_at saw: the newest work a live process waited for ran (the
    victim's, if it ran), and this process's caller was answered as documented."""
    assert outcome in (["killed"], ["exit", "0"]), outcome
    if victim == "older":  # this process's newer work runs whatever befalls the victim
        assert mine == "mine ran", f"step {step}: {reports}, {outcome}"
        assert "holding" not in reports
        assert reports in ([], ["superseded"]), reports
    elif "holding" not in reports:  # the newest work never started: the older one runs
        assert mine == "mine ran", f"step {step}: {reports}, {outcome}"
    elif outcome == ["exit", "0"]:  # it ran, and said so: the older is answered
        assert mine is None, f"step {step}"
    # (killed after it started: the older runs, or is answered if the run was recorded)
    assert mine in ("mine ran", None)


async def crashes_at_every_step(
    spec: str, url: str, namespace: str, workers: list[Worker], victim: str
) -> int:
    """A victim's latest work (a fork server on backend spec, killed at its step-th step,
    see latest_killed_at) at each step in turn until one runs to its end: each time the
    newest work a live process waits for runs (no_update_lost), and nothing is left in
    the line (on url's namespace) once the victim is gone. How many steps there were."""
    server = await Worker.start(spec, "crash-each", "k", "latest")
    workers.append(server)
    shared = Shared(Path(), url, namespace)
    step = 0
    try:
        while True:
            step += 1
            reports, outcome, mine = await latest_killed_at(server, step, shared, victim)
            no_update_lost(victim, step, reports, outcome, mine)
            await until(shared.empty, f"nothing left after a crash at step {step}")
            if outcome == ["exit", "0"]:
                return step
    finally:
        shared.close()


async def answered(*calls: Any) -> list[Any]:
    """Each call's outcome (its result or error), within PATIENCE."""
    return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), PATIENCE)


def in_thread(name: str, call: Callable[[], Any], outcomes: dict[str, Any]) -> threading.Thread:
    """Run call in a thread of its own; its outcome (result or error) goes to outcomes[name]."""

    def body() -> None:
        try:
            outcomes[name] = call()
        except BaseException as error:
            outcomes[name] = error

    started = threading.Thread(target=body, name=name)
    started.start()
    return started
