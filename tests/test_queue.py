"""KeyedQueue in process: what only the in-process lines do (any hashable key, eviction).

The guarantees shared by every backend are in test_backend_conformance.py.
"""

from __future__ import annotations

import asyncio
import gc
import math
import weakref
from typing import Any

import pytest

import inturn
from inturn import KeyedQueue

from support.helpers import settle


class Key:
    """A key object that a weak reference can watch."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return hash(self.name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other.name == self.name

    def __repr__(self) -> str:
        return f"Key({self.name!r})"


# -- eviction --------------------------------------------------------------------------


async def test_idle_keys_are_not_referenced(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    key = Key("k")
    ref = weakref.ref(key)

    async def impatient() -> None:
        async with queue.keyed(Key("k"), timeout=0.001):
            pass

    holder = asyncio.create_task(queue.run(key, gate.wait))
    waiters = [asyncio.create_task(queue.run(Key("k"), lambda: None)) for _ in range(3)]
    cancelled = asyncio.create_task(queue.run(Key("k"), lambda: None))
    timed_out = asyncio.create_task(impatient())
    await settle(lambda: queue.pending(Key("k")) == 5)
    cancelled.cancel()
    watcher = queue.current(Key("k"))
    with pytest.raises(TimeoutError):
        await timed_out
    gate.set()
    await asyncio.gather(holder, *waiters, cancelled, watcher, return_exceptions=True)
    del key, holder, waiters, cancelled, timed_out, watcher
    gc.collect()
    assert ref() is None
    assert queue.active_count == 0
    assert queue.active_keys == frozenset()


async def test_memory_does_not_grow_with_keys_ever_used(queue: KeyedQueue) -> None:
    async def noop() -> None:
        await asyncio.sleep(0)

    for wave in range(3):
        await asyncio.gather(*(queue.run((wave, i), noop) for i in range(1000)))
        assert queue.active_count == 0
    assert queue._registry.lines == {}


# -- bad input --------------------------------------------------------------------------------


async def test_unhashable_key_is_a_type_error_that_names_it(queue: KeyedQueue) -> None:
    with pytest.raises(TypeError, match=r"key \['a'\] is unhashable \(list\)"):
        await queue.run(["a"], lambda: None)
    with pytest.raises(TypeError, match="unhashable"):
        queue.keyed({"a": 1})  # at the call, before any await
    with pytest.raises(TypeError, match=r"key \{'b'\} is unhashable"):
        queue.keyed("a", {"b"})
    assert queue.active_count == 0


async def test_awaiting_keyed_instead_of_entering_it_says_to_use_async_with(
    queue: KeyedQueue,
) -> None:
    """``await queue.keyed(...)`` is a TypeError that names ``async with``; nothing is taken."""
    with pytest.raises(TypeError, match=r"^inturn: .*`async with queue\.keyed\(\.\.\.\)`"):
        await queue.keyed("k")
    with pytest.raises(TypeError, match=r"`with` in a thread"):
        await inturn.keyed("k")
    with pytest.raises(TypeError, match="async with"):
        await queue.keyed("a", "b", timeout=1)  # (a turn taken by its steps)
    assert queue.active_count == 0
    assert inturn.default_queue.active_count == 0
    async with queue.keyed("k") as turn:  # the turn itself is still good to enter
        assert queue.is_active("k")
    with pytest.raises(TypeError, match="async with"):
        await turn  # (and after its block)
    assert queue.active_count == 0


@pytest.mark.parametrize("timeout", [-1, -0.001, math.nan])
def test_timeout_out_of_range(timeout: float) -> None:
    with pytest.raises(ValueError, match="timeout"):
        KeyedQueue(timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        KeyedQueue().keyed("k", timeout=timeout)


@pytest.mark.parametrize("timeout", ["1", True, [1]])
def test_timeout_of_the_wrong_type(timeout: Any) -> None:
    with pytest.raises(TypeError, match="timeout"):
        KeyedQueue(timeout=timeout)


@pytest.mark.parametrize("max_pending", [-1, -100])
def test_max_pending_out_of_range(max_pending: int) -> None:
    with pytest.raises(ValueError, match="max_pending"):
        KeyedQueue(max_pending=max_pending)


@pytest.mark.parametrize("max_pending", [1.5, "2", True])
def test_max_pending_of_the_wrong_type(max_pending: Any) -> None:
    with pytest.raises(TypeError, match="max_pending"):
        KeyedQueue(max_pending=max_pending)


def test_infinite_timeout_means_none() -> None:
    assert KeyedQueue(timeout=math.inf).timeout is None
    assert KeyedQueue(timeout=2).timeout == 2.0


# -- lifecycle ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["shop", None])
async def test_a_closed_queue_names_itself_in_every_refusal(name: str | None) -> None:
    queue = KeyedQueue(name=name)
    queue.close()
    said = (
        "inturn: queue 'shop' is closed (by its close() or aclose()); "
        "the work for key 'k' was not queued"
    )
    if name is None:
        said = said.replace("queue 'shop'", "a queue with no name")
        said += ". KeyedQueue(name=...) names a queue here"
    refusals: list[str] = []
    for refused in (
        lambda: queue.run("k", lambda: None),
        lambda: queue.submit("k", lambda: None),
        lambda: asyncio.to_thread(queue.run_sync, "k", lambda: None),
    ):
        with pytest.raises(inturn.QueueClosed) as closed:
            await refused()
        refusals.append(str(closed.value))
    with pytest.raises(inturn.QueueClosed) as closed:
        async with queue.keyed("k"):
            pass
    refusals.append(str(closed.value))
    assert refusals == [said] * 4


async def test_a_long_line_with_many_leavers_stays_compact(queue: KeyedQueue) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("k", gate.wait))
    await settle(lambda: queue.is_active("k"))
    keep = asyncio.create_task(queue.run("k", lambda: "kept"))
    for _ in range(10):
        leavers = [asyncio.create_task(queue.run("k", lambda: None)) for _ in range(100)]
        await settle(lambda: queue.pending("k") == 101)
        for task in leavers:
            task.cancel()
        await asyncio.gather(*leavers, return_exceptions=True)
    line = queue._registry.lines["k"]
    assert queue.pending("k") == 1
    assert len(line.waiters) <= 2 * 1 + 16 + 1
    gate.set()
    await holder
    assert await keep == "kept"
