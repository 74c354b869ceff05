"""The guarantees every backend keeps, run against each: in process, file, Redis, PostgreSQL.

Every test takes ``queue`` (a :class:`KeyedQueue` on the backend under test)
or ``make_queue`` (the same with settings of the test's own), from
``conftest.py``, which parametrises them over the backends. Keys are ``str``
or ``int``, which every backend shares. What only one backend does is tested
in that backend's own module.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from inturn import KeyedQueue, QueueClosed, QueueFull
from inturn.backends import Backend
from inturn.backends.file import FileBackend

from support.helpers import (
    PATIENCE,
    QueueFactory,
    Recorder,
    checkpoints,
    settle,
    unavailable,
    wait_until,
)
from support.redis_checks import waiting

if sys.version_info < (3, 11):
    from exceptiongroup import ExceptionGroup

BACKENDS = ("local", "file", "redis", "valkey", "redis-cluster", "postgres")


@pytest.fixture(params=BACKENDS)
async def backend(
    request: pytest.FixtureRequest, tmp_path: Path, redis_urls: dict[str, str]
) -> AsyncIterator[Backend | None]:
    """Each backend in turn, with a fresh place for its lines; None is the in-process default.

    On a Redis server, the test's namespace must hold no key once the test is over.
    """
    kind = request.param
    if kind == "local":
        yield None
    elif kind == "file":
        yield FileBackend(tmp_path / "lines")
    elif kind == "postgres":
        pytest.importorskip("psycopg")
        from inturn.backends.postgres import PostgresBackend

        from support.pg_checks import advisory_locks_left

        url = request.getfixturevalue("postgres_url")  # a server only for this backend
        backend = PostgresBackend.from_url(url, namespace=f"t-{uuid.uuid4().hex[:12]}")
        yield backend
        # No lock held and no waiter queued once the work is done (before aclose,
        # whose closing of every session would free them anyway).
        left = await advisory_locks_left(url)
        await backend.aclose()
        assert left == []
    else:
        from inturn.backends.redis import RedisBackend

        from support.redis_checks import cluster_keys_left, keys_left

        if kind not in redis_urls:
            unavailable(f"a {kind} server")
        namespace = f"t-{uuid.uuid4().hex[:12]}"
        if kind == "redis-cluster":
            from redis.asyncio.cluster import RedisCluster

            client = RedisCluster.from_url(redis_urls[kind])
            backend = RedisBackend(client, namespace=namespace, owns_client=True)
            yield backend
            await backend.aclose()
            assert await cluster_keys_left(redis_urls[kind], namespace) == []
        else:
            backend = RedisBackend.from_url(redis_urls[kind], namespace=namespace)
            yield backend
            await backend.aclose()
            assert await keys_left(redis_urls[kind], namespace) == []


@pytest.fixture
def make_queue(backend: Backend | None) -> QueueFactory:
    """KeyedQueue(**settings) on the backend under test."""
    return functools.partial(KeyedQueue, backend=backend)


@pytest.fixture
def queue(make_queue: QueueFactory) -> KeyedQueue:
    return make_queue()


# -- exclusion and order ------------------------------------------------------------


async def test_threads_and_tasks_share_each_line(queue: KeyedQueue) -> None:
    inside: list[str] = []
    overlaps: list[str] = []
    done: list[str] = []

    def body(name: str) -> None:
        if inside:
            overlaps.append(name)
        inside.append(name)
        done.append(name)
        inside.remove(name)

    def thread(n: int) -> None:
        for i in range(10):
            with queue.keyed("k"):
                body(f"thread{n}-{i}")

    async def task(i: int) -> None:
        await queue.run("k", body, f"task{i}")
        await asyncio.sleep(0)

    # A task first: a Redis Cluster client serves one loop, which threads then go through.
    await task(-1)
    await asyncio.gather(
        *(asyncio.to_thread(thread, n) for n in range(3)), *(task(i) for i in range(20))
    )
    assert overlaps == []
    assert len(done) == 51
    assert queue.active_count == 0


# A thread waits in line (a real blocking wait, not a poll) until a task lets go.
async def test_a_thread_waits_for_a_task_in_fifo_order(queue: KeyedQueue) -> None:
    order: list[str] = []
    gate = asyncio.Event()

    async def hold() -> None:
        async with queue.keyed("k"):
            await gate.wait()
            order.append("task")

    holder = asyncio.create_task(hold())
    await settle(lambda: queue.is_active("k"))
    thread = asyncio.ensure_future(asyncio.to_thread(queue.run_sync, "k", order.append, "thread"))
    await settle(lambda: queue.pending("k") == 1)
    late = asyncio.create_task(queue.run("k", order.append, "late task"))
    await settle(lambda: queue.pending("k") == 2)
    gate.set()
    await asyncio.gather(holder, thread, late)
    assert order == ["task", "thread", "late task"]


async def test_same_key_never_runs_twice_at_once(queue: KeyedQueue, recorder: Recorder) -> None:
    results = await asyncio.gather(
        *(queue.run("k", recorder.body("k", i, steps=3)) for i in range(20))
    )
    assert results == list(range(20))
    assert recorder.overlaps == []
    assert recorder.started == list(range(20))


async def test_gather_order_is_start_order(queue: KeyedQueue, recorder: Recorder) -> None:
    names = [f"t{i}" for i in range(50)]
    await asyncio.gather(*(queue.run("k", recorder.body("k", n)) for n in names))
    assert recorder.started == names
    assert recorder.finished == names


async def test_create_task_order_is_start_order(queue: KeyedQueue, recorder: Recorder) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", recorder.body("k", "holder", gate=gate)))
    tasks = [asyncio.create_task(queue.run("k", recorder.body("k", i))) for i in range(10)]
    await settle(lambda: queue.pending("k") == 10)
    gate.set()
    await asyncio.gather(holder, *tasks)
    assert recorder.started == ["holder", *range(10)]


async def test_different_keys_run_concurrently(queue: KeyedQueue, recorder: Recorder) -> None:
    gate = asyncio.Event()
    a = asyncio.create_task(queue.run("a", recorder.body("a", "a", gate=gate)))
    await settle(lambda: recorder.started == ["a"])
    # b completes while a still holds its own key: b never waited for a.
    assert await queue.run("b", recorder.body("b", "b")) == "b"
    assert not a.done()
    assert queue.pending("a") == 0
    gate.set()
    assert await a == "a"


async def test_run_returns_plain_results_and_awaits_awaitables(queue: KeyedQueue) -> None:
    assert await queue.run("k", lambda x, y=0: x + y, 1, y=2) == 3

    async def coro(x: int) -> int:
        return x * 2

    assert await queue.run("k", coro, 21) == 42
    future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    future.set_result("from a future")
    assert await queue.run("k", lambda: future) == "from a future"


async def test_the_key_is_held_until_an_awaitable_result_finishes(
    queue: KeyedQueue, recorder: Recorder
) -> None:
    gate = asyncio.Event()
    first = asyncio.create_task(queue.run("k", lambda: recorder.body("k", 1, gate=gate)()))
    second = asyncio.create_task(queue.run("k", recorder.body("k", 2)))
    await settle(lambda: queue.pending("k") == 1 and recorder.started == [1])
    gate.set()
    await asyncio.gather(first, second)
    assert recorder.started == [1, 2]
    assert recorder.overlaps == []


# -- errors ---------------------------------------------------------------------------


async def test_an_error_reaches_its_caller_only_and_the_next_still_runs(
    queue: KeyedQueue, recorder: Recorder
) -> None:
    results = await asyncio.gather(
        queue.run("k", recorder.body("k", 0)),
        queue.run("k", recorder.body("k", 1, error=ValueError("boom"))),
        queue.run("k", recorder.body("k", 2)),
        return_exceptions=True,
    )
    assert results[0] == 0
    assert isinstance(results[1], ValueError)
    assert results[2] == 2
    assert recorder.started == [0, 1, 2]
    assert queue.active_count == 0


async def test_a_sync_error_from_fn_releases_the_key(queue: KeyedQueue) -> None:
    def broken() -> None:
        raise KeyError("sync")

    with pytest.raises(KeyError):
        await queue.run("k", broken)
    assert not queue.is_active("k")
    assert await queue.run("k", lambda: "next") == "next"


# -- cancellation -----------------------------------------------------------------------


async def test_cancelled_waiter_leaves_without_disturbing_the_line(
    queue: KeyedQueue, recorder: Recorder
) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", recorder.body("k", "holder", gate=gate)))
    waiters = [asyncio.create_task(queue.run("k", recorder.body("k", i))) for i in range(5)]
    await settle(lambda: queue.pending("k") == 5)
    waiters[2].cancel()
    await settle(lambda: queue.pending("k") == 4)
    gate.set()
    await holder
    for i, task in enumerate(waiters):
        if i == 2:
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            assert await task == i
    assert recorder.started == ["holder", 0, 1, 3, 4]
    assert queue.active_count == 0


async def test_cancelled_holder_releases_the_key(queue: KeyedQueue, recorder: Recorder) -> None:
    never = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", recorder.body("k", "holder", gate=never)))
    waiter = asyncio.create_task(queue.run("k", recorder.body("k", "next")))
    await settle(lambda: queue.pending("k") == 1)
    holder.cancel()
    assert await waiter == "next"
    assert holder.cancelled()
    assert recorder.overlaps == []
    assert queue.active_count == 0


async def test_waiter_cancelled_as_it_is_handed_the_key_passes_it_on(
    queue: KeyedQueue, recorder: Recorder
) -> None:
    gate = asyncio.Event()
    handed: list[asyncio.Task[Any]] = []

    async def holder() -> None:
        async with queue.keyed("k"):
            await gate.wait()
        # The release just handed the key to the first waiter, which has not
        # run yet. Cancel it in this same step: the moment of hand-off.
        handed[0].cancel()

    first = asyncio.create_task(holder())
    await settle(lambda: queue.is_active("k"))
    handed.append(asyncio.create_task(queue.run("k", recorder.body("k", "cancelled"))))
    second = asyncio.create_task(queue.run("k", recorder.body("k", "second")))
    third = asyncio.create_task(queue.run("k", recorder.body("k", "third")))
    await settle(lambda: queue.pending("k") == 3)
    gate.set()
    await first
    with pytest.raises(asyncio.CancelledError):
        await handed[0]
    assert await second == "second"
    assert await third == "third"
    assert recorder.started == ["second", "third"]
    assert recorder.overlaps == []
    assert queue.active_count == 0


async def test_run_waiter_cancelled_at_hand_off_from_run_holder(queue: KeyedQueue) -> None:
    order: list[str] = []
    victim: list[asyncio.Task[Any]] = []
    gate = asyncio.Event()

    async def hold() -> None:
        order.append("holder")
        await gate.wait()  # until both waiters stand in line

    async def holder() -> None:
        await queue.run("k", hold)
        victim[0].cancel()  # same step as the hand-off

    async def body(name: str) -> None:
        order.append(name)

    first = asyncio.create_task(holder())
    await settle(lambda: order == ["holder"])
    victim.append(asyncio.create_task(queue.run("k", body, "victim")))
    after = asyncio.create_task(queue.run("k", body, "after"))
    await settle(lambda: queue.pending("k") == 2)
    gate.set()
    await first
    await asyncio.gather(victim[0], after, return_exceptions=True)
    assert victim[0].cancelled()
    assert order == ["holder", "after"]
    assert queue.active_count == 0


async def test_waiter_cancelled_just_before_the_release_that_empties_the_line(
    queue: KeyedQueue,
) -> None:
    gate = asyncio.Event()
    victim: list[asyncio.Task[Any]] = []
    again = asyncio.Event()

    async def holder() -> None:
        async with queue.keyed("k"):
            await gate.wait()
            # In one step: cancel the only waiter, release (the line empties,
            # as the cancelled waiter no longer counts), and take the key anew.
            victim[0].cancel()
        async with queue.keyed("k"):
            assert queue.pending("k") == 0
            await again.wait()
            # The cancelled waiter left the old line, not this new one.
            assert queue.pending("k") == 0

    first = asyncio.create_task(holder())
    await settle(lambda: queue.is_active("k"))
    victim.append(asyncio.create_task(queue.run("k", lambda: "never")))
    await settle(lambda: queue.pending("k") == 1)
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await victim[0]
    again.set()
    await first
    assert queue.active_count == 0


async def test_cancelling_every_waiter_leaves_the_key_to_the_holder_then_frees_it(
    queue: KeyedQueue,
) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    waiters = [asyncio.create_task(queue.run("k", lambda: None)) for _ in range(100)]
    await settle(lambda: queue.pending("k") == 100)
    for task in waiters:
        task.cancel()
    await settle(lambda: queue.pending("k") == 0)
    assert queue.is_active("k")
    gate.set()
    await holder
    assert queue.active_count == 0


# -- reentrancy -------------------------------------------------------------------------


async def test_holder_taking_its_key_again_runs_at_once(queue: KeyedQueue) -> None:
    async def inner() -> str:
        return "inner"

    async def outer() -> tuple[str, str]:
        nested = await queue.run("k", inner)
        async with queue.keyed("k", "other"):
            deeper = await queue.run("k", inner)
        return nested, deeper

    assert await queue.run("k", outer) == ("inner", "inner")
    assert queue.active_count == 0


async def test_a_reentrant_call_does_not_release_the_outer_turn(queue: KeyedQueue) -> None:
    seen: list[bool] = []

    async def outer() -> None:
        await queue.run("k", asyncio.sleep, 0)
        seen.append(queue.is_active("k"))
        async with queue.keyed("k"):
            pass
        seen.append(queue.is_active("k"))

    await queue.run("k", outer)
    assert seen == [True, True]
    assert not queue.is_active("k")


async def test_child_task_of_the_holder_waits_its_turn(queue: KeyedQueue) -> None:
    order: list[str] = []
    children: list[asyncio.Task[None]] = []

    async def child() -> None:
        order.append("child")

    async def holder() -> None:
        order.append("holder start")
        children.append(asyncio.create_task(queue.run("k", child)))
        await settle(lambda: queue.pending("k") == 1)  # the child stands in line
        order.append("holder end")

    await queue.run("k", holder)
    await children[0]
    assert order == ["holder start", "holder end", "child"]


async def test_reentrancy_with_a_waiter_behind_the_holder(queue: KeyedQueue) -> None:
    order: list[str] = []
    gate = asyncio.Event()

    async def outer() -> None:
        await gate.wait()
        await queue.run("k", order.append, "nested")
        order.append("outer end")

    first = asyncio.create_task(queue.run("k", outer))
    await settle(lambda: queue.is_active("k"))
    second = asyncio.create_task(queue.run("k", order.append, "second"))
    await settle(lambda: queue.pending("k") == 1)
    gate.set()
    await asyncio.gather(first, second)
    assert order == ["nested", "outer end", "second"]


# -- eviction --------------------------------------------------------------------------


# -- timeouts ----------------------------------------------------------------------------


async def test_turn_not_reached_in_time_raises_and_never_runs(
    recorder: Recorder, make_queue: QueueFactory
) -> None:
    # A timeout covers a backend's connecting too: connect before, with none.
    await make_queue().run("warm-up", lambda: None)
    queue = make_queue(timeout=0.01)
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", recorder.body("k", "holder", gate=gate)))
    await settle(lambda: recorder.started == ["holder"])
    late = asyncio.create_task(queue.run("k", recorder.body("k", "late")))
    behind = asyncio.create_task(queue.run("k", recorder.body("k", "behind")))
    with pytest.raises(TimeoutError, match="'k'"):
        await late
    with pytest.raises(TimeoutError):  # 'behind' timed out as well (on its own timer: it
        await behind  # may not have run out yet when late's did)
    assert queue.pending("k") == 0
    gate.set()
    assert await holder == "holder"
    assert recorder.started == ["holder"]
    assert queue.active_count == 0


async def test_timed_out_waiter_does_not_disturb_the_others(
    recorder: Recorder, make_queue: QueueFactory
) -> None:
    queue = make_queue()
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", recorder.body("k", "holder", gate=gate)))
    await settle(lambda: recorder.started == ["holder"])
    before = asyncio.create_task(queue.run("k", recorder.body("k", "before")))

    async def impatient() -> None:
        async with queue.keyed("k", timeout=0.01):
            recorder.started.append("impatient")

    gone = asyncio.create_task(impatient())
    after = asyncio.create_task(queue.run("k", recorder.body("k", "after")))
    with pytest.raises(TimeoutError):
        await gone
    gate.set()
    await asyncio.gather(holder, before, after)
    assert recorder.started == ["holder", "before", "after"]


async def test_timeout_zero_takes_a_free_key_and_refuses_a_busy_one(queue: KeyedQueue) -> None:
    # (connected first: a try-lock that must connect gets a margin of 1 s for it, which a
    # new PostgreSQL connection on a loaded 2-core machine can outlast)
    await queue.run("k", lambda: None)
    async with queue.keyed("k", timeout=0):
        pass
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    with pytest.raises(TimeoutError, match=r"at once \(timeout=0\): it needed its place in"):
        async with queue.keyed("k", timeout=0):
            pytest.fail("the block ran without its turn")
    assert queue.pending("k") == 0
    gate.set()
    await holder


async def test_a_timeout_in_the_backends_line_names_it_and_the_callers_limit(
    backend: Backend | None, make_queue: QueueFactory
) -> None:
    # Issue 31: two queues on one backend (two processes, as the backend sees them);
    # the second's turn on a key the first holds waits in the backend's line, which
    # is given only the time left. Before: "not reached in time" (file, Redis), or
    # "within 0.299... s" (PostgreSQL), and no word of what it waited for. In process
    # (no backend), both turns are one queue's, and it waits in that queue's line.
    queue = make_queue(timeout=0.3)
    holder_queue = queue if backend is None else make_queue()
    # (connected, by a run as the one below, however long that takes on a loaded machine:
    # the wait below is the line's)
    await make_queue().run("warm-up", lambda: None)
    gate = asyncio.Event()
    holding = asyncio.Event()

    async def hold() -> None:
        holding.set()
        await gate.wait()

    holder = asyncio.create_task(holder_queue.run("k", hold))
    await asyncio.wait_for(holding.wait(), PATIENCE)
    try:
        with pytest.raises(TimeoutError) as late:
            await queue.run("k", pytest.fail, "ran without its turn")
    finally:
        gate.set()
    await holder
    said = str(late.value)
    assert said.startswith(
        "inturn: the turn for key 'k' was not reached within 0.3 s: it was waiting for its "
        "place in the key's line"
    ), said
    assert said.endswith("; the work did not run"), said


async def test_explicit_none_overrides_the_queue_timeout(make_queue: QueueFactory) -> None:
    # (connected first: a try-lock that must connect has a margin of 1 s for it, which a
    # new PostgreSQL connection can outlast on a busy machine)
    await make_queue().run("warm-up", lambda: None)
    queue = make_queue(timeout=0)
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))

    async def patient() -> str:
        async with queue.keyed("k", timeout=None):
            return "ran"

    waiter = asyncio.create_task(patient())
    await settle(lambda: queue.pending("k") == 1)
    gate.set()
    assert await waiter == "ran"
    await holder


async def test_timeout_covers_every_key_of_a_multi_key_turn(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("b", gate.wait))
    await settle(lambda: queue.is_active("b"))
    with pytest.raises(TimeoutError):
        async with queue.keyed("a", "b", "c", timeout=0.01):
            pytest.fail("ran without every turn")
    # Whatever keys were taken before the timeout were released again.
    assert queue.active_keys == {"b"}
    gate.set()
    await holder


# -- max_pending ---------------------------------------------------------------------------


async def test_max_pending_refuses_at_once_and_drops_nothing(
    recorder: Recorder, make_queue: QueueFactory
) -> None:
    queue = make_queue(max_pending=2)
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", recorder.body("k", "holder", gate=gate)))
    await settle(lambda: recorder.started == ["holder"])  # granted, on a shared backend too
    w1 = asyncio.create_task(queue.run("k", recorder.body("k", "w1")))
    w2 = asyncio.create_task(queue.run("k", recorder.body("k", "w2")))
    await settle(lambda: queue.pending("k") == 2)
    with pytest.raises(QueueFull, match="max_pending=2"):
        await queue.run("k", recorder.body("k", "refused"))
    # Other keys are not limited by this key's line.
    assert await queue.run("other", recorder.body("other", "other")) == "other"
    w1.cancel()
    await settle(lambda: queue.pending("k") == 1)
    w3 = asyncio.create_task(queue.run("k", recorder.body("k", "w3")))
    await settle(lambda: queue.pending("k") == 2)
    gate.set()
    await asyncio.gather(holder, w2, w3)
    assert recorder.started == ["holder", "other", "w2", "w3"]


async def test_max_pending_zero_allows_only_a_free_key(make_queue: QueueFactory) -> None:
    queue = make_queue(max_pending=0)
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    with pytest.raises(QueueFull):
        async with queue.keyed("k"):
            pass
    gate.set()
    await holder
    async with queue.keyed("k"):
        pass


# -- bad input --------------------------------------------------------------------------------


async def test_keyed_needs_a_key(queue: KeyedQueue) -> None:
    with pytest.raises(TypeError, match="at least one key"):
        queue.keyed()


async def test_run_needs_a_callable(queue: KeyedQueue) -> None:
    with pytest.raises(TypeError, match="callable"):
        await queue.run("free", 42)  # type: ignore[call-overload]
    assert queue.active_count == 0
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("busy", gate.wait))
    await settle(lambda: queue.is_active("busy"))
    # refused before waiting for the turn, not after
    with pytest.raises(TypeError, match="needs a callable, got 42"):
        await queue.run("busy", 42)  # type: ignore[call-overload]
    assert queue.pending("busy") == 0
    gate.set()
    await holder


async def test_a_turn_outside_a_task_is_refused(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    errors: list[BaseException] = []

    def from_a_callback() -> None:
        coro = queue.run("k", lambda: None)
        try:
            coro.send(None)
        except BaseException as error:
            errors.append(error)

    asyncio.get_running_loop().call_soon(from_a_callback)
    await settle(lambda: bool(errors))
    assert isinstance(errors[0], RuntimeError)
    assert "inside an asyncio task" in str(errors[0])
    gate.set()
    await holder


# -- several keys ---------------------------------------------------------------------------


async def test_overlapping_key_sets_in_opposite_orders_do_not_deadlock(
    queue: KeyedQueue,
) -> None:
    held: list[tuple[str, ...]] = []
    go = asyncio.Event()

    async def both(*keys: str) -> None:
        await go.wait()
        async with queue.keyed(*keys) as turn:
            held.append(tuple(map(str, turn.keys)))
            await checkpoints(3)

    tasks = [asyncio.create_task(both("a", "b")), asyncio.create_task(both("b", "a"))]
    tasks += [asyncio.create_task(both("b", "c", "a")) for _ in range(3)]
    await checkpoints()
    go.set()
    await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert len(held) == 5
    assert held[0] == held[1]  # one global order, whatever order the caller wrote
    assert queue.active_count == 0


async def test_multi_key_turn_excludes_each_single_key(
    queue: KeyedQueue, recorder: Recorder
) -> None:
    gate = asyncio.Event()

    async def pair() -> None:
        async with queue.keyed("a", "b"):
            recorder.started.append("pair")
            await gate.wait()
            recorder.finished.append("pair")

    first = asyncio.create_task(pair())
    await settle(lambda: recorder.started == ["pair"])
    a = asyncio.create_task(queue.run("a", recorder.body("a", "a")))
    b = asyncio.create_task(queue.run("b", recorder.body("b", "b")))
    await settle(lambda: queue.pending("a") == 1 and queue.pending("b") == 1)
    gate.set()
    await asyncio.gather(first, a, b)
    assert recorder.started[0] == "pair"
    assert sorted(recorder.started[1:]) == ["a", "b"]


async def test_duplicate_keys_count_once(queue: KeyedQueue) -> None:
    async with queue.keyed("a", "a", "b") as turn:
        assert sorted(map(str, turn.keys)) == ["a", "b"]
        assert queue.active_count == 2


async def test_a_multi_key_waiter_cancelled_midway_releases_what_it_took(
    queue: KeyedQueue,
) -> None:
    gate = asyncio.Event()
    first, second = map(str, queue.keyed("a", "b").keys)  # the global order
    holder = asyncio.create_task(queue.run(second, gate.wait))
    await settle(lambda: queue.is_active(second))

    async def both() -> None:
        async with queue.keyed("a", "b"):
            pytest.fail("ran without both turns")

    waiter = asyncio.create_task(both())
    await settle(lambda: queue.pending(second) == 1)
    assert queue.is_active(first)  # taken while it waits for the second key
    waiter.cancel()
    await settle(lambda: not queue.is_active(first))
    gate.set()
    await holder
    assert queue.active_count == 0


async def test_keyed_block_cannot_be_entered_twice_at_once(queue: KeyedQueue) -> None:
    block = queue.keyed("k")
    async with block:
        with pytest.raises(RuntimeError, match="already entered"):
            await block.__aenter__()
    async with block:  # entering again after it ended is fine
        assert queue.is_active("k")


async def test_turn_tokens_only_grow(queue: KeyedQueue) -> None:
    tokens = []
    for _ in range(3):
        async with queue.keyed("k") as turn:
            tokens.append(turn.token)
        async with queue.keyed("other", "k") as turn:
            tokens.append(turn.token)
    assert tokens == sorted(set(tokens))
    assert repr(turn).startswith("<Turn keys=")
    assert turn.lease_lost is False


# -- introspection --------------------------------------------------------------------------


async def test_introspection_follows_the_line(queue: KeyedQueue) -> None:
    assert not queue.is_active("k")
    assert queue.pending("k") == 0
    assert queue.current("k") is None
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    assert queue.active_keys == {"k"}
    assert queue.active_count == 1
    assert queue.pending("k") == 0
    waiters = [asyncio.create_task(queue.run("k", lambda: None)) for _ in range(3)]
    await settle(lambda: queue.pending("k") == 3)
    assert "'k': held, 3 waiting" in repr(queue)
    gate.set()
    await asyncio.gather(holder, *waiters)
    assert queue.active_count == 0
    assert repr(queue).startswith("<KeyedQueue open")
    assert repr(queue).endswith(", 0 active {}>")


async def test_current_resolves_with_the_holders_result(queue: KeyedQueue) -> None:
    gate = asyncio.Event()

    async def work() -> str:
        await gate.wait()
        return "result"

    holder = asyncio.create_task(queue.run("k", work))
    await settle(lambda: queue.is_active("k"))
    current = queue.current("k")
    assert current is not None
    gate.set()
    assert await current == "result"
    assert await holder == "result"


async def test_current_raises_the_holders_error(queue: KeyedQueue) -> None:
    gate = asyncio.Event()

    async def work() -> None:
        await gate.wait()
        raise ValueError("boom")

    holder = asyncio.create_task(queue.run("k", work))
    await settle(lambda: queue.is_active("k"))
    current = queue.current("k")
    assert current is not None
    gate.set()
    with pytest.raises(ValueError, match="boom"):
        await current
    with pytest.raises(ValueError, match="boom"):
        await holder


async def test_cancelling_an_awaiter_of_current_never_cancels_the_call(
    queue: KeyedQueue,
) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    current = queue.current("k")
    other = queue.current("k")
    assert current is not None
    assert other is not None
    watcher = asyncio.create_task(asyncio.wait_for(current, timeout=10))
    await checkpoints()
    watcher.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watcher
    assert not holder.done()
    gate.set()
    assert await holder is True
    assert await other is True  # the other awaiter still gets the result


async def test_current_of_a_cancelled_holder_raises_cancelled(queue: KeyedQueue) -> None:
    holder = asyncio.create_task(queue.run("k", asyncio.Event().wait))
    await settle(lambda: queue.is_active("k"))
    current = queue.current("k")
    assert current is not None
    holder.cancel()
    with pytest.raises(asyncio.CancelledError):
        await current


async def test_current_of_a_keyed_block_resolves_to_none(queue: KeyedQueue) -> None:
    async with queue.keyed("k"):
        current = queue.current("k")
        assert current is not None
        assert not current.done()
    assert await current is None


# -- lifecycle ---------------------------------------------------------------------------------


async def test_drain_waits_for_pending_and_running_work(
    queue: KeyedQueue, recorder: Recorder
) -> None:
    gate = asyncio.Event()
    tasks = [asyncio.create_task(queue.run("a", recorder.body("a", "a0", gate=gate)))]
    tasks += [asyncio.create_task(queue.run("a", recorder.body("a", f"a{i}"))) for i in (1, 2)]
    tasks += [asyncio.create_task(queue.run("b", recorder.body("b", "b0", steps=5)))]
    await settle(lambda: queue.pending("a") == 2)
    drain = asyncio.create_task(queue.drain())
    await checkpoints(10)
    assert not drain.done()
    gate.set()
    await drain
    assert sorted(recorder.finished) == ["a0", "a1", "a2", "b0"]
    await asyncio.gather(*tasks)


async def test_drain_counts_tasks_created_just_before_it(queue: KeyedQueue) -> None:
    finished: list[int] = []

    async def work(i: int) -> None:
        await checkpoints(3)
        finished.append(i)

    tasks = [asyncio.create_task(queue.run(i % 3, work, i)) for i in range(9)]
    await queue.drain()  # the tasks have not started yet when drain is called
    assert sorted(finished) == list(range(9))
    await asyncio.gather(*tasks)


async def test_drain_does_not_wait_for_later_work(queue: KeyedQueue) -> None:
    first_gate, later_gate = asyncio.Event(), asyncio.Event()
    first = asyncio.create_task(queue.run("k", first_gate.wait))
    await settle(lambda: queue.is_active("k"))
    drain = asyncio.create_task(queue.drain())
    await checkpoints()
    later = asyncio.create_task(queue.run("k", later_gate.wait))
    other = asyncio.create_task(queue.run("other", later_gate.wait))
    await settle(lambda: queue.pending("k") == 1)
    first_gate.set()
    await drain
    assert not later.done()
    assert not other.done()
    later_gate.set()
    await asyncio.gather(first, later, other)


async def test_drain_does_not_raise_the_errors_of_the_work(queue: KeyedQueue) -> None:
    gate = asyncio.Event()

    async def fail() -> None:
        await gate.wait()
        raise ValueError("the caller's, not drain's")

    task = asyncio.create_task(queue.run("k", fail))
    await settle(lambda: queue.is_active("k"))
    drain = asyncio.create_task(queue.drain())
    await checkpoints()
    gate.set()
    await drain
    with pytest.raises(ValueError, match="caller"):
        await task


async def test_drain_counts_waiters_that_leave(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    leaving = asyncio.create_task(queue.run("k", lambda: None))
    await settle(lambda: queue.pending("k") == 1)
    drain = asyncio.create_task(queue.drain())
    await checkpoints()
    leaving.cancel()
    await checkpoints(5)
    assert not drain.done()  # the holder is still running
    gate.set()
    await drain
    await holder


async def test_drain_of_an_idle_queue_returns_at_once(queue: KeyedQueue) -> None:
    await queue.drain()


async def test_cancelled_drain_leaves_the_lines_working(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    drain = asyncio.create_task(queue.drain())
    await checkpoints()
    drain.cancel()
    with pytest.raises(asyncio.CancelledError):
        await drain
    gate.set()
    await holder
    assert queue.active_count == 0


async def test_close_refuses_new_work_and_finishes_the_old(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    order: list[str] = []

    async def work(name: str) -> str:
        await gate.wait()
        order.append(name)
        # the holder may take its key again after close(): admitted work finishes
        await queue.run(name, order.append, f"{name} nested")
        return name

    running = asyncio.create_task(queue.run("k", work, "k"))
    waiting = asyncio.create_task(queue.run("k", work, "k"))
    await settle(lambda: queue.pending("k") == 1)
    queue.close()
    assert queue.closed
    with pytest.raises(QueueClosed):
        await queue.run("k", work, "refused")
    with pytest.raises(QueueClosed):
        await queue.run("free key", work, "refused")
    with pytest.raises(QueueClosed):
        async with queue.keyed("free key"):
            pass
    gate.set()
    assert await asyncio.gather(running, waiting) == ["k", "k"]
    assert order == ["k", "k nested", "k", "k nested"]
    queue.close()  # twice is harmless


async def test_aclose_closes_then_drains(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    task = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    closing = asyncio.create_task(queue.aclose())
    await checkpoints()
    assert queue.closed
    assert not closing.done()
    gate.set()
    await closing
    assert task.done()


# -- flow control -------------------------------------------------------------------


async def test_max_running_bounds_work_across_keys_and_keeps_each_keys_order(
    make_queue: QueueFactory, recorder: Recorder
) -> None:
    queue = make_queue(max_running=2)
    calls = [(f"k{i % 4}", i) for i in range(16)]
    running = 0
    most = 0
    left = Counter(key for key, _ in calls)  # by key: its works not finished yet

    async def work(key: str, n: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        try:
            # hold until a second work runs too (a shared backend's grants come
            # whenever its replies do), unless no other key has work left
            await settle(lambda: running == 2 or sum(map(bool, left.values())) < 2)
            return await recorder.body(key, (key, n), steps=2)()  # type: ignore[no-any-return]
        finally:
            running -= 1
            left[key] -= 1

    await asyncio.gather(*(queue.run(key, work, key, n) for key, n in calls))
    assert most == 2  # reached, never exceeded
    assert recorder.overlaps == []
    for key in {key for key, _ in calls}:
        mine = [n for k, n in recorder.started if k == key]
        assert mine == sorted(mine)
    assert queue.stats().running == 0
    assert queue.stats().completed == 16


async def test_max_hold_cancels_and_the_next_starts_after_the_cut_work_ended(
    make_queue: QueueFactory,
) -> None:
    from inturn import HoldTimeout

    queue = make_queue(max_hold=0.05)
    events: list[str] = []

    async def stubborn() -> None:
        events.append("first starts")
        try:
            await asyncio.Event().wait()  # never set: only max_hold ends it
        except asyncio.CancelledError:
            await checkpoints(5)  # cleans up for a while, still holding the key
            events.append("first ends")
            raise

    first = asyncio.create_task(queue.run("k", stubborn))
    await settle(lambda: events == ["first starts"])
    second = asyncio.create_task(queue.run("k", events.append, "second runs"))
    with pytest.raises(HoldTimeout) as caught:
        await first
    assert isinstance(caught.value, TimeoutError)
    await second
    assert events == ["first starts", "first ends", "second runs"]
    assert queue.stats().timed_out == 1


async def test_batch_waits_for_its_submissions_and_raises_their_errors(
    make_queue: QueueFactory,
) -> None:
    queue = make_queue(max_running=2)
    done: list[int] = []

    async def work(n: int) -> int:
        await checkpoints()
        if n == 3:
            raise ValueError(n)
        done.append(n)
        return n

    with pytest.raises(ExceptionGroup) as caught:
        async with queue.batch() as batch:
            handles = [await batch.submit(f"k{n % 2}", work, n) for n in range(6)]
    assert [type(e) for e in caught.value.exceptions] == [ValueError]
    assert sorted(done) == [0, 1, 2, 4, 5]
    assert all(handle.done() for handle in handles)
    assert batch.unfinished == 0


# -- latest wins --------------------------------------------------------------------


@pytest.mark.parametrize("on_superseded", ["join", "raise"])
async def test_a_burst_on_a_busy_key_runs_the_holder_and_the_latest(
    make_queue: QueueFactory, on_superseded: str
) -> None:
    queue = make_queue(pending="latest", on_superseded=on_superseded)
    ran: list[Any] = []
    release = asyncio.Event()

    async def work(name: Any) -> Any:
        ran.append(name)
        if name == "holder":
            await release.wait()
        return name

    holder = asyncio.create_task(queue.run("k", work, "holder"))
    await settle(lambda: ran == ["holder"])
    burst = [asyncio.create_task(queue.run("k", work, i)) for i in range(10)]
    # (each waits, or was answered with Superseded; then the submissions come)
    await settle(lambda: queue.pending("k") + sum(t.done() for t in burst) == 10)
    handles = [await queue.submit("k", work, i) for i in range(10, 20)]
    await settle(lambda: queue.pending("k") + sum(t.done() for t in (*burst, *handles)) == 20)
    release.set()
    outcomes = await asyncio.gather(holder, *burst, *handles, return_exceptions=True)
    assert ran == ["holder", 19]
    if on_superseded == "join":
        assert outcomes == ["holder", *[19] * 20]
    else:
        assert [type(o).__name__ for o in outcomes[1:-1]] == ["Superseded"] * 19
        assert outcomes[-1] == 19
    assert queue.stats().superseded == 19
    assert not queue.is_active("k")


async def test_latest_work_across_processes_runs_once_the_newest_or_is_refused(
    make_queue: QueueFactory, backend: Backend | None
) -> None:
    """Queues on one backend act as processes: with ``across="processes"`` a burst spread
    over them runs once, the newest; a backend that cannot keep it refuses the setting."""
    if backend is None or not backend.capabilities.latest:
        with pytest.raises(ValueError, match='across="processes"'):
            make_queue(pending="latest", across="processes")
        return
    holder = make_queue()
    queues = [
        make_queue(pending="latest", across="processes", on_superseded=mode)
        for mode in ("join", "raise")
    ]
    ran: list[Any] = []
    release = asyncio.Event()
    shows: Any = backend  # (a backend that keeps latest work shows its lines: lines())

    async def work(name: Any) -> Any:
        ran.append(name)
        return name

    held = asyncio.create_task(holder.run("k", release.wait))
    await waiting(shows, 0)  # (held at the backend)
    calls = []
    for n, queue in enumerate(queues):  # each queue's burst once the one before is in line
        calls += [asyncio.create_task(queue.run("k", work, f"{n}{i}")) for i in range(3)]
        await waiting(shows, n + 1)
    release.set()
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    await held
    assert ran == ["12"]
    assert outcomes[:3] == [None, None, None]  # "join", in another process: the newer returned
    assert [type(outcome).__name__ for outcome in outcomes[3:5]] == ["Superseded"] * 2
    assert outcomes[5] == "12"
    assert await shows.lines() == []


async def test_threads_conflate_on_the_backend(make_queue: QueueFactory) -> None:
    queue = make_queue(pending="latest", on_superseded="raise")

    def scenario() -> None:
        ran: list[Any] = []
        held, release = threading.Event(), threading.Event()

        def work(name: Any) -> Any:
            ran.append(name)
            if name == "holder":
                held.set()
                release.wait(PATIENCE)
            return name

        outcomes: dict[int, Any] = {}

        def call(i: int) -> None:
            try:
                outcomes[i] = queue.run_sync("k", work, i)
            except Exception as error:
                outcomes[i] = type(error).__name__

        holder = threading.Thread(target=queue.run_sync, args=("k", work, "holder"))
        holder.start()
        assert held.wait(PATIENCE)
        callers = []
        for i in range(3):  # each answered Superseded once the next comes
            callers.append(threading.Thread(target=call, args=(i,)))
            callers[-1].start()
            if i:
                callers[-2].join(PATIENCE)
            else:
                wait_until(lambda: queue.pending("k") == 1, "the first caller waits")
        release.set()
        for thread in (holder, *callers):
            thread.join(PATIENCE)
        assert ran == ["holder", 2]
        assert outcomes == {0: "Superseded", 1: "Superseded", 2: 2}

    await asyncio.to_thread(scenario)
