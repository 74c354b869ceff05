"""Latest work shared across processes, in one process: queues on one place as processes.

Several KeyedQueues, each with a backend of its own on one place (a file
backend's directory, or a Redis namespace), share a key's line as processes
do: the backend cannot tell them apart (each queue keeps its own lines and
its own latest work).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from inturn import KeyedQueue
from inturn.backends import Backend
from inturn.backends.file import FileBackend
from inturn.backends.file._linefile import parse
from inturn.backends.redis import RedisBackend
from inturn.backends.redis._scripts import Line

from .file_checks import line_file
from .helpers import PATIENCE


class Shared:
    """Where the queues of a test share their lines: a directory, or a Redis namespace.

    Its looks at key k's line are synchronous (a test's settle and a thread's
    wait_until take them): the file's records, or Redis's keys read with a
    blocking client.
    """

    def __init__(self, directory: Path, url: str | None = None, namespace: str = "") -> None:
        self.directory = directory
        self.url = url
        self.namespace = namespace
        self._redis = None if url is None else redis.Redis.from_url(url)
        self.kind = "file" if url is None else "redis"

    def backend(self) -> Backend:
        """A backend of its own on this place (a process's)."""
        if self.url is None:
            return FileBackend(self.directory)
        return RedisBackend.from_url(self.url, namespace=self.namespace, lease=LEASE)

    def posts(self) -> int:
        """How many posts of latest work key k's line holds now."""
        if self._redis is None:
            return len(parse(records(self.directory)).posts)
        info = Line(self.namespace, "k").names[3]
        return sum(b" @" in value for value in self._redis.hvals(info))

    def members(self) -> int:
        """How many turns key k's line has now (its holder, and its waiters)."""
        if self._redis is None:
            return len(FileBackend(self.directory).line("k"))
        line, q = Line(self.namespace, "k").names[:2]
        return self._redis.hexists(line, "holder") + self._redis.zcard(q)

    def empty(self) -> bool:
        """Whether key k's line is gone (nobody holds it or waits: nothing is left)."""
        if self._redis is None:
            return not line_file(self.directory, "k").exists()
        return not self._redis.exists(*Line(self.namespace, "k").names)

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()


#: Redis's lease in these tests (s): long enough for a loaded machine's heartbeats.
LEASE = 2.0


def _shared(place: Path | Shared) -> Shared:
    return place if isinstance(place, Shared) else Shared(place)


class Holder:
    """A queue (a process of its own) that holds key k until released."""

    def __init__(self, place: Path | Shared) -> None:
        self.queue = KeyedQueue(backend=_shared(place).backend())
        self.held = asyncio.Event()
        self.gate = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def hold(self) -> None:
        async def holding() -> None:
            self.held.set()
            await self.gate.wait()

        self.task = asyncio.create_task(self.queue.run("k", holding))
        await self.held.wait()

    async def release(self) -> None:
        self.gate.set()
        assert self.task is not None
        await self.task


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
    """Records the works that ran."""

    def work(self, name: str) -> Callable[[], Any]:
        async def run() -> str:
            self.append(name)
            return name

        return run
