"""The file backend's cost in file descriptors, and a process that has none left.

A key held through the file backend keeps one descriptor open: its
ticket's writer end. A turn refused because the process has no descriptor
left raises BackendUnavailable (its cause the OSError), and nothing it
made stays in the directory. The refusals at a real limit run in a child
process (this file, run as a script) whose RLIMIT_NOFILE is lowered, so
the test process keeps its own limit.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import itertools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from inturn import BackendUnavailable, KeyedQueue
from inturn.backends.file import FileBackend, _fds
from inturn.backends.file._linefile import parse

from support.file_checks import files, line_file
from support.helpers import PATIENCE
from support.processes import until

#: The child's limit of open files, and how many keys it tries to hold at once.
LIMIT = 64
KEYS = 100


@pytest.fixture
def backend(directory: Path) -> FileBackend:
    return FileBackend(directory)


def open_fds() -> int:
    """How many files this process has open (the listing's own descriptor left out)."""
    gc.collect()  # (a FileBackend's directory is closed when it is collected)
    return len(os.listdir("/proc/self/fd")) - 1


def check_refusal(error: BaseException, key: str) -> None:
    """Check error is the refusal of key's turn for lack of descriptors, as a user reads it."""
    assert isinstance(error, BackendUnavailable), repr(error)
    assert isinstance(error.__cause__, OSError)
    assert error.__cause__.errno == errno.EMFILE
    message = str(error)
    assert repr(key) in message
    assert "the work did not run" in message
    assert "ulimit -n" in message
    assert "RLIMIT_NOFILE" in message
    assert "fewer keys" in message


# -- what a held key costs ----------------------------------------------------------------------


async def test_each_key_held_by_a_task_keeps_one_descriptor_open(backend: FileBackend) -> None:
    queue = KeyedQueue(backend=backend)
    await queue.run("warm-up", lambda: None)
    before = open_fds()
    async with AsyncExitStack() as stack:
        for n in range(40):
            await stack.enter_async_context(queue.keyed(f"k{n}"))
        assert open_fds() - before == 40
    assert open_fds() == before
    assert files(backend.directory) == []


def test_each_key_held_by_a_thread_keeps_one_descriptor_open(backend: FileBackend) -> None:
    queue = KeyedQueue(backend=backend)
    queue.run_sync("warm-up", lambda: None)
    before = open_fds()
    with holding_in_threads(queue, [f"k{n}" for n in range(40)]) as outcomes:
        assert outcomes == ["held"] * 40
        assert open_fds() - before == 40
    assert open_fds() == before
    assert files(backend.directory) == []


@contextmanager
def holding_in_threads(
    queue: KeyedQueue, keys: list[str], refused: Callable[[], None] = lambda: None
) -> Iterator[list[Any]]:
    """A thread per key holds it (``with queue.keyed(key)``), started one after the other.

    Yields, once each thread holds or was refused, what each one got:
    ``"held"``, or the exception that refused it. refused() is called after
    each refusal. The turns end with the block.
    """
    outcomes: list[Any] = []
    done = threading.Semaphore(0)
    release = threading.Event()

    def hold(key: str) -> None:
        try:
            with queue.keyed(key, timeout=PATIENCE):
                outcomes.append("held")
                done.release()
                release.wait(PATIENCE)
        except Exception as error:
            outcomes.append(error)
            done.release()

    threads = []
    try:
        for key in keys:
            thread = threading.Thread(target=hold, args=(key,))
            thread.start()
            threads.append(thread)
            assert done.acquire(timeout=PATIENCE), f"the thread of {key} never held nor failed"
            if outcomes[-1] != "held":
                refused()
        yield outcomes
    finally:
        release.set()
        for thread in threads:
            thread.join(PATIENCE)


# -- no descriptor left, at each open of a turn ------------------------------------------------

#: Set in the turn under test: its opens are counted (see OutOfFiles), not others'.
COUNTED: ContextVar[bool] = ContextVar("COUNTED", default=False)


class OutOfFiles:
    """os.open as a process at its limit has it, at the at-th open of the counted turn.

    Counts the opens of files in a directory (``dir_fd=``: the backend's)
    that the turn under test makes (see COUNTED), and makes the at-th one
    fail with EMFILE, as the kernel does when no descriptor is left.
    """

    def __init__(self, at: int) -> None:
        self.at = at
        self.opens = 0
        self.real = os.open
        self.in_retry = False  # whether the failed open was a retried tidy's (see retried)

    def __call__(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: Any = None) -> int:
        if dir_fd is not None and COUNTED.get():
            self.opens += 1
            if self.opens == self.at:
                self.in_retry = retried()
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE), path)
        return self.real(path, flags, mode, dir_fd=dir_fd)


def retried() -> bool:
    """Whether this open is a tidy's, tried again after another tidier held the line's lock.

    That happens only when the two tidies met (a matter of timing), and
    such a tidy is best effort: one with no descriptor left to open the
    line file leaves it to the key's next turn (see the file backend's _tidy.retry).
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "again":
            return True
        frame = frame.f_back
    return False


async def take(queue: KeyedQueue, key: str, driver: str) -> None:
    """Take key's turn and end it at once, counted (see COUNTED): in this task, or a thread."""
    counted = COUNTED.set(True)  # (a thread of to_thread gets a copy of the context)
    try:
        if driver == "task":
            async with queue.keyed(key, timeout=PATIENCE):
                pass
        else:

            def turn() -> None:
                with queue.keyed(key, timeout=PATIENCE):
                    pass

            await asyncio.to_thread(turn)
    finally:
        COUNTED.reset(counted)


def waited_or_failed(taker: asyncio.Task[None], fault: OutOfFiles) -> Callable[[], bool]:
    """Whether taker failed, or waits on the holder's ticket, its third open (and last)."""
    return lambda: taker.done() or fault.opens >= 3


def turn_free(backend: FileBackend, key: str) -> None:
    """Check key is free: a turn takes it at once, and leaves nothing."""
    backend.release_sync(backend.acquire_sync(key, 0))
    assert files(backend.directory) == []


@pytest.mark.parametrize("driver", ["task", "thread"])
async def test_a_lone_turn_with_no_descriptor_left_at_any_open_is_refused_and_leaves_nothing(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    queue = KeyedQueue(backend=backend)
    backend.line("k")  # the directory's descriptor, opened at its first use: not a turn's
    before = open_fds()
    for at in itertools.count(1):
        fault = OutOfFiles(at)
        with monkeypatch.context() as patch:
            patch.setattr(os, "open", fault)
            try:
                await take(queue, "k", driver)
            except BackendUnavailable as error:
                check_refusal(error, "k")
            # (Else the turn made fewer opens, or the fault came at its release.)
        assert files(backend.directory) == [], f"left by a fault at open {at}"
        turn_free(backend, "k")
        assert open_fds() == before
        if fault.opens < at:
            break  # every open of the turn has failed once
    assert at > 2  # the line file, the ticket...


@pytest.mark.parametrize("driver", ["task", "thread"])
async def test_a_turn_behind_another_with_no_descriptor_left_is_refused_and_leaves_nothing(
    backend: FileBackend, monkeypatch: pytest.MonkeyPatch, driver: str
) -> None:
    holders, queue = KeyedQueue(backend=backend), KeyedQueue(backend=backend)
    backend.line("k")  # the directory's descriptor, opened at its first use: not a turn's
    before = open_fds()
    for at in itertools.count(1):
        fault = OutOfFiles(at)
        gate = asyncio.Event()
        holder = asyncio.create_task(holders.run("k", gate.wait))
        await until(lambda: backend.line("k") == (os.getpid(),), "the holder took the key")
        with monkeypatch.context() as patch:
            patch.setattr(os, "open", fault)
            taker = asyncio.create_task(take(queue, "k", driver))
            await until(waited_or_failed(taker, fault), "the taker waited, or failed")
            if taker.done():  # refused: its FIFO is gone, and its mark, from the busy line
                assert len(files(backend.directory)) == 2  # the line file, the holder's ticket
                records = line_file(backend.directory, "k").read_text().splitlines()
                assert parse(records).unfinished == [], records
            gate.set()
            await holder
            try:
                await taker
            except BackendUnavailable as error:
                check_refusal(error, "k")
        if not fault.in_retry:  # (else the line file is the next turn's to tidy: turn_free)
            assert files(backend.directory) == [], f"left by a fault at open {at}"
        turn_free(backend, "k")
        assert open_fds() == before
        if fault.opens < at:
            break
    assert at > 3  # the line file, the ticket, the holder's ticket...


# -- a process at its limit (a child of its own) -----------------------------------------------


@dataclass
class AtTheLimit:
    """What a child at LIMIT open files got when it tried to hold KEYS keys at once."""

    #: The child's report while it held what it could: base (files open before
    #: the turns, but a spare given back at the first refusal), free (LIMIT - base),
    #: held (keys), refused ([key, type, message, errno]).
    holding: dict[str, Any]
    #: The directory's files while the child held those keys.
    files_while_held: list[str]
    #: Files the child had open once every turn ended.
    fds_after: int
    #: The directory's files once the child exited.
    files_after: list[str]


@pytest.fixture(scope="module", params=["tasks", "threads"])
def at_the_limit(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Run a child at LIMIT files that holds what keys it can (in tasks, or threads)."""
    place = tmp_path_factory.mktemp(f"limit-{request.param}")
    directory, errors = place / "lines", place / "stderr"
    with (
        errors.open("w") as stderr,
        subprocess.Popen(
            [sys.executable, __file__, request.param, str(directory)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        ) as child,
    ):
        assert child.stdin is not None
        assert child.stdout is not None

        def report() -> Any:
            line = child.stdout.readline()  # type: ignore[union-attr]
            assert line, f"the child ended (exit {child.wait()}): {errors.read_text()}"
            return json.loads(line)

        holding = report()
        while_held = files(directory)
        child.stdin.write("go\n")
        child.stdin.flush()
        after = report()
        assert child.wait(PATIENCE) == 0, errors.read_text()
    return AtTheLimit(holding, while_held, after["fds"], files(directory))


def test_a_process_at_its_limit_holds_a_key_per_descriptor(at_the_limit: AtTheLimit) -> None:
    held, free = at_the_limit.holding["held"], at_the_limit.holding["free"]
    # A key being taken needs a second descriptor for a moment (its line file), so one is left.
    assert len(held) == free - 1, at_the_limit.holding


def test_a_turn_refused_for_lack_of_descriptors_says_the_work_did_not_run(
    at_the_limit: AtTheLimit,
) -> None:
    held, refused = at_the_limit.holding["held"], at_the_limit.holding["refused"]
    assert len(refused) == KEYS - len(held) > 0
    for key, kind, message, cause in refused:
        assert kind == "BackendUnavailable", (key, kind, message)
        assert cause == errno.EMFILE
        assert repr(key) in message
        for words in ("the work did not run", "ulimit -n", "RLIMIT_NOFILE", "fewer keys"):
            assert words in message, message


def test_a_turn_refused_for_lack_of_descriptors_leaves_nothing(at_the_limit: AtTheLimit) -> None:
    held = at_the_limit.holding["held"]
    # Only the held keys' line files and tickets, while they are held.
    assert len(at_the_limit.files_while_held) == 2 * len(held), at_the_limit.files_while_held
    for key in held:
        assert line_file(Path("."), key).name in at_the_limit.files_while_held
    assert at_the_limit.fds_after == at_the_limit.holding["base"]  # nothing left open
    assert at_the_limit.files_after == []


def _describe(error: BaseException) -> list[Any]:
    cause = error.__cause__ if error.__cause__ is not None else error
    return [type(error).__name__, str(error), getattr(cause, "errno", None)]


class Spare:
    """A descriptor kept open, then given back at the first refusal.

    So the turns that follow run out at the other step of a join: a turn
    needs two descriptors at once, for a moment, and keeps one.
    """

    def __init__(self) -> None:
        self.fd: int | None = os.open(os.devnull, os.O_RDONLY)
        #: Files open besides the spare (with it: one more).
        self.base = open_fds() - 1

    def give_back(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


async def _hold_in_tasks(queue: KeyedQueue, keys: list[str], say: Callable[..., None]) -> None:
    await queue.run("warm-up", lambda: None)
    spare = Spare()
    held: list[str] = []
    refused: list[list[Any]] = []
    async with AsyncExitStack() as stack:
        for key in keys:
            try:
                await stack.enter_async_context(queue.keyed(key, timeout=PATIENCE))
            except Exception as error:
                refused.append([key, *_describe(error)])
                spare.give_back()
            else:
                held.append(key)
        say(base=spare.base, free=LIMIT - spare.base, held=held, refused=refused)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    say(fds=open_fds())


def _hold_in_threads(queue: KeyedQueue, keys: list[str], say: Callable[..., None]) -> None:
    queue.run_sync("warm-up", lambda: None)
    spare = Spare()
    with holding_in_threads(queue, keys, spare.give_back) as outcomes:
        held = [key for key, got in zip(keys, outcomes, strict=True) if got == "held"]
        refused = [
            [key, *_describe(got)] for key, got in zip(keys, outcomes, strict=True) if got != "held"
        ]
        say(base=spare.base, free=LIMIT - spare.base, held=held, refused=refused)
        sys.stdin.readline()
    say(fds=open_fds())


def _child(how: str, directory: str) -> None:
    """Lower this process's limit of open files to LIMIT, then try to hold KEYS keys at once."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, hard))
    queue = KeyedQueue(backend=FileBackend(directory))
    keys = [f"k{n}" for n in range(KEYS)]

    def say(**report: Any) -> None:
        print(json.dumps(report), flush=True)

    if how == "tasks":
        asyncio.run(_hold_in_tasks(queue, keys, say))
    else:
        _hold_in_threads(queue, keys, say)


if __name__ == "__main__":
    _child(*sys.argv[1:])


# -- an interrupt as an open returns -----------------------------------------------------------


@pytest.mark.parametrize("listed", [True, False], ids=["listed", "numbers-tried"])
def test_an_interrupt_as_an_open_returns_closes_that_descriptor_and_no_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: bool
) -> None:
    """An exception (a signal handler's) raised as the file backend's open of a file to write
    returns, before the open is listed, closes the descriptor it made; the same file open to
    read (an inspection, a waiter's probe), and other files open to write, stay open."""
    directory = os.open(tmp_path, os.O_RDONLY)
    name = "key.line"
    reading = os.open(tmp_path / name, os.O_RDONLY | os.O_CREAT, 0o600)
    writing_another = os.open(tmp_path / "another", os.O_RDWR | os.O_CREAT, 0o600)
    made: list[int] = []
    real_open = os.open

    def open_then_interrupted(*args: Any, **kwargs: Any) -> int:
        made.append(real_open(*args, **kwargs))
        raise KeyboardInterrupt("a signal handler's, as the open returns")

    try:
        with monkeypatch.context() as patched:
            patched.setattr(os, "open", open_then_interrupted)
            if not listed:  # (where descriptors cannot be listed, each number is tried)
                patched.setattr(_fds, "_DESCRIPTORS", str(tmp_path / "nowhere"))
            with pytest.raises(KeyboardInterrupt):
                _fds.open_tracked(name, os.O_RDWR, directory, _fds.new_serial())
        assert len(made) == 1
        with pytest.raises(OSError, match="Bad file descriptor") as closed:
            os.fstat(made[0])
        assert closed.value.errno == errno.EBADF
        os.fstat(reading)  # (open still: these raise if not)
        os.fstat(writing_another)
        assert made[0] not in _fds._OPEN
    finally:
        for fd in (reading, writing_another, directory):
            os.close(fd)
