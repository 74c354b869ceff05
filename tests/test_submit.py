"""submit() queues work as data in its key's line: FIFO with every caller, and no task per backlog.

A submission joins its key's line when submit() is called. While the key is
busy, it waits there as data and costs no task; its task is made when the
line hands it the key. Tasks are counted through the loop's task factory,
never by timing; orders are set up with events and checkpoints.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import inspect
import sys
import threading
import weakref
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from inturn import Handle, KeyedQueue, QueueFull
from inturn.backends.file import FileBackend

from support.helpers import PATIENCE, Recorder, checkpoints, settle, wait_until

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup


class Tasks:
    """Counts the tasks a loop makes: in all, alive now, and the most alive at once.

    The test's own task (made through the factory too) is not counted.
    """

    def __init__(self) -> None:
        self.made = -1
        self.alive = -1
        self.peak = 0

    def _ended(self, _: object) -> None:
        self.alive -= 1

    def factory(
        self, loop: asyncio.AbstractEventLoop, coro: Any, **options: Any
    ) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **options)
        task.add_done_callback(self._ended)
        self.made += 1
        self.alive += 1
        self.peak = max(self.peak, self.alive)
        return task


@pytest.fixture
async def tasks() -> AsyncIterator[Tasks]:
    loop = asyncio.get_running_loop()
    counter = Tasks()
    previous = loop.get_task_factory()
    loop.set_task_factory(counter.factory)
    yield counter
    loop.set_task_factory(previous)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=2) as executor:
        yield executor


@pytest.mark.parametrize("max_running", [None, 4])
async def test_a_hot_key_s_backlog_waits_as_data_not_as_tasks(
    tasks: Tasks, max_running: int | None
) -> None:
    queue = KeyedQueue(max_running=max_running)
    recorder = Recorder()
    gate = asyncio.Event()
    async with queue.batch() as batch:
        first = await batch.submit("hot", recorder.body("hot", 0, gate=gate))
        for i in range(1, 200):
            await batch.submit("hot", recorder.body("hot", i))
        await checkpoints(5)
        assert queue.pending("hot") == 199
        assert tasks.alive == 1  # the holder's task only: 199 works wait as data
        gate.set()
    assert await first == 0
    assert recorder.started == list(range(200))
    assert recorder.overlaps == []
    assert tasks.peak <= 2  # the running work's task, and the next one's once handed the key
    assert queue.active_count == 0


async def test_the_submitter_s_own_run_after_its_submit_goes_behind_it() -> None:
    queue = KeyedQueue()
    order: list[str] = []
    first = await queue.submit("k", order.append, "A1")
    # the key is free and A1's task has not run yet: A1 holds it already
    await queue.run("k", order.append, "x")
    second = await queue.submit("k", order.append, "A2")
    await first
    await second
    assert order == ["A1", "x", "A2"]


async def test_submissions_before_a_run_go_first() -> None:
    queue = KeyedQueue()
    order: list[str] = []
    first = await queue.submit("k", order.append, "A1")
    second = await queue.submit("k", order.append, "A2")
    async with queue.keyed("k"):
        order.append("block")
    await queue.run("k", order.append, "x")
    await asyncio.gather(first, second)
    assert order == ["A1", "A2", "block", "x"]


async def test_a_submission_and_a_thread_keep_their_arrival_order(
    pool: ThreadPoolExecutor,
) -> None:
    queue = KeyedQueue()
    await asyncio.to_thread(queue.run_sync, "warm", lambda: None)  # shared with threads now
    order: list[str] = []
    lock = threading.Lock()

    def record(name: str) -> None:
        with lock:
            order.append(name)

    first = await queue.submit("k", record, "A1")
    # without yielding: the thread arrives while A1 holds the key (its task not run yet)
    thread = pool.submit(queue.run_sync, "k", record, "thread")
    wait_until(lambda: queue.pending("k") == 1, "the thread waits in the line")
    second = await queue.submit("k", record, "A2")
    await first
    await asyncio.wrap_future(thread)
    await second
    assert order == ["A1", "thread", "A2"]


async def test_a_cancelled_waiting_submission_leaves_without_a_task(tasks: Tasks) -> None:
    queue = KeyedQueue(max_running=2)
    recorder = Recorder()
    gate = asyncio.Event()
    holder = await queue.submit("k", recorder.body("k", "holder", gate=gate))
    queued = await queue.submit("k", recorder.body("k", "queued"))
    after = await queue.submit("k", recorder.body("k", "after"))
    await settle(lambda: recorder.started == ["holder"])
    assert queue.pending("k") == 2
    assert queued.cancel() is True
    assert queued.cancelled()
    assert queued.cancel() is False
    assert queue.pending("k") == 1
    with pytest.raises(asyncio.CancelledError):
        await queued
    gate.set()
    assert [await holder, await after] == ["holder", "after"]
    assert recorder.started == ["holder", "after"]
    assert tasks.made == 2  # none for the cancelled work
    assert queue.stats().cancelled == 1
    assert queue.active_count == 0


async def test_a_submission_cancelled_as_it_is_handed_the_key_passes_it_on(tasks: Tasks) -> None:
    queue = KeyedQueue()
    recorder = Recorder()
    gate = asyncio.Event()
    holder = await queue.submit("k", recorder.body("k", "holder", gate=gate))
    handed = await queue.submit("k", recorder.body("k", "handed"))
    after = await queue.submit("k", recorder.body("k", "after"))
    await settle(lambda: recorder.started == ["holder"])
    watcher = queue.current("k")
    assert watcher is not None
    # the holder's end is told to its watchers just before the hand-off; this
    # callback runs after the hand-off, before the handed work's task is made
    watcher.add_done_callback(lambda _: handed.cancel())
    gate.set()
    assert await holder == "holder"
    assert await after == "after"
    assert handed.cancelled()
    assert recorder.started == ["holder", "after"]
    assert tasks.made == 2
    assert queue.active_count == 0


async def test_a_submission_cancelled_before_its_task_ran_frees_the_key() -> None:
    queue = KeyedQueue(max_running=1)
    ran: list[str] = []
    handle = await queue.submit("k", ran.append, "never")
    assert queue.is_active("k")  # it holds the free key already
    assert handle.cancel() is True
    await settle(handle.done)
    assert handle.cancelled()
    assert await queue.run("k", ran.append, "next") is None
    assert ran == ["next"]
    assert queue.active_count == 0
    assert queue.stats().running == 0


async def test_a_waiting_submission_times_out_with_the_queue_s_timeout(tasks: Tasks) -> None:
    queue = KeyedQueue(timeout=0.05)
    gate = asyncio.Event()
    ran: list[str] = []
    holder = await queue.submit("k", gate.wait)
    late = await queue.submit("k", ran.append, "late")
    await settle(late.done)  # the holder holds the key all along
    with pytest.raises(TimeoutError) as missed:
        await late
    assert str(missed.value) == (
        "inturn: the turn for key 'k' was not reached within 0.05 s: it was waiting for its "
        "place in the key's line (the key was busy, no other turn waiting); the work did not run"
    )
    assert queue.pending("k") == 0
    gate.set()
    assert await holder is True
    assert await queue.submit("k", ran.append, "next") is not None
    await queue.drain()
    assert ran == ["next"]
    assert tasks.made == 2  # the holder's and next's: none for the work that timed out
    assert queue.stats().timed_out == 1


async def test_a_timed_out_submission_s_error_reaches_its_batch() -> None:
    queue = KeyedQueue(timeout=0.01)
    gate = asyncio.Event()
    holder = await queue.submit("k", gate.wait)

    async def scope() -> None:
        async with queue.batch() as batch:
            await batch.submit("k", lambda: None)
            await settle(lambda: queue.pending("k") == 0)  # timed out
            gate.set()

    with pytest.raises(ExceptionGroup) as info:
        await asyncio.wait_for(scope(), PATIENCE)
    assert [type(error) for error in info.value.exceptions] == [TimeoutError]
    assert await holder is True


async def test_a_full_line_fails_the_handle_with_queue_full(tasks: Tasks) -> None:
    queue = KeyedQueue(max_pending=1)
    gate = asyncio.Event()
    holder = await queue.submit("k", gate.wait)
    queued = await queue.submit("k", lambda: "queued")
    refused = await queue.submit("k", lambda: "refused")
    assert refused.done()
    with pytest.raises(QueueFull, match="max_pending=1"):
        await refused
    gate.set()
    assert [await holder, await queued] == [True, "queued"]
    assert tasks.made == 2


async def test_waiting_work_runs_in_the_context_of_its_submit() -> None:
    queue = KeyedQueue()
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")
    gate = asyncio.Event()
    seen: list[str] = []
    holder = await queue.submit("k", gate.wait)
    var.set("first")
    first = await queue.submit("k", lambda: seen.append(var.get()))
    var.set("second")
    second = await queue.submit("k", lambda: seen.append(var.get()))
    var.set("after")
    gate.set()
    await asyncio.gather(holder, first, second)
    assert seen == ["first", "second"]


async def test_a_handle_of_waiting_work_answers_as_a_future() -> None:
    queue = KeyedQueue()
    gate = asyncio.Event()
    holder = await queue.submit("k", gate.wait)
    queued = await queue.submit("k", lambda: 42)
    seen: list[int] = []
    queued.add_done_callback(lambda handle: seen.append(handle.result()))
    assert not queued.done()
    assert "waiting in line" in repr(queued)
    with pytest.raises(asyncio.InvalidStateError):
        queued.result()
    waiter = asyncio.ensure_future(queued)
    await checkpoints(3)
    waiter.cancel()  # cancelling an awaiter never affects the work
    gate.set()
    assert await queued == 42
    await settle(lambda: seen == [42])
    assert await holder is True
    assert repr(queued).endswith("done>")


async def test_drain_waits_for_work_waiting_as_data() -> None:
    queue = KeyedQueue(max_running=2)
    recorder = Recorder()
    gate = asyncio.Event()
    handles = [await queue.submit("k", recorder.body("k", 0, gate=gate))]
    handles += [await queue.submit("k", recorder.body("k", i)) for i in range(1, 5)]
    drained = asyncio.create_task(queue.drain())
    await checkpoints(5)
    assert not drained.done()
    gate.set()
    await drained
    assert all(handle.done() for handle in handles)
    assert recorder.finished == list(range(5))


async def test_a_thread_hands_the_key_to_work_waiting_as_data() -> None:
    queue = KeyedQueue(max_running=2)
    release = threading.Event()
    order: list[str] = []

    def hold() -> None:
        order.append("thread")
        release.wait(PATIENCE)

    thread = asyncio.ensure_future(asyncio.to_thread(queue.run_sync, "k", hold))
    await settle(lambda: order == ["thread"])
    handles = [await queue.submit("k", order.append, f"A{i}") for i in range(5)]
    assert queue.pending("k") == 5
    release.set()  # the thread's release hands the key to A0, in this loop
    await thread
    await asyncio.gather(*handles)
    assert order == ["thread", "A0", "A1", "A2", "A3", "A4"]
    assert queue.active_count == 0


async def test_current_is_none_while_submitted_work_has_not_started() -> None:
    queue = KeyedQueue()
    handle = await queue.submit("k", lambda: "done")
    assert queue.is_active("k")
    assert queue.current("k") is None
    assert await handle == "done"


@pytest.mark.skipif(sys.version_info < (3, 12), reason="eager tasks came with Python 3.12")
async def test_submissions_keep_their_order_under_eager_tasks() -> None:
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined,unused-ignore]
    try:
        queue = KeyedQueue(max_running=2)
        recorder = Recorder()
        gate = asyncio.Event()
        async with queue.batch() as batch:
            # the free key's work runs its first step inside submit(): up to the gate
            first = await batch.submit("k", recorder.body("k", 0, gate=gate))
            assert recorder.started == [0]
            rest = [await batch.submit("k", recorder.body("k", i)) for i in range(1, 6)]
            cancelled = rest.pop(2)  # work 3, waiting as data
            assert cancelled.cancel() is True
            other = await batch.submit("j", recorder.body("j", "j"))
            run = asyncio.ensure_future(queue.run("k", recorder.body("k", "run")))
            gate.set()
        await run
        assert [await first, *[await handle for handle in rest]] == [0, 1, 2, 4, 5]
        assert await other == "j"
        assert cancelled.cancelled()
        assert [name for name in recorder.started if name != "j"] == [0, 1, 2, 4, 5, "run"]
        assert recorder.overlaps == []
        assert queue.active_count == 0
    finally:
        loop.set_task_factory(None)


@pytest.mark.skipif(sys.version_info < (3, 12), reason="eager tasks came with Python 3.12")
async def test_a_handle_cancelled_in_its_works_eager_first_step_cancels_the_work() -> None:
    loop = asyncio.get_running_loop()
    loop.set_task_factory(asyncio.eager_task_factory)  # type: ignore[attr-defined,unused-ignore]
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        queue = KeyedQueue()
        handles: list[Handle[str]] = []
        steps: list[str] = []

        async def work() -> str:
            steps.append("first step")
            handles[0].cancel()  # its task runs this step inside the hand-off, eagerly
            await asyncio.sleep(0)
            steps.append("went on")
            return "done"

        async with queue.keyed("k"):
            handles.append(await queue.submit("k", work))  # waits in line as data
        # the release handed the key to the work: its first step ran just then
        with pytest.raises(asyncio.CancelledError):
            await handles[0]
        await queue.drain()
        gc.collect()
        assert steps == ["first step"]
        assert handles[0].cancelled()
        assert queue.active_count == 0
        assert errors == []
    finally:
        loop.set_task_factory(None)
        loop.set_exception_handler(None)


async def test_a_finished_handle_lets_its_arguments_go() -> None:
    queue = KeyedQueue()

    class Message:
        pass

    message = Message()
    gone = weakref.ref(message)
    handle = await queue.submit("k", lambda m: None, message)
    del message
    await handle
    gc.collect()
    assert gone() is None


@pytest.mark.parametrize("max_running", [None, 2])
def test_asyncio_run_s_shutdown_cancels_work_left_waiting_as_data(max_running: int | None) -> None:
    queue = KeyedQueue(max_running=max_running)

    async def forever() -> None:
        await asyncio.Event().wait()

    async def first() -> None:
        recorder = Recorder()
        await queue.submit("k", forever)
        for i in range(5):
            await queue.submit("k", recorder.body("k", i, steps=5))
        await asyncio.sleep(0)  # the holder runs; asyncio.run() then cancels it

    async def second() -> str:
        return await asyncio.wait_for(queue.run("k", lambda: "free"), PATIENCE)

    asyncio.run(first())
    assert queue.active_count == 0  # nothing of the closed loop holds or waits
    assert queue.stats().running == 0
    assert asyncio.run(second()) == "free"


def test_a_loop_that_had_work_waiting_as_data_is_let_go() -> None:
    queue = KeyedQueue()
    loops: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    async def main() -> None:
        loops.append(weakref.ref(asyncio.get_running_loop()))
        gate = asyncio.Event()
        holder = await queue.submit("k", gate.wait)
        queued = await queue.submit("k", lambda: "queued")
        gate.set()
        assert [await holder, await queued] == [True, "queued"]

    asyncio.run(main())
    asyncio.run(main())  # (the queue remembers the last loop it ran in)
    gc.collect()
    assert loops[0]() is None


@pytest.mark.parametrize("max_running", [None, 2])
def test_work_whose_task_others_cancel_before_its_first_step_gives_up_its_key_with_its_loop(
    max_running: int | None,
) -> None:
    """Code that cancels every task of its loop (a shutdown handler) may hit a submitted
    work's task before its first step, which runs none of its code. The loop's shutdown
    gives the work's place up, or the next job's loop (one asyncio.run() per job) would
    wait for the key for ever."""
    queue = KeyedQueue(max_running=max_running)
    handles = []

    async def first_job() -> None:
        handles.append(await queue.submit("k", lambda: "never"))  # its task made, not run
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()

    async def next_job() -> str:
        ran = await asyncio.wait_for(queue.run("k", lambda: "next"), PATIENCE)
        other = await asyncio.wait_for(queue.submit("j", lambda: "ran"), PATIENCE)
        return f"{ran} {await other}"

    asyncio.run(first_job())
    assert handles[0].cancelled()
    assert not queue.is_active("k")
    assert asyncio.run(next_job()) == "next ran"


async def test_a_producer_of_another_loop_waiting_for_a_slot_switches_the_queue_to_locking(
    pool: ThreadPoolExecutor,
) -> None:
    """A loop in another thread whose first call is a submit() that must wait for a slot:
    it changes the producers' line, so the queue must lock its lines from then on."""
    queue = KeyedQueue(max_running=1)
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("a", gate.wait))
    await settle(lambda: queue.stats().running == 1)

    async def produce() -> str:
        # every slot busy: it waits (a slot freed as it starts to wait must still wake it)
        handle = await asyncio.wait_for(queue.submit("b", lambda: "b ran"), PATIENCE)
        return await handle

    produced = asyncio.wrap_future(pool.submit(asyncio.run, produce()))
    try:
        await settle(lambda: "shared by threads" in repr(queue))
    finally:
        gate.set()
    await holder
    assert await asyncio.wait_for(produced, PATIENCE) == "b ran"


# -- submit() joins its key's line at the call, on every queue ----------------------------

#: Queues whose submit() takes a path of its own: plain, slots, a keyed semaphore, a backend.
SETTINGS: dict[str, dict[str, Any]] = {
    "plain": {},
    "max_running": {"max_running": 2},
    "concurrency": {"concurrency": 2},
    "concurrency and max_running": {"concurrency": 2, "max_running": 4},
    "file backend": {"backend": "file"},
    "file backend and max_running": {"backend": "file", "max_running": 2},
}


@pytest.mark.parametrize("made_first", [True, False], ids=["B made first", "A made first"])
@pytest.mark.parametrize("busy", [True, False], ids=["busy key", "free key"])
@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
async def test_a_submission_goes_before_a_task_whose_call_comes_after_it(
    settings: dict[str, Any], busy: bool, made_first: bool, tmp_path: Path
) -> None:
    if settings.get("backend") == "file":
        settings = {**settings, "backend": FileBackend(tmp_path)}
    queue = KeyedQueue(**settings)
    # busy: every place of the key held; free: all but one, which A takes at its call
    places = settings.get("concurrency", 1)
    holders = places if busy else places - 1
    entered: list[int] = []
    release = asyncio.Event()

    async def hold(i: int) -> None:
        entered.append(i)
        await release.wait()

    holding = [asyncio.create_task(queue.run("k", hold, i)) for i in range(holders)]
    await settle(lambda: len(entered) == holders)
    order: list[str] = []
    call = queue.run("k", order.append, "B")  # B calls once its task starts
    if made_first:  # its task is made before submit() is called, and starts after it
        later = asyncio.create_task(call)
        handle = await queue.submit("k", order.append, "A")
    else:  # (passes on every queue: A's task, made first, also starts first)
        handle = await queue.submit("k", order.append, "A")
        later = asyncio.create_task(call)
    assert inspect.getcoroutinestate(call) == inspect.CORO_CREATED  # B has not called yet
    release.set()
    await asyncio.wait_for(asyncio.gather(later, handle, *holding), PATIENCE)
    assert order == ["A", "B"]  # "at this call: later callers of the key go after it"
