"""What the backends log: rare events, at the level they deserve, naming keys as users gave them.

The loggers: ``inturn.file``, ``inturn.redis`` and ``inturn.bridge``, all
under ``inturn``. A turn that goes as it should, taken at once or after a
wait, logs nothing at all, not even at DEBUG.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Hashable
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from inturn import BackendUnavailable, KeyedQueue, LeaseLost
from inturn import _bridge as bridge
from inturn.backends.file import FileBackend, _deaths
from inturn.backends.file._directory import Directory
from inturn.backends.redis import RedisBackend

from support.file_checks import line_file, spec
from support.helpers import PATIENCE, settle
from support.processes import Worker, until
from support.servers import Server

#: Short leases, so that a fault's consequences come soon.
LEASE = 0.5
#: A key as a user gives it: what a log line must show (not a digest, not a Redis key).
KEY = "orders/42"


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    """Every record of the inturn loggers, DEBUG included."""
    caplog.set_level(logging.DEBUG, logger="inturn")
    return caplog


def records(caplog: pytest.LogCaptureFixture, name: str, level: int) -> list[str]:
    """The messages logged on logger name at level."""
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno == level]


def ours(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every record of an inturn logger, as ``name LEVEL message``."""
    return [
        f"{r.name} {r.levelname} {r.getMessage()}"
        for r in caplog.records
        if r.name == "inturn" or r.name.startswith("inturn.")
    ]


@pytest.fixture
def backend(directory: Path) -> FileBackend:
    return FileBackend(directory)


@pytest.fixture
async def redis_backends() -> AsyncIterator[list[RedisBackend]]:
    """Redis backends a test makes (with redis_backend()); closed at its end."""
    made: list[RedisBackend] = []
    yield made
    for made_backend in made:
        await asyncio.wait_for(made_backend.aclose(), PATIENCE)


def redis_backend(made: list[RedisBackend], url: str, namespace: str) -> RedisBackend:
    made.append(RedisBackend.from_url(url, namespace=namespace, lease=LEASE))
    return made[-1]


# -- the file backend ---------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["waiting", "after"])
async def test_a_holder_that_died_is_logged_by_whoever_takes_its_key_over(
    directory: Path,
    backend: FileBackend,
    workers: list[Worker],
    logs: pytest.LogCaptureFixture,
    when: str,
) -> None:
    holder = await Worker.start(spec(directory), "hold", KEY)
    workers.append(holder)
    await holder.expect("holding")
    queue = KeyedQueue(backend=backend)
    if when == "waiting":  # this process waits on the holder's ticket as it dies
        waiter = asyncio.create_task(queue.run(KEY, lambda: None))
        await until(lambda: len(backend.line(KEY)) == 2, "this process waits")
        holder.kill()
        await asyncio.wait_for(waiter, PATIENCE)
    else:  # the next turn finds its ticket, which nobody waited on
        holder.kill()
        await holder.process.wait()
        await queue.run(KEY, lambda: None)
    (line,) = records(logs, "inturn.file", logging.WARNING)
    assert f"process {holder.pid} died holding key 'orders/42'" in line
    assert f"process {os.getpid()} takes the key over" in line
    assert str(directory) in line
    assert ours(logs) == [f"inturn.file WARNING {line}"]


async def test_a_waiter_that_died_is_logged_at_info(
    directory: Path, backend: FileBackend, workers: list[Worker], logs: pytest.LogCaptureFixture
) -> None:
    gate = asyncio.Event()
    holder = asyncio.create_task(KeyedQueue(backend=backend).run(KEY, gate.wait))
    await until(lambda: len(backend.line(KEY)) == 1, "this process holds")
    doomed = await Worker.start(spec(directory), "hold", KEY)
    workers.append(doomed)
    await until(lambda: len(backend.line(KEY)) == 2, "the doomed worker waits")
    follower = asyncio.create_task(KeyedQueue(backend=backend).run(KEY, lambda: None))
    await until(lambda: len(backend.line(KEY)) == 3, "this process waits behind it")
    doomed.kill()
    await until(lambda: len(backend.line(KEY)) == 2, "the doomed worker left the line")
    await settle(lambda: bool(records(logs, "inturn.file", logging.INFO)))
    gate.set()
    await asyncio.wait_for(asyncio.gather(holder, follower), PATIENCE)
    (line,) = records(logs, "inturn.file", logging.INFO)
    assert f"process {doomed.pid} died waiting for key 'orders/42'" in line
    assert len(ours(logs)) == 1


async def test_a_waiter_that_gives_up_is_no_death(
    backend: FileBackend, logs: pytest.LogCaptureFixture
) -> None:
    # Its ticket closes as a dead process's does, but says first that it leaves.
    gate = asyncio.Event()
    holder = asyncio.create_task(KeyedQueue(backend=backend).run(KEY, gate.wait))
    await until(lambda: len(backend.line(KEY)) == 1, "this process holds")
    impatient = asyncio.create_task(KeyedQueue(backend=backend, timeout=0.2).run(KEY, lambda: None))
    await until(lambda: len(backend.line(KEY)) == 2, "the impatient turn waits")
    follower = asyncio.create_task(KeyedQueue(backend=backend).run(KEY, lambda: None))
    await until(lambda: len(backend.line(KEY)) == 3, "the follower waits behind it")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(impatient, PATIENCE)
    gate.set()
    await asyncio.wait_for(asyncio.gather(holder, follower), PATIENCE)
    assert ours(logs) == []


async def test_files_deleted_under_a_holder_are_logged(
    directory: Path, backend: FileBackend, logs: pytest.LogCaptureFixture
) -> None:
    queue = KeyedQueue(backend=backend)
    with pytest.raises(LeaseLost):
        async with queue.keyed(KEY):
            os.unlink(line_file(directory, KEY))  # another process of this user
    (line,) = records(logs, "inturn.file", logging.WARNING)
    assert "the turn on key 'orders/42'" in line
    assert str(directory) in line
    assert "were deleted while it held" in line


async def test_a_removed_directory_is_logged(
    directory: Path, backend: FileBackend, logs: pytest.LogCaptureFixture
) -> None:
    queue = KeyedQueue(backend=backend)
    await queue.run(KEY, lambda: None)
    shutil.rmtree(directory)  # a tmp cleaner
    await queue.run(KEY, lambda: None)
    (line,) = records(logs, "inturn.file", logging.WARNING)
    assert f"the directory {directory} was removed" in line
    assert "key 'orders/42'" in line


@pytest.mark.parametrize("sync", [False, True])
async def test_a_full_disk_is_logged_with_the_directory_and_the_key(
    directory: Path,
    backend: FileBackend,
    logs: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    sync: bool,
) -> None:
    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "mkfifo", full)
    take = (
        asyncio.to_thread(backend.acquire_sync, KEY, None) if sync else backend.acquire(KEY, None)
    )
    with pytest.raises(BackendUnavailable, match="No space left") as refused:
        await take
    assert isinstance(refused.value.__cause__, OSError)
    (line,) = records(logs, "inturn.file", logging.WARNING)
    assert f"could not take a turn on key 'orders/42' in {directory}" in line
    assert "No space left" in line


async def test_a_missed_deadline_is_not_logged(
    backend: FileBackend, logs: pytest.LogCaptureFixture
) -> None:
    gate = asyncio.Event()
    queue = KeyedQueue(backend=backend)
    holder = asyncio.create_task(queue.run(KEY, gate.wait))
    await until(lambda: len(backend.line(KEY)) == 1, "this process holds")
    with pytest.raises(TimeoutError):
        await backend.acquire(KEY, 0)
    gate.set()
    await holder
    assert ours(logs) == []


# -- the Redis backend --------------------------------------------------------------------------


async def test_a_dropped_redis_connection_warns_and_its_return_is_info(
    own_redis: Server,
    namespace: str,
    redis_backends: list[RedisBackend],
    logs: pytest.LogCaptureFixture,
) -> None:
    queue = KeyedQueue(backend=redis_backend(redis_backends, own_redis.url, namespace))
    await queue.run(KEY, lambda: None)  # connected and subscribed
    assert ours(logs) == []
    side = aioredis.Redis.from_url(own_redis.url)
    try:
        await side.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        await side.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    finally:
        await side.aclose()

    def warnings() -> list[str]:
        return records(logs, "inturn.redis", logging.WARNING)

    def infos() -> list[str]:
        return records(logs, "inturn.redis", logging.INFO)

    await settle(lambda: len(warnings()) == 2)
    assert any(line.startswith("inturn: lost the connection to Redis") for line in warnings())
    assert any(line.startswith("inturn: Redis subscription interrupted") for line in warnings())
    await queue.run(KEY, lambda: None)  # connects again
    await settle(lambda: len(infos()) == 2)
    assert sorted(infos()) == [
        "inturn: Redis subscription back",
        "inturn: connected to Redis again",
    ]
    assert len(warnings()) == 2


async def test_a_lost_redis_lease_is_logged_with_the_users_key(
    own_redis: Server,
    namespace: str,
    redis_backends: list[RedisBackend],
    logs: pytest.LogCaptureFixture,
) -> None:
    queue = KeyedQueue(backend=redis_backend(redis_backends, own_redis.url, namespace))
    side = aioredis.Redis.from_url(own_redis.url)

    async def hold() -> None:
        await side.flushall()  # Redis forgets every line: the heartbeat finds this one gone
        await settle(lambda: bool(records(logs, "inturn.redis", logging.WARNING)))

    try:
        with pytest.raises(LeaseLost):
            await queue.run(KEY, hold)
    finally:
        await side.aclose()
    (line,) = records(logs, "inturn.redis", logging.WARNING)
    assert line.startswith("inturn: lost the lease of the turn on key 'orders/42'")
    assert namespace not in line  # the user's key, not the Redis key


# -- the bridge ---------------------------------------------------------------------------------


class _Grant:
    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.token = 1
        self.lost = False


class _Stubborn:
    """A backend whose acquire, cancelled, grants all the same (as one that just got the key)."""

    def __init__(self) -> None:
        self.released: list[Hashable] = []
        self.waiting = threading.Event()

    async def acquire(self, key: Hashable, timeout: float | None) -> _Grant:
        self.waiting.set()
        try:
            await asyncio.sleep(PATIENCE)
        except asyncio.CancelledError:
            pass  # granted just as the caller gave up
        return _Grant(key)

    def release(self, grant: _Grant) -> asyncio.Future[None]:
        self.released.append(grant.key)
        done = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return done

    def thread_loop(self) -> None:
        return None

    def __repr__(self) -> str:
        return "Stubborn()"


async def test_the_bridge_logs_its_loop_and_a_grant_released_for_a_caller_that_gave_up(
    logs: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bridge, "_LOOP", bridge._BackendLoop())  # a backend loop of its own
    stubborn = _Stubborn()
    call = asyncio.create_task(bridge.acquire_via(stubborn, stubborn, KEY, None))  # type: ignore[arg-type]
    await until(stubborn.waiting.is_set, "the acquire runs on the backend loop")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await until(lambda: stubborn.released == [KEY], "the grant was released")
    loop = bridge._LOOP.get()
    thread = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(_current_thread(), loop))
    serving = await thread
    loop.call_soon_threadsafe(loop.stop)
    serving.join(PATIENCE)
    loop.close()
    started, released = records(logs, "inturn.bridge", logging.DEBUG)
    assert started.startswith(f"inturn: started the backend loop thread of process {os.getpid()}")
    assert released == (
        "inturn: releasing the turn on key 'orders/42' that Stubborn() granted after its "
        "caller gave up"
    )


async def _current_thread() -> threading.Thread:
    return threading.current_thread()


# -- a turn that goes as it should logs nothing -------------------------------------------------


async def turns(queues: list[KeyedQueue], key: Hashable) -> None:
    """Turns on key, of tasks and threads: one at a time (uncontended), then all at once."""
    for queue in queues:
        for _ in range(3):
            await queue.run(key, lambda: None)
            await asyncio.to_thread(queue.run_sync, key, lambda: None)

    async def slow() -> None:
        await asyncio.sleep(0.001)

    busy = [queue.run(key, slow) for queue in queues for _ in range(5)]
    busy += [asyncio.to_thread(queue.run_sync, key, lambda: None) for queue in queues]
    await asyncio.wait_for(asyncio.gather(*busy), PATIENCE)


async def test_turns_that_go_as_they_should_log_nothing_even_at_debug(
    backend: FileBackend,
    redis_url: str,
    namespace: str,
    redis_backends: list[RedisBackend],
    logs: pytest.LogCaptureFixture,
) -> None:
    redis = [redis_backend(redis_backends, redis_url, namespace) for _ in range(3)]
    # Each Redis backend connects, and this process's backend loop starts, before the count.
    for each in redis:
        await KeyedQueue(backend=each).run(KEY, lambda: None)
        await asyncio.to_thread(KeyedQueue(backend=each).run_sync, KEY, lambda: None)
    logs.clear()
    await turns([KeyedQueue(backend=backend) for _ in range(3)], KEY)
    await turns([KeyedQueue(backend=each) for each in redis], KEY)
    assert ours(logs) == []


def test_a_ticket_closed_without_a_word_by_a_live_process_is_no_death(
    tmp_path: Path, logs: pytest.LogCaptureFixture
) -> None:
    """A third reader may take a hand-off (see _tickets.probe): its writer still runs.

    Found by running the quiet-turns test above in a loop: 1 run in 20 logged
    "process P died holding", P being the test's own process.
    """
    dead = subprocess_pid_that_exited()
    where = Directory(os.open(tmp_path, os.O_RDONLY), tmp_path)
    tickets = [f"{os.getpid()}.aaaa", f"{dead}.bbbb"]
    _deaths.died("k", where, tickets, held=True)  # the dead one held
    assert ours(logs) == [
        f"inturn.file WARNING inturn: process {dead} died holding key 'k' (or as it was "
        f"handed the key), without releasing it; process {os.getpid()} takes the key over "
        f"(directory {tmp_path})"
    ]
    logs.clear()
    _deaths.died("k", where, list(reversed(tickets)), held=True)  # the live one held
    assert ours(logs) == [
        f"inturn.file INFO inturn: process {dead} died waiting for key 'k'; its place in "
        f"line is skipped (directory {tmp_path})"
    ]


def test_a_death_is_logged_though_its_parent_reaps_it_meanwhile(
    tmp_path: Path, logs: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dead process's parent may reap it at any moment: here, just as it is looked at.

    asyncio's child watcher reaps a zombie from a thread. Found by running
    test_a_waiter_that_died_is_logged_at_info in a loop: 1 run in 1000
    logged nothing, its worker reaped after kill() found it and before its
    /proc entry was read.
    """
    child = subprocess.Popen([sys.executable, "-c", ""])
    try:
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie, not reaped yet

        def reaping_open(*args: Any, **kwargs: Any) -> Any:
            child.wait()
            return open(*args, **kwargs)

        monkeypatch.setattr(_deaths, "open", reaping_open, raising=False)
        where = Directory(os.open(tmp_path, os.O_RDONLY), tmp_path)
        _deaths.died("k", where, [f"{child.pid}.bbbb"], held=False)
    finally:
        child.wait()
    assert ours(logs) == [
        f"inturn.file INFO inturn: process {child.pid} died waiting for key 'k'; its place in "
        f"line is skipped (directory {tmp_path})"
    ]


def subprocess_pid_that_exited() -> int:
    """The id of a process that has exited and was reaped."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(child.stdout)
