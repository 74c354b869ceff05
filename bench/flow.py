"""(g) A batch of keyed messages on 32 running slots: inturn's flow control beside hand-written.

M messages over K keys are processed as one batch, which ends only once
every message is done. Each message's body holds its key (one body at a
time per key, in submission order) and one of 32 running slots, and yields
once while it holds them. The keys are spread evenly, or skewed: one hot
key holds every other message, the rest spread over the other keys.

Contenders, each given the whole batch:

- ``handwritten``: a dict of asyncio.Lock with reference counts (as in
  :class:`bench.contenders.HandwrittenKeyedLock`) and an
  ``asyncio.Semaphore(32)`` taken after the key's lock (so that a key never
  holds two slots); a task per message, all created up front, errors
  collected by a done callback, then ``gather``.
- ``handwritten+backpressure``: the same, but the producer takes one of 64
  in-flight permits before it creates each task (released when the task
  ends), so at most 64 tasks are alive.
- ``inturn.batch``: ``async with queue.batch() as b: await b.submit(...)``
  for each message, on ``KeyedQueue(max_running=32)``.
- ``inturn.run+gather``: ``gather(*(queue.run(...) ...))`` on the same queue.

Three runs per contender and distribution: a timed one (garbage collector
paused, as in bench/scenarios.py), one that counts the tasks alive at once
(every task the loop creates, the library's own included), and one that
traces the peak memory with tracemalloc. Every run checks the guarantees and
raises :class:`~bench.scenarios.Verification` if one was broken.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import sys
import time
import tracemalloc
from collections import defaultdict
from collections.abc import Callable, Coroutine, Hashable, Sequence
from typing import Any

import inturn

from .scenarios import Verification

if sys.version_info < (3, 11):  # pragma: no cover - depends on the interpreter
    from exceptiongroup import ExceptionGroup

SLOTS = 32  # max_running, and the hand-written semaphore
IN_FLIGHT = 2 * SLOTS  # handwritten+backpressure: the most tasks alive at once

Body = Callable[[int, int], Coroutine[Any, Any, None]]


class Sizes:
    def __init__(self, quick: bool) -> None:
        self.messages = 500 if quick else 10_000
        self.keys = 1_000


def spread(messages: int, keys: int) -> list[int]:
    """Each message's key: round-robin over keys."""
    return [i % keys for i in range(messages)]


def skewed(messages: int, keys: int) -> list[int]:
    """Each message's key: every other one on hot key 0, the rest round-robin over the others."""
    return [0 if i % 2 == 0 else 1 + (i // 2) % (keys - 1) for i in range(messages)]


# -- the contenders ---------------------------------------------------------------


class SlottedKeyedLock:
    """A hand-written keyed lock with a bound on running work: a dict of
    asyncio.Lock with reference counts, and a Semaphore taken after the key's
    lock (taken before it, a key's queued work would hold slots while it waits)."""

    def __init__(self, slots: int) -> None:
        self._locks: dict[Hashable, list[Any]] = {}  # key -> [lock, users]
        self._slots = asyncio.Semaphore(slots)

    async def run(self, key: Hashable, fn: Body, *args: Any) -> Any:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0], self._slots:
                return await fn(*args)
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)


def _raise_collected(errors: list[BaseException]) -> None:
    if errors:
        raise ExceptionGroup(f"{len(errors)} message(s) failed", errors)  # type: ignore[type-var]


class FlowContender:
    name = ""

    def reset(self) -> None:
        """Start from fresh state."""

    async def process(self, keys: Sequence[int], body: Body) -> None:
        """Run body(keys[i], i) for every message i; return once all are done."""
        raise NotImplementedError

    def keys_kept(self) -> int:
        """How many keys the contender still references when idle."""
        return 0


class Handwritten(FlowContender):
    name = "handwritten"

    def reset(self) -> None:
        self.locks = SlottedKeyedLock(SLOTS)

    async def process(self, keys: Sequence[int], body: Body) -> None:
        run = self.locks.run
        create_task = asyncio.get_running_loop().create_task
        errors: list[BaseException] = []

        def finished(task: asyncio.Task[Any]) -> None:
            if not task.cancelled() and (error := task.exception()) is not None:
                errors.append(error)

        tasks = []
        for index, key in enumerate(keys):
            task = create_task(run(key, body, key, index))
            task.add_done_callback(finished)
            tasks.append(task)
        await asyncio.gather(*tasks, return_exceptions=True)
        _raise_collected(errors)

    def keys_kept(self) -> int:
        return len(self.locks)


class HandwrittenBackpressure(Handwritten):
    name = "handwritten+backpressure"

    async def process(self, keys: Sequence[int], body: Body) -> None:
        run = self.locks.run
        create_task = asyncio.get_running_loop().create_task
        errors: list[BaseException] = []
        permits = asyncio.Semaphore(IN_FLIGHT)  # tasks alive, not slots: see module doc
        alive: set[asyncio.Task[Any]] = set()  # the usual strong references, dropped when done

        def finished(task: asyncio.Task[Any]) -> None:
            permits.release()
            alive.discard(task)
            if not task.cancelled() and (error := task.exception()) is not None:
                errors.append(error)

        for index, key in enumerate(keys):
            await permits.acquire()
            task = create_task(run(key, body, key, index))
            task.add_done_callback(finished)
            alive.add(task)
        await asyncio.gather(*alive, return_exceptions=True)
        _raise_collected(errors)


class InturnBatch(FlowContender):
    name = "inturn.batch"

    def reset(self) -> None:
        self.queue = inturn.KeyedQueue(max_running=SLOTS)

    async def process(self, keys: Sequence[int], body: Body) -> None:
        async with self.queue.batch() as batch:
            submit = batch.submit
            for index, key in enumerate(keys):
                await submit(key, body, key, index)

    def keys_kept(self) -> int:
        return self.queue.active_count


class InturnRunGather(InturnBatch):
    name = "inturn.run+gather"

    async def process(self, keys: Sequence[int], body: Body) -> None:
        run = self.queue.run
        await asyncio.gather(*[run(key, body, key, index) for index, key in enumerate(keys)])


ALL: list[type[FlowContender]] = [
    Handwritten,
    HandwrittenBackpressure,
    InturnBatch,
    InturnRunGather,
]
NAMES = [cls.name for cls in ALL]


# -- one run ------------------------------------------------------------------------


class Probe:
    """The messages' body, which records what the guarantees forbid, and its counts."""

    def __init__(self, keys: Sequence[int]) -> None:
        width = max(keys) + 1
        self.inside = [False] * width  # whether a body of the key runs
        self.last = [-1] * width  # the index of the key's latest body to start
        self.running = 0
        self.peak_running = 0
        self.done = 0
        self.overlaps = 0
        self.reordered = 0

    async def body(self, key: int, index: int) -> None:
        running = self.running = self.running + 1
        if running > self.peak_running:
            self.peak_running = running
        inside = self.inside
        if inside[key]:
            self.overlaps += 1
        inside[key] = True
        if index < self.last[key]:
            self.reordered += 1
        self.last[key] = index
        await asyncio.sleep(0)
        inside[key] = False
        self.running -= 1
        self.done += 1

    def verify(self, contender: FlowContender, messages: int) -> None:
        name = contender.name
        if self.overlaps:
            raise Verification(f"{name}: {self.overlaps} bodies ran while their key was held")
        if self.reordered:
            raise Verification(f"{name}: {self.reordered} bodies started out of FIFO order")
        if self.peak_running > SLOTS:
            raise Verification(f"{name}: {self.peak_running} bodies ran at once (max {SLOTS})")
        if self.done != messages:
            raise Verification(f"{name}: {self.done} of {messages} messages were processed")
        if contender.keys_kept():
            raise Verification(f"{name}: {contender.keys_kept()} keys kept when idle")


async def timed(contender: FlowContender, keys: Sequence[int]) -> dict[str, float]:
    """ns per message of the whole batch, and the most bodies that ran at once."""
    contender.reset()
    probe = Probe(keys)
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        await contender.process(keys, probe.body)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    probe.verify(contender, len(keys))
    return {"ns": elapsed * 1e9 / len(keys), "running": float(probe.peak_running)}


async def tasks_alive(contender: FlowContender, keys: Sequence[int]) -> float:
    """The most tasks alive at once (created and not finished) while the batch ran."""
    contender.reset()
    probe = Probe(keys)
    loop = asyncio.get_running_loop()
    alive = peak = 0

    def ended(task: asyncio.Future[Any]) -> None:
        nonlocal alive
        alive -= 1

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **options: Any) -> asyncio.Task[Any]:
        nonlocal alive, peak
        task = asyncio.Task(coro, loop=loop, **options)
        task.add_done_callback(ended)
        alive += 1
        peak = max(peak, alive)
        return task

    previous = loop.get_task_factory()
    loop.set_task_factory(factory)
    try:
        await contender.process(keys, probe.body)
    finally:
        loop.set_task_factory(previous)
    probe.verify(contender, len(keys))
    return float(peak)


async def peak_memory(contender: FlowContender, keys: Sequence[int]) -> float:
    """The traced memory's peak while the batch ran, above what it was before, per message."""
    contender.reset()
    probe = Probe(keys)
    gc.collect()
    gc.disable()  # as in the timed run: garbage in cycles counts until the next collection
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        await contender.process(keys, probe.body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        gc.enable()
    probe.verify(contender, len(keys))
    return (peak - base) / len(keys)


# -- the scenario -------------------------------------------------------------------


def _rotated(items: Sequence[FlowContender], by: int) -> list[FlowContender]:
    by %= len(items)
    return [*items[by:], *items[:by]]


def distributions(sizes: Sizes) -> dict[str, list[int]]:
    m, k = sizes.messages, sizes.keys
    return {
        f"{k:,} keys": spread(m, k),
        f"hot key (half) + {k - 1:,} keys": skewed(m, k),
    }


async def measure(
    sizes: Sizes,
    repeats: int,
    log: Callable[[str], None],
    kinds: Sequence[type[FlowContender]] = ALL,
) -> dict[str, dict[str, float]]:
    """Median of repeats of every measure, by '<measure> <distribution>' and contender."""
    contenders = [cls() for cls in kinds]
    batches = distributions(sizes)
    for contender in contenders:  # warm up: asyncio's own tables grow to size first
        for keys in batches.values():
            await timed(contender, keys)
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for repeat in range(repeats):
        log(f"(g) repeat {repeat + 1}/{repeats}")
        for contender in _rotated(contenders, repeat):
            name = contender.name
            for label, keys in batches.items():
                result = await timed(contender, keys)
                samples[f"ns {label}"][name].append(result["ns"])
                samples[f"running {label}"][name].append(result["running"])
                samples[f"tasks {label}"][name].append(await tasks_alive(contender, keys))
                samples[f"bytes {label}"][name].append(await peak_memory(contender, keys))
    return {
        measure: {name: statistics.median(values) for name, values in by_name.items()}
        for measure, by_name in samples.items()
    }


def title(sizes: Sizes) -> str:
    return f"(g) {sizes.messages:,} keyed messages as one batch, max_running={SLOTS}"


def derive(medians: dict[str, dict[str, float]], sizes: Sizes) -> dict[str, dict[str, float]]:
    """The reported rows, in the order of run.table()."""
    rows: dict[str, dict[str, float]] = {}
    labels = list(distributions(sizes))
    for what, row in (
        ("ns", "ns/message"),
        ("tasks", "peak tasks alive"),
        ("bytes", "peak traced bytes/message"),
        ("running", "peak bodies running"),
    ):
        for label in labels:
            rows[f"(g) {row}, {label}"] = medians[f"{what} {label}"]
    return rows
