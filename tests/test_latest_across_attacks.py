"""Attacks on latest work shared across processes (``across="processes"``, file backend).

In-process attacks use several KeyedQueues, each with a FileBackend of its own on one
directory (as tests/test_latest_across.py: the backend cannot tell them from processes);
the freeze attack uses real processes (tests/support/latest_worker.py).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from inturn import HoldTimeout, KeyedQueue, Superseded
from inturn.backends.file import FileBackend
from inturn.backends.file._linefile import parse

from support.file_checks import line_file
from support.helpers import PATIENCE, settle, wait_until
from support.latest_across import Holder, Runs, key_free, latest, posts, records
from support.processes import Worker, stopped, until

LATEST_WORKER = Path(__file__).parent / "support" / "latest_worker.py"


def fresh_posts(directory: Path) -> int:
    return sum(post.fresh for post in parse(records(directory)).posts.values())


# -- 1. threads, tasks, and a fresh event loop per job -------------------------------------


async def test_threads_and_decorated_defs_of_several_queues_run_the_newest_once(
    tmp_path: Path,
) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    a, b, c = latest(tmp_path), latest(tmp_path, on_superseded="raise"), latest(tmp_path)
    ran: list[str] = []
    outcomes: dict[str, Any] = {}

    @b.queue_by_key(key="k")
    def decorated(name: str) -> str:
        ran.append(name)
        return name

    def thread(name: str, call: Callable[[], Any]) -> threading.Thread:
        def body() -> None:
            try:
                outcomes[name] = call()
            except BaseException as error:
                outcomes[name] = error

        started = threading.Thread(target=body)
        started.start()
        return started

    threads = []
    threads.append(thread("a0", lambda: a.run_sync("k", ran.append, "a0")))
    await settle(lambda: posts(tmp_path) == 1)
    threads.append(thread("a1", lambda: a.run_sync("k", ran.append, "a1")))
    await settle(lambda: a.pending("k") == 1)
    threads.append(thread("b0", lambda: decorated("b0")))
    await settle(lambda: posts(tmp_path) == 2)
    threads.append(thread("b1", lambda: decorated("b1")))
    await settle(lambda: b.pending("k") == 1 or "b0" in outcomes)  # ("raise": b0 answered)
    tasks = [asyncio.create_task(c.run("k", Runs.work(ran, "c0")))]  # type: ignore[arg-type]
    await settle(lambda: posts(tmp_path) == 3)
    tasks.append(asyncio.create_task(c.run("k", Runs.work(ran, "c1"))))  # type: ignore[arg-type]
    await settle(lambda: c.pending("k") == 1)
    await holder.release()
    results = await asyncio.wait_for(asyncio.gather(*tasks), PATIENCE)
    for started in threads:
        await asyncio.to_thread(started.join, PATIENCE)
    assert ran == ["c1"]
    assert results == ["c1", "c1"]
    assert outcomes["a0"] is None
    assert outcomes["a1"] is None
    assert isinstance(outcomes["b0"], Superseded)
    assert isinstance(outcomes["b1"], Superseded)
    assert [q.stats().superseded for q in (a, b, c)] == [2, 2, 1]
    assert await key_free(tmp_path)


async def test_a_thread_and_a_task_of_one_process_run_a_run_per_kind_the_newest_last(
    tmp_path: Path,
) -> None:
    """A process's newest work is a task's, its first a thread's (at the backend); another
    process's thread called between. A turn runs only work of its own kind (see the docs),
    so the thread's turn posts the thread's call: the other process's newer thread work runs,
    then the task's, newest, in a turn of its own. The process's older work never runs."""
    holder = Holder(tmp_path)
    await holder.hold()
    a, b = latest(tmp_path), latest(tmp_path)
    ran: list[str] = []
    outcomes: dict[str, Any] = {}

    def in_thread(queue: KeyedQueue, name: str) -> threading.Thread:
        def body() -> None:
            outcomes[name] = queue.run_sync("k", ran.append, name)

        started = threading.Thread(target=body)
        started.start()
        return started

    t1 = in_thread(a, "a-thread")
    await settle(lambda: posts(tmp_path) == 1)
    t2 = in_thread(b, "b-thread")
    await settle(lambda: posts(tmp_path) == 2)
    newest = asyncio.create_task(a.run("k", Runs.work(ran, "a-task")))  # type: ignore[arg-type]
    await settle(lambda: a.pending("k") == 1)
    await holder.release()
    assert await asyncio.wait_for(newest, PATIENCE) == "a-task"
    for started in (t1, t2):
        await asyncio.to_thread(started.join, PATIENCE)
    assert ran == ["b-thread", "a-task"], "not a run per kind, the newest last"
    assert outcomes == {"a-thread": None, "b-thread": None}  # (None: ran.append's result)


def test_a_fresh_event_loop_per_job_runs_a_run_per_loop_the_newest_last(tmp_path: Path) -> None:
    """Jobs of one queue, each in a thread of its own with asyncio.run; another queue's call
    before the last. A turn runs only work of its own event loop (see the docs): the other
    queue's newer work runs, then the newest, in its own turn; the oldest never runs."""
    loop = asyncio.new_event_loop()
    holder = Holder(tmp_path)
    loop.run_until_complete(holder.hold())
    a, b = latest(tmp_path), latest(tmp_path)
    ran: list[str] = []
    outcomes: dict[str, Any] = {}

    def job(queue: KeyedQueue, name: str) -> threading.Thread:
        def body() -> None:
            outcomes[name] = asyncio.run(queue.run("k", Runs.work(ran, name)))  # type: ignore[arg-type]

        started = threading.Thread(target=body)
        started.start()
        return started

    try:
        threads = [job(a, "a0")]
        wait_until(lambda: posts(tmp_path) == 1, "a0 in line")
        threads.append(job(b, "b0"))
        wait_until(lambda: posts(tmp_path) == 2, "b0 in line")
        threads.append(job(a, "a1"))
        wait_until(lambda: a.pending("k") == 1, "a1 waits")
        loop.run_until_complete(holder.release())
        for started in threads:
            started.join(PATIENCE)
        assert outcomes == {"a0": None, "b0": "b0", "a1": "a1"}
        assert ran == ["b0", "a1"], "not a run per loop, the newest last"
    finally:
        holder.gate.set()
        loop.run_until_complete(holder.queue.aclose())
        loop.close()


# -- 2. submit() handles on the losing side ------------------------------------------------


@pytest.mark.parametrize("mode", ["join", "raise"])
async def test_losing_handles_get_the_documented_answer(tmp_path: Path, mode: str) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path, on_superseded=mode), latest(tmp_path)
    ran = Runs()
    first = await older.submit("k", ran.work("h0"))
    await settle(lambda: posts(tmp_path) == 1)
    second = await older.submit("k", ran.work("h1"))  # replaces h0 in this process
    await settle(lambda: older.pending("k") >= 1 or first.done())
    winner = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    assert await winner == "newer"
    for handle in (first, second):
        if mode == "join":
            assert await asyncio.wait_for(handle, PATIENCE) is None
        else:
            with pytest.raises(Superseded):
                await asyncio.wait_for(handle, PATIENCE)
    assert ran == ["newer"]
    assert older.stats().superseded == 2
    assert newer.stats().superseded == 0
    await older.drain(raise_errors=True)  # nothing failed: nothing to raise
    assert await key_free(tmp_path)


@pytest.mark.parametrize("mode", ["join", "raise"])
async def test_dropped_losing_handles_leave_nothing_behind(tmp_path: Path, mode: str) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path, on_superseded=mode), latest(tmp_path)
    ran = Runs()
    for n in range(5):
        await older.submit("k", ran.work(f"h{n}"))  # dropped at once
        await settle(lambda: posts(tmp_path) == 1)
    gc.collect()
    winner = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    assert await winner == "newer"
    await asyncio.wait_for(older.drain(raise_errors=True), PATIENCE)  # nothing failed
    assert ran == ["newer"]
    assert older.stats().superseded == 5
    assert await key_free(tmp_path)


async def test_losing_handles_of_a_failed_newer_work_and_drain(
    tmp_path: Path,
) -> None:
    """join handles whose newer work failed in another process: Superseded ("failed there");
    a dropped one is not raised by drain(raise_errors=True), as in one process."""
    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path), latest(tmp_path)

    async def fails() -> None:
        raise ValueError("the sync failed")

    awaited = await older.submit("k", Runs().work("h0"))
    await settle(lambda: posts(tmp_path) == 1)
    dropped = await older.submit("k", Runs().work("h1"))
    await settle(lambda: older.pending("k") >= 1)
    winner = asyncio.create_task(newer.run("k", fails))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    with pytest.raises(ValueError, match="the sync failed"):
        await winner
    with pytest.raises(Superseded, match="failed there"):
        await awaited
    del dropped
    gc.collect()
    # as in one process: the newer work's error is its own caller's; a dropped handle that
    # followed it is not an unawaited failure of this queue's work (nothing to raise)
    await asyncio.wait_for(older.drain(raise_errors=True), PATIENCE)
    assert older.stats().superseded == 2
    assert await key_free(tmp_path)


# -- 3. timeouts ---------------------------------------------------------------------------


async def test_a_caller_times_out_while_its_turn_waits_again_behind_newer_work(
    tmp_path: Path,
) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    older = latest(tmp_path, timeout=1.0)
    newer = latest(tmp_path)
    started, go_on = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def slow() -> str:
        started.set()
        await go_on.wait()
        order.append("newer ran")
        return "newer"

    async def never() -> str:
        order.append("older ran")
        return "older"

    first = asyncio.create_task(older.run("k", never))
    await settle(lambda: posts(tmp_path) == 1)
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    await started.wait()  # the older turn judged, and waits again behind the running one
    assert fresh_posts(tmp_path) == 1
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(first, PATIENCE)
    assert time.monotonic() - began < 5.0
    order.append("older timed out")
    go_on.set()
    assert await second == "newer"
    assert order == ["older timed out", "newer ran"]
    assert older.stats().superseded == 0  # (timed out: a missed turn, not a replaced one)
    assert await key_free(tmp_path)


async def test_a_timed_follower_times_out_and_the_others_are_answered(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path), latest(tmp_path)
    ran = Runs()

    @older.queue_by_key(key="k", timeout=0.3)
    async def timed(name: str) -> str:
        ran.append(name)
        return name

    first = asyncio.create_task(older.run("k", ran.work("a0")))
    await settle(lambda: posts(tmp_path) == 1)
    follower = asyncio.create_task(timed("a1"))  # newest of its process, timed
    await settle(lambda: older.pending("k") == 1)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(follower, PATIENCE)
    last = asyncio.create_task(older.run("k", ran.work("a2")))  # untimed, newer still
    await settle(lambda: older.pending("k") == 1)
    winner = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    assert await winner == "newer"
    assert await first is None
    assert await last is None
    assert ran == ["newer"]
    assert await key_free(tmp_path)


async def test_timeout_0_never_waits_and_leaves_nothing(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    waiting = latest(tmp_path)
    ran = Runs()
    queued = asyncio.create_task(waiting.run("k", ran.work("queued")))
    await settle(lambda: posts(tmp_path) == 1)
    now = latest(tmp_path, timeout=0)
    with pytest.raises(TimeoutError):
        await now.run("k", ran.work("now"))
    assert posts(tmp_path) == 1
    assert len(FileBackend(tmp_path).line("k")) == 2  # the holder and the queued turn
    await holder.release()
    assert await queued == "queued"
    assert await now.run("k", ran.work("now")) == "now"  # a free key: it runs
    assert ran == ["queued", "now"]
    assert await key_free(tmp_path)


# -- 4. cancellation -----------------------------------------------------------------------


async def test_cancel_of_the_runner_waiting_at_the_backend_hands_on_to_its_followers(
    tmp_path: Path,
) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path), latest(tmp_path)
    ran = Runs()
    runner = asyncio.create_task(older.run("k", ran.work("a0")))
    await settle(lambda: posts(tmp_path) == 1)
    follower = asyncio.create_task(older.run("k", ran.work("a1")))
    await settle(lambda: older.pending("k") == 1)
    runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await runner
    # a1 takes the process's turn: a new ticket, a new post (the left one's stays written)
    await settle(lambda: posts(tmp_path) == 2 and len(FileBackend(tmp_path).line("k")) == 2)
    winner = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(tmp_path) == 3)
    await holder.release()
    assert await winner == "newer"
    assert await asyncio.wait_for(follower, PATIENCE) is None
    assert ran == ["newer"]
    assert await key_free(tmp_path)


async def test_cancel_of_the_newest_callers_while_their_turn_waits_again(
    tmp_path: Path,
) -> None:
    """The newer process's turn is ahead in line and waits again behind a plain turn; its
    callers are cancelled there: the older work, which a live process still waits for, runs."""
    holder = Holder(tmp_path)
    await holder.hold()
    one, two = latest(tmp_path), latest(tmp_path)
    ran = Runs()
    b0 = asyncio.create_task(two.run("k", ran.work("b0")))  # ahead in line
    await settle(lambda: posts(tmp_path) == 1)
    a = asyncio.create_task(one.run("k", ran.work("a")))
    await settle(lambda: posts(tmp_path) == 2)
    b1 = asyncio.create_task(two.run("k", ran.work("b1")))  # the newest
    await settle(lambda: two.pending("k") == 1)
    blocker = Holder(tmp_path)  # a plain turn behind them
    block_task = asyncio.create_task(blocker.hold())
    await settle(lambda: len(FileBackend(tmp_path).line("k")) == 4)
    await holder.release()
    await block_task  # it holds: both latest turns judged, and wait again behind it
    assert fresh_posts(tmp_path) == 2
    b0.cancel()
    b1.cancel()
    for task in (b0, b1):
        with pytest.raises(asyncio.CancelledError):
            await task
    await blocker.release()
    assert await asyncio.wait_for(a, PATIENCE) == "a"
    assert ran == ["a"]
    assert await key_free(tmp_path)


async def test_cancel_of_the_older_caller_while_its_turn_waits_again(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path), latest(tmp_path)
    started, go_on = asyncio.Event(), asyncio.Event()
    ran = Runs()

    async def slow() -> str:
        started.set()
        await go_on.wait()
        return "newer"

    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: posts(tmp_path) == 1)
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    await started.wait()
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    go_on.set()
    assert await second == "newer"
    assert ran == []
    assert await key_free(tmp_path)


# -- 5. max_hold ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["join", "raise"])
async def test_max_hold_cutting_the_newest_work(tmp_path: Path, mode: str) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    older = latest(tmp_path, on_superseded=mode)
    newer = latest(tmp_path, max_hold=0.2)
    ran = Runs()

    async def endless() -> None:
        await asyncio.Event().wait()

    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: posts(tmp_path) == 1)
    second = asyncio.create_task(newer.run("k", endless))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    with pytest.raises(HoldTimeout):
        await asyncio.wait_for(second, PATIENCE)
    if mode == "join":
        with pytest.raises(Superseded, match="failed there"):
            await asyncio.wait_for(first, PATIENCE)
    else:
        with pytest.raises(Superseded):
            await asyncio.wait_for(first, PATIENCE)
    assert ran == []
    assert older.stats().superseded == 1
    assert await key_free(tmp_path)


# -- 6. debounce ---------------------------------------------------------------------------


async def test_debounced_older_work_loses_to_a_newer_call_made_in_its_quiet_period(
    tmp_path: Path,
) -> None:
    """Newest by call time: a call made while another process's debounced burst was quiet
    is newer than that burst, though its post reaches the line first."""
    holder = Holder(tmp_path)
    await holder.hold()
    debounced = latest(tmp_path, debounce=0.3)
    other = latest(tmp_path)
    ran = Runs()
    burst = [asyncio.create_task(debounced.run("k", ran.work(f"d{n}"))) for n in range(3)]
    await settle(lambda: debounced.pending("k") == 3)
    newest = asyncio.create_task(other.run("k", ran.work("newest")))
    await settle(lambda: posts(tmp_path) == 1)
    await settle(lambda: posts(tmp_path) == 2)  # the quiet period ended: its post is in
    await holder.release()
    assert await newest == "newest"
    assert await asyncio.gather(*burst) == [None, None, None]
    assert ran == ["newest"]
    assert debounced.stats().superseded == 3
    assert await key_free(tmp_path)


async def test_debounced_newest_burst_wins(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    debounced = latest(tmp_path, debounce=0.05)
    other = latest(tmp_path, on_superseded="raise")
    ran = Runs()
    old = asyncio.create_task(other.run("k", ran.work("old")))
    await settle(lambda: posts(tmp_path) == 1)
    burst = [asyncio.create_task(debounced.run("k", ran.work(f"d{n}"))) for n in range(3)]
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    assert await asyncio.gather(*burst) == ["d2"] * 3
    with pytest.raises(Superseded):
        await old
    assert ran == ["d2"]
    assert await key_free(tmp_path)


# -- 7. hostile line file content ----------------------------------------------------------

#: Garbage and torn records: a torn W and R, a W of a ticket nobody holds, a ticket with no
#: pipe, bytes outside ASCII, a long line (longer than one read), a line cut without "\n".
GARBAGE = (
    b"W12\nR12:\nR:1\nW1.00000000000a:5:1\nT77777.0123456789ab\n"
    b"\x00\xff\xfe junk\nKzz\n?\n" + b"x" * 70000 + b"\nW1.0"
)


async def first_use(directory: Path) -> None:
    """Make and check the backend's directory (a turn on another key)."""
    queue = KeyedQueue(backend=FileBackend(directory))
    await queue.run("other", asyncio.sleep, 0)
    await queue.aclose()


@pytest.mark.parametrize("when", ["before", "during"])
async def test_garbage_in_the_line_file_does_not_keep_the_newest_from_running(
    tmp_path: Path, when: str
) -> None:
    await first_use(tmp_path)
    path = line_file(tmp_path, "k")
    if when == "before":
        path.write_bytes(GARBAGE + b"\n")
    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path), latest(tmp_path, on_superseded="raise")
    ran = Runs()
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: sum(ticket.startswith("T") for ticket in records(tmp_path)) >= 2)
    second = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: len(FileBackend(tmp_path).line("k")) == 3)
    if when == "during":
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)  # (after every record)
        os.write(fd, GARBAGE)
        os.close(fd)  # (cut short: the next append is glued to it)
    third = asyncio.create_task(newer.run("k", ran.work("newest")))
    await settle(lambda: newer.pending("k") == 1 or second.done())
    await holder.release()
    assert await asyncio.wait_for(third, PATIENCE) == "newest"
    with pytest.raises(Superseded):
        await second
    assert await asyncio.wait_for(first, PATIENCE) is None
    assert ran == ["newest"]
    assert await key_free(tmp_path)


FUTURE = b"R99999999999999999:1\n"  # what ran, as a line file left from before a reboot says


@pytest.mark.parametrize("mode", ["join", "raise"])
async def test_a_record_of_work_run_in_the_future_does_not_supersede_new_work(
    tmp_path: Path, mode: str
) -> None:
    """A line file left from before a reboot (the monotonic clock restarted) says that work
    called at a time later than now ran: new work on the key must run all the same."""
    assert int(FUTURE[1:].split(b":")[0]) > time.monotonic_ns()
    await first_use(tmp_path)
    line_file(tmp_path, "k").write_bytes(b"K6b\n" + FUTURE)
    queue = latest(tmp_path, on_superseded=mode)
    ran = Runs()
    assert await asyncio.wait_for(queue.run("k", ran.work("alone")), PATIENCE) == "alone"
    assert ran == ["alone"]


async def test_a_record_of_work_run_in_the_future_does_not_supersede_a_burst(
    tmp_path: Path,
) -> None:
    await first_use(tmp_path)
    holder = Holder(tmp_path)
    await holder.hold()
    fd = os.open(line_file(tmp_path, "k"), os.O_WRONLY | os.O_APPEND)
    os.write(fd, FUTURE)
    os.close(fd)
    older, newer = latest(tmp_path), latest(tmp_path)
    ran = Runs()
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: posts(tmp_path) == 1)
    second = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    assert await asyncio.wait_for(second, PATIENCE) == "newer"
    assert await asyncio.wait_for(first, PATIENCE) is None
    assert ran == ["newer"]


# -- 8. fork() inside the work -------------------------------------------------------------


@pytest.mark.parametrize("child", ["exits at once", "outlives the turn"])
async def test_a_child_forked_in_the_work_leaves_the_turn_and_the_line_alone(
    tmp_path: Path, child: str
) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    forking, other = latest(tmp_path), latest(tmp_path)
    ran = Runs()
    started, go_on = asyncio.Event(), asyncio.Event()
    read, write = os.pipe()
    pids: list[int] = []

    async def forks() -> str:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            if child == "outlives the turn":
                os.close(write)
                os.read(read, 1)
            os._exit(0)
        pids.append(pid)
        if child == "exits at once":
            await asyncio.to_thread(os.waitpid, pid, 0)
        started.set()
        await go_on.wait()
        ran.append("forks")
        return "forks"

    older = asyncio.create_task(other.run("k", ran.work("older")))
    await settle(lambda: posts(tmp_path) == 1)
    mine = asyncio.create_task(forking.run("k", forks))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    await started.wait()
    later = asyncio.create_task(other.run("k", ran.work("later")))  # comes while it runs
    await settle(lambda: other.pending("k") == 1)
    go_on.set()
    try:
        assert await asyncio.wait_for(mine, PATIENCE) == "forks"
        assert await asyncio.wait_for(later, PATIENCE) == "later"
        # (older's turn, in later's process, runs later's newer work: it follows it)
        assert await asyncio.wait_for(older, PATIENCE) == "later"
        assert ran == ["forks", "later"]
        assert await key_free(tmp_path)
    finally:
        os.close(write)
        os.close(read)
        if child == "outlives the turn":
            await asyncio.to_thread(os.waitpid, pids[0], 0)


# -- 9. a frozen process (SIGSTOP) ---------------------------------------------------------


async def test_a_frozen_process_whose_newer_work_waits_holds_up_only_until_it_thaws(
    tmp_path: Path, workers: list[Worker]
) -> None:
    directory, log = tmp_path / "lines", tmp_path / "log"
    holder = Holder(directory)
    await holder.hold()
    older, frozen = [
        await Worker.start(str(directory), str(log), "join", name=name, script=LATEST_WORKER)
        for name in ("older", "frozen")
    ]
    workers += [older, frozen]

    def posted_by(pid: int, fresh: bool | None = None) -> bool:
        return any(
            post.ticket.startswith(f"{pid}.") and (fresh is None or post.fresh == fresh)
            for post in parse(records(directory)).posts.values()
        )

    await older.send("burst 2 older")
    await older.expect("queued")
    await until(lambda: posted_by(older.pid), "the older work is in line")
    await frozen.send("burst 2 frozen")
    await frozen.expect("queued")
    await until(lambda: posted_by(frozen.pid), "the newer work is in line")
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        await until(lambda: stopped(frozen.pid), "the newer work's process is frozen")
        await holder.release()
        # the older turn judged, and waits again behind the frozen one, handed the key
        await until(lambda: posted_by(older.pid, fresh=True), "the older turn waits again")
        timed = latest(directory, timeout=0.3)
        plain = KeyedQueue(backend=FileBackend(directory), timeout=0.3)
        ran = Runs()
        began = time.monotonic()
        outcomes = await asyncio.gather(
            timed.run("k", ran.work("timed")),
            plain.run("k", ran.work("plain")),
            return_exceptions=True,
        )
        assert time.monotonic() - began < 10.0
        assert [type(outcome) for outcome in outcomes] == [TimeoutError, TimeoutError]
        assert ran == []
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    assert (await older.expect("answered"))[1:] == ["none", "none"]
    assert (await frozen.expect("answered"))[1:] == ["1", "1"]
    lines = log.read_text().split()
    assert lines.count("run") == 1
    assert f"{frozen.pid}" in lines
    assert await key_free(directory)
    for worker in (older, frozen):
        await worker.send("quit")
        assert await worker.finish() == 0
    await holder.queue.aclose()
