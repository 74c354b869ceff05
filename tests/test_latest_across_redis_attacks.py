"""Attacks on latest work shared across processes on Redis (``across="processes"``).

In-process attacks use several KeyedQueues, each with a RedisBackend of its own on one
namespace (tests/support/redis_latest.py: the backend cannot tell them from processes, each
has its own share, members and channel); kills and freezes use real processes
(tests/support/latest_worker.py). The scenarios mirror the file backend's
(test_latest_across.py, test_latest_across_attacks.py), then go where only Redis goes:
leases, grants that come late, a Redis that stalls or restarts, a cluster, the public wire.

Every order is driven by events and by the line's state in Redis, read from the side
(``Seen``); a test that waits for a lease to run out uses a short one (LEASE).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from inturn import BackendUnavailable, HoldTimeout, KeyedQueue, LeaseLost, Superseded
from inturn._bridge import backend_loop
from inturn.backends.redis import RedisBackend, _takeover
from inturn.backends.redis._calls import Calls
from inturn.backends.redis._loop import LoopShare

from support.faults import Proxy
from support.helpers import PATIENCE, settle, wait_until
from support.processes import Worker, stopped, until
from support.redis_latest import Processes, Runs
from support.servers import Server

LATEST_WORKER = Path(__file__).parent / "support" / "latest_worker.py"
#: The lease here (s): short, so that a dead or frozen process's place runs out within a test.
LEASE = 1.0
#: How long past its bound a call may take on a loaded machine before it counts as hanging.
SLACK = 3.0


@pytest.fixture
async def made(redis_url: str, namespace: str) -> AsyncIterator[Processes]:
    """Queues on the session's Redis, one "process" each; closed at the test's end."""
    processes = Processes(redis_url, namespace, LEASE)
    yield processes
    await processes.close()


@pytest.fixture
def proxy(own_redis: Server) -> Iterator[Proxy]:
    """A proxy in front of this test's own server (to hold Redis's replies)."""
    proxy = Proxy(own_redis.port).start()
    try:
        yield proxy
    finally:
        proxy.close()


async def answered(*calls: Any) -> list[Any]:
    """Each call's outcome (its result or error), within PATIENCE."""
    return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), PATIENCE)


def in_thread(name: str, call: Callable[[], Any], outcomes: dict[str, Any]) -> threading.Thread:
    """Run call in a thread of its own; its outcome (result or error) goes to outcomes[name]."""

    def body() -> None:
        try:
            outcomes[name] = call()
        except BaseException as error:
            outcomes[name] = error

    started = threading.Thread(target=body, name=name)
    started.start()
    return started


# -- 1. one run per burst, the newest ----------------------------------------------------


async def test_a_burst_spread_over_processes_runs_once_the_newest(made: Processes) -> None:
    """Guarantee: a burst spread over processes while the key is busy runs once, the newest;
    "join" callers elsewhere get None (it returned), "raise" callers Superseded, the runner's
    own process the newest's result; stats count each replaced work where it was called;
    nothing is left in Redis."""
    holder = made.holder()
    await holder.hold()
    modes = ("join", "raise", "join")
    queues = [made.latest(on_superseded=mode) for mode in modes]
    ran = Runs()
    calls = []
    for n in range(9):  # process by process, each one's burst after the one before posted
        queue = queues[n // 3]
        calls.append(asyncio.create_task(queue.run("k", ran.work(f"{n}"))))
        waiting = n % 3 if modes[n // 3] == "join" else min(n % 3, 1)
        await settle(
            lambda q=queue, w=waiting, n=n: (q.pending("k"), made.seen.posts()) == (w, n // 3 + 1)
        )
    await holder.release()
    outcomes = await answered(*calls)
    assert ran == ["8"]
    assert outcomes[:3] == [None, None, None]
    assert all(isinstance(outcome, Superseded) for outcome in outcomes[3:6])
    assert outcomes[6:] == ["8", "8", "8"]
    assert [queue.stats().superseded for queue in queues] == [3, 3, 2]
    assert [queue.stats().completed for queue in queues] == [0, 0, 1]
    assert await made.nothing_left()


async def test_a_burst_whose_newest_is_a_follower_of_the_first_in_line_runs_it_once(
    made: Processes,
) -> None:
    """Attack: five processes in line in call order, but the first one's process gets the
    newest call of all afterwards (its post in line is its oldest). Every post is judged
    stale once, so the rounds of judging go past the line's length. Guarantee: one run, the
    newest (the first process's follower), every other caller answered."""
    holder = made.holder()
    await holder.hold()
    queues = [made.latest() for _ in range(5)]
    ran = Runs()
    calls = []
    for n, queue in enumerate(queues):
        calls.append(asyncio.create_task(queue.run("k", ran.work(f"p{n}"))))
        await settle(lambda n=n: made.seen.posts() == n + 1)
    calls.append(asyncio.create_task(queues[0].run("k", ran.work("newest"))))
    await settle(lambda: queues[0].pending("k") == 1)
    await holder.release()
    outcomes = await answered(*calls)
    assert ran == ["newest"]
    assert outcomes == ["newest", None, None, None, None, "newest"]
    assert await made.nothing_left()


async def test_a_join_caller_learns_that_the_newer_work_failed(made: Processes) -> None:
    """Guarantee: a "join" caller whose work another process's newer work replaced gets
    Superseded ("failed there") when that work raised; the error itself stays its own."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest(), made.latest()

    async def fails() -> None:
        raise ValueError("the sync failed")

    first = asyncio.create_task(older.run("k", Runs().work("older")))
    await settle(lambda: made.seen.posts() == 1)
    second = asyncio.create_task(newer.run("k", fails))
    await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    with pytest.raises(ValueError, match="the sync failed"):
        await asyncio.wait_for(second, PATIENCE)
    with pytest.raises(Superseded, match="failed there"):
        await asyncio.wait_for(first, PATIENCE)
    assert await made.nothing_left()


async def test_work_called_after_the_newest_started_runs_after_it(made: Processes) -> None:
    """Guarantee: the running work is never replaced; a call that comes while it runs runs
    after it (the record of what ran is older than that call)."""
    holder = made.holder()
    await holder.hold()
    one, two = made.latest(), made.latest()
    started, go_on = asyncio.Event(), asyncio.Event()
    ran = Runs()

    async def slow() -> str:
        ran.append("first")
        started.set()
        await go_on.wait()
        return "first"

    first = asyncio.create_task(one.run("k", slow))
    await settle(lambda: made.seen.posts() == 1)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    later = asyncio.create_task(two.run("k", ran.work("later")))
    await settle(lambda: made.seen.posts() == 2)
    go_on.set()
    assert await answered(first, later) == ["first", "later"]
    assert ran == ["first", "later"]
    assert await made.nothing_left()


@pytest.mark.parametrize("leaves", ["cancelled", "timed out"])
async def test_when_the_newer_caller_leaves_the_older_work_runs(
    made: Processes, leaves: str
) -> None:
    """Guarantee: a newer work whose caller gives up before its turn stops counting: the
    older work, whose caller still waits, runs (its post was the newer one's only rival)."""
    holder = made.holder()
    await holder.hold()
    older = made.latest()
    newer = made.latest(timeout=0.3 if leaves == "timed out" else None)
    ran = Runs()
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: made.seen.posts() == 1)
    second = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: made.seen.posts() == 2)
    if leaves == "cancelled":
        second.cancel()
    with pytest.raises(asyncio.CancelledError if leaves == "cancelled" else TimeoutError):
        await asyncio.wait_for(second, PATIENCE)
    await settle(lambda: made.seen.posts() == 1)  # its place is given up
    await holder.release()
    assert await asyncio.wait_for(first, PATIENCE) == "older"
    assert ran == ["older"]
    assert await made.nothing_left()


async def test_plain_turns_in_the_same_line_keep_their_places_and_run(made: Processes) -> None:
    """Attack: plain turns (no post) between and behind latest ones. Guarantee: the plain
    turns run in their places, first come first served; the latest work runs once, the
    newest, never in a plain turn's place; every latest caller is answered."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest(), made.latest(on_superseded="raise")
    plain_one, plain_two = made.plain(), made.plain()
    order: list[str] = []

    def work(name: str) -> Callable[[], Any]:
        async def run() -> str:
            order.append(name)
            return name

        return run

    calls = [asyncio.create_task(older.run("k", work("older")))]
    await settle(lambda: made.seen.waiters() == 1)
    calls.append(asyncio.create_task(plain_one.run("k", work("plain 1"))))
    await settle(lambda: made.seen.waiters() == 2)
    calls.append(asyncio.create_task(newer.run("k", work("newer"))))
    await settle(lambda: made.seen.waiters() == 3)
    calls.append(asyncio.create_task(plain_two.run("k", work("plain 2"))))
    await settle(lambda: made.seen.waiters() == 4)
    await holder.release()
    outcomes = await answered(*calls)
    assert outcomes == [None, "plain 1", "newer", "plain 2"]
    # the older turn joined again behind the newer one: the plain turn ahead of both runs
    # first, the newer work in its place, then the plain turn behind it
    assert order == ["plain 1", "newer", "plain 2"]
    assert await made.nothing_left()


# -- 2. threads, a fresh event loop per job, submit, the decorator ------------------------


async def test_threads_and_decorated_defs_of_several_processes_run_the_newest_once(
    made: Processes,
) -> None:
    """Guarantee, from threads (run_sync; a decorated def) and tasks of three processes:
    one run, the newest (a task's); the thread callers elsewhere answered as their modes
    say; each queue counts its replaced works."""
    holder = made.holder()
    await holder.hold()
    a, b, c = made.latest(), made.latest(on_superseded="raise"), made.latest()
    ran = Runs()
    outcomes: dict[str, Any] = {}

    @b.queue_by_key(key="k")
    def decorated(name: str) -> str:
        ran.append(name)
        return name

    threads = [in_thread("a0", lambda: a.run_sync("k", ran.sync("a0")), outcomes)]
    await settle(lambda: made.seen.posts() == 1)
    threads.append(in_thread("a1", lambda: a.run_sync("k", ran.sync("a1")), outcomes))
    await settle(lambda: a.pending("k") == 1)
    threads.append(in_thread("b0", lambda: decorated("b0"), outcomes))
    await settle(lambda: made.seen.posts() == 2)
    threads.append(in_thread("b1", lambda: decorated("b1"), outcomes))
    await settle(lambda: b.pending("k") == 1 or "b0" in outcomes)  # ("raise": b0 answered)
    tasks = [asyncio.create_task(c.run("k", ran.work("c0")))]
    await settle(lambda: made.seen.posts() == 3)
    tasks.append(asyncio.create_task(c.run("k", ran.work("c1"))))
    await settle(lambda: c.pending("k") == 1)
    await holder.release()
    assert await answered(*tasks) == ["c1", "c1"]
    for started in threads:
        await asyncio.to_thread(started.join, PATIENCE)
    assert ran == ["c1"]
    assert outcomes["a0"] is None
    assert outcomes["a1"] is None
    assert isinstance(outcomes["b0"], Superseded)
    assert isinstance(outcomes["b1"], Superseded)
    assert [q.stats().superseded for q in (a, b, c)] == [2, 2, 1]
    assert await made.nothing_left()


def test_a_fresh_event_loop_per_job_runs_a_run_per_loop_the_newest_last(
    redis_url: str, namespace: str
) -> None:
    """Jobs of one queue, each asyncio.run in a thread of its own (a share per loop, closed
    with it); another process's call between. Guarantee (a turn runs only work of its own
    loop): the other process's newer work runs, then the newest in its own turn; the oldest
    never runs, and its caller gets None; nothing is left."""
    made = Processes(redis_url, namespace, LEASE)
    loop = asyncio.new_event_loop()
    holder = made.holder()
    loop.run_until_complete(holder.hold())
    a, b = made.latest(), made.latest()
    ran = Runs()
    outcomes: dict[str, Any] = {}

    def job(queue: KeyedQueue, name: str) -> threading.Thread:
        return in_thread(name, lambda: asyncio.run(queue.run("k", ran.work(name))), outcomes)

    try:
        threads = [job(a, "a0")]
        wait_until(lambda: made.seen.posts() == 1, "a0 in line")
        threads.append(job(b, "b0"))
        wait_until(lambda: made.seen.posts() == 2, "b0 in line")
        threads.append(job(a, "a1"))
        wait_until(lambda: a.pending("k") == 1, "a1 waits")
        loop.run_until_complete(holder.release())
        for started in threads:
            started.join(PATIENCE)
        assert outcomes == {"a0": None, "b0": "b0", "a1": "a1"}
        assert ran == ["b0", "a1"], "not a run per loop, the newest last"
        assert loop.run_until_complete(made.nothing_left())
    finally:
        holder.gate.set()
        loop.run_until_complete(made.close())
        loop.close()


async def test_the_decorator_and_submit_conflate_across_processes(made: Processes) -> None:
    holder = made.holder()
    await holder.hold()
    one, two = made.latest(), made.latest()
    ran = Runs()

    @one.queue_by_key(key="k")
    async def sync_manifest(version: int) -> int:
        ran.append(f"decorated {version}")
        return version

    decorated = asyncio.create_task(sync_manifest(1))
    await settle(lambda: made.seen.posts() == 1)
    handle = await two.submit("k", ran.work("submitted"))
    await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    assert await asyncio.wait_for(decorated, PATIENCE) is None
    assert await asyncio.wait_for(handle, PATIENCE) == "submitted"
    assert ran == ["submitted"]
    assert await made.nothing_left()


@pytest.mark.parametrize("mode", ["join", "raise"])
async def test_losing_handles_awaited_or_dropped_get_the_documented_answer(
    made: Processes, mode: str
) -> None:
    """Guarantee: submit() handles replaced by another process's newer work are answered
    (join: None; raise: Superseded), dropped ones leave nothing behind, drain() raises
    nothing of theirs."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest(on_superseded=mode), made.latest()
    ran = Runs()
    kept = [await older.submit("k", ran.work("h0"))]
    await settle(lambda: made.seen.posts() == 1)
    kept.append(await older.submit("k", ran.work("h1")))
    for n in range(2, 5):
        await older.submit("k", ran.work(f"h{n}"))  # dropped at once
    gc.collect()
    winner = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    assert await asyncio.wait_for(winner, PATIENCE) == "newer"
    for handle in kept:
        if mode == "join":
            assert await asyncio.wait_for(handle, PATIENCE) is None
        else:
            with pytest.raises(Superseded):
                await asyncio.wait_for(handle, PATIENCE)
    await asyncio.wait_for(older.drain(raise_errors=True), PATIENCE)
    assert ran == ["newer"]
    assert older.stats().superseded == 5
    assert await made.nothing_left()


# -- 3. timeouts ---------------------------------------------------------------------------


async def test_a_caller_times_out_while_its_turn_waits_again_behind_newer_work(
    made: Processes,
) -> None:
    """Attack: the older turn judged, joined again behind the newer work (a fresh post), and
    waits there while that work runs. Guarantee: its caller's timeout ends the wait
    (TimeoutError: its work did not run), its place is given up, the newer work goes on."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest(timeout=1.0), made.latest()
    started, go_on = asyncio.Event(), asyncio.Event()
    order: list[str] = []

    async def slow() -> str:
        started.set()
        await go_on.wait()
        order.append("newer ran")
        return "newer"

    first = asyncio.create_task(older.run("k", Runs().work("older")))
    await settle(lambda: made.seen.posts() == 1)
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    assert made.seen.fresh() == 1  # the older turn waits again, behind the running one
    began = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(first, PATIENCE)
    assert time.monotonic() - began < 1.0 + SLACK
    order.append("older timed out")
    await settle(lambda: made.seen.waiters() == 0)  # its place is given up
    go_on.set()
    assert await asyncio.wait_for(second, PATIENCE) == "newer"
    assert order == ["older timed out", "newer ran"]
    assert older.stats().superseded == 0  # (a missed turn, not a replaced one)
    assert await made.nothing_left()


async def test_timeout_0_never_waits_and_leaves_nothing(made: Processes) -> None:
    holder = made.holder()
    await holder.hold()
    waiting = made.latest()
    ran = Runs()
    queued = asyncio.create_task(waiting.run("k", ran.work("queued")))
    await settle(lambda: made.seen.posts() == 1)
    now = made.latest(timeout=0)
    with pytest.raises(TimeoutError):
        await now.run("k", ran.work("now"))
    assert (made.seen.posts(), made.seen.waiters()) == (1, 1)
    await holder.release()
    assert await asyncio.wait_for(queued, PATIENCE) == "queued"
    assert await now.run("k", ran.work("now")) == "now"  # a free key: it runs
    assert ran == ["queued", "now"]
    assert await made.nothing_left()


def trip(monkeypatch: pytest.MonkeyPatch, method: str, action: Callable[..., None]) -> list[str]:
    """Have Calls.<method> (a script call of a turn of latest work) call action(calls,
    member, member_id) the first time it is called, before it calls Redis; the ids of the
    members it was called for go into the list returned."""
    real = getattr(Calls, method)
    seen: list[str] = []

    def tripped(self: Calls, member: Any, member_id: str) -> Any:
        seen.append(member_id)
        if len(seen) == 1:
            action(self, member, member_id)
        return real(self, member, member_id)

    monkeypatch.setattr(Calls, method, tripped)
    return seen


#: (how a caller's turn is driven, the script whose answer Redis holds back)
HELD = [("task", "judge"), ("task", "again"), ("thread", "judge")]


@pytest.mark.xfail(
    strict=True,
    reason="defect: the JUDGE and AGAIN calls of a turn of latest work wait for Redis's "
    "answer unbounded by the caller's timeout (only the lease bounds them)",
)
@pytest.mark.parametrize(("driver", "stage"), HELD)
async def test_a_timeout_bounds_a_turn_whose_judging_redis_does_not_answer(
    proxy: Proxy,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    driver: str,
    stage: str,
) -> None:
    """Attack: Redis stops answering (a stall, a partition) just as the turn judges, or
    joins its line again. Guarantee: each caller's timeout bounds its wait, as always
    (TimeoutError: its work did not run), as the enqueue's does (a tenth of the lease at
    least); not the lease, which a stall shorter than it never reaches."""
    lease, timeout, held_for = 5.0, 1.0, 4.0  # (a plain turn's enqueue: a timeout of 0.5 s)
    made = Processes(proxy.url, namespace, lease)
    try:
        holder = made.holder()
        latest = made.latest(timeout=timeout)
        warm = (
            latest.run_sync("warm", lambda: None)
            if driver == "thread"
            else await latest.run("warm", asyncio.sleep, 0)
        )
        assert warm is None
        held = asyncio.Event()
        loop = asyncio.get_running_loop()
        method = stage if driver == "task" else f"{stage}_rest"
        trip(monkeypatch, method, lambda *_: (proxy.hold_replies(), loop.call_soon_threadsafe(held.set)))
        ran = Runs()
        outcomes: dict[str, Any] = {}
        if stage == "again":
            await holder.hold()
            newer = made.latest()
        if driver == "task":
            call: Any = asyncio.create_task(latest.run("k", ran.work("older")))
        else:
            call = in_thread("older", lambda: latest.run_sync("k", ran.sync("older")), outcomes)
        began = time.monotonic()
        if stage == "again":
            await settle(lambda: made.seen.posts() == 1)
            later = asyncio.create_task(newer.run("k", ran.work("newer")))
            await settle(lambda: made.seen.posts() == 2)
            holder.gate.set()
        await asyncio.wait_for(held.wait(), PATIENCE)
        assert time.monotonic() - began < timeout, "too slow a machine to reach the stage in time"
        if driver == "task":
            done, _ = await asyncio.wait({call}, timeout=held_for)
            over = bool(done)
        else:
            over = await asyncio.to_thread(call.join, held_for) or not call.is_alive()
        took = time.monotonic() - began
        proxy.thaw()
        if driver == "task":
            outcome = (await answered(call))[0]
        else:
            await asyncio.to_thread(call.join, PATIENCE)
            outcome = outcomes["older"]
        assert over, f"the caller was not answered within {held_for} s (timeout {timeout} s)"
        assert isinstance(outcome, TimeoutError), outcome
        assert took < timeout + lease / 10 + SLACK
        assert "older" not in ran
        if stage == "again":
            await holder.release()
            assert await asyncio.wait_for(later, PATIENCE) == "newer"
    finally:
        proxy.thaw()
        await made.close()


# -- 4. cancellation at each step of a turn ------------------------------------------------


@pytest.mark.parametrize("stage", ["judge", "again", "waiting again"])
async def test_cancelling_the_runner_at_each_step_hands_on_to_its_follower(
    made: Processes, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """Attack: the caller whose turn it is (a0, older; its process's newer call a1 follows
    it) is cancelled while its turn's JUDGE is on its way, while its AGAIN is, or while it
    waits again behind the newer work of another process (b). Guarantee: a0 gets its
    cancellation, its place is given up, a1 takes the process's turn, b runs once (the
    newest), a1 is answered (None: b returned), a plain turn behind them all runs, and
    nothing is left in Redis."""
    holder = made.holder()
    await holder.hold()
    a, b, plain = made.latest(), made.latest(), made.holder()
    ran = Runs()
    b_started, b_go = asyncio.Event(), asyncio.Event()

    async def b_work() -> str:
        ran.append("b")
        b_started.set()
        await b_go.wait()
        return "b"

    a0 = asyncio.create_task(a.run("k", ran.work("a0")))
    await settle(lambda: made.seen.posts() == 1)
    a1 = asyncio.create_task(a.run("k", ran.work("a1")))
    await settle(lambda: a.pending("k") == 1)
    b0 = asyncio.create_task(b.run("k", b_work))
    await settle(lambda: made.seen.posts() == 2)
    blocking = asyncio.create_task(plain.hold())  # (it keeps the line, and what ran, alive)
    await settle(lambda: made.seen.waiters() == 3)
    a_ids = made.seen.ids()[1:2]
    if stage in ("judge", "again"):
        trip(monkeypatch, stage, lambda *_: a0.cancel())
    await holder.release()
    if stage == "waiting again":
        await asyncio.wait_for(b_started.wait(), PATIENCE)
        assert made.seen.fresh() == 1  # a0's turn waits again, behind b, which runs
        a0.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(a0, PATIENCE)
    share = a_ids[0].split("/")[0]
    await settle(  # a1's turn is in line: a member of a's share, not a0's
        lambda: any(m.startswith(share) and m not in a_ids for m in made.seen.ids())
    )
    b_go.set()
    await asyncio.wait_for(plain.held.wait(), PATIENCE)
    await plain.release()
    await asyncio.wait_for(blocking, PATIENCE)
    assert await answered(a1, b0) == [None, "b"]
    assert ran == ["b"]
    assert await made.nothing_left()


async def test_cancelling_the_newest_callers_while_their_turn_waits_again(
    made: Processes,
) -> None:
    """Attack: the newer process's turn is ahead in line; both latest turns judge and wait
    again behind a plain turn; the newer process's callers are cancelled there. Guarantee:
    the older work, which a live caller still waits for, runs."""
    holder = made.holder()
    await holder.hold()
    one, two = made.latest(), made.latest()
    ran = Runs()
    b0 = asyncio.create_task(two.run("k", ran.work("b0")))  # ahead in line
    await settle(lambda: made.seen.posts() == 1)
    a = asyncio.create_task(one.run("k", ran.work("a")))
    await settle(lambda: made.seen.posts() == 2)
    b1 = asyncio.create_task(two.run("k", ran.work("b1")))  # the newest
    await settle(lambda: two.pending("k") == 1)
    blocker = made.holder()  # a plain turn behind them
    block_task = asyncio.create_task(blocker.hold())
    await settle(lambda: made.seen.waiters() == 3)
    await holder.release()
    await asyncio.wait_for(block_task, PATIENCE)  # it holds: both judged, both wait again
    assert made.seen.fresh() == 2
    b0.cancel()
    b1.cancel()
    for task in (b0, b1):
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, PATIENCE)
    await settle(lambda: made.seen.posts() == 1)
    await blocker.release()
    assert await asyncio.wait_for(a, PATIENCE) == "a"
    assert ran == ["a"]
    assert await made.nothing_left()


@pytest.mark.parametrize("mode", ["join", "raise"])
async def test_max_hold_cutting_the_newest_work(made: Processes, mode: str) -> None:
    """Guarantee: a newest work cut by max_hold counts as run and failed: the older
    callers elsewhere get Superseded (join: "failed there"); nothing else runs."""
    holder = made.holder()
    await holder.hold()
    older = made.latest(on_superseded=mode)
    newer = made.latest(max_hold=0.2)
    ran = Runs()

    async def endless() -> None:
        await asyncio.Event().wait()

    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: made.seen.posts() == 1)
    second = asyncio.create_task(newer.run("k", endless))
    await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    with pytest.raises(HoldTimeout):
        await asyncio.wait_for(second, PATIENCE)
    with pytest.raises(Superseded, match="failed there" if mode == "join" else ""):
        await asyncio.wait_for(first, PATIENCE)
    assert ran == []
    assert older.stats().superseded == 1
    assert await made.nothing_left()


@pytest.mark.parametrize("debounced", ["older", "newest"])
async def test_a_debounced_burst_against_another_process(made: Processes, debounced: str) -> None:
    """Guarantee: newest by call time, whatever reaches the line first: a call made in another
    process's quiet period is newer than that burst; a debounced burst called after the
    other process's call wins."""
    holder = made.holder()
    await holder.hold()
    quiet = made.latest(debounce=0.3 if debounced == "older" else 0.05)
    other = made.latest()
    ran = Runs()
    if debounced == "older":
        burst = [asyncio.create_task(quiet.run("k", ran.work(f"d{n}"))) for n in range(3)]
        await settle(lambda: quiet.pending("k") == 3)
        single = asyncio.create_task(other.run("k", ran.work("single")))
        await settle(lambda: made.seen.posts() == 2)  # the quiet period ended: its post is in
    else:
        single = asyncio.create_task(other.run("k", ran.work("single")))
        await settle(lambda: made.seen.posts() == 1)
        burst = [asyncio.create_task(quiet.run("k", ran.work(f"d{n}"))) for n in range(3)]
        await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    outcomes = await answered(single, *burst)
    if debounced == "older":
        assert outcomes == ["single", None, None, None]
        assert ran == ["single"]
    else:
        assert outcomes == [None, "d2", "d2", "d2"]
        assert ran == ["d2"]
    assert await made.nothing_left()
