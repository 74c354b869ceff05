"""The multi-process contenders: locks that processes share, written as their users would.

A contender lives in a worker process (see bench/mp_worker.py). The worker
calls :meth:`setup` once, before the workers are released together, then
takes the lock again and again through :meth:`hold`, and finally calls
:meth:`teardown`. A sync contender's methods block; an async contender's
are coroutines, run in one event loop per worker.

Every contender is given the same ``workdir``, a fresh directory of the
run that every worker of the run shares; where its lock lives in it is its
own business. To add a contender (Redis, say), subclass
:class:`SyncContender` or :class:`AsyncContender` and list it in
:data:`CONTENDERS`.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from pathlib import Path
from typing import IO, Any, ClassVar

__all__ = (
    "CONTENDERS",
    "DEFAULT",
    "AsyncContender",
    "Contender",
    "SyncContender",
)


class Contender:
    """What every contender has: a name the table and the command line use."""

    name: ClassVar[str] = ""
    is_async: ClassVar[bool] = False

    def available(self) -> str | None:
        """Why this contender cannot run here (a missing package), or None if it can."""
        return None


class SyncContender(Contender):
    """A lock taken with blocking calls."""

    def setup(self, workdir: Path) -> None:
        """Make the lock object, in the worker, before the workers are released."""

    def hold(self, key: str) -> AbstractContextManager[Any]:
        """A context manager that holds key for the duration of its block."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Let go of whatever setup opened."""


class AsyncContender(Contender):
    """A lock taken by awaiting, in the worker's event loop."""

    is_async = True

    async def setup(self, workdir: Path) -> None:
        """Make the lock object, in the worker's loop, before the workers are released."""

    def hold(self, key: str) -> AbstractAsyncContextManager[Any]:
        """An async context manager that holds key for the duration of its block."""
        raise NotImplementedError

    async def teardown(self) -> None:
        """Let go of whatever setup opened."""


def _missing(module: str) -> str | None:
    try:
        __import__(module)
    except ImportError:
        return f"{module} is not installed (pip install -e '.[bench]')"
    return None


class InturnFile(AsyncContender):
    """inturn's file backend: ``async with queue.keyed(key):`` on a FileBackend queue."""

    name = "inturn-file"

    async def setup(self, workdir: Path) -> None:
        from inturn import KeyedQueue
        from inturn.backends.file import FileBackend

        self.queue = KeyedQueue(backend=FileBackend(workdir / "inturn"))

    def hold(self, key: str) -> AbstractAsyncContextManager[Any]:
        return self.queue.keyed(key)

    async def teardown(self) -> None:
        await self.queue.aclose()


class Filelock(SyncContender):
    """PyPI ``filelock`` with its defaults: ``with FileLock(path):``, which polls."""

    name = "filelock"

    def available(self) -> str | None:
        return _missing("filelock")

    def setup(self, workdir: Path) -> None:
        import filelock

        self.workdir = workdir
        self.locks: dict[str, filelock.FileLock] = {}
        self.make = filelock.FileLock

    def hold(self, key: str) -> AbstractContextManager[Any]:
        lock = self.locks.get(key)
        if lock is None:
            lock = self.locks[key] = self.make(str(self.workdir / f"{key}.filelock"))
        return lock


class _Flocked:
    """portalocker's documented use: lock an open file exclusively, then unlock it."""

    __slots__ = ("exclusive", "file", "lock", "unlock")

    def __init__(self, file: IO[Any]) -> None:
        import portalocker

        self.file = file
        self.lock = portalocker.lock
        self.unlock = portalocker.unlock
        self.exclusive = portalocker.LOCK_EX

    def __enter__(self) -> None:
        self.lock(self.file, self.exclusive)

    def __exit__(self, *exc: object) -> None:
        self.unlock(self.file)


class Portalocker(SyncContender):
    """PyPI ``portalocker``: a blocking exclusive flock, ``lock(fh, LOCK_EX)`` / ``unlock(fh)``."""

    name = "portalocker"

    def available(self) -> str | None:
        return _missing("portalocker")

    def setup(self, workdir: Path) -> None:
        self.workdir = workdir
        self.held: dict[str, _Flocked] = {}

    def hold(self, key: str) -> AbstractContextManager[Any]:
        held = self.held.get(key)
        if held is None:
            file = open(self.workdir / f"{key}.portalocker", "a+")  # noqa: SIM115 - kept open
            held = self.held[key] = _Flocked(file)
        return held

    def teardown(self) -> None:
        for held in self.held.values():
            held.file.close()


class NoLock(SyncContender):
    """No lock at all: not a contender, a check that the harness sees lost updates."""

    name = "no-lock"

    def hold(self, key: str) -> AbstractContextManager[Any]:
        return nullcontext()


#: Every contender, by name.
CONTENDERS: dict[str, type[Contender]] = {
    cls.name: cls for cls in (InturnFile, Filelock, Portalocker, NoLock)
}

#: The contenders measured unless the command line names others.
DEFAULT: tuple[str, ...] = ("inturn-file", "filelock", "portalocker")
