"""The in-process scenarios, each measured for one contender at a time.

Timed sections run with the garbage collector paused (collected before), the
same for every contender.
"""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from collections.abc import Hashable
from typing import Any

from .contenders import Contender


class Verification(AssertionError):
    """A contender broke mutual exclusion or FIFO during a run."""


def _timed(seconds_per: float) -> float:
    return seconds_per * 1e9


async def sequential(contender: Contender, n: int) -> float:
    """(a) ns per call of n sequential uncontended calls on distinct keys."""
    contender.reset()
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        await contender.sequential(n)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    return _timed(elapsed / n)


async def gathered(contender: Contender, keys: int, per_key: int, *, verify: bool) -> float:
    """(b), (c), (e): ns per task of keys x per_key tasks, gathered in interleaved order.

    Each body yields once while it holds its key, so every task but the first
    of each key finds the key taken and waits: the hand-off path. With
    ``verify``, each key's bodies must never overlap and must start in
    submission order (not checked for contenders that hold nothing).
    """
    contender.reset()
    inside: dict[Hashable, int] = dict.fromkeys(range(keys), 0)
    started: dict[Hashable, list[int]] = {k: [] for k in range(keys)}
    overlaps = 0

    def body_for(key: int, index: int) -> Any:
        async def body() -> None:
            nonlocal overlaps
            if inside[key]:
                overlaps += 1
            inside[key] += 1
            started[key].append(index)
            await asyncio.sleep(0)
            inside[key] -= 1

        return body

    coros = [contender.submit(i % keys, body_for(i % keys, i)) for i in range(keys * per_key)]
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        await asyncio.gather(*coros)
        elapsed = time.perf_counter() - start
    finally:
        gc.enable()
    if verify and contender.holds:
        if overlaps:
            raise Verification(f"{contender.name}: {overlaps} bodies ran while their key was held")
        for key, order in started.items():
            if order != sorted(order):
                raise Verification(f"{contender.name}: key {key} started out of FIFO order")
    return _timed(elapsed / (keys * per_key))


async def memory(contender: Contender, keys: int, *, through: bool = False) -> dict[str, float]:
    """(d) bytes per in-flight key, and what stays afterwards.

    ``keys`` tasks each hold a distinct key until released: the traced memory
    with all of them in flight, above what it was before. With ``through``,
    the same calls go through :meth:`Contender.through` (the same call shape,
    holding nothing), whose figure is subtracted by the caller to leave the
    contender's bookkeeping. Then what is retained once all work finished,
    and the growth after a second wave of new keys.
    """
    contender.reset()
    submit = contender.through if through else contender.submit
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def wave(offset: int) -> tuple[int, int]:
        gate.clear()
        tasks = [asyncio.ensure_future(submit(offset + i, hold)) for i in range(keys)]
        for _ in range(3):
            await asyncio.sleep(0)  # every task holds its key now
        gc.collect()
        in_flight = tracemalloc.get_traced_memory()[0]
        gate.set()
        await asyncio.gather(*tasks)
        del tasks
        # The loop's handle that resumed this task still references the
        # gather (and through it every task) until the next loop round.
        await asyncio.sleep(0)
        gc.collect()
        return in_flight, tracemalloc.get_traced_memory()[0]

    await wave(10 * keys)  # warm up: asyncio's own tables grow to size first
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        in_flight, after_first = await wave(0)
        _, after_second = await wave(keys)
    finally:
        tracemalloc.stop()
    return {
        "in_flight_bytes": float(in_flight - base),
        "retained_bytes": float(after_first - base),
        "growth_bytes": float(after_second - after_first),
        "keys_kept": float(contender.keys_kept()),
    }
