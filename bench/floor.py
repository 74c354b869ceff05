"""The floor under `async with keyed(key)`: what the least a keyed turn can do costs.

    python -m bench.floor [--repeats 7] [--turns 100000]

Issue 29 asked `async with q.keyed(key)` to cost at most 1.2x the hand-written
lock (a dict of ``asyncio.Lock``, bench/contenders.py); this showed that no
turn written once as the protocol's named calls can on CPython 3.11, so issue
45 states the target as a ratio to the *named calls* turn below, which
``python -m bench.turns`` times in the same run. This times, in one run and
on the same machine, three turns that no inturn turn can undercut:

- *bare*: an ``async with`` whose object takes a free key into a dict and
  pops it (``__aenter__``/``__aexit__`` as coroutines, the current task as
  the holder, a fencing token): nothing checked, nothing counted, no wait
  possible (a busy key raises);
- *named calls*: the same, with the calls the one-protocol rule asks for
  (``keyed()`` makes the turn, ``_enter_now`` settles it, the registry's
  ``try_take`` and ``finish`` take and give the key), each doing only that;
- inturn's own ``async with q.keyed(key)``;

each beside the hand-written lock, as ns per turn above a bare call of the
work, fastest of the repeats (interleaved), and as a ratio to it. If *bare*
is above a target, no pure-Python turn meets it on that interpreter; the gap
from *bare* to *named calls* is the price of writing the protocol once.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Hashable
from pathlib import Path
from threading import get_ident
from typing import Any

if __package__ in (None, ""):  # run as a script: python bench/floor.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "bench"

from .contenders import HandwrittenKeyedLock, work

if sys.version_info >= (3, 12):  # in C
    current_task = asyncio.current_task
else:  # asyncio.current_task() is Python there: the two C calls it makes, as inturn does
    from asyncio.tasks import _current_tasks

    def current_task(
        _get: Callable[[object], object] = _current_tasks.get,
        _loop: Callable[[], object] = asyncio._get_running_loop,
    ) -> object:
        return _get(_loop())


class _Bare:
    """A turn on a free key, and nothing else."""

    __slots__ = ("_holder", "_key", "_lines", "_tokens", "token")

    def __init__(self, lines: dict[Hashable, object], tokens: Any, key: Hashable) -> None:
        self._lines = lines
        self._tokens = tokens
        self._key = key
        self._holder: object = None

    async def __aenter__(self) -> _Bare:
        task = current_task()
        if self._key in self._lines:
            raise RuntimeError("bench.floor: a busy key (never, here)")
        self._lines[self._key] = task
        self.token = next(self._tokens)
        self._holder = task
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._holder = None
        del self._lines[self._key]


class _Registry:
    """The registry's two verbs, each doing only what a free key needs."""

    def __init__(self) -> None:
        self.lines: dict[Hashable, object] = {}
        self.tokens = itertools.count()
        self.completed = 0

    def try_take(self, key: Hashable, holder: object) -> bool:
        if key in self.lines:
            raise RuntimeError("bench.floor: a busy key (never, here)")
        self.lines[key] = holder
        return True

    def finish(self, key: Hashable, holder: object, error: BaseException | None) -> None:
        if self.lines.pop(key) is not holder:
            raise RuntimeError("bench.floor: another holder (never, here)")
        if error is None:
            self.completed += 1


class _Named:
    """A turn on a free key through the calls one protocol makes."""

    __slots__ = ("_holder", "_registry", "keys", "token")

    def __init__(self, registry: _Registry, keys: tuple[Hashable, ...]) -> None:
        self._registry = registry
        self.keys = keys
        self._holder: object = None

    async def __aenter__(self) -> _Named:
        self._enter_now()
        return self

    def _enter_now(self) -> None:
        registry = self._registry
        holder = current_task()
        registry.try_take(self.keys[0], holder)
        self.token = next(registry.tokens)
        self._holder = holder

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        holder, self._holder = self._holder, None
        self._registry.finish(self.keys[0], holder, exc)


class _NamedQueue:
    def __init__(self) -> None:
        self._registry = _Registry()

    def keyed(self, *keys: Hashable) -> _Named:
        hash(keys[0])
        return _Named(self._registry, keys)


class _NamedLocked:
    """A thread's turn on a free key through the same named calls, each of the registry's
    under the lines' lock, as a queue that threads share must take them (issue 41)."""

    __slots__ = ("_holder", "_lock", "_registry", "keys", "token")

    def __init__(self, registry: _Registry, lock: Any, keys: tuple[Hashable, ...]) -> None:
        self._registry = registry
        self._lock = lock
        self.keys = keys
        self._holder: object = None

    def __enter__(self) -> _NamedLocked:
        self._enter_now()
        return self

    def _enter_now(self) -> None:
        registry = self._registry
        holder = get_ident()
        with self._lock:
            registry.try_take(self.keys[0], holder)
        self.token = next(registry.tokens)
        self._holder = holder

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        holder, self._holder = self._holder, None
        with self._lock:
            self._registry.finish(self.keys[0], holder, exc)


class NamedLockedQueue:
    """keyed() of the thread's named-call floor (bench/turns.py times it beside a thread's)."""

    def __init__(self) -> None:
        self._registry = _Registry()
        self._lock = threading.Lock()

    def keyed(self, *keys: Hashable) -> _NamedLocked:
        hash(keys[0])
        return _NamedLocked(self._registry, self._lock, keys)


async def _bare_call(n: int) -> None:
    for _ in range(n):
        await work()


async def _handwritten(n: int) -> None:
    locks = HandwrittenKeyedLock()
    for i in range(n):
        await locks.run(i, work)


async def _bare_turn(n: int) -> None:
    lines: dict[Hashable, object] = {}
    tokens = itertools.count()
    for i in range(n):
        async with _Bare(lines, tokens, i):
            await work()


async def _named_calls(n: int) -> None:
    keyed = _NamedQueue().keyed
    for i in range(n):
        async with keyed(i):
            await work()


async def _inturn(n: int) -> None:
    import inturn

    keyed = inturn.KeyedQueue().keyed
    for i in range(n):
        async with keyed(i):
            await work()


KINDS: dict[str, Callable[[int], Coroutine[Any, Any, None]]] = {
    "bare call": _bare_call,
    "hand-written lock": _handwritten,
    "bare turn (take a free key, pop it)": _bare_turn,
    "the same through named calls": _named_calls,
    "inturn `async with q.keyed(key)`": _inturn,
}


def _time(kind: Callable[[int], Coroutine[Any, Any, None]], n: int) -> float:
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        asyncio.run(kind(n))
        return (time.perf_counter() - start) / n * 1e9
    finally:
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.floor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--turns", type=int, default=100_000)
    options = parser.parse_args(argv)
    best = dict.fromkeys(KINDS, float("inf"))
    names = list(KINDS)
    for repeat in range(options.repeats):
        turn = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in turn:
            best[name] = min(best[name], _time(KINDS[name], options.turns))
    floor = best["bare call"]
    hand = best["hand-written lock"] - floor
    version = sys.version.split()[0]
    print(f"Python {version}, fastest of {options.repeats}, ns per turn above a bare call")
    print()
    print("| turn | ns | ratio to the hand-written lock |")
    print("|---|---:|---:|")
    for name in names[1:]:
        above = best[name] - floor
        print(f"| {name} | {above:,.0f} | {above / hand:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
