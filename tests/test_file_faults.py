"""The file backend attacked: crashes and freezes at every step, shared and removed directories.

Real processes (tests/support/worker.py), really killed (SIGKILL) or frozen
(SIGSTOP). Where a fault must strike at one exact step, the worker's
Tripwire makes the process signal itself at that call of the backend: a
deterministic point, never a timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from inturn import BackendUnavailable, KeyedQueue, LeaseLost
from inturn.backends.file import FileBackend

from support.file_checks import files, line_file, spec
from support.helpers import PATIENCE, unavailable
from support.latest_across import Shared, latest_killed_at, no_update_lost
from support.processes import Worker, stopped, until


@pytest.fixture
def backend(directory: Path) -> FileBackend:
    return FileBackend(directory)


#: Another user: files are given to it with chown, which needs root.
NOBODY = 65534


def as_root() -> None:
    if os.geteuid() != 0:
        unavailable("root, to give files to another user (chown)")


async def ended(server: Worker) -> list[str]:
    """Read a crash-each child's reports up to its end; return how it ended."""
    while True:
        words = await server.report()
        if words[0] == "ended":
            return words[1:]
        assert words[0] in ("holding", "released", "timeout", "superseded"), words


# -- a crash at every step ---------------------------------------------------------------


async def test_a_crash_at_any_step_of_a_lone_turn_leaves_the_line_usable_and_clean(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    server = await Worker.start(spec(directory), "crash-each", "k")
    workers.append(server)
    queue = KeyedQueue(backend=backend)
    step = 0
    while True:
        step += 1
        await server.send(str(step))
        await server.expect("forked")
        outcome = await ended(server)
        assert outcome in (["killed"], ["exit", "0"]), outcome
        # The key is free at once, and this turn's release removes what the crash left.
        async with queue.keyed("k", timeout=PATIENCE):
            pass
        assert files(directory) == [], f"left behind by a crash before step {step}"
        if outcome == ["exit", "0"]:
            break  # step is past the last one: the whole turn ran
    assert step > 10


@pytest.mark.parametrize("victim", ["newest", "older"])
async def test_a_crash_at_any_step_of_latest_work_across_processes_loses_no_update(
    directory: Path, backend: FileBackend, workers: list[Worker], victim: str
) -> None:
    """Latest work (across="processes") killed before each step of its turn, beside a work of
    this process's that waits too: the newest work a live process waits for runs (the
    killed one's, if it ran), the key is free at once, and nothing is left behind.

    A newest victim judges and runs (this process's older work queues again behind it); an
    older victim queues again behind this process's newer work, then learns that it ran.
    """
    server = await Worker.start(spec(directory), "crash-each", "k", "latest")
    workers.append(server)
    step = 0
    while True:
        step += 1
        reports, outcome, mine = await latest_killed_at(server, step, Shared(directory), victim)
        no_update_lost(victim, step, reports, outcome, mine)
        async with KeyedQueue(backend=backend).keyed("k", timeout=PATIENCE):
            pass
        assert files(directory) == [], f"left behind by a crash before step {step}"
        if outcome == ["exit", "0"]:
            break
    assert step > 10


def plant_dead_tickets(directory: Path, key: str) -> None:
    """Start key's line file with tickets whose processes died, of every length.

    As a busy line has: pids of other lengths than this process's. The first
    is one character longer than this process's tickets: the shape that once
    made a compaction cut short leave an empty name behind, which was then
    looked up as the directory itself.
    """
    pids = [10 ** len(str(os.getpid())), *(7 * 10**n for n in range(10))]
    records = "".join(f"T{pid}.{n:012x}\n" for n, pid in enumerate(pids))
    directory.mkdir(mode=0o700, exist_ok=True)
    line_file(directory, key).write_text(records)


async def test_a_crash_at_any_step_between_two_turns_loses_no_turn(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    server = await Worker.start(spec(directory), "crash-each", "k", "compact")
    workers.append(server)
    step = 0
    while True:
        step += 1
        outcome = await between_two_turns(server, step, backend)
        assert outcome in (["killed"], ["exit", "0"]), outcome
        assert files(directory) == [], f"left behind by a crash before step {step}"
        if outcome == ["exit", "0"]:
            break
    assert step > 10


async def between_two_turns(server: Worker, step: int, backend: FileBackend) -> list[str]:
    """A victim killed before the step-th call, queued between two turns of this process.

    The second turn holds until the victim has ended, so that the victim
    releases by compacting the line file. Return how the victim ended.
    """
    first, second = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    me = os.getpid()
    plant_dead_tickets(backend.directory, "k")
    gate = asyncio.Event()
    holder = asyncio.create_task(first.run("k", gate.wait))
    await until(lambda: backend.line("k") == (me,), "the holder took the key")
    await server.send(str(step))
    (pid,) = await server.expect("forked")
    outcome = asyncio.ensure_future(ended(server))
    await until(lambda: int(pid) in backend.line("k") or outcome.done(), "the victim queued")
    turns: list[str] = []

    async def follow() -> None:
        async with second.keyed("k", timeout=PATIENCE):
            turns.append("second")
            await outcome  # in line until the victim's release has tidied up, or it died

    follower = asyncio.create_task(follow())
    await until(lambda: backend.line("k").count(me) == 2, "the second turn queued")
    gate.set()
    await holder
    await follower  # a TimeoutError here is a lost turn
    assert turns == ["second"]
    return await outcome


async def test_a_crash_at_any_step_of_giving_up_loses_no_turn(
    directory: Path, backend: FileBackend, workers: list[Worker]
) -> None:
    # The victim times out behind a holder of this process: it leaves the
    # line, and tidies it, as a turn that is not reached does.
    server = await Worker.start(spec(directory), "crash-each", "k", "impatient")
    workers.append(server)
    queue = KeyedQueue(backend=backend)
    step = 0
    while True:
        step += 1
        gate = asyncio.Event()
        holder = asyncio.create_task(queue.run("k", gate.wait))
        await until(lambda: backend.line("k") == (os.getpid(),), "the holder took the key")
        await server.send(str(step))
        await server.expect("forked")
        outcome = await ended(server)
        assert outcome in (["killed"], ["exit", "0"]), outcome
        gate.set()
        await holder
        async with queue.keyed("k", timeout=PATIENCE):
            pass
        assert files(directory) == [], f"left behind by a crash before step {step}"
        if outcome == ["exit", "0"]:
            break
    assert step > 5


# -- a process frozen while it holds a line file's lock -------------------------------------


async def test_a_frozen_holder_of_the_line_files_lock_defeats_no_timeout(
    directory: Path, workers: list[Worker]
) -> None:
    frozen = await Worker.start(spec(directory), "freeze-in-tidy", "k", name="frozen")
    workers.append(frozen)
    await frozen.expect("holding")
    await until(lambda: stopped(frozen.pid), "stopped inside its release, holding the lock")
    try:
        impatient = await Worker.start(spec(directory), "try", "k", "0.2", name="impatient")
        workers.append(impatient)
        await impatient.expect("timeout")
        assert await impatient.finish() == 0  # no thread left behind keeps it from exiting
        cancelled = await Worker.start(spec(directory), "try-cancel", "k", name="cancelled")
        workers.append(cancelled)
        await cancelled.expect("cancelled")
        assert await cancelled.finish() == 0
        patient = await Worker.start(spec(directory), "try", "k", str(PATIENCE), name="patient")
        workers.append(patient)
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    await frozen.expect("released")
    await patient.expect("holding")
    assert await patient.finish() == 0
    assert await frozen.finish() == 0
    assert files(directory) == []


# -- shared directories ----------------------------------------------------------------------


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_a_directory_others_may_write_is_refused_unless_sticky(tmp_path: Path, mode: int) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(PermissionError, match="writable by others"):
        FileBackend(shared).line("k")  # (made and checked at the first use)


async def test_a_sticky_shared_directory_gets_an_owner_only_subdirectory(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    backend = FileBackend(shared)
    assert backend.directory == shared / f"inturn-{os.geteuid()}"
    info = os.lstat(backend.directory)
    assert stat.S_ISDIR(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o700
    async with KeyedQueue(backend=backend).keyed("k"):
        assert len(files(backend.directory)) == 2
    assert files(shared) == [f"inturn-{os.geteuid()}"]
    assert FileBackend(shared).directory == backend.directory


async def test_a_link_planted_in_a_shared_directory_is_never_followed(tmp_path: Path) -> None:
    as_root()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    precious = tmp_path / "precious"
    precious.write_text("mine\n")
    planted = line_file(shared, "k")
    planted.symlink_to(precious)
    os.lchown(planted, NOBODY, NOBODY)  # planted by another user
    async with KeyedQueue(backend=FileBackend(shared)).keyed("k"):
        pass
    assert precious.read_text() == "mine\n"
    assert planted.is_symlink()


def test_a_squatted_subdirectory_of_a_shared_directory_is_refused(tmp_path: Path) -> None:
    as_root()
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    squatted = shared / f"inturn-{os.geteuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, NOBODY, NOBODY)  # made by another user, before this one came
    with pytest.raises(PermissionError, match="belongs to uid 65534"):
        FileBackend(shared).line("k")  # (at the first use)
    squatted.rmdir()
    squatted.symlink_to(tmp_path)
    with pytest.raises(PermissionError, match="symbolic link"):
        FileBackend(shared).line("k")  # (at the first use)


async def test_a_symbolic_link_in_the_directory_is_never_followed(
    backend: FileBackend, tmp_path: Path
) -> None:
    precious = tmp_path / "precious"
    precious.write_text("mine\n")
    line_file(backend.directory, "k").symlink_to(precious)
    with pytest.raises(OSError, match="symbolic link"):
        async with KeyedQueue(backend=backend).keyed("k"):
            pass
    assert precious.read_text() == "mine\n"


# -- a full or read-only file system ------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A file system of this test's own: a 64 KiB tmpfs (mounting one needs root)."""
    mounted = tmp_path / "fs"
    mounted.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(mounted)],
        capture_output=True,
        check=False,
    )
    if made.returncode != 0:
        unavailable(f"mount -t tmpfs (root, in a namespace that allows it): {made.stderr!r}")
    try:
        yield mounted
    finally:
        subprocess.run(["umount", "-l", str(mounted)], check=False)


@pytest.mark.parametrize("mode", ["task", "thread"])
@pytest.mark.parametrize("fault", ["full", "read-only"])
def test_a_full_or_read_only_file_system_refuses_a_turn_naming_it(
    small_fs: Path, fault: str, mode: str
) -> None:
    """Issue 42: a turn on a full disk or a read-only file system raised the raw OSError;
    it raises BackendUnavailable naming the directory and the cause, the work does not run,
    and once the fault is gone the key's next turn runs."""
    directory = small_fs / "lines"
    backend = FileBackend(directory)
    queue, ran = KeyedQueue(backend=backend), []
    with queue.keyed("warm"):
        pass  # (the directory is made, and checked)
    filler = small_fs / "filler"
    if fault == "full":
        with open(filler, "wb") as fill, contextlib.suppress(OSError):
            fill.write(b"\0" * 65536)  # (up to the last block)
    else:
        subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True)

    def turn() -> None:
        if mode == "task":
            asyncio.run(queue.run("k", ran.append, 1))
        else:
            queue.run_sync("k", ran.append, 1)

    with pytest.raises(BackendUnavailable) as refused:
        turn()
    said = str(refused.value)
    assert str(directory) in said
    assert ("No space left" if fault == "full" else "Read-only file system") in said
    assert "did not run" in said
    assert isinstance(refused.value.__cause__, OSError)
    assert ran == []
    if fault == "full":
        filler.unlink()
    else:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True)
    turn()
    assert ran == [1]
    assert files(directory) == []


# -- a removed directory ---------------------------------------------------------------------


async def test_a_removed_directory_is_made_again_on_the_next_turn(
    directory: Path, backend: FileBackend
) -> None:
    queue = KeyedQueue(backend=backend)
    await queue.run("k", lambda: None)
    shutil.rmtree(directory)
    assert await queue.run("k", lambda: "again") == "again"
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    shutil.rmtree(directory)
    async with queue.keyed("k"), KeyedQueue(backend=backend).keyed("other"):
        assert len(files(directory)) == 4
    assert files(directory) == []


async def test_a_directory_replaced_by_a_link_is_refused_on_the_next_turn(
    directory: Path, backend: FileBackend, tmp_path: Path
) -> None:
    await KeyedQueue(backend=backend).run("k", lambda: None)  # (the directory is made)
    shutil.rmtree(directory)
    os.mkdir(tmp_path / "elsewhere", 0o700)
    os.symlink(tmp_path / "elsewhere", directory)
    with pytest.raises(PermissionError, match="symbolic link"):
        await KeyedQueue(backend=backend).run("k", lambda: None)
    assert os.listdir(tmp_path / "elsewhere") == []


# -- what the backend trusts, and what it detects ------------------------------------------------


async def test_a_line_file_deleted_under_its_holder_is_reported(
    backend: FileBackend, directory: Path
) -> None:
    queue = KeyedQueue(backend=backend)
    seen: list[bool] = []

    async def hold() -> None:
        async with queue.keyed("k") as turn:
            seen.append(turn.lease_lost)
            os.unlink(line_file(directory, "k"))  # another process of this user
            seen.append(turn.lease_lost)

    with pytest.raises(LeaseLost):
        await hold()
    assert seen == [False, True]
    assert files(directory) == []


async def test_a_line_file_deleted_and_made_again_by_another_turn_is_reported(
    backend: FileBackend, directory: Path
) -> None:
    """The new file may have the old one's inode number (ext4 gives it at once): it is read."""
    first, second = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    gate = asyncio.Event()
    others: list[asyncio.Task[bool]] = []
    seen: list[bool] = []

    async def hold() -> None:
        async with first.keyed("k") as turn:
            os.unlink(line_file(directory, "k"))  # another process of this user
            # Outside the guarantee: another turn makes the file again and takes the key.
            others.append(asyncio.create_task(second.run("k", gate.wait)))
            await until(lambda: backend.line("k") == (os.getpid(),), "the other took the key")
            seen.append(turn.lease_lost)

    with pytest.raises(LeaseLost):
        await hold()
    assert seen == [True]
    assert backend.line("k") == (os.getpid(),)  # the other's line, as it was
    gate.set()
    await others[0]
    assert files(directory) == []


@pytest.mark.parametrize("removed", ["line file", "directory"])
async def test_a_holding_process_whose_files_are_removed_is_told(
    directory: Path, backend: FileBackend, workers: list[Worker], removed: str
) -> None:
    holder = await Worker.start(spec(directory), "hold", "k")
    workers.append(holder)
    await holder.expect("holding")
    if removed == "line file":
        os.unlink(line_file(directory, "k"))  # another process of this user
    else:
        shutil.rmtree(directory)  # a tmp cleaner
    # Outside the guarantee: another process takes the key at once.
    async with KeyedQueue(backend=backend).keyed("k", timeout=0):
        pass
    await holder.go()
    await holder.expect("lease-lost")
    await holder.expect("raised")
    assert await holder.finish() == 0
    assert files(directory) == []


# -- keys of any size ---------------------------------------------------------------------------


async def test_a_key_of_a_megabyte_takes_turns_and_shows_short(backend: FileBackend) -> None:
    key = "k" * 2**20
    first, second = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    gate = asyncio.Event()
    holder = asyncio.create_task(first.run(key, gate.wait))
    await until(lambda: backend.line(key) == (os.getpid(),), "the holder took the key")
    follower = asyncio.create_task(second.run(key, lambda: "second"))
    await until(lambda: backend.line(key) == (os.getpid(),) * 2, "the second one queued")
    (line,) = await backend.lines()
    assert line.key == key
    assert len(line.waiters) == 1
    gate.set()
    await holder
    assert await follower == "second"
    assert files(backend.directory) == []
