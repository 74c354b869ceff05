"""Attacks on latest work shared across processes on Redis (``across="processes"``).

In-process attacks use several KeyedQueues, each with a RedisBackend of its own on one
namespace (tests/support/redis_latest.py: the backend cannot tell them from processes, each
has its own share, members and channel); kills and freezes use real processes
(tests/support/latest_worker.py). The scenarios mirror the file backend's
(test_latest_across.py, test_latest_across_attacks.py), then go where only Redis goes:
leases, grants that come late, a Redis that stalls or restarts, a cluster, the public wire.

Every order is driven by events and by the line's state in Redis, read from the side
(``Seen``); a test that waits for a lease to run out uses a short one (LEASE), the others
one that a loaded machine's heartbeat never misses (CALM).
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
import redis.connection

from inturn import BackendUnavailable, HoldTimeout, KeyedQueue, LeaseLost, Superseded
from inturn._bridge import backend_loop
from inturn.backends.redis import RedisBackend, _takeover
from inturn.backends.redis._calls import Calls
from inturn.backends.redis._loop import LoopShare

from support.faults import Proxy
from support.helpers import PATIENCE, settle, unavailable, wait_until
from support.latest_across import Runs, answered, in_thread
from support.processes import Worker, stopped, until
from support.redis_latest import Processes
from support.servers import Server

LATEST_WORKER = Path(__file__).parent / "support" / "latest_worker.py"
#: The lease here (s): short, so that a dead or frozen process's place runs out within a test.
LEASE = 1.0
#: The lease of the tests that wait none out (s): renewed every third of it, so that a
#: heartbeat that a loaded machine starves never loses a place the test relies on.
CALM = 5.0
#: How long past its bound a call may take on a loaded machine before it counts as hanging.
SLACK = 3.0


@pytest.fixture
async def made(redis_url: str, namespace: str) -> AsyncIterator[Processes]:
    """Queues on the session's Redis, one "process" each; closed at the test's end."""
    processes = Processes(redis_url, namespace, CALM)
    yield processes
    await processes.close()


@pytest.fixture
async def mortal(redis_url: str, namespace: str) -> AsyncIterator[Processes]:
    """As made, with the short lease (LEASE) of a test that waits for one to run out."""
    processes = Processes(redis_url, namespace, LEASE)
    yield processes
    await processes.close()


@pytest.fixture(params=["redis", "redis-cluster", "public wire"])
async def made_on(
    request: pytest.FixtureRequest,
    redis_urls: dict[str, str],
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Processes]:
    """As made, on each way to Redis: one server; a Redis Cluster (each backend on a
    RedisCluster client of its own); one server through redis-py's public API
    (INTURN_REDIS_WIRE=public: no connection taken over)."""
    if request.param == "redis-cluster":
        if "redis-cluster" not in redis_urls:
            unavailable("a Redis Cluster (redis-server and redis-cli)")
        processes = Processes(redis_urls["redis-cluster"], namespace, CALM, cluster=True)
    else:
        if request.param == "public wire":
            monkeypatch.setattr(_takeover, "ENABLED", False)
        processes = Processes(request.getfixturevalue("redis_url"), namespace, CALM)
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


# -- 1. one run per burst, the newest ----------------------------------------------------


async def test_a_burst_spread_over_processes_runs_once_the_newest(made_on: Processes) -> None:
    """Guarantee (one server, a cluster, the public wire): a burst spread over processes
    while the key is busy runs once, the newest; "join" callers elsewhere get None (it
    returned), "raise" callers Superseded, the runner's own process the newest's result;
    stats count each replaced work where it was called; nothing is left in Redis."""
    made = made_on
    holder = made.holder()
    await holder.hold()
    modes = ("join", "raise", "join")
    queues = [made.latest(on_superseded=mode) for mode in modes]
    ran = Runs()
    calls = []
    for n in range(9):  # process by process, each one's burst after the one before posted
        queue = queues[n // 3]
        calls.append(asyncio.create_task(queue.run("k", ran.work(f"{n}"))))
        # (the first waits at the backend; a "raise" caller replaced is answered at once)
        waiting = n % 3 if modes[n // 3] == "join" else min(n % 3, 1)

        def reached(
            queue: KeyedQueue = queue, state: tuple[int, int] = (waiting, n // 3 + 1)
        ) -> bool:
            return (queue.pending("k"), made.seen.posts()) == state

        await settle(reached)
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
        await settle(lambda: made.seen.posts() == len(calls))
    calls.append(asyncio.create_task(queues[0].run("k", ran.work("newest"))))
    await settle(lambda: queues[0].pending("k") == 1)
    await holder.release()
    outcomes = await answered(*calls)
    assert ran == ["newest"]
    assert outcomes == ["newest", None, None, None, None, "newest"]
    assert await made.nothing_left()


async def test_plain_turns_in_the_same_line_keep_their_places_and_run(made_on: Processes) -> None:
    """Attack: plain turns (no post) between and behind latest ones. Guarantee: the plain
    turns run in their places, first come first served; the latest work runs once, the
    newest, never in a plain turn's place; every latest caller is answered."""
    made = made_on
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
    made = Processes(redis_url, namespace, CALM)
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


async def test_a_thread_and_a_task_of_one_process_run_a_run_per_kind_the_newest_last(
    made: Processes,
) -> None:
    """A process's newest work is a task's, its first a thread's (at the backend); another
    process's thread called between. Guarantee (a turn runs only work of its own kind): the
    thread's turn posts the thread's call: the other process's newer thread work runs, then
    the task's, newest, in a turn of its own; the process's older work never runs."""
    holder = made.holder()
    await holder.hold()
    a, b = made.latest(), made.latest()
    ran = Runs()
    outcomes: dict[str, Any] = {}
    t1 = in_thread("a-thread", lambda: a.run_sync("k", ran.sync("a-thread")), outcomes)
    await settle(lambda: made.seen.posts() == 1)
    t2 = in_thread("b-thread", lambda: b.run_sync("k", ran.sync("b-thread")), outcomes)
    await settle(lambda: made.seen.posts() == 2)
    newest = asyncio.create_task(a.run("k", ran.work("a-task")))
    await settle(lambda: a.pending("k") == 1)
    await holder.release()
    assert await asyncio.wait_for(newest, PATIENCE) == "a-task"
    for started in (t1, t2):
        await asyncio.to_thread(started.join, PATIENCE)
    assert ran == ["b-thread", "a-task"], "not a run per kind, the newest last"
    assert outcomes == {"a-thread": None, "b-thread": "b-thread"}
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


@pytest.mark.parametrize("driver", ["task", "thread"])
async def test_a_caller_times_out_while_its_turn_waits_again_behind_newer_work(
    made: Processes, driver: str
) -> None:
    """Attack: the older turn (a task's, or a thread's) judged, joined again behind the newer
    work (a fresh post), and waits there while that work runs. Guarantee: its caller's
    timeout ends the wait (TimeoutError: its work did not run), its place is given up, the
    newer work goes on."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest(timeout=1.0), made.latest()
    if driver == "thread":
        await asyncio.to_thread(older.run_sync, "warm", lambda: None)
    started, go_on = asyncio.Event(), asyncio.Event()
    order: list[str] = []
    outcomes: dict[str, Any] = {}

    async def slow() -> str:
        started.set()
        await go_on.wait()
        order.append("newer ran")
        return "newer"

    if driver == "task":
        first: Any = asyncio.create_task(older.run("k", Runs().work("older")))
    else:
        first = in_thread("older", lambda: older.run_sync("k", Runs().sync("older")), outcomes)
    await settle(lambda: made.seen.posts() == 1)
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    assert made.seen.fresh() == 1  # the older turn waits again, behind the running one
    began = time.monotonic()
    if driver == "task":
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(first, PATIENCE)
    else:
        await asyncio.to_thread(first.join, PATIENCE)
        assert isinstance(outcomes["older"], TimeoutError)
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


def trip(monkeypatch: pytest.MonkeyPatch, method: str, action: Callable[..., object]) -> list[str]:
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
    lease, timeout, held_for = 4.0, 0.8, 3.0  # (a plain turn's enqueue: a timeout of 0.8 s)
    made = Processes(proxy.url, namespace, lease)
    try:
        holder = made.holder()
        latest = made.latest(timeout=timeout)
        if driver == "thread":  # (a thread's first turn starts the backend loop's share)
            await asyncio.to_thread(latest.run_sync, "warm", lambda: None)
        else:
            await latest.run("warm", asyncio.sleep, 0)
        held = asyncio.Event()
        loop = asyncio.get_running_loop()

        def hold_replies(*_: Any) -> None:  # (as the call is about to be written)
            proxy.hold_replies()
            loop.call_soon_threadsafe(held.set)

        trip(monkeypatch, stage if driver == "task" else f"{stage}_rest", hold_replies)
        ran = Runs()
        outcomes: dict[str, Any] = {}
        await holder.hold()  # (a turn that starts its line anew has nothing to judge)
        if stage == "again":
            newer = made.latest()
        if driver == "task":
            call: Any = asyncio.create_task(latest.run("k", ran.work("older")))
        else:
            call = in_thread("older", lambda: latest.run_sync("k", ran.sync("older")), outcomes)
        began = time.monotonic()
        await settle(lambda: made.seen.posts() == 1)
        if stage == "again":
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
        await holder.release()
        if stage == "again":
            assert await asyncio.wait_for(later, PATIENCE) == "newer"
    finally:
        proxy.thaw()
        await made.close()


# -- 4. cancellation at each step of a turn ------------------------------------------------


@pytest.mark.parametrize("stage", ["judge", "again", "waiting again"])
async def test_cancelling_the_runner_at_each_step_hands_on_to_its_follower(
    made_on: Processes, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """Attack: the caller whose turn it is (a0, older; its process's newer call a1 follows
    it) is cancelled while its turn's JUDGE is on its way, while its AGAIN is, or while it
    waits again behind the newer work of another process (b). Guarantee: a0 gets its
    cancellation, its place is given up, a1 takes the process's turn, b runs once (the
    newest), a1 is answered (None: b returned), a plain turn behind them all runs, and
    nothing is left in Redis. On a cluster too, whose calls of one process may overtake
    each other (a leave its judge or its AGAIN)."""
    made = made_on
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


@pytest.mark.parametrize("cut", ["max_hold", "cancelled"])
@pytest.mark.parametrize("mode", ["join", "raise"])
async def test_the_newest_work_cut_while_it_runs(made: Processes, mode: str, cut: str) -> None:
    """Attack: the newest work is cut as it runs, by max_hold or by its caller's
    cancellation. Guarantee (as on the file backend: a work that started counts as run, and
    failed): the older callers elsewhere get Superseded (join: "failed there"); nothing
    else runs, nothing is left."""
    holder = made.holder()
    await holder.hold()
    older = made.latest(on_superseded=mode)
    newer = made.latest(max_hold=0.2) if cut == "max_hold" else made.latest()
    ran = Runs()
    started = asyncio.Event()

    async def endless() -> None:
        started.set()
        await asyncio.Event().wait()

    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: made.seen.posts() == 1)
    second = asyncio.create_task(newer.run("k", endless))
    await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    if cut == "cancelled":
        await asyncio.wait_for(started.wait(), PATIENCE)
        second.cancel()
    with pytest.raises(HoldTimeout if cut == "max_hold" else asyncio.CancelledError):
        await asyncio.wait_for(second, PATIENCE)
    with pytest.raises(Superseded, match="failed there" if mode == "join" else None):
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


class Landed(BaseException):
    """Stands for an exception a signal handler raises, or one thrown into a thread."""


@pytest.mark.parametrize("stage", ["judge", "again"])
async def test_an_exception_landing_as_a_threads_turn_reads_its_judge_or_again_leaves_nothing(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """Attack: an exception lands in the thread of the older turn just as it has read Redis's
    answer to its JUDGE (it holds the key) or to its AGAIN (it is in line again), before the
    steps see it. Guarantee: its caller gets it (the work did not run), its place is given
    up at once (not a lease later: a long lease here), and the newer work runs once."""
    made = Processes(redis_url, namespace, 30.0)
    try:
        holder = made.holder()
        await holder.hold()
        older, newer = made.latest(), made.latest()
        await asyncio.to_thread(older.run_sync, "warm", lambda: None)
        armed = threading.local()
        tripped = trip(monkeypatch, f"{stage}_rest", lambda *_: setattr(armed, "on", True))
        real = redis.connection.AbstractConnection.read_response

        def read_response(connection: Any, *args: Any, **kwargs: Any) -> Any:
            reply = real(connection, *args, **kwargs)
            if getattr(armed, "on", False):
                armed.on = False
                raise Landed
            return reply

        monkeypatch.setattr(redis.connection.AbstractConnection, "read_response", read_response)
        ran = Runs()
        outcomes: dict[str, Any] = {}
        first = in_thread("older", lambda: older.run_sync("k", ran.sync("older")), outcomes)
        await settle(lambda: made.seen.posts() == 1)
        older_id = made.seen.ids()[-1]
        second = asyncio.create_task(newer.run("k", ran.work("newer")))
        await settle(lambda: made.seen.posts() == 2)
        await holder.release()
        await asyncio.to_thread(first.join, PATIENCE)
        assert isinstance(outcomes["older"], Landed)
        assert tripped[0] == older_id  # (it landed at the older turn's read, as meant)
        began = time.monotonic()
        await settle(lambda: older_id not in made.seen.ids())
        assert time.monotonic() - began < 5.0  # (its lease: 30 s)
        assert await asyncio.wait_for(second, PATIENCE) == "newer"
        assert ran == ["newer"]
        assert await made.key_free()
    finally:
        await made.close()


# -- 5. grants that come late: the earlier token never makes a turn think it holds ---------


class Heard(list[tuple[str, int]]):
    """Every grant a share's leases were handed (Leases.granted: a grant's message, or a
    renewal's reply), as (member id, token), recorded as it is handled."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        from inturn.backends.redis._lease import Leases

        real = Leases.granted

        def granted(leases: Leases, member_id: str, token: int) -> None:
            real(leases, member_id, token)
            self.append((member_id, token))

        monkeypatch.setattr(Leases, "granted", granted)


@pytest.mark.parametrize(
    ("driver", "late"), [("task", "message"), ("thread", "message"), ("task", "renewal")]
)
async def test_a_grant_naming_the_turns_earlier_token_after_it_joined_again_is_ignored(
    made: Processes, monkeypatch: pytest.MonkeyPatch, driver: str, late: str
) -> None:
    """Attack: the older turn was granted the key (token t), judged, and joined the line
    again behind newer work; then a grant naming t reaches its process: the grant's message
    again (a duplicate, or one delayed in a subscription that was down), or the reply of a
    renewal sent while it held the key. Guarantee: it never makes the turn think it holds the
    key: it waits on (no BackendUnavailable for a place that is fine, no run beside the newer
    work), and is answered once the newer work ran."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest(), made.latest()
    if driver == "thread":
        await asyncio.to_thread(older.run_sync, "warm", lambda: None)
    ran = Runs()
    outcomes: dict[str, Any] = {}
    judged: list[tuple[Any, str, int]] = []  # (member, its id, its token): the older turn
    renewals: list[Any] = []
    heard = Heard(monkeypatch)

    def judging(calls: Calls, member: Any, member_id: str) -> None:
        judged.append((member, member_id, member.token))
        if late == "renewal":  # (on the share's link before the judge: it says "holds, t")
            renewals.append(calls.renew(member, member_id))

    judges = trip(monkeypatch, "judge" if driver == "task" else "judge_rest", judging)
    started, go_on = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        ran.append("newer")
        started.set()
        await go_on.wait()
        return "newer"

    if driver == "task":
        first: Any = asyncio.create_task(older.run("k", ran.work("older")))
    else:
        first = in_thread("older", lambda: older.run_sync("k", ran.sync("older")), outcomes)
    await settle(lambda: made.seen.posts() == 1)
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    assert made.seen.fresh() == 1  # the older turn waits again, behind the running work
    ((member, member_id, token),) = judged
    assert token > 0
    if late == "message":
        share = member_id.split("/")[0]
        channel = f"inturn:{made.namespace}:wake:{share}"
        assert made.seen.redis.publish(channel, f"{member_id} {token}") == 1
    else:
        state, value = await asyncio.wait_for(renewals[0].future, PATIENCE)
        assert (state, int(value)) == (1, token)
        older_backend = older.backend
        assert isinstance(older_backend, RedisBackend)
        share_of: LoopShare = older_backend._session()
        share_of.leases.granted(member_id, int(value))  # (as the heartbeat hands a reply on)
    await settle(lambda: heard.count((member_id, token)) == 2)  # its grant, and this one
    assert not member.waiting.done(), "the turn took a grant of its earlier place for its new"
    assert (made.seen.fresh(), made.seen.posts()) == (1, 2)
    go_on.set()
    assert await asyncio.wait_for(second, PATIENCE) == "newer"
    if driver == "task":
        assert await asyncio.wait_for(first, PATIENCE) is None
    else:
        await asyncio.to_thread(first.join, PATIENCE)
        assert outcomes["older"] is None
    assert judges.count(member_id) == 2  # judged as granted, then once newer work ran
    assert ran == ["newer"]
    assert await made.nothing_left()


# -- 6. processes killed or frozen, a Redis that restarts ----------------------------------


async def latest_worker(made: Processes, log: Path, name: str, mode: str = "join") -> Worker:
    """A real process of latest work on made's line (tests/support/latest_worker.py)."""
    spec = f"redis:{made.url}#{made.namespace}#{made.lease}"
    return await Worker.start(spec, str(log), mode, "k", name=name, script=LATEST_WORKER)


@pytest.mark.parametrize("fate", ["killed", "frozen"])
async def test_the_newest_works_process_dead_or_frozen_past_its_lease_stops_counting(
    made: Processes, mortal: Processes, tmp_path: Path, workers: list[Worker], fate: str
) -> None:
    """Attack: the process of the newest work dies (SIGKILL) or freezes (SIGSTOP) while its
    turn waits in line. Guarantee: its post counts while its lease holds, then no more: the
    newest live work (this process's older one) runs, within about a lease; a frozen process
    that thaws is answered truthfully (its work did not run: BackendUnavailable), and never
    runs its work beside another; nothing is left in Redis. (Only the victim's lease is
    short: this process's places outlast a loaded machine's heartbeat.)"""
    log = tmp_path / "log"
    holder = made.holder()
    await holder.hold()
    older = made.latest()
    ran = Runs()
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: made.seen.posts() == 1)
    victim = await latest_worker(mortal, log, "victim")
    workers.append(victim)
    await victim.send("burst 1 newest")
    await victim.expect("queued")
    assert made.seen.pids()[-1] == victim.pid
    assert made.seen.posts() == 2
    os.kill(victim.pid, signal.SIGKILL if fate == "killed" else signal.SIGSTOP)
    try:
        if fate == "frozen":
            await until(lambda: stopped(victim.pid), "the victim is frozen")
        began = time.monotonic()
        await holder.release()
        assert await asyncio.wait_for(first, PATIENCE) == "older"
        assert time.monotonic() - began < 2 * LEASE + SLACK
        assert ran == ["older"]
    finally:
        if fate == "frozen":
            os.kill(victim.pid, signal.SIGCONT)
    if fate == "frozen":
        assert await victim.expect("answered") == [str(victim.pid), "error:BackendUnavailable"]
        await victim.send("quit")
        assert await victim.finish() == 0
    assert not log.exists() or "run" not in log.read_text()
    assert await made.nothing_left()


@pytest.mark.parametrize("when", ["waiting", "waiting again"])
async def test_a_redis_restarted_mid_burst_fails_the_waiters_truthfully(
    own_redis: Server, namespace: str, when: str
) -> None:
    """Attack: Redis restarts, empty, while a burst of two processes waits (before any
    judged, or with the older turn waiting again behind the newer work, which runs).
    Guarantee: every waiter gets BackendUnavailable (its work did not run) within about a
    lease, nothing hangs; a turn that ran learns its lease is lost (LeaseLost); the key works
    again afterwards."""
    made = Processes(own_redis.url, namespace, LEASE)
    try:
        holder = made.holder()
        await holder.hold()
        older, newer = made.latest(), made.latest()
        ran = Runs()
        started, go_on = asyncio.Event(), asyncio.Event()

        async def slow() -> str:
            ran.append("newer")
            started.set()
            await go_on.wait()
            return "newer"

        first = asyncio.create_task(older.run("k", ran.work("older")))
        await settle(lambda: made.seen.posts() == 1)
        second = asyncio.create_task(newer.run("k", slow))
        await settle(lambda: made.seen.posts() == 2)
        if when == "waiting again":
            holder.gate.set()
            await asyncio.wait_for(started.wait(), PATIENCE)
            assert made.seen.fresh() == 1
        own_redis.stop(kill=True)
        own_redis.start()
        began = time.monotonic()
        with pytest.raises(BackendUnavailable):
            await asyncio.wait_for(first, PATIENCE)
        if when == "waiting":
            with pytest.raises(BackendUnavailable):
                await asyncio.wait_for(second, PATIENCE)
            assert ran == []
        assert time.monotonic() - began < 2 * LEASE + SLACK
        go_on.set()
        with pytest.raises(LeaseLost):
            await (holder.release() if when == "waiting" else asyncio.wait_for(second, PATIENCE))
        if when == "waiting again":
            assert ran == ["newer"]
            await holder.release()
        after = made.latest().run("k", ran.work("after"))  # (the key works again)
        assert await asyncio.wait_for(after, PATIENCE) == "after"
        assert await made.nothing_left()
    finally:
        await made.close()


async def test_a_holder_frozen_past_its_lease_does_not_make_older_work_run_after_newer(
    made: Processes, mortal: Processes
) -> None:
    """Attack: the oldest work (a's, in a thread) runs, and its process's heartbeat freezes
    past the lease (the backend loop blocked, as in a paused VM): its work stops counting.
    c (older) and b (newer) waited: c judged and joined again behind b, b ran, a plain turn
    holds now, c waits behind it. Then a's work ends, and its release reaches Redis.
    Guarantee: the frozen holder's release does not count: c, older than what ran, is
    answered (None) and never runs after b. (Only a's lease is short.)"""
    a = mortal.latest()
    await asyncio.to_thread(a.run_sync, "warm", lambda: None)  # (its share, on the backend loop)
    ran = Runs()
    outcomes: dict[str, Any] = {}
    a_running, a_go = threading.Event(), threading.Event()

    def a_work() -> str:
        ran.append("a")
        a_running.set()
        a_go.wait(PATIENCE)
        return "a"

    frozen, thaw = threading.Event(), threading.Event()
    a_thread = in_thread("a", lambda: a.run_sync("k", a_work), outcomes)
    try:
        await asyncio.to_thread(a_running.wait, PATIENCE)
        c, b, plain = made.latest(), made.latest(), made.holder()
        c_call = asyncio.create_task(c.run("k", ran.work("c")))
        await settle(lambda: made.seen.waiters() == 1)
        b_call = asyncio.create_task(b.run("k", ran.work("b")))
        await settle(lambda: made.seen.waiters() == 2)
        blocking = asyncio.create_task(plain.hold())
        await settle(lambda: made.seen.waiters() == 3)

        def freeze() -> None:  # (on the backend loop: its heartbeat stops while this blocks)
            frozen.set()
            thaw.wait(PATIENCE)

        backend_loop().call_soon_threadsafe(freeze)
        await asyncio.to_thread(frozen.wait, PATIENCE)  # a's heartbeat stops: its lease runs out
        await asyncio.wait_for(blocking, PATIENCE)  # c joined again, b ran: the plain turn holds
        assert await asyncio.wait_for(b_call, PATIENCE) == "b"
        assert made.seen.fresh() == 1  # c waits again, behind the plain turn
        a_go.set()
        await asyncio.to_thread(a_thread.join, PATIENCE)
        assert isinstance(outcomes["a"], LeaseLost)  # (its lease ran out while it ran)
    finally:
        a_go.set()
        thaw.set()
    await plain.release()
    outcome = await asyncio.wait_for(c_call, PATIENCE)
    assert ran == ["a", "b"], "older work ran after newer work had run"
    assert outcome is None
    assert await made.nothing_left()


@pytest.mark.parametrize("stage", ["judge", "again"])
async def test_a_line_lost_as_the_turn_judges_or_joins_again_fails_it_truthfully(
    own_redis: Server, namespace: str, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    """Attack: Redis loses the line (FLUSHALL: a failover, a restart without persistence)
    just before the older turn's JUDGE, or its AGAIN, reaches it. Guarantee: the turn learns
    it is gone (BackendUnavailable: its work did not run), so does the newer waiter (within
    about a lease), nothing runs, nothing hangs, and the key works afterwards."""
    made = Processes(own_redis.url, namespace, LEASE)
    try:
        holder = made.holder()
        await holder.hold()
        older, newer = made.latest(), made.latest()
        trip(monkeypatch, stage, lambda *_: made.seen.redis.flushall())
        ran = Runs()
        first = asyncio.create_task(older.run("k", ran.work("older")))
        await settle(lambda: made.seen.posts() == 1)
        second = asyncio.create_task(newer.run("k", ran.work("newer")))
        await settle(lambda: made.seen.posts() == 2)
        began = time.monotonic()
        await holder.release()
        outcomes = await answered(first, second)
        assert [type(outcome) for outcome in outcomes] == [BackendUnavailable] * 2, outcomes
        assert time.monotonic() - began < 2 * LEASE + SLACK
        assert ran == []
        after = made.latest().run("k", ran.work("after"))  # (the key works again)
        assert await asyncio.wait_for(after, PATIENCE) == "after"
        assert await made.nothing_left()
    finally:
        await made.close()


async def test_closing_the_backend_while_its_turn_judges_never_runs_the_work_without_the_key(
    made: Processes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: the backend of a turn of latest work is closed (another queue on it closes
    it, the app shuts down) while the turn, granted the key, is judging. Guarantee (close():
    waiters get BackendUnavailable, a holder keeps its lease): the turn either holds the key
    or fails; its work never runs while Redis has given the key to the plain turn behind it."""
    holder = made.holder()
    await holder.hold()
    latest = made.latest()
    backend = latest.backend
    assert isinstance(backend, RedisBackend)
    ran = Runs()
    started, go_on = asyncio.Event(), asyncio.Event()

    async def work() -> str:
        ran.append("latest")
        started.set()
        await go_on.wait()
        return "latest"

    call = asyncio.create_task(latest.run("k", work))
    await settle(lambda: made.seen.posts() == 1)
    plain = made.holder()
    behind = asyncio.create_task(plain.hold())
    await settle(lambda: made.seen.waiters() == 2)
    closing: list[asyncio.Future[None]] = []
    trip(monkeypatch, "judge", lambda *_: closing.append(asyncio.ensure_future(backend.aclose())))
    await holder.release()
    waited = asyncio.ensure_future(started.wait())
    await asyncio.wait({call, waited}, return_when=asyncio.FIRST_COMPLETED)
    both = False
    if started.is_set():  # its work runs: does Redis still give it the key?
        await asyncio.wait_for(behind, PATIENCE)
        both = not call.done() and plain.held.is_set()
    go_on.set()
    outcome = (await answered(call))[0]
    waited.cancel()
    await asyncio.wait_for(closing[0], PATIENCE)
    await asyncio.wait_for(behind, PATIENCE)
    await plain.release()
    assert not both, "the work ran while a plain turn of another process held the key"
    assert isinstance(outcome, BackendUnavailable), outcome
    assert "closed" in str(outcome)  # (not a lease run out: the backend was closed)
    assert ran == []


async def test_closing_the_backend_while_its_turn_waits_again_gives_its_place_up(
    made: Processes,
) -> None:
    """Guarantee: a backend closed while its turn of latest work waits again (behind newer
    work that runs) answers its caller with BackendUnavailable and has left the line by the
    time aclose() returns; the newer work is undisturbed."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest(), made.latest()
    started, go_on = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        started.set()
        await go_on.wait()
        return "newer"

    first = asyncio.create_task(older.run("k", Runs().work("older")))
    await settle(lambda: made.seen.posts() == 1)
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: made.seen.posts() == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    assert made.seen.fresh() == 1
    closed = older.backend
    assert isinstance(closed, RedisBackend)
    await asyncio.wait_for(closed.aclose(), PATIENCE)
    assert (made.seen.posts(), made.seen.waiters()) == (1, 0)
    with pytest.raises(BackendUnavailable, match="closed"):
        await asyncio.wait_for(first, PATIENCE)
    go_on.set()
    assert await asyncio.wait_for(second, PATIENCE) == "newer"
    assert await made.nothing_left()


# -- 7. what an operator sees -------------------------------------------------------------


async def test_lines_and_inspect_show_when_latest_work_was_called(made: Processes) -> None:
    """Guarantee: lines() (and python -m inturn inspect) show a holder's and a waiter's
    latest work as such, with how long ago it was called; a plain turn shows none."""
    runner, waiter, plain = made.latest(), made.latest(), made.holder()
    started, go_on = asyncio.Event(), asyncio.Event()

    async def slow() -> str:
        started.set()
        await go_on.wait()
        return "runner"

    running = asyncio.create_task(runner.run("k", slow))
    await asyncio.wait_for(started.wait(), PATIENCE)
    waiting = asyncio.create_task(waiter.run("k", Runs().work("waiter")))
    await settle(lambda: made.seen.waiters() == 1)
    blocking = asyncio.create_task(plain.hold())
    await settle(lambda: made.seen.waiters() == 2)
    backend = runner.backend
    assert isinstance(backend, RedisBackend)
    (line,) = await backend.lines()
    assert line.key == "k"
    assert line.holder is not None
    assert line.holder.latest_called is not None
    assert 0 <= line.holder.latest_called < PATIENCE
    assert [w.latest_called is not None for w in line.waiters] == [True, False]
    assert line.holder.latest_called >= line.waiters[0].latest_called  # type: ignore[operator]
    command = [sys.executable, "-m", "inturn", "inspect", "--redis", made.url]
    shown = await asyncio.to_thread(
        subprocess.run,
        [*command, "--namespace", made.namespace],
        capture_output=True,
        text=True,
        timeout=PATIENCE,
    )
    assert shown.returncode == 0, shown.stderr
    out = shown.stdout.splitlines()
    assert "latest work called" in out[2], out  # the holder
    assert "latest work called" in out[3], out  # the first waiter
    assert "latest work called" not in out[4], out  # the plain turn
    go_on.set()
    assert await answered(running, waiting) == ["runner", "waiter"]
    await asyncio.wait_for(blocking, PATIENCE)
    await plain.release()
    assert await made.nothing_left()
