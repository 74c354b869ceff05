"""A raw ``fork()`` inside a turn, on every shared backend (issue 28, point 10).

A thread (or a task) holds "k" and forks; the child leaves the block and
exits. What the child inherited of the turn ends in the child without a
word to the server: the child's exit never hangs, and the parent still holds
"k" (another process's turn times out; on PostgreSQL, ``pg_locks`` still
shows the lock granted to the parent's session) until it leaves the block
as usual (no LeaseLost, nothing logged); the next turn on "k" then works.
The child, for its part, may take "k" again afterwards: it waits behind the
parent, as any other process does.

A child forked by a task cannot run its copy of the event loop (asyncio
disowns it, and its selector is the parent's): it can only leave the block
in the step that forked, and exit or exec. So leaving must wait for
nothing there, and the backend's own release of what the child inherited
(the seam the turn calls) must be done at once.

The forks are real (``os.fork()`` in the test's own process, as a user's
code would call it), each child reports on a pipe, and a child that has
not exited within EXIT_WITHIN is killed and the test fails.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

import pytest

from inturn import KeyedQueue, current_turn

from support.helpers import PATIENCE, holding, wait_until

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX: fork")

#: Seconds a child may take to leave its block, report and exit: far more than it
#: needs; past it, the child hangs, and is killed.
EXIT_WITHIN = 10.0
#: Seconds a turn that must not be reached waits for it.
SHORT = 0.5

#: A queue on a new backend object of the test's place (another process, to the backend).
Make = Callable[[], KeyedQueue]


@pytest.fixture(params=["file", "redis", "postgres"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def place(kind: str, request: pytest.FixtureRequest, directory: Path) -> str:
    """Where the lines are: a directory, or a server's URL."""
    if kind == "file":
        return str(directory)
    if kind == "postgres":
        pytest.importorskip("psycopg")
        return str(request.getfixturevalue("postgres_url"))
    return str(request.getfixturevalue("redis_url"))


@pytest.fixture
def make(kind: str, place: str, namespace: str) -> Iterator[Make]:
    made: list[KeyedQueue] = []

    def make() -> KeyedQueue:
        if kind == "file":
            from inturn.backends.file import FileBackend

            backend: Any = FileBackend(place)
        elif kind == "postgres":
            from inturn.backends.postgres import PostgresBackend

            backend = PostgresBackend.from_url(place, namespace=namespace)
        else:
            from inturn.backends.redis import RedisBackend

            backend = RedisBackend.from_url(place, namespace=namespace)
        made.append(KeyedQueue(backend=backend))
        return made[-1]

    yield make
    for queue in made:
        asyncio.run(queue.backend.aclose())  # type: ignore[union-attr]


@pytest.fixture
def quiet(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail the test if anything (inturn, asyncio, a callback's error) logged a warning or worse."""
    caplog.set_level(logging.WARNING)
    yield
    loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.WARNING]
    assert loud == [], "logged while the parent kept its turn"


# -- the fork, and the child's report -----------------------------------------------------


class Child:
    """A child forked inside a turn, as its parent sees it: its pid and the pipe it reports on."""

    def __init__(self, pid: int, reader: int) -> None:
        self.pid = pid
        self.reader = reader

    def report(self) -> str:
        """What the child reported, once it exited; kill it and fail if it has not in time.

        Read before the parent's own checks, asserted after them: the parent's
        turn is what matters most, and its failure is reported first.
        """
        deadline = time.monotonic() + EXIT_WITHIN
        said = b""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self.reader], [], [], left)[0]:
                    self._kill(said)
                chunk = os.read(self.reader, 4096)
                if not chunk:
                    break  # the child closed the pipe: it exited
                said += chunk
            while (status := os.waitpid(self.pid, os.WNOHANG))[0] == 0:
                if time.monotonic() > deadline:
                    self._kill(said)
                time.sleep(0.001)
        finally:
            os.close(self.reader)
        assert os.waitstatus_to_exitcode(status[1]) == 0, f"the child failed: {said!r}"
        return said.decode()

    def _kill(self, said: bytes) -> NoReturn:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise AssertionError(
            f"the child forked inside the turn had not left its block and exited within "
            f"{EXIT_WITHIN:g} s (killed; it had said {said.decode()!r})"
        )


class Fork:
    """One fork inside a turn, from either side: the parent's Child, or the child's report.

    ``with fork.leaving(check):`` goes around the turn: in the child, once
    it left the block, it reports what ``check()`` says (or what leaving
    raised) and exits at once, so that nothing of the test runs on in it.
    """

    def __init__(self) -> None:
        self.parent = os.getpid()
        self.writer = -1  # (in the child) the pipe to report on

    @property
    def in_child(self) -> bool:
        return os.getpid() != self.parent

    def fork(self) -> Child | None:
        """os.fork(): the Child in the parent, None in the child."""
        reader, writer = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (3.12+: a process with threads)
            pid = os.fork()
        if pid == 0:
            os.close(reader)
            self.writer = writer
            return None
        os.close(writer)
        return Child(pid, reader)

    @contextmanager
    def leaving(self, check: Callable[[], str]) -> Iterator[None]:
        """Around the turn: in the child, report what leaving raised, or check(), and exit."""
        try:
            yield
        except BaseException as error:
            if self.in_child:
                raised = f"leaving the block raised {type(error).__name__}: {error}"
                self.end(lambda: raised)
            raise
        if self.in_child:
            self.end(check)

    def end(self, check: Callable[[], str]) -> NoReturn:
        """(In the child.) Report what check() says (or raised), and exit at once."""
        try:
            try:
                said = check()
            except BaseException as error:
                said = f"{type(error).__name__}: {error}"
            os.write(self.writer, said.encode("utf-8", "replace")[:4000])
        finally:
            os._exit(0)


def child_takes_its_turn_again(queue: KeyedQueue) -> str:
    """(In the child, out of its block.) It holds nothing, and waits behind the parent for "k"."""
    if queue.active_count:
        return f"the child still counts {queue.active_count} turn(s) held after its block"
    try:
        with queue.keyed("k", timeout=SHORT):
            return "the child took k again while its parent held it"
    except TimeoutError:
        return "ok"


# -- what the parent checks, inside its block and after -------------------------------------


def lock_holders(place: str, namespace: str) -> list[int]:
    """(PostgreSQL.) The server pids of the sessions granted the advisory lock of "k"."""
    import psycopg

    from inturn.backends.postgres._keys import lock_id, lock_parts

    with psycopg.connect(place, autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND classid = %s AND objid = %s AND objsubid = 1",
            lock_parts(lock_id(namespace, "k")),
        ).fetchall()
    return sorted(int(row[0]) for row in rows)


class Place:
    """The backend's place for one test: who holds "k" there, checked from outside the turn."""

    def __init__(self, kind: str, place: str, namespace: str, make: Make) -> None:
        self.kind, self.place, self.namespace = kind, place, namespace
        self.other = make()  # another process, to the backend
        self.holders: list[int] = []

    def note_the_holder(self) -> None:
        """(Inside the parent's block, before the fork.) Who holds "k" on the server."""
        if self.kind == "postgres":
            self.holders = lock_holders(self.place, self.namespace)
            assert len(self.holders) == 1, f"pg_locks shows {self.holders} holding k"

    def still_held(self) -> None:
        """(Inside the parent's block, after the child left.) Nobody else can take "k"."""
        with pytest.raises(TimeoutError), self.other.keyed("k", timeout=SHORT):
            pass
        if self.kind == "postgres":
            assert lock_holders(self.place, self.namespace) == self.holders, (
                "pg_locks no longer shows k granted to the parent's session"
            )

    def free_again(self) -> None:
        """(After the parent's block.) The next turn on "k" works."""
        with self.other.keyed("k", timeout=PATIENCE):
            pass


@pytest.fixture
def where(kind: str, place: str, namespace: str, make: Make) -> Place:
    return Place(kind, place, namespace, make)


# -- a thread forks inside its turn -----------------------------------------------------------


def _keyed(queue: KeyedQueue, inside: Callable[[], None]) -> None:
    with queue.keyed("k"):
        inside()


def _run_sync(queue: KeyedQueue, inside: Callable[[], None]) -> None:
    queue.run_sync("k", inside)


def _decorated(queue: KeyedQueue, inside: Callable[[], None]) -> None:
    queue.queue_by_key(key="k")(inside)()


SHAPES = {"keyed": _keyed, "run_sync": _run_sync, "decorated": _decorated}


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_child_forked_by_a_thread_in_its_turn_ends_it_alone(
    make: Make, where: Place, shape: str
) -> None:
    queue = make()
    fork = Fork()

    def inside() -> None:
        where.note_the_holder()
        child = fork.fork()
        if child is None:
            return  # the child leaves the block
        said = child.report()
        where.still_held()
        assert said == "ok", "the child's part"
        turn = current_turn()
        assert turn is not None
        assert not turn.lease_lost

    with fork.leaving(lambda: child_takes_its_turn_again(queue)):
        SHAPES[shape](queue, inside)
    where.free_again()
    assert queue.run_sync("k", lambda: "again") == "again"


# -- a task forks inside its turn -------------------------------------------------------------


def _leave_at_once(turn: Any) -> str:
    """(In a child forked by a task.) Leave the block without running the event loop.

    A forked child must never run its copy of the loop: the copy's selector
    is the parent's (one epoll instance, shared), and asyncio disowns it in
    the child (no running loop there). So the block must end in the step
    that forked, waiting for nothing; then the child exits (or execs).
    """
    leaving = turn.__aexit__(None, None, None)
    try:
        leaving.send(None)
    except StopIteration:
        return "ok"
    except BaseException as error:
        return f"leaving the block raised {type(error).__name__}: {error}"
    leaving.close()
    return "leaving the block waited for the event loop, which a forked child must not run"


@pytest.mark.usefixtures("quiet")
def test_a_child_forked_by_a_task_in_its_turn_ends_it_alone(make: Make, where: Place) -> None:
    queue = make()
    fork = Fork()

    async def hold() -> None:
        # (async with, spelt out: the child leaves the block in the step that forked)
        turn = queue.keyed("k")
        await turn.__aenter__()
        try:
            where.note_the_holder()
            child = fork.fork()
            if child is None:
                fork.end(lambda: _leave_at_once(turn))
            said = await asyncio.to_thread(child.report)
            await asyncio.to_thread(where.still_held)
            assert said == "ok", "the child's part"
            assert not turn.lease_lost
        except BaseException as error:
            await turn.__aexit__(type(error), error, error.__traceback__)
            raise
        await turn.__aexit__(None, None, None)

    asyncio.run(hold())
    where.free_again()
    assert queue.run_sync("k", lambda: "again") == "again"


def _release_at_once(backend: Any, grant: Any) -> str:
    """(In a child forked by a task.) The backend's release of the parent's grant, in one step."""
    ending = backend.release(grant)
    if isinstance(ending, asyncio.Future):
        if ending.done():
            ending.result()
            return "ok"
        return "the release waited for the event loop, which a forked child must not run"
    try:
        ending.send(None)
    except StopIteration:
        return "ok"
    ending.close()
    return "the release waited for the event loop, which a forked child must not run"


@pytest.mark.usefixtures("quiet")
def test_a_grant_held_by_a_task_across_a_fork_ends_in_the_child_alone(
    make: Make, where: Place
) -> None:
    """The backend's own part of the task's case, through the seam the turn calls:
    the child's release of what it inherited is done at once, and is the child's alone."""
    backend: Any = make().backend
    fork = Fork()

    async def hold() -> None:
        grant = await backend.acquire("k", PATIENCE)
        try:
            where.note_the_holder()
            child = fork.fork()
            if child is None:
                fork.end(lambda: _release_at_once(backend, grant))
            said = await asyncio.to_thread(child.report)
            await asyncio.to_thread(where.still_held)
            assert said == "ok", "the child's part"
            assert not grant.lost
        finally:
            await backend.release(grant)
        assert not grant.lost

    asyncio.run(hold())
    where.free_again()


# -- a fork while other threads of the parent wait ------------------------------------------------


def waiters_of(where: Place, queue: KeyedQueue, key: str) -> int:
    """How many wait for key on the backend's server (or in its line files), not holding it."""
    if where.kind == "file":
        return max(0, len(queue.backend.line(key)) - 1)  # type: ignore[union-attr]
    if where.kind == "redis":
        lines = asyncio.run(queue.backend.lines())  # type: ignore[union-attr]
        return sum(len(line.waiters) for line in lines if line.key == key)
    import psycopg

    from inturn.backends.postgres._keys import lock_id, lock_parts

    with psycopg.connect(where.place, autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
            " AND classid = %s AND objid = %s AND objsubid = 1",
            lock_parts(lock_id(where.namespace, key)),
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.usefixtures("quiet")
def test_a_fork_leaves_the_parents_waiting_turns_to_the_parent(make: Make, where: Place) -> None:
    """One thread of the parent waits on the server for "w" (another process holds it), one
    in the parent's own line for "k": neither's pending answer is the child's to take."""
    queue, holder = make(), make()
    fork = Fork()
    got: dict[str, str] = {}

    def wait_for(key: str) -> None:
        got[key] = queue.run_sync(key, lambda: key)

    with holding(holder, "w"):
        on_server = threading.Thread(target=wait_for, args=("w",))
        in_line = threading.Thread(target=wait_for, args=("k",))
        with fork.leaving(lambda: child_takes_its_turn_again(queue)), queue.keyed("k"):
            on_server.start()
            wait_until(lambda: waiters_of(where, holder, "w") == 1, "the parent waiting for w")
            in_line.start()
            wait_until(lambda: queue.pending("k") == 1, "the parent's thread in k's line")
            where.note_the_holder()
            child = fork.fork()
            if child is not None:
                said = child.report()
                where.still_held()
                assert said == "ok", "the child's part"
        in_line.join(PATIENCE)
        assert got == {"k": "k"}  # ("w" is still held)
    on_server.join(PATIENCE)
    assert got == {"k": "k", "w": "w"}
    where.free_again()


# -- the file backend: the numbers of the parent's files, reused by the child ---------------


def _reuse_and_release(backend: Any, grant: Any, path: Path, highest: int, how: str) -> str:
    """(In the child.) Fill every free number up to highest with a file of the child's, the
    parent's ticket's among them; release the inherited grant; check that file is untouched."""
    mine = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    reused = [mine]
    while reused[-1] <= highest:  # (dup takes the lowest free number)
        reused.append(os.dup(mine))
    if grant.lost:
        return "the child's copy of the parent's grant reads as lost"
    if how == "release_sync":
        backend.release_sync(grant)
    elif not backend.release(grant).done():  # (no running loop here: a task's child)
        return "the release waited for the event loop, which a forked child must not run"
    for fd in reused:
        os.fstat(fd)  # (EBADF if the release closed one)
    if written := os.pread(mine, 64, 0):
        return f"the release wrote {written!r} into a file of the child's"
    try:
        backend.release_sync(backend.acquire_sync("k", SHORT))
    except TimeoutError:
        return "ok"
    return "the child took k again while its parent held it"


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("how", ["release_sync", "release"])
def test_a_file_grant_released_in_the_child_leaves_the_childs_files_alone(
    directory: Path, tmp_path: Path, how: str
) -> None:
    """The fork closed the child's copy of the parent's ticket, and a file the child opened
    since may have its number: releasing the inherited grant writes nothing into that file,
    closes nothing, and leaves the parent's ticket in its line, the key the parent's."""
    from inturn.backends.file import FileBackend

    backend, other = FileBackend(directory), FileBackend(directory)
    if how == "release_sync":  # a thread's grant
        grant = backend.acquire_sync("k", PATIENCE)
    else:  # a task's (its loop is closed after: no loop runs in the child)
        grant = asyncio.run(backend.acquire("k", PATIENCE))
    highest = max(int(name) for name in os.listdir("/dev/fd"))
    fork = Fork()
    child = fork.fork()
    if child is None:
        fork.end(lambda: _reuse_and_release(backend, grant, tmp_path / "child", highest, how))
    said = child.report()
    with pytest.raises(TimeoutError):
        other.acquire_sync("k", SHORT)
    assert backend.line("k") == (os.getpid(),), "the parent's ticket left the line"
    assert said == "ok", "the child's part"
    assert not grant.lost
    backend.release_sync(grant)
    other.release_sync(other.acquire_sync("k", PATIENCE))
    assert os.listdir(directory) == []
