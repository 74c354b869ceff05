"""The ways into and out of a turn: defects 10 to 15 of issue 41, one small test each.

(Defect 9, a signal handler's exception leaving a key held, is the interrupt
storm's: tests/test_interrupt_storm.py.) Deterministic: events, loop rounds,
and threads waited for by the state they bring about.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from inturn import KeyedQueue, QueueClosed, QueueFull

from support.helpers import PATIENCE, checkpoints, settle

# -- 10: close() lets a several-key turn already waiting go on ---------------------------------


@pytest.mark.parametrize("kind", ["task", "thread"])
async def test_10_close_lets_a_several_key_turn_waiting_for_its_first_key_run(kind: str) -> None:
    """Issue 41, 10. ``close()``: "Work already holding or waiting for a turn goes on."

    ``keyed(1, 2)`` waits for key 1 when ``close()`` lands: handed key 1, it takes key 2
    and runs its block, instead of raising QueueClosed on key 2.
    """
    queue = KeyedQueue()
    ran: list[str] = []
    release = asyncio.Event()

    async def hold() -> None:
        async with queue.keyed(1):
            await release.wait()

    holder = asyncio.create_task(hold())
    await settle(lambda: queue.is_active(1))

    async def in_task() -> None:
        async with queue.keyed(1, 2):
            ran.append("block")

    def in_thread() -> None:
        with queue.keyed(1, 2):
            ran.append("block")

    if kind == "task":
        both: asyncio.Future[Any] = asyncio.ensure_future(in_task())
    else:
        both = asyncio.ensure_future(asyncio.to_thread(in_thread))
    await settle(lambda: queue.pending(1) == 1)
    queue.close()
    release.set()
    await holder
    outcome = await asyncio.gather(asyncio.wait_for(both, PATIENCE), return_exceptions=True)
    assert list(outcome) == [None], f"the several-key turn waiting at close() got {outcome[0]!r}"
    assert ran == ["block"]
    assert queue.active_count == 0
    with pytest.raises(QueueClosed):  # (and later work is refused, as ever)
        async with queue.keyed(1, 2):
            pass


# -- 11: a reentrant call reports as many ended() as started() ---------------------------------


class Heard:
    """An observer (inturn.Observer) counting the turns it hears of."""

    def __init__(self) -> None:
        self.starts = self.ends = self.misses = 0

    def started(self, waited: float, function: str | None) -> None:
        self.starts += 1

    def ended(self, held: Any, error: BaseException | None, cut: bool, function: Any) -> None:
        self.ends += 1

    def missed(self, error: BaseException, function: str | None) -> None:
        self.misses += 1


@pytest.mark.parametrize("settings", [{}, {"timeout": 5.0}, {"max_running": 4}])
@pytest.mark.parametrize("kind", ["task", "thread"])
async def test_11_a_reentrant_call_on_an_observed_queue_ends_as_often_as_it_starts(
    kind: str, settings: dict[str, Any]
) -> None:
    """Issue 41, 11. An observer hears, of each turn that started, that it ended: a gauge
    of turns in flight (``started`` minus ``ended``) is back at 0 once they all ended.

    Two turns, each with a reentrant call inside (a method calling another with the
    same key).
    """
    queue = KeyedQueue(**settings)
    heard = Heard()
    queue.observe(heard)

    async def inner() -> str:
        return "inner"

    async def outer() -> str:
        return str(await queue.run("k", inner))

    def inner_sync() -> str:
        return "inner"

    def outer_sync() -> str:
        return str(queue.run_sync("k", inner_sync))

    for _ in range(2):
        if kind == "task":
            assert await queue.run("k", outer) == "inner"
        else:
            assert await asyncio.to_thread(queue.run_sync, "k", outer_sync) == "inner"
    assert heard.starts == heard.ends, (
        f"{heard.starts} started, {heard.ends} ended for 2 turns with a reentrant call each"
    )
    assert heard.misses == 0


# -- 12: a key whose == raises is refused with TypeError ----------------------------------------


class Touchy:
    """A key that shares its hash with every Touchy, and whose == raises."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return 41

    def __eq__(self, other: object) -> bool:
        raise LookupError(f"{self.name} cannot be compared")

    def __repr__(self) -> str:
        return f"Touchy({self.name!r})"


@pytest.mark.parametrize("kind", ["task", "thread", "decorator"])
async def test_12_a_key_whose_eq_raises_in_a_several_key_turn_is_refused_with_type_error(
    kind: str,
) -> None:
    """Issue 41, 12. README: "A key whose ``==`` raises against another key of its hash is
    refused with ``TypeError``" (not the key's own exception), and nothing is queued."""
    queue = KeyedQueue()
    one, other = Touchy("one"), Touchy("other")
    ran: list[str] = []

    async def in_task() -> None:
        async with queue.keyed(one, other):
            ran.append("block")

    def in_thread() -> None:
        with queue.keyed(one, other):
            ran.append("block")

    @queue.queue_by_key(keys=lambda args: [args["a"], args["b"]])
    async def decorated(a: Touchy, b: Touchy) -> None:
        ran.append("decorated")

    call: Callable[[], Awaitable[Any]] = {
        "task": in_task,
        "thread": lambda: asyncio.to_thread(in_thread),
        "decorator": lambda: decorated(one, other),
    }[kind]
    with pytest.raises(TypeError) as refused:
        await call()
    assert "Touchy" in str(refused.value)
    assert ran == []
    assert queue.active_count == 0


# -- 13: a submitted work's BaseException is never logged when its handle was awaited ----------


class Stop(BaseException):
    """An application's own BaseException (as a worker's shutdown signal might be)."""


@contextmanager
def loop_exceptions(loop: asyncio.AbstractEventLoop) -> Iterator[list[dict[str, Any]]]:
    """Collect what reaches the loop's exception handler ("Task exception was never
    retrieved", among others) while the block runs."""
    seen: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: seen.append(context))
    try:
        yield seen
    finally:
        loop.set_exception_handler(previous)


@pytest.mark.parametrize("error", [GeneratorExit, Stop], ids=["GeneratorExit", "own"])
@pytest.mark.parametrize("busy", [False, True], ids=["free", "busy"])
async def test_13_submitted_work_raising_a_base_exception_is_not_logged_once_awaited(
    caplog: pytest.LogCaptureFixture, error: type[BaseException], busy: bool
) -> None:
    """Issue 41, 13. README: "Errors are never lost, never logged as 'Task exception was
    never retrieved'": a handle awaited has had its error retrieved, whatever its class."""
    queue = KeyedQueue()
    release = asyncio.Event()

    async def hold() -> None:
        async with queue.keyed("k"):
            await release.wait()

    async def work() -> None:
        raise error("the work's own")

    holder = asyncio.create_task(hold()) if busy else None
    await settle(lambda: queue.is_active("k") == busy)
    with caplog.at_level(logging.DEBUG), loop_exceptions(asyncio.get_running_loop()) as seen:
        handle = await queue.submit("k", work)
        release.set()
        with pytest.raises(error):
            await handle
        if holder is not None:
            await holder
        await queue.drain()
        del handle
        for _ in range(3):
            gc.collect()
            await checkpoints()
    messages = [context.get("message") for context in seen]
    assert not seen, f"the loop was told: {messages}"
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not logged, f"logged: {logged}"


# -- 14: one keyed() object entered twice at once is refused ---------------------------------------


async def test_14_one_keyed_object_entered_by_a_second_task_is_refused_at_once() -> None:
    """Issue 41, 14. A ``keyed(...)`` object is one turn: a second task entering it while a
    first has entered is refused at once (the docs warn against it; today, when one of
    the two is cancelled while both wait, both keys stay held for ever).

    Which error it raises is the fix's to decide; here: any ``Exception`` but a turn's
    own (TimeoutError, QueueFull, QueueClosed), raised before the keys free.
    """
    queue = KeyedQueue()
    release = asyncio.Event()
    ran: list[str] = []

    async def hold() -> None:
        async with queue.keyed("a"):
            await release.wait()

    holder = asyncio.create_task(hold())
    await settle(lambda: queue.is_active("a"))
    turn = queue.keyed("a", "b")

    async def enter(name: str) -> None:
        async with turn:
            ran.append(name)

    first = asyncio.create_task(enter("first"))
    await settle(lambda: queue.pending("a") == 1)
    second = asyncio.create_task(enter("second"))
    await checkpoints(10)
    assert second.done(), "the second entry of one keyed() object waits instead of being refused"
    refused = second.exception()
    assert isinstance(refused, Exception)
    assert not isinstance(refused, TimeoutError | QueueFull | QueueClosed), refused
    first.cancel()
    release.set()
    await asyncio.gather(first, holder, return_exceptions=True)
    assert ran == []
    assert queue.active_count == 0, f"keys left held: {queue!r}"
    async with queue.keyed("a", "b", timeout=0):  # (free: taken at once)
        pass


async def test_14_cancelling_one_of_two_entries_of_one_keyed_object_leaves_the_keys_free() -> None:
    """Issue 41, 14, the harm itself: whatever the second entry does, once the first is
    cancelled while both wait and the holder leaves, no key stays held."""
    queue = KeyedQueue()
    release = asyncio.Event()

    async def hold() -> None:
        async with queue.keyed("a"):
            await release.wait()

    holder = asyncio.create_task(hold())
    await settle(lambda: queue.is_active("a"))
    turn = queue.keyed("a", "b")

    async def enter() -> None:
        async with turn:
            await checkpoints()

    first = asyncio.create_task(enter())
    await settle(lambda: queue.pending("a") == 1)
    second = asyncio.create_task(enter())
    await checkpoints(3)
    first.cancel()
    await checkpoints(3)
    release.set()
    await asyncio.wait_for(asyncio.gather(first, second, holder, return_exceptions=True), PATIENCE)
    await settle(lambda: queue.active_count == 0, limit=50)
    async with queue.keyed("a", "b", timeout=0):
        pass


# -- 15: submit() takes its place at its call, with concurrency > 1 too --------------------------


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_15_a_submission_takes_its_place_at_its_call_before_tasks_not_started(
    concurrency: int,
) -> None:
    """Issue 41, 15. README: ``submit()`` "returns a ``Handle`` once the work has taken its
    place in its key's line (at this call, on every queue, with a backend,
    ``concurrency`` or ``max_running`` too: later callers of the key, ``run()``, threads
    or submissions, go after it)".

    Two tasks are created calling ``run("k", ...)`` (they have not run: they call later);
    then ``submit("k", ...)`` is awaited before they run: its work starts first.
    """
    queue = KeyedQueue(concurrency=concurrency)
    started: list[str] = []

    def work(name: str) -> Any:
        async def run() -> str:
            started.append(name)
            await checkpoints()
            return name

        return run

    later = [asyncio.create_task(queue.run("k", work(f"run {n}"))) for n in range(2)]
    handle = await queue.submit("k", work("submitted"))
    assert await handle == "submitted"
    await asyncio.gather(*later)
    assert started[0] == "submitted", f"started in the order {started}"
