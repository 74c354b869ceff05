"""Threads and several event loops on one queue: the same line per key for all of them.

Threads are real threads and loops real loops in their own threads. Orders
are set up by waiting until each caller is in line (``pending()``), never by
sleeping; timings are never asserted.
"""

from __future__ import annotations

import _thread
import asyncio
import inspect
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

import inturn
from inturn import KeyedQueue, QueueClosed, QueueFull

from support.helpers import PATIENCE, main_thread_raises_on_sigint, settle, wait_until

T = TypeVar("T")


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=16) as executor:
        yield executor


@contextmanager
def loop_thread() -> Iterator[asyncio.AbstractEventLoop]:
    """An event loop running in a thread of its own, for the length of the block."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="loop-thread")
    thread.start()
    try:
        yield loop
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def in_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T]) -> Future[T]:
    return asyncio.run_coroutine_threadsafe(coro, loop)


class Overlaps:
    """Counts callers inside one key's turn, across threads; records any overlap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.seen: list[str] = []
        self.order: list[Any] = []

    def enter(self, name: Any) -> None:
        with self.lock:
            if self.inside:
                self.seen.append(f"{name} entered while another held the key")
            self.inside += 1
            self.order.append(name)

    def leave(self) -> None:
        with self.lock:
            self.inside -= 1


# -- mutual exclusion ---------------------------------------------------------


def test_eight_threads_increment_one_counter_exactly(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    box = {"n": 0}
    per_thread = 300

    def increment() -> None:
        value = box["n"]
        time.sleep(0)  # let another thread run between the read and the write
        box["n"] = value + 1

    def worker() -> None:
        for _ in range(per_thread):
            queue.run_sync("counter", increment)

    for future in [pool.submit(worker) for _ in range(8)]:
        future.result()
    assert box["n"] == 8 * per_thread
    assert queue.active_count == 0


def test_decorated_plain_def_and_with_keyed_exclude_each_other(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    box = {"n": 0}
    overlaps = Overlaps()

    @queue.queue_by_key(key="row-{row}")
    def bump(row: int) -> int:
        overlaps.enter("bump")
        value = box["n"]
        time.sleep(0)
        box["n"] = value + 1
        overlaps.leave()
        return box["n"]

    def by_block() -> None:
        for _ in range(200):
            with queue.keyed("row-1"):
                overlaps.enter("block")
                value = box["n"]
                time.sleep(0)
                box["n"] = value + 1
                overlaps.leave()

    def by_decorator() -> None:
        for _ in range(200):
            bump(1)

    futures = [pool.submit(by_block) for _ in range(4)]
    futures += [pool.submit(by_decorator) for _ in range(4)]
    for future in futures:
        future.result()
    assert overlaps.seen == []
    assert box["n"] == 8 * 200


def test_threads_and_tasks_never_overlap_on_one_key(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    overlaps = Overlaps()
    box = {"n": 0}

    def thread_work() -> None:
        for _ in range(150):
            with queue.keyed("k"):
                overlaps.enter("thread")
                value = box["n"]
                time.sleep(0)
                box["n"] = value + 1
                overlaps.leave()

    async def task_work() -> None:
        for _ in range(150):
            async with queue.keyed("k"):
                overlaps.enter("task")
                value = box["n"]
                await asyncio.sleep(0)
                box["n"] = value + 1
                overlaps.leave()

    async def main() -> None:
        threads = [asyncio.to_thread(thread_work) for _ in range(4)]
        await asyncio.gather(*threads, *(task_work() for _ in range(4)))

    asyncio.run(main())
    assert overlaps.seen == []
    assert box["n"] == 8 * 150
    assert queue.active_count == 0


def test_two_event_loops_in_two_threads_exclude_each_other() -> None:
    queue = KeyedQueue()
    overlaps = Overlaps()
    box = {"n": 0}

    async def work(name: str) -> None:
        for _ in range(200):
            async with queue.keyed("k"):
                overlaps.enter(name)
                value = box["n"]
                await asyncio.sleep(0)
                box["n"] = value + 1
                overlaps.leave()

    async def several(name: str) -> None:
        await asyncio.gather(*(work(name) for _ in range(3)))

    with loop_thread() as first, loop_thread() as second:
        futures = [in_loop(first, several("first")), in_loop(second, several("second"))]
        for future in futures:
            future.result()
    assert overlaps.seen == []
    assert box["n"] == 2 * 3 * 200
    assert {"first", "second"} <= set(overlaps.order)
    assert queue.active_count == 0


# -- FIFO ------------------------------------------------------------------------


def line_up(
    queue: KeyedQueue, key: str, callers: list[Callable[[], Any]], pool: ThreadPoolExecutor
) -> list[Future[Any]]:
    """Start callers one by one, each once the one before is waiting in key's line."""
    futures = []
    for n, caller in enumerate(callers, start=queue.pending(key) + 1):
        futures.append(pool.submit(caller))
        wait_until(lambda n=n: queue.pending(key) == n, f"caller {n} waiting for {key!r}")
    return futures


def test_threads_get_the_key_in_the_order_they_queued(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    overlaps = Overlaps()
    with queue.keyed("k"):
        futures = line_up(
            queue,
            "k",
            [lambda i=i: queue.run_sync("k", overlaps.enter, i) for i in range(8)],
            pool,
        )
        assert overlaps.order == []  # all wait behind this thread
    for future in futures:
        future.result()
    assert overlaps.order == list(range(8))


def test_threads_and_tasks_keep_fifo_between_them(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    order: list[str] = []
    release = threading.Event()

    async def task_turn(name: str) -> None:
        async with queue.keyed("k"):
            order.append(name)

    with loop_thread() as loop:
        holder = pool.submit(lambda: queue.run_sync("k", release.wait))
        wait_until(lambda: queue.is_active("k"), "the first thread holding")
        futures: list[Future[Any]] = []
        for n, name in enumerate(["t1", "a1", "t2", "a2", "a3", "t3"], start=1):
            if name.startswith("t"):
                futures.append(pool.submit(queue.run_sync, "k", order.append, name))
            else:
                futures.append(in_loop(loop, task_turn(name)))
            wait_until(lambda n=n: queue.pending("k") == n, f"{name} waiting")
        release.set()
        holder.result()
        for future in futures:
            future.result()
    assert order == ["t1", "a1", "t2", "a2", "a3", "t3"]
    assert queue.active_count == 0


def test_tasks_queued_before_the_first_thread_keep_their_places(
    pool: ThreadPoolExecutor,
) -> None:
    """The switch to locking, made by the first thread, reorders nothing."""
    queue = KeyedQueue()
    order: list[str] = []

    async def main() -> None:
        gate = asyncio.Event()

        async def turn(name: str, wait: asyncio.Event | None = None) -> None:
            async with queue.keyed("k"):
                order.append(name)
                if wait is not None:
                    await wait.wait()

        holder = asyncio.create_task(turn("holder", gate))
        waiting = [asyncio.create_task(turn(f"task{i}")) for i in range(3)]
        await settle(lambda: queue.pending("k") >= 3)
        thread = asyncio.ensure_future(
            asyncio.wrap_future(pool.submit(queue.run_sync, "k", order.append, "thread"))
        )
        await settle(lambda: queue.pending("k") >= 4)
        late = asyncio.create_task(turn("late task"))
        await settle(lambda: queue.pending("k") >= 5)
        assert "shared by threads" in repr(queue)
        gate.set()
        await asyncio.gather(holder, *waiting, thread, late)

    asyncio.run(main())
    assert order == ["holder", "task0", "task1", "task2", "thread", "late task"]


def test_loops_one_after_another_in_one_thread_need_no_locking() -> None:
    queue = KeyedQueue()

    async def turn() -> int:
        async with queue.keyed("k") as held:
            return held.token

    assert asyncio.run(turn()) < asyncio.run(turn())
    assert "shared by threads" not in repr(queue)


# -- timeouts, max_pending, reentrancy, several keys -------------------------------


def test_a_thread_times_out_and_its_work_never_runs(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue(timeout=0.05)
    ran: list[str] = []
    with queue.keyed("k", timeout=None):  # this thread holds k; the others wait
        with pytest.raises(
            TimeoutError,
            match=r"'k' was not reached within 0\.05 s: it was waiting for its place in the "
            r"key's line \(the key was busy, no other turn waiting\); the work did not run$",
        ):
            pool.submit(queue.run_sync, "k", ran.append, "late").result()
        assert queue.pending("k") == 0

        def at_once() -> None:
            with queue.keyed("k", timeout=0):
                ran.append("never")

        with pytest.raises(
            TimeoutError,
            match=r"'k' was not reached at once \(timeout=0\): it needed its place in the key's",
        ):
            pool.submit(at_once).result()
    assert ran == []
    pool.submit(queue.run_sync, "k", ran.append, "after").result()  # the line still works
    assert ran == ["after"]
    assert queue.active_count == 0


def test_a_threads_turn_that_ran_out_waiting_for_a_running_slot_says_so(
    pool: ThreadPoolExecutor,
) -> None:
    # Issue 31: a thread's turn (its own driver) on a key nobody holds, max_running
    # full with another key: it names the slot, the fix and the queue's timeout.
    # Before: "a running slot (max_running=1) was not reached within 0.3 s".
    queue = KeyedQueue(max_running=1, timeout=0.3)
    entered, leave = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        leave.wait(PATIENCE)

    holder = pool.submit(queue.run_sync, "busy", hold)
    assert entered.wait(PATIENCE)
    ran: list[str] = []
    try:
        with pytest.raises(TimeoutError) as late:
            pool.submit(queue.run_sync, "free", ran.append, "free").result()
    finally:
        leave.set()
    holder.result()
    assert ran == []
    assert str(late.value) == (
        "inturn: the turn for key 'free' was not reached within 0.3 s: it was waiting for a "
        "running slot (all max_running=1 busy, no other turn waiting); the work did not run. "
        "Raise max_running"
    )


def test_max_pending_counts_threads(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue(max_pending=1)
    with queue.keyed("k"):
        waiting = line_up(queue, "k", [lambda: queue.run_sync("k", lambda: "ran")], pool)
        with pytest.raises(QueueFull, match="max_pending=1"):
            pool.submit(queue.run_sync, "k", lambda: "refused").result()
    assert waiting[0].result() == "ran"


def test_a_thread_retakes_a_key_it_holds_at_once() -> None:
    queue = KeyedQueue()

    @queue.queue_by_key(key="acct-{n}")
    def outer(n: int) -> list[str]:
        with queue.keyed(f"acct-{n}"):
            return [inner(n), queue.run_sync(f"acct-{n}", lambda: "run_sync")]

    @queue.queue_by_key(key="acct-{n}")
    def inner(n: int) -> str:
        return "inner"

    assert outer(1) == ["inner", "run_sync"]
    assert queue.active_count == 0


def test_a_thread_started_by_the_holder_waits_its_turn(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    with queue.keyed("k"):
        started = pool.submit(queue.run_sync, "k", lambda: "child")
        wait_until(lambda: queue.pending("k") == 1, "the child thread waiting")
        assert not started.done()
    assert started.result() == "child"


def test_threads_taking_overlapping_keys_in_any_order_never_deadlock(
    pool: ThreadPoolExecutor,
) -> None:
    queue = KeyedQueue()
    overlaps = {key: Overlaps() for key in "abc"}

    def work(keys: str) -> None:
        for _ in range(100):
            with queue.keyed(*keys):
                for key in keys:
                    overlaps[key].enter(keys)
                time.sleep(0)
                for key in keys:
                    overlaps[key].leave()

    futures = [pool.submit(work, keys) for keys in ("ab", "ba", "bc", "cb", "ca", "abc")]
    for future in futures:
        future.result()
    assert all(o.seen == [] for o in overlaps.values())
    assert queue.active_count == 0


def test_a_thread_timing_out_on_a_later_key_releases_the_earlier(
    pool: ThreadPoolExecutor,
) -> None:
    queue = KeyedQueue()

    def both() -> None:
        with queue.keyed("a", "b", timeout=0):
            pass

    with queue.keyed("b"):
        with pytest.raises(
            TimeoutError, match=r"'b' was not reached at once \(timeout=0\): it needed its place"
        ):
            pool.submit(both).result()
        assert not queue.is_active("a")


# -- the blocking call inside a running loop ------------------------------------------


async def test_a_blocking_turn_inside_a_running_loop_is_refused() -> None:
    queue = KeyedQueue()

    @queue.queue_by_key(key="k")
    def plain() -> str:
        return "ran"

    message = "inside a running event loop.*freeze the loop"
    with pytest.raises(RuntimeError, match=message):
        queue.run_sync("k", plain)
    with pytest.raises(RuntimeError, match=message), queue.keyed("k"):
        pass
    with pytest.raises(RuntimeError, match=message):
        plain()
    with pytest.raises(RuntimeError, match="drain_sync"):
        queue.drain_sync()
    assert queue.active_count == 0


async def test_a_blocking_turn_inside_a_running_loop_names_its_function_and_async_def() -> None:
    queue = KeyedQueue()

    @queue.queue_by_key(key="invoice-{n}")
    def render_invoice(n: int) -> str:
        return "ran"

    def settle() -> None:
        pass

    with pytest.raises(RuntimeError) as decorated:
        render_invoice(7)  # (awaiting it would be the next mistake: it was called here)
    message = str(decorated.value)
    assert "render_invoice() is a plain def" in message
    assert "'invoice-7'" in message
    assert "make it an `async def` and await it" in message.lower()
    assert "`await asyncio.to_thread(" in message
    assert "render_invoice, ...)`" in message
    with pytest.raises(RuntimeError, match=r"settle\(\) is a plain def.*`async def`"):
        queue.run_sync("k", settle)
    keyed = r"`with keyed\(...\)` turn on 'k'.*`async with"
    with pytest.raises(RuntimeError, match=keyed), queue.keyed("k"):
        pass
    assert queue.active_count == 0


async def test_the_task_holding_a_key_may_take_it_blocking() -> None:
    queue = KeyedQueue()

    @queue.queue_by_key(key="k")
    def plain() -> str:
        return "ran"

    async with queue.keyed("k", "j"):
        assert plain() == "ran"
        with queue.keyed("j", "k"):
            assert queue.run_sync("k", plain) == "ran"
        assert queue.is_active("k")  # the inner block did not release the task's key
        with pytest.raises(RuntimeError, match="freeze the loop"):
            queue.run_sync("other", plain)
    assert queue.active_count == 0


# -- interruption and cancellation across threads ----------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="pthread_kill")
@pytest.mark.usefixtures("collector_paused")
def test_an_interrupted_thread_leaves_the_line(pool: ThreadPoolExecutor) -> None:
    main_thread_raises_on_sigint()
    queue = KeyedQueue(timeout=PATIENCE)  # (a lost SIGINT fails the test, not hangs it)
    order: list[str] = []
    release = threading.Event()
    holder = pool.submit(queue.run_sync, "k", release.wait)
    wait_until(lambda: queue.is_active("k"), "the holder")
    main = threading.get_ident()

    def interrupt() -> None:
        wait_until(lambda: queue.pending("k") == 1, "the main thread waiting")
        signal.pthread_kill(main, signal.SIGINT)

    interrupter = pool.submit(interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            queue.run_sync("k", order.append, "interrupted")
        interrupter.result()
        assert queue.pending("k") == 0
        behind = line_up(queue, "k", [lambda: queue.run_sync("k", order.append, "behind")], pool)
    finally:
        release.set()  # (a failure above must not leave the pool's holder waiting for ever)
    holder.result()
    behind[0].result()
    assert order == ["behind"]
    assert queue.active_count == 0


def test_a_task_cancelled_as_a_thread_hands_it_the_key_passes_it_on(
    pool: ThreadPoolExecutor,
) -> None:
    queue = KeyedQueue()
    order: list[str] = []
    let_go = threading.Event()
    released = threading.Event()

    def holder() -> None:
        with queue.keyed("k"):
            let_go.wait()
        released.set()

    async def main() -> None:
        holding = asyncio.wrap_future(pool.submit(holder))
        await settle(lambda: queue.is_active("k"))

        async def turn(name: str) -> None:
            async with queue.keyed("k"):
                order.append(name)

        first = asyncio.create_task(turn("first"))
        second = asyncio.create_task(turn("second"))
        await settle(lambda: queue.pending("k") >= 2)
        # Block this loop while the thread releases: the hand-off to `first`
        # is decided, and its wake-up queued, but `first` has not run.
        let_go.set()
        released.wait()
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await second
        await holding

    asyncio.run(main())
    assert order == ["second"]
    assert queue.active_count == 0


# -- introspection, drain, close ---------------------------------------------------------


def test_introspection_sees_threads(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    with queue.keyed("k") as turn:
        assert queue.active_keys == frozenset({"k"})
        line_up(queue, "k", [lambda: queue.run_sync("k", lambda: None)] * 2, pool)
        assert queue.pending("k") == 2
        assert "'k': held, 2 waiting" in repr(queue)
        assert turn.token > 0
    wait_until(lambda: queue.active_count == 0, "the line empty")
    assert queue.active_keys == frozenset()


def test_current_resolves_with_a_threads_result(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    release = threading.Event()

    def work() -> str:
        release.wait()
        return "done"

    async def watch() -> str:
        holder = asyncio.wrap_future(pool.submit(queue.run_sync, "k", work))
        await settle(lambda: queue.is_active("k"))
        outcome = queue.current("k")
        assert outcome is not None
        release.set()
        assert await holder == "done"
        return await outcome  # type: ignore[no-any-return]

    assert asyncio.run(watch()) == "done"


def test_drain_waits_for_threads_and_tasks(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    release = threading.Event()
    finished: list[str] = []

    def thread_work() -> None:
        release.wait()
        finished.append("thread")

    async def main() -> None:
        holder = asyncio.wrap_future(pool.submit(queue.run_sync, "a", thread_work))
        await settle(lambda: queue.is_active("a"))
        task = asyncio.create_task(queue.run("a", lambda: finished.append("task")))
        drained = asyncio.create_task(queue.drain())
        await asyncio.sleep(0)
        assert not drained.done()
        release.set()
        await drained
        assert finished == ["thread", "task"]
        await asyncio.gather(holder, task)

    asyncio.run(main())


def test_drain_sync_waits_for_tasks_of_another_loop(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    finished: list[str] = []
    with loop_thread() as loop:
        gate = asyncio.Event()

        async def work() -> None:
            await gate.wait()
            finished.append("task")

        running = in_loop(loop, queue.run("k", work))
        wait_until(lambda: queue.is_active("k"), "the task holding")
        assert not queue.drain_sync(timeout=0)
        loop.call_soon_threadsafe(gate.set)
        assert queue.drain_sync()
        assert finished == ["task"]
        running.result()
    assert queue.drain_sync(timeout=0)  # nothing active: at once


def test_a_closed_queue_refuses_threads_but_lets_holders_reenter() -> None:
    queue = KeyedQueue()
    with queue.keyed("k"):
        queue.close()
        assert queue.run_sync("k", lambda: "reentrant") == "reentrant"
    with pytest.raises(QueueClosed):
        queue.run_sync("k", lambda: "refused")
    with pytest.raises(QueueClosed), queue.keyed("k"):
        pass


def test_idle_keys_leave_no_trace_after_threads(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()
    for future in [pool.submit(queue.run_sync, f"k{i % 50}", lambda: None) for i in range(500)]:
        future.result()
    assert queue.active_count == 0
    assert queue._registry.lines == {}


# -- the functional and decorated forms ---------------------------------------------------


def test_run_sync_refuses_what_it_cannot_run() -> None:
    queue = KeyedQueue()

    async def coroutine_function() -> None:
        pass

    with pytest.raises(TypeError, match="needs a callable, got 42"):
        queue.run_sync("k", 42)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"returned a coroutine.*await queue\.run"):
        queue.run_sync("k", coroutine_function)
    with pytest.raises(TypeError, match="unhashable"):
        queue.run_sync(["k"], lambda: None)  # type: ignore[arg-type]
    assert queue.active_count == 0


def test_module_level_run_sync_and_keyed_use_the_default_queue() -> None:
    assert inturn.run_sync("threads-default", lambda: 7) == 7
    with inturn.keyed("threads-default") as turn:
        assert inturn.default_queue.is_active("threads-default")
        assert turn.keys == ("threads-default",)
    assert not inturn.default_queue.is_active("threads-default")


def test_a_plain_def_keeps_its_identity_and_every_key_form() -> None:
    queue = KeyedQueue()

    @queue.queue_by_key
    def bare(x: int) -> int:
        """Bare."""
        return x

    @queue.queue_by_key(key=lambda args: ("fn", args["x"]))
    def by_function(x: int) -> int:
        return x

    @queue.queue_by_key(keys=["a-{x}", "b"])
    def several(x: int) -> int:
        return x

    class Repo:
        table = "stock"

        @queue.queue_by_key(key="{self.table}-{row}")
        def method(self, row: int) -> int:
            return row

        @queue.queue_by_key(key="cls-{row}")
        @classmethod
        def klass(cls, row: int) -> int:
            return row

        @queue.queue_by_key(key="static-{row}")
        @staticmethod
        def static(row: int) -> int:
            return row

    assert bare(1) == 1
    assert bare.__name__ == "bare"
    assert bare.__doc__ == "Bare."
    assert str(inspect.signature(bare)) == "(x: 'int') -> 'int'"
    assert not inspect.iscoroutinefunction(bare)
    assert bare.key_of(1) == f"{__name__}.{bare.__qualname__}"
    assert by_function(2) == 2
    assert by_function.key_of(2) == ("fn", 2)
    assert several(3) == 3
    assert several.key_of(3) == ("a-3", "b")
    repo = Repo()
    assert repo.method(4) == 4
    assert repo.method.key_of(4) == "stock-4"
    assert Repo.klass(5) == 5
    assert Repo.klass.key_of(5) == "cls-5"
    assert Repo.static(6) == 6
    assert repo.static.key_of(6) == "static-6"
    assert bare.queue is queue
    assert queue.active_count == 0


def test_a_plain_def_with_a_timeout_of_its_own(pool: ThreadPoolExecutor) -> None:
    queue = KeyedQueue()

    @queue.queue_by_key(key="k", timeout=0)
    def impatient() -> str:
        return "ran"

    assert impatient() == "ran"
    with queue.keyed("k"), pytest.raises(TimeoutError):
        pool.submit(impatient).result()


def test_what_cannot_decorate_a_plain_def_is_refused_at_decoration() -> None:
    queue = KeyedQueue()
    with pytest.raises(TypeError, match=r"lambda by position.*key="):
        queue.queue_by_key(lambda args: args["x"])
    with pytest.raises(TypeError, match="coalesce=True is for async def"):

        @queue.queue_by_key(key="k", coalesce=True)
        def coalescing() -> None:
            pass


def test_a_key_by_position_and_by_keyword_is_refused() -> None:
    queue = KeyedQueue()
    with pytest.raises(TypeError, match=r"by position, not a key.*key='a'"):
        queue.queue_by_key("a", key="b")  # type: ignore[call-overload]

    def fn() -> None:
        pass

    with pytest.raises(TypeError, match="not both"):
        queue.queue_by_key(fn, key="b")  # type: ignore[call-overload]


def test_a_task_woken_by_a_thread_is_the_holder_from_its_first_step(
    monkeypatch: pytest.MonkeyPatch, pool: ThreadPoolExecutor
) -> None:
    """A hand-off from a thread makes the line the task's before the task can run.

    The thread is held right after it woke the task (as a GIL switch there
    would), until the task has started its body: the task must already be
    the holder then, so taking its own key again runs at once.
    """
    import inturn._line as internals

    queue = KeyedQueue()
    body_started = threading.Event()
    wake = internals.wake

    def wake_then_pause(waiter: Any) -> bool:
        woken = wake(waiter)
        body_started.wait(PATIENCE)
        return woken

    monkeypatch.setattr(internals, "wake", wake_then_pause)
    let_go = threading.Event()

    async def main() -> str:
        holder = asyncio.wrap_future(pool.submit(queue.run_sync, "k", let_go.wait))
        await settle(lambda: queue.is_active("k"))

        async def body() -> str:
            body_started.set()
            # the holder: its blocking re-take is reentrant (else RuntimeError at once)
            return queue.run_sync("k", lambda: "reentered")

        task = asyncio.ensure_future(queue.run("k", body))
        await settle(lambda: queue.pending("k") == 1)
        let_go.set()
        await holder
        return await task

    assert asyncio.run(main()) == "reentered"


def test_a_queue_with_a_backend_serves_a_loop_of_another_thread_once_the_first_is_gone(
    tmp_path: Any, pool: ThreadPoolExecutor
) -> None:
    """One ``asyncio.run()`` per job, each in a pool thread: the case of RQ or Celery threads.

    The first job's thread lives on after its loop closed; a later job's
    loop, in another thread, is served all the same.
    """
    from inturn.backends.file import FileBackend

    queue = KeyedQueue(backend=FileBackend(tmp_path))

    async def job(n: int) -> int:
        return await queue.run("k", lambda: asyncio.sleep(0, n))

    first_closed = threading.Event()
    let_go = threading.Event()

    def first() -> int:
        result = asyncio.run(job(1))
        first_closed.set()
        assert let_go.wait(PATIENCE)  # this thread is alive, its loop closed
        return result

    done = pool.submit(first)
    assert first_closed.wait(PATIENCE)
    assert pool.submit(lambda: asyncio.run(job(2))).result(PATIENCE) == 2
    let_go.set()
    assert done.result(PATIENCE) == 1
    assert queue.stats().completed == 2


def test_two_open_loops_in_two_threads_share_a_backend_queues_lines(tmp_path: Any) -> None:
    from inturn.backends.file import FileBackend

    queue = KeyedQueue(backend=FileBackend(tmp_path))
    order: list[str] = []
    held, release = threading.Event(), threading.Event()

    async def hold() -> None:
        async with queue.keyed("k"):
            held.set()
            await asyncio.get_running_loop().run_in_executor(None, release.wait, PATIENCE)
            order.append("first")

    async def follow() -> None:
        async with queue.keyed("k"):
            order.append("second")

    with loop_thread() as loop:
        first = in_loop(loop, hold())
        assert held.wait(PATIENCE)

        def let_go() -> None:
            wait_until(lambda: queue.pending("k") == 1, "the second loop's task in line")
            release.set()

        threading.Thread(target=let_go).start()
        asyncio.run(follow())  # a second loop, while the first is open in its thread
        first.result(PATIENCE)
    assert order == ["first", "second"]


def test_a_coalesced_call_from_a_loop_in_another_thread_gets_the_result() -> None:
    """coalesce=True across event loops in threads: the joiner is woken in its own loop."""
    queue = KeyedQueue()
    calls: list[int] = []
    entered = threading.Event()
    gate = threading.Event()

    @queue.queue_by_key(key="k", coalesce=True)
    async def refresh() -> int:
        calls.append(1)
        entered.set()
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, PATIENCE)
        return len(calls)

    joined = threading.Event()

    async def join_and_step() -> asyncio.Task[int]:
        joiner = asyncio.create_task(refresh())
        joiner.add_done_callback(lambda _: joined.set())
        await asyncio.sleep(0)  # a checkpoint: the task has run its first step, and joined
        return joiner

    with loop_thread() as first, loop_thread() as second:
        leader = in_loop(first, refresh())
        assert entered.wait(PATIENCE)
        joiner = in_loop(second, join_and_step()).result(PATIENCE)
        assert not joiner.done()
        gate.set()
        assert leader.result(PATIENCE) == 1
        # Nothing else wakes the second loop: the end of the flight must.
        assert joined.wait(PATIENCE), "the joiner's loop was never woken"
        assert joiner.result() == 1
    assert calls == [1]  # one run, whose result both callers got


# -- a thread not started by threading ----------------------------------------------------


def test_a_blocking_turn_in_a_thread_not_started_by_threading_leaves_no_dummy_thread() -> None:
    queue = KeyedQueue()
    done = _thread.allocate_lock()
    done.acquire()
    seen: dict[str, Any] = {}

    def work() -> None:
        try:
            ident = seen["ident"] = _thread.get_ident()
            seen["before"] = threading._active.get(ident)  # type: ignore[attr-defined]
            with queue.keyed("k"):
                seen["held"] = queue.is_active("k")
            seen["after"] = threading._active.get(ident)  # type: ignore[attr-defined]
        except BaseException as error:
            seen["error"] = error
        finally:
            done.release()

    _thread.start_new_thread(work, ())
    assert done.acquire(timeout=PATIENCE)
    ident = seen["ident"]
    try:
        assert "error" not in seen, seen.get("error")
        assert seen["held"]
        assert seen["before"] is None
        # The turn made no threading._DummyThread for the thread (Python 3.13 drops
        # one when its thread ends, 3.10-3.12 keep it for good) ...
        assert seen["after"] is None
        # ... and, the thread done, nothing of it stays in threading's table.
        assert ident not in threading._active  # type: ignore[attr-defined]
    finally:
        # (a dummy left behind would be taken for a later thread given the same ident)
        with threading._active_limbo_lock:  # type: ignore[attr-defined]
            if isinstance(threading._active.get(ident), threading._DummyThread):  # type: ignore[attr-defined]
                del threading._active[ident]  # type: ignore[attr-defined]
