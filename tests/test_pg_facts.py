"""What PostgreSQL's advisory locks do: the ground truth for the PostgreSQL backend (issue 20).

Each test asserts one behaviour of the server, observed on a real one
(``postgres_url``: tests/support/pg_server.py). Ordering is driven by checkpoints on
the server's own state (``pg_locks`` shows a waiter queued), never by sleeps.
A waiter is a thread with a psycopg connection of its own (a session).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")
from psycopg import errors  # noqa: E402

pytestmark = pytest.mark.server

#: How long a checkpoint waits for the server to reach a state before the test fails.
PATIENCE = 15.0


def new_key() -> int:
    """An advisory lock key no other test uses (a signed 64-bit integer)."""
    return random.randint(-(2**63), 2**63 - 1)


@pytest.fixture
def connect(postgres_url: str) -> Iterator[Callable[[], Any]]:
    """Open sessions (autocommit connections) that are closed at the test's end."""
    opened: list[Any] = []

    def open_one() -> Any:
        connection = psycopg.connect(postgres_url, autocommit=True)
        opened.append(connection)
        return connection

    yield open_one
    for connection in opened:
        connection.close()


def eventually(check: Callable[[], bool], what: str) -> None:
    """Return once ``check()`` holds: a checkpoint on the server's state, not an ordering."""
    deadline = time.monotonic() + PATIENCE
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"the server never reached: {what}")
        time.sleep(0.005)


def advisory_locks(observer: Any, pid: int) -> list[bool]:
    """The advisory locks of the session ``pid`` in pg_locks: granted (True) or waiting."""
    rows = observer.execute(
        "SELECT granted FROM pg_locks WHERE locktype = 'advisory' AND pid = %s", (pid,)
    ).fetchall()
    return [row[0] for row in rows]


def is_waiting(observer: Any, pid: int) -> bool:
    return advisory_locks(observer, pid) == [False]


class Waiter(threading.Thread):
    """A session that asks for ``key`` in a thread, and holds it until ``release`` is set.

    On its grant it appends ``label`` to ``granted`` (while holding: the list is
    the grant order); ``error`` is what the lock call raised, if anything.
    """

    def __init__(
        self,
        connection: Any,
        key: int,
        label: Any,
        granted: list[Any],
        *,
        sql: str = "SELECT pg_advisory_lock(%s)",
        hold: bool = False,
    ) -> None:
        super().__init__(daemon=True)
        self.connection, self.key, self.label, self.granted = connection, key, label, granted
        self.pid = connection.info.backend_pid
        self.sql = sql
        self.release = threading.Event()
        if not hold:
            self.release.set()
        self.error: BaseException | None = None
        self.granted_at = 0.0

    def run(self) -> None:
        try:
            self.connection.execute(self.sql, (self.key,))
        except BaseException as error:
            self.error = error
            return
        self.granted_at = time.monotonic()
        self.granted.append(self.label)
        self.release.wait(PATIENCE)
        self.connection.execute("SELECT pg_advisory_unlock(%s)", (self.key,))


def queue_up(observer: Any, waiter: Waiter) -> Waiter:
    """Start ``waiter`` and return once the server shows it queued for its key."""
    waiter.start()
    eventually(lambda: is_waiting(observer, waiter.pid), f"session {waiter.pid} waits")
    return waiter


@contextlib.contextmanager
def python(program: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A Python process running ``program``, stdin and stdout pipes; killed at the end if up."""
    process = subprocess.Popen(
        [sys.executable, "-c", program, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield process
    finally:
        process.kill()
        process.wait()
        assert process.stdout is not None
        process.stdout.close()
        assert process.stdin is not None
        process.stdin.close()


# a. FIFO ------------------------------------------------------------------------------


def test_waiters_are_granted_in_the_order_they_asked(connect: Callable[[], Any]) -> None:
    key, granted = new_key(), []
    observer, holder = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    waiters = [queue_up(observer, Waiter(connect(), key, i, granted)) for i in range(8)]
    holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
    for waiter in waiters:
        waiter.join(PATIENCE)
    assert granted == list(range(8))
    assert all(waiter.error is None for waiter in waiters)


def test_fifo_holds_across_processes(postgres_url: str, connect: Callable[[], Any]) -> None:
    """Waiters in separate processes, queued one after another, are granted in that order."""
    key, observer, holder = new_key(), connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    program = (
        "import sys, psycopg\n"
        "c = psycopg.connect(sys.argv[1], autocommit=True)\n"
        "print(c.info.backend_pid, flush=True)\n"
        "c.execute('SELECT pg_advisory_lock(%s)', (int(sys.argv[2]),))\n"
        "print('granted', flush=True)\n"
        "sys.stdin.readline()\n"
        "c.execute('SELECT pg_advisory_unlock(%s)', (int(sys.argv[2]),))\n"
    )
    with contextlib.ExitStack() as stack:
        processes: list[tuple[int, subprocess.Popen[str]]] = []
        for i in range(6):
            process = stack.enter_context(python(program, postgres_url, str(key)))
            assert process.stdout is not None
            pid = int(process.stdout.readline())
            eventually(lambda pid=pid: is_waiting(observer, pid), f"process {i} waits")
            processes.append((pid, process))
        holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
        for i, (pid, process) in enumerate(processes):
            eventually(lambda pid=pid: advisory_locks(observer, pid) == [True], f"{i} granted")
            # and every process behind it still waits
            assert all(is_waiting(observer, later) for later, _ in processes[i + 1 :])
            assert process.stdin is not None
            assert process.stdout is not None
            assert process.stdout.readline() == "granted\n"
            process.stdin.write("\n")
            process.stdin.flush()
            assert process.wait(PATIENCE) == 0


# b. A session that ends frees its locks at once ------------------------------------


def _holder_dies_then_waiter_granted(
    connect: Callable[[], Any], kill: Callable[[Any, Any], None]
) -> float:
    """Seconds from killing a holder's session to its waiter's grant."""
    key, granted = new_key(), []
    observer, holder = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    waiter = queue_up(observer, Waiter(connect(), key, "waiter", granted, hold=True))
    began = time.monotonic()
    kill(holder, observer)
    waiter.join(0.0)
    eventually(lambda: granted == ["waiter"], "the waiter is granted")
    elapsed = waiter.granted_at - began
    waiter.release.set()
    waiter.join(PATIENCE)
    return elapsed


def test_a_holder_whose_socket_closes_abruptly_frees_the_lock_at_once(
    connect: Callable[[], Any],
) -> None:
    def shut(holder: Any, observer: Any) -> None:
        # no Terminate message: the server sees only the TCP connection end
        raw = socket.socket(fileno=os.dup(holder.fileno()))
        raw.shutdown(socket.SHUT_RDWR)
        raw.close()

    assert _holder_dies_then_waiter_granted(connect, shut) < 1.0


def test_a_terminated_holder_frees_the_lock_at_once(connect: Callable[[], Any]) -> None:
    def terminate(holder: Any, observer: Any) -> None:
        pid = holder.info.backend_pid
        observer.execute("SELECT pg_terminate_backend(%s)", (pid,))

    assert _holder_dies_then_waiter_granted(connect, terminate) < 1.0


def test_a_sigkilled_holder_process_frees_the_lock_at_once(
    postgres_url: str, connect: Callable[[], Any]
) -> None:
    key, granted, observer = new_key(), [], connect()
    program = (
        "import sys, time, psycopg\n"
        "c = psycopg.connect(sys.argv[1], autocommit=True)\n"
        "c.execute('SELECT pg_advisory_lock(%s)', (int(sys.argv[2]),))\n"
        "print(c.info.backend_pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    with python(program, postgres_url, str(key)) as process:
        assert process.stdout is not None
        holder_pid = int(process.stdout.readline())
        assert advisory_locks(observer, holder_pid) == [True]
        waiter = queue_up(observer, Waiter(connect(), key, "waiter", granted))
        began = time.monotonic()
        os.kill(process.pid, signal.SIGKILL)
        waiter.join(PATIENCE)
        assert granted == ["waiter"]
        assert waiter.granted_at - began < 1.0


def test_a_sigkilled_waiter_stays_queued_until_its_turn_then_lets_the_next_through(
    postgres_url: str, connect: Callable[[], Any]
) -> None:
    """A backend blocked in a lock wait does not read its socket: a dead waiter stays queued.

    (``client_connection_check_interval``, PostgreSQL 14+, off by default,
    would notice sooner.) It is granted in its turn, finds the client gone
    when it next reads, ends, and the lock passes to the next waiter: a short
    hand-off delay, no hang.
    """
    key, granted = new_key(), []
    observer, holder = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    program = (
        "import sys, psycopg\n"
        "c = psycopg.connect(sys.argv[1], autocommit=True)\n"
        "print(c.info.backend_pid, flush=True)\n"
        "c.execute('SELECT pg_advisory_lock(%s)', (int(sys.argv[2]),))\n"
    )
    with python(program, postgres_url, str(key)) as process:
        assert process.stdout is not None
        dead_pid = int(process.stdout.readline())
        eventually(lambda: is_waiting(observer, dead_pid), "the doomed waiter waits")
        behind = queue_up(observer, Waiter(connect(), key, "behind", granted))
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        time.sleep(0.5)  # (a bounded look: the dead waiter is still in the queue after 0.5 s)
        assert is_waiting(observer, dead_pid)
        holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
        behind.join(PATIENCE)
        assert granted == ["behind"]


def test_client_connection_check_interval_drops_a_dead_waiter_from_the_queue(
    postgres_url: str, connect: Callable[[], Any]
) -> None:
    """With ``client_connection_check_interval`` (a session may set it), a dead waiter leaves.

    The waiting backend checks its socket every interval and ends when the
    client is gone, so a SIGKILLed waiter no longer waits for its turn.
    """
    key = new_key()
    observer, holder = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    program = (
        "import sys, psycopg\n"
        "c = psycopg.connect(sys.argv[1], autocommit=True)\n"
        "c.execute(\"SET client_connection_check_interval = '100ms'\")\n"
        "print(c.info.backend_pid, flush=True)\n"
        "c.execute('SELECT pg_advisory_lock(%s)', (int(sys.argv[2]),))\n"
    )
    with python(program, postgres_url, str(key)) as process:
        assert process.stdout is not None
        dead_pid = int(process.stdout.readline())
        eventually(lambda: is_waiting(observer, dead_pid), "the doomed waiter waits")
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        began = time.monotonic()
        eventually(lambda: advisory_locks(observer, dead_pid) == [], "the dead waiter left")
        assert time.monotonic() - began < 2.0
    holder.execute("SELECT pg_advisory_unlock(%s)", (key,))


# c. lock_timeout, statement_timeout and cancel -------------------------------------


def test_lock_timeout_fails_the_wait_with_55P03_and_leaves_the_queue(
    connect: Callable[[], Any],
) -> None:
    key, granted = new_key(), []
    observer, holder = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    impatient = connect()
    impatient.execute("SET lock_timeout = '300ms'")
    first = Waiter(impatient, key, "impatient", granted)
    began = time.monotonic()
    queue_up(observer, first)
    second = queue_up(observer, Waiter(connect(), key, "second", granted))
    first.join(PATIENCE)
    waited = time.monotonic() - began
    assert isinstance(first.error, errors.LockNotAvailable)
    assert first.error.sqlstate == "55P03"
    assert 0.3 <= waited < 3.0
    assert advisory_locks(observer, first.pid) == []  # out of the queue
    third = queue_up(observer, Waiter(connect(), key, "third", granted))
    holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
    second.join(PATIENCE)
    third.join(PATIENCE)
    assert granted == ["second", "third"]
    # an autocommit session is usable at once after the timeout
    assert impatient.execute("SELECT 1").fetchone() == (1,)


def test_a_cancelled_wait_raises_query_canceled_and_leaves_the_queue(
    connect: Callable[[], Any],
) -> None:
    """How a client gives up a wait (asyncio cancellation): cancel the statement."""
    key, granted = new_key(), []
    observer, holder = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    waiter = queue_up(observer, Waiter(connect(), key, "cancelled", granted))
    behind = queue_up(observer, Waiter(connect(), key, "behind", granted))
    waiter.connection.cancel_safe()
    waiter.join(PATIENCE)
    assert isinstance(waiter.error, errors.QueryCanceled)
    assert waiter.error.sqlstate == "57014"
    assert advisory_locks(observer, waiter.pid) == []
    holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
    behind.join(PATIENCE)
    assert granted == ["behind"]


# d. Transaction-scoped locks -------------------------------------------------------


@pytest.mark.parametrize("end", ["commit", "rollback"])
def test_a_transaction_lock_is_released_when_the_transaction_ends(
    connect: Callable[[], Any], end: str
) -> None:
    key, granted = new_key(), []
    observer, holder = connect(), connect()
    holder.execute("BEGIN")
    holder.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
    waiter = queue_up(
        observer, Waiter(connect(), key, "waiter", granted, sql="SELECT pg_advisory_xact_lock(%s)")
    )
    # a session-level unlock does not release a transaction-level lock (the server warns)
    assert holder.execute("SELECT pg_advisory_unlock(%s)", (key,)).fetchone() == (False,)
    assert is_waiting(observer, waiter.pid)
    holder.execute(end.upper())
    waiter.join(PATIENCE)
    assert granted == ["waiter"]
    assert advisory_locks(observer, holder.info.backend_pid) == []


# e. The wait is a server-side sleep ------------------------------------------------


def test_a_waiting_session_shows_the_advisory_lock_wait_event(connect: Callable[[], Any]) -> None:
    key, granted = new_key(), []
    observer, holder = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    waiter = queue_up(observer, Waiter(connect(), key, "waiter", granted))
    query = (
        "SELECT state, wait_event_type, wait_event, query_start, xact_start"
        " FROM pg_stat_activity WHERE pid = %s"
    )
    before = observer.execute(query, (waiter.pid,)).fetchone()
    time.sleep(0.3)  # (a bounded look: the same single statement is still waiting)
    after = observer.execute(query, (waiter.pid,)).fetchone()
    assert before[:3] == ("active", "Lock", "advisory")
    assert after == before  # one statement, started once: nothing polls
    holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
    waiter.join(PATIENCE)
    assert granted == ["waiter"]


# f. Barging, and re-entrancy -------------------------------------------------------


@pytest.mark.parametrize("statements", ["one", "two"])
def test_a_holder_that_releases_and_asks_again_queues_behind_the_waiters(
    connect: Callable[[], Any], statements: str
) -> None:
    """No barging: the release hands the lock to the first waiter before the holder asks again.

    Both in one statement (``SELECT pg_advisory_unlock(k), pg_advisory_lock(k)``)
    and in two back to back, the holder queues behind every waiter.
    """
    key, granted = new_key(), []
    observer, holder = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    first = queue_up(observer, Waiter(connect(), key, "first", granted, hold=True))
    second = queue_up(observer, Waiter(connect(), key, "second", granted, hold=True))

    def release_and_ask_again() -> None:
        if statements == "one":
            holder.execute("SELECT pg_advisory_unlock(%s), pg_advisory_lock(%s)", (key, key))
        else:
            holder.execute("SELECT pg_advisory_unlock(%s)", (key,))
            holder.execute("SELECT pg_advisory_lock(%s)", (key,))
        granted.append("holder again")

    again = threading.Thread(target=release_and_ask_again, daemon=True)
    again.start()
    holder_pid = holder.info.backend_pid
    eventually(lambda: granted == ["first"], "the first waiter is granted")
    eventually(lambda: is_waiting(observer, holder_pid), "the holder waits again")
    first.release.set()
    eventually(lambda: granted == ["first", "second"], "the second waiter is granted")
    second.release.set()
    again.join(PATIENCE)
    first.join(PATIENCE)
    second.join(PATIENCE)
    assert granted == ["first", "second", "holder again"]
    holder.execute("SELECT pg_advisory_unlock(%s)", (key,))


def test_session_locks_stack_one_unlock_per_lock(connect: Callable[[], Any]) -> None:
    """A session that takes a key twice holds it until it released it twice."""
    key, granted = new_key(), []
    observer, holder = connect(), connect()
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))
    holder.execute("SELECT pg_advisory_lock(%s)", (key,))  # granted at once: re-entrant
    waiter = queue_up(observer, Waiter(connect(), key, "waiter", granted))
    assert holder.execute("SELECT pg_advisory_unlock(%s)", (key,)).fetchone() == (True,)
    time.sleep(0.2)  # (a bounded look: still held once)
    assert is_waiting(observer, waiter.pid)
    assert holder.execute("SELECT pg_advisory_unlock(%s)", (key,)).fetchone() == (True,)
    waiter.join(PATIENCE)
    assert granted == ["waiter"]
