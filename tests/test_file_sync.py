"""The file backend from threads: acquire_sync and release_sync, with no event loop.

Threads, tasks and real processes (tests/support/worker.py) share one key's line:
the same exclusion and arrival order for all of them, timeouts and
interrupts that leave no trace, crash safety from the kernel.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from inturn.backends import Grant
from inturn.backends.file import FileBackend, FileGrant, _fds, _line

from support.file_checks import files, line_file, spec
from support.helpers import PATIENCE, wait_until
from support.processes import Worker, until


@pytest.fixture
def backend(directory: Path) -> FileBackend:
    return FileBackend(directory)


class Taker(threading.Thread):
    """A thread that takes key with acquire_sync, holds it until let go, then releases it."""

    def __init__(self, backend: FileBackend, key: str, timeout: float | None = PATIENCE) -> None:
        super().__init__(daemon=True)
        self.backend = backend
        self.key = key
        self.timeout = timeout
        self.grant: FileGrant | None = None  # set once it holds
        self.error: BaseException | None = None  # what acquire_sync raised
        self.go = threading.Event()  # let it release

    def run(self) -> None:
        try:
            self.grant = self.backend.acquire_sync(self.key, self.timeout)
        except BaseException as error:
            self.error = error
            return
        self.go.wait(PATIENCE)
        self.backend.release_sync(self.grant)

    def finish(self) -> None:
        self.go.set()
        self.join(PATIENCE)
        assert not self.is_alive()


def queued(backend: FileBackend, key: str, n: int) -> Callable[[], bool]:
    return lambda: len(backend.line(key)) == n


def open_fds() -> int:
    """How many files this process has open, once what earlier tests left is collected."""
    gc.collect()  # (a FileBackend's directory is closed when it is collected)
    return len(os.listdir("/proc/self/fd"))


# -- one line for threads, tasks and processes ------------------------------------------


async def test_threads_tasks_and_processes_take_turns_in_arrival_order(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    held: list[str] = []  # who held the key, in turn order (appended by each, as it holds)
    first = await backend.acquire("k", None)
    held.append("first")

    # Arrivals, one at a time: each is in the line file before the next starts.
    thread_1 = Taker(backend, "k")
    thread_1.start()
    await until(queued(backend, "k", 2), "thread-1 in line")
    sync_process = await Worker.start(spec(directory), "hold-sync", "k", name="sync-process")
    workers.append(sync_process)
    await until(queued(backend, "k", 3), "sync-process in line")
    task_go = asyncio.Event()

    async def task() -> None:
        grant = await backend.acquire("k", PATIENCE)
        held.append("task")
        await task_go.wait()
        await backend.release(grant)

    running = asyncio.create_task(task())
    await until(queued(backend, "k", 4), "task in line")
    async_process = await Worker.start(spec(directory), "hold", "k", name="async-process")
    workers.append(async_process)
    await until(queued(backend, "k", 5), "async-process in line")
    thread_2 = Taker(backend, "k")
    thread_2.start()
    await until(queued(backend, "k", 6), "thread-2 in line")

    async def reports(worker: Worker) -> None:
        await worker.expect("holding")
        held.append(worker.name)

    watches = [asyncio.create_task(reports(w)) for w in (sync_process, async_process)]
    in_line = ["first", "thread-1", "sync-process", "task", "async-process", "thread-2"]

    def holds(taker: Taker, name: str) -> Callable[[], bool]:
        def check() -> bool:
            if taker.grant is not None and name not in held:
                held.append(name)
            return name in held

        return check

    # Each lets go only once the one before it holds, and nobody else does.
    await backend.release(first)
    await until(holds(thread_1, "thread-1"), "thread-1 holds")
    assert held == in_line[:2]
    thread_1.finish()
    await until(lambda: len(held) == 3, "the next holds")
    assert held == in_line[:3]
    await sync_process.release()
    await until(lambda: len(held) == 4, "the next holds")
    assert held == in_line[:4]
    task_go.set()
    await running
    await until(lambda: len(held) == 5, "the next holds")
    assert held == in_line[:5]
    await async_process.release()
    await until(holds(thread_2, "thread-2"), "thread-2 holds")
    assert held == in_line
    thread_2.finish()
    await asyncio.gather(*watches)
    assert [await w.finish() for w in workers] == [0, 0]
    assert files(directory) == []


async def test_no_lost_update_between_threads_tasks_and_processes(
    directory: Path, backend: FileBackend, tmp_path: Path, workers: list[Worker]
) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    n = 50
    # Another process's threads (sync), another process's tasks (async), and here:
    # threads (sync) and this loop's tasks (async), on the one key.
    workers.append(
        await Worker.start(spec(directory), "increment-sync", "k", str(counter), str(n), "3")
    )
    workers.append(await Worker.start(spec(directory), "increment", "k", str(counter), str(n)))

    def increments() -> None:
        for _ in range(n):
            grant = backend.acquire_sync("k", PATIENCE)
            try:
                value = int(counter.read_text())
                os.sched_yield()
                counter.write_text(str(value + 1))
            finally:
                backend.release_sync(grant)

    async def increments_async() -> None:
        for _ in range(n):
            grant = await backend.acquire("k", PATIENCE)
            try:
                value = int(counter.read_text())
                await asyncio.sleep(0)
                counter.write_text(str(value + 1))
            finally:
                await backend.release(grant)

    threads = [threading.Thread(target=increments) for _ in range(2)]
    for thread in threads:
        thread.start()
    await asyncio.gather(increments_async(), increments_async())
    for worker in workers:
        await worker.expect("done")
        assert await worker.finish() == 0

    def join() -> None:
        for thread in threads:
            thread.join(PATIENCE)

    await asyncio.get_running_loop().run_in_executor(None, join)
    assert int(counter.read_text()) == (3 + 1 + 2 + 2) * n


def test_many_threads_on_a_few_keys_count_exactly_and_leak_no_file(backend: FileBackend) -> None:
    keys = ("a", "b", "c")
    threads, turns = 8, 200
    counts = dict.fromkeys(keys, 0)  # read, then written: a lost update if two hold at once
    inside = dict.fromkeys(keys, 0)
    overlaps: list[str] = []
    failures: list[BaseException] = []
    start = threading.Barrier(threads)
    backend.line("a")  # the directory's descriptor, opened at its first use: not a turn's
    before = open_fds()

    def work(offset: int) -> None:
        try:
            start.wait(PATIENCE)
            for turn in range(turns):
                key = keys[(offset + turn) % len(keys)]
                grant = backend.acquire_sync(key, PATIENCE)
                try:
                    inside[key] += 1
                    if inside[key] != 1:
                        overlaps.append(key)
                    value = counts[key]
                    os.sched_yield()  # let another thread run here
                    counts[key] = value + 1
                    inside[key] -= 1
                finally:
                    backend.release_sync(grant)
        except BaseException as error:
            failures.append(error)

    runners = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for runner in runners:
        runner.start()
    for runner in runners:
        runner.join(PATIENCE * 2)
    assert failures == []
    assert overlaps == []
    expected = dict.fromkeys(keys, 0)
    for offset in range(threads):
        for turn in range(turns):
            expected[keys[(offset + turn) % len(keys)]] += 1
    assert counts == expected
    assert open_fds() == before
    assert not _fds._OPEN  # (what a forked child would close)
    # A release_sync leaves a tidy that found the lock busy to the key's next turn.
    for key in keys:
        backend.release_sync(backend.acquire_sync(key, 0))
    assert files(backend.directory) == []


# -- timeouts ---------------------------------------------------------------------------------


def test_a_timeout_comes_at_its_deadline_and_leaves_no_ticket(backend: FileBackend) -> None:
    holder = backend.acquire_sync("k", None)
    impatient = Taker(backend, "k", timeout=0.3)
    began = time.monotonic()
    impatient.start()
    wait_until(queued(backend, "k", 2), "the impatient one in line")
    patient = Taker(backend, "k")  # arrived after the impatient one
    patient.start()
    wait_until(queued(backend, "k", 3), "the patient one in line")
    impatient.join(PATIENCE)
    waited = time.monotonic() - began
    assert isinstance(impatient.error, TimeoutError)
    assert "not reached" in str(impatient.error)
    assert 0.3 <= waited < 0.3 + 1.0  # (slack for a loaded machine)
    assert backend.line("k") == (os.getpid(), os.getpid())  # the holder, then the patient one
    assert len(files(backend.directory)) == 3  # the line file and two tickets
    backend.release_sync(holder)
    wait_until(lambda: patient.grant is not None, "the patient one holds")
    assert patient.grant is not None
    assert patient.grant.token > holder.token
    patient.finish()
    assert files(backend.directory) == []


def test_a_line_files_lock_held_too_long_defeats_no_timeout(backend: FileBackend) -> None:
    import fcntl

    backend.release_sync(backend.acquire_sync("k", None))
    line = line_file(backend.directory, "k")
    line.touch()
    frozen = os.open(line, os.O_RDONLY)  # a process stopped inside its few calls under the lock
    try:
        fcntl.flock(frozen, fcntl.LOCK_EX)
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            backend.acquire_sync("k", 0.2)
        assert 0.2 <= time.monotonic() - began < 0.2 + 1.0
        assert line.read_bytes() == b""  # it never queued
    finally:
        os.close(frozen)
    backend.release_sync(backend.acquire_sync("k", 0))
    assert files(backend.directory) == []


def test_a_release_that_meets_another_tidier_tidies_later_aside(backend: FileBackend) -> None:
    """A thread's release whose tidy finds the line file locked by another tidier goes on at
    once, and the line file is removed once that tidier lets go (within release's half second).

    Before, the releasing thread tried again itself, yielding its CPU between tries for 2 ms,
    then left the file to the key's next turn: on a busy machine it stayed out of the line for
    milliseconds (the other processes took the key meanwhile), and the file stayed.
    """
    import fcntl

    grant = backend.acquire_sync("k", None)
    line = line_file(backend.directory, "k")
    tidier = os.open(line, os.O_RDONLY)  # another process's tidy, inside its few calls
    try:
        fcntl.flock(tidier, fcntl.LOCK_EX)
        before = {thread.ident for thread in threading.enumerate()}
        backend.release_sync(grant)
        aside = [thread for thread in threading.enumerate() if thread.ident not in before]
        assert line.exists()  # (the lock kept it)
    finally:
        os.close(tidier)  # the other tidier is done
    assert [thread.name for thread in aside] == ["inturn-file-tidy"]  # (it went on at once)
    wait_until(lambda: files(backend.directory) == [], "the line file removed")
    aside[0].join(PATIENCE)
    assert not aside[0].is_alive()  # (once the tidy is done, nothing is left running)


def test_releases_that_meet_other_tidiers_run_a_few_tidies_aside_at_most(
    backend: FileBackend,
) -> None:
    """However many releases meet a busy line file at once, at most _ASIDE threads tidy aside;
    the lines left over are tidied by their keys' next turns."""
    import fcntl

    from inturn.backends.file import _tidy

    keys = [f"k{n}" for n in range(_tidy._ASIDE + 2)]
    grants = [backend.acquire_sync(key, None) for key in keys]
    tidiers = [os.open(line_file(backend.directory, key), os.O_RDONLY) for key in keys]
    before = {thread.ident for thread in threading.enumerate()}
    try:
        for tidier in tidiers:
            fcntl.flock(tidier, fcntl.LOCK_EX)
        for grant in grants:
            backend.release_sync(grant)
        aside = [thread for thread in threading.enumerate() if thread.ident not in before]
    finally:
        for tidier in tidiers:
            os.close(tidier)
    assert len(aside) == _tidy._ASIDE
    for thread in aside:
        thread.join(PATIENCE)
    assert len(files(backend.directory)) == 2  # (the two the seats could not take)
    for key in keys:
        backend.release_sync(backend.acquire_sync(key, None))
    assert files(backend.directory) == []


# -- an exception from a signal handler -------------------------------------------------------


class Interrupted(Exception):
    pass


@pytest.fixture
def interrupting(
    collector_paused: None,
) -> Iterator[Callable[[threading.Event], threading.Thread]]:
    """Sends SIGUSR1, whose handler raises Interrupted, to the main thread once an event is set
    (with the collector paused: see conftest's collector_paused)."""

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    started: list[threading.Thread] = []

    def start(when: threading.Event) -> threading.Thread:
        def send() -> None:
            if when.wait(PATIENCE):
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        started.append(sender)
        return sender

    try:
        yield start
    finally:
        for sender in started:
            sender.join(PATIENCE)
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize("wait", ["ticket", "lock"])
def test_an_exception_from_a_signal_handler_leaves_the_line(
    backend: FileBackend,
    interrupting: Callable[[threading.Event], threading.Thread],
    monkeypatch: pytest.MonkeyPatch,
    wait: str,
) -> None:
    """KeyboardInterrupt, or a server's SystemExit, raised in the waiting thread by a signal."""
    import fcntl

    assert threading.current_thread() is threading.main_thread()
    holder = Taker(backend, "k")
    holder.start()
    wait_until(lambda: holder.grant is not None, "the holder holds")
    waiting = threading.Event()  # the main thread is inside the wait: signal it
    name = "until_left_blocking" if wait == "ticket" else "lock_blocking"
    real = getattr(_line, name)

    def entered(*args: Any) -> Any:
        waiting.set()
        return real(*args)

    monkeypatch.setattr(_line, name, entered)
    frozen = os.open(line_file(backend.directory, "k"), os.O_RDONLY)
    try:
        if wait == "lock":
            fcntl.flock(frozen, fcntl.LOCK_EX)  # it waits for the lock, not yet in line
        interrupting(waiting)
        before = open_fds()
        # (Kept, with its traceback and frames: the line is left at once, not when they are freed.)
        with pytest.raises(Interrupted) as caught:
            backend.acquire_sync("k", PATIENCE)
        assert open_fds() == before  # its line file and ticket closed
    finally:
        os.close(frozen)
    assert waiting.is_set()
    assert backend.line("k") == (os.getpid(),)  # the holder alone
    assert len(files(backend.directory)) == 2  # its line file and ticket: none of the waiter
    later = Taker(backend, "k")
    later.start()
    wait_until(queued(backend, "k", 2), "a later one in line")
    holder.finish()
    wait_until(lambda: later.grant is not None, "the later one holds")
    later.finish()
    assert files(backend.directory) == []
    assert caught.traceback  # (alive until here)


# -- crashes ------------------------------------------------------------------------------


async def test_a_killed_sync_holder_frees_the_key_at_once(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    holder = await Worker.start(spec(directory), "hold-sync", "k", name="holder")
    workers.append(holder)
    await holder.expect("holding")
    waiter = Taker(backend, "k")  # waits in poll() on the holder's ticket
    waiter.start()
    await until(queued(backend, "k", 2), "the waiter in line")
    killed = time.monotonic()
    holder.kill()
    await until(lambda: waiter.grant is not None, "the waiter holds")
    assert time.monotonic() - killed < 1.0  # at once: no lease to run out
    waiter.finish()
    assert files(directory) == []  # its release removed what the dead holder left


# -- tokens and grants ----------------------------------------------------------------------


async def test_tokens_grow_across_sync_and_async_grants(backend: FileBackend) -> None:
    tokens = []
    first = backend.acquire_sync("k", None)  # uncontended: returns at once, even in a loop
    tokens.append(first.token)
    second = asyncio.create_task(backend.acquire("k", PATIENCE))
    await until(queued(backend, "k", 2), "the task in line")
    backend.release_sync(first)
    grant = await second
    tokens.append(grant.token)
    third = Taker(backend, "k")
    third.start()
    await until(queued(backend, "k", 2), "the thread in line")
    await backend.release(grant)
    await until(lambda: third.grant is not None, "the thread holds")
    assert third.grant is not None
    tokens.append(third.grant.token)
    third.finish()
    # A line that starts anew starts from the wall clock, past every earlier token.
    fourth = await backend.acquire("k", None)
    tokens.append(fourth.token)
    await backend.release(fourth)
    fifth = backend.acquire_sync("k", None)
    tokens.append(fifth.token)
    backend.release_sync(fifth)
    assert tokens == sorted(set(tokens))


async def test_a_grant_taken_sync_may_be_released_async_and_reports_lost(
    backend: FileBackend,
) -> None:
    grant = backend.acquire_sync("k", None)
    lost = [grant.lost]
    line_file(backend.directory, "k").unlink()  # removed by another process of this user
    lost.append(grant.lost)
    await backend.release(grant)
    lost.append(grant.lost)
    assert lost == [False, True, True]


@dataclass
class ForeignGrant:
    """Another backend's grant."""

    key: str
    token: int
    lost: bool = False


assert isinstance(ForeignGrant("k", 1), Grant)  # (a Grant, but not the file backend's)


def test_release_sync_refuses_a_grant_it_did_not_give(backend: FileBackend) -> None:
    grant = backend.acquire_sync("k", None)
    with pytest.raises(TypeError, match="did not grant"):
        backend.release_sync(ForeignGrant("k", grant.token))
    assert backend.line("k") == (os.getpid(),)  # still held
    backend.release_sync(grant)
    assert files(backend.directory) == []


def test_a_released_grant_is_released_once(backend: FileBackend) -> None:
    grant = backend.acquire_sync("k", None)
    backend.release_sync(grant)
    backend.release_sync(grant)  # nothing more to do
    assert "released" in repr(grant)
    assert files(backend.directory) == []
