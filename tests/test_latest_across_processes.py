"""Latest wins across real processes (``across="processes"``), and their deaths, on each
shared backend that keeps it (file, Redis, PostgreSQL).

This test's process holds the key while worker processes
(tests/support/latest_worker.py) each queue a burst, one after the other,
so that the newest work is the last burst's last call. Once the holder
lets go, that work alone runs; every other caller is answered. Then the
same with the newest work's process killed (SIGKILL) at a random moment:
the newest work that a live process still waits for runs, nothing hangs,
and the key is left free.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from inturn import KeyedQueue
from inturn.backends.file import FileBackend
from inturn.backends.postgres import PostgresBackend
from inturn.backends.redis import RedisBackend

from support.helpers import PATIENCE
from support.processes import Worker

pytestmark = pytest.mark.server  # (real processes, and their deaths: the newest Python)

LATEST_WORKER = Path(__file__).parent / "support" / "latest_worker.py"
#: Each process's burst.
BURST = 50
#: Redis's lease here (s): a killed process's place is freed within about this long.
LEASE = 0.5


class Holder:
    """This process: holds key (k), on the workers' backend (``spec``), until released."""

    def __init__(self, spec: str, key: str = "k") -> None:
        self.spec = spec
        self.key = key
        kind, _, where = spec.partition(":")
        if kind == "file":
            self.queue = KeyedQueue(backend=FileBackend(where))
        elif kind == "postgres":
            url, namespace = where.split("#")
            self.queue = KeyedQueue(backend=PostgresBackend.from_url(url, namespace=namespace))
        else:
            url, namespace, lease = where.split("#")
            backend = RedisBackend.from_url(url, namespace=namespace, lease=float(lease))
            self.queue = KeyedQueue(backend=backend)
        self.gate = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def hold(self) -> None:
        held = asyncio.Event()
        self.gate = asyncio.Event()

        async def holding() -> None:
            held.set()
            await self.gate.wait()

        self.task = asyncio.create_task(self.queue.run(self.key, holding))
        await held.wait()

    async def release(self) -> None:
        self.gate.set()
        assert self.task is not None
        await self.task

    async def free(self) -> bool:
        """Whether the key is free: a turn takes it (within a lease, on Redis: a killed
        process's place lasts that long), and nobody else holds it or waits."""
        backend = self.queue.backend
        try:
            async with self.queue.keyed(self.key, timeout=PATIENCE):
                if isinstance(backend, FileBackend):
                    return not FileBackend(backend.directory).line(self.key)[1:]
                assert isinstance(backend, RedisBackend | PostgresBackend)
                (line,) = [line for line in await backend.lines() if line.key == self.key]
                return line.holder is not None and not line.waiters
        except TimeoutError:
            return False


async def start(spec: str, log: Path, mode: str, name: str, key: str = "k") -> Worker:
    return await Worker.start(spec, str(log), mode, key, name=name, script=LATEST_WORKER)


def runs(log: Path, tag: str) -> list[tuple[str, str, str]]:
    """The works of burst tag that started (run) and ended (done), in order: (what, pid, i)."""
    if not log.exists():
        return []
    lines = [line.split() for line in log.read_text().splitlines()]
    return [(what, pid, i) for what, pid, t, i in lines if t == tag]


async def queued(forker: Worker) -> str:
    """The pid of forker's new child, once its burst is queued (a child killed too late
    said it was answered, before)."""
    while True:
        words = await forker.report()
        if words[0] == "queued":
            return words[1]
        assert words[0] == "answered", f"the forker said {words}"


@pytest.fixture(params=["file", "redis", "postgres"])
async def holder(
    request: pytest.FixtureRequest, tmp_path: Path, namespace: str
) -> AsyncIterator[Holder]:
    """The holder, on a backend of each kind (its spec: the workers')."""
    if request.param == "file":
        spec = f"file:{tmp_path / 'lines'}"
    elif request.param == "postgres":
        spec = f"postgres:{request.getfixturevalue('postgres_url')}#{namespace}"
    else:
        spec = f"redis:{request.getfixturevalue('redis_url')}#{namespace}#{LEASE}"
    holding = Holder(spec)
    yield holding
    holding.gate.set()  # (a test that failed while it held)
    await holding.queue.aclose()


async def test_bursts_of_four_processes_run_the_newest_once(
    tmp_path: Path, holder: Holder, workers: list[Worker]
) -> None:
    log = tmp_path / "log"
    modes = ["join", "raise", "join", "join"]
    workers += [await start(holder.spec, log, mode, f"w{n}") for n, mode in enumerate(modes)]
    for round_ in range(20):
        await holder.hold()
        for n, worker in enumerate(workers):  # one after the other: the last burst is newest
            await worker.send(f"burst {BURST} r{round_}w{n}")
            await worker.expect("queued")
        await holder.release()
        answers = [(await worker.expect("answered"))[1:] for worker in workers]
        newest = str(BURST - 1)
        last = workers[-1].pid
        assert runs(log, f"r{round_}w3") == [
            ("run", str(last), newest),
            ("done", str(last), newest),
        ]
        for n in range(3):
            assert runs(log, f"r{round_}w{n}") == [], f"round {round_}: w{n} ran" + log.read_text()
        assert answers[0] == answers[2] == ["none"] * BURST  # "join": the newer work returned
        assert answers[1] == ["superseded"] * BURST  # "raise"
        assert answers[3] == [newest] * BURST  # its own process: the newest's outcome
        assert await holder.free()
    for worker in workers:
        await worker.send("quit")
        assert await worker.finish() == 0


async def test_the_newest_surviving_work_runs_when_its_process_is_killed(
    tmp_path: Path, holder: Holder, workers: list[Worker]
) -> None:
    """100 rounds: two live processes' bursts, then a third's, newest, in a child that is
    killed at a random moment after the holder lets go (waiting, judging, queueing again,
    running its work, recording it, or after). Four keys at once, 25 rounds each: on
    Redis, a killed process's place lasts its lease (LEASE)."""
    holders = [holder] + [Holder(holder.spec, f"k{group}") for group in range(1, GROUPS)]
    children: list[int] = []
    try:
        await asyncio.gather(
            *(
                _kill_rounds(tmp_path / f"log{group}", holding, workers, group, children)
                for group, holding in enumerate(holders)
            )
        )
    finally:
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for holding in holders[1:]:
            holding.gate.set()
            await holding.queue.aclose()


#: Keys whose kill rounds run at once, and each one's rounds.
GROUPS = 4
ROUNDS = 25


async def _kill_rounds(
    log: Path, holder: Holder, workers: list[Worker], group: int, children: list[int]
) -> None:
    """ROUNDS of the kill test on holder's key (see there)."""
    key = holder.key
    older, middle, forker = [
        await start(holder.spec, log, "join", f"{name}{group}", key)
        for name in ("older", "middle", "forker")
    ]
    workers += [older, middle, forker]
    rng = random.Random(46 + group)
    for round_ in range(ROUNDS):
        at = f"group {group} round {round_}"
        await holder.hold()
        await older.send(f"burst 3 r{round_}older")
        await older.expect("queued")
        await middle.send(f"burst 3 r{round_}middle")
        await middle.expect("queued")
        await forker.send(f"fork 3 r{round_}victim")
        victim = await queued(forker)
        children.append(int(victim))
        await holder.release()
        await asyncio.sleep(rng.uniform(0, 0.015))  # (a random moment, not an order)
        os.kill(int(victim), signal.SIGKILL)
        older_answers = (await older.expect("answered"))[1:]
        middle_answers = (await middle.expect("answered"))[1:]
        victim_runs = runs(log, f"r{round_}victim")
        victim_ran = ("done", victim, "2") in victim_runs
        middle_runs = runs(log, f"r{round_}middle")
        assert runs(log, f"r{round_}older") == [], f"{at}: older work ran"
        if not victim_ran:  # the newest surviving work ran, whole, once
            assert middle_runs == [
                ("run", str(middle.pid), "2"),
                ("done", str(middle.pid), "2"),
            ], at
        else:  # (it may run still, if the victim died before it recorded its run)
            assert middle_runs in (
                [],
                [("run", str(middle.pid), "2"), ("done", str(middle.pid), "2")],
            ), at
        assert older_answers == ["none"] * 3, at
        assert middle_answers == (["2"] * 3 if middle_runs else ["none"] * 3), at
        assert await holder.free(), f"{at}: the key was left held"
    for worker in (older, middle, forker):
        await worker.send("quit")
        assert await worker.finish() == 0
