"""Shared helpers: deterministic ways to drive concurrency (no real sleeps)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import pytest

from inturn import KeyedQueue
from inturn.backends import Capabilities

#: How long a test waits for a state that real I/O brings about, before failing.
#: A safety net against a hang, far above what any step takes.
PATIENCE = 30.0

#: Makes a KeyedQueue on the backend under test: ``make_queue(timeout=..., max_pending=...)``.
QueueFactory = Callable[..., KeyedQueue]


async def checkpoints(n: int = 1) -> None:
    """Let every other ready task run n steps."""
    for _ in range(n):
        await asyncio.sleep(0)


async def settle(predicate: Callable[[], bool], limit: int = 200) -> None:
    """Yield to the loop until predicate() holds.

    In process, the state is reached through the tasks' own progress within
    `limit` loop rounds, or the test fails at once. Where a backend waits
    for real I/O (a Redis reply), rounds go by without progress; after
    `limit` rounds it keeps waiting a millisecond at a time, up to PATIENCE
    seconds: the wait ends on the state, never on a time.
    """
    for _ in range(limit):
        if predicate():
            return
        await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PATIENCE
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"state not reached within {limit} loop rounds and {PATIENCE} s")
        await asyncio.sleep(0.001)


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    """Block until another thread has made predicate true (checked every 0.2 ms).

    For states that other threads bring about: a thread waiting in a line
    gives no signal. The wait ends on the state, not on a time; PATIENCE
    only bounds a hang.
    """
    deadline = time.monotonic() + PATIENCE
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never reached: {what}")
        time.sleep(0.0002)


@contextmanager
def holding(queue: KeyedQueue, *keys: Hashable) -> Iterator[None]:
    """A thread of its own holds keys of queue (``with queue.keyed(...)``) during the block.

    The block starts once the thread's turn began; the turn ends when it ends.
    """
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with queue.keyed(*keys):
            held.set()
            release.wait(PATIENCE)

    holder = threading.Thread(target=hold, name="holder")
    holder.start()
    try:
        assert held.wait(PATIENCE), f"the holder never took {keys}"
        yield
    finally:
        release.set()
        holder.join(PATIENCE)


class Recorder:
    """Bodies that record when they run, and check that one key never runs twice at once."""

    def __init__(self) -> None:
        self.started: list[Any] = []  # names, in start order
        self.finished: list[Any] = []  # names, in finish order
        self.inside: Counter[Hashable] = Counter()  # key -> bodies running now
        self.overlaps: list[tuple[Hashable, Any]] = []  # (key, name) that found another inside

    def body(
        self,
        key: Hashable,
        name: Any,
        *,
        gate: asyncio.Event | None = None,
        steps: int = 1,
        error: BaseException | None = None,
    ) -> Callable[[], Any]:
        """A coroutine function that holds for `steps` loop rounds (and the gate)."""

        async def run() -> Any:
            if self.inside[key]:
                self.overlaps.append((key, name))
            self.inside[key] += 1
            self.started.append(name)
            try:
                if gate is not None:
                    await gate.wait()
                await checkpoints(steps)
                if error is not None:
                    raise error
                return name
            finally:
                self.inside[key] -= 1
                self.finished.append(name)

        return run


def unavailable(what: str) -> NoReturn:
    """Skip a test whose server is missing; in CI, where every server is installed, fail."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not available, and CI must test it")
    pytest.skip(f"{what} is not available on this machine")


class _Grant:
    def __init__(self, key: Any, token: int) -> None:
        self.key, self.token, self.lost = key, token, False


class LosingBackend:
    """A backend whose leases all run out while their work holds them (LeaseLost each turn)."""

    capabilities = Capabilities()

    def thread_loop(self) -> None:
        return None

    def __init__(self) -> None:
        self.tokens = 0

    def order(self, keys: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(sorted(set(keys)))

    async def acquire(self, key: Any, timeout: float | None) -> _Grant:
        self.tokens += 1
        return _Grant(key, self.tokens)

    async def release(self, grant: Any) -> None:
        grant.lost = True

    async def aclose(self) -> None:
        pass


def main_thread_raises_on_sigint() -> None:
    """Check that a SIGINT sent to the main thread raises KeyboardInterrupt there.

    A test that interrupts the main thread with SIGINT relies on Python's own
    handler: an asyncio runner left installed by an earlier test (its handler
    cancels a task instead) would make it wait for ever.
    """
    handler = signal.getsignal(signal.SIGINT)
    assert handler is signal.default_int_handler, (
        f"SIGINT is handled by {handler!r}, not Python's default: an earlier test left it"
    )
