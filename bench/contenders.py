"""The contenders: what users would write or pick instead of inturn, written as they would.

Each contender gives the scenarios two things:

- ``sequential(n)``: n uncontended calls on distinct keys, in the loop a user
  would write (so each pays exactly its own API's cost);
- ``submit(key, body)``: the coroutine that runs ``body()`` holding ``key``,
  for the gathered scenarios; ``None`` for contenders that hold nothing.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import io
import subprocess
import sys
import tarfile
import tempfile
from collections import defaultdict
from collections.abc import Callable, Coroutine, Hashable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar, TypeVar

import wrapt

import inturn

Body = Callable[[], Coroutine[Any, Any, Any]]
C = TypeVar("C")

#: InturnSlots' max_running, as in scenario (g) (bench/flow.py).
SLOTS = 32


async def work() -> int:
    """The work of scenario (a): nothing, so that only the lock's cost shows."""
    return 1


async def work_id(id: int) -> int:
    return 1


class HandwrittenKeyedLock:
    """What a competent user writes by hand: a dict of asyncio.Lock with a
    reference count, deleting a key's lock once nobody holds or waits for it."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, list[Any]] = {}  # key -> [lock, users]

    async def run(self, key: Hashable, fn: Body) -> Any:
        entry = self._locks.get(key)
        if entry is None:
            entry = self._locks[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:
                return await fn()
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[key]

    def __len__(self) -> int:
        return len(self._locks)


async def run_through(key: Hashable, fn: Body) -> Any:
    """A run(key, fn) that holds nothing: the shape of a hand-written run()."""
    return await fn()


async def run_through_args(key: Hashable, fn: Body, /, *args: Any, **kwargs: Any) -> Any:
    """A run(key, fn, *args, **kwargs) that holds nothing: the shape of inturn.run()."""
    return await fn(*args, **kwargs)


class _Nothing:
    """An async context manager that holds nothing."""

    async def __aenter__(self) -> None:
        pass

    async def __aexit__(self, *exc: object) -> None:
        pass


NOTHING = _Nothing()


async def hold_through(key: Hashable, body: Body) -> Any:
    """An `async with lock(key)` that holds nothing: the shape of context-manager locks."""
    async with NOTHING:
        return await body()


async def decorated_through(id: Hashable, body: Body) -> Any:
    return await body()


#: A decorated function that holds nothing: the shape of a @queue_by_key call.
decorated_through_wrapper = wrapt.FunctionWrapper(
    decorated_through, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)
)


class Contender:
    name = ""
    holds = True  # False for contenders without a lock (bare, empty wrapper)

    def reset(self) -> None:
        """Start from fresh state."""

    async def sequential(self, n: int) -> None:
        raise NotImplementedError

    def submit(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        raise NotImplementedError

    def through(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        """submit()'s call shape, holding nothing: the floor of its bookkeeping."""
        return body()

    def keys_kept(self) -> int:
        """How many keys the contender still references when idle."""
        return 0


class Bare(Contender):
    name = "bare"
    holds = False

    async def sequential(self, n: int) -> None:
        for _ in range(n):
            await work()

    def submit(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return body()


class Handwritten(Contender):
    name = "handwritten"

    def reset(self) -> None:
        self.locks = HandwrittenKeyedLock()

    async def sequential(self, n: int) -> None:
        locks = self.locks
        for i in range(n):
            await locks.run(i, work)

    def submit(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return self.locks.run(key, body)

    def through(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return run_through(key, body)

    def keys_kept(self) -> int:
        return len(self.locks)


class DefaultDict(Contender):
    name = "defaultdict"

    def reset(self) -> None:
        self.locks: defaultdict[Hashable, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def sequential(self, n: int) -> None:
        locks = self.locks
        for i in range(n):
            async with locks[i]:
                await work()

    async def submit(self, key: Hashable, body: Body) -> Any:
        async with self.locks[key]:
            return await body()

    def through(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return hold_through(key, body)

    def keys_kept(self) -> int:
        return len(self.locks)


class AsyncioKeyedLock(Contender):
    name = "asyncio-keyed-lock"

    def reset(self) -> None:
        from asyncio_keyed_lock import AsyncioKeyedLock as Lock

        self.lock = Lock()

    async def sequential(self, n: int) -> None:
        lock = self.lock
        for i in range(n):
            async with lock(i):  # type: ignore[arg-type]
                await work()

    async def submit(self, key: Hashable, body: Body) -> Any:
        async with self.lock(key):  # type: ignore[arg-type]
            return await body()

    def through(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return hold_through(key, body)

    def keys_kept(self) -> int:
        return int(self.lock.active_keys_count)


class InturnRun(Contender):
    name = "inturn.run"
    module: ModuleType = inturn  # the inturn measured: this tree's, or an earlier one's
    #: The queue's options: none, the default queue (bench/turns.py times shapes with some)
    options: ClassVar[dict[str, Any]] = {}

    def reset(self) -> None:
        self.queue = self.module.KeyedQueue(**self.options)

    async def sequential(self, n: int) -> None:
        run = self.queue.run
        for i in range(n):
            await run(i, work)

    def submit(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return self.queue.run(key, body)

    def through(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return run_through_args(key, body)

    def keys_kept(self) -> int:
        return self.queue.active_count


class InturnSlots(InturnRun):
    """inturn.run on a queue with max_running: each turn also takes a running slot."""

    name = f"inturn.run max_running={SLOTS}"

    def reset(self) -> None:
        self.queue = self.module.KeyedQueue(max_running=SLOTS)


class InturnKeyed(InturnRun):
    name = "inturn.keyed"

    async def sequential(self, n: int) -> None:
        keyed = self.queue.keyed
        for i in range(n):
            async with keyed(i):
                await work()

    async def submit(self, key: Hashable, body: Body) -> Any:
        async with self.queue.keyed(key):
            return await body()

    def through(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return hold_through(key, body)


class InturnDecorator(InturnRun):
    name = "@queue_by_key"

    def reset(self) -> None:
        super().reset()

        @self.queue.queue_by_key(key="k-{id}")
        async def decorated(id: Hashable) -> int:
            return 1

        @self.queue.queue_by_key(key="k-{id}")
        async def decorated_body(id: Hashable, body: Body) -> Any:
            return await body()

        self.decorated = decorated
        self.decorated_body = decorated_body

    async def sequential(self, n: int) -> None:
        decorated = self.decorated
        for i in range(n):
            await decorated(i)

    def submit(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return self.decorated_body(key, body)

    def through(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return decorated_through_wrapper(key, body)  # type: ignore[no-any-return]


class WraptEmpty(Contender):
    """The decorator machinery alone: a wrapt wrapper that only calls through."""

    name = "wrapt (empty)"
    holds = False

    def reset(self) -> None:
        self.wrapped = wrapt.FunctionWrapper(
            work_id, lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)
        )

    async def sequential(self, n: int) -> None:
        wrapped = self.wrapped
        for i in range(n):
            await wrapped(i)

    def submit(self, key: Hashable, body: Body) -> Coroutine[Any, Any, Any]:
        return body()


def extract_version(ref: str) -> tuple[Path, str]:
    """Unpack src/inturn as it was at git revision ref: (the directory to import from, its name).

    The package is renamed ``inturn_<ref>``, so that it imports beside this tree's.
    """
    root = Path(__file__).resolve().parent.parent
    archive = subprocess.run(
        ["git", "archive", "--format=tar", ref, "src/inturn"],
        cwd=root,
        check=True,
        capture_output=True,
    ).stdout
    name = "inturn_" + "".join(c if c.isalnum() else "_" for c in ref)
    where = Path(tempfile.mkdtemp(prefix="inturn-bench-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(where, filter="data")
    (where / "src" / "inturn").rename(where / name)
    return where, name


@functools.cache
def load_version(ref: str) -> ModuleType:
    """Import inturn as it was at git revision ref, as the package ``inturn_<ref>`` (once)."""
    where, name = extract_version(ref)
    sys.path.insert(0, str(where))
    return importlib.import_module(name)


def at_version(
    ref: str, kinds: Sequence[type[C]] = (InturnRun, InturnKeyed, InturnDecorator)
) -> list[type[C]]:
    """The inturn contenders kinds again, on the inturn of git revision ref (named name@ref).

    Each kind takes its queue from its class's ``module``.
    """
    module = load_version(ref)
    return [
        type(cls.__name__, (cls,), {"name": f"{cls.name}@{ref}", "module": module}) for cls in kinds
    ]


ALL: list[type[Contender]] = [
    Bare,
    Handwritten,
    DefaultDict,
    AsyncioKeyedLock,
    InturnRun,
    InturnSlots,
    InturnKeyed,
    InturnDecorator,
    WraptEmpty,
]
