"""Attacks on latest work shared across processes on PostgreSQL (``across="processes"``).

In-process attacks use several KeyedQueues, each with a PostgresBackend of its own on one
namespace (tests/support/pg_latest.py: the server cannot tell them from processes, each has
its own connections, so its own server sessions, named ``TAG-name``). The scenarios mirror
Redis's (test_latest_across_redis_attacks.py), then go where only PostgreSQL goes: the
intent lock (``objsubid = 2``), the fate locks (a turn's, an int8 advisory lock from its
first post to its end, that the older turns standing by behind it wait for, shared: not the
key's lock, so a standby is neither in the key's line nor in ``lines()``) and the table
``inturn_latest``, an administrator's ``pg_terminate_backend``/``pg_cancel_backend``/``LOCK
TABLE``, a SIGKILL of a real process, a server restart, a user's privileges, a nested turn,
a post made by hand, PgBouncer.

Every order is driven by events and by the server's own state (``pg_locks``,
``pg_stat_activity``, ``inturn_latest``), read from the side (``Seen``), never by sleeps.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

from psycopg.conninfo import make_conninfo  # noqa: E402

from inturn import BackendUnavailable, KeyedQueue, LeaseLost, Superseded  # noqa: E402
from inturn.backends._judge import AGAIN  # noqa: E402
from inturn.backends._stamps import CLOCK  # noqa: E402
from inturn.backends.postgres import PostgresBackend, _latest, _sql  # noqa: E402
from inturn.backends.postgres._keys import fate_id, lock_id  # noqa: E402

from support.helpers import PATIENCE, settle, wait_until  # noqa: E402
from support.latest_across import Holder, Runs, answered, in_thread  # noqa: E402
from support.pg_latest import PgProcesses, Seen  # noqa: E402
from support.processes import until  # noqa: E402

pytestmark = pytest.mark.server

#: What a turn may take past its bound: the backend's margin (1 s), and room for a loaded
#: 2-core machine.
SLACK = 3.0


@pytest.fixture(autouse=True)
def _no_collection_until_reported() -> Iterator[None]:
    """No cyclic garbage collection from a test's start to its teardown (then one).

    A test that fails half way leaves tasks whose exception nobody retrieved; collected
    while pytest parses the test's source for its report, their finalizer logs their
    traceback, whose formatting parses source too: CPython 3.11's ast module keeps its
    recursion depth per interpreter, not per call, so pytest's parse raises "AST constructor
    recursion depth mismatch", an INTERNALERROR that ends the worker (and hides the failure).
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
        gc.collect()


@pytest.fixture
async def made(postgres_url: str, namespace: str) -> AsyncIterator[PgProcesses]:
    """Queues on the session's server, one "process" each; closed at the test's end."""
    processes = PgProcesses(postgres_url, namespace)
    yield processes
    await processes.close()


@pytest.fixture
async def alone(postgres_url: str, namespace: str) -> AsyncIterator[PgProcesses]:
    """As made, in a database of the test's own: for a test that locks or drops the table of
    latest work (other tests' turns never meet it, even on a server shared by workers)."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as root:
        await root.execute(f"CREATE DATABASE {name}")
    processes = PgProcesses(make_conninfo(postgres_url, dbname=name), namespace)
    try:
        await asyncio.wait_for(processes.plain("maker").run("warm", lambda: None), PATIENCE)
        yield processes  # (its tables are made)
    finally:
        await processes.close()
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as root:
            await root.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


async def warm(*queues: KeyedQueue) -> None:
    """A turn of each queue on another key: its connection is made and readied, and kept
    (a test's bounds then measure the turn, not a connect)."""
    for queue in queues:
        await asyncio.wait_for(queue.run("warm", lambda: None), PATIENCE)


def one(pids: list[int]) -> int:
    """The one server session of a list."""
    assert len(pids) == 1, pids
    return pids[0]


#: A work, the event it sets as it starts, and the one it waits for to end.
Slow = tuple[Callable[[], Any], asyncio.Event, asyncio.Event]


async def slow_work(ran: list[str], name: str) -> Slow:
    """A work that records itself, says it started, and ends once let go."""
    started, go_on = asyncio.Event(), asyncio.Event()

    async def work() -> str:
        ran.append(name)
        started.set()
        await go_on.wait()
        return name

    return work, started, go_on


# -- 1. timeouts -----------------------------------------------------------------------------


async def test_timeout_0_on_a_latest_queue_is_a_plain_try_that_leaves_nothing(
    made: PgProcesses,
) -> None:
    """Attack: timeout=0 (try once) on a latest queue while the key is held and older latest
    work waits. Guarantee (a call with timeout=0 is never replaced: a plain try): TimeoutError
    at once (its work did not run); it posted nothing, took no intent lock, left no wait; the
    waiting work still runs; a try on the free key runs."""
    holder = made.holder()
    await holder.hold()
    waiting, now = made.latest("waiting"), made.latest("now", timeout=0)
    await warm(now)
    ran = Runs()
    queued = asyncio.create_task(waiting.run("k", ran.work("queued")))
    await settle(lambda: len(made.seen.waiting()) == 1 and len(made.seen.posts()) == 1)
    waiter = one(made.seen.waiting())
    began = time.monotonic()
    with pytest.raises(TimeoutError, match="the work did not run"):
        await now.run("k", ran.work("now"))
    assert time.monotonic() - began < SLACK
    assert list(made.seen.posts()) == [waiter]
    assert made.seen.intents() == [waiter]
    assert made.seen.waiting() == [waiter]
    await holder.release()
    assert await asyncio.wait_for(queued, PATIENCE) == "queued"
    assert await now.run("k", ran.work("now")) == "now"  # a free key: it runs
    assert ran == ["queued", "now"]
    assert await made.nothing_left()


async def test_the_backends_acquire_latest_with_timeout_0_tries_once_and_leaves_nothing(
    made: PgProcesses,
) -> None:
    """Attack: the backend's own acquire_latest (a LatestBackend's API) with timeout=0: on a
    busy key, and on a free key with a newer post whose session never waits, as a turn's
    first post (its fate lock held: a turn that stood by behind it would wait for as long as
    that session lives). Guarantee: busy, TimeoutError at once, and its post, intent lock,
    fate lock and session's wait are gone; free, it never stands by (each join again is an
    unlock and a try, in one statement): the grant comes after a bounded number of tries,
    and its release records what ran and leaves nothing held."""
    backend = made.backend("api")
    holder = made.holder()
    await holder.hold()
    called = time.monotonic_ns()
    with pytest.raises(TimeoutError, match="the work did not run"):
        await asyncio.wait_for(backend.acquire_latest("k", 0, lambda: called), PATIENCE)
    assert made.seen.posts() == {}
    assert made.seen.intents() == []
    assert made.seen.waiting() == []
    assert made.seen.fated() == []  # (nor its fate lock: the holder's plain turn has none)
    await holder.release()
    rogue = post_by_hand(made.url, made.namespace, CLOCK, 60.0)
    try:
        called = time.monotonic_ns()
        grant = await asyncio.wait_for(backend.acquire_latest("k", 0, lambda: called), PATIENCE)
        assert made.seen.holders() == made.seen.sessions("api")
        assert made.seen.standbys() == {}
        grant.ran(called, True)
        await asyncio.wait_for(backend.release(grant), PATIENCE)
        assert made.seen.ran()
        assert made.seen.holders() == []
        assert made.seen.intents() == [rogue.info.backend_pid]
        assert made.seen.fated() == [rogue.info.backend_pid]
    finally:
        rogue.close()
    assert await made.nothing_left()


@pytest.mark.parametrize("driver", ["task", "thread"])
async def test_a_timeout_expiring_while_the_turn_stands_by_behind_newer_work(
    made: PgProcesses, driver: str
) -> None:
    """Attack: the older turn (a task's, or a thread's) judged, found newer work behind it,
    and stands by behind it (the key given up, a fresh post, waiting for that turn's fate
    lock) while that work runs. Guarantee: its caller's timeout ends the wait (TimeoutError:
    the work did not run), within the timeout and the margin; once answered, nothing of it
    is left (no post, no intent lock, no fate lock of its own, no wait for nor hold of the
    newer turn's fate lock); the newer work goes on undisturbed (its key and fate lock held
    throughout), and nothing is left at its end."""
    timeout = 3.0
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest("older", timeout=timeout), made.latest("newer")
    if driver == "thread":
        await asyncio.to_thread(older.run_sync, "warm", lambda: None)
    else:
        await warm(older)
    await warm(newer)
    ran: list[str] = []
    slow, started, go_on = await slow_work(ran, "newer")
    outcomes: dict[str, Any] = {}
    began = time.monotonic()
    if driver == "task":
        first: Any = asyncio.create_task(older.run("k", Runs().work("older")))
    else:
        first = in_thread("older", lambda: older.run_sync("k", Runs().sync("older")), outcomes)
    await settle(lambda: len(made.seen.posts()) == 1)
    older_pid = one(list(made.seen.posts()))
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: len(made.seen.posts()) == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    runner = one(made.seen.holders())
    await settle(lambda: made.seen.standbys() == {older_pid: runner})
    assert made.seen.posts()[older_pid] is True  # (a fresh post, as it stood by)
    assert made.seen.waiting() == []  # (standing by is not waiting for the key)
    assert time.monotonic() - began < timeout, "too slow a machine to reach the stage in time"
    if driver == "task":
        with pytest.raises(TimeoutError, match="the work did not run"):
            await asyncio.wait_for(first, PATIENCE)
    else:
        await asyncio.to_thread(first.join, PATIENCE)
        assert isinstance(outcomes["older"], TimeoutError), outcomes
        assert "the work did not run" in str(outcomes["older"])
    assert time.monotonic() - began < timeout + SLACK
    assert made.seen.holds_nothing(older_pid)
    assert made.seen.holders() == [runner]
    assert made.seen.fated() == [runner]
    go_on.set()
    assert await asyncio.wait_for(second, PATIENCE) == "newer"
    assert ran == ["newer"]
    assert older.stats().superseded == 0  # (a missed turn, not a replaced one)
    assert await made.nothing_left()


async def table_locked(made: PgProcesses) -> Any:
    """An owner's transaction that holds the table of latest work (LOCK TABLE ... ACCESS
    EXCLUSIVE: a migration, a VACUUM FULL); rolled back by the caller."""
    owner = await psycopg.AsyncConnection.connect(made.url)
    await owner.execute(f"LOCK TABLE {_sql.LATEST} IN ACCESS EXCLUSIVE MODE")
    return owner


async def test_a_timeout_expiring_while_the_turn_judges(alone: PgProcesses) -> None:
    """Attack: the turn is granted the key, and its JUDGE is held up (an owner holds the table
    of latest work) past the caller's timeout. Guarantee: TimeoutError within the timeout and
    the margin, saying the work did not run; the key goes on to the next in line; once the
    table is free again, nothing of the turn is left."""
    timeout = 2.0
    holder = alone.holder()
    await holder.hold()
    latest, plain = alone.latest("latest", timeout=timeout), alone.plain("plain")
    await warm(latest, plain)
    ran = Runs()
    began = time.monotonic()
    call = asyncio.create_task(latest.run("k", ran.work("latest")))
    await settle(lambda: len(alone.seen.posts()) == 1)
    owner = await table_locked(alone)
    try:
        behind = asyncio.create_task(plain.run("k", ran.work("plain")))
        await settle(lambda: len(alone.seen.waiting()) == 2)
        holder.gate.set()
        await settle(lambda: len(alone.seen.blocked_on_table()) == 1)  # its JUDGE waits
        with pytest.raises(TimeoutError, match="the work did not run"):
            await asyncio.wait_for(call, PATIENCE)
        assert time.monotonic() - began < timeout + SLACK
        assert await asyncio.wait_for(behind, PATIENCE) == "plain"  # the key went on
    finally:
        await owner.rollback()
        await owner.close()
    await holder.release()
    assert ran == ["plain"]
    assert await alone.nothing_left()


# -- 2. cancellation at each await of the turn --------------------------------------------


@pytest.mark.parametrize("stage", ["waiting", "judging", "standing by"])
async def test_cancelling_the_runner_at_each_await_hands_on_to_its_follower(
    alone: PgProcesses, stage: str
) -> None:
    """Attack: the caller whose turn it is (a0, older; its process's newer call a1 follows
    it) is cancelled while its turn waits in the server's queue, while its JUDGE is held up
    (an owner holds the table), or while it stands by behind the newer work of another
    process (b), which runs. Guarantee: a0 gets its cancellation; a1 takes the process's
    turn; b runs once (the newest); a1 is answered (None: b returned); a plain turn behind
    them runs; the key is free and nothing is left."""
    holder = alone.holder()
    await holder.hold()
    a, b, plain = alone.latest("a"), alone.latest("b"), alone.holder("plain")
    await warm(a, b)
    ran = Runs()
    b_work, b_started, b_go = await slow_work(ran, "b")
    a0 = asyncio.create_task(a.run("k", ran.work("a0")))
    await settle(lambda: len(alone.seen.posts()) == 1)
    a_pid = one(list(alone.seen.posts()))
    a1 = asyncio.create_task(a.run("k", ran.work("a1")))
    await settle(lambda: a.pending("k") == 1)
    b0 = asyncio.create_task(b.run("k", b_work))
    await settle(lambda: len(alone.seen.posts()) == 2)
    blocking = asyncio.create_task(plain.hold())
    await settle(lambda: len(alone.seen.waiting()) == 3)
    owner = None
    try:
        if stage == "waiting":
            assert a_pid in alone.seen.waiting()
            a0.cancel()
        elif stage == "judging":
            owner = await table_locked(alone)
            holder.gate.set()
            await settle(lambda: alone.seen.blocked_on_table() == [a_pid])
            a0.cancel()
        else:
            holder.gate.set()
            await asyncio.wait_for(b_started.wait(), PATIENCE)
            b_pid = one(alone.seen.holders())
            await settle(lambda: alone.seen.standbys() == {a_pid: b_pid})  # a0's, behind b
            assert alone.seen.posts().get(a_pid) is True
            a0.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(a0, PATIENCE)
    finally:
        if owner is not None:
            await owner.rollback()
            await owner.close()
    holder.gate.set()
    b_go.set()  # (b may run before or after the plain turn: a1 may post behind it)
    await asyncio.wait_for(plain.held.wait(), PATIENCE)
    await plain.release()
    await asyncio.wait_for(blocking, PATIENCE)
    await holder.release()
    assert await answered(a1, b0) == [None, "b"]
    assert ran == ["b"]
    assert await alone.nothing_left()


@pytest.mark.parametrize("stage", ["waiting", "standing by"])
async def test_a_cancelled_turn_leaves_the_servers_queue_its_post_and_its_locks(
    made: PgProcesses, stage: str
) -> None:
    """Attack: the older turn's caller is cancelled while its turn waits in the key's line,
    or while it stands by behind the newer work, which runs. Guarantee: waiting, once the
    cancelled caller's await returns, its session no longer waits, its intent lock and fate
    lock are given back and its post is gone (not at some later time: its connection is
    kept for the next turn, and must hold nothing); standing by (its connection is closed:
    the wait on the newer turn's fate lock cannot be called off), its session holds nothing
    within the server's client check (1 s) and the margin: no post, no intent lock, no fate
    lock, no wait for nor hold of the newer turn's fate lock. Either way the newer work runs
    undisturbed, its key and fate lock held throughout."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest("older"), made.latest("newer")
    await warm(older, newer)
    ran = Runs()
    slow, started, go_on = await slow_work(ran, "newer")
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: len(made.seen.posts()) == 1)
    pid = one(list(made.seen.posts()))
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: len(made.seen.posts()) == 2)
    runner = one([other for other in made.seen.posts() if other != pid])
    await settle(lambda: len(made.seen.waiting()) == 2)
    if stage == "standing by":
        await holder.release()
        await asyncio.wait_for(started.wait(), PATIENCE)
        await settle(lambda: made.seen.standbys() == {pid: runner})
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    cancelled = time.monotonic()
    if stage == "waiting":
        assert made.seen.alive(pid)  # (its connection is kept: it must hold nothing)
        assert made.seen.holds_nothing(pid)
        await holder.release()
    else:
        await until(lambda: made.seen.holds_nothing(pid), "the standby's session holds nothing")
        assert time.monotonic() - cancelled < SLACK
        assert made.seen.holders() == [runner]
    assert made.seen.fated() == [runner]
    go_on.set()
    assert await asyncio.wait_for(second, PATIENCE) == "newer"
    assert ran == ["newer"]
    assert await made.nothing_left()


async def test_cancelling_a_turn_as_it_connects_leaves_nothing(made: PgProcesses) -> None:
    """Attack: the caller is cancelled as its turn's first connection appears on the server
    (connecting, readying, or posting: wherever the cancellation lands). Guarantee: it gets
    its cancellation; nothing of it is left (no post, no intent lock, no wait); the key's
    next latest work runs."""
    holder = made.holder()
    await holder.hold()
    fresh, other = made.latest("fresh"), made.latest("other")
    ran = Runs()
    first = asyncio.create_task(fresh.run("k", ran.work("fresh")))
    await settle(lambda: bool(made.seen.sessions("fresh")))
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await until(  # (a connection closed as it was readied ends a moment later on the server)
        lambda: (made.seen.posts(), made.seen.intents(), made.seen.waiting()) == ({}, [], []),
        "nothing of the cancelled turn is left",
    )
    second = asyncio.create_task(other.run("k", ran.work("other")))
    await settle(lambda: len(made.seen.posts()) == 1)
    await holder.release()
    assert await asyncio.wait_for(second, PATIENCE) == "other"
    assert ran == ["other"]
    assert await made.nothing_left()


async def test_cancelling_a_turn_as_it_learns_it_was_replaced_leaves_nothing(
    alone: PgProcesses,
) -> None:
    """Attack: the older turn stood by behind the newer work, which ran; woken, it learns so
    and takes its post away before its locks go (in the JUDGE behind its standby, or in a
    statement of its own); that DELETE is held up (an owner holds its row) and its caller is
    cancelled there. Guarantee: the caller gets its cancellation (or
    its answer, None, if it came first); the newer work ran once; nothing is left (its
    connection is closed: its session ends, with its post's intent lock and its fate lock)."""
    holder = alone.holder()
    await holder.hold()
    older, newer = alone.latest("older"), alone.latest("newer")
    await warm(older, newer)
    ran = Runs()
    slow, started, go_on = await slow_work(ran, "newer")
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: len(alone.seen.posts()) == 1)
    pid = one(list(alone.seen.posts()))
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: len(alone.seen.posts()) == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    runner = one(alone.seen.holders())
    await settle(lambda: alone.seen.standbys() == {pid: runner})
    owner = await psycopg.AsyncConnection.connect(alone.url)
    try:
        await owner.execute(f"SELECT 1 FROM {_sql.LATEST} WHERE pid = %s FOR UPDATE", (pid,))
        go_on.set()
        assert await asyncio.wait_for(second, PATIENCE) == "newer"
        await until(lambda: alone.seen.deleting(pid), "the replaced turn's DELETE waits")
        first.cancel()
        outcome = (await answered(first))[0]
    finally:
        await owner.rollback()
        await owner.close()
    assert outcome is None or isinstance(outcome, asyncio.CancelledError), outcome
    assert ran == ["newer"]
    assert await alone.nothing_left()


# -- 4. pg_terminate_backend ---------------------------------------------------------------


async def test_terminating_the_newest_waiting_session_runs_the_older_surviving_work(
    made: PgProcesses,
) -> None:
    """Attack: an administrator ends the server session of the newest work while it waits in
    line. Guarantee: its caller gets BackendUnavailable (its work did not run); the older
    work, whose caller still waits, runs; nothing is left."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest("older"), made.latest("newer")
    await warm(older, newer)
    ran = Runs()
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: len(made.seen.posts()) == 1)
    second = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: len(made.seen.posts()) == 2 and len(made.seen.waiting()) == 2)
    victim = one([pid for pid in made.seen.waiting() if made.seen.name_of(pid) == "newer"])
    made.seen.terminate(victim)
    with pytest.raises(BackendUnavailable, match="did not run"):
        await asyncio.wait_for(second, PATIENCE)
    await holder.release()
    assert await asyncio.wait_for(first, PATIENCE) == "older"
    assert ran == ["older"]
    assert await made.nothing_left()


async def test_terminating_the_newest_while_the_older_stands_by_behind_it_runs_the_older(
    made: PgProcesses,
) -> None:
    """Attack: the older turn judged and stands by behind the newer work, which still waits
    (a plain turn holds the key between them); then the newer work's session is ended (the
    target the standby waits on). Guarantee: the standby wakes, and as the newer work did
    not run, joins the line again: the older work runs once the plain turn is done; nothing
    is left (no fate lock of the ended turn either)."""
    holder = made.holder()
    await holder.hold()
    older, newer, plain = made.latest("older"), made.latest("newer"), made.holder("plain")
    await warm(older, newer)
    ran = Runs()
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: len(made.seen.posts()) == 1)
    older_pid = one(list(made.seen.posts()))
    blocking = asyncio.create_task(plain.hold())
    await settle(lambda: len(made.seen.waiting()) == 2)
    second = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: len(made.seen.posts()) == 2 and len(made.seen.waiting()) == 3)
    victim = one([pid for pid in made.seen.waiting() if made.seen.name_of(pid) == "newer"])
    holder.gate.set()  # the older judges: newer waits behind it; it stands by behind it
    await asyncio.wait_for(plain.held.wait(), PATIENCE)
    await settle(lambda: made.seen.standbys() == {older_pid: victim})
    assert made.seen.waiting() == [victim]
    assert made.seen.posts()[victim] is False  # (the newer one waits for its first turn)
    made.seen.terminate(victim)
    with pytest.raises(BackendUnavailable, match="did not run"):
        await asyncio.wait_for(second, PATIENCE)
    await settle(lambda: made.seen.waiting() == [older_pid])  # woken: in line again
    assert made.seen.standbys() == {}
    await plain.release()
    await asyncio.wait_for(blocking, PATIENCE)
    await holder.release()
    assert await asyncio.wait_for(first, PATIENCE) == "older"
    assert ran == ["older"]
    assert await made.nothing_left()


async def test_terminating_a_standby_leaves_the_newer_work_undisturbed(
    made: PgProcesses,
) -> None:
    """Attack: the session of the older turn, which stands by behind the newer work that
    runs, is ended. Guarantee: its caller gets BackendUnavailable; the newer work ends well
    (its key and fate lock held throughout); nothing is left."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest("older"), made.latest("newer")
    await warm(older, newer)
    ran: list[str] = []
    slow, started, go_on = await slow_work(ran, "newer")
    first = asyncio.create_task(older.run("k", Runs().work("older")))
    await settle(lambda: len(made.seen.posts()) == 1)
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: len(made.seen.posts()) == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    runner = one(made.seen.holders())
    await settle(lambda: len(made.seen.standbys()) == 1)
    victim, target = next(iter(made.seen.standbys().items()))
    assert target == runner
    assert made.seen.posts()[victim] is True
    made.seen.terminate(victim)
    with pytest.raises(BackendUnavailable, match="did not run"):
        await asyncio.wait_for(first, PATIENCE)
    assert made.seen.holders() == [runner]
    assert made.seen.fated() == [runner]
    go_on.set()
    assert await asyncio.wait_for(second, PATIENCE) == "newer"
    assert ran == ["newer"]
    assert await made.nothing_left()


async def test_terminating_the_holder_of_the_newest_before_it_recorded_runs_the_older(
    made: PgProcesses,
) -> None:
    """Attack: the newest work runs, the older turn stands by behind it; the runner's session
    (the standby's target) is ended before its release could record what ran. Guarantee
    (work counts as run once its holder recorded it): the standby wakes and the older work,
    whose caller still waits, runs; the runner's caller learns its lease was lost
    (LeaseLost) once its work ended; nothing is left."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest("older"), made.latest("newer")
    await warm(older, newer)
    ran = Runs()
    slow, started, go_on = await slow_work(ran, "newer")
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: len(made.seen.posts()) == 1)
    older_pid = one(list(made.seen.posts()))
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: len(made.seen.posts()) == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    runner = one(made.seen.holders())
    assert made.seen.name_of(runner) == "newer"
    await settle(lambda: made.seen.standbys() == {older_pid: runner})
    made.seen.terminate(runner)
    assert await asyncio.wait_for(first, PATIENCE) == "older"
    go_on.set()
    with pytest.raises(LeaseLost):
        await asyncio.wait_for(second, PATIENCE)
    assert ran == ["newer", "older"]
    assert await made.nothing_left()


@pytest.mark.parametrize("when", ["waiting", "running"])
async def test_sigkill_of_the_process_a_turn_stands_by_behind_runs_the_newest_surviving_work(
    made: PgProcesses, when: str
) -> None:
    """Attack: a real process's newest work is the target two older turns of two processes
    stand by behind, and the process is SIGKILLed: while its turn waits in line (a plain
    turn holds the key), or while its work runs (before its release recorded it).
    Guarantee: the standbys wake (its session ends with its socket: a waiting one within the
    server's client check, 1 s), and since its work is not recorded as run, the newest
    surviving work (b's) runs, once; the older caller is answered None; nothing is left,
    no fate lock of the killed turn either."""
    holder = made.holder()
    await holder.hold()
    a, b, plain = made.latest("a"), made.latest("b"), made.holder("plain")
    await warm(a, b)
    doomed = await made.process("doomed")
    ran = Runs()
    a0 = asyncio.create_task(a.run("k", ran.work("a")))
    await settle(lambda: len(made.seen.posts()) == 1)
    a_pid = one(list(made.seen.posts()))
    b0 = asyncio.create_task(b.run("k", ran.work("b")))
    await settle(lambda: len(made.seen.posts()) == 2)
    b_pid = one([pid for pid in made.seen.posts() if pid != a_pid])
    await settle(lambda: len(made.seen.waiting()) == 2)
    if when == "waiting":
        blocking = asyncio.create_task(plain.hold())
        await settle(lambda: len(made.seen.waiting()) == 3)
    await doomed.send("run")
    await settle(lambda: len(made.seen.posts()) == 3)
    await settle(lambda: len(made.seen.waiting()) == (4 if when == "waiting" else 3))
    target = one(made.seen.sessions("doomed"))
    holder.gate.set()
    if when == "waiting":
        await asyncio.wait_for(plain.held.wait(), PATIENCE)
    else:
        await doomed.expect("started")
    await settle(lambda: made.seen.standbys() == {a_pid: target, b_pid: target})
    killed = time.monotonic()
    doomed.kill()
    await until(lambda: not made.seen.alive(target), "the killed process's session ended")
    assert time.monotonic() - killed < SLACK
    if when == "waiting":
        # woken: the newest of them in line again, the older standing by behind it
        await until(
            lambda: made.seen.waiting() == [b_pid] and made.seen.standbys() == {a_pid: b_pid},
            "the standbys woke",
        )
        await plain.release()
        await asyncio.wait_for(blocking, PATIENCE)
    await holder.release()
    assert await answered(a0, b0) == [None, "b"]
    assert ran == ["b"]
    assert await made.nothing_left()


# -- 3. threads, a fresh event loop per job --------------------------------------------------


async def test_threads_of_three_processes_run_the_newest_once(made: PgProcesses) -> None:
    """Guarantee, from threads (run_sync) of three processes, two calls each, one of them
    "raise": one run, the newest; the callers elsewhere answered as their modes say, the
    runner's own process's callers with its result; each queue counts its replaced works."""
    holder = made.holder()
    await holder.hold()
    a, b, c = made.latest("a"), made.latest("b", on_superseded="raise"), made.latest("c")
    for queue in (a, b, c):
        await asyncio.to_thread(queue.run_sync, "warm", lambda: None)
    ran = Runs()
    outcomes: dict[str, Any] = {}

    def call(queue: KeyedQueue, name: str) -> threading.Thread:
        return in_thread(name, lambda: queue.run_sync("k", ran.sync(name)), outcomes)

    threads = [call(a, "a0")]
    await settle(lambda: len(made.seen.posts()) == 1)
    threads.append(call(a, "a1"))
    await settle(lambda: a.pending("k") == 1)
    threads.append(call(b, "b0"))
    await settle(lambda: len(made.seen.posts()) == 2)
    threads.append(call(b, "b1"))
    await settle(lambda: b.pending("k") == 1 or "b0" in outcomes)  # ("raise": b0 answered)
    threads.append(call(c, "c0"))
    await settle(lambda: len(made.seen.posts()) == 3)
    threads.append(call(c, "c1"))
    await settle(lambda: c.pending("k") == 1)
    await holder.release()
    for started in threads:
        await asyncio.to_thread(started.join, PATIENCE)
    assert ran == ["c1"]
    assert (outcomes["a0"], outcomes["a1"]) == (None, None)
    assert isinstance(outcomes["b0"], Superseded)
    assert isinstance(outcomes["b1"], Superseded)
    assert (outcomes["c0"], outcomes["c1"]) == ("c1", "c1")
    assert [queue.stats().superseded for queue in (a, b, c)] == [2, 2, 1]
    assert await made.nothing_left()


async def test_a_thread_and_a_task_of_one_process_run_a_run_per_kind_the_newest_last(
    made: PgProcesses,
) -> None:
    """A process's newest work is a task's, its first a thread's (at the server); another
    process's thread called between. Guarantee (a turn runs only work of its own kind): the
    other process's newer thread work runs, then the task's, newest, in a turn of its own;
    the process's older work never runs."""
    holder = made.holder()
    await holder.hold()
    a, b = made.latest("a"), made.latest("b")
    ran = Runs()
    outcomes: dict[str, Any] = {}
    t1 = in_thread("a-thread", lambda: a.run_sync("k", ran.sync("a-thread")), outcomes)
    await settle(lambda: len(made.seen.posts()) == 1)
    t2 = in_thread("b-thread", lambda: b.run_sync("k", ran.sync("b-thread")), outcomes)
    await settle(lambda: len(made.seen.posts()) == 2)
    newest = asyncio.create_task(a.run("k", ran.work("a-task")))
    await settle(lambda: a.pending("k") == 1 or len(made.seen.posts()) == 3)
    await holder.release()
    assert await asyncio.wait_for(newest, PATIENCE) == "a-task"
    for started in (t1, t2):
        await asyncio.to_thread(started.join, PATIENCE)
    assert ran == ["b-thread", "a-task"], "not a run per kind, the newest last"
    assert outcomes == {"a-thread": None, "b-thread": "b-thread"}
    assert await made.nothing_left()


def test_a_fresh_event_loop_per_job_runs_a_run_per_loop_the_newest_last(
    postgres_url: str, namespace: str
) -> None:
    """Jobs of one queue, each asyncio.run in a thread of its own; another process's call
    between. Guarantee (a turn runs only work of its own loop): the other process's newer
    work runs, then the newest in its own turn; the oldest never runs, and its caller gets
    None; nothing is left."""
    made = PgProcesses(postgres_url, namespace)
    loop = asyncio.new_event_loop()
    holder = made.holder()
    loop.run_until_complete(holder.hold())
    a, b = made.latest("a"), made.latest("b")
    ran = Runs()
    outcomes: dict[str, Any] = {}

    def job(queue: KeyedQueue, name: str) -> threading.Thread:
        return in_thread(name, lambda: asyncio.run(queue.run("k", ran.work(name))), outcomes)

    try:
        threads = [job(a, "a0")]
        wait_until(lambda: len(made.seen.posts()) == 1, "a0 in line")
        threads.append(job(b, "b0"))
        wait_until(lambda: len(made.seen.posts()) == 2, "b0 in line")
        threads.append(job(a, "a1"))
        wait_until(lambda: a.pending("k") == 1 or len(made.seen.posts()) == 3, "a1 waits")
        loop.run_until_complete(holder.release())
        for started in threads:
            started.join(PATIENCE)
        assert outcomes == {"a0": None, "b0": "b0", "a1": "a1"}
        assert ran == ["b0", "a1"], "not a run per loop, the newest last"
        assert loop.run_until_complete(made.nothing_left())
    finally:
        holder.gate.set()
        loop.run_until_complete(made.close())
        loop.close()


# -- 5. a server restart -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("when", "mode"), [("waiting", "fast"), ("waiting", "immediate"), ("standing by", "fast")]
)
async def test_a_restart_while_latest_turns_wait_fails_them_truthfully(
    own_postgres: Any, namespace: str, when: str, mode: str
) -> None:
    """Attack: the server stops (fast: sessions ended; immediate: a crash) while a burst of
    two processes waits (before any judged, or with the older turn standing by behind the
    newer work, which runs). Guarantee (errors tell the truth), nothing hangs: each waiter
    gets BackendUnavailable (its work did not run) as its session ends, or, if the sessions
    it waited behind ended first (the server ends them one by one) and its own lived on for
    a few round trips, LeaseLost (its work ran, its key lost); a turn that ran learns its key
    was lost (LeaseLost); once the server is back, latest work on the key runs, and nothing
    is left."""
    made = PgProcesses(own_postgres.url, namespace)
    try:
        holder = made.holder()
        await holder.hold()
        older, newer = made.latest("older"), made.latest("newer")
        await warm(older, newer)
        ran = Runs()
        slow, started, go_on = await slow_work(ran, "newer")
        first = asyncio.create_task(older.run("k", ran.work("older")))
        await settle(lambda: len(made.seen.posts()) == 1)
        second = asyncio.create_task(newer.run("k", slow))
        await settle(lambda: len(made.seen.posts()) == 2)
        if when == "standing by":
            holder.gate.set()
            await asyncio.wait_for(started.wait(), PATIENCE)
            assert made.seen.fresh() == 1
        made.seen.close()
        await asyncio.to_thread(own_postgres.stop, mode)
        stopped = time.monotonic()
        waiters = {"older": first} if when == "standing by" else {"older": first, "newer": second}
        for name, outcome in zip(waiters, await answered(*waiters.values()), strict=True):
            if isinstance(outcome, LeaseLost):
                assert name in ran, f"{name}: LeaseLost, but its work did not run"
            else:
                assert isinstance(outcome, BackendUnavailable), (name, outcome)
                assert "did not run" in str(outcome)
                assert name not in ran, f"{name}: its work ran, but it was told it did not"
        assert time.monotonic() - stopped < SLACK
        await asyncio.to_thread(own_postgres.start)
        made.seen = Seen(made.url, made.namespace, made.tag)
        go_on.set()
        holder.gate.set()
        if when == "standing by":
            with pytest.raises(LeaseLost):
                await asyncio.wait_for(second, PATIENCE)
            assert ran[0] == "newer"
        else:
            with pytest.raises(LeaseLost):
                await holder.release()
        after = await asyncio.wait_for(made.latest("after").run("k", ran.work("after")), PATIENCE)
        assert after == "after"
        assert await made.nothing_left()
    finally:
        await made.close()


# -- 6. a user who may not write inturn_latest ----------------------------------------------


@pytest.fixture
def app_db(postgres_url: str) -> Iterator[tuple[str, str]]:
    """A database of this test's own (its owner's URL), and the URL of a user with no CREATE
    in it whom its owner let use the sequence of tokens."""
    tag = f"t{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {tag} LOGIN")
        admin.execute(f"CREATE DATABASE {tag}")
    owner_url = postgres_url.rsplit("/", 1)[0] + f"/{tag}"
    with psycopg.connect(owner_url, autocommit=True) as owner:
        owner.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        owner.execute("CREATE SEQUENCE inturn_token AS bigint")
        owner.execute(f"GRANT USAGE ON SEQUENCE inturn_token TO {tag}")
    try:
        yield owner_url, owner_url.replace("postgres@", f"{tag}@", 1)
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {tag} WITH (FORCE)")
            admin.execute(f"DROP ROLE {tag}")


def advisory_locks(url: str) -> list[tuple[Any, ...]]:
    """Every advisory lock held or waited for in url's database (a test's own)."""
    with psycopg.connect(url, autocommit=True) as session:
        return list(
            session.execute(
                "SELECT pid, objsubid, granted FROM pg_locks WHERE locktype = 'advisory'"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ).fetchall()
        )


@pytest.mark.parametrize(
    "refused",
    [
        "no table",
        "ALL",
        "INSERT",
        "UPDATE",
        "SELECT",
        "DELETE",
    ],
)
async def test_a_user_who_may_not_write_inturn_latest_gets_backend_unavailable(
    app_db: tuple[str, str], refused: str
) -> None:
    """Attack: the table of latest work is missing and the user may not make it, or the user
    was refused a privilege on it. Guarantee (docs/backends.md): each latest turn raises
    BackendUnavailable naming the table and the fix, its work did not run, the key is not
    left held (no advisory lock: the key's, its intent lock, a fate lock); plain turns on the
    same backend work."""
    owner_url, url = app_db
    user = url.split("//", 1)[1].split("@", 1)[0]
    if refused != "no table":
        with psycopg.connect(owner_url, autocommit=True) as owner:
            owner.execute(_sql.TABLES.encode())
            owner.execute(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON inturn_keys, inturn_sessions,"
                f" {_sql.LATEST} TO {user}"
            )
            owner.execute(f"REVOKE {refused} ON {_sql.LATEST} FROM {user}")
    backend = PostgresBackend.from_url(url, namespace="ns")
    try:
        latest = KeyedQueue(backend=backend, pending="latest", across="processes")
        plain = KeyedQueue(backend=backend)
        ran = Runs()
        for attempt in range(2):  # (not once only)
            with pytest.raises(BackendUnavailable) as raised:
                await asyncio.wait_for(latest.run("k", ran.work(f"latest {attempt}")), PATIENCE)
            said = str(raised.value)
            assert _sql.LATEST in said
            assert f"grants SELECT, INSERT, UPDATE, DELETE ON {_sql.LATEST}" in said
            assert "the work did not run" in said
            assert ran == []
            assert advisory_locks(owner_url) == []  # the key, its intent lock, a fate lock
        assert await asyncio.wait_for(plain.run("k", ran.work("plain")), PATIENCE) == "plain"
        assert ran == ["plain"]
    finally:
        await backend.aclose()


#: The defect of a post that rides ahead of its wait.
POST_AHEAD = (
    "defect: once one post of the backend went through (Readiness.posted), every first post "
    "rides ahead of its wait (_latest_turn.LatestTurn._posting); its failure is read only "
    "once the wait is answered: on a busy key the turn waits out its timeout before it "
    "raises BackendUnavailable naming the table (the first turn after a revoke only)"
)


@pytest.mark.parametrize(
    "when",
    [
        "missing from the start",
        pytest.param(
            "revoked after a post went through",
            marks=pytest.mark.xfail(strict=True, reason=POST_AHEAD),
        ),
    ],
)
async def test_a_latest_turn_whose_post_failed_on_a_busy_key_says_so_without_waiting_for_it(
    app_db: tuple[str, str], when: str
) -> None:
    """Attack: the table of latest work is missing (the user may not make it), or an owner
    revoked INSERT on it after the backend's turns posted there; and the key is held by
    another process. Guarantee (docs/backends.md: latest work "fails with
    BackendUnavailable naming the fix"): the turn fails so, well within its timeout (its post
    failed: there is nothing to wait for), its work did not run, the holder keeps the key."""
    owner_url, url = app_db
    user = url.split("//", 1)[1].split("@", 1)[0]
    backend, other = (PostgresBackend.from_url(url, namespace="ns") for _ in range(2))
    timeout = 3.0
    try:
        latest = KeyedQueue(backend=backend, pending="latest", across="processes", timeout=timeout)
        ran = Runs()
        if when != "missing from the start":
            with psycopg.connect(owner_url, autocommit=True) as owner:
                owner.execute(_sql.TABLES.encode())
                owner.execute(
                    f"GRANT SELECT, INSERT, UPDATE, DELETE ON inturn_keys, inturn_sessions,"
                    f" {_sql.LATEST} TO {user}"
                )
            assert await asyncio.wait_for(latest.run("k", ran.work("before")), PATIENCE)
            with psycopg.connect(owner_url, autocommit=True) as owner:
                owner.execute(f"REVOKE INSERT ON {_sql.LATEST} FROM {user}")
        holder = Holder(other)
        await holder.hold()
        began = time.monotonic()
        try:
            with pytest.raises(BackendUnavailable, match=_sql.LATEST) as raised:
                await asyncio.wait_for(latest.run("k", ran.work("latest")), PATIENCE)
            assert "did not run" in str(raised.value)
            assert time.monotonic() - began < timeout
            assert "latest" not in ran
            assert [row[1:] for row in advisory_locks(owner_url)] == [(1, True)]  # the holder's
        finally:
            await holder.release()
        assert advisory_locks(owner_url) == []
    finally:
        await backend.aclose()
        await other.aclose()


async def test_a_table_of_latest_work_dropped_under_a_running_backend_is_made_again(
    alone: PgProcesses,
) -> None:
    """Attack: an owner drops inturn_latest (a cleanup, a restore without it) while a
    backend, whose user may make it, keeps its connections. Guarantee (as for the tables of
    keys: a record that finds them gone makes them again): the turn that finds it gone
    raises BackendUnavailable at worst (its work did not run), and latest work runs again
    from the next turn on."""
    latest = alone.latest("latest")
    ran = Runs()
    assert await asyncio.wait_for(latest.run("k", ran.work("before")), PATIENCE) == "before"
    alone.seen.rows(f"DROP TABLE {_sql.LATEST}")
    try:
        outcomes = [(await answered(latest.run("k", ran.work(f"after {n}"))))[0] for n in range(3)]
        assert all(isinstance(o, str | BackendUnavailable) for o in outcomes), outcomes
        assert outcomes[1:] == ["after 1", "after 2"], outcomes
    finally:
        alone.seen.rows(_sql.TABLES)  # (for the backends' close)


# -- an administrator's pg_cancel_backend ----------------------------------------------------


@pytest.mark.parametrize("then", ["the table is freed", "its JUDGE is cancelled again"])
async def test_a_judge_cancelled_by_an_administrator_tells_the_truth(
    alone: PgProcesses, then: str
) -> None:
    """Attack: an administrator cancels the turn's JUDGE (pg_cancel_backend: a statement held
    up by an owner's LOCK TABLE, say), sent behind its wait; then the owner frees the table,
    or the administrator cancels the JUDGE the turn asks again too. Guarantee (errors tell
    the truth): freed, the caller is answered promptly, by its work's result (it ran) or by
    BackendUnavailable saying its work did not run (it did not); cancelled again, it gets
    BackendUnavailable saying its work did not run, promptly (the table still held); once
    the table is free, nothing is left."""
    holder = alone.holder()
    await holder.hold()
    latest = alone.latest("latest")
    await warm(latest)
    ran = Runs()
    call = asyncio.create_task(latest.run("k", ran.work("latest")))
    await settle(lambda: len(alone.seen.posts()) == 1)
    owner = await table_locked(alone)
    try:
        holder.gate.set()
        await settle(lambda: len(alone.seen.blocked_on_table()) == 1)  # its JUDGE waits
        victim = one(alone.seen.blocked_on_table())
        first = alone.seen.started(victim)
        alone.seen.cancel(victim)
        cancelled = time.monotonic()
        if then == "the table is freed":
            await owner.rollback()
        else:  # (the JUDGE asked again, held up by the table too)
            await until(
                lambda: (
                    alone.seen.blocked_on_table() == [victim]
                    and alone.seen.started(victim) != first
                ),
                "its JUDGE asked again waits",
            )
            alone.seen.cancel(victim)
        outcome = (await answered(call))[0]
        assert time.monotonic() - cancelled < SLACK
    finally:
        await owner.rollback()
        await owner.close()
    await holder.release()
    if outcome == "latest":
        assert then == "the table is freed"
        assert ran == ["latest"]
    else:
        assert isinstance(outcome, BackendUnavailable), repr(outcome)
        assert "did not run" in str(outcome)
        assert ran == []
    assert await alone.nothing_left()


@pytest.mark.parametrize("how", ["record cancelled", "post deleted"])
async def test_a_release_whose_record_fails_leaves_no_lock_nor_counting_post(
    alone: PgProcesses, how: str
) -> None:
    """Attack: an administrator cancels the statement by which a release takes its post away
    and records what ran (held up by an owner's LOCK TABLE), so it fails and the unlocks
    behind it run; or an operator deleted the turn's post while its work ran (a clean-up of
    the table). Guarantee (nothing is left held): once the turn ended, the session that held
    the key (its connection kept for the next turn) holds neither the key, nor its intent
    lock, nor its fate lock; no post of it counts (a post whose DELETE was cancelled may stay
    in the table, but counts only while its session holds the intent lock)."""
    latest = alone.latest("latest")
    await warm(latest)
    ran: list[str] = []
    slow, started, go_on = await slow_work(ran, "latest")
    call = asyncio.create_task(latest.run("k", slow))
    await asyncio.wait_for(started.wait(), PATIENCE)
    runner = one(alone.seen.holders())
    assert runner in alone.seen.intents()
    assert alone.seen.fated() == [runner]
    if how == "post deleted":
        alone.seen.rows(f"DELETE FROM {_sql.LATEST} WHERE pid = %s", runner)
        go_on.set()
        assert await asyncio.wait_for(call, PATIENCE) == "latest"
    else:
        owner = await table_locked(alone)
        try:
            go_on.set()
            await settle(lambda: alone.seen.blocked_on_table() == [runner])  # its record waits
            alone.seen.cancel(runner)
            assert await asyncio.wait_for(call, PATIENCE) == "latest"
        finally:
            await owner.rollback()
            await owner.close()
    assert alone.seen.alive(runner)  # (its connection is kept for the next turn)
    assert runner not in alone.seen.holders()
    assert runner not in alone.seen.intents(), "the intent lock stays on a pooled connection"
    assert alone.seen.fate_locks("k", runner) == [], "a fate lock stays on a pooled connection"
    assert runner not in alone.seen.counted(), "the post counts while the connection is kept"
    if how == "post deleted":
        assert runner not in alone.seen.posts()


# -- 7. nesting: in a plain turn, in a transaction turn -----------------------------------------


@pytest.mark.parametrize("nested", ["older", "newest"])
async def test_latest_work_nested_in_a_plain_turn_takes_a_connection_of_its_own(
    made: PgProcesses, nested: str
) -> None:
    """Attack: latest work called inside a plain turn on another key of the same queue
    (whose session a nested plain turn would borrow), against another process's work.
    Guarantee: the nested turn posts, waits, judges and stands by on a connection of its
    own, never the enclosing turn's (giving up may close its connection); the newest runs
    once; the enclosing turn's key stays held throughout, and the enclosing turn ends well;
    nothing is left."""
    holder = made.holder()
    await holder.hold()
    queue, other = made.latest("outer"), made.latest("other")
    await warm(queue, other)
    ran = Runs()
    seen: dict[str, Any] = {}
    calls: list[asyncio.Task[Any]] = []

    async def outer() -> Any:
        async with queue.keyed("a"):
            result = await queue.run("k", ran.work("nested"))
            seen["a after"] = made.seen.holders("a")
            return result

    if nested == "newest":
        calls.append(asyncio.create_task(other.run("k", ran.work("other"))))
        await settle(lambda: len(made.seen.posts()) == 1)
    calls.append(asyncio.create_task(outer()))
    await settle(lambda: len(made.seen.holders("a")) == 1 and len(made.seen.posts()) == len(calls))
    enclosing = one(made.seen.holders("a"))
    own = one([pid for pid in made.seen.posts() if made.seen.name_of(pid) == "outer"])
    assert own != enclosing  # the nested turn's session is not the enclosing one's
    assert own in made.seen.waiting()
    assert own in made.seen.intents()
    assert enclosing not in made.seen.waiting() + made.seen.intents()
    if nested == "older":
        calls.append(asyncio.create_task(other.run("k", ran.work("other"))))
        await settle(lambda: len(made.seen.posts()) == 2)
    await holder.release()
    outcomes = await answered(*calls)
    winner = "nested" if nested == "newest" else "other"
    assert ran == [winner]
    assert sorted(map(str, outcomes)) == sorted(["None", winner])
    assert seen["a after"] == [enclosing]
    assert await made.nothing_left("k", "a")


@pytest.mark.parametrize("whose", ["another queue", "the same queue"])
async def test_latest_work_inside_a_transaction_turn_takes_a_connection_of_its_own(
    made: PgProcesses, whose: str
) -> None:
    """Attack: latest work called inside a ``keyed(..., transaction=True)`` block (of another
    queue on the same server, or of its own queue). Guarantee: it never posts or waits on the
    transaction's connection (the work's); the newest runs once; the transaction commits
    both its writes; nothing is left."""
    table = f"t_{uuid.uuid4().hex[:12]}"
    made.seen.rows(f"CREATE TABLE {table} (n int)")
    holder = made.holder()
    await holder.hold()
    latest, other = made.latest("latest"), made.latest("other")
    transacting = latest if whose == "the same queue" else made.plain("tx")
    await warm(latest, other, transacting)
    ran = Runs()
    seen: dict[str, Any] = {}

    async def outer() -> Any:
        async with transacting.keyed("a", transaction=True) as turn:
            await turn.connection.execute(f"INSERT INTO {table} VALUES (1)")
            seen["tx"] = turn.connection.info.backend_pid
            result = await latest.run("k", ran.work("nested"))
            await turn.connection.execute(f"INSERT INTO {table} VALUES (2)")
            return result

    try:
        call = asyncio.create_task(outer())
        await settle(lambda: len(made.seen.posts()) == 1)
        assert seen["tx"] not in made.seen.posts()
        assert seen["tx"] not in made.seen.waiting()
        newer = asyncio.create_task(other.run("k", ran.work("other")))
        await settle(lambda: len(made.seen.posts()) == 2)
        await holder.release()
        assert await answered(call, newer) == [None, "other"]
        assert ran == ["other"]
        assert made.seen.rows(f"SELECT n FROM {table} ORDER BY n") == [(1,), (2,)]
        assert await made.nothing_left("k", "a")
    finally:
        made.seen.rows(f"DROP TABLE {table}")


@pytest.mark.parametrize("gives_up", ["cancelled", "timed out"])
async def test_a_nested_turn_given_up_on_while_judging_leaves_the_enclosing_key_held(
    alone: PgProcesses, gives_up: str
) -> None:
    """Attack: latest work nested in a plain turn on key a is given up on while its JUDGE is
    held up (an owner holds the table for a moment): its caller is cancelled, or its timeout
    runs out (a JUDGE given up on closes its connection). Guarantee (as for a plain nested
    turn, see test_postgres_adversary): the nested turn ends, and the enclosing turn keeps
    key a to its end (no LeaseLost), as its work goes on; nothing is left."""
    holder = alone.holder()
    await holder.hold()
    queue = alone.latest("outer", timeout=2.0 if gives_up == "timed out" else None)
    await warm(queue)
    nested_over, checked = asyncio.Event(), asyncio.Event()
    seen: dict[str, Any] = {}

    async def outer() -> None:
        async with queue.keyed("a", timeout=PATIENCE):
            try:
                await queue.run("k", Runs().work("nested"))
            except (asyncio.CancelledError, TimeoutError) as error:
                seen["nested"] = error
            nested_over.set()
            await checked.wait()

    task = asyncio.create_task(outer())
    owner = None
    try:
        await settle(lambda: len(alone.seen.posts()) == 1)
        enclosing = one(alone.seen.holders("a"))
        nested = one(list(alone.seen.posts()))
        assert nested != enclosing
        owner = await table_locked(alone)
        holder.gate.set()
        await settle(lambda: alone.seen.blocked_on_table() == [nested])  # its JUDGE waits
        if gives_up == "cancelled":
            task.cancel()
        else:  # its time runs out: the JUDGE is given up on
            await until(lambda: "SELECT 0," not in (alone.seen.query(nested) or ""), "given up")
        await owner.rollback()
        await asyncio.wait_for(nested_over.wait(), PATIENCE)
        seen["a"] = alone.seen.holders("a")
        checked.set()
        outcome = (await answered(task))[0]
    finally:
        checked.set()
        holder.gate.set()
        if owner is not None:
            await owner.close()
    assert isinstance(seen["nested"], asyncio.CancelledError | TimeoutError)
    assert seen["a"] == [enclosing], "the enclosing turn's key a was freed while its work ran"
    assert not isinstance(outcome, LeaseLost), outcome
    assert await alone.nothing_left("k", "a")


async def test_a_nested_turn_cancelled_as_it_is_replaced_leaves_the_enclosing_key_held(
    alone: PgProcesses,
) -> None:
    """Attack: latest work nested in a plain turn on key a stood by behind newer work, which
    ran; woken, it learns so and takes its post away (a DELETE before its unlocks); that
    DELETE is held up (an owner holds its row for a moment) and the caller is cancelled
    there (which closes the nested turn's connection). Guarantee: the nested turn ends; the
    enclosing turn keeps key a to its end; nothing is left."""
    holder = alone.holder()
    await holder.hold()
    queue, other = alone.latest("outer"), alone.latest("other")
    await warm(queue, other)
    ran: list[str] = []
    slow, started, go_on = await slow_work(ran, "other")
    nested_over, checked = asyncio.Event(), asyncio.Event()
    seen: dict[str, Any] = {}

    async def outer() -> None:
        async with queue.keyed("a", timeout=PATIENCE):
            try:
                seen["nested"] = await queue.run("k", Runs().work("nested"))
            except asyncio.CancelledError as error:
                seen["nested"] = error
            nested_over.set()
            await checked.wait()

    task = asyncio.create_task(outer())
    owner = await psycopg.AsyncConnection.connect(alone.url)
    try:
        await settle(lambda: len(alone.seen.posts()) == 1)
        enclosing = one(alone.seen.holders("a"))
        nested = one(list(alone.seen.posts()))
        assert nested != enclosing
        newer = asyncio.create_task(other.run("k", slow))
        await settle(lambda: len(alone.seen.posts()) == 2)
        holder.gate.set()
        await asyncio.wait_for(started.wait(), PATIENCE)
        runner = one(alone.seen.holders())
        await settle(lambda: alone.seen.standbys() == {nested: runner})
        await owner.execute(  # (its DELETE of this row will wait for the owner)
            f"SELECT 1 FROM {_sql.LATEST} WHERE pid = %s FOR UPDATE", (nested,)
        )
        go_on.set()
        assert await asyncio.wait_for(newer, PATIENCE) == "other"
        await until(lambda: alone.seen.deleting(nested), "the replaced turn's DELETE waits")
        task.cancel()
        await owner.rollback()
        await asyncio.wait_for(nested_over.wait(), PATIENCE)
        seen["a"] = alone.seen.holders("a")
        checked.set()
        outcome = (await answered(task))[0]
    finally:
        checked.set()
        holder.gate.set()
        await owner.close()
    assert seen["a"] == [enclosing], "the enclosing turn's key a was freed while its work ran"
    assert not isinstance(outcome, LeaseLost), outcome
    assert ran == ["other"]
    assert await alone.nothing_left("k", "a")


# -- 8. a post whose session never waits -----------------------------------------------------


class Judged(list[int]):
    """Counts the JUDGEs of this process's turns (each reading of one, by _latest.judged)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        real = _latest.judged

        def judged(*args: Any, **kwargs: Any) -> Any:
            self.append(1)
            return real(*args, **kwargs)

        monkeypatch.setattr(_latest, "judged", judged)


def post_by_hand(url: str, namespace: str, clock: str, ahead_s: float, fate: bool = True) -> Any:
    """A connection of its own whose session posted latest work on k, and never waits: a
    call made ``ahead_s`` seconds from now, on the clock named clock (this host's: CLOCK);
    ``fate``: as a turn's first post does (it takes the key's intent lock and the turn's fate
    lock), else with the intent lock alone (a hand-made post: its fate lock is free). The
    caller closes it."""
    connection = psycopg.connect(url, autocommit=True)
    called = time.monotonic_ns() + int(ahead_s * 1e9)
    age = -int(ahead_s * 1e6)
    lock = lock_id(namespace, "k")
    if fate:
        taken = fate_id(lock, connection.info.backend_pid)
        connection.execute(_sql.posting(namespace, lock, clock, called, age, False, taken))
    else:
        high, low = _sql.intent(lock)
        connection.execute(f"SELECT pg_advisory_lock_shared({high:d}, {low:d})".encode())
        connection.execute(_sql.posting(namespace, lock, clock, called, age, False, None))
    return connection


@pytest.mark.parametrize(
    ("post", "timeout"),
    [("newer, of this host", None), ("another host's, ahead", None), ("newer, of this host", 8.0)],
)
async def test_a_post_whose_fate_lock_is_free_delays_the_work_a_bounded_number_of_times(
    made: PgProcesses, monkeypatch: pytest.MonkeyPatch, post: str, timeout: float | None
) -> None:
    """Attack: a session posts latest work on the key, newer than the real work's, takes the
    key's intent lock (its post counts) but no fate lock, and never waits (a hand-made row;
    of this host, or of another whose post is a minute ahead of the server's clock).
    Guarantee: the real work (untimed, or timed: its standbys and waits are timed
    statements) still runs, promptly, after a bounded number of JUDGEs (it stands by behind
    that post, wakes at once as its fate lock is free and, the post still counting, stands
    by again, uncounted up to DYING times, then joins again up to AGAIN times); once that
    session ends, its post no longer counts (the next turn judges once, and runs)."""
    judged = Judged(monkeypatch)
    latest = made.latest("latest", timeout=timeout)
    await warm(latest)
    ran = Runs()
    holder = made.holder()
    await holder.hold()
    call = asyncio.create_task(latest.run("k", ran.work("real")))
    await settle(lambda: len(made.seen.posts()) == 1)
    here = post != "another host's, ahead"
    rogue = post_by_hand(made.url, made.namespace, CLOCK if here else "x" + CLOCK[1:], 60.0, False)
    try:
        rogue_pid = rogue.info.backend_pid
        assert made.seen.counted() == sorted([rogue_pid, *made.seen.waiting()])
        assert rogue_pid not in made.seen.fated()
        judged.clear()
        began = time.monotonic()
        await holder.release()
        assert await asyncio.wait_for(call, PATIENCE) == "real"
        assert time.monotonic() - began < SLACK
        assert 1 < len(judged) <= _latest.DYING + AGAIN + 2, len(judged)
        assert list(made.seen.posts()) == [rogue_pid]  # (its session lives: its post stays)
    finally:
        rogue.close()
    await until(lambda: not made.seen.alive(rogue_pid), "the hand-made session ended")
    judged.clear()
    assert await asyncio.wait_for(latest.run("k", ran.work("after")), PATIENCE) == "after"
    assert len(judged) == 1  # its post no longer counts
    assert ran == ["real", "after"]
    assert await made.nothing_left()


@pytest.mark.parametrize("then", ["it ends", "newer work runs", "time runs out"])
async def test_a_turn_stuck_between_its_first_post_and_its_wait_holds_only_older_work(
    made: PgProcesses, monkeypatch: pytest.MonkeyPatch, then: str
) -> None:
    """Attack: a session posts latest work on the key, newer than the real work's, as a
    turn's first post does (the key's intent lock and its fate lock taken), and never waits
    (a client stuck between its first post, sent alone, and its wait). Guarantee: the older
    real work stands by behind it and does not run while it lives (its newer work may still
    come), the key free meanwhile; once that session ends, the real work runs promptly; a
    newer call of another process runs at once meanwhile, and the real work's caller is
    answered (None) once the stuck session ends; with a timeout, its caller gets
    TimeoutError within its timeout and the margin, and nothing of it is left (no post, no
    intent lock, no fate lock, no wait on the stuck turn's fate lock)."""
    judged = Judged(monkeypatch)
    latest = made.latest("latest", timeout=2.0 if then == "time runs out" else None)
    newest = made.latest("newest")
    await warm(latest, newest)
    ran = Runs()
    holder = made.holder()
    await holder.hold()
    call = asyncio.create_task(latest.run("k", ran.work("real")))
    await settle(lambda: len(made.seen.posts()) == 1)
    real = one(list(made.seen.posts()))
    rogue = post_by_hand(made.url, made.namespace, CLOCK, 0.0)
    try:
        rogue_pid = rogue.info.backend_pid
        assert made.seen.fated() == sorted([real, rogue_pid])
        began = time.monotonic()
        await holder.release()
        await settle(lambda: made.seen.standbys() == {real: rogue_pid})
        assert made.seen.holders() == made.seen.waiting() == []  # the key is free
        assert not call.done()
        if then == "time runs out":
            with pytest.raises(TimeoutError, match="the work did not run"):
                await asyncio.wait_for(call, PATIENCE)
            assert time.monotonic() - began < 2.0 + SLACK
            assert made.seen.holds_nothing(real)
            assert made.seen.fated() == [rogue_pid]
            assert ran == []
            return
        if then == "newer work runs":
            assert await asyncio.wait_for(newest.run("k", ran.work("newest")), PATIENCE) == "newest"
        judged.clear()
        rogue.close()
        closed = time.monotonic()
        outcome = await asyncio.wait_for(call, PATIENCE)
        assert time.monotonic() - closed < SLACK
        assert len(judged) <= _latest.DYING + AGAIN + 2, len(judged)
    finally:
        rogue.close()
    if then == "it ends":
        assert (outcome, ran) == ("real", ["real"])
    else:
        assert (outcome, ran) == (None, ["newest"])
    assert await made.nothing_left()


# -- 9. what else may break -----------------------------------------------------------------


#: Keys a hostile caller may pass: quotes and SQL, NUL and high bytes, other scripts, ints
#: whose lock ids cover both signs of both halves, an empty key, a long one.
HOSTILE = [
    "k'; DROP TABLE inturn_latest; --",
    'q"uo\\te',
    b"\x00\xff\x00",
    "ключ-鍵-🔑",
    "",
    "x" * 5000,
    -1,
    2**70,
    *range(8),
]


async def test_bursts_on_many_hostile_keys_at_once_run_the_newest_of_each(
    made: PgProcesses,
) -> None:
    """Attack: bursts of two processes on many keys at once (quotes, SQL, NUL bytes, other
    scripts, huge and negative ints, an empty key), while one turn holds them all.
    Guarantee: on each key, once: the newest; the older callers answered None; nothing of
    any key is left."""
    keys = HOSTILE
    plain = made.plain("holder")
    older, newer = made.latest("older"), made.latest("newer")
    await warm(older, newer)
    held, gate = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with plain.keyed(*keys):
            held.set()
            await gate.wait()

    holding = asyncio.create_task(hold())
    await asyncio.wait_for(held.wait(), PATIENCE)
    ran: list[Any] = []

    def work(key: Any, name: str) -> Callable[[], Any]:
        async def run() -> str:
            ran.append((key, name))
            return name

        return run

    olds = [asyncio.create_task(older.run(key, work(key, "older"))) for key in keys]
    await settle(lambda: all(len(made.seen.posts(key)) == 1 for key in keys))
    news = [asyncio.create_task(newer.run(key, work(key, "newer"))) for key in keys]
    await settle(lambda: all(len(made.seen.posts(key)) == 2 for key in keys))
    gate.set()
    await asyncio.wait_for(holding, PATIENCE)
    assert await answered(*olds) == [None] * len(keys)
    assert await answered(*news) == ["newer"] * len(keys)
    assert sorted(map(repr, ran)) == sorted(repr((key, "newer")) for key in keys)
    assert await made.nothing_left(*keys)


async def test_a_late_call_is_answered_as_replaced_by_what_ran_before_it_reached_the_line(
    made: PgProcesses,
) -> None:
    """Attack: the older call is made, but its turn reaches the line only after a newer work
    of another process ran there and the line emptied (it waited for its process's only
    connection). Guarantee (docs/latest.md: PostgreSQL keeps what ran in its table): it is
    answered as replaced (None), its work never runs."""
    older = made.latest("older", options={"max_sessions": 1})
    newer = made.latest("newer")
    await warm(older, newer)
    ran = Runs()
    busy, free = asyncio.Event(), asyncio.Event()

    async def occupy() -> None:  # (the older process's only connection, on another key)
        async with older.keyed("x"):
            busy.set()
            await free.wait()

    occupying = asyncio.create_task(occupy())
    await asyncio.wait_for(busy.wait(), PATIENCE)
    late = asyncio.create_task(older.run("k", ran.work("older")))
    # its call is made, and its turn holds its process's line, waiting for the connection
    await settle(lambda: "'k': held" in repr(older))
    assert made.seen.posts() == {}  # (its turn is not in the key's line on the server)
    assert await asyncio.wait_for(newer.run("k", ran.work("newer")), PATIENCE) == "newer"
    await until(made.seen.ran, "what ran is recorded")
    free.set()
    await asyncio.wait_for(occupying, PATIENCE)
    assert await asyncio.wait_for(late, PATIENCE) is None
    assert ran == ["newer"]
    assert await made.nothing_left()


async def test_a_pool_of_one_session_serves_bursts_on_two_keys_without_deadlock(
    made: PgProcesses,
) -> None:
    """Attack: a process whose pool has one session (max_sessions=1) calls latest work on two
    keys held by another process, against a newer process's calls; its second key's turn
    waits for the session its first key's turn holds (waiting, then standing by).
    Guarantee: no deadlock; on each key the newest runs once; every caller is answered."""
    older = made.latest("older", options={"max_sessions": 1, "session_wait": PATIENCE})
    newer = made.latest("newer")
    await warm(older, newer)
    plain = made.plain("holder")
    held, gate = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        async with plain.keyed("k", "j"):
            held.set()
            await gate.wait()

    holding = asyncio.create_task(hold())
    await asyncio.wait_for(held.wait(), PATIENCE)
    ran = Runs()
    olds = [asyncio.create_task(older.run(key, ran.work(f"older {key}"))) for key in "kj"]
    await settle(lambda: len(made.seen.posts("k")) + len(made.seen.posts("j")) == 1)
    news = [asyncio.create_task(newer.run(key, ran.work(f"newer {key}"))) for key in "kj"]
    await settle(lambda: len(made.seen.posts("k")) + len(made.seen.posts("j")) == 3)
    gate.set()
    await asyncio.wait_for(holding, PATIENCE)
    assert await answered(*olds, *news) == [None, None, "newer k", "newer j"]
    assert sorted(ran) == ["newer j", "newer k"]
    assert await made.nothing_left("k", "j")


async def test_behind_pgbouncer_in_session_mode_a_burst_runs_the_newest_once(
    postgres_url: str, namespace: str
) -> None:
    """Guarantee: through a pooler in session mode (docs: supported; each server session is
    its client's, so the posts' sessions and their locks are the turns'), a burst of two
    processes runs once, the newest; the older caller is answered None; nothing is left on
    the server."""
    from support.pg_bouncer import bouncer

    with bouncer(postgres_url, "session") as url:
        made = PgProcesses(url, namespace)
        made.seen.close()
        made.seen = Seen(postgres_url, namespace, made.tag)  # (the server itself, from the side)
        try:
            holder = made.holder()
            await holder.hold()
            older, newer = made.latest("older"), made.latest("newer")
            ran = Runs()
            first = asyncio.create_task(older.run("k", ran.work("older")))
            await settle(lambda: len(made.seen.posts()) == 1)
            second = asyncio.create_task(newer.run("k", ran.work("newer")))
            await settle(lambda: len(made.seen.posts()) == 2)
            await holder.release()
            assert await answered(first, second) == [None, "newer"]
            assert ran == ["newer"]
            assert await made.nothing_left()
        finally:
            await made.close()


async def test_lines_show_the_running_latest_work_and_its_waiters_in_turn_order(
    made: PgProcesses,
) -> None:
    """Guarantee: lines() while latest turns run shows each turn in the key's line once (an
    intent lock is not a turn, nor is a fate lock), the runner as holder and the waiters in
    the server's order: a latest turn, then a plain turn; when latest work was called, for
    latest turns only. An older turn standing by behind the runner is not in the key's line
    (it waits for the runner's end, not for the key), and is not shown."""
    holder = made.holder()
    await holder.hold()
    older, newer, plain = made.latest("older"), made.latest("newer"), made.holder("plain")
    await warm(older, newer)
    ran: list[str] = []
    slow, started, go_on = await slow_work(ran, "newer")
    first = asyncio.create_task(older.run("k", Runs().work("older")))
    await settle(lambda: len(made.seen.posts()) == 1)
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: len(made.seen.posts()) == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    runner = one(made.seen.holders())
    await settle(lambda: len(made.seen.standbys()) == 1)
    standby = one(list(made.seen.standbys()))
    latest = made.latest("latest")
    await warm(latest)
    third = asyncio.create_task(latest.run("k", Runs().work("latest")))
    await settle(lambda: len(made.seen.waiting()) == 1)
    blocking = asyncio.create_task(plain.hold())
    await settle(lambda: len(made.seen.waiting()) == 2)
    waiter = one([pid for pid in made.seen.waiting() if made.seen.name_of(pid) == "latest"])
    behind = one([pid for pid in made.seen.waiting() if made.seen.name_of(pid) == "plain"])
    backend = plain.queue.backend
    assert isinstance(backend, PostgresBackend)
    (line,) = [line for line in await backend.lines() if line.key == "k"]
    assert line.holder is not None
    assert line.holder.server_pid == runner
    assert [waiter.server_pid for waiter in line.waiters] == [waiter, behind]
    assert standby not in [runner, waiter, behind]
    assert line.holder.latest_called is not None
    assert line.waiters[0].latest_called is not None
    assert line.waiters[1].latest_called is None
    go_on.set()
    assert await answered(first, second) == [None, "newer"]
    assert await asyncio.wait_for(third, PATIENCE) == "latest"
    await asyncio.wait_for(plain.held.wait(), PATIENCE)
    await plain.release()
    await asyncio.wait_for(blocking, PATIENCE)
    assert await made.nothing_left()


async def test_plain_turns_in_the_same_line_keep_their_places_and_run(made: PgProcesses) -> None:
    """Attack: plain turns between and behind latest ones. Guarantee: the plain turns run in
    their places; the latest work runs once, the newest, never in a plain turn's place."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest("older"), made.latest("newer", on_superseded="raise")
    plain_one, plain_two = made.plain("one"), made.plain("two")
    await warm(older, newer, plain_one, plain_two)
    order: list[str] = []

    def work(name: str) -> Callable[[], Any]:
        async def run() -> str:
            order.append(name)
            return name

        return run

    calls = [asyncio.create_task(older.run("k", work("older")))]
    await settle(lambda: len(made.seen.waiting()) == 1)
    calls.append(asyncio.create_task(plain_one.run("k", work("plain 1"))))
    await settle(lambda: len(made.seen.waiting()) == 2)
    calls.append(asyncio.create_task(newer.run("k", work("newer"))))
    await settle(lambda: len(made.seen.waiting()) == 3)
    calls.append(asyncio.create_task(plain_two.run("k", work("plain 2"))))
    await settle(lambda: len(made.seen.waiting()) == 4)
    await holder.release()
    assert await answered(*calls) == [None, "plain 1", "newer", "plain 2"]
    assert order == ["plain 1", "newer", "plain 2"]
    assert await made.nothing_left()


@pytest.mark.parametrize("cut", ["max_hold", "cancelled"])
@pytest.mark.parametrize("mode", ["join", "raise"])
async def test_the_newest_work_cut_while_it_runs(made: PgProcesses, mode: str, cut: str) -> None:
    """Attack: the newest work is cut as it runs, by max_hold or by its caller's
    cancellation. Guarantee (a work that started counts as run, and failed): the older
    caller elsewhere gets Superseded (join: "failed there"); nothing else runs."""
    from inturn import HoldTimeout

    holder = made.holder()
    await holder.hold()
    older = made.latest("older", on_superseded=mode)
    newer = made.latest("newer", max_hold=0.3) if cut == "max_hold" else made.latest("newer")
    await warm(older, newer)
    ran = Runs()
    started = asyncio.Event()

    async def endless() -> None:
        started.set()
        await asyncio.Event().wait()

    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: len(made.seen.posts()) == 1)
    second = asyncio.create_task(newer.run("k", endless))
    await settle(lambda: len(made.seen.posts()) == 2)
    await holder.release()
    if cut == "cancelled":
        await asyncio.wait_for(started.wait(), PATIENCE)
        second.cancel()
    with pytest.raises(HoldTimeout if cut == "max_hold" else asyncio.CancelledError):
        await asyncio.wait_for(second, PATIENCE)
    with pytest.raises(Superseded, match="failed there" if mode == "join" else None):
        await asyncio.wait_for(first, PATIENCE)
    assert ran == []
    assert await made.nothing_left()


async def test_closing_the_backend_while_its_turn_stands_by_lets_the_turn_end_cleanly(
    made: PgProcesses,
) -> None:
    """Attack: the backend of the older turn is closed (aclose: it closes the connections it
    keeps) while that turn stands by behind newer work that runs. Guarantee: the turn goes
    on to its end, is answered as replaced (None: the newer work returned), and its
    connection is closed then (its session ends, with whatever it held); the newer work is
    undisturbed; nothing is left."""
    holder = made.holder()
    await holder.hold()
    older, newer = made.latest("older"), made.latest("newer")
    await warm(older, newer)
    ran: list[str] = []
    slow, started, go_on = await slow_work(ran, "newer")
    first = asyncio.create_task(older.run("k", Runs().work("older")))
    await settle(lambda: len(made.seen.posts()) == 1)
    second = asyncio.create_task(newer.run("k", slow))
    await settle(lambda: len(made.seen.posts()) == 2)
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    runner = one(made.seen.holders())
    await settle(lambda: len(made.seen.standbys()) == 1)
    pid = one(list(made.seen.standbys()))
    closed = older.backend
    assert isinstance(closed, PostgresBackend)
    await asyncio.wait_for(closed.aclose(), PATIENCE)
    assert made.seen.standbys() == {pid: runner}  # (it waits on: aclose ends no turn)
    assert made.seen.posts().get(pid) is True
    go_on.set()
    assert await answered(first, second) == [None, "newer"]
    await until(lambda: not made.seen.alive(pid), "its connection is closed at its end")
    assert ran == ["newer"]
    assert await made.nothing_left()


# -- 10. standing by ----------------------------------------------------------------------


async def test_several_standbys_behind_one_target_are_all_answered_when_it_runs(
    made: PgProcesses, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack: three older processes' turns judge, one after the other, with the newest
    work (another process's) waiting behind them: each stands by behind it. Guarantee: the
    newest runs once; when it ends, every standby is answered (None: it returned) at once,
    without taking the key again (each judges twice: granted, then woken); nothing is
    left."""
    judged = Judged(monkeypatch)
    holder = made.holder()
    await holder.hold()
    olders = [made.latest(f"older{n}") for n in range(3)]
    newest = made.latest("newest")
    await warm(*olders, newest)
    ran: list[str] = []
    slow, started, go_on = await slow_work(ran, "newest")
    calls = []
    for n, queue in enumerate(olders):
        calls.append(asyncio.create_task(queue.run("k", Runs().work(f"older{n}"))))
        posted = n + 1
        await settle(lambda: len(made.seen.posts()) == posted)  # noqa: B023 (awaited here)
    pids = [one(made.seen.sessions(f"older{n}")) for n in range(3)]
    last = asyncio.create_task(newest.run("k", slow))
    await settle(lambda: len(made.seen.posts()) == 4 and len(made.seen.waiting()) == 4)
    judged.clear()
    await holder.release()
    await asyncio.wait_for(started.wait(), PATIENCE)
    runner = one(made.seen.holders())
    assert made.seen.name_of(runner) == "newest"
    await settle(lambda: made.seen.standbys() == dict.fromkeys(pids, runner))
    assert made.seen.waiting() == []
    go_on.set()
    assert await answered(*calls, last) == [None, None, None, "newest"]
    assert ran == ["newest"]
    assert len(judged) == 2 * len(olders) + 1, len(judged)
    assert await made.nothing_left()


@pytest.mark.parametrize("gives_up", ["timed out", "cancelled"])
async def test_the_target_giving_up_wakes_its_standbys_and_the_newest_of_them_runs_once(
    made: PgProcesses, gives_up: str
) -> None:
    """Attack: two older processes' turns stand by behind the newest work, which waits in
    line (a plain turn holds the key); its caller gives up (its timeout runs out, or it is
    cancelled) before it runs. Guarantee: its caller gets TimeoutError or its cancellation
    (its work did not run); the standbys wake and, as it did not run, join again: the newest
    of them in line, the older standing by behind it; that work runs once, after the plain
    turn; the older caller is answered None; nothing is left."""
    holder = made.holder()
    await holder.hold()
    a, b, plain = made.latest("a"), made.latest("b"), made.holder("plain")
    target = made.latest("target", timeout=2.0 if gives_up == "timed out" else None)
    await warm(a, b, target)
    ran = Runs()
    a0 = asyncio.create_task(a.run("k", ran.work("a")))
    await settle(lambda: len(made.seen.posts()) == 1)
    b0 = asyncio.create_task(b.run("k", ran.work("b")))
    await settle(lambda: len(made.seen.posts()) == 2)
    a_pid, b_pid = one(made.seen.sessions("a")), one(made.seen.sessions("b"))
    blocking = asyncio.create_task(plain.hold())
    await settle(lambda: len(made.seen.waiting()) == 3)
    began = time.monotonic()
    t0 = asyncio.create_task(target.run("k", ran.work("target")))
    await settle(lambda: len(made.seen.posts()) == 3 and len(made.seen.waiting()) == 4)
    t_pid = one(made.seen.sessions("target"))
    holder.gate.set()
    await asyncio.wait_for(plain.held.wait(), PATIENCE)
    await settle(lambda: made.seen.standbys() == {a_pid: t_pid, b_pid: t_pid})
    assert made.seen.waiting() == [t_pid]
    assert time.monotonic() - began < 2.0, "too slow a machine to reach the stage in time"
    if gives_up == "cancelled":
        t0.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(t0, PATIENCE)
    else:
        with pytest.raises(TimeoutError, match="the work did not run"):
            await asyncio.wait_for(t0, PATIENCE)
    await until(
        lambda: made.seen.waiting() == [b_pid] and made.seen.standbys() == {a_pid: b_pid},
        "the standbys woke, the newest of them in line again",
    )
    assert made.seen.holds_nothing(t_pid)
    await plain.release()
    await asyncio.wait_for(blocking, PATIENCE)
    await holder.release()
    assert await answered(a0, b0) == [None, "b"]
    assert ran == ["b"]
    assert await made.nothing_left()
