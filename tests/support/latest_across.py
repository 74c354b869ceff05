"""Latest work shared across processes, in one process: queues on one directory as processes.

Several KeyedQueues, each with a FileBackend of its own on one directory,
share a key's line as processes do: the backend cannot tell them apart
(each queue keeps its own lines and its own latest work).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inturn import KeyedQueue
from inturn.backends.file import FileBackend
from inturn.backends.file._linefile import parse

from .file_checks import line_file
from .helpers import PATIENCE


class Holder:
    """A queue (a process of its own) that holds key k until released."""

    def __init__(self, directory: Path) -> None:
        self.queue = KeyedQueue(backend=FileBackend(directory))
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


def latest(directory: Path, **settings: Any) -> KeyedQueue:
    """A queue whose latest work is the key's among the queues on directory."""
    return KeyedQueue(
        backend=FileBackend(directory), pending="latest", across="processes", **settings
    )


def records(directory: Path) -> list[str]:
    """Key k's line file's records now ([] if there is none)."""
    try:
        return line_file(directory, "k").read_bytes().decode("latin-1").splitlines()
    except FileNotFoundError:
        return []


def posts(directory: Path) -> int:
    """How many posts of latest work key k's line file holds now."""
    return len(parse(records(directory)).posts)


async def key_free(directory: Path) -> bool:
    """Whether key k is free: a plain turn takes it at once, alone in its line."""
    queue = KeyedQueue(backend=FileBackend(directory))
    try:
        async with queue.keyed("k", timeout=PATIENCE):
            return not FileBackend(directory).line("k")[1:]
    finally:
        await queue.aclose()


class Runs(list[str]):
    """Records the works that ran."""

    def work(self, name: str) -> Callable[[], Any]:
        async def run() -> str:
            self.append(name)
            return name

        return run
