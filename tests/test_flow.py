"""Flow control: max_running, concurrency, max_hold, submit() and Handles, batch(), stats().

Orders are set up with events, ``checkpoints()`` and ``settle()`` on a
state, never with a sleep. The max_hold and timeout tests need a real short
limit; each asserts only what holds however long the machine takes (the
work waits on an event that never comes, so it is surely cancelled; an
overlap is caught by a counter, not by a clock).
"""

from __future__ import annotations

import asyncio
import gc
import math
import pickle
import sys
import threading
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import inturn
from inturn import HoldTimeout, InturnError, KeyedQueue, QueueClosed
from inturn.backends.file import FileBackend

from support.helpers import PATIENCE, Recorder, checkpoints, settle, wait_until
from support.virtual_time import Deadlock, VirtualTimeLoop

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

#: Loop rounds a blocked caller is given to show it stays blocked.
ROUNDS = 30


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8) as executor:
        yield executor


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[dict[str, Any]]]:
    """What reaches the running loop's exception handler ("never retrieved", ...)."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    yield reported
    loop.set_exception_handler(previous)


class Gauge:
    """Counts works inside their turn, across keys, tasks and threads.

    ``peak`` is the most inside at once; each key's start order and its own
    peak are kept too.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.peak = 0
        self.inside: Counter[Hashable] = Counter()
        self.key_peak: Counter[Hashable] = Counter()
        self.started: defaultdict[Hashable, list[Any]] = defaultdict(list)

    def enter(self, key: Hashable, name: Any) -> None:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
            self.inside[key] += 1
            self.key_peak[key] = max(self.key_peak[key], self.inside[key])
            self.started[key].append(name)

    def leave(self, key: Hashable) -> None:
        with self.lock:
            self.running -= 1
            self.inside[key] -= 1

    def body(
        self, key: Hashable, name: Any, *, steps: int = 1, gate: asyncio.Event | None = None
    ) -> Callable[[], Any]:
        async def run() -> Any:
            self.enter(key, name)
            try:
                if gate is not None:
                    await gate.wait()
                await checkpoints(steps)
                return name
            finally:
                self.leave(key)

        return run

    def sync_body(self, key: Hashable, name: Any) -> Callable[[], Any]:
        def run() -> Any:
            self.enter(key, name)
            try:
                time.sleep(0)  # let the other threads run while inside
                return name
            finally:
                self.leave(key)

        return run


async def fail(error: BaseException, *, gate: asyncio.Event | None = None) -> None:
    if gate is not None:
        await gate.wait()
    await checkpoints()
    raise error


def slot_waiters(queue: KeyedQueue) -> int:
    return queue.stats().waiting_for_slot


def never_retrieved(reported: list[dict[str, Any]]) -> list[str]:
    return [str(context.get("message")) for context in reported]


# -- max_running ------------------------------------------------------------------------

WAYS = ("run", "keyed", "decorator", "submit")


@pytest.mark.parametrize("way", WAYS)
async def test_max_running_is_never_exceeded_and_each_key_stays_fifo(way: str) -> None:
    queue = KeyedQueue(max_running=3)
    gauge = Gauge()
    works = [(f"k{k}", (k, i)) for i in range(8) for k in range(12)]

    def steps(name: tuple[int, int]) -> int:
        return 1 + (name[0] * 7 + name[1] * 3) % 5

    @queue.queue_by_key(key="{key}")
    async def decorated(key: str, name: tuple[int, int]) -> Any:
        return await gauge.body(key, name, steps=steps(name))()

    async def in_block(key: str, name: tuple[int, int]) -> Any:
        async with queue.keyed(key):
            return await gauge.body(key, name, steps=steps(name))()

    if way == "submit":
        handles = [await queue.submit(key, gauge.body(key, n, steps=steps(n))) for key, n in works]
        results = [await handle for handle in handles]
    elif way == "run":
        runs = (queue.run(key, gauge.body(key, n, steps=steps(n))) for key, n in works)
        results = await asyncio.gather(*runs)
    elif way == "keyed":
        results = await asyncio.gather(*(in_block(key, n) for key, n in works))
    else:
        results = await asyncio.gather(*(decorated(key, n) for key, n in works))

    assert results == [name for _, name in works]
    assert gauge.peak <= 3
    if way != "submit":  # (a producer may give each work time to end before the next)
        assert gauge.peak == 3  # the works started together: the bound was reached
    assert set(gauge.key_peak.values()) == {1}
    for k in range(12):
        assert gauge.started[f"k{k}"] == [(k, i) for i in range(8)]
    assert queue.active_count == 0
    assert queue.stats().running == 0


async def test_slots_go_in_order_of_waiting_and_a_finished_key_to_the_back() -> None:
    queue = KeyedQueue(max_running=1)
    recorder = Recorder()
    gate = asyncio.Event()
    first = asyncio.create_task(queue.run("a", recorder.body("a", "a1", gate=gate)))
    await settle(lambda: recorder.started == ["a1"])
    tasks = [asyncio.create_task(queue.run("a", recorder.body("a", "a2")))]
    await settle(lambda: queue.pending("a") == 1)  # in a's line: it waits for no slot
    for name in ("b", "c", "d"):
        tasks.append(asyncio.create_task(queue.run(name, recorder.body(name, name))))
        waiting = len(tasks) - 1
        await settle(lambda n=waiting: slot_waiters(queue) == n)
    gate.set()
    await asyncio.gather(first, *tasks)
    # a2 became a's holder only when a1 left, so it waits for a slot behind b, c, d
    assert recorder.started == ["a1", "b", "c", "d", "a2"]


@pytest.mark.parametrize("way", ["run", "submit"])
@pytest.mark.parametrize("hot_keys", [1, 2])
async def test_a_hot_key_does_not_starve_a_cold_one(hot_keys: int, way: str) -> None:
    queue = KeyedQueue(max_running=hot_keys)
    events: list[Any] = []
    midway = asyncio.Event()

    async def hot(key: str, i: int) -> None:
        events.append((key, i))
        if i == 500:
            midway.set()
        await checkpoints(2)

    async def cold() -> str:
        events.append("cold submitted")
        if way == "run":
            return await queue.run("cold", lambda: events.append("cold") or "cold")
        return await (await queue.submit("cold", lambda: events.append("cold") or "cold"))

    keys = [f"hot{h}" for h in range(hot_keys)]
    if way == "run":
        hots = [asyncio.create_task(queue.run(k, hot, k, i)) for i in range(1000) for k in keys]
    else:  # each producer's next submission queues behind its key's running work
        hots = [await queue.submit(k, hot, k, i) for i in range(1000) for k in keys]
    await midway.wait()
    assert await cold() == "cold"
    submitted, started = events.index("cold submitted"), events.index("cold")
    # the cold task starts within the first 3 turns after it was submitted
    assert started - submitted - 1 <= 2, events[submitted : started + 1]
    for work in hots:
        await work
    for key in keys:
        assert [e[1] for e in events if isinstance(e, tuple) and e[0] == key] == list(range(1000))


async def test_a_nested_turn_takes_no_second_slot() -> None:
    queue = KeyedQueue(max_running=1)
    order: list[str] = []
    nest = asyncio.Event()

    @queue.queue_by_key(key="d")
    async def decorated() -> str:
        return "d"

    async def outer() -> list[Any]:
        async with queue.keyed("a"):
            order.append("a")
            await nest.wait()
            got = []
            async with queue.keyed("b"):  # another key
                got.append(await queue.run("c", lambda: "c"))
                got.append(await decorated())
                async with queue.keyed("a"):  # reentrant
                    got.append(await queue.run("b", lambda: "b"))
            order.append("a done")
            return got

    task = asyncio.create_task(outer())
    await settle(lambda: order == ["a"])
    other = asyncio.create_task(queue.run("x", lambda: order.append("x")))
    await settle(lambda: slot_waiters(queue) == 1)
    nest.set()  # the nested turns must not wait for a slot behind "x"
    await settle(task.done)
    assert await task == ["c", "d", "b"]
    await other
    assert order == ["a", "a done", "x"]


async def test_waiting_for_a_slot_counts_in_the_timeout_and_releases_the_keys() -> None:
    queue = KeyedQueue(max_running=1)
    gate = asyncio.Event()
    ran: list[str] = []
    holder = asyncio.create_task(queue.run("a", gate.wait))
    await settle(lambda: queue.is_active("a"))

    async def impatient() -> None:
        async with queue.keyed("b", "c", timeout=0.01):
            ran.append("impatient")

    first = asyncio.create_task(impatient())
    await settle(lambda: slot_waiters(queue) == 1)
    behind = asyncio.create_task(queue.run("b", lambda: ran.append("behind")))
    await settle(lambda: queue.pending("b") == 1)
    with pytest.raises(TimeoutError):
        await first  # b and c are free: only the slot was missing
    # b went to the next in its line, which now waits for the slot; c is free
    await settle(lambda: slot_waiters(queue) == 1 and queue.pending("b") == 0)
    assert not queue.is_active("c")
    assert ran == []
    gate.set()
    await asyncio.gather(holder, behind)
    assert ran == ["behind"]
    assert queue.active_count == 0
    assert queue.stats().timed_out == 1


async def test_the_queue_timeout_covers_the_slot_wait() -> None:
    queue = KeyedQueue(max_running=1, timeout=0.01)
    gate, ran = asyncio.Event(), asyncio.Event()
    holder = asyncio.create_task(queue.run("a", gate.wait))
    await settle(lambda: queue.is_active("a"))
    with pytest.raises(TimeoutError):
        await queue.run("b", ran.set)  # b is free: only the slot is missing
    assert not queue.is_active("b")
    gate.set()
    await holder
    assert not ran.is_set()


async def test_a_task_cancelled_while_waiting_for_a_slot_leaves_the_line() -> None:
    queue = KeyedQueue(max_running=1)
    gate = asyncio.Event()
    ran: list[str] = []
    holder = asyncio.create_task(queue.run("a", gate.wait))
    await settle(lambda: queue.is_active("a"))
    leaver = asyncio.create_task(queue.run("b", lambda: ran.append("b")))
    await settle(lambda: slot_waiters(queue) == 1)
    stayer = asyncio.create_task(queue.run("c", lambda: ran.append("c")))
    await settle(lambda: slot_waiters(queue) == 2)
    leaver.cancel()
    await settle(lambda: slot_waiters(queue) == 1)
    assert not queue.is_active("b")
    gate.set()
    await asyncio.gather(holder, stayer)
    assert leaver.cancelled()
    assert ran == ["c"]
    assert queue.active_count == 0


async def test_a_slot_handed_to_a_task_cancelled_at_that_moment_passes_on() -> None:
    queue = KeyedQueue(max_running=1)
    ran: list[str] = []
    async with queue.keyed("a"):
        leaver = asyncio.create_task(queue.run("b", lambda: ran.append("b")))
        await settle(lambda: slot_waiters(queue) == 1)
        stayer = asyncio.create_task(queue.run("c", lambda: ran.append("c")))
        await settle(lambda: slot_waiters(queue) == 2)
    leaver.cancel()  # the slot was just handed to it: it has not run yet
    await settle(stayer.done)
    await stayer
    assert leaver.cancelled()
    assert ran == ["c"]
    assert queue.active_count == 0
    assert queue.stats().running == 0


async def test_several_keys_of_one_turn_take_one_slot() -> None:
    queue = KeyedQueue(max_running=2)
    gauge = Gauge()
    gate = asyncio.Event()

    async def both() -> str:
        async with queue.keyed("a", "b"):
            return await gauge.body("a+b", "a+b", gate=gate)()

    first = asyncio.create_task(both())
    other = asyncio.create_task(queue.run("c", gauge.body("c", "c", gate=gate)))
    await settle(lambda: gauge.running == 2)  # a+b took one slot: c has the other
    third = asyncio.create_task(queue.run("d", gauge.body("d", "d")))
    await settle(lambda: slot_waiters(queue) == 1)
    assert queue.stats().running == 2
    gate.set()
    assert await asyncio.gather(first, other, third) == ["a+b", "c", "d"]
    assert gauge.peak == 2


async def test_a_cancelled_handle_takes_no_slot() -> None:
    queue = KeyedQueue(max_running=1)
    gate = asyncio.Event()
    ran: list[str] = []
    holder = await queue.submit("a", gate.wait)
    behind = await queue.submit("a", lambda: ran.append("a2"))  # queued behind a: no wait
    producer = asyncio.create_task(queue.submit("b", lambda: ran.append("b")))
    await checkpoints(ROUNDS)
    assert not producer.done()
    assert behind.cancel() is True
    gate.set()  # a's holder leaves: the slot goes to b, a2 having left
    assert await (await producer) is None
    assert await holder is True
    assert behind.cancelled()
    assert ran == ["b"]
    assert queue.active_count == 0
    assert queue.stats().running == 0


async def test_one_deadline_covers_the_key_and_the_slot() -> None:
    loop = asyncio.get_running_loop()
    queue = KeyedQueue(max_running=2)
    forever = asyncio.Event()
    x = asyncio.create_task(queue.run("x", forever.wait))  # holds a slot throughout
    b = asyncio.create_task(queue.run("b", asyncio.sleep, 0.3))  # key b and a slot, 0.3 s
    await settle(lambda: queue.stats().running == 2)
    d = asyncio.create_task(queue.run("d", forever.wait))  # first for a slot: gets b's
    await settle(lambda: slot_waiters(queue) == 1)
    late = asyncio.Event()
    loop.call_later(0.55, late.set)
    with pytest.raises(TimeoutError):
        # 0.3 s in b's line, then a slot that never frees: missed at 0.4 s, not at
        # 0.7 s (a fresh 0.4 s for the slot); timers fire in the order of their deadlines
        async with queue.keyed("b", timeout=0.4):
            pass
    assert not late.is_set()
    for task in (x, d):
        task.cancel()
    await asyncio.gather(x, b, d, return_exceptions=True)


# -- threads and max_running -----------------------------------------------------------


async def test_threads_and_tasks_never_exceed_max_running_together(
    pool: ThreadPoolExecutor,
) -> None:
    queue = KeyedQueue(max_running=2)
    gauge = Gauge()

    def thread_worker(t: int) -> None:
        for i in range(60):
            key = f"t{t}-{i % 3}"
            if i % 2:
                queue.run_sync(key, gauge.sync_body(key, (t, i)))
            else:
                with queue.keyed(key):
                    gauge.sync_body(key, (t, i))()

    async def task_worker(n: int) -> None:
        for i in range(60):
            key = f"a{n}-{i % 3}"
            await queue.run(key, gauge.body(key, (n, i), steps=2))

    loop = asyncio.get_running_loop()
    await asyncio.gather(
        *(loop.run_in_executor(pool, thread_worker, t) for t in range(4)),
        *(task_worker(n) for n in range(4)),
    )
    assert 1 <= gauge.peak <= 2
    assert set(gauge.key_peak.values()) == {1}
    assert queue.stats().running == 0


async def test_a_thread_waits_for_a_slot_that_a_task_holds(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue(max_running=1)
    gate = asyncio.Event()
    ran: list[str] = []
    holder = asyncio.create_task(queue.run("a", gate.wait))
    await settle(lambda: queue.is_active("a"))
    loop = asyncio.get_running_loop()
    thread = loop.run_in_executor(pool, queue.run_sync, "b", ran.append, "thread")
    await settle(lambda: slot_waiters(queue) == 1)
    await checkpoints(ROUNDS)
    assert ran == []
    gate.set()
    await holder
    await thread
    assert ran == ["thread"]


async def test_a_task_waits_for_a_slot_that_a_thread_holds(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue(max_running=1)
    inside = threading.Event()
    leave = threading.Event()
    ran: list[str] = []

    def thread_work() -> None:
        with queue.keyed("t"):
            inside.set()
            leave.wait()
            queue.run_sync("u", ran.append, "nested")  # nested: no second slot

    loop = asyncio.get_running_loop()
    thread = loop.run_in_executor(pool, thread_work)
    await settle(inside.is_set)
    task = asyncio.create_task(queue.run("b", ran.append, "task"))
    await settle(lambda: slot_waiters(queue) == 1)
    await checkpoints(ROUNDS)
    assert ran == []
    leave.set()
    await thread
    await task
    assert ran == ["nested", "task"]


async def test_a_run_that_finds_its_key_and_a_slot_free_holds_both_and_counts() -> None:
    """run()'s turn at once on a queue with slots (its own path): the slot is held, then freed.

    The queue's first call settles its loop; the calls after it find the key
    and a slot free and take both at once.
    """
    queue = KeyedQueue(max_running=1)
    await queue.run("warm", lambda: None)
    gate = asyncio.Event()
    seen: list[tuple[int, int]] = []
    span: list[float] = []

    async def hold() -> str:
        span.append(time.monotonic())
        seen.append((queue.stats().running, queue.pending("a")))
        await gate.wait()
        span.append(time.monotonic())
        return "held"

    holder = asyncio.create_task(queue.run("a", hold))
    await settle(lambda: seen == [(1, 0)])
    behind = asyncio.create_task(queue.run("b", lambda: "b"))  # no slot left: it waits
    await settle(lambda: slot_waiters(queue) == 1)
    gate.set()
    assert await holder == "held"
    assert await behind == "b"
    with pytest.raises(ValueError, match="boom"):
        await queue.run("c", fail, ValueError("boom"))
    stats = queue.stats()
    assert (stats.completed, stats.failed, stats.running, stats.waiting_for_slot) == (3, 1, 0, 0)
    assert stats.hold_time is not None
    assert stats.hold_time >= span[1] - span[0]
    assert not queue.active_keys


async def test_a_thread_arriving_while_a_run_holds_a_slot_taken_at_once_waits_its_turn(
    pool: ThreadPoolExecutor,
) -> None:
    """The queue turns shared (a thread) while a task holds a key and a slot it took at once."""
    queue = KeyedQueue(max_running=2)
    await queue.run("warm", lambda: None)
    gate = asyncio.Event()
    ran: list[str] = []

    async def hold() -> None:
        ran.append("task")
        await gate.wait()

    holder = asyncio.create_task(queue.run("a", hold))
    await settle(lambda: ran == ["task"])
    loop = asyncio.get_running_loop()
    thread = loop.run_in_executor(pool, queue.run_sync, "a", ran.append, "thread")
    await settle(lambda: queue.pending("a") == 1)
    await checkpoints(ROUNDS)
    assert ran == ["task"]
    gate.set()
    await holder
    await thread
    assert ran == ["task", "thread"]
    stats = queue.stats()
    assert (stats.completed, stats.running) == (3, 0)
    assert not queue.active_keys


def test_threads_alone_never_exceed_max_running(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue(max_running=3)
    gauge = Gauge()

    def worker(t: int) -> None:
        for i in range(100):
            queue.run_sync(f"k{(t + i) % 6}", gauge.sync_body(f"k{(t + i) % 6}", (t, i)))

    for future in [pool.submit(worker, t) for t in range(8)]:
        future.result()
    assert 1 <= gauge.peak <= 3
    assert set(gauge.key_peak.values()) == {1}
    wait_until(lambda: queue.active_count == 0, "every key released")


def test_threads_keep_concurrency_per_key(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue(concurrency=2, max_running=3)
    gauge = Gauge()

    def worker(t: int) -> None:
        for i in range(100):
            key = f"k{i % 2}"
            if t % 2:
                queue.run_sync(key, gauge.sync_body(key, (t, i)))
            else:
                with queue.keyed(key):
                    gauge.sync_body(key, (t, i))()

    for future in [pool.submit(worker, t) for t in range(6)]:
        future.result()
    assert 1 <= gauge.peak <= 3
    assert max(gauge.key_peak.values()) <= 2
    wait_until(lambda: queue.active_count == 0, "every key released")


# -- concurrency -----------------------------------------------------------------------


async def test_concurrency_lets_three_in_per_key_in_fifo_order() -> None:
    queue = KeyedQueue(concurrency=3)
    gauge = Gauge()
    gates = [asyncio.Event() for _ in range(10)]
    tasks = [
        asyncio.create_task(queue.run(key, gauge.body(key, i, gate=gates[i])))
        for i in range(10)
        for key in ("k", "j")
    ]
    await settle(lambda: gauge.started["k"] == [0, 1, 2] and gauge.started["j"] == [0, 1, 2])
    await checkpoints(ROUNDS)
    assert gauge.started["k"] == [0, 1, 2]
    assert queue.pending("k") == 7
    for done, expected in ((1, [0, 1, 2, 3]), (0, [0, 1, 2, 3, 4]), (4, [0, 1, 2, 3, 4, 5])):
        gates[done].set()
        await settle(lambda e=expected: gauge.started["k"] == e)
        await checkpoints(ROUNDS)
        assert gauge.started["k"] == expected
    for gate in gates:
        gate.set()
    await asyncio.gather(*tasks)
    assert gauge.key_peak == Counter({"k": 3, "j": 3})
    assert gauge.started["k"] == list(range(10))
    assert gauge.started["j"] == list(range(10))


async def test_concurrency_and_max_running_both_hold() -> None:
    queue = KeyedQueue(concurrency=3, max_running=4)
    gauge = Gauge()
    works = [(key, i) for i in range(20) for key in ("a", "b", "c")]
    await asyncio.gather(*(queue.run(k, gauge.body(k, i, steps=1 + i % 4)) for k, i in works))
    assert gauge.peak == 4
    assert max(gauge.key_peak.values()) <= 3
    for key in ("a", "b", "c"):
        assert gauge.started[key] == list(range(20))


async def test_a_holder_of_a_concurrent_key_runs_a_nested_call_at_once() -> None:
    queue = KeyedQueue(concurrency=2)
    gate = asyncio.Event()
    go = asyncio.Event()
    got: list[str] = []

    async def holder() -> None:
        async with queue.keyed("k"):
            await go.wait()
            got.append(await queue.run("k", lambda: "nested"))

    first = asyncio.create_task(holder())
    second = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.stats().running == 2)
    waiter = asyncio.create_task(queue.run("k", lambda: got.append("waiter")))
    await settle(lambda: queue.pending("k") == 1)
    go.set()  # both places are taken and one waits: the nested call still runs at once
    await settle(first.done)
    await first
    assert got == ["nested"]
    gate.set()
    await asyncio.gather(second, waiter)
    assert got == ["nested", "waiter"]


# -- submit() and Handles ---------------------------------------------------------------


async def test_submit_returns_a_handle_to_the_queued_work() -> None:
    queue = KeyedQueue()
    gate = asyncio.Event()
    first = await queue.submit("k", gate.wait)
    second = await queue.submit("k", lambda x, y=0: x + y, 40, y=2)
    assert isinstance(first, inturn.Handle)
    assert first.key == "k"
    # submit() did not yield, yet both joined the line: first holds "k", second waits behind it
    assert queue.pending("k") == 1
    await checkpoints()
    assert queue.pending("k") == 1
    assert not first.done()
    assert not second.done()
    gate.set()
    assert await first is True
    assert await second == 42
    assert first.done()
    assert not first.cancelled()
    assert second.cancel() is False  # done: nothing to cancel


async def test_every_timeout_says_what_the_turn_waited_for_and_that_the_work_did_not_run() -> None:
    # Issue 31: each names what the turn was waiting for when its time ran out (its
    # place in the key's line, with how many others waited; a running slot, and the
    # fix), the caller's limit, and that the work did not run. Before: "a running
    # slot (max_running=1) was not reached within 0.01 s", nothing about the line.
    queue = KeyedQueue(max_running=1)
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    behind = asyncio.create_task(queue.run("k", lambda: None))  # one more in k's line
    await settle(lambda: queue.pending("k") == 1)
    ran: list[str] = []
    with pytest.raises(TimeoutError) as waited:
        async with queue.keyed("k", timeout=0.01):
            ran.append("k")
    with pytest.raises(TimeoutError) as refused:
        async with queue.keyed("k", timeout=0):
            ran.append("k")
    with pytest.raises(TimeoutError) as slotless:  # the only slot is busy
        async with queue.keyed("other", timeout=0.01):
            ran.append("other")
    with pytest.raises(TimeoutError) as both:
        async with queue.keyed(2, 1, timeout=0):  # (int keys: an order that hash() keeps)
            ran.append("both")
    gate.set()
    await asyncio.gather(holder, behind)
    assert ran == []
    assert str(waited.value) == (
        "inturn: the turn for key 'k' was not reached within 0.01 s: it was waiting for its "
        "place in the key's line (the key was busy, 1 other turn waiting); the work did not run"
    )
    assert str(refused.value) == (
        "inturn: the turn for key 'k' was not reached at once (timeout=0): it needed its "
        "place in the key's line (the key was busy, 1 other turn waiting); the work did not run"
    )
    assert str(slotless.value) == (
        "inturn: the turn for key 'other' was not reached within 0.01 s: it was waiting for a "
        "running slot (all max_running=1 busy, no other turn waiting); the work did not run. "
        "Raise max_running"
    )
    assert str(both.value) == (
        "inturn: the turn for keys (1, 2) was not reached at once (timeout=0): it "
        "needed a running slot (all max_running=1 busy, no other turn waiting); the work did "
        "not run. Raise max_running"
    )


async def test_a_slot_wait_names_the_callers_limit_and_the_turns_waiting_for_slots() -> None:
    # Issue 31: a turn on a key nobody holds, max_running full with another key: the
    # time ran out waiting for a running slot, behind another turn waiting for one.
    queue = KeyedQueue(max_running=1)
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("busy", gate.wait))
    await settle(lambda: queue.is_active("busy"))
    queued = asyncio.create_task(queue.run("queued", lambda: None))  # waits for the slot
    await settle(lambda: queue.stats().waiting_for_slot == 1)
    with pytest.raises(TimeoutError) as late:
        async with queue.keyed("free", timeout=0.3):
            pytest.fail("the block ran without a slot")
    gate.set()
    await asyncio.gather(holder, queued)
    assert "'free' was not reached within 0.3 s: it was waiting for a running slot" in str(
        late.value
    )
    assert "(all max_running=1 busy, 1 other turn waiting)" in str(late.value)
    assert str(late.value).endswith("; the work did not run. Raise max_running")


async def test_a_missed_turns_error_pickles_as_a_plain_timeout_error() -> None:
    # What missed() keeps on the error for the drivers (see _checks.restated) is
    # words: an unpicklable key does not make the error unpicklable.
    queue = KeyedQueue()
    key = lambda: None  # noqa: E731 - hashable, and pickle refuses it
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run(key, gate.wait))
    await settle(lambda: queue.is_active(key))
    with pytest.raises(TimeoutError) as late:
        async with queue.keyed(key, timeout=0):
            pytest.fail("the block ran without its turn")
    gate.set()
    await holder
    copy = pickle.loads(pickle.dumps(late.value))
    assert type(copy) is TimeoutError
    assert str(copy) == str(late.value)
    assert "it needed its place in the key's line" in str(copy)


async def test_a_handle_answers_as_an_asyncio_future_does(
    loop_errors: list[dict[str, Any]],
) -> None:
    queue = KeyedQueue()
    gate = asyncio.Event()
    seen: list[tuple[str, inturn.Handle[Any]]] = []
    ok = await queue.submit("k", lambda: gate.wait())
    failing = await queue.submit("k", fail, ValueError("boom"))
    cancelled = await queue.submit("k", lambda: None)
    for name, handle in (("ok", ok), ("failing", failing), ("cancelled", cancelled)):
        handle.add_done_callback(lambda h, name=name: seen.append((name, h)))
    failing.add_done_callback(lambda h: seen.append(("failing again", h)))
    assert failing.remove_done_callback(seen.append) == 0  # never added
    with pytest.raises(asyncio.InvalidStateError):
        ok.result()
    with pytest.raises(asyncio.InvalidStateError):
        ok.exception()
    cancelled.cancel()
    gate.set()
    await settle(lambda: len(seen) == 4)
    assert ok.result() is True
    assert ok.exception() is None
    assert isinstance(failing.exception(), ValueError)
    with pytest.raises(ValueError, match="boom"):
        failing.result()
    with pytest.raises(asyncio.CancelledError):
        cancelled.result()
    with pytest.raises(asyncio.CancelledError):
        cancelled.exception()
    # each callback got its handle, in its loop, once
    assert sorted(name for name, _ in seen) == ["cancelled", "failing", "failing again", "ok"]
    handles = {"ok": ok, "failing": failing, "failing again": failing, "cancelled": cancelled}
    assert all(handle is handles[name] for name, handle in seen)
    # the error was retrieved through the handle: neither drain nor asyncio reports it
    await queue.drain(raise_errors=True)
    assert never_retrieved(loop_errors) == []


async def test_a_removed_done_callback_is_not_called() -> None:
    queue = KeyedQueue()
    seen: list[inturn.Handle[Any]] = []
    handle = await queue.submit("k", lambda: "done")
    handle.add_done_callback(seen.append)
    handle.add_done_callback(seen.append)
    assert handle.remove_done_callback(seen.append) == 2
    assert await handle == "done"
    await checkpoints()
    assert seen == []


async def test_submits_for_one_key_run_in_submission_order() -> None:
    queue = KeyedQueue()
    recorder = Recorder()
    handles = [await queue.submit("k", recorder.body("k", i, steps=3)) for i in range(20)]
    handles += [await queue.submit("j", recorder.body("j", i)) for i in range(20, 25)]
    assert [await handle for handle in handles] == list(range(25))
    assert [n for n in recorder.started if n < 20] == list(range(20))
    assert recorder.overlaps == []


async def test_a_cancelled_handle_never_runs_or_stops_its_work(
    loop_errors: list[dict[str, Any]],
) -> None:
    queue = KeyedQueue()
    recorder = Recorder()
    never = asyncio.Event()
    running = await queue.submit("k", recorder.body("k", "running", gate=never))
    queued = await queue.submit("k", recorder.body("k", "queued"))
    after = await queue.submit("k", recorder.body("k", "after"))
    await settle(lambda: recorder.started == ["running"])
    assert queued.cancel() is True
    await settle(queued.done)
    assert queued.cancelled()
    with pytest.raises(asyncio.CancelledError):
        await queued
    assert running.cancel() is True
    await settle(running.done)
    assert running.cancelled()
    assert await after == "after"
    assert recorder.started == ["running", "after"]
    await queue.drain(raise_errors=True)  # a cancellation is not an error
    assert never_retrieved(loop_errors) == []


async def test_submit_refuses_bad_input_itself() -> None:
    queue = KeyedQueue()
    with pytest.raises(TypeError, match="unhashable"):
        await queue.submit(["k"], lambda: None)
    with pytest.raises(TypeError, match="callable"):
        await queue.submit("k", 42)  # type: ignore[arg-type]
    async with queue.batch() as batch:
        with pytest.raises(TypeError, match="unhashable"):
            await batch.submit(["k"], lambda: None)
        with pytest.raises(TypeError, match="callable"):
            await batch.submit("k", None)  # type: ignore[arg-type]
    queue.close()
    with pytest.raises(QueueClosed):
        await queue.submit("k", lambda: None)
    assert queue.active_count == 0
    await queue.drain(raise_errors=True)


async def test_submit_blocks_the_producer_while_every_slot_is_busy() -> None:
    queue = KeyedQueue(max_running=2)
    gauge = Gauge()
    gate_a, gate_b = asyncio.Event(), asyncio.Event()
    a1 = await queue.submit("a", gauge.body("a", "a1", gate=gate_a))
    b1 = await queue.submit("b", gauge.body("b", "b1", gate=gate_b))
    await settle(lambda: gauge.running == 2)

    # a's work runs already: more work for a queues behind it without blocking
    more_a = asyncio.create_task(queue.submit("a", gauge.body("a", "a2")))
    await settle(more_a.done)
    a2 = await more_a
    more_a = asyncio.create_task(queue.submit("a", gauge.body("a", "a3")))
    await settle(more_a.done)
    a3 = await more_a
    await checkpoints()  # their tasks take their first steps
    assert queue.pending("a") == 2

    producer = asyncio.create_task(queue.submit("c", gauge.body("c", "c1")))
    await checkpoints(ROUNDS)
    assert not producer.done()  # both slots are busy
    gate_b.set()  # a slot frees: c takes it and the producer goes on
    await settle(producer.done)
    c1 = await producer
    assert await c1 == "c1"
    assert await b1 == "b1"
    assert gauge.started["a"] == ["a1"]
    gate_a.set()
    assert [await a1, await a2, await a3] == ["a1", "a2", "a3"]
    assert gauge.peak == 2


async def test_a_blocked_producer_can_be_cancelled() -> None:
    queue = KeyedQueue(max_running=1)
    gate = asyncio.Event()
    ran: list[str] = []
    holder = await queue.submit("a", gate.wait)
    producer = asyncio.create_task(queue.submit("b", lambda: ran.append("b")))
    await checkpoints(ROUNDS)
    assert not producer.done()
    producer.cancel()
    await settle(producer.done)
    assert producer.cancelled()
    await settle(lambda: not queue.is_active("b"))  # the work was withdrawn
    gate.set()
    await holder
    await queue.drain(raise_errors=True)
    assert ran == []
    assert queue.active_count == 0


async def test_blocked_producers_go_in_order_and_one_for_a_running_key_goes_on() -> None:
    queue = KeyedQueue(max_running=1)
    gauge = Gauge()
    gate_a, gate_c = asyncio.Event(), asyncio.Event()
    a = await queue.submit("a", gauge.body("a", "a", gate=gate_a))
    first = asyncio.create_task(queue.submit("c", gauge.body("c", "c1", gate=gate_c)))
    await checkpoints(ROUNDS)
    second = asyncio.create_task(queue.submit("c", gauge.body("c", "c2")))
    await checkpoints(ROUNDS)
    other = asyncio.create_task(queue.submit("d", gauge.body("d", "d1")))
    await checkpoints(ROUNDS)
    assert not first.done()  # the one slot is a's
    assert not second.done()
    assert not other.done()
    gate_a.set()
    await settle(lambda: gauge.started["c"] == ["c1"])  # the first producer's work took it
    await settle(first.done)
    # c's work runs now: the second producer's work queues behind it, with no slot to wait for
    await settle(second.done)
    await checkpoints(ROUNDS)
    assert not other.done()
    assert gauge.started["d"] == []
    gate_c.set()
    handles = [a, await first, await second, await other]
    assert [await handle for handle in handles] == ["a", "c1", "c2", "d1"]
    assert gauge.started["c"] == ["c1", "c2"]
    assert gauge.peak == 1


# -- errors nobody awaited -----------------------------------------------------------------


async def test_drain_raises_the_errors_of_unawaited_handles_once(
    loop_errors: list[dict[str, Any]],
) -> None:
    queue = KeyedQueue()
    first, second = ValueError("first"), KeyError("second")
    await queue.submit("a", fail, first)  # the handles are dropped at once
    await queue.submit("b", fail, second)
    fine = await queue.submit("a", lambda: "fine")
    awaited = await queue.submit("c", fail, RuntimeError("awaited"))
    with pytest.raises(RuntimeError, match="awaited"):
        await awaited
    with pytest.raises(ExceptionGroup) as info:
        await queue.drain(raise_errors=True)
    assert sorted(map(id, info.value.exceptions)) == sorted([id(first), id(second)])
    await queue.drain(raise_errors=True)  # raised once only
    assert await fine == "fine"
    del fine, awaited, info
    gc.collect()
    await checkpoints(3)
    assert never_retrieved(loop_errors) == []


async def test_an_error_awaited_after_it_happened_is_not_collected(
    loop_errors: list[dict[str, Any]],
) -> None:
    queue = KeyedQueue()
    handle = await queue.submit("k", fail, ValueError("late"))
    await settle(handle.done)
    await checkpoints(3)
    with pytest.raises(ValueError, match="late"):
        await handle
    await queue.drain(raise_errors=True)
    del handle
    gc.collect()
    await checkpoints(3)
    assert never_retrieved(loop_errors) == []


async def test_drain_without_raise_errors_keeps_them_for_a_later_drain(
    loop_errors: list[dict[str, Any]],
) -> None:
    queue = KeyedQueue()
    error = ValueError("kept")
    await queue.submit("k", fail, error)
    await queue.drain()
    gc.collect()
    await checkpoints(3)
    assert never_retrieved(loop_errors) == []
    with pytest.raises(ExceptionGroup) as info:
        await queue.drain(raise_errors=True)
    assert info.value.exceptions == (error,)


# -- batch() -----------------------------------------------------------------------------


async def test_batch_raises_the_errors_nobody_awaited(loop_errors: list[dict[str, Any]]) -> None:
    queue = KeyedQueue()
    recorder = Recorder()
    first, second = ValueError("first"), KeyError("second")
    handles: dict[str, inturn.Handle[Any]] = {}

    async def scope() -> None:
        async with queue.batch() as batch:
            await batch.submit("a", fail, first)  # the handles are dropped at once
            handles["ok"] = await batch.submit("a", recorder.body("a", "ok", steps=3))
            await batch.submit("b", fail, second)
            awaited = await batch.submit("c", fail, RuntimeError("awaited"))
            with pytest.raises(RuntimeError):
                await awaited

    with pytest.raises(ExceptionGroup) as info:
        await scope()
    ok = handles.pop("ok")
    assert sorted(map(id, info.value.exceptions)) == sorted([id(first), id(second)])
    assert ok.done()  # the scope waited for it
    assert await ok == "ok"
    await queue.drain(raise_errors=True)  # a batch's errors are not raised again
    del info, ok
    gc.collect()
    await checkpoints(3)
    assert never_retrieved(loop_errors) == []


async def test_batch_without_errors_waits_for_every_submission() -> None:
    queue = KeyedQueue(max_running=2)
    recorder = Recorder()
    async with queue.batch() as batch:
        handles = [await batch.submit(f"k{i % 3}", recorder.body(f"k{i % 3}", i)) for i in range(9)]
    assert all(handle.done() for handle in handles)
    assert sorted(recorder.finished) == list(range(9))


async def test_batch_adds_the_body_s_own_error() -> None:
    queue = KeyedQueue()
    error, boom = ValueError("work"), ZeroDivisionError("body")

    async def scope() -> None:
        async with queue.batch() as batch:
            handle = await batch.submit("a", fail, error)
            await settle(handle.done)
            raise boom

    with pytest.raises(ExceptionGroup) as info:
        await scope()
    assert sorted(map(id, info.value.exceptions)) == sorted([id(error), id(boom)])


async def test_batch_waits_for_its_own_work_only() -> None:
    queue = KeyedQueue()
    recorder = Recorder()
    gate = asyncio.Event()
    outside = await queue.submit("x", recorder.body("x", "outside", gate=gate))
    async with queue.batch() as batch:
        mine = await batch.submit("y", recorder.body("y", "mine", steps=3))
        # work of the queue on the batch's key, behind the batch's own
        later = await queue.submit("y", recorder.body("y", "later", gate=gate))
    assert mine.done()
    assert not outside.done()
    assert not later.done()
    gate.set()
    assert [await outside, await later] == ["outside", "later"]


async def test_batch_on_error_wait_lets_the_rest_run_to_the_end() -> None:
    queue = KeyedQueue()
    recorder = Recorder()
    fail_now, finish = asyncio.Event(), asyncio.Event()
    error = ValueError("first")
    handles: dict[str, inturn.Handle[Any]] = {}

    async def scope() -> None:
        async with queue.batch(on_error="wait") as batch:
            handles["fail"] = await batch.submit("a", fail, error, gate=fail_now)
            handles["running"] = await batch.submit("b", recorder.body("b", "running", gate=finish))
            handles["queued"] = await batch.submit("b", recorder.body("b", "queued"))

    task = asyncio.create_task(scope())
    await settle(lambda: recorder.started == ["running"])
    fail_now.set()
    await settle(handles["fail"].done)
    await checkpoints(ROUNDS)
    assert not task.done()  # it waits for the rest
    assert not handles["running"].cancelled()
    finish.set()
    with pytest.raises(ExceptionGroup) as info:
        await task
    assert info.value.exceptions == (error,)
    assert recorder.finished == ["running", "queued"]


async def test_batch_on_error_cancel_cancels_the_rest_and_the_body() -> None:
    queue = KeyedQueue()
    fail_now, never = asyncio.Event(), asyncio.Event()
    error = ValueError("first")
    events: list[str] = []
    handles: dict[str, inturn.Handle[Any]] = {}

    async def stubborn() -> None:
        events.append("running starts")
        try:
            await never.wait()
        except asyncio.CancelledError:
            await checkpoints(5)  # a few more steps before it gives up
            events.append("running ends")
            raise

    async def scope() -> None:
        async with queue.batch(on_error="cancel") as batch:
            handles["fail"] = await batch.submit("a", fail, error, gate=fail_now)
            handles["running"] = await batch.submit("b", stubborn)
            handles["queued"] = await batch.submit("b", lambda: events.append("queued"))
            try:
                await never.wait()
            except asyncio.CancelledError:
                events.append("body cancelled")
                raise

    outside_gate = asyncio.Event()
    outside = await queue.submit("x", outside_gate.wait)
    task = asyncio.create_task(scope())
    await settle(lambda: events == ["running starts"] and queue.pending("b") == 1)
    fail_now.set()
    with pytest.raises(ExceptionGroup) as info:
        await task
    assert info.value.exceptions == (error,)
    assert "running ends" in events  # waited until the cancelled work finished
    assert "body cancelled" in events
    assert "queued" not in events
    assert handles["running"].cancelled()
    assert handles["queued"].cancelled()
    assert not outside.done()  # not the batch's: untouched
    outside_gate.set()
    assert await outside is True


async def test_batch_on_error_cancel_cancels_the_rest_on_the_body_s_error() -> None:
    queue = KeyedQueue()
    never = asyncio.Event()
    boom = ZeroDivisionError("body")
    handles: list[inturn.Handle[Any]] = []

    async def scope() -> None:
        async with queue.batch(on_error="cancel") as batch:
            handles.append(await batch.submit("a", never.wait))
            await settle(lambda: queue.stats().running == 1)
            raise boom

    with pytest.raises(ExceptionGroup) as info:
        await scope()
    assert info.value.exceptions == (boom,)
    assert handles[0].cancelled()
    assert queue.active_count == 0


async def test_a_batch_cancelled_from_outside_cancels_its_submissions() -> None:
    queue = KeyedQueue()
    never = asyncio.Event()
    handles: list[inturn.Handle[Any]] = []

    async def scope() -> None:
        async with queue.batch() as batch:
            handles.append(await batch.submit("a", never.wait))
            handles.append(await batch.submit("a", never.wait))
            await never.wait()

    task = asyncio.create_task(scope())
    await settle(lambda: queue.pending("a") == 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(handle.cancelled() for handle in handles)
    assert queue.active_count == 0


async def test_batch_rejects_an_unknown_on_error() -> None:
    queue = KeyedQueue()
    with pytest.raises(ValueError, match=r"^inturn:.*on_error"):
        async with queue.batch(on_error="ignore"):  # type: ignore[arg-type]
            pass


# -- max_hold ----------------------------------------------------------------------------


def test_hold_timeout_is_an_inturn_error_and_a_timeout() -> None:
    assert issubclass(HoldTimeout, InturnError)
    assert issubclass(HoldTimeout, TimeoutError)
    assert "HoldTimeout" in inturn.__all__


async def test_max_hold_cancels_and_the_next_holder_waits_until_the_work_finished() -> None:
    queue = KeyedQueue(max_hold=0.01)
    events: list[str] = []
    never, let_go = asyncio.Event(), asyncio.Event()

    async def stubborn() -> None:
        events.append("stubborn starts")
        try:
            await never.wait()  # it never comes: surely cancelled
        except asyncio.CancelledError:
            events.append("stubborn cancelled")
            while not let_go.is_set():  # catches the cancel and keeps going
                try:
                    await let_go.wait()
                except asyncio.CancelledError:
                    pass
            events.append("stubborn ends")
            raise

    async def nxt() -> str:
        events.append("next starts")
        await checkpoints()
        return "next"

    first = asyncio.create_task(queue.run("k", stubborn))
    second = asyncio.create_task(queue.run("k", nxt))
    await settle(lambda: "stubborn cancelled" in events)
    await checkpoints(ROUNDS)
    assert "next starts" not in events
    assert queue.is_active("k")
    let_go.set()
    with pytest.raises(HoldTimeout):
        await first
    assert await second == "next"
    assert events == ["stubborn starts", "stubborn cancelled", "stubborn ends", "next starts"]


async def test_max_hold_of_a_keyed_block_and_of_a_decorator() -> None:
    queue = KeyedQueue()
    never = asyncio.Event()
    with pytest.raises(HoldTimeout):
        async with queue.keyed("k", max_hold=0.01):
            await never.wait()
    assert not queue.is_active("k")

    @queue.queue_by_key(key="k", max_hold=0.01)
    async def slow() -> None:
        await never.wait()

    with pytest.raises(HoldTimeout):
        await slow()
    assert not queue.is_active("k")
    handle = await queue.submit("k", never.wait)  # the queue's: no max_hold
    await checkpoints(ROUNDS)
    assert not handle.done()
    handle.cancel()


async def test_max_hold_of_a_call_overrides_the_queue_s() -> None:
    queue = KeyedQueue(max_hold=0.01)

    async def beyond() -> str:
        # A real wait past the queue's max_hold (not to get an order): the
        # queue's limit would surely have struck first.
        await asyncio.sleep(0.05)
        return "held"

    async with queue.keyed("k", max_hold=None):
        assert await beyond() == "held"

    @queue.queue_by_key(key="k", max_hold=30)
    async def patient() -> str:
        return await beyond()

    assert await patient() == "held"
    with pytest.raises(HoldTimeout):
        await queue.run("k", beyond)

    strict = KeyedQueue(max_hold=30)
    never = asyncio.Event()
    with pytest.raises(HoldTimeout):
        async with strict.keyed("k", max_hold=0.01):
            await never.wait()


async def test_max_hold_counts_from_the_turn_not_from_submission() -> None:
    queue = KeyedQueue(max_hold=0.2)

    async def long_holder() -> None:
        async with queue.keyed("k", max_hold=None):
            await asyncio.sleep(0.25)  # longer than max_hold, while the next one waits

    holder = asyncio.create_task(long_holder())
    await settle(lambda: queue.is_active("k"))
    waiter = asyncio.create_task(queue.run("k", checkpoints, 3))
    await holder
    await waiter  # waited past max_hold, but held the key for a few steps only


async def test_max_hold_of_submitted_work_reaches_its_handle_or_drain(
    loop_errors: list[dict[str, Any]],
) -> None:
    queue = KeyedQueue(max_hold=0.01)
    never = asyncio.Event()
    awaited = await queue.submit("k", never.wait)
    await queue.submit("k", never.wait)  # nobody awaits it
    after = await queue.submit("k", lambda: "after")
    with pytest.raises(HoldTimeout):
        await awaited
    assert await after == "after"
    with pytest.raises(ExceptionGroup) as info:
        await queue.drain(raise_errors=True)
    assert len(info.value.exceptions) == 1
    assert isinstance(info.value.exceptions[0], HoldTimeout)
    assert queue.stats().timed_out == 2
    del info, awaited, after
    gc.collect()
    await checkpoints(3)
    assert never_retrieved(loop_errors) == []


def test_max_hold_refuses_threads_which_cannot_be_cancelled() -> None:
    ran: list[int] = []
    queue = KeyedQueue(max_hold=1)
    with pytest.raises(TypeError, match=r"^inturn:"):
        queue.run_sync("k", ran.append, 1)
    with pytest.raises(TypeError, match=r"^inturn:"), queue.keyed("k"):
        ran.append(2)

    def plain() -> None:
        ran.append(3)

    with pytest.raises(TypeError, match=r"^inturn:"):
        queue.queue_by_key(key="k")(plain)()  # at decoration or at the call

    other = KeyedQueue()
    with pytest.raises(TypeError, match=r"^inturn:"):
        other.queue_by_key(key="k", max_hold=1)(plain)  # at decoration
    with pytest.raises(TypeError, match=r"^inturn:"), other.keyed("k", max_hold=1):
        ran.append(4)
    assert ran == []
    assert queue.active_count == 0
    assert other.active_count == 0
    assert other.run_sync("k", ran.append, 5) is None  # no max_hold: threads welcome
    assert ran == [5]


# The clocks of one loop and one limit share one timer (``_hold``): these check that each
# turn is still cut at its own deadline, and only it, and that the timer outlives nothing.


async def test_max_hold_on_one_timer_cuts_only_the_work_that_overran(
    loop_errors: list[dict[str, Any]],
) -> None:
    queue = KeyedQueue(max_hold=0.05)
    never = asyncio.Event()
    expected = [str(i) for i in range(20)]
    for _ in range(2):  # the second round after the timer ran out of turns and was left unset
        # Each quick turn starts and ends in one step of this task: surely before its
        # deadline, so a timer that cut a turn that ended would cancel this test.
        before = [await queue.run(f"before{i}", str, i) for i in range(20)]
        late = asyncio.create_task(queue.run("late", never.wait))
        await settle(lambda: queue.is_active("late"))
        after = [await queue.run(f"after{i}", str, i) for i in range(20)]
        with pytest.raises(HoldTimeout, match=r"'late' longer than max_hold=0\.05 s"):
            await late
        assert before == after == expected
        assert not queue.is_active("late")
    assert queue.stats().timed_out == 2
    assert loop_errors == []  # (what a timer's callback raised would be reported there)


def test_max_hold_cuts_each_turn_at_its_own_deadline_on_virtual_time() -> None:
    # A loop whose time() is not time.monotonic(): deadlines are the loop's time, exactly.
    loop = VirtualTimeLoop()
    queue = KeyedQueue(max_hold=1.0)
    never = asyncio.Event()
    cut: dict[str, float] = {}
    ended: dict[str, float] = {}

    async def work(key: str, held: float | None) -> None:
        try:
            await (never.wait() if held is None else asyncio.sleep(held))
        except asyncio.CancelledError:
            cut[key] = loop.time()
            raise
        ended[key] = loop.time()

    async def hold(key: str, start: float, held: float | None, limit: float = 1.0) -> None:
        await asyncio.sleep(start)
        async with queue.keyed(key, max_hold=limit):
            await work(key, held)

    async def main() -> list[BaseException | None]:
        turns = [
            hold("a", 0.0, 0.5),  # ends at 0.5: the head of the timer's line, done by then
            hold("b", 0.25, 0.999),  # ends at 1.249, just before its deadline
            hold("c", 0.5, None),  # overruns: cut at 1.5
            hold("d", 0.75, 2.0),  # overruns too: cut at 1.75
            hold("e", 1.0, 0.9),  # ends at 1.9, before its deadline
            hold("f", 1.0, None, limit=0.25),  # another limit, another timer: cut at 1.25
        ]
        outcomes = await asyncio.gather(*turns, return_exceptions=True)
        assert loop.time() == pytest.approx(1.9)
        await never.wait()  # every turn ended: the loop deadlocks once no timer is left
        return outcomes

    with pytest.raises(Deadlock):
        loop.run_until_complete(main())
    # No timer of ours is left once the last deadline (2.0, "e"'s) has passed.
    assert loop.time() <= 2.0 + 1e-9
    assert cut == pytest.approx({"c": 1.5, "d": 1.75, "f": 1.25})
    assert ended == pytest.approx({"a": 0.5, "b": 1.249, "e": 1.9})
    (main_task,) = asyncio.all_tasks(loop)
    main_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        loop.run_until_complete(main_task)
    loop.close()
    assert queue.stats().timed_out == 3
    assert queue.active_count == 0


def test_max_hold_on_two_loops_in_two_threads_at_once() -> None:
    queue = KeyedQueue(max_hold=0.05)  # one queue, one limit: one timer on each loop
    both = threading.Barrier(2, timeout=PATIENCE)
    results: dict[str, list[str]] = {}
    errors: list[BaseException] = []

    async def main(name: str) -> None:
        never = asyncio.Event()
        late = asyncio.create_task(queue.run(f"{name}-late", never.wait))
        await settle(lambda: queue.is_active(f"{name}-late"))
        # both loops have a clock running; their quick turns now interleave (the GIL)
        await asyncio.get_running_loop().run_in_executor(None, both.wait)
        results[name] = [await queue.run(f"{name}-{i % 7}", str, i) for i in range(2_000)]
        with pytest.raises(HoldTimeout, match=f"'{name}-late'"):
            await late

    def thread(name: str) -> None:
        try:
            # debug: a clock's loop timer touched from the other loop's thread would raise
            asyncio.run(main(name), debug=True)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=thread, args=(name,)) for name in ("one", "two")]
    for each in threads:
        each.start()
    for each in threads:
        each.join(PATIENCE)
    assert errors == []
    assert results == {name: [str(i) for i in range(2_000)] for name in ("one", "two")}
    assert queue.stats().timed_out == 2


def test_max_hold_keeps_no_loop_alive_once_it_ends() -> None:
    # The timer stays set for 60 s past the last turn (a turn costs none of its own), and
    # a turn is still held when asyncio.run() ends: the loop must still go with its tasks.
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def main() -> None:
        queue = KeyedQueue(max_hold=60)
        loops.append(weakref.ref(asyncio.get_running_loop()))
        assert await queue.run("k", str, 1) == "1"
        asyncio.create_task(queue.run("held", asyncio.Event().wait))  # noqa: RUF006 - run() cancels it
        await settle(lambda: queue.is_active("held"))

    asyncio.run(main())
    gc.collect()
    assert loops[0]() is None


# -- stats() -----------------------------------------------------------------------------


async def test_stats_count_every_outcome_exactly() -> None:
    queue = KeyedQueue(max_running=2)
    never, gate = asyncio.Event(), asyncio.Event()
    for i in range(3):
        assert await queue.run(f"ok{i}", lambda: "ok") == "ok"
    for i in range(2):
        with pytest.raises(ValueError, match="bad"):
            await queue.run(f"bad{i}", fail, ValueError("bad"))
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    with pytest.raises(TimeoutError):
        async with queue.keyed("k", timeout=0.01):
            pass
    with pytest.raises(HoldTimeout):
        async with queue.keyed("h", max_hold=0.01):
            await never.wait()
    victim = asyncio.create_task(queue.run("v", never.wait))
    await settle(lambda: queue.stats().running == 2)
    victim.cancel()
    await asyncio.gather(victim, return_exceptions=True)
    gate.set()
    await holder
    stats = queue.stats()
    assert isinstance(stats, inturn.QueueStats)
    assert (stats.completed, stats.failed, stats.timed_out, stats.cancelled) == (4, 2, 2, 1)
    assert (stats.running, stats.waiting_for_slot, dict(stats.waiting)) == (0, 0, {})
    assert isinstance(stats.wait_time, float)
    assert isinstance(stats.hold_time, float)
    assert stats.wait_time >= 0.0
    assert stats.hold_time >= 0.009  # the work that held "h" until max_hold struck


async def test_stats_count_a_work_cancelled_in_line_as_cancelled() -> None:
    queue = KeyedQueue()
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    waiter = asyncio.create_task(queue.run("k", lambda: None))
    await settle(lambda: queue.pending("k") == 1)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    gate.set()
    await holder
    stats = queue.stats()
    assert (stats.completed, stats.failed, stats.timed_out, stats.cancelled) == (1, 0, 0, 1)


async def test_stats_show_what_runs_and_waits_mid_flight() -> None:
    queue = KeyedQueue(max_running=1)
    gate = asyncio.Event()
    tasks = [asyncio.create_task(queue.run("a", gate.wait))]
    await settle(lambda: queue.stats().running == 1)
    tasks.append(asyncio.create_task(queue.run("b", gate.wait)))
    await settle(lambda: slot_waiters(queue) == 1)
    tasks += [asyncio.create_task(queue.run(k, gate.wait)) for k in ("a", "a", "b")]
    await settle(lambda: queue.pending("a") == 2 and queue.pending("b") == 1)
    stats = queue.stats()
    assert stats.running == 1
    assert stats.waiting_for_slot == 1
    assert dict(stats.waiting) == {"a": 2, "b": 1}
    assert stats.completed == 0
    gate.set()
    await asyncio.gather(*tasks)
    # a snapshot: it did not follow the queue
    assert stats.running == 1
    assert dict(stats.waiting) == {"a": 2, "b": 1}
    after = queue.stats()
    assert (after.running, after.waiting_for_slot, dict(after.waiting)) == (0, 0, {})
    assert after.completed == 5


async def test_stats_without_max_running() -> None:
    queue = KeyedQueue()
    gate = asyncio.Event()
    tasks = [asyncio.create_task(queue.run(k, gate.wait)) for k in ("a", "b", "c", "a")]
    await settle(lambda: queue.pending("a") == 1)
    stats = queue.stats()
    assert (stats.running, stats.waiting_for_slot, dict(stats.waiting)) == (3, 0, {"a": 1})
    gate.set()
    await asyncio.gather(*tasks)


async def test_stats_are_a_frozen_snapshot() -> None:
    queue = KeyedQueue()
    gate = asyncio.Event()
    tasks = [asyncio.create_task(queue.run("a", gate.wait)) for _ in range(2)]
    await settle(lambda: queue.pending("a") == 1)
    stats = queue.stats()
    with pytest.raises(AttributeError):
        stats.running = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        stats.waiting["a"] = 5  # type: ignore[index]
    gate.set()
    await asyncio.gather(*tasks)
    assert dict(stats.waiting) == {"a": 1}


# -- settings ----------------------------------------------------------------------------


def test_settings_are_exposed() -> None:
    queue = KeyedQueue()
    assert (queue.max_running, queue.concurrency, queue.max_hold) == (None, 1, None)
    queue = KeyedQueue(max_running=4, concurrency=2, max_hold=1.5)
    assert (queue.max_running, queue.concurrency, queue.max_hold) == (4, 2, 1.5)


@pytest.mark.parametrize(
    ("setting", "value", "error"),
    [
        ("max_running", 0, ValueError),
        ("max_running", -1, ValueError),
        ("max_running", 1.5, TypeError),
        ("max_running", True, TypeError),
        ("max_running", "2", TypeError),
        ("concurrency", 0, ValueError),
        ("concurrency", -2, ValueError),
        ("concurrency", 2.0, TypeError),
        ("concurrency", True, TypeError),
        ("concurrency", None, TypeError),
        ("max_hold", 0, ValueError),
        ("max_hold", -0.5, ValueError),
        ("max_hold", math.nan, ValueError),
        ("max_hold", True, TypeError),
        ("max_hold", "1", TypeError),
    ],
)
def test_bad_settings_are_refused_at_construction(
    setting: str, value: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match=rf"^inturn:.*{setting}"):
        KeyedQueue(**{setting: value})


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-1, ValueError), (True, TypeError)])
def test_bad_max_hold_of_a_call_is_refused(value: Any, error: type[Exception]) -> None:
    queue = KeyedQueue()
    with pytest.raises(error, match=r"^inturn:.*max_hold"):
        queue.keyed("k", max_hold=value)
    with pytest.raises(error, match=r"^inturn:.*max_hold"):
        queue.queue_by_key(key="k", max_hold=value)


def test_concurrency_above_one_with_a_backend_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^inturn:.*concurrency"):
        KeyedQueue(concurrency=2, backend=FileBackend(tmp_path / "lines"))
    assert KeyedQueue(concurrency=1, backend=FileBackend(tmp_path / "lines")).concurrency == 1


async def test_a_newcomer_never_starts_ahead_of_a_waiter_handed_a_place() -> None:
    # Two places on "k": a (this task) and b hold them, c waits. b leaves (c is
    # handed its place but not yet woken), then a leaves in the next step, and a
    # newcomer comes in that same step: a place is free, but c was first.
    queue = KeyedQueue(concurrency=2)
    started: list[str] = []
    release = asyncio.Event()

    async def holder_b() -> None:
        async with queue.keyed("k"):
            started.append("b")
            await release.wait()

    async def waiter_c() -> None:
        async with queue.keyed("k"):
            started.append("c")

    async with queue.keyed("k"):
        started.append("a")
        b = asyncio.create_task(holder_b())
        await settle(lambda: "b" in started)
        c = asyncio.create_task(waiter_c())
        await settle(lambda: queue.pending("k") == 1)
        asyncio.get_running_loop().call_soon(release.set)
        await release.wait()  # woken just after b: b has left, c is not awake yet
    async with queue.keyed("k"):
        started.append("newcomer")
    await asyncio.gather(b, c)
    assert started == ["a", "b", "c", "newcomer"]
