"""The PostgreSQL backend through a stalled network or server (issue 28, points 3 and 4).

A turn's ``timeout`` holds whatever the network or the server does: past it
(plus MARGIN) the turn raises TimeoutError and its work never runs, also not
once the network comes back. Without a timeout, a stall surfaces as
BackendUnavailable within two ``unreachable_after`` plus MARGIN: a wait unanswered that
long is checked on a new connection, which must answer within
``unreachable_after`` (a wait for a key held long by another process is not
failed: the check finds the server alive). Readying a new connection is
bounded the same way, leaving a block too (the turn raises LeaseLost: it
could not confirm its keys were held), and cancelling a task's wait ends
within MARGIN.

The partition is :class:`faults.Proxy` between the backend under test and
the session's server: frozen, no byte flows either way and new connections
get no answer. (The proxy passes on a close at once, frozen or not: the
server sees a connection the backend closes end, as it would once TCP gives
up on a real partition.) The holder of a key, and the test's admin session,
reach the server directly. Every session is named (``application_name``) so
that the test tells the backend's sessions apart on the server.

Orderings come from checkpoints on the server's state (a session waiting in
``pg_locks``), never from sleeps; the real waits are timeouts meant to run
out. Bounds are generous (SLACK) on top of each promised one, for a loaded
2-core machine, and never a lower bound. A test measures from the moment
the fault began, and lets the network flow again before it looks at what
became of the turn, so that the work of a turn that outlived its bound
(which 093c37a does) shows whether it ran when the partition healed.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

psycopg = pytest.importorskip("psycopg")

from psycopg.conninfo import conninfo_to_dict, make_conninfo  # noqa: E402

from inturn import BackendUnavailable, KeyedQueue, LeaseLost  # noqa: E402
from inturn.backends.postgres import PostgresBackend  # noqa: E402

from support.faults import Proxy  # noqa: E402
from support.helpers import PATIENCE  # noqa: E402

pytestmark = pytest.mark.server

#: The backend's ``unreachable_after`` in these tests (short, to keep them short).
UNREACHABLE = 1.0

#: What a turn may take past its timeout, whatever the network does (the promise).
MARGIN = 1.0

#: libpq's shortest ``connect_timeout``: a thread's new connection to a server that
#: does not answer may take this long, even when less is left.
CONNECT_FLOOR = 2.0

#: Room on top of each promised bound for a loaded 2-core machine.
SLACK = 4.0

#: How long a lock's release, or a session's end, may take to show on the server.
PROMPTLY = 5.0

MODES = ["task", "thread"]


def margin(mode: str) -> float:
    """What a turn in mode may take past its timeout: MARGIN, or libpq's floor for a
    thread (its cancel, or a check, opens a new connection)."""
    return MARGIN if mode == "task" else max(MARGIN, CONNECT_FLOOR)


class Attempt:
    """One turn on one key, taken in a task or in a thread of its own (no event loop there).

    ``entered`` is set once its block began (``ran``); with ``hold``, the
    block waits for :meth:`let_go`. ``done`` is a future of this loop,
    settled with the turn's outcome; ``ended`` is when the turn's call
    returned or raised (``time.monotonic()``).
    """

    def __init__(
        self, mode: str, queue: KeyedQueue, key: str, *, timeout: float | None, hold: bool
    ) -> None:
        self._queue, self._key, self._timeout = queue, key, timeout
        self._loop = asyncio.get_running_loop()
        self.entered = asyncio.Event()
        self.ran = False
        self.ended: float | None = None
        self._go = threading.Event()
        self._go_async = asyncio.Event()
        if not hold:
            self.let_go()
        self.done: asyncio.Future[None]
        if mode == "task":
            self.done = asyncio.ensure_future(self._in_task())
        else:
            self.done = self._loop.create_future()
            threading.Thread(target=self._in_thread, name=f"turn-{key}", daemon=True).start()

    async def _in_task(self) -> None:
        try:
            async with self._queue.keyed(self._key, timeout=self._timeout):
                self.ran = True
                self.entered.set()
                await self._go_async.wait()
        finally:
            self.ended = time.monotonic()

    def _in_thread(self) -> None:
        outcome: BaseException | None = None
        try:
            with self._queue.keyed(self._key, timeout=self._timeout):
                self.ran = True
                self._loop.call_soon_threadsafe(self.entered.set)
                self._go.wait(PATIENCE)
        except BaseException as error:
            outcome = error
        finally:
            self.ended = time.monotonic()
        try:
            self._loop.call_soon_threadsafe(_settle, self.done, outcome)
        except RuntimeError:
            pass  # the test's loop is closed: it gave up on this turn long ago

    def let_go(self) -> None:
        """Let the block end (it returns at once if the turn never entered it)."""
        self._go.set()
        self._go_async.set()

    async def ends_within(self, bound: float, since: float) -> float | None:
        """Wait until the turn ended, bound seconds after since at most; how long it took
        (None: it had not ended by then)."""
        left = max(0.0, since + bound - time.monotonic())
        await asyncio.wait((self.done,), timeout=left)
        ended = self.ended
        if ended is None or ended - since > bound:
            return None
        return ended - since

    async def finish(self) -> None:
        """Let the turn end (its block, or a wait the healed network answers), PATIENCE at most."""
        self.let_go()
        await asyncio.wait((self.done,), timeout=PATIENCE)
        if self.done.done() and not self.done.cancelled():
            self.done.exception()  # (retrieved: the test looks at it through error)

    @property
    def error(self) -> BaseException | None:
        """What the turn raised (the turn ended)."""
        if self.done.cancelled():
            return asyncio.CancelledError()
        return self.done.exception() if self.done.done() else None


def _settle(done: asyncio.Future[None], error: BaseException | None) -> None:
    if done.done():
        return
    if error is None:
        done.set_result(None)
    else:
        done.set_exception(error)


def took(seconds: float | None, bound: float) -> str:
    """How long a turn took, for a failure's message."""
    if seconds is None:
        return f"had not ended after {bound:g} s"
    return f"ended after {seconds:.1f} s (bound {bound:g} s)"


class Net:
    """The session's server as this test sees it: a proxy before it, and an admin session.

    The sessions this test opens are named ``TAG-name`` on the server, and
    its lines are in namespace TAG.
    """

    def __init__(self, url: str, admin: Any, proxy: Proxy) -> None:
        self.url = url
        self.admin = admin
        self.proxy = proxy
        self.tag = f"pgp{uuid.uuid4().hex[:10]}"
        self.backends: list[PostgresBackend] = []
        self.attempts: list[Attempt] = []

    def conninfo(self, name: str, *, proxied: bool) -> str:
        """Where sessions named ``TAG-name`` connect: through the proxy, or straight."""
        through = {"host": "127.0.0.1", "port": str(self.proxy.port)} if proxied else {}
        return make_conninfo(self.url, application_name=f"{self.tag}-{name}", **through)

    def queue(self, name: str, *, proxied: bool = True, **options: Any) -> KeyedQueue:
        """A queue on a backend of its own, whose sessions are named ``TAG-name``."""
        backend = PostgresBackend(
            self.conninfo(name, proxied=proxied), namespace=self.tag, **options
        )
        self.backends.append(backend)
        return KeyedQueue(backend=backend)

    def attempt(
        self,
        mode: str,
        queue: KeyedQueue,
        key: str,
        *,
        timeout: float | None = None,
        hold: bool = False,
    ) -> Attempt:
        made = Attempt(mode, queue, key, timeout=timeout, hold=hold)
        self.attempts.append(made)
        return made

    async def warm(self, queue: KeyedQueue, mode: str, key: str = "warm-up") -> None:
        """One turn on key in mode (a task, or a thread), so that a connection is kept for
        the next (and key's name recorded: its next turn's first statement is its wait)."""
        if mode == "task":
            await asyncio.wait_for(queue.run(key, lambda: None), PATIENCE)
        else:
            await asyncio.wait_for(asyncio.to_thread(queue.run_sync, key, lambda: None), PATIENCE)

    async def hold(self, key: str) -> Attempt:
        """A task holds key through a backend that reaches the server straight, until let go."""
        holder = self.attempt("task", self.queue("holder", proxied=False), key, hold=True)
        await asyncio.wait_for(holder.entered.wait(), PATIENCE)
        return holder

    async def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        cursor = await self.admin.execute(sql, params)
        return list(await cursor.fetchall())

    async def locks(self, name: str) -> list[bool]:
        """The advisory locks of the sessions named ``TAG-name``: granted or not, each."""
        rows = await self.rows(
            "SELECT l.granted FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND a.application_name = %s ORDER BY 1",
            f"{self.tag}-{name}",
        )
        return [bool(granted) for (granted,) in rows]

    async def locks_left(self, name: str) -> list[bool]:
        """locks(name): none, or those still there after PROMPTLY (a release may be in flight)."""
        deadline = time.monotonic() + PROMPTLY
        while True:
            left = await self.locks(name)
            if not left or time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.01)

    async def until_waiting(self, name: str, attempt: Attempt) -> None:
        """Wait until a session named ``TAG-name`` waits for an advisory lock on the server."""
        deadline = time.monotonic() + PATIENCE
        while await self.locks(name) != [False]:
            assert not attempt.done.done(), f"the turn ended before it waited: {attempt.error!r}"
            assert time.monotonic() < deadline, f"{name} never waited for its key"
            await asyncio.sleep(0.002)

    async def healed(self) -> None:
        """Let the network flow; return once what the partition held has reached the server.

        The proxy passes on what it held in its first round after the thaw; a
        new connection through it, which takes it several rounds, comes after.
        """
        self.proxy.thaw()
        probe = await psycopg.AsyncConnection.connect(
            self.conninfo("probe", proxied=True), autocommit=True, connect_timeout=10
        )
        async with probe:
            await probe.execute("SELECT 1")

    async def aclose(self) -> None:
        self.proxy.thaw()
        for attempt in self.attempts:
            await attempt.finish()
        for backend in self.backends:
            await asyncio.wait_for(backend.aclose(), PATIENCE)


@pytest.fixture
async def net(postgres_url: str) -> AsyncIterator[Net]:
    port = int(conninfo_to_dict(postgres_url).get("port") or 5432)
    proxy = Proxy(port).start()
    try:
        async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as admin:
            made = Net(postgres_url, admin, proxy)
            try:
                yield made
            finally:
                await made.aclose()
    finally:
        proxy.close()


# -- 3. a timeout, whatever the network does ---------------------------------------------


#: A turn with timeout=2.0 whose wait PostgreSQL did not answer (before issue 31: "the turn
#: for key 'k' (no answer from PostgreSQL) was not reached within 1.99... s", the time left).
_NO_ANSWER = (
    "inturn: the turn for key 'k' was not reached within 2 s: it was waiting for an answer "
    "from PostgreSQL; the work did not run. Check the network and the server"
)


async def timed_out_through_a_partition(
    net: Net, mode: str, queue: KeyedQueue, holder: Attempt | None = None
) -> str:
    """A turn on "k" (timeout 2 s) in mode, sent once the network froze: that it ended in
    time with a TimeoutError, its work never run (the network healed, holder let go), and
    nothing of "p" still held. Its error's words."""
    began = time.monotonic()
    net.proxy.freeze()
    turn = net.attempt(mode, queue, "k", timeout=2.0)
    bound = 2.0 + margin(mode) + SLACK
    seconds = await turn.ends_within(bound, began)
    await net.healed()
    if holder is not None:
        holder.let_go()
    await turn.finish()
    outcome = {
        "ended in time": seconds is not None,
        "raised TimeoutError": isinstance(turn.error, TimeoutError),
        "work ran": turn.ran,
    }
    expected = {"ended in time": True, "raised TimeoutError": True, "work ran": False}
    assert outcome == expected, f"{took(seconds, bound)}; in the end: {turn.error!r}"
    assert await net.locks_left("p") == []
    return str(turn.error)


@pytest.mark.parametrize("mode", MODES)
async def test_a_timed_wait_through_a_partition_ends_in_time_and_its_work_never_runs(
    net: Net, mode: str
) -> None:
    # 093c37a (run without unreachable_after): the wait statement goes out on the
    # kept connection and nothing answers; the client waits for the answer with no
    # deadline of its own (a task and a thread alike), so the turn had not ended 7 s
    # later (8 s for a thread). Once the network came back, the wait reached the
    # server with its lock_timeout still whole, got the key when the holder let go,
    # and the work ran.
    queue = net.queue("p", unreachable_after=UNREACHABLE)
    await net.warm(queue, mode, "k")  # the turn's connection is a kept one
    holder = await net.hold("k")
    said = await timed_out_through_a_partition(net, mode, queue, holder)
    assert said == _NO_ANSWER  # (issue 31: the cause, and the limit given)


@pytest.mark.parametrize("mode", MODES)
async def test_a_timed_wait_for_a_free_key_through_a_partition_ends_in_time(
    net: Net, mode: str
) -> None:
    # 093c37a: as above; the key being free, the wait held by the partition got it
    # the moment it reached the server, and the work ran after the thaw.
    queue = net.queue("p", unreachable_after=UNREACHABLE)
    other = net.queue("other", proxied=False)
    await net.warm(queue, mode, "k")  # (then the wait statement is the first one cut)
    said = await timed_out_through_a_partition(net, mode, queue)
    assert said == _NO_ANSWER  # (issue 31: the cause, and the limit given)
    async with other.keyed("k", timeout=PROMPTLY):  # what reached the server late let go
        pass


@pytest.mark.parametrize("mode", MODES)
async def test_a_first_turn_on_a_key_through_a_partition_ends_in_time(net: Net, mode: str) -> None:
    # A process's first turn on a key records the key's name (for lines()) in the round
    # trip of its wait (issue 45; before, in a round trip of its own, whose error named
    # it): a partition there is bounded by the turn's timeout as any wait is.
    queue = net.queue("p", unreachable_after=UNREACHABLE)
    await net.warm(queue, mode)  # (a kept connection; "k" is new to this process)
    said = await timed_out_through_a_partition(net, mode, queue)
    assert said == _NO_ANSWER


@pytest.mark.parametrize("mode", MODES)
async def test_a_wait_without_timeout_through_a_partition_raises_backend_unavailable(
    net: Net, mode: str
) -> None:
    # 093c37a (run without unreachable_after): the waiter waits for the server's
    # answer for ever; 7 s after the freeze it had not ended. When the network came
    # back and the holder let go, it got the key and the work ran.
    queue = net.queue("p", unreachable_after=UNREACHABLE)
    holder = await net.hold("k")
    turn = net.attempt(mode, queue, "k")
    await net.until_waiting("p", turn)  # the wait is in the server's queue
    began = time.monotonic()
    net.proxy.freeze()
    # the next check of the wait comes within unreachable_after; its new connection
    # must answer within unreachable_after (a thread's: libpq's floor)
    bound = UNREACHABLE + max(UNREACHABLE, CONNECT_FLOOR) + MARGIN + SLACK
    seconds = await turn.ends_within(bound, began)
    await net.healed()
    holder.let_go()
    await turn.finish()
    outcome = {
        "ended in time": seconds is not None,
        "raised BackendUnavailable": isinstance(turn.error, BackendUnavailable),
        "work ran": turn.ran,
    }
    expected = {"ended in time": True, "raised BackendUnavailable": True, "work ran": False}
    assert outcome == expected, f"{took(seconds, bound)}; in the end: {turn.error!r}"
    assert await net.locks_left("p") == []


@pytest.mark.parametrize("mode", MODES)
async def test_a_grant_whose_answer_never_comes_is_given_up_and_its_key_freed(
    net: Net, mode: str
) -> None:
    # Only the server's replies are lost: the waiter's session gets the lock and
    # its statement ends, but the answer never reaches the client. The check must
    # not take "the session is there" for "the wait goes on": the session is idle,
    # holding a lock no turn will use. The wait is given up (BackendUnavailable, the
    # work never runs) and its connection closed, which frees the key at once.
    queue = net.queue("p", unreachable_after=UNREACHABLE)
    holder = await net.hold("k")
    turn = net.attempt(mode, queue, "k")
    await net.until_waiting("p", turn)
    began = time.monotonic()
    net.proxy.hold_replies()
    holder.let_go()  # the waiter's session is granted the key; its answer is held
    bound = UNREACHABLE + max(UNREACHABLE, CONNECT_FLOOR) + MARGIN + SLACK
    seconds = await turn.ends_within(bound, began)
    outcome = {
        "ended in time": seconds is not None,
        "raised BackendUnavailable": isinstance(turn.error, BackendUnavailable),
        "work ran": turn.ran,
    }
    expected = {"ended in time": True, "raised BackendUnavailable": True, "work ran": False}
    assert outcome == expected, f"{took(seconds, bound)}; in the end: {turn.error!r}"
    assert await net.locks_left("p") == []  # (the replies still held: freed by the close)


@pytest.mark.parametrize("mode", MODES)
async def test_a_wait_for_a_key_held_long_is_not_failed_by_the_check(net: Net, mode: str) -> None:
    # The control of the test above: the network flows, the key is held by another
    # process for three unreachable_after; the checks find the server alive and the
    # session waiting, and the waiter gets the key when it comes free.
    # (093c37a, run without unreachable_after, passes: it never checks.)
    queue = net.queue("p", unreachable_after=UNREACHABLE)
    holder = await net.hold("k")
    turn = net.attempt(mode, queue, "k")
    await net.until_waiting("p", turn)
    await asyncio.sleep(3 * UNREACHABLE)  # a real wait: the checks of the wait run meanwhile
    assert not turn.done.done(), f"a wait for a held key was failed: {turn.error!r}"
    assert await net.locks("p") == [False]  # still in the server's queue
    holder.let_go()
    await asyncio.wait_for(turn.entered.wait(), PATIENCE)
    await turn.finish()
    assert turn.error is None
    assert await net.locks_left("p") == []


# -- 3. readying a new connection ------------------------------------------------------


@pytest.fixture
async def own_database(postgres_url: str) -> AsyncIterator[str]:
    """A database of the test's own (no sequence of tokens in it yet); its conninfo."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    async with await psycopg.AsyncConnection.connect(postgres_url, autocommit=True) as root:
        await root.execute(f"CREATE DATABASE {name}")
        try:
            yield make_conninfo(postgres_url, dbname=name)
        finally:
            await root.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@pytest.mark.parametrize("mode", MODES)
async def test_readying_a_connection_held_up_by_uncommitted_ddl_is_bounded(
    own_database: str, mode: str
) -> None:
    # A DBA's CREATE SEQUENCE inturn_token, not committed: a new connection's
    # readying finds no sequence and its CREATE SEQUENCE IF NOT EXISTS waits for
    # the DBA's transaction. 093c37a (run without unreachable_after): readying has
    # no deadline, in a task or a thread: the timeout=1 turn had not ended 6 s
    # later, the turn without a timeout not 5 s later; both ran their work once
    # the DBA rolled back.
    backends: list[PostgresBackend] = []
    attempts: list[Attempt] = []

    def fresh(name: str) -> KeyedQueue:
        conninfo = make_conninfo(own_database, application_name=name)
        backend = PostgresBackend(conninfo, namespace="ddl", unreachable_after=UNREACHABLE)
        backends.append(backend)
        return KeyedQueue(backend=backend)

    async with await psycopg.AsyncConnection.connect(own_database) as dba:
        try:
            await dba.execute("CREATE SEQUENCE inturn_token")  # (its transaction stays open)
            timed, untimed = fresh("timed"), fresh("untimed")
            began = time.monotonic()
            attempts.append(first := Attempt(mode, timed, "k", timeout=1.0, hold=False))
            bound = 1.0 + MARGIN + SLACK
            seconds = await first.ends_within(bound, began)
            began = time.monotonic()
            attempts.append(second := Attempt(mode, untimed, "k", timeout=None, hold=False))
            untimed_bound = UNREACHABLE + SLACK
            untimed_seconds = await second.ends_within(untimed_bound, began)
            await dba.rollback()
            for attempt in attempts:
                await attempt.finish()
            outcome = {
                "timed: ended in time": seconds is not None,
                "timed: raised TimeoutError": isinstance(first.error, TimeoutError),
                "untimed: ended in time": untimed_seconds is not None,
                "untimed: raised BackendUnavailable": isinstance(second.error, BackendUnavailable),
                "work ran": first.ran or second.ran,
            }
            expected = {
                "timed: ended in time": True,
                "timed: raised TimeoutError": True,
                "untimed: ended in time": True,
                "untimed: raised BackendUnavailable": True,
                "work ran": False,
            }
            assert outcome == expected, (
                f"timed: {took(seconds, bound)}; in the end: {first.error!r}; untimed: "
                f"{took(untimed_seconds, untimed_bound)}; in the end: {second.error!r}"
            )
            # once the DDL is gone, the same backends take turns
            for queue in (timed, untimed):
                attempt = Attempt(mode, queue, "k", timeout=PATIENCE, hold=False)
                attempts.append(attempt)
                await asyncio.wait_for(asyncio.shield(attempt.done), PATIENCE)
                assert attempt.ran
        finally:
            await dba.rollback()
            for attempt in attempts:
                await attempt.finish()
            for backend in backends:
                await asyncio.wait_for(backend.aclose(), PATIENCE)


# -- 4. leaving a block --------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_leaving_a_block_through_a_partition_raises_lease_lost_in_time(
    net: Net, mode: str
) -> None:
    # 093c37a: a task's unlock is settled only by the server's answer, so leaving
    # the block had not ended 5 s after the freeze (it ended with the thaw, with no
    # error); a thread's unlock waited 10 s (its CONNECT_WAIT), then closed the
    # connection and ended with no error: keys it could not confirm counted as held.
    queue = net.queue("p", unreachable_after=UNREACHABLE)
    other = net.queue("other", proxied=False)
    turn = net.attempt(mode, queue, "k", hold=True)
    await asyncio.wait_for(turn.entered.wait(), PATIENCE)
    net.proxy.freeze()
    began = time.monotonic()
    turn.let_go()  # the work ends: the turn's keys are unlocked
    bound = UNREACHABLE + SLACK
    seconds = await turn.ends_within(bound, began)
    await net.healed()
    await turn.finish()
    outcome = {
        "ended in time": seconds is not None,
        "raised LeaseLost": isinstance(turn.error, LeaseLost),
    }
    expected = {"ended in time": True, "raised LeaseLost": True}
    assert outcome == expected, f"{took(seconds, bound)}; in the end: {turn.error!r}"
    # the backend closed the connection: the server freed the key
    async with other.keyed("k", timeout=PROMPTLY):
        pass
    assert await net.locks_left("p") == []


# -- 3. cancelling a wait -----------------------------------------------------------------


async def test_cancelling_a_wait_through_a_partition_ends_at_once(net: Net) -> None:
    # 093c37a: the cancelled wait sends the server a cancel request on a new
    # connection (no answer through the partition: 10 s), then waits 10 s more for
    # the wait's answer before it closes the connection: the task ended about 20 s
    # after it was cancelled.
    queue = net.queue("p", unreachable_after=UNREACHABLE)
    holder = await net.hold("k")
    turn = net.attempt("task", queue, "k")
    await net.until_waiting("p", turn)
    net.proxy.freeze()
    began = time.monotonic()
    turn.done.cancel()
    bound = MARGIN + SLACK
    seconds = await turn.ends_within(bound, began)
    await net.healed()
    holder.let_go()
    await turn.finish()
    outcome = {
        "ended in time": seconds is not None,
        "cancelled": turn.done.cancelled(),
        "work ran": turn.ran,
    }
    expected = {"ended in time": True, "cancelled": True, "work ran": False}
    assert outcome == expected, f"{took(seconds, bound)}; in the end: {turn.error!r}"
    # the server dropped the cancelled wait: no lock of it, waiting or granted
    assert await net.locks_left("p") == []
