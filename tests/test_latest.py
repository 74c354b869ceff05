"""Latest wins: pending="latest" (a key's waiting work replaced by newer work), and debounce.

Driven by events and loop rounds; the debounce on a virtual clock.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest

from inturn import InturnError, KeyedQueue, QueueFull, Superseded

from support.helpers import PATIENCE, checkpoints, settle, wait_until
from support.own_thread import OwnThreadTimers
from support.virtual_time import run_virtual


class Busy:
    """A work that holds its key until released, recording every work that runs."""

    def __init__(self) -> None:
        self.ran: list[Any] = []
        self.gate = asyncio.Event()

    def work(self, name: Any) -> Callable[[], Any]:
        async def run() -> Any:
            self.ran.append(name)
            if name == "holder":
                await self.gate.wait()
            await checkpoints()
            return name

        return run


class ThreadBusy:
    """A plain work for threads: it holds its key until released; records every work that runs."""

    def __init__(self) -> None:
        self.ran: list[Any] = []
        self.held, self.release = threading.Event(), threading.Event()

    def work(self, name: Any) -> Any:
        self.ran.append(name)
        if name == "holder":
            self.held.set()
            self.release.wait(PATIENCE)
        return name

    def holding(self, call: Callable[[], Any]) -> threading.Thread:
        """A thread that makes call (the holder's), started once its work holds the key."""
        thread = threading.Thread(target=call)
        thread.start()
        assert self.held.wait(PATIENCE)
        return thread


def one_by_one(
    queue: KeyedQueue, call: Callable[[int], Any], n: int
) -> tuple[list[threading.Thread], dict[int, Any]]:
    """n threads making call(i), each started once the one before waits for key k; and their
    outcomes."""
    outcomes: dict[int, Any] = {}
    callers = []
    for i in range(n):
        caller = threading.Thread(target=lambda i=i: outcomes.__setitem__(i, call(i)))
        caller.start()
        callers.append(caller)
        wait_until(lambda i=i: queue.pending("k") == i + 1, f"caller {i} waits")
    return callers, outcomes


class Missed(list[BaseException]):
    """An observer that keeps the error of each turn that never started."""

    def started(self, waited: float, function: str | None) -> None:
        pass

    def ended(self, held: Any, error: Any, cut: bool, function: str | None) -> None:
        pass

    def missed(self, error: BaseException, function: str | None) -> None:
        self.append(error)


async def hold(queue: KeyedQueue, busy: Busy, key: str = "k") -> asyncio.Task[Any]:
    """A task that holds key (until busy.gate is set)."""
    task = asyncio.create_task(queue.run(key, busy.work("holder")))
    await settle(lambda: busy.ran == ["holder"])
    return task


# -- a burst while the key is busy -------------------------------------------------------


@pytest.mark.parametrize("n", [2, 10, 200])
async def test_a_burst_while_the_key_is_busy_runs_the_running_work_and_the_latest(n: int) -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    holder = await hold(queue, busy)
    burst = [asyncio.create_task(queue.run("k", busy.work(i))) for i in range(n)]
    await settle(lambda: queue.pending("k") == n)
    busy.gate.set()
    answers = await asyncio.gather(*burst)
    assert await holder == "holder"
    assert busy.ran == ["holder", n - 1]
    assert answers == [n - 1] * n  # every caller: the newer work's outcome (join)
    stats = queue.stats()
    assert stats.superseded == n - 1
    assert stats.completed == 2
    assert not queue.is_active("k")
    assert queue.pending("k") == 0


async def test_a_free_key_runs_at_once() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    assert await queue.run("k", busy.work(1)) == 1
    assert await queue.run("k", busy.work(2)) == 2
    assert busy.ran == [1, 2]
    assert queue.stats().superseded == 0


async def test_raise_answers_a_replaced_caller_at_once_with_superseded() -> None:
    queue = KeyedQueue(pending="latest", on_superseded="raise")
    busy = Busy()
    holder = await hold(queue, busy)
    first = asyncio.create_task(queue.run("k", busy.work(1)))
    await settle(lambda: queue.pending("k") == 1)
    second = asyncio.create_task(queue.run("k", busy.work(2)))
    await settle(first.done)  # answered while the key is still held
    with pytest.raises(Superseded, match="newer work for key 'k' took this work's place"):
        first.result()
    assert isinstance(first.exception(), InturnError)
    assert queue.pending("k") == 1
    busy.gate.set()
    assert await second == 2
    await holder
    assert busy.ran == ["holder", 2]
    assert queue.stats().superseded == 1


async def test_the_running_work_is_never_interrupted() -> None:
    queue = KeyedQueue(pending="latest", on_superseded="raise")
    busy = Busy()
    holder = await hold(queue, busy)
    newer = [asyncio.create_task(queue.run("k", busy.work(i))) for i in range(5)]
    await settle(lambda: sum(t.done() for t in newer) == 4)
    assert not holder.done()
    busy.gate.set()
    assert await holder == "holder"
    outcomes = await asyncio.gather(*newer, return_exceptions=True)
    assert [type(outcome) for outcome in outcomes[:4]] == [Superseded] * 4
    assert outcomes[4] == 4


async def test_errors_of_the_newer_work_reach_the_callers_it_replaced() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    holder = await hold(queue, busy)

    async def fails() -> None:
        raise LookupError("the manifest is gone")

    replaced = asyncio.create_task(queue.run("k", busy.work(1)))
    await settle(lambda: queue.pending("k") == 1)
    newer = asyncio.create_task(queue.run("k", fails))
    await settle(lambda: queue.pending("k") == 2)
    busy.gate.set()
    await holder
    for caller in (replaced, newer):
        with pytest.raises(LookupError, match="the manifest is gone"):
            await caller
    assert busy.ran == ["holder"]
    assert queue.stats().failed == 1  # one turn ran and failed; the other never ran


async def test_other_keys_keep_their_fifo() -> None:
    queue = KeyedQueue()
    busy = Busy()
    latest_of = queue.queue_by_key(key="a", pending="latest")
    holder = await hold(queue, busy, "a")
    others = [asyncio.create_task(queue.run("b", busy.work(f"b{i}"))) for i in range(5)]
    latest = [asyncio.create_task(latest_of(busy.work(f"a{i}"))()) for i in range(3)]
    assert await asyncio.gather(*others) == [f"b{i}" for i in range(5)]
    assert [name for name in busy.ran if str(name).startswith("b")] == [f"b{i}" for i in range(5)]
    busy.gate.set()
    await asyncio.gather(holder, *latest)
    assert [name for name in busy.ran if str(name).startswith("a")] == ["a2"]


async def test_a_keyed_block_is_never_replaced_and_the_newer_work_takes_the_older_place() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    holder = await hold(queue, busy)
    older = asyncio.create_task(queue.run("k", busy.work("older")))
    await settle(lambda: queue.pending("k") == 1)

    async def block() -> None:
        async with queue.keyed("k"):
            busy.ran.append("block")

    blocked = asyncio.create_task(block())
    await settle(lambda: queue.pending("k") == 2)
    newer = asyncio.create_task(queue.run("k", busy.work("newer")))
    await settle(lambda: queue.pending("k") == 3)
    busy.gate.set()
    await asyncio.gather(holder, older, blocked, newer)
    assert busy.ran == ["holder", "newer", "block"]
    assert older.result() == "newer"


async def test_a_holder_calling_again_runs_at_once() -> None:
    queue = KeyedQueue(pending="latest")
    ran = []

    async def outer() -> str:
        ran.append("outer")
        return str(await queue.run("k", inner))

    async def inner() -> str:
        ran.append("inner")
        return "inner"

    assert await queue.run("k", outer) == "inner"
    assert ran == ["outer", "inner"]


# -- cancellation and timeouts -------------------------------------------------------------


@pytest.mark.parametrize(
    ("cancelled", "runs"),
    [
        ("replaced", 2),  # the newer work is left alone
        ("newer", 1),  # the work it replaced is back in its place
    ],
)
async def test_cancelling_a_waiting_caller(cancelled: str, runs: int) -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    holder = await hold(queue, busy)
    callers = {
        "replaced": asyncio.create_task(queue.run("k", busy.work(1))),
        "newer": asyncio.create_task(queue.run("k", busy.work(2))),
    }
    await settle(lambda: queue.pending("k") == 2)
    callers[cancelled].cancel()
    await settle(lambda: queue.pending("k") == 1)
    busy.gate.set()
    left = callers["newer" if cancelled == "replaced" else "replaced"]
    assert await left == runs
    await holder
    assert callers[cancelled].cancelled()
    assert busy.ran == ["holder", runs]
    assert queue.stats().cancelled == 1


async def test_cancelling_the_latest_after_raise_leaves_the_line_empty() -> None:
    queue = KeyedQueue(pending="latest", on_superseded="raise")
    busy = Busy()
    holder = await hold(queue, busy)
    replaced = asyncio.create_task(queue.run("k", busy.work(1)))
    await settle(lambda: queue.pending("k") == 1)
    newer = asyncio.create_task(queue.run("k", busy.work(2)))
    await settle(replaced.done)
    newer.cancel()
    await settle(lambda: queue.pending("k") == 0)
    busy.gate.set()
    await holder
    assert isinstance(replaced.exception(), Superseded)
    assert newer.cancelled()
    assert busy.ran == ["holder"]
    assert not queue.is_active("k")


async def test_cancelling_the_running_latest_work_runs_the_newest_it_replaced() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    holder = await hold(queue, busy)
    started = asyncio.Event()

    async def long() -> str:
        busy.ran.append("long")
        started.set()
        await asyncio.Event().wait()
        return "never"

    replaced = [asyncio.create_task(queue.run("k", busy.work(i))) for i in range(3)]
    newest = asyncio.create_task(queue.run("k", long))
    await settle(lambda: queue.pending("k") == 4)
    busy.gate.set()
    await started.wait()
    newest.cancel()
    assert await asyncio.gather(*replaced) == [2, 2, 2]
    await holder
    assert newest.cancelled()
    assert busy.ran == ["holder", "long", 2]
    assert not queue.is_active("k")


def test_a_replaced_callers_timeout_counts_from_its_own_call() -> None:
    async def scenario() -> None:
        queue = KeyedQueue(pending="latest", timeout=5.0)
        busy = Busy()
        holder = asyncio.create_task(queue.run("k", busy.work("holder")))
        await settle(lambda: busy.ran == ["holder"])
        loop = asyncio.get_running_loop()
        start = loop.time()
        old = asyncio.create_task(queue.run("k", busy.work("old")))
        await settle(lambda: queue.pending("k") == 1)
        await asyncio.sleep(3)
        new = asyncio.create_task(queue.run("k", busy.work("new")))
        await settle(lambda: queue.pending("k") == 2)
        with pytest.raises(TimeoutError, match="within 5 s"):
            await old
        assert loop.time() - start == pytest.approx(5.0)  # not 8: from its own call
        assert queue.pending("k") == 1
        busy.gate.set()
        assert await new == "new"
        await holder
        assert busy.ran == ["holder", "new"]
        assert queue.stats().timed_out == 1

    run_virtual(scenario())


def test_the_latest_timing_out_puts_the_older_work_back() -> None:
    async def scenario() -> None:
        queue = KeyedQueue(pending="latest")
        busy = Busy()
        holder = await hold(queue, busy)
        older = asyncio.create_task(queue.run("k", busy.work("older")))
        await settle(lambda: queue.pending("k") == 1)
        hurried = queue.queue_by_key(key="k", timeout=1.0)(busy.work("newer"))
        with pytest.raises(TimeoutError):
            await hurried()
        assert queue.pending("k") == 1
        busy.gate.set()
        assert await older == "older"
        await holder
        assert busy.ran == ["holder", "older"]

    run_virtual(scenario())


async def test_timeout_zero_never_waits_and_replaces_nothing() -> None:
    queue = KeyedQueue(pending="latest", on_superseded="raise")
    busy = Busy()
    holder = await hold(queue, busy)
    waiting = asyncio.create_task(queue.run("k", busy.work(1)))
    await settle(lambda: queue.pending("k") == 1)
    with pytest.raises(TimeoutError):
        async with queue.keyed("k", timeout=0):
            pass
    assert not waiting.done()
    busy.gate.set()
    assert await waiting == 1
    await holder


async def test_max_pending_counts_the_latest_once() -> None:
    queue = KeyedQueue(pending="latest", max_pending=1)
    busy = Busy()
    holder = await hold(queue, busy)
    burst = [asyncio.create_task(queue.run("k", busy.work(i))) for i in range(5)]
    await settle(lambda: queue.pending("k") == 5)

    async def block() -> None:
        async with queue.keyed("k"):
            pass

    with pytest.raises(QueueFull):
        await block()
    busy.gate.set()
    assert await asyncio.gather(*burst) == [4] * 5
    await holder


# -- submit, batch, drain ----------------------------------------------------------------------


async def test_a_burst_of_submissions_runs_two_and_answers_every_handle() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    first = await queue.submit("k", busy.work("holder"))
    await settle(lambda: busy.ran == ["holder"])
    handles = [await queue.submit("k", busy.work(i)) for i in range(100)]
    assert queue.pending("k") == 100
    busy.gate.set()
    assert await first == "holder"
    assert [await handle for handle in handles] == [99] * 100
    assert busy.ran == ["holder", 99]
    assert queue.stats().superseded == 99
    await queue.drain(raise_errors=True)
    assert not queue.is_active("k")


async def test_raise_fails_replaced_handles_without_failing_the_batch() -> None:
    queue = KeyedQueue(pending="latest", on_superseded="raise")
    busy = Busy()
    async with queue.batch() as batch:
        await batch.submit("k", busy.work("holder"))
        await settle(lambda: busy.ran == ["holder"])
        handles = [await batch.submit("k", busy.work(i)) for i in range(3)]
        await settle(lambda: sum(h.done() for h in handles) == 2)
        busy.gate.set()
    assert [type(h.exception()) for h in handles[:2]] == [Superseded, Superseded]
    assert handles[2].result() == 2
    assert busy.ran == ["holder", 2]


async def test_a_replaced_handle_follows_the_newer_work_even_when_it_is_cancelled() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    first = await queue.submit("k", busy.work("holder"))
    await settle(lambda: busy.ran == ["holder"])
    older = await queue.submit("k", busy.work("older"))
    newer = await queue.submit("k", busy.work("newer"))
    assert newer.cancel()
    await checkpoints()
    assert older.cancelled()  # it let its work go when it was replaced
    assert not queue.pending("k")
    busy.gate.set()
    await first
    assert busy.ran == ["holder"]


async def test_replaced_handles_nobody_holds_cost_the_key_nothing() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    first = await queue.submit("k", busy.work("holder"))
    await settle(lambda: busy.ran == ["holder"])
    for i in range(50):
        await queue.submit("k", busy.work(i))  # (each handle dropped at once)
    gc.collect()
    assert queue.pending("k") == 1  # the newest only: the replaced ones are gone
    busy.gate.set()
    await first
    await queue.drain()
    assert busy.ran == ["holder", 49]


def test_a_replaced_handle_times_out_from_its_own_submission() -> None:
    async def scenario() -> None:
        queue = KeyedQueue(pending="latest", timeout=5.0)
        busy = Busy()
        first = await queue.submit("k", asyncio.Event().wait)
        await checkpoints()  # (it runs: a work not started yet would be replaced too)
        old = await queue.submit("k", busy.work("old"))
        await asyncio.sleep(3)
        new = await queue.submit("k", busy.work("new"))
        with pytest.raises(TimeoutError):
            await old
        with pytest.raises(TimeoutError):
            await new
        assert first.cancel()
        await checkpoints()
        stats = queue.stats()
        assert (stats.timed_out, stats.superseded) == (1, 1)  # each work counted once
        assert busy.ran == []

    run_virtual(scenario())


async def test_drain_waits_for_the_latest() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    holder = await hold(queue, busy)
    burst = [asyncio.create_task(queue.run("k", busy.work(i))) for i in range(3)]
    await settle(lambda: queue.pending("k") == 3)
    drained = asyncio.create_task(queue.drain())
    await checkpoints(3)
    assert not drained.done()
    busy.gate.set()
    await drained
    assert busy.ran == ["holder", 2]
    await asyncio.gather(holder, *burst)


# -- debounce ------------------------------------------------------------------------------------


def test_debounce_runs_the_latest_once_the_key_is_quiet() -> None:
    async def scenario() -> None:
        queue = KeyedQueue(debounce=1.0)
        loop = asyncio.get_running_loop()
        ran: list[tuple[int, float]] = []

        async def sync(version: int) -> int:
            ran.append((version, loop.time()))
            return version

        calls = []
        for version in range(5):
            calls.append(asyncio.create_task(queue.run("k", sync, version)))
            await asyncio.sleep(0.5)  # newer work within the quiet period
        assert await asyncio.gather(*calls) == [4] * 5
        assert ran == [(4, pytest.approx(3.0))]  # 1 s after the last, at 2.0 s
        assert queue.stats().superseded == 4

    run_virtual(scenario())


def test_max_wait_bounds_a_key_that_never_goes_quiet() -> None:
    async def scenario() -> None:
        queue = KeyedQueue(debounce=1.0, max_wait=3.0)
        loop = asyncio.get_running_loop()
        ran: list[tuple[int, float]] = []

        async def sync(version: int) -> int:
            ran.append((version, loop.time()))
            return version

        calls = []
        for version in range(10):  # one every 0.4 s: never 1 s of quiet
            calls.append(asyncio.create_task(queue.run("k", sync, version)))
            await asyncio.sleep(0.4)
        await asyncio.gather(*calls)
        assert ran[0] == (7, pytest.approx(3.0))  # the latest at max_wait (7 came at 2.8 s)
        assert ran[1:] == [(9, pytest.approx(4.6))]  # then 1 s after the last (3.6 s)

    run_virtual(scenario())


def test_drain_ends_the_quiet_period() -> None:
    async def scenario() -> None:
        queue = KeyedQueue(debounce=100.0)
        ran = []

        async def sync(version: int) -> None:
            ran.append(version)

        calls = [asyncio.create_task(queue.run("k", sync, v)) for v in range(3)]
        await checkpoints()
        await queue.drain()
        assert ran == [2]
        assert asyncio.get_running_loop().time() == 0.0
        await asyncio.gather(*calls)

    run_virtual(scenario())


def test_a_debounced_key_that_is_busy_waits_behind_its_holder() -> None:
    async def scenario() -> None:
        queue = KeyedQueue(debounce=1.0)
        busy = Busy()
        holder = await hold(queue, busy)
        calls = [asyncio.create_task(queue.run("k", busy.work(i))) for i in range(3)]
        await asyncio.sleep(10)
        assert busy.ran == ["holder"]
        busy.gate.set()
        assert await asyncio.gather(*calls) == [2, 2, 2]
        await holder
        assert busy.ran == ["holder", 2]

    run_virtual(scenario())


# -- threads, and threads with tasks ---------------------------------------------------


def test_threads_joined_get_the_latest_outcome() -> None:
    queue = KeyedQueue(pending="latest")
    busy = ThreadBusy()
    holder = busy.holding(lambda: queue.run_sync("k", busy.work, "holder"))
    callers, outcomes = one_by_one(queue, lambda i: queue.run_sync("k", busy.work, i), 5)
    busy.release.set()
    for thread in (holder, *callers):
        thread.join(PATIENCE)
    assert busy.ran == ["holder", 4]
    assert outcomes == dict.fromkeys(range(5), 4)
    assert not queue.is_active("k")


def test_a_thread_timing_out_leaves_the_latest_to_the_older() -> None:
    queue = KeyedQueue(pending="latest")
    busy = ThreadBusy()
    holder = busy.holding(lambda: queue.run_sync("k", busy.work, "holder"))
    outcomes: dict[str, Any] = {}
    older = threading.Thread(
        target=lambda: outcomes.__setitem__("older", queue.run_sync("k", busy.work, "older"))
    )
    older.start()
    wait_until(lambda: queue.pending("k") == 1, "the older waits")
    short = queue.queue_by_key(key="k", timeout=0.05)(busy.work)
    with pytest.raises(TimeoutError):
        short("newer")
    busy.release.set()
    holder.join(PATIENCE)
    older.join(PATIENCE)
    assert busy.ran == ["holder", "older"]
    assert outcomes == {"older": "older"}


async def test_tasks_and_threads_share_the_latest() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    holder = await hold(queue, busy)
    task = asyncio.create_task(queue.run("k", busy.work("task")))
    await settle(lambda: queue.pending("k") == 1)

    def thread_work() -> str:
        busy.ran.append("thread")
        return "thread"

    thread = asyncio.create_task(asyncio.to_thread(queue.run_sync, "k", thread_work))
    await settle(lambda: queue.pending("k") == 2)
    busy.gate.set()
    assert await asyncio.gather(task, thread) == ["thread", "thread"]
    await holder
    assert busy.ran == ["holder", "thread"]


def test_a_thread_debounce() -> None:
    queue = KeyedQueue(debounce=0.05)
    ran = []

    def work(version: int) -> int:
        ran.append(version)
        return version

    outcomes: dict[int, int] = {}
    callers = []
    for version in range(3):
        caller = threading.Thread(
            target=lambda v=version: outcomes.__setitem__(v, queue.run_sync("k", work, v))
        )
        caller.start()
        callers.append(caller)
        wait_until(lambda v=version: queue.pending("k") == v + 1 or ran, "the caller waits")
    for caller in callers:
        caller.join(PATIENCE)
    # quiet periods may end between two callers on a loaded machine: each run is the newest
    assert ran[-1] == 2
    assert outcomes[2] == 2
    assert sorted(ran) == ran


def test_a_thread_that_ends_a_quiet_period_leaves_a_tasks_loop_timer_alone() -> None:
    """A task's call sets its loop's timer for the key's quiet period. A thread that
    ends the period itself (its own end came while the loop was busy) takes the key
    without touching that timer, which then goes off and finds nothing to do."""
    queue = KeyedQueue(debounce=0.05)
    loop = OwnThreadTimers()
    ran = threading.Event()
    outcomes: dict[str, Any] = {}

    def thread_work() -> str:
        ran.set()
        return "thread"

    async def task_work() -> str:
        return "task"

    async def scenario() -> None:
        task = asyncio.create_task(queue.run("k", task_work))
        await settle(lambda: queue.pending("k") == 1)
        caller = threading.Thread(
            target=lambda: outcomes.__setitem__("thread", queue.run_sync("k", thread_work))
        )
        caller.start()
        await settle(lambda: queue.pending("k") == 2)
        assert ran.wait(PATIENCE)  # (the loop blocked: only the thread can end the period)
        assert await task == "thread"
        caller.join(PATIENCE)

    loop.run(scenario())
    assert outcomes == {"thread": "thread"}
    assert loop.foreign == []


def test_a_thread_whose_quiet_period_moved_leaves_a_tasks_loop_timer_alone() -> None:
    """A thread whose quiet period's end came, but moved with a newer call that did not
    wake it, waits on; the tasks' loop timer moves itself, on its loop (the thread sets
    none there)."""
    queue = KeyedQueue(debounce=0.5)
    loop = OwnThreadTimers()
    ran: list[str] = []
    outcomes: dict[str, Any] = {}

    def work(name: str) -> Callable[[], Any]:
        async def run() -> str:
            ran.append(name)
            return name

        return run

    async def scenario() -> None:
        first = asyncio.create_task(queue.run("k", work("first")))
        await settle(lambda: queue.pending("k") == 1)
        caller = threading.Thread(
            target=lambda: outcomes.__setitem__("thread", queue.run_sync("k", ran.append, "thread"))
        )
        caller.start()
        await settle(lambda: queue.pending("k") == 2)
        middle = asyncio.create_task(queue.run("k", work("middle")))  # (wakes the thread)
        await settle(lambda: queue.pending("k") == 3)
        last = asyncio.create_task(queue.run("k", work("last")))  # (its end moves: no wake)
        assert await asyncio.gather(first, middle, last) == ["last"] * 3
        caller.join(PATIENCE)

    loop.run(scenario())
    assert ran == ["last"]  # (one quiet period: the newer call came within the thread's)
    assert outcomes == {"thread": "last"}
    assert loop.foreign == []


# -- the decorator, settings, and what is counted -----------------------------------------------


async def test_a_decorated_function_conflates_by_its_own_setting() -> None:
    queue = KeyedQueue()
    busy = Busy()
    synced: list[int] = []

    @queue.queue_by_key(key="manifest-{server}", pending="latest", on_superseded="raise")
    async def sync(server: str, version: int) -> int:
        synced.append(version)
        if version == 0:
            await busy.gate.wait()
        return version

    first = asyncio.create_task(sync("a", 0))
    await settle(lambda: synced == [0])
    burst = [asyncio.create_task(sync("a", v)) for v in range(1, 4)]
    await settle(lambda: sum(t.done() for t in burst) == 2)
    busy.gate.set()
    assert await first == 0
    assert await burst[-1] == 3
    assert synced == [0, 3]
    assert [type(t.exception()) for t in burst[:2]] == [Superseded, Superseded]


async def test_a_decorator_can_turn_a_latest_queue_back_to_all() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()

    @queue.queue_by_key(key="k", pending="all")
    async def each(version: int) -> int:
        busy.ran.append(version)
        return version

    holder = await hold(queue, busy)
    calls = [asyncio.create_task(each(v)) for v in range(3)]
    await settle(lambda: queue.pending("k") == 3)
    busy.gate.set()
    assert await asyncio.gather(*calls) == [0, 1, 2]
    await holder


def test_a_decorated_plain_def_conflates() -> None:
    queue = KeyedQueue()
    busy = ThreadBusy()

    @queue.queue_by_key(key="k", pending="latest")
    def write(name: Any) -> Any:
        return busy.work(name)

    holder = busy.holding(lambda: write("holder"))
    callers, outcomes = one_by_one(queue, write, 3)
    busy.release.set()
    for thread in (holder, *callers):
        thread.join(PATIENCE)
    assert busy.ran == ["holder", 2]
    assert outcomes == dict.fromkeys(range(3), 2)


@pytest.mark.parametrize(
    ("settings", "error", "match"),
    [
        ({"pending": "newest"}, ValueError, 'pending must be "all" or "latest"'),
        ({"on_superseded": "drop"}, ValueError, 'on_superseded must be "join" or "raise"'),
        ({"debounce": 0}, ValueError, "debounce must be > 0"),
        ({"debounce": "1s"}, TypeError, "debounce must be a number of seconds"),
        ({"max_wait": 1.0}, ValueError, "max_wait bounds a debounce"),
        ({"debounce": 2.0, "max_wait": 1.0}, ValueError, "must be at least debounce"),
        ({"pending": "latest", "concurrency": 2}, ValueError, "concurrency=2"),
    ],
)
def test_wrong_settings_are_named_at_once(
    settings: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        KeyedQueue(**settings)


def test_a_decorator_refuses_settings_that_cannot_combine() -> None:
    queue = KeyedQueue()
    with pytest.raises(TypeError, match="coalesce=True joins a call in flight"):
        queue.queue_by_key(key="k", pending="latest", coalesce=True)
    with pytest.raises(TypeError, match="a keys= function takes several keys"):
        queue.queue_by_key(keys=["a", "b"], debounce=1.0)
    with pytest.raises(ValueError, match='pending must be "all" or "latest"'):
        queue.queue_by_key(key="k", pending="last")  # type: ignore[arg-type]


async def test_several_keys_on_a_latest_queue_wait_as_keyed_does() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()

    @queue.queue_by_key(keys=["k", "other"])
    async def both(version: int) -> int:
        busy.ran.append(version)
        return version

    holder = await hold(queue, busy)
    calls = [asyncio.create_task(both(v)) for v in range(3)]
    # (the keys are taken in the queue's one order: "other" may come first)
    await settle(lambda: queue.pending("k") + queue.pending("other") == 3)
    busy.gate.set()
    assert await asyncio.gather(*calls) == [0, 1, 2]
    await holder


async def test_the_observer_hears_of_each_replaced_work() -> None:
    queue = KeyedQueue(pending="latest", on_superseded="raise")
    heard = Missed()
    queue.observe(heard)
    busy = Busy()
    holder = await hold(queue, busy)
    calls = [asyncio.create_task(queue.run("k", busy.work(i))) for i in range(4)]
    await settle(lambda: sum(t.done() for t in calls) == 3)
    busy.gate.set()
    await asyncio.gather(holder, *calls, return_exceptions=True)
    assert [type(error) for error in heard] == [Superseded] * 3
    assert queue.stats().superseded == 3


async def test_max_running_with_latest() -> None:
    queue = KeyedQueue(pending="latest", max_running=1)
    busy = Busy()
    holder = await hold(queue, busy)
    burst = [asyncio.create_task(queue.run("k", busy.work(i))) for i in range(5)]
    other = asyncio.create_task(queue.run("o", busy.work("other")))
    await settle(lambda: queue.pending("k") == 5)
    busy.gate.set()
    assert await asyncio.gather(*burst) == [4] * 5
    await asyncio.gather(holder, other)
    assert sorted(map(str, busy.ran)) == sorted(["holder", "4", "other"])
    assert queue.stats().running == 0


def test_a_decorator_on_a_queue_of_several_holders_cannot_conflate() -> None:
    queue = KeyedQueue(concurrency=2)
    with pytest.raises(ValueError, match="concurrency=2"):
        queue.queue_by_key(key="k", pending="latest")


async def test_a_latest_refused_by_max_pending_is_reported() -> None:
    queue = KeyedQueue(pending="latest", max_pending=0)
    heard = Missed()
    queue.observe(heard)
    busy = Busy()
    holder = await hold(queue, busy)
    with pytest.raises(QueueFull):
        await queue.run("k", busy.work(1))
    busy.gate.set()
    await holder
    assert busy.ran == ["holder"]
    assert [type(error) for error in heard] == [QueueFull]
    assert not queue.is_active("k")


def test_close_lets_work_being_debounced_run() -> None:
    async def scenario() -> None:
        queue = KeyedQueue(debounce=100.0)
        ran = []

        async def sync(version: int) -> int:
            ran.append(version)
            return version

        calls = [asyncio.create_task(queue.run("k", sync, v)) for v in range(3)]
        await checkpoints()
        await queue.aclose()  # closes, then drains: the quiet period ends at once
        assert await asyncio.gather(*calls) == [2, 2, 2]
        assert ran == [2]
        assert asyncio.get_running_loop().time() == 0.0

    run_virtual(scenario())


def test_a_thread_that_joined_the_running_work_waits_past_its_timeout() -> None:
    queue = KeyedQueue(pending="latest")
    entered = {"holder": threading.Event(), "newer": threading.Event()}
    release = {"holder": threading.Event(), "newer": threading.Event()}
    ran: list[Any] = []

    def work(name: str) -> str:
        ran.append(name)
        entered[name].set()
        release[name].wait(PATIENCE)
        return name

    holder = threading.Thread(target=queue.run_sync, args=("k", work, "holder"))
    holder.start()
    assert entered["holder"].wait(PATIENCE)
    outcomes: dict[str, Any] = {}
    hurried = queue.queue_by_key(key="k", timeout=2.0)(work)
    older = threading.Thread(target=lambda: outcomes.__setitem__("older", hurried("older")))
    older.start()
    wait_until(lambda: queue.pending("k") == 1, "the older waits")
    newer = threading.Thread(
        target=lambda: outcomes.__setitem__("newer", queue.run_sync("k", work, "newer"))
    )
    newer.start()
    wait_until(lambda: queue.pending("k") == 2, "the newer waits")
    release["holder"].set()  # the newer runs in the older's place, well within its 2 s
    assert entered["newer"].wait(PATIENCE)
    older.join(2.5)  # the older's timeout passes: it follows the newer's run, and waits on
    assert older.is_alive()
    release["newer"].set()
    for thread in (holder, older, newer):
        thread.join(PATIENCE)
    assert outcomes == {"older": "newer", "newer": "newer"}
    assert ran == ["holder", "newer"]


def test_a_thread_that_times_out_never_has_its_work_run_by_an_older_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A thread's timeout that finds its work still waiting takes the work out of the line in
    the same hold of the guard: an older turn starting just after (here: handed the one
    running slot) runs its own work, never the work whose caller got TimeoutError.

    The thread is held between its timeout and the rest of its clean-up (Book.gave_up),
    the window where, before, the older turn took its work.
    """
    from inturn._latest import Book

    queue = KeyedQueue(pending="latest", max_running=1)
    busy = ThreadBusy()
    slot = busy.holding(lambda: queue.run_sync("other", busy.work, "holder"))
    outcomes: dict[str, Any] = {}

    def call(name: str, timeout: float | None = None) -> threading.Thread:
        def run() -> None:
            try:
                outcomes[name] = queue.queue_by_key(key="k", timeout=timeout)(busy.work)(name)
            except BaseException as error:  # (the outcome is checked below)
                outcomes[name] = error

        thread = threading.Thread(target=run, name=name)
        thread.start()
        return thread

    older = call("older")  # takes k at once, and waits for the slot
    wait_until(lambda: queue.stats().waiting_for_slot == 1, "the older waits for the slot")
    quitting, go_on = threading.Event(), threading.Event()
    gave_up = Book.gave_up

    def held_back(book: Book, ticket: Any, error: BaseException) -> bool:
        if threading.current_thread().name == "newer":
            quitting.set()
            go_on.wait(PATIENCE)
        return gave_up(book, ticket, error)

    monkeypatch.setattr(Book, "gave_up", held_back)
    newer = call("newer", timeout=0.2)  # waits behind the older's turn, and times out
    assert quitting.wait(PATIENCE), "the newer caller did not time out"
    busy.release.set()  # the slot frees: the older's turn starts
    older.join(PATIENCE)
    go_on.set()
    for thread in (newer, slot):
        thread.join(PATIENCE)
    assert isinstance(outcomes["newer"], TimeoutError)
    assert busy.ran == ["holder", "older"], "the newer's work ran though its caller timed out"
    assert outcomes["older"] == "older"
    assert not queue.is_active("k")


# -- work that holds its key but has not started is replaced too -------------------------------


async def slot_taken(queue: KeyedQueue, busy: Busy) -> asyncio.Task[Any]:
    """A task that holds the queue's one running slot, on another key (until busy.gate)."""
    return await hold(queue, busy, "other")


@pytest.mark.parametrize("on_superseded", ["join", "raise"])
async def test_a_turn_waiting_for_a_slot_runs_the_newer_work_instead(on_superseded: str) -> None:
    queue = KeyedQueue(pending="latest", on_superseded=on_superseded, max_running=1)  # type: ignore[arg-type]
    busy = Busy()
    holder = await slot_taken(queue, busy)
    first = asyncio.create_task(
        queue.run("k", busy.work(0))
    )  # its key is free: it waits for a slot
    await settle(lambda: queue.stats().waiting_for_slot == 1)
    newer = [asyncio.create_task(queue.run("k", busy.work(i))) for i in range(1, 5)]
    await settle(lambda: queue.pending("k") + sum(t.done() for t in newer) == 4)
    busy.gate.set()
    outcomes = await asyncio.gather(first, *newer, return_exceptions=True)
    await holder
    assert busy.ran == ["holder", 4]  # the first's turn ran the latest work, in its task
    if on_superseded == "join":
        assert outcomes == [4] * 5
    else:
        assert [type(o) for o in outcomes[:4]] == [Superseded] * 4
        assert outcomes[4] == 4
    stats = queue.stats()
    assert (stats.completed, stats.superseded) == (2, 4)
    assert not queue.is_active("k")


async def test_a_submission_whose_task_has_not_run_yet_is_replaced() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    handles = [await queue.submit("k", busy.work(i)) for i in range(3)]  # (no loop pass between)
    assert [await handle for handle in handles] == [2, 2, 2]
    assert busy.ran == [2]


async def test_a_work_cut_while_it_runs_in_an_older_turn_never_runs_again() -> None:
    # The older caller's turn runs the newest work; the older caller is cancelled meanwhile:
    # the run is cut, and its outcome (the cancellation) is the newest caller's answer too.
    # The work is not run a second time in its own caller's turn: no work runs twice.
    queue = KeyedQueue(pending="latest", max_running=1)
    busy = Busy()
    holder = await slot_taken(queue, busy)
    started = asyncio.Event()

    async def long(name: str) -> str:
        busy.ran.append(name)
        started.set()
        await asyncio.Event().wait()
        return name

    first = asyncio.create_task(queue.run("k", busy.work(0)))
    await settle(lambda: queue.stats().waiting_for_slot == 1)
    newest = asyncio.create_task(queue.run("k", long, "newest"))
    await settle(lambda: queue.pending("k") == 1)
    busy.gate.set()
    await started.wait()  # the first's turn runs the newest work
    first.cancel()
    await asyncio.gather(first, newest, holder, return_exceptions=True)
    assert busy.ran == ["holder", "newest"]
    assert first.cancelled()
    assert newest.cancelled()
    assert not queue.is_active("k")
    stats = queue.stats()  # holder, the newest (cut), the first (replaced): each once
    assert (stats.completed, stats.cancelled, stats.superseded) == (1, 1, 1)


REQUEST: contextvars.ContextVar[str] = contextvars.ContextVar("request", default="none")


async def test_newer_work_run_in_an_older_turn_sees_its_own_callers_context() -> None:
    queue = KeyedQueue(pending="latest", max_running=1)
    busy = Busy()
    holder = await slot_taken(queue, busy)
    seen: list[str] = []

    async def work() -> str:
        await checkpoints()
        seen.append(REQUEST.get())
        return REQUEST.get()

    async def call(request: str) -> str:
        REQUEST.set(request)
        return await queue.run("k", work)

    first = asyncio.create_task(call("first"))
    await settle(lambda: queue.stats().waiting_for_slot == 1)
    newest = asyncio.create_task(call("newest"))
    await settle(lambda: queue.pending("k") == 1)
    busy.gate.set()
    assert await asyncio.gather(first, newest) == ["newest", "newest"]
    assert seen == ["newest"]  # run once, in the first's turn, with the newest's context
    await holder


async def test_a_threads_turn_never_runs_a_tasks_work() -> None:
    queue = KeyedQueue(pending="latest", max_running=1)
    busy = Busy()
    holder = await slot_taken(queue, busy)

    def blocking() -> str:
        busy.ran.append("thread")
        return "thread"

    thread = asyncio.create_task(asyncio.to_thread(queue.run_sync, "k", blocking))
    await settle(lambda: queue.stats().waiting_for_slot == 1)
    task = asyncio.create_task(queue.run("k", busy.work("task")))
    await settle(lambda: queue.pending("k") == 1)
    busy.gate.set()
    assert await asyncio.gather(thread, task) == ["thread", "task"]
    await holder
    assert busy.ran == ["holder", "thread", "task"]


# -- found by attacking it: the revive path and the take-over -----------------------------------


async def test_work_waiting_again_follows_a_newer_run_instead_of_running_after_it() -> None:
    queue = KeyedQueue(pending="latest")
    gates = {name: asyncio.Event() for name in "ACD"}
    ran: list[str] = []

    async def work(name: str) -> str:
        ran.append(name)
        if name in gates:
            await gates[name].wait()
        return name

    a = asyncio.create_task(queue.run("k", work, "A"))
    await settle(lambda: ran == ["A"])
    b = asyncio.create_task(queue.run("k", work, "B"))
    c = asyncio.create_task(queue.run("k", work, "C"))  # C replaces B: B follows C
    await settle(lambda: queue.pending("k") == 2)
    gates["A"].set()
    await settle(lambda: ran == ["A", "C"])
    d = asyncio.create_task(queue.run("k", work, "D"))  # D waits behind C's run
    await settle(lambda: queue.pending("k") == 1)  # (B follows C's run: not in line)
    c.cancel()  # C's run is cancelled: B's work would wait again, but D is newer
    await settle(lambda: ran == ["A", "C", "D"])
    gates["D"].set()
    outcomes = await asyncio.gather(a, b, c, d, return_exceptions=True)
    assert ran == ["A", "C", "D"]  # B never runs after D: the key ends at the newest
    assert outcomes[:2] == ["A", "D"]
    assert isinstance(outcomes[2], asyncio.CancelledError)
    assert outcomes[3] == "D"
    assert not queue.is_active("k")


async def test_drain_waits_for_work_that_waits_again() -> None:
    queue = KeyedQueue(pending="latest")
    gates = {name: asyncio.Event() for name in "AC"}
    ran: list[str] = []

    async def work(name: str) -> str:
        ran.append(name)
        if name in gates:
            await gates[name].wait()
        return name

    a = asyncio.create_task(queue.run("k", work, "A"))
    await settle(lambda: ran == ["A"])
    b = asyncio.create_task(queue.run("k", work, "B"))
    c = asyncio.create_task(queue.run("k", work, "C"))
    await settle(lambda: queue.pending("k") == 2)
    gates["A"].set()
    await settle(lambda: ran == ["A", "C"])
    drained = asyncio.create_task(queue.drain())  # B is pending at this call
    await checkpoints()
    c.cancel()  # B's work waits again, at the head of the line
    await drained
    assert b.done()
    assert ran == ["A", "C", "B"]
    assert await b == "B"
    await asyncio.gather(a, c, return_exceptions=True)


@pytest.mark.parametrize("kind", ["run", "submit"])
async def test_cancelling_a_caller_whose_work_an_older_turn_runs(kind: str) -> None:
    queue = KeyedQueue(pending="latest", max_running=1)
    busy = Busy()
    holder = await slot_taken(queue, busy)
    first = asyncio.create_task(queue.run("k", busy.work("first")))
    await settle(lambda: queue.stats().waiting_for_slot == 1)
    newer: Any
    if kind == "run":
        newer = asyncio.create_task(queue.run("k", busy.work("newer")))
    else:
        newer = await queue.submit("k", busy.work("newer"))
    await settle(lambda: queue.pending("k") == 1)
    busy.gate.set()
    await settle(lambda: "newer" in busy.ran)  # the first's turn runs the newer work
    newer.cancel()  # the newer's caller leaves; the run goes on for the first
    outcomes = await asyncio.gather(first, newer, holder, return_exceptions=True)
    assert outcomes[0] == "newer"
    assert isinstance(outcomes[1], asyncio.CancelledError)
    assert busy.ran == ["holder", "newer"]
    assert not queue.is_active("k")


async def test_a_follower_promoted_to_run_is_not_counted_as_replaced() -> None:
    queue = KeyedQueue(pending="latest")
    busy = Busy()
    holder = await hold(queue, busy)
    older = asyncio.create_task(queue.run("k", busy.work("older")))
    newer = asyncio.create_task(queue.run("k", busy.work("newer")))
    await settle(lambda: queue.pending("k") == 2)
    busy.gate.set()
    await holder  # the key is handed to the newer, which has not started yet
    newer.cancel()
    assert await older == "older"  # the older runs in its place
    await asyncio.gather(newer, return_exceptions=True)
    stats = queue.stats()
    assert (stats.completed, stats.cancelled, stats.superseded) == (2, 1, 0)
