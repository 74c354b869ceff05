"""The file backend: lines shared by real processes of one host, crash safety, hostile keys.

Several queues on one directory in one process stand for several processes
where a test needs exact control of the interleaving; real processes
(tests/support/worker.py), really killed, where the guarantee is about processes.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from inturn import KeyedQueue, current_turn
from inturn.backends import Backend
from inturn.backends import file as file_backend
from inturn.backends.file import FileBackend

from support.file_checks import files, line_file, spec
from support.helpers import PATIENCE, checkpoints, settle
from support.processes import Worker, first_to_hold, until


@pytest.fixture
def backend(directory: Path) -> FileBackend:
    return FileBackend(directory)


# -- several queues on one directory ----------------------------------------------------


async def test_two_queues_on_one_directory_exclude_each_other(backend: FileBackend) -> None:
    first, second = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    gate = asyncio.Event()
    order: list[str] = []

    async def hold(name: str) -> None:
        order.append(f"{name} in")
        await gate.wait()
        order.append(f"{name} out")

    a = asyncio.create_task(first.run("k", hold, "a"))
    await settle(lambda: order == ["a in"])
    b = asyncio.create_task(second.run("k", hold, "b"))
    await until(lambda: len(backend.line("k")) == 2, "the second queue waits in the line file")
    assert order == ["a in"]
    gate.set()
    await asyncio.gather(a, b)
    assert order == ["a in", "a out", "b in", "b out"]
    assert files(backend.directory) == []


async def held(queue: KeyedQueue, key: str) -> tuple[asyncio.Task[None], asyncio.Event]:
    """A task that holds key on queue (returned once it does) until the event is set."""
    inside = asyncio.Event()
    gate = asyncio.Event()

    async def hold() -> None:
        inside.set()
        await gate.wait()

    turn = asyncio.create_task(queue.run(key, hold))
    await inside.wait()
    return turn, gate


@pytest.mark.parametrize("lock", ["shared", "exclusive"])
async def test_the_last_to_leave_deletes_the_line_file_though_a_tidier_held_its_lock(
    backend: FileBackend, lock: str
) -> None:
    """The race that left a line file behind: the last holder leaves while another
    process's tidy holds the lock (having seen that holder still in line, it
    leaves the file to it). The last one tries again once the lock is free."""
    import fcntl

    queue = KeyedQueue(backend=backend)
    turn, gate = await held(queue, "k")
    line = line_file(backend.directory, "k")
    tidier = os.open(line, os.O_RDONLY)  # another process's tidy
    try:
        fcntl.flock(tidier, fcntl.LOCK_SH if lock == "shared" else fcntl.LOCK_EX)
        gate.set()
        await checkpoints(5)
        assert not turn.done()  # its release waits to tidy: the line file is still there
        assert line.exists()
    finally:
        os.close(tidier)  # the tidier is done
    await asyncio.wait_for(turn, 5)
    assert files(backend.directory) == []


async def test_a_waiter_that_gives_up_as_the_key_is_handed_to_it_deletes_the_line_file(
    backend: FileBackend,
) -> None:
    """Issue 42 (found by reading file/_tidy): the holder releases while the waiter behind it
    is giving up, and the holder's tidy sees it still in line, so leaves the line file to
    it; the waiter, tidying as it gives up, finds the lock taken (by that tidy, or
    another's) and nobody behind it. It tried no more: the file stayed for the key's next
    turn. It now tries again shortly, as a release does."""
    import fcntl

    holder, waiter = KeyedQueue(backend=backend), KeyedQueue(backend=FileBackend(backend.directory))
    turn, gate = await held(holder, "k")
    waiting = asyncio.create_task(waiter.run("k", lambda: None))
    await until(lambda: len(backend.line("k")) == 2, "the waiter in the line file")
    line = line_file(backend.directory, "k")
    tidier = os.open(line, os.O_RDONLY)  # a tidy that holds the lock a moment longer
    try:
        fcntl.flock(tidier, fcntl.LOCK_SH)
        gate.set()  # the holder releases first (its tidy sees the waiter still in line)...
        waiting.cancel()  # ...then the waiter gives up, as its key is handed to it
        await asyncio.wait_for(turn, PATIENCE)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert line.exists()  # (left to the waiter, which found the lock taken)
    finally:
        os.close(tidier)  # the tidy is done
    await until(lambda: not line.exists(), "the waiter's tidy, tried again")
    assert files(backend.directory) == []


async def test_a_tidier_frozen_with_the_line_files_lock_holds_up_a_release_briefly(
    backend: FileBackend,
) -> None:
    """A process frozen while it holds the line file's lock (SIGSTOP mid-tidy) holds the
    last holder's release up for half a second at most: the release is then done, and
    the line file is left to the key's next turn, which removes it."""
    import fcntl

    queue = KeyedQueue(backend=backend)
    turn, gate = await held(queue, "k")
    line = line_file(backend.directory, "k")
    frozen = os.open(line, os.O_RDONLY)  # the frozen process's tidy: it never lets go
    try:
        fcntl.flock(frozen, fcntl.LOCK_EX)
        gate.set()
        await asyncio.wait_for(turn, PATIENCE)  # (its release waited for good)
        assert line.exists()  # left to the next turn
    finally:
        os.close(frozen)  # thawed, or killed
    await queue.run("k", lambda: None)
    assert files(backend.directory) == []


async def test_a_timeout_on_a_later_key_names_the_callers_limit(backend: FileBackend) -> None:
    queue = KeyedQueue(backend=backend)
    gate = asyncio.Event()
    holder = asyncio.create_task(queue.run("b", gate.wait))
    await settle(lambda: queue.is_active("b"))
    with pytest.raises(TimeoutError) as missed:
        async with queue.keyed("a", "b", timeout=0.05):
            pytest.fail("the block ran without its turns")
    gate.set()
    await holder
    assert str(missed.value) == (
        "inturn: the turn for key 'b' was not reached within 0.05 s: it was waiting for its "
        "place in the key's line (the key was busy, no other turn waiting); the work did not run"
    )
    assert files(backend.directory) == []


async def test_a_release_gives_up_the_cpu_only_to_someone_behind_it(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The next holder's work holds up the whole line: a release with
    # someone queued behind it lets that one run first; alone, it never
    # gives its CPU away (a busy server's uncontended keys pay nothing).
    yields: list[None] = []
    monkeypatch.setattr(file_backend.os, "sched_yield", lambda: yields.append(None))
    first, second = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    await first.run("k", asyncio.sleep, 0)
    assert yields == []

    gate = asyncio.Event()
    a = asyncio.create_task(first.run("k", gate.wait))
    await until(lambda: len(backend.line("k")) == 1, "the first queue holds the key")
    b = asyncio.create_task(second.run("k", asyncio.sleep, 0))
    await until(lambda: len(backend.line("k")) == 2, "the second queue waits in the line file")
    gate.set()
    await asyncio.gather(a, b)
    assert len(yields) == 1  # the first release, with the second behind it; not the second's


async def test_turns_go_in_registration_order_across_queues(backend: FileBackend) -> None:
    queues = [KeyedQueue(backend=backend) for _ in range(5)]
    gate = asyncio.Event()
    order: list[int] = []

    async def work(i: int) -> None:
        order.append(i)
        if i == 0:
            await gate.wait()

    tasks = [asyncio.create_task(queues[0].run("k", work, 0))]
    await settle(lambda: order == [0])
    for i in (3, 1, 4, 2):  # registered in this order, behind the holder
        tasks.append(asyncio.create_task(queues[i].run("k", work, i)))
        await until(lambda: len(backend.line("k")) == len(tasks), f"queue {i} registered")
    gate.set()
    await asyncio.gather(*tasks)
    assert order == [0, 3, 1, 4, 2]


async def test_timeout_while_another_queue_holds(backend: FileBackend) -> None:
    holder_queue, waiter_queue = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    gate = asyncio.Event()
    holder = asyncio.create_task(holder_queue.run("k", gate.wait))
    await until(lambda: len(backend.line("k")) == 1, "the holder took the key")
    ran: list[str] = []
    with pytest.raises(TimeoutError, match="'k'"):
        async with waiter_queue.keyed("k", timeout=0.05):
            ran.append("ran")
    assert ran == []
    assert backend.line("k") == (os.getpid(),)  # the timed-out ticket left the line
    assert waiter_queue.active_count == 0
    with pytest.raises(TimeoutError):
        async with waiter_queue.keyed("k", timeout=0):
            ran.append("ran")
    gate.set()
    await holder
    async with waiter_queue.keyed("k", timeout=0):
        ran.append("free")
    assert ran == ["free"]


async def test_a_cancelled_waiter_leaves_and_the_one_behind_goes_next(
    backend: FileBackend,
) -> None:
    holder_queue, leaving_queue, next_queue = (KeyedQueue(backend=backend) for _ in range(3))
    gate = asyncio.Event()
    order: list[str] = []
    holder = asyncio.create_task(holder_queue.run("k", gate.wait))
    await until(lambda: len(backend.line("k")) == 1, "holder in")
    leaving = asyncio.create_task(leaving_queue.run("k", order.append, "leaving"))
    await until(lambda: len(backend.line("k")) == 2, "leaving in line")
    following = asyncio.create_task(next_queue.run("k", order.append, "next"))
    await until(lambda: len(backend.line("k")) == 3, "next in line")
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await until(lambda: len(backend.line("k")) == 2, "the cancelled ticket left")
    gate.set()
    await asyncio.gather(holder, following)
    assert order == ["next"]
    assert files(backend.directory) == []


async def test_waiter_cancelled_as_the_holder_releases_passes_the_turn_on(
    backend: FileBackend,
) -> None:
    holder_queue, victim_queue, next_queue = (KeyedQueue(backend=backend) for _ in range(3))
    order: list[str] = []
    victim: list[asyncio.Task[Any]] = []
    gate = asyncio.Event()

    async def hold() -> None:
        await gate.wait()

    async def holder() -> None:
        await holder_queue.run("k", hold)
        victim[0].cancel()  # in the step that released: the victim was just woken

    first = asyncio.create_task(holder())
    await until(lambda: len(backend.line("k")) == 1, "holder in")
    victim.append(asyncio.create_task(victim_queue.run("k", order.append, "victim")))
    await until(lambda: len(backend.line("k")) == 2, "victim in line")
    following = asyncio.create_task(next_queue.run("k", order.append, "next"))
    await until(lambda: len(backend.line("k")) == 3, "next in line")
    gate.set()
    await first
    await asyncio.gather(victim[0], following, return_exceptions=True)
    assert victim[0].cancelled()
    assert order == ["next"]
    assert files(backend.directory) == []


async def test_tokens_grow_across_queues_and_reach_current_turn(backend: FileBackend) -> None:
    first, second = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    seen: list[int] = []

    @first.queue_by_key(key="k")
    async def decorated() -> None:
        turn = current_turn()
        assert turn is not None
        assert turn.keys == ("k",)
        assert turn.lease_lost is False
        seen.append(turn.token)

    for _ in range(3):
        await decorated()
        async with second.keyed("k") as turn:
            seen.append(turn.token)
            assert current_turn() is turn
        assert current_turn() is None
    assert seen == sorted(set(seen))


async def test_several_keys_are_taken_in_one_order_by_every_queue(backend: FileBackend) -> None:
    first, second = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    held: list[tuple[Any, ...]] = []

    async def both(queue: KeyedQueue, *keys: Any) -> None:
        for _ in range(20):
            async with queue.keyed(*keys) as turn:
                held.append(turn.keys)
                await checkpoints()

    await asyncio.wait_for(
        asyncio.gather(both(first, "a", b"b", 3), both(second, 3, b"b", "a")), timeout=20
    )
    assert len(held) == 40
    assert len(set(held)) == 1  # the same order, whatever order the caller wrote


# -- real processes -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "each"),
    [
        (["increment", "150"], 150),
        # Each forks a child that keeps its backend, and each of the eight
        # runs three threads that take every turn in a fresh event loop.
        (["share", "20", "3"], 2 * 3 * 20),
    ],
    ids=["processes", "forks-and-threads"],
)
async def test_no_lost_update_across_processes(
    directory: Path, tmp_path: Path, workers: list[Worker], command: list[str], each: int
) -> None:
    counter = tmp_path / "counter"
    counter.write_text("0")
    name, *counts = command
    workers += [
        await Worker.start(spec(directory), name, "k", str(counter), *counts, name=str(i))
        for i in range(4)
    ]
    for worker in workers:
        await worker.expect("done")
        assert await worker.finish() == 0
    assert counter.read_text() == str(4 * each)
    assert files(directory) == []


async def test_turns_go_in_arrival_order_across_processes(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    for i in range(4):
        workers.append(await Worker.start(spec(directory), "hold", "k", name=f"w{i}"))
        if i == 0:
            await workers[0].expect("holding")
        await until(lambda: len(backend.line("k")) == len(workers), f"w{i} registered")
    assert backend.line("k") == tuple(worker.pid for worker in workers)
    order = ["w0"]
    holder = workers[0]
    for _ in range(3):
        await holder.release()
        # Whoever of the rest reports holding first got the turn.
        holder = await first_to_hold([w for w in workers if w.name not in order])
        order.append(holder.name)
    assert order == ["w0", "w1", "w2", "w3"]
    await holder.release()
    assert files(directory) == []


async def test_a_killed_holder_releases_at_once(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    holder = await Worker.start(spec(directory), "hold", "k")
    workers.append(holder)
    await holder.expect("holding")
    queue = KeyedQueue(backend=backend)
    ran = asyncio.Event()

    async def after() -> None:
        ran.set()

    waiter = asyncio.create_task(queue.run("k", after))
    await until(lambda: len(backend.line("k")) == 2, "this process waits behind the holder")
    assert not ran.is_set()
    holder.kill()
    await asyncio.wait_for(waiter, 10)
    assert ran.is_set()
    assert files(directory) == []  # the dead holder's ticket was cleaned up too


async def test_a_killed_waiter_is_skipped(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    holder = await Worker.start(spec(directory), "hold", "k", name="holder")
    await holder.expect("holding")
    doomed = await Worker.start(spec(directory), "hold", "k", name="doomed")
    await until(lambda: len(backend.line("k")) == 2, "doomed waits")
    survivor = await Worker.start(spec(directory), "hold", "k", name="survivor")
    await until(lambda: len(backend.line("k")) == 3, "survivor waits")
    workers += [holder, doomed, survivor]
    doomed.kill()
    await doomed.process.wait()
    assert backend.line("k") == (holder.pid, survivor.pid)
    await holder.release()
    await survivor.expect("holding")
    await survivor.release()
    assert await survivor.finish() == 0
    assert files(directory) == []


async def test_timeout_and_cancellation_while_another_process_holds(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    holder = await Worker.start(spec(directory), "hold", "k")
    workers.append(holder)
    await holder.expect("holding")
    queue = KeyedQueue(backend=backend)
    with pytest.raises(TimeoutError, match="'k'"):
        async with queue.keyed("k", timeout=0.05):
            pytest.fail("ran without the turn")
    waiting = asyncio.create_task(queue.run("k", lambda: "never"))
    await until(lambda: len(backend.line("k")) == 2, "waiting behind the other process")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert backend.line("k") == (holder.pid,)
    assert queue.active_count == 0
    await holder.release()
    assert await queue.run("k", lambda: "mine") == "mine"


async def test_a_child_forked_while_holding_does_not_keep_the_turn(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    forker = await Worker.start(spec(directory), "fork-hold", "k")
    workers.append(forker)
    (child,) = await forker.expect("forked")
    queue = KeyedQueue(backend=backend)
    waiter = asyncio.create_task(queue.run("k", lambda: "mine"))
    await until(lambda: len(backend.line("k")) == 2, "waiting on the forker's ticket")
    await forker.release()
    os.kill(int(child), 0)  # the child still runs, with copies of its parent's files
    assert await asyncio.wait_for(waiter, 10) == "mine"
    await forker.go()
    assert await forker.finish() == 0


# -- keys and files --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["../../etc/passwd", "/absolute", "x" * 10_000, "nul\0byte", b"\0\xff/..", -(10**40), "é/𝄞"],
)
async def test_hostile_keys_make_no_file_outside_the_directory(tmp_path: Path, key: Any) -> None:
    directory = tmp_path / "lines"
    queue = KeyedQueue(backend=FileBackend(directory))
    async with queue.keyed(key):
        names = files(directory)
        assert len(names) == 2  # the line file and this turn's ticket
        assert all(len(name) < 100 and "/" not in name for name in names)
    assert files(directory) == []
    assert sorted(os.listdir(tmp_path)) == ["lines"]


async def test_an_int_key_of_any_size_works(backend: FileBackend) -> None:
    queue = KeyedQueue(backend=backend)
    huge = 10**5000  # beyond what int() and str() convert by default
    assert await queue.run(huge, lambda: "huge") == "huge"
    async with queue.keyed(huge, -huge, huge + 1, "x") as turn:
        assert set(turn.keys) == {huge, -huge, huge + 1, "x"}
    assert files(backend.directory) == []


async def test_keys_of_other_types_are_refused_with_a_type_error(backend: FileBackend) -> None:
    queue = KeyedQueue(backend=backend)
    with pytest.raises(TypeError, match=r"key \('a', 1\) \(tuple\) cannot name a line shared"):
        await queue.run(("a", 1), lambda: None)
    with pytest.raises(TypeError, match="use a str, bytes or int key"):
        queue.keyed("a", 1.5)
    assert queue.active_count == 0


async def test_one_and_the_string_one_are_different_lines(backend: FileBackend) -> None:
    queue = KeyedQueue(backend=backend)
    async with queue.keyed(1), KeyedQueue(backend=backend).keyed("1", timeout=0):
        pass  # "1" was free while 1 was held


def test_the_directory_is_created_owner_only(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "new" / "lines")
    mode = stat.S_IMODE(os.stat(backend.directory).st_mode)
    assert mode & 0o077 == 0
    assert isinstance(backend, Backend)
    assert repr(backend) == f"FileBackend({str(tmp_path / 'new' / 'lines')!r})"


async def test_the_directory_is_made_at_the_first_turn_not_at_construction(
    tmp_path: Path,
) -> None:
    path = tmp_path / "new" / "lines"
    backend = FileBackend(path)
    queue = KeyedQueue(backend=backend)  # as a module made at import would
    assert repr(backend) == f"FileBackend({str(path)!r})"
    assert not (tmp_path / "new").exists()
    async with queue.keyed("k"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    assert backend.directory == path


@pytest.mark.parametrize("blocking", [False, True], ids=["task", "thread"])
async def test_a_directory_that_cannot_be_made_fails_the_first_turn_naming_it_and_the_fix(
    tmp_path: Path, blocking: bool
) -> None:
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / "lines"  # under a file: never a directory
    queue = KeyedQueue(backend=FileBackend(path))  # refused at the first turn, not here
    ran: list[int] = []
    turn = (
        asyncio.to_thread(queue.run_sync, "k", ran.append, 1)
        if blocking
        else queue.run("k", ran.append, 1)
    )
    with pytest.raises(NotADirectoryError) as raised:
        await turn
    message = raised.value.strerror  # (str() puts "[Errno 20] " before it)
    assert message.startswith(f"inturn: cannot create the directory {path} for lines: ")
    assert "create it before the workers start" in message
    assert ran == []
    assert queue.active_count == 0


def test_the_default_directory_is_per_user_and_in_memory_on_linux() -> None:
    backend = FileBackend()
    assert backend.directory.name == f"inturn-{os.geteuid()}"
    if sys.platform.startswith("linux") and os.access("/dev/shm", os.W_OK | os.X_OK):
        assert backend.directory.parent == Path("/dev/shm")
    else:
        assert backend.directory.parent == Path(tempfile.gettempdir())


def test_a_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, 65534)
    else:
        theirs = Path("/")  # owned by root
    with pytest.raises(PermissionError, match="belongs to uid"):
        FileBackend(theirs).line("k")  # (made and checked at the first use)


def test_a_symbolic_link_or_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(PermissionError, match="symbolic link"):
        FileBackend(tmp_path / "link").line("k")  # (made and checked at the first use)
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError):
        FileBackend(tmp_path / "file").line("k")  # (made and checked at the first use)


def test_a_platform_without_posix_locks_is_refused_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(file_backend, "fcntl", None)
    with pytest.raises(RuntimeError, match="needs a POSIX system"):
        FileBackend(tmp_path)


async def test_tickets_of_a_dead_process_are_cleaned_by_the_next_holder(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    holder = await Worker.start(spec(directory), "hold", "k")
    workers.append(holder)
    await holder.expect("holding")
    holder.kill()
    await holder.process.wait()
    assert len(files(directory)) == 2  # the dead holder's line file and ticket
    async with KeyedQueue(backend=backend).keyed("k"):
        pass
    assert files(directory) == []
