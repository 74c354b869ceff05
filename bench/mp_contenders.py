"""The multi-process contenders: locks that processes share, written as their users would.

A contender lives in a worker process (see bench/mp_worker.py). The worker
calls :meth:`setup` once, before the workers are released together, then
takes the lock again and again through :meth:`hold`, and finally calls
:meth:`teardown`. A sync contender's methods block; an async contender's
are coroutines, run in one event loop per worker.

Every worker of a run is given the same :class:`Run`: ``workdir``, a fresh
directory of the run that every worker shares (where a file lock lives in
it is its own business), and for the Redis scenarios the server's URL and a
tag unique to the run, and for the PostgreSQL scenarios the server's URL
and that tag. A contender's :attr:`~Contender.kinds` say which scenarios it
runs in: ``"file"`` (one host), ``"redis"``, ``"postgres"``, and the sync
scenarios ``"sync-file"``, ``"sync-redis"`` and ``"sync-postgres"``
(inturn's sync turns beside the sync locks users write). To add a
contender, subclass
:class:`SyncContender` or :class:`AsyncContender` and list it in
:data:`CONTENDERS`.

The Redis contenders are written as their documentation shows, with their
defaults: a lock per call for redis-py (``with r.lock(name):``), one lock
object per key for python-redis-lock and pottery (their examples make the
lock once and enter it). In the sync scenarios redis-py's lock is given
what production code gives it: a lease (``timeout``, inturn's default
lease) and a bound on the wait (``blocking_timeout``).

The PostgreSQL contender that is not inturn is what a user writes today: one
autocommit psycopg connection per process, ``SELECT pg_advisory_lock(id)``
before the work and ``SELECT pg_advisory_unlock(id)`` after it, the id a
64-bit digest of the key. The server queues the waiters of a lock in arrival
order and wakes the next one at the unlock, so its numbers are the server's
own FIFO and hand-off, which inturn's PostgresBackend is held to.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import importlib
import os
import struct
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar

__all__ = (
    "CONTENDERS",
    "DEFAULT",
    "AsyncContender",
    "Contender",
    "Run",
    "SyncContender",
    "contender",
)


@dataclass(frozen=True)
class Run:
    """What every worker of one run shares."""

    #: A fresh directory of the run (the shared counter lives in it too).
    workdir: Path
    #: The Redis server of the Redis scenarios, None in the file ones.
    redis_url: str | None = None
    #: Unique to the run: Redis names (namespace, lock names) include it.
    tag: str = "run"
    #: The inturn package the inturn contenders import: ``inturn``, or an
    #: earlier revision's ``inturn_<ref>`` (``--before``).
    package: str = "inturn"
    #: The PostgreSQL server of the PostgreSQL scenarios, None in the others.
    postgres_url: str | None = None

    def inturn(self, module: str = "") -> Any:
        """The inturn package of this run (or one of its modules, ``.backends.file`` say)."""
        return importlib.import_module(self.package + module)

    def needs_redis(self) -> str:
        if self.redis_url is None:
            raise RuntimeError("a Redis contender was run without a Redis server")
        return self.redis_url

    def needs_postgres(self) -> str:
        if self.postgres_url is None:
            raise RuntimeError("a PostgreSQL contender was run without a PostgreSQL server")
        return self.postgres_url


class Contender:
    """What every contender has: a name the table and the command line use."""

    name: ClassVar[str] = ""
    is_async: ClassVar[bool] = False
    #: The kinds of scenario it runs in: "file" (one host), "redis", "postgres",
    #: "sync-file", "sync-redis", "sync-postgres", "rtt" (bench/rtt.py's only), or
    #: "any" (every kind).
    kinds: ClassVar[tuple[str, ...]] = ("file",)

    def available(self) -> str | None:
        """Why this contender cannot run here (a missing package), or None if it can."""
        return None


class SyncContender(Contender):
    """A lock taken with blocking calls."""

    def setup(self, run: Run) -> None:
        """Make the lock object, in the worker, before the workers are released."""

    def hold(self, key: str) -> AbstractContextManager[Any]:
        """A context manager that holds key for the duration of its block."""
        raise NotImplementedError

    def teardown(self) -> None:
        """Let go of whatever setup opened."""


class AsyncContender(Contender):
    """A lock taken by awaiting, in the worker's event loop."""

    is_async = True

    async def setup(self, run: Run) -> None:
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
        return f"{module} is not installed (pip install -e . --group bench)"
    return None


class InturnFile(AsyncContender):
    """inturn's file backend: ``async with queue.keyed(key):`` on a FileBackend queue."""

    name = "inturn-file"
    kinds = ("file", "sync-file")

    async def setup(self, run: Run) -> None:
        backend = run.inturn(".backends.file").FileBackend(run.workdir / "inturn")
        self.queue = run.inturn().KeyedQueue(backend=backend)

    def hold(self, key: str) -> AbstractAsyncContextManager[Any]:
        return self.queue.keyed(key)

    async def teardown(self) -> None:
        await self.queue.aclose()


class InturnFileSync(SyncContender):
    """inturn's file backend from plain code: ``with queue.keyed(key):``, no event loop."""

    name = "inturn-file-sync"
    kinds = ("sync-file",)

    def setup(self, run: Run) -> None:
        backend = run.inturn(".backends.file").FileBackend(run.workdir / "inturn")
        self.queue = run.inturn().KeyedQueue(backend=backend)

    def hold(self, key: str) -> AbstractContextManager[Any]:
        return self.queue.keyed(key)  # type: ignore[no-any-return]

    def teardown(self) -> None:
        _close_sync(self.queue)


def _close_sync(queue: Any) -> None:
    """Close a queue that plain code used, and its backend."""
    queue.close()
    queue.drain_sync()
    asyncio.run(queue.backend.aclose())


class Filelock(SyncContender):
    """PyPI ``filelock`` with its defaults: ``with FileLock(path):``, which polls."""

    name = "filelock"
    kinds = ("file", "sync-file")

    def available(self) -> str | None:
        return _missing("filelock")

    def setup(self, run: Run) -> None:
        import filelock

        self.workdir = run.workdir
        self.locks: dict[str, filelock.FileLock] = {}
        self.make = filelock.FileLock

    def hold(self, key: str) -> AbstractContextManager[Any]:
        lock = self.locks.get(key)
        if lock is None:
            lock = self.locks[key] = self.make(str(self.workdir / f"{key}.filelock"))
        return lock


class FileFifoFloor(SyncContender):
    """Not a lock to use: the least a fair hand-off costs on one host's files (sync scenarios).

    A ticket lock in one file per key, kept open: a turn draws a ticket
    under ``flock`` (read and write the file's two counters), and if it is
    not served at once, makes a named pipe for its ticket before letting the
    ``flock`` go, then blocks opening it for reading; a release serves the
    next ticket under ``flock`` and, if one waits, opens that ticket's pipe
    for writing, which wakes the waiter (each open waits for the other end).
    Nothing else: no crash safety (a holder or a waiter that dies blocks the
    key for good), no timeout, no interrupt safety, one thread per process.
    inturn's sync turn keeps arrival order too; this is what keeping it
    costs at the least with files, as ``redis-fifo-floor`` is with Redis.
    """

    name = "file-fifo-floor"
    kinds = ("sync-file",)

    def setup(self, run: Run) -> None:
        self.workdir = run.workdir
        self.files: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        fd = self.files.get(key)
        if fd is None:
            fd = self.files[key] = os.open(self.workdir / f"{key}.floor", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        drawn, served = _counters(fd)
        os.pwrite(fd, _COUNTERS.pack(drawn + 1, served), 0)
        pipe = self.workdir / f"{key}.floor.{drawn}"
        if drawn != served:
            os.mkfifo(pipe)
        fcntl.flock(fd, fcntl.LOCK_UN)
        if drawn != served:  # (the release opens it for writing: that is the wake-up)
            os.close(os.open(pipe, os.O_RDONLY))
            os.unlink(pipe)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_EX)
            drawn, served = _counters(fd)
            os.pwrite(fd, _COUNTERS.pack(drawn, served + 1), 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
            if served + 1 != drawn:  # the next ticket waits (its pipe is made: see above)
                os.close(os.open(self.workdir / f"{key}.floor.{served + 1}", os.O_WRONLY))

    def teardown(self) -> None:
        for fd in self.files.values():
            os.close(fd)


#: A file-fifo-floor file: the tickets drawn, and the ticket served.
_COUNTERS = struct.Struct("=QQ")


def _counters(fd: int) -> tuple[int, int]:
    data = os.pread(fd, _COUNTERS.size, 0)
    return _COUNTERS.unpack(data) if data else (0, 0)  # type: ignore[return-value]


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

    def setup(self, run: Run) -> None:
        self.workdir = run.workdir
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
    kinds = ("any",)

    def hold(self, key: str) -> AbstractContextManager[Any]:
        return nullcontext()


class InturnRedis(AsyncContender):
    """inturn's Redis backend: ``async with queue.keyed(key):`` on a RedisBackend queue."""

    name = "inturn-redis"
    kinds = ("redis", "sync-redis")

    def available(self) -> str | None:
        return _missing("redis")

    async def setup(self, run: Run) -> None:
        redis_backend = run.inturn(".backends.redis").RedisBackend
        backend = redis_backend.from_url(run.needs_redis(), namespace=f"bench-{run.tag}")
        self.queue = run.inturn().KeyedQueue(backend=backend)

    def hold(self, key: str) -> AbstractAsyncContextManager[Any]:
        return self.queue.keyed(key)

    async def teardown(self) -> None:
        await self.queue.aclose()


class InturnRedisSync(SyncContender):
    """inturn's Redis backend from plain code: ``with queue.keyed(key):``, no event loop."""

    name = "inturn-redis-sync"
    kinds = ("sync-redis",)

    def available(self) -> str | None:
        return _missing("redis")

    def setup(self, run: Run) -> None:
        redis_backend = run.inturn(".backends.redis").RedisBackend
        backend = redis_backend.from_url(run.needs_redis(), namespace=f"bench-{run.tag}")
        self.queue = run.inturn().KeyedQueue(backend=backend)

    def hold(self, key: str) -> AbstractContextManager[Any]:
        return self.queue.keyed(key)  # type: ignore[no-any-return]

    def teardown(self) -> None:
        _close_sync(self.queue)


#: The sync scenarios' redis-py lock: its lease (inturn's default lease) and its
#: longest wait, in seconds (a wait that long fails the run; none comes near it).
LEASE, WAIT = 10.0, 60.0


class _RedisClient(SyncContender):
    """A sync contender on one redis-py client, made in setup and closed in teardown."""

    kinds = ("redis",)
    needs: ClassVar[str] = "redis"

    def available(self) -> str | None:
        return _missing(self.needs)

    def setup(self, run: Run) -> None:
        import redis

        self.client = redis.Redis.from_url(run.needs_redis())

    def teardown(self) -> None:
        self.client.close()


class RedisPyLock(_RedisClient):
    """redis-py's own lock with its defaults: ``with r.lock(name):``, which polls every 0.1 s."""

    name = "redis-py-lock"

    def hold(self, key: str) -> AbstractContextManager[Any]:
        return self.client.lock(key)


class RedisPyLockLease(RedisPyLock):
    """redis-py's lock as production code takes it: ``with r.lock(name, timeout=...,
    blocking_timeout=...):`` (a lease, and a bound on the wait); it still polls every 0.1 s."""

    name = "redis-py-lock-lease"
    kinds = ("sync-redis",)

    def hold(self, key: str) -> AbstractContextManager[Any]:
        return self.client.lock(key, timeout=LEASE, blocking_timeout=WAIT)


#: FifoFloor's scripts. KEYS: the key's ticket counter, the ticket served now.
#: Take: draw a ticket; (1, n) if it is served now, else (0, n) and BLPOP "<counter>:n".
_FLOOR_TAKE = """
local n = redis.call('INCR', KEYS[1])
redis.call('SET', KEYS[2], n, 'NX')
if tonumber(redis.call('GET', KEYS[2])) == n then return {1, n} end
return {0, n}
"""
#: Release: serve the next ticket, waking its BLPOP if it was drawn; the last one out
#: deletes the counters.
_FLOOR_GIVE = """
local s = redis.call('INCR', KEYS[2])
if s > tonumber(redis.call('GET', KEYS[1]) or '0') then
  redis.call('DEL', KEYS[1], KEYS[2])
else
  redis.call('LPUSH', KEYS[1] .. ':' .. s, 1)
end
return s
"""


class FifoFloor(_RedisClient):
    """Not a lock to use: the least a fair hand-off costs on Redis, for the sync scenarios.

    A ticket lock: a turn draws a ticket (one script), and if it is not
    served at once blocks in ``BLPOP`` on its ticket's list; a release serves
    the next ticket and pushes to its list, so Redis wakes the next process
    itself: no subscription, no thread, no lease, no fencing, no crash
    safety (a holder that dies blocks the key for good). inturn's sync turn
    keeps arrival order too; this is what keeping it costs at the least.
    """

    name = "redis-fifo-floor"
    kinds = ("sync-redis",)

    def setup(self, run: Run) -> None:
        super().setup(run)
        self.take = self.client.register_script(_FLOOR_TAKE)
        self.give = self.client.register_script(_FLOOR_GIVE)

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        counter, served = f"floor:{key}", f"floor:{key}:served"
        held, ticket = self.take(keys=(counter, served))
        if not held and self.client.blpop([f"{counter}:{ticket}"], timeout=WAIT) is None:
            raise TimeoutError(f"ticket {ticket} was not served within {WAIT:g} s")
        try:
            yield
        finally:
            self.give(keys=(counter, served))


class RedisPyAsyncLock(AsyncContender):
    """redis-py's asyncio lock as production code takes it: ``async with r.lock(name,
    timeout=..., blocking_timeout=...):`` on a ``redis.asyncio.Redis``: what an async
    turn replaces (r1 to r3, and bench/rtt.py)."""

    name = "redis-py-async-lock"
    kinds = ("redis", "rtt")

    def available(self) -> str | None:
        return _missing("redis")

    async def setup(self, run: Run) -> None:
        import redis.asyncio

        self.client = redis.asyncio.Redis.from_url(run.needs_redis())

    def hold(self, key: str) -> AbstractAsyncContextManager[Any]:
        return self.client.lock(key, timeout=LEASE, blocking_timeout=WAIT)

    async def teardown(self) -> None:
        await self.client.aclose()


class PythonRedisLock(_RedisClient):
    """PyPI ``python-redis-lock``: ``with redis_lock.Lock(conn, name):``; waiters BLPOP."""

    name = "python-redis-lock"
    needs = "redis_lock"

    def setup(self, run: Run) -> None:
        import redis_lock

        super().setup(run)
        self.make = redis_lock.Lock
        self.locks: dict[str, Any] = {}

    def hold(self, key: str) -> AbstractContextManager[Any]:
        lock = self.locks.get(key)
        if lock is None:
            lock = self.locks[key] = self.make(self.client, key)
        return lock  # type: ignore[no-any-return]


class Pottery(_RedisClient):
    """PyPI ``pottery``: ``with Redlock(key=name, masters={r}):``; waiters retry at random."""

    name = "pottery"
    needs = "pottery"

    def setup(self, run: Run) -> None:
        from pottery import Redlock

        super().setup(run)
        self.make = Redlock
        self.locks: dict[str, Any] = {}

    def hold(self, key: str) -> AbstractContextManager[Any]:
        lock = self.locks.get(key)
        if lock is None:
            lock = self.locks[key] = self.make(key=key, masters={self.client})
        return lock  # type: ignore[no-any-return]


def _missing_postgres() -> str | None:
    return _missing("psycopg") or _missing("psycopg_pool")


class InturnPostgres(AsyncContender):
    """inturn's PostgreSQL backend: ``async with queue.keyed(key):`` on a PostgresBackend queue."""

    name = "inturn-postgres"
    kinds = ("postgres", "sync-postgres")

    def available(self) -> str | None:
        return _missing_postgres()

    async def setup(self, run: Run) -> None:
        postgres_backend = run.inturn(".backends.postgres").PostgresBackend
        backend = postgres_backend.from_url(run.needs_postgres(), namespace=f"bench-{run.tag}")
        self.queue = run.inturn().KeyedQueue(backend=backend)

    def hold(self, key: str) -> AbstractAsyncContextManager[Any]:
        return self.queue.keyed(key)

    async def teardown(self) -> None:
        await self.queue.aclose()


class InturnPostgresSync(SyncContender):
    """inturn's PostgreSQL backend from plain code: ``with queue.keyed(key):``, no event loop."""

    name = "inturn-postgres-sync"
    kinds = ("sync-postgres",)

    def available(self) -> str | None:
        return _missing_postgres()

    def setup(self, run: Run) -> None:
        postgres_backend = run.inturn(".backends.postgres").PostgresBackend
        backend = postgres_backend.from_url(run.needs_postgres(), namespace=f"bench-{run.tag}")
        self.queue = run.inturn().KeyedQueue(backend=backend)

    def hold(self, key: str) -> AbstractContextManager[Any]:
        return self.queue.keyed(key)  # type: ignore[no-any-return]

    def teardown(self) -> None:
        _close_sync(self.queue)


def advisory_id(key: str) -> int:
    """A key's advisory-lock id, as a user derives one: 64 bits of a digest, signed."""
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


#: The hand-written loop's two statements.
LOCK, UNLOCK = "SELECT pg_advisory_lock(%s)", "SELECT pg_advisory_unlock(%s)"


class _AdvisoryLock:
    """``SELECT pg_advisory_lock(id)`` on entry, ``SELECT pg_advisory_unlock(id)`` on exit."""

    __slots__ = ("connection", "params")

    def __init__(self, connection: Any, lock: int) -> None:
        self.connection = connection
        self.params = (lock,)

    def __enter__(self) -> None:
        self.connection.execute(LOCK, self.params)

    def __exit__(self, *exc: object) -> None:
        self.connection.execute(UNLOCK, self.params)

    async def __aenter__(self) -> None:
        await self.connection.execute(LOCK, self.params)

    async def __aexit__(self, *exc: object) -> None:
        await self.connection.execute(UNLOCK, self.params)


class PgAdvisoryLock(AsyncContender):
    """The hand-written loop, async: one autocommit ``psycopg.AsyncConnection`` per process,
    ``SELECT pg_advisory_lock(id)`` ... work ... ``SELECT pg_advisory_unlock(id)``."""

    name = "pg-advisory-lock"
    kinds = ("postgres",)

    def available(self) -> str | None:
        return _missing("psycopg")

    async def setup(self, run: Run) -> None:
        import psycopg

        self.connection = await psycopg.AsyncConnection.connect(
            run.needs_postgres(), autocommit=True
        )
        self.locks: dict[str, _AdvisoryLock] = {}

    def hold(self, key: str) -> AbstractAsyncContextManager[Any]:
        lock = self.locks.get(key)
        if lock is None:
            lock = self.locks[key] = _AdvisoryLock(self.connection, advisory_id(key))
        return lock

    async def teardown(self) -> None:
        await self.connection.close()


class PgAdvisoryLockSync(SyncContender):
    """The hand-written loop, sync: one autocommit ``psycopg.Connection`` per process,
    ``SELECT pg_advisory_lock(id)`` ... work ... ``SELECT pg_advisory_unlock(id)``."""

    name = "pg-advisory-lock-sync"
    kinds = ("sync-postgres",)

    def available(self) -> str | None:
        return _missing("psycopg")

    def setup(self, run: Run) -> None:
        import psycopg

        self.connection = psycopg.Connection.connect(run.needs_postgres(), autocommit=True)
        self.locks: dict[str, _AdvisoryLock] = {}

    def hold(self, key: str) -> AbstractContextManager[Any]:
        lock = self.locks.get(key)
        if lock is None:
            lock = self.locks[key] = _AdvisoryLock(self.connection, advisory_id(key))
        return lock

    def teardown(self) -> None:
        self.connection.close()


#: Every contender, by name.
CONTENDERS: dict[str, type[Contender]] = {
    cls.name: cls
    for cls in (
        InturnFile,
        InturnFileSync,
        Filelock,
        FileFifoFloor,
        Portalocker,
        InturnRedis,
        InturnRedisSync,
        RedisPyLock,
        RedisPyLockLease,
        FifoFloor,
        RedisPyAsyncLock,
        PythonRedisLock,
        Pottery,
        InturnPostgres,
        InturnPostgresSync,
        PgAdvisoryLock,
        PgAdvisoryLockSync,
        NoLock,
    )
}

#: The contenders that ``--before REF`` measures again as ``name@REF``, on inturn at REF.
VERSIONED: tuple[str, ...] = (
    "inturn-file",
    "inturn-file-sync",
    "inturn-redis",
    "inturn-redis-sync",
    "inturn-postgres",
    "inturn-postgres-sync",
)


def contender(name: str) -> Contender:
    """The contender called name: one of CONTENDERS, or ``name@REF`` of one of VERSIONED."""
    base, at, _ = name.partition("@")
    if at and base not in VERSIONED:
        raise KeyError(f"{name}: only {', '.join(VERSIONED)} can be measured at a revision")
    cls = CONTENDERS[base]
    return type(cls.__name__, (cls,), {"name": name})() if at else cls()


#: The contenders measured unless the command line names others.
DEFAULT: tuple[str, ...] = (
    "inturn-file",
    "inturn-file-sync",
    "filelock",
    "file-fifo-floor",
    "portalocker",
    "inturn-redis",
    "inturn-redis-sync",
    "redis-py-lock",
    "redis-py-lock-lease",
    "redis-fifo-floor",
    "redis-py-async-lock",
    "python-redis-lock",
    "pottery",
    "inturn-postgres",
    "inturn-postgres-sync",
    "pg-advisory-lock",
    "pg-advisory-lock-sync",
)
