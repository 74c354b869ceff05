"""Latest wins: the eight promises issue 41 found broken, one small deterministic test each.

Each test names its defect (issue 41, 1 to 8) and the README's words it
checks. Driven by events and loop rounds; times on a virtual clock, but for
8, which measures memory with tracemalloc (never a time).
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

import pytest

from inturn import KeyedQueue, Superseded

from support.helpers import checkpoints, settle
from support.virtual_time import run_virtual


class Works:
    """Works that record when they start (the loop's time) and hold until their gate opens."""

    def __init__(self) -> None:
        self.ran: list[tuple[Any, float]] = []  # (name, start), in start order
        self.gates: dict[Any, asyncio.Event] = {}

    def gate(self, name: Any) -> asyncio.Event:
        return self.gates.setdefault(name, asyncio.Event())

    def work(self, name: Any, *, gated: bool = False, error: Exception | None = None) -> Any:
        async def run() -> Any:
            self.ran.append((name, asyncio.get_running_loop().time()))
            if gated:
                await self.gate(name).wait()
            await checkpoints()
            if error is not None:
                raise error
            return name

        return run

    @property
    def names(self) -> list[Any]:
        return [name for name, _ in self.ran]


async def holding_a_slot(queue: KeyedQueue, works: Works, key: str = "other") -> asyncio.Task[Any]:
    """A task that runs on key, holding the queue's one running slot until works.gate(key) opens."""
    task = asyncio.create_task(queue.run(key, works.work(key, gated=True)))
    await settle(lambda: key in works.names)
    return task


async def block_waiting_for_a_slot(queue: KeyedQueue, key: str) -> asyncio.Task[None]:
    """A ``keyed()`` block that takes key and waits for a running slot: it holds key without
    running, and, being a block, never runs anyone else's work."""

    async def block() -> None:
        async with queue.keyed(key):
            pass

    waiting = queue.stats().waiting_for_slot
    task = asyncio.create_task(block())
    await settle(lambda: queue.stats().waiting_for_slot == waiting + 1)
    return task


class Heard:
    """An observer (inturn.Observer) that keeps what it hears of each turn."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[BaseException | None] = []
        self.misses: list[BaseException] = []

    def started(self, waited: float, function: str | None) -> None:
        self.starts.append(waited)

    def ended(self, held: Any, error: BaseException | None, cut: bool, function: Any) -> None:
        self.ends.append(error)

    def missed(self, error: BaseException, function: str | None) -> None:
        self.misses.append(error)


# -- 1: a newer caller's timeout is not given to the callers it replaced -------------------------


def test_1_a_newer_callers_timeout_puts_the_work_it_replaced_back() -> None:
    """Issue 41, 1. README: "If the newer work's caller gives up (cancelled, timed out)
    before the key's turn comes, the older work is back in its place"; a turn waiting
    for a running slot "counts as waiting".

    The newest caller (timeout 0.5 s) is handed the key, then waits for a slot past its
    timeout: it times out, and the older caller it replaced (no timeout) runs its own
    work once a slot frees.
    """

    async def scenario() -> None:
        queue = KeyedQueue(pending="latest", max_running=1)
        works = Works()
        slot = await holding_a_slot(queue, works)
        block = await block_waiting_for_a_slot(queue, "k")  # holds k, waits for the slot
        later = asyncio.create_task(queue.run("g", works.work("g", gated=True)))
        await settle(lambda: queue.stats().waiting_for_slot == 2)  # g waits behind the block
        older = asyncio.create_task(queue.run("k", works.work("older")))
        await settle(lambda: queue.pending("k") == 1)
        hurried = queue.queue_by_key(key="k", timeout=0.5)(works.work("newer"))
        newer = asyncio.create_task(hurried())
        await settle(lambda: queue.pending("k") == 2)
        works.gate("other").set()  # the block runs, g takes the slot, k goes to the newer
        await settle(lambda: "g" in works.names)
        await asyncio.sleep(1.0)  # the newer waits for the slot past its 0.5 s
        with pytest.raises(TimeoutError):
            await newer
        works.gate("g").set()
        outcome = await asyncio.gather(older, return_exceptions=True)
        await asyncio.gather(slot, block, later)
        assert list(outcome) == ["older"], "the older caller (no timeout) got the newer's timeout"
        assert "newer" not in works.names
        assert works.names[-1] == "older"
        assert not queue.is_active("k")

    run_virtual(scenario())


# -- 2: a follower's timeout counts up to the start of the work it joined ------------------------


def test_2_a_followers_timeout_counts_until_the_work_it_joined_starts() -> None:
    """Issue 41, 2. README: "Each caller's ``timeout`` counts from its own call, up to the
    start of its work or of the one it joined."

    A caller with a 0.6 s limit, replaced by a newer work that then waits 1.5 s for a
    running slot, times out at 0.6 s: the work it joined had not started.
    """

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        queue = KeyedQueue(pending="latest", max_running=1)
        works = Works()
        slot = await holding_a_slot(queue, works)
        block = await block_waiting_for_a_slot(queue, "k")
        later = asyncio.create_task(queue.run("g", works.work("g", gated=True)))
        await settle(lambda: queue.stats().waiting_for_slot == 2)
        called = loop.time()
        hurried = queue.queue_by_key(key="k", timeout=0.6)(works.work("older"))
        older = asyncio.create_task(hurried())
        await settle(lambda: queue.pending("k") == 1)
        newer = asyncio.create_task(queue.run("k", works.work("newer")))
        await settle(lambda: queue.pending("k") == 2)
        works.gate("other").set()  # the newer is handed k, and waits for g's slot
        await settle(lambda: "g" in works.names)
        answered: list[float] = []
        older.add_done_callback(lambda _: answered.append(loop.time()))
        await asyncio.sleep(1.5)
        works.gate("g").set()
        outcomes = await asyncio.gather(older, newer, return_exceptions=True)
        await asyncio.gather(slot, block, later)
        assert isinstance(outcomes[0], TimeoutError), (
            f"the 0.6 s caller got {outcomes[0]!r} at {answered[0] - called:.2f} s"
        )
        assert answered[0] - called == pytest.approx(0.6, abs=0.01)  # (the call's time: real)
        assert outcomes[1] == "newer"
        assert not queue.is_active("k")

    run_virtual(scenario())


# -- 3: "raise" raises Superseded, never another work's error --------------------------------------


async def test_3_raise_answers_superseded_even_when_the_newer_work_fails() -> None:
    """Issue 41, 3. README: with ``on_superseded="raise"`` a replaced caller "raises
    ``inturn.Superseded``".

    A caller whose turn (waiting for a slot) runs the newer work instead of its own gets
    Superseded, whether that work succeeds or, here, fails.
    """
    queue = KeyedQueue(pending="latest", on_superseded="raise", max_running=1)
    works = Works()
    slot = await holding_a_slot(queue, works)
    first = asyncio.create_task(queue.run("k", works.work("first")))  # free key: waits for a slot
    await settle(lambda: queue.stats().waiting_for_slot == 1)
    failing = asyncio.create_task(queue.run("k", works.work("newer", error=LookupError("gone"))))
    await settle(lambda: queue.pending("k") + first.done() == 1)
    works.gate("other").set()
    outcomes = await asyncio.gather(first, failing, return_exceptions=True)
    await slot
    assert works.names == ["other", "newer"]  # the first's turn ran the newer work
    assert isinstance(outcomes[0], Superseded), f"the replaced caller got {outcomes[0]!r}"
    assert isinstance(outcomes[1], LookupError)


# -- 4: a work counts once: never both cancelled and superseded ----------------------------------


async def test_4_a_work_cut_in_an_older_turn_counts_once_and_never_runs_again() -> None:
    """Issue 41, 4. QueueStats: each call is counted once, as the turn it was or the work
    newer work replaced; an observer hears once of each.

    The newer work N runs in the older caller F's turn (F waits for a slot), F is
    cancelled: N's run is cut, and that is N's answer too (a work runs at most once: it
    does not wait again, so it cannot be replaced, nor counted, a second time). Then M
    comes and runs. Five calls (the slot's holder, g, F, N, M): five counts, five things
    heard.
    """
    queue = KeyedQueue(pending="latest", max_running=1)
    heard = Heard()
    queue.observe(heard)
    works = Works()
    slot = await holding_a_slot(queue, works)
    first = asyncio.create_task(queue.run("k", works.work("F")))
    await settle(lambda: queue.stats().waiting_for_slot == 1)
    later = asyncio.create_task(queue.run("g", works.work("g", gated=True)))
    await settle(lambda: queue.stats().waiting_for_slot == 2)
    cut = asyncio.create_task(queue.run("k", works.work("N", gated=True)))
    await settle(lambda: queue.pending("k") == 1)
    works.gate("other").set()
    await settle(lambda: "N" in works.names)  # F's turn runs N's work
    first.cancel()  # N's run is cut: it is N's answer too, and g takes the slot
    await settle(lambda: "g" in works.names)
    newest = asyncio.create_task(queue.run("k", works.work("M")))
    await checkpoints(5)
    works.gate("g").set()
    outcomes = await asyncio.gather(first, cut, newest, later, slot, return_exceptions=True)
    assert isinstance(outcomes[0], asyncio.CancelledError)
    assert isinstance(outcomes[1], asyncio.CancelledError)
    assert list(outcomes[2:]) == ["M", "g", "other"]
    assert works.names.count("N") == 1
    stats = queue.stats()
    counted = stats.completed + stats.failed + stats.timed_out + stats.cancelled + stats.superseded
    assert counted == 5, f"5 calls counted as {counted}: {stats}"
    told = len(heard.ends) + len(heard.misses)
    assert told == 5, f"5 calls, the observer heard {told}: {heard.ends} {heard.misses}"


# -- 5: a key in its quiet period is active -------------------------------------------------------


def test_5_a_key_whose_callers_wait_out_a_debounce_is_active() -> None:
    """Issue 41, 5. README: ``is_active(key)``: "a task or thread holds or waits for
    ``key``"; ``active_keys``, ``active_count`` and the repr agree."""

    async def scenario() -> None:
        queue = KeyedQueue(debounce=60.0)
        works = Works()
        calls = [asyncio.create_task(queue.run("k", works.work(i))) for i in range(3)]
        await checkpoints()
        assert queue.pending("k") == 3
        assert queue.is_active("k")
        assert queue.active_keys == frozenset({"k"})
        assert queue.active_count == 1
        assert "1 active" in repr(queue)
        await queue.drain()
        assert await asyncio.gather(*calls) == [2, 2, 2]
        assert not queue.is_active("k")

    run_virtual(scenario())


# -- 6: pending() counts every debounced caller still waiting --------------------------------------


def test_6_pending_counts_each_debounced_caller_once_their_work_is_in_line() -> None:
    """Issue 41, 6. README: ``pending(key)``: the tasks and threads waiting for ``key``;
    with ``debounce``, "every caller still waiting counts"."""

    async def scenario() -> None:
        queue = KeyedQueue(debounce=1.0)  # pending="all"
        works = Works()
        release = asyncio.Event()

        async def hold() -> None:
            async with queue.keyed("k"):  # (a block is never debounced)
                await release.wait()

        holder = asyncio.create_task(hold())
        await settle(lambda: queue.is_active("k"))
        calls = [asyncio.create_task(queue.run("k", works.work(i))) for i in range(2)]
        await checkpoints()
        assert queue.pending("k") == 2  # quiet
        await asyncio.sleep(2.0)  # the quiet period ended: their one work waits in line
        assert queue.pending("k") == 2, "two waiting callers read as one"
        release.set()
        assert await asyncio.gather(*calls) == [1, 1]
        await holder

    run_virtual(scenario())


# -- 7: with pending="latest", a debounced work takes its place when its quiet period ends ---------


@pytest.mark.parametrize("burst", [False, True], ids=["one-call", "burst-bounded-by-max_wait"])
def test_7_a_newer_debounced_call_waits_out_its_quiet_period_behind_a_waiting_latest(
    burst: bool,
) -> None:
    """Issue 41, 7. README: "a debounced work takes its place when its quiet period ends,
    not at its call". The semantics decided: as lodash's and RxJS's trailing debounce,
    every call restarts its key's quiet period, ``max_wait`` (from the first call of a
    burst) bounds it, and the work takes its place in the line only when it ends.

    A's work takes its place at 1 s and waits behind a busy key; B comes at 2 s, the key
    is freed at 2.1 s. B's work must not run before its own quiet period ends: at 3 s
    (one call), or at 3.5 s when calls go on every 0.5 s from B with ``max_wait=1.5``.
    """

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        queue = KeyedQueue(pending="latest", debounce=1.0, max_wait=1.5 if burst else None)
        works = Works()
        release = asyncio.Event()

        async def hold() -> None:
            async with queue.keyed("k"):
                await release.wait()

        holder = asyncio.create_task(hold())
        await settle(lambda: queue.is_active("k"))
        calls = [asyncio.create_task(queue.run("k", works.work("A")))]
        await asyncio.sleep(2.0)  # A's quiet period ended at 1 s: its work waits in line
        calls.append(asyncio.create_task(queue.run("k", works.work("B0"))))
        loop.call_later(0.1, release.set)
        if burst:
            for n in range(1, 9):  # every 0.5 s: B's key never goes quiet
                await asyncio.sleep(0.5)
                calls.append(asyncio.create_task(queue.run("k", works.work(f"B{n}"))))
        await asyncio.gather(*calls, return_exceptions=True)
        await holder
        newer = [(name, at) for name, at in works.ran if name != "A"]
        assert newer, f"no work of B's burst ran: {works.ran}"
        due = 3.5 if burst else 3.0
        assert newer[0][1] == pytest.approx(due), (
            f"B's burst first ran {newer[0][0]} at {newer[0][1]:.2f} s, not at {due} s: {works.ran}"
        )

    run_virtual(scenario())


# -- 8: replaced debounced submissions cost nothing once drained -----------------------------------


async def _burst_retained(queue: KeyedQueue, n: int) -> int:
    """Bytes still traced after n dropped submissions during a quiet period, once drained."""

    async def work(version: int) -> int:
        return version

    gc.collect()
    before = tracemalloc.get_traced_memory()[0]
    for version in range(n):
        await queue.submit("k", work, version)  # (the handle dropped at once)
    await queue.drain()
    await checkpoints(3)
    gc.collect()
    return tracemalloc.get_traced_memory()[0] - before


async def test_8_dropped_debounced_submissions_leave_nothing_after_drain() -> None:
    """Issue 41, 8. README: a replaced handle "costs the key no memory each"; "once a key
    is idle, nothing of it is kept".

    100,000 submissions during a quiet period (``debounce=60``), handles dropped, then
    ``drain()``: what stays traced is no more than after a burst of 1,000 (well under a
    byte a submission; today each left a loop timer holding its Latest).
    """
    queue = KeyedQueue(debounce=60.0)
    tracemalloc.start()
    try:
        await _burst_retained(queue, 1_000)  # (warms the caches a first burst fills)
        small = await _burst_retained(queue, 1_000)
        large = await _burst_retained(queue, 100_000)
    finally:
        tracemalloc.stop()
    assert large - small < 100_000, (
        f"100,000 dropped submissions left {large:,} bytes after drain(), 1,000 left {small:,}"
    )
    assert not queue.is_active("k")
