"""The Redis backend through faults: forks, partitions, frozen and restarted servers, refusals.

Every test here brings a fault about on purpose, against a real server of
its own (``own_redis``), through a real TCP proxy (tests/support/faults.py) or in
real processes, and checks the backend's promises through it:

- never two holders while both leases are valid;
- nothing hangs: every call ends within its ``timeout``, and without one a
  waiter whose place is lost, or whose process cannot reach Redis for longer
  than its lease, ends with ``BackendUnavailable`` within about one lease;
- errors tell the truth: ``BackendUnavailable`` (the work did not run),
  ``LeaseLost`` (it ran; the lease may have lapsed), never a raw redis-py
  error or a ``KeyError``; refusals (permissions, memory, credentials) are
  named as such.

Leases are short (LEASE) so that a test that waits for one to run out
finishes in seconds; bounds on how long something may take are generous,
for a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import ConnectionError as RedisConnectionError

from inturn import BackendUnavailable, KeyedQueue, LeaseLost, Turn
from inturn.backends.redis import RedisBackend, _takeover, _wire

from support.faults import Proxy
from support.helpers import PATIENCE, settle
from support.latest_across import crashes_at_every_step
from support.processes import Worker
from support.redis_checks import BackendFactory, hand_over, waiting
from support.servers import SentinelSetup, Server

#: A short lease: a lost one shows within a test.
LEASE = 1.0
#: How long past its bound a call may take on a loaded machine before it counts as hanging.
SLACK = 3.0


@pytest.fixture
def proxy(own_redis: Server) -> Iterator[Proxy]:
    """A proxy in front of this test's own server."""
    proxy = Proxy(own_redis.port).start()
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
async def server(own_redis: Server) -> AsyncIterator[aioredis.Redis]:
    """A plain client of this test's own server, to change it from the side."""
    client = aioredis.Redis.from_url(own_redis.url)
    yield client
    await client.aclose()


@pytest.fixture
async def make_backend(own_redis: Server, namespace: str) -> AsyncIterator[BackendFactory]:
    """RedisBackend(url, ...) for this test (own_redis's by default); all closed at its end."""
    made: list[RedisBackend] = []

    def make(*, url: str | None = None, lease: float = LEASE, **options: Any) -> RedisBackend:
        made.append(
            RedisBackend.from_url(url or own_redis.url, namespace=namespace, lease=lease, **options)
        )
        return made[-1]

    yield make
    for backend in made:
        await asyncio.wait_for(backend.aclose(), PATIENCE)


async def held(queue: KeyedQueue, key: str, gate: asyncio.Event) -> asyncio.Task[Any]:
    """A task that holds key on queue until gate is set; returned once it holds."""
    holding = asyncio.Event()

    async def hold() -> None:
        holding.set()
        await gate.wait()

    task = asyncio.create_task(queue.run(key, hold))
    await asyncio.wait_for(holding.wait(), PATIENCE)
    return task


async def within(seconds: float, awaitable: Any) -> Any:
    """Await awaitable; fail the test if it takes longer than seconds (plus SLACK)."""
    return await asyncio.wait_for(awaitable, seconds + SLACK)


# -- fork ----------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["before", "after"])
async def test_forked_workers_each_get_their_own_place_in_line(
    own_redis: Server,
    server: aioredis.Redis,
    namespace: str,
    workers: list[Worker],
    when: str,
) -> None:
    # A queue made at module level, before the fork (gunicorn --preload,
    # Celery prefork, multiprocessing's fork): 4 children and the parent
    # each do 100 read-modify-writes of one Redis counter under one key.
    counter = f"counter-{namespace}"
    spec = f"redis:{own_redis.url}#{namespace}#{LEASE}"
    worker = await Worker.start(spec, "fork-increment", "k", counter, "100", "4", when)
    workers.append(worker)
    assert await worker.expect("done") == ["-"]  # no error in any process
    assert await worker.finish() == 0
    assert int(await server.get(counter)) == 500


@pytest.mark.parametrize("mode", ["task", "thread"])
def test_a_long_lived_forked_child_keeps_none_of_its_parents_connections(
    own_redis: Server, namespace: str, mode: str
) -> None:
    """Issue 42: a child forked while its parent's backend has connections (its event loop's,
    or its threads': the backend loop's, and a thread's own) inherits their sockets. It
    closes its copies at once: when the parent closes the backend, Redis sees those
    connections end then, not when the last child exits."""
    # Before the fix, the child kept its copies of the backend loop's (or the parent's
    # loop's) link and subscription open: the server listed them until the child exited.
    backend = RedisBackend.from_url(own_redis.url, namespace=namespace)
    queue = KeyedQueue(backend=backend)
    admin = redis.Redis.from_url(own_redis.url)
    loop = asyncio.new_event_loop()  # (the parent's loop lives across the fork: a server's)

    def clients() -> int:
        return len(admin.client_list()) - 1  # (but the admin's own)

    try:
        if mode == "task":
            loop.run_until_complete(queue.run("k", lambda: None))
        else:
            queue.run_sync("k", lambda: None)
        assert clients() >= 2  # (a link and a subscription, at least)
        go, gone = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # (fork with threads)
            child = os.fork()
        if child == 0:  # pragma: no cover - the child: lives until the test ends
            os.close(gone)
            os.read(go, 1)
            os._exit(0)
        os.close(go)
        try:
            if mode == "task":
                loop.run_until_complete(backend.aclose())
            else:
                asyncio.run(backend.aclose())
            deadline = time.monotonic() + PATIENCE
            while clients() > 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # (polls the server for a state)
            assert clients() == 0, admin.client_list()
        finally:
            os.close(gone)
            os.waitpid(child, 0)
    finally:
        loop.close()
        admin.close()


# -- the heartbeat -----------------------------------------------------------------------


async def test_the_heartbeat_lives_through_error_replies(
    make_backend: BackendFactory,
    server: aioredis.Redis,
    own_redis: Server,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Another app's slow script makes Redis answer -BUSY to everything for a
    # while; the renewals fail, then succeed again, well within the lease.
    await server.config_set("busy-reply-threshold", 50)
    lease = 2.0
    a, b = make_backend(lease=lease), make_backend(lease=lease)
    gate = asyncio.Event()
    holder = await held(KeyedQueue(backend=a), "k", gate)
    ran: list[str] = []
    follower = asyncio.create_task(KeyedQueue(backend=b).run("k", ran.append, "b"))
    await waiting(a, 1)
    slow = aioredis.Redis.from_url(own_redis.url)
    script = asyncio.create_task(slow.eval("while true do end", 0))
    try:
        await settle(lambda: "busy running another client's script" in caplog.text)
    finally:
        killer = aioredis.Redis.from_url(own_redis.url)
        await killer.script_kill()
        await killer.aclose()
        with pytest.raises(Exception, match="Script killed"):
            await script
        await slow.aclose()
    # The leases would run out while the holder holds: only renewals keep both in line.
    await asyncio.sleep(lease * 1.5)  # the span of time is the point here, not an ordering
    gate.set()
    await within(lease, holder)  # no LeaseLost: the heartbeat renewed it
    await within(lease, follower)  # and the waiter kept its place
    assert ran == ["b"]


# -- timeouts cover everything ------------------------------------------------------------


async def test_a_timeout_covers_connecting_and_enqueueing(
    make_backend: BackendFactory, proxy: Proxy
) -> None:
    queue = KeyedQueue(backend=make_backend(url=proxy.url), timeout=0.5)
    proxy.freeze()  # a partition: nothing comes back, not even the connection's greeting
    ran: list[str] = []
    with pytest.raises(TimeoutError, match=r"0\.5 s: it was waiting for an answer from Redis \("):
        await within(0.5, queue.run("k", ran.append, "ran"))
    assert ran == []
    proxy.thaw()  # connected now, and then the partition: the enqueue gets no answer
    await queue.run("warm", lambda: None)
    proxy.freeze()
    with pytest.raises(TimeoutError, match=r"0\.5 s: it was waiting for an answer from Redis;"):
        await within(0.5, queue.run("k", ran.append, "ran"))
    assert ran == []
    proxy.thaw()


@pytest.mark.parametrize("mode", ["task", "thread"])
async def test_a_timeout_on_a_redis_that_does_not_answer_names_it_and_the_callers_limit(
    make_backend: BackendFactory, proxy: Proxy, mode: str
) -> None:
    # Issue 31: a key nobody holds, and Redis does not answer the enqueue (a
    # partition). Before: "the turn for key 'k' was not reached in time", as if
    # the key were busy, and without the timeout given.
    queue = KeyedQueue(backend=make_backend(url=proxy.url), timeout=0.3)

    def turn(key: str, fn: Any, *args: Any) -> Any:
        if mode == "task":
            return queue.run(key, fn, *args)
        return asyncio.to_thread(queue.run_sync, key, fn, *args)

    await turn("warm", lambda: None)  # connected (and a thread's connection made): then
    proxy.freeze()
    ran: list[str] = []
    try:
        with pytest.raises(TimeoutError) as late:
            await within(0.3, turn("k", ran.append, "ran"))
    finally:
        proxy.thaw()
    assert ran == []
    assert str(late.value) == (
        "inturn: the turn for key 'k' was not reached within 0.3 s: it was waiting for an "
        "answer from Redis; the work did not run. Check the network and the server"
    )


async def test_without_a_timeout_an_unreachable_redis_ends_the_wait_within_a_lease(
    make_backend: BackendFactory, proxy: Proxy
) -> None:
    queue = KeyedQueue(backend=make_backend(url=proxy.url))
    await queue.run("warm", lambda: None)  # connected and subscribed: then the partition
    proxy.freeze()
    ran: list[str] = []
    with pytest.raises(BackendUnavailable, match="did not run"):
        await within(LEASE, queue.run("k", ran.append, "ran"))
    assert ran == []
    proxy.thaw()


async def test_a_stall_before_redis_registered_the_waiter_is_no_lost_lease(
    make_backend: BackendFactory, proxy: Proxy
) -> None:
    # The lease is counted from when Redis could have registered the member,
    # not from the submission: a slow start is no reason to doubt the turn.
    queue = KeyedQueue(backend=make_backend(url=proxy.url))
    proxy.freeze()
    done = asyncio.Event()

    async def work() -> str:
        await asyncio.sleep(LEASE * 0.5)  # holds for half a lease: the span is the point
        done.set()
        return "ran"

    call = asyncio.create_task(queue.run("k", work))
    await asyncio.sleep(LEASE * 0.7)  # stalled for most of a lease before it gets through
    proxy.thaw()
    assert await within(LEASE, call) == "ran"  # and no LeaseLost


# -- places lost ----------------------------------------------------------------------------


async def waiter_behind(
    make_backend: BackendFactory, **options: Any
) -> tuple[asyncio.Event, asyncio.Task[Any], asyncio.Task[Any], list[str], RedisBackend]:
    """A holder (gate to release it) and a waiter behind it, on two backends."""
    a, b = make_backend(**options), make_backend(**options)
    gate = asyncio.Event()
    holder = await held(KeyedQueue(backend=a), "k", gate)
    ran: list[str] = []
    waiter = asyncio.create_task(KeyedQueue(backend=b).run("k", ran.append, "b"))
    await waiting(a, 1)
    return gate, holder, waiter, ran, b


async def test_a_waiter_whose_place_was_flushed_gets_backend_unavailable(
    make_backend: BackendFactory, server: aioredis.Redis
) -> None:
    gate, holder, waiter, ran, _ = await waiter_behind(make_backend)
    await server.flushall()
    with pytest.raises(BackendUnavailable, match="place"):
        await within(LEASE, waiter)
    assert ran == []
    gate.set()
    with pytest.raises(LeaseLost):
        await within(LEASE, holder)


async def test_a_waiter_whose_redis_restarted_empty_gets_backend_unavailable(
    make_backend: BackendFactory, own_redis: Server
) -> None:
    gate, holder, waiter, ran, _ = await waiter_behind(make_backend)
    own_redis.stop(kill=True)
    own_redis.start()
    with pytest.raises(BackendUnavailable):
        await within(2 * LEASE, waiter)
    assert ran == []
    gate.set()
    with pytest.raises(LeaseLost):
        await within(LEASE, holder)


async def test_a_waiter_under_a_closing_backend_gets_backend_unavailable(
    make_backend: BackendFactory,
) -> None:
    gate, holder, waiter, ran, b = await waiter_behind(make_backend)
    await within(LEASE, b.aclose())
    with pytest.raises(BackendUnavailable, match="closed"):
        await within(LEASE, waiter)
    assert ran == []
    gate.set()
    await within(LEASE, holder)


@pytest.mark.parametrize("pause", ["debug-sleep", "client-pause"])
async def test_a_redis_frozen_past_the_lease_ends_waits_and_turns_truthfully(
    make_backend: BackendFactory, own_redis: Server, pause: str
) -> None:
    gate, holder, waiter, ran, _ = await waiter_behind(make_backend)
    side = aioredis.Redis.from_url(own_redis.url)
    try:
        if pause == "client-pause":
            await side.execute_command("CLIENT", "PAUSE", int(LEASE * 2500), "ALL")
            frozen = None
        else:
            frozen = asyncio.create_task(side.execute_command("DEBUG", "SLEEP", LEASE * 2.5))
        with pytest.raises(BackendUnavailable):
            await within(2 * LEASE, waiter)
        if frozen is not None:
            await within(2 * LEASE, frozen)
    finally:
        await side.aclose()
    assert ran == []
    gate.set()
    with pytest.raises(LeaseLost):
        await within(2 * LEASE, holder)


# -- refusals: permissions, memory, credentials ---------------------------------------------


@pytest.mark.parametrize(
    ("denied", "named"),
    [("-subscribe", "SUBSCRIBE"), ("-evalsha", "EVALSHA"), ("-publish", "PUBLISH")],
)
async def test_a_missing_permission_is_named_at_the_first_call(
    make_backend: BackendFactory,
    server: aioredis.Redis,
    own_redis: Server,
    denied: str,
    named: str,
) -> None:
    user = f"u{uuid.uuid4().hex[:8]}"
    await server.acl_setuser(
        user,
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", denied],
    )
    url = own_redis.url.replace("redis://", f"redis://{user}:pw@")
    ran: list[str] = []
    with pytest.raises(BackendUnavailable, match=rf"(?i)permission.*{named}|{named}.*permission"):
        await within(
            1, KeyedQueue(backend=make_backend(url=url), timeout=1).run("k", ran.append, 1)
        )
    assert ran == []


async def test_a_permission_revoked_while_waiting_is_named_within_a_lease(
    make_backend: BackendFactory,
    server: aioredis.Redis,
    own_redis: Server,
    caplog: pytest.LogCaptureFixture,
) -> None:
    user = f"u{uuid.uuid4().hex[:8]}"
    await server.acl_setuser(
        user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all"]
    )
    url = own_redis.url.replace("redis://", f"redis://{user}:pw@")
    gate, holder, waiter, ran, _ = await waiter_behind(make_backend, url=url)
    await server.acl_setuser(user, commands=["-evalsha"])  # renewals are refused from now on
    with pytest.raises(BackendUnavailable, match="lacks a permission"):
        await within(2 * LEASE, waiter)
    assert ran == []
    gate.set()
    with pytest.raises(LeaseLost):
        await within(LEASE, holder)
    refusals = [r for r in caplog.records if "could not renew" in r.getMessage()]
    assert len(refusals) == 2  # once per backend, however often it was tried


async def test_redis_out_of_memory_is_named(
    make_backend: BackendFactory, server: aioredis.Redis
) -> None:
    queue = KeyedQueue(backend=make_backend(), timeout=1)
    await queue.run("warm", lambda: None)
    await server.config_set("maxmemory-policy", "noeviction")
    await server.config_set("maxmemory", 1)
    try:
        with pytest.raises(BackendUnavailable, match="out of memory"):
            await within(1, queue.run("k", lambda: None))
    finally:
        await server.config_set("maxmemory", 0)


async def test_a_wrong_password_is_named(
    make_backend: BackendFactory, server: aioredis.Redis, own_redis: Server
) -> None:
    user = f"u{uuid.uuid4().hex[:8]}"
    await server.acl_setuser(user, enabled=True, passwords=["+right"], keys=["*"])
    url = own_redis.url.replace("redis://", f"redis://{user}:wrong@")
    with pytest.raises(BackendUnavailable, match="refused the credentials") as caught:
        await within(1, KeyedQueue(backend=make_backend(url=url)).run("k", lambda: None))
    assert "could not be reached" not in str(caught.value)


# -- what comes over the wire --------------------------------------------------------------


async def test_push_frames_between_replies_go_to_no_call(
    make_backend: BackendFactory, proxy: Proxy
) -> None:
    # RESP3 (protocol=3): only then does a server push; what it pushes goes to no call
    a = make_backend(url=proxy.url, protocol=3)
    b = make_backend(url=proxy.url, protocol=3)
    qa, qb = KeyedQueue(backend=a), KeyedQueue(backend=b)
    await qa.run("warm", lambda: None)
    await qb.run("warm", lambda: None)
    # what newer servers push to RESP3 clients: a maintenance notice, a tracking invalidation
    push = b">4\r\n$6\r\nMOVING\r\n:1\r\n:15\r\n$14\r\n127.0.0.1:6379\r\n"
    invalidate = b">2\r\n$10\r\ninvalidate\r\n*1\r\n$3\r\nfoo\r\n"
    assert proxy.inject(push + invalidate) >= 4  # every connection: calls and subscriptions
    await _both_serve_turns(qa, qb)


async def _both_serve_turns(qa: KeyedQueue, qb: KeyedQueue) -> None:
    """Ten turns on one key from the two queues' processes all run (within a lease), and
    the next turns' fencing tokens rise: no reply went to the wrong call."""
    order: list[int] = []
    await within(
        LEASE,
        asyncio.gather(*(q.run("k", order.append, i) for i, q in enumerate([qa, qb] * 5))),
    )
    assert sorted(order) == list(range(10))
    async with qa.keyed("k") as turn:
        token = turn.token
    async with qb.keyed("k") as turn:
        assert turn.token > token


# -- event loops --------------------------------------------------------------------------


def test_an_event_loop_per_job_leaks_no_socket_and_no_connection(
    own_redis: Server, namespace: str
) -> None:
    # A module-level queue, and asyncio.run() per job (RQ, Celery, scripts).
    queue = KeyedQueue(backend=RedisBackend.from_url(own_redis.url, namespace=namespace))

    async def clients() -> int:
        side = aioredis.Redis.from_url(own_redis.url)
        try:
            return len(await side.client_list())
        finally:
            await side.aclose()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Two loops' own sessions, then the backend loop's (later loops go through it).
        for _ in range(3):
            asyncio.run(queue.run("k", lambda: None))
        gc.collect()
        first = asyncio.run(clients())
        for _ in range(8):
            asyncio.run(queue.run("k", lambda: None))
            gc.collect()
        assert asyncio.run(clients()) <= first
        asyncio.run(queue.aclose())
        gc.collect()
    assert [str(w.message) for w in caught] == []


async def test_a_dropped_connection_under_renewals_leaves_no_unretrieved_error(
    make_backend: BackendFactory, server: aioredis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    a = make_backend(lease=0.3)
    queue = KeyedQueue(backend=a)
    gates = [asyncio.Event() for _ in range(20)]
    holders = [await held(queue, f"k{i}", gate) for i, gate in enumerate(gates)]
    for _ in range(5):
        await server.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
        await asyncio.sleep(0.1)  # renewals are in flight when the connection drops
    for gate in gates:
        gate.set()
    await asyncio.gather(*holders, return_exceptions=True)
    gc.collect()
    await asyncio.sleep(0)
    assert "never retrieved" not in caplog.text


class Gone:
    """A carrier's listener that keeps only how its connection ended."""

    def __init__(self) -> None:
        self.error: asyncio.Future[BaseException] = asyncio.get_running_loop().create_future()

    def got(self, reply: Any) -> None:
        pass

    def gone(self, error: BaseException) -> None:
        self.error.set_result(error)


@pytest.fixture
async def public_carrier(
    own_redis: Server, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[Any, Gone]]:
    """A carrier through redis-py's public API (no takeover), and the listener it tells."""
    monkeypatch.setattr(_takeover, "ENABLED", False)
    client = aioredis.Redis.from_url(own_redis.url)
    listener = Gone()
    carrier = await _wire.connect(client.connection_pool.make_connection, listener, LEASE, False)
    try:
        yield carrier, listener
    finally:
        await carrier.close()
        await client.aclose()


async def test_a_write_that_breaks_the_pipe_leaves_no_error_for_the_collector_to_log(
    public_carrier: tuple[Any, Gone], caplog: pytest.LogCaptureFixture
) -> None:
    # Through redis-py's public API, a write into a broken connection fails in the
    # StreamWriter's drain(); asyncio keeps the BrokenPipeError in its protocol's close
    # waiter too, which only the protocol's __del__ retrieves, and the drain's frames leave
    # the protocol in a reference cycle: the collector finalizes their objects in no set
    # order, and "Future exception was never retrieved" came once in CI. Here the waiter
    # is finalized first on purpose.
    carrier, listener = public_carrier
    transport = _takeover.writer_transport(carrier._connection)
    assert transport is not None
    closed = transport.get_protocol()._closed  # type: ignore[attr-defined]
    transport.get_extra_info("socket").shutdown(socket.SHUT_WR)  # the next write: EPIPE
    carrier.write(b"*1\r\n$4\r\nPING\r\n")
    await within(LEASE, listener.error)
    closed.__del__()  # finalized before its protocol, as the collector may
    assert asyncio_problems(caplog) == []
    assert isinstance(closed.exception(), BrokenPipeError)  # (there was one to retrieve)


async def test_a_write_that_fails_first_still_ends_the_connection_for_its_listener(
    public_carrier: tuple[Any, Gone], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Through redis-py's public API, a write that failed before the reader had seen the
    # connection end (the order Python 3.12 and 3.13 take when a write breaks the pipe)
    # stopped the reader, which took that for its loop's end and never told its listener:
    # the Link wrote into a dead connection for good. Here the write fails alone.
    carrier, listener = public_carrier

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise RedisConnectionError("Error 32 while writing to socket. Broken pipe.")

    monkeypatch.setattr(carrier._connection, "send_packed_command", broken)
    carrier.write(b"*1\r\n$4\r\nPING\r\n")
    assert "Broken pipe" in str(await within(LEASE, listener.error))


async def test_a_connect_cancelled_into_an_error_leaves_no_task_unretrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Closing a backend while it connects cancels redis-py's connect(), which may end with a
    # ConnectionError instead (its own wait_for let a write's failure win over the
    # cancellation: seen under load). On Python 3.11 and earlier, wait_for ran it in a task
    # of its own, and that error was logged as never retrieved.
    started = asyncio.Event()

    class Connecting:
        async def connect(self) -> None:
            started.set()
            try:
                await asyncio.Event().wait()  # (never set: the handshake never ends)
            except asyncio.CancelledError:
                raise RedisConnectionError("Connection lost") from None

        async def disconnect(self, nowait: bool = False) -> None:
            pass

    opening = asyncio.create_task(_wire.connect(Connecting, Gone(), LEASE, False))
    await within(LEASE, started.wait())
    opening.cancel()
    with pytest.raises((asyncio.CancelledError, RedisConnectionError)):
        await opening
    await asyncio.sleep(0)  # (a round: the loop lets go of the tasks that ended)
    assert asyncio_problems(caplog) == []


async def clients(url: str) -> list[dict[str, Any]]:
    """The server's clients now (CLIENT LIST), seen by a client of the test's own."""
    side = aioredis.Redis.from_url(url)
    try:
        return list(await side.client_list())
    finally:
        await side.aclose()


def asyncio_problems(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What asyncio logged (at ERROR) so far: never retrieved, destroyed pending, callbacks."""
    gc.collect()
    return [r.getMessage().split("\n")[0] for r in caplog.records if r.name == "asyncio"]


# -- found by an adversarial review -----------------------------------------------------------


# -- a waiter frozen past its lease runs its work while another process holds the key ---


async def test_a_waiter_frozen_past_its_lease_never_runs_while_another_holds(
    own_redis: Server,
    namespace: str,
    make_backend: BackendFactory,
    workers: list[Worker],
) -> None:
    # A waiter frozen (SIGSTOP, a paused VM, a blocked loop) past its lease, whose grant
    # then waits in its socket while a third process takes the key, must not run its work.
    a, c = make_backend(), make_backend()
    gate = asyncio.Event()
    holder = await held(KeyedQueue(backend=a), "k", gate)
    frozen = await Worker.start(f"redis:{own_redis.url}#{namespace}#{LEASE}", "hold", "k")
    workers.append(frozen)
    await waiting(a, 1)
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        gate.set()  # the key passes to the frozen waiter: its grant waits in its socket
        await within(LEASE, holder)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PATIENCE
        while True:  # until Redis shows the frozen holder's lease run out
            lines = await a.lines()
            if lines and lines[0].holder is not None and lines[0].holder.lease_left < 0:
                break
            assert loop.time() < deadline, lines
            await asyncio.sleep(0.01)
        gate2 = asyncio.Event()
        third = await held(KeyedQueue(backend=c), "k", gate2)  # a valid lease, a valid holder
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    try:
        assert frozen.process.stdout is not None
        line = await asyncio.wait_for(frozen.process.stdout.readline(), PATIENCE)
        # expected: the worker fails (BackendUnavailable) and says nothing; found: "holding <token>"
        assert line == b"", f"the frozen waiter ran its work while another held the key: {line!r}"
    finally:
        gate2.set()
        await within(LEASE, third)


# -- a connection closed right after redis-py's handshake wedges the session for good ---


class CutAfterHandshake(Proxy):
    """A proxy that closes its nth connection right after redis-py's handshake is answered.

    As when Redis drops a client (CLIENT KILL, a restart, an idle timeout, a load balancer)
    the moment it is set up: the FIN follows the last handshake reply.
    """

    def __init__(self, target_port: int, nth: int) -> None:
        super().__init__(target_port)
        self.nth = nth
        self.accepted = 0
        self._targets: set[int] = set()
        self._cut: set[int] = set()

    def _accept(self) -> None:
        before = {id(pipe) for pipe in self._pipes.values()}
        super()._accept()
        for pipe in set(self._pipes.values()):
            if id(pipe) not in before:
                self.accepted += 1
                if self.accepted == self.nth:
                    self._targets.add(id(pipe))

    def _read(self, sock: Any) -> None:
        pipe = self._pipes[sock]
        super()._read(sock)
        if id(pipe) in self._targets:
            # the handshake's last command is CLIENT SETINFO LIB-VER; cut once it is answered
            if sock is pipe.client and b"LIB-VER" in pipe.to_server:
                pipe.armed = True  # type: ignore[attr-defined]
            elif sock is pipe.server and getattr(pipe, "armed", False) and pipe.to_client:
                self._cut.add(id(pipe))

    def _flush(self) -> None:
        super()._flush()
        for pipe in list(set(self._pipes.values())):
            if id(pipe) in self._cut and not pipe.to_client:
                self._drop(pipe)  # an orderly close: the client reads EOF


async def test_a_connection_dropped_just_after_its_handshake_does_not_wedge_the_session(
    own_redis: Server, make_backend: BackendFactory
) -> None:
    # The link's connection closed by the peer just after redis-py's handshake (its reader
    # saw the end before the takeover): the session must not wait forever for its greeting.
    proxy = CutAfterHandshake(own_redis.port, nth=2).start()  # 1: the subscription; 2: the Link
    try:
        queue = KeyedQueue(backend=make_backend(url=proxy.url))
        outcomes: list[str] = []
        for _ in range(4):
            try:
                outcomes.append(await within(LEASE, queue.run("k", lambda: "ran")))
            except BackendUnavailable as error:
                outcomes.append(f"BackendUnavailable: {error}")
        # the first call may fail with the dropped connection; the next ones must get through
        assert "ran" in outcomes[1:], outcomes
    finally:
        proxy.close()


# -- the public-API path with decode_responses=True never subscribes ---------------------


async def test_the_public_api_path_works_with_decode_responses(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Through redis-py's public API, a client with decode_responses=True works too.
    monkeypatch.setattr(_takeover, "ENABLED", False)
    a = make_backend(decode_responses=True)
    b = make_backend(decode_responses=True)
    assert await within(LEASE, KeyedQueue(backend=a).run("k", lambda: "ran")) == "ran"
    assert await hand_over(a, b) == "next"


class HiredisPush(list):  # type: ignore[type-arg]
    """What hiredis 3.2 and later make of a RESP3 push frame (``hiredis.PushNotification``)."""


class HiredisLikeConnection(aioredis.Connection):
    """A connection that reads as redis-py 5.0's hiredis parser did: a push frame handed
    over as a reply (marked as hiredis marks it), and decode_responses obeyed whatever
    ``read_response(disable_decoding=True)`` asked."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["disable_decoding"] = False
        kwargs["push_request"] = True  # (redis-py's own parser hands the push over then)
        reply = await super().read_response(*args, **kwargs)
        if (
            isinstance(reply, list)
            and reply
            and reply[0] in (b"server-cpu-usage", "server-cpu-usage")
        ):
            return HiredisPush(reply)
        return reply


async def test_a_push_handed_over_as_a_reply_goes_to_no_call_on_the_public_api_path(
    make_backend: BackendFactory,
    proxy: Proxy,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # redis-py 5.0's hiredis parser hands a RESP3 push over as the next reply: it took a
    # call's place (every later call got the reply of the call before it), or with no
    # call in flight broke the connection.
    monkeypatch.setattr(_takeover, "ENABLED", False)
    monkeypatch.setattr(_wire, "_HiredisPush", HiredisPush)
    a = make_backend(url=proxy.url, protocol=3, connection_class=HiredisLikeConnection)
    b = make_backend(url=proxy.url, protocol=3, connection_class=HiredisLikeConnection)
    qa, qb = KeyedQueue(backend=a), KeyedQueue(backend=b)
    await qa.run("warm", lambda: None)
    await qb.run("warm", lambda: None)
    # (what DEBUG PROTOCOL push sends: a push no redis-py handler claims)
    assert proxy.inject(b">2\r\n$16\r\nserver-cpu-usage\r\n:42\r\n") >= 4
    await _both_serve_turns(qa, qb)
    assert not [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


async def test_a_parser_that_decodes_regardless_still_hears_grants_on_the_public_api_path(
    make_backend: BackendFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # redis-py 5.0's hiredis parser decodes whatever read_response asks: with
    # decode_responses=True, the subscription's confirmation came as a str, was never
    # recognised, and no turn could start.
    monkeypatch.setattr(_takeover, "ENABLED", False)
    a = make_backend(decode_responses=True, connection_class=HiredisLikeConnection)
    b = make_backend(decode_responses=True, connection_class=HiredisLikeConnection)
    assert await within(LEASE, KeyedQueue(backend=a).run("k", lambda: "ran")) == "ran"
    assert await hand_over(a, b) == "next"


# -- the public-API path writes at once -------------------------------------------------


async def test_a_write_runs_at_once_and_only_what_blocks_is_left_to_a_task() -> None:
    # A write through redis-py's public API runs in the caller (no pass of the loop);
    # a write that blocks (a full socket buffer) is finished by a task: resumed with
    # its future's answer, or cancelled where it waits.
    record: list[str] = []

    async def write(until: asyncio.Future[None] | None) -> None:
        record.append("written")
        if until is not None:
            await until
            record.append("drained")

    assert _wire.eagerly(write(None)) is None
    assert record == ["written"]
    for cancel in (False, True):
        record.clear()
        drained = asyncio.get_running_loop().create_future()
        rest = _wire.eagerly(write(drained))
        assert rest is not None
        assert record == ["written"]
        finishing = asyncio.ensure_future(rest)  # (a Rest is awaitable, not a coroutine)
        await asyncio.sleep(0)
        if cancel:
            finishing.cancel()
            with pytest.raises(asyncio.CancelledError):
                await finishing
            assert drained.cancelled()
            assert record == ["written"]
        else:
            drained.set_result(None)
            await finishing
            assert record == ["written", "drained"]


class _BlockedWrite:
    """A connection whose write blocks, and whose clean-up of a write cut short needs the
    running loop, as redis-py's does (it awaits a disconnect)."""

    socket_timeout = None
    is_connected = True

    def __init__(self) -> None:
        self.cleaned: list[str] = []

    async def send_packed_command(self, data: bytes, check_health: bool = True) -> None:
        try:
            await asyncio.get_running_loop().create_future()  # (a full buffer: never drained)
        except BaseException as cut:
            asyncio.get_running_loop()  # (raises without a running loop, as redis-py's clean-up)
            self.cleaned.append(type(cut).__name__)
            raise

    async def read_response(self, **options: Any) -> Any:
        await asyncio.get_running_loop().create_future()

    async def disconnect(self, nowait: bool = False) -> None:
        pass


class _Deaf:
    def got(self, reply: Any) -> None:
        pass

    def gone(self, error: BaseException | None) -> None:
        pass


def test_a_blocked_write_whose_task_never_ran_is_closed_in_its_loop() -> None:
    # Through redis-py's public API, a write that blocked is left to a task; that task
    # cancelled before its first step must close the write in the loop. Before, the
    # write was collected afterwards, without a loop, and redis-py's clean-up of it
    # failed as "Exception ignored in: <coroutine send_packed_command>" (seen with
    # redis-py 5.0 and hiredis, about one run in five).
    connection = _BlockedWrite()
    unraisable: list[Any] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append

    async def write_and_end() -> None:
        carrier = _wire._Public(connection, _Deaf(), False)  # type: ignore[arg-type]
        carrier.write(b"PING")  # blocks: a task is to finish it, at the next pass
        # Cancelled before that pass, as the carrier's end cancels it when the reader
        # ends first (the connection lost): it never awaits the write.
        carrier._writing.cancel()  # type: ignore[union-attr]

    try:
        asyncio.run(write_and_end())
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert connection.cleaned == ["GeneratorExit"]
    assert unraisable == []


# -- the public-API writer task outlives its connection -----------------------------------


async def test_the_public_api_writer_ends_with_its_connection(
    make_backend: BackendFactory,
    server: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    heap_frozen: None,  # (a collection after each of 150 kills)
) -> None:
    # Through redis-py's public API, under connection kills: no task outlives its
    # connection (redis-py may swallow the writer's cancellation on Python 3.10/3.11).
    monkeypatch.setattr(_takeover, "ENABLED", False)
    queue = KeyedQueue(backend=make_backend(lease=2.0))
    stop = asyncio.Event()

    async def loop_on(key: str) -> None:
        while not stop.is_set():
            try:
                await queue.run(key, lambda: None)
            except BackendUnavailable:
                pass

    runners = [asyncio.create_task(loop_on(f"k{i}")) for i in range(16)]
    try:
        for _ in range(150):  # the kills are paced, not ordered: each lands mid-traffic
            await asyncio.sleep(0.01)
            await server.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
            if asyncio_problems(caplog):
                break
    finally:
        stop.set()
        await within(PATIENCE, asyncio.gather(*runners))
    assert asyncio_problems(caplog) == []


# -- closing the backend while an enqueue is in flight: a future never retrieved ---------


async def test_closing_while_an_enqueue_is_in_flight_logs_nothing_never_retrieved(
    make_backend: BackendFactory, proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    # Closing while an enqueue gets no answer: the place is given up, nothing is logged.
    backend = make_backend(url=proxy.url)
    queue = KeyedQueue(backend=backend)
    await queue.run("warm", lambda: None)
    proxy.freeze()  # the enqueue is written and gets no answer
    waiter = asyncio.create_task(queue.run("k", lambda: None))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    await within(LEASE, backend.aclose())
    with pytest.raises(BackendUnavailable, match="closed"):
        await within(LEASE, waiter)
    proxy.thaw()
    del waiter
    assert asyncio_problems(caplog) == []


# -- a holder cancelled while its release is on its way: the release callback raises -----


async def test_cancelling_a_holder_during_its_release_raises_in_no_callback(
    make_backend: BackendFactory, proxy: Proxy, caplog: pytest.LogCaptureFixture
) -> None:
    # A holder cancelled while its release is on its way: the release goes on, quietly.
    queue = KeyedQueue(backend=make_backend(url=proxy.url))
    await queue.run("warm", lambda: None)
    frozen = asyncio.Event()

    async def work() -> None:
        proxy.freeze()  # the release that follows waits for its answer
        frozen.set()

    holder = asyncio.create_task(queue.run("k", work))
    await within(LEASE, frozen.wait())
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    holder.cancel()  # e.g. an outer asyncio.timeout() running out during the release
    with pytest.raises(asyncio.CancelledError):
        await holder
    proxy.thaw()
    assert await within(LEASE, queue.run("k", lambda: "again")) == "again"  # released
    assert asyncio_problems(caplog) == []


# -- a refused subscription leaves a task that reconnects forever, after aclose() too -----


async def test_a_refused_subscription_leaves_nothing_running_after_aclose(
    make_backend: BackendFactory, server: aioredis.Redis, own_redis: Server
) -> None:
    # A user without +subscribe: the refused inbox leaves no task reconnecting.
    user = f"u{uuid.uuid4().hex[:8]}"
    await server.acl_setuser(
        user,
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-subscribe"],
    )
    backend = make_backend(url=own_redis.url.replace("redis://", f"redis://{user}:pw@"))
    with pytest.raises(BackendUnavailable, match="permission"):
        await within(1, KeyedQueue(backend=backend, timeout=1).run("k", lambda: None))
    await within(LEASE, backend.aclose())
    left = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("inturn-")]
    assert left == []


# -- loops that end without asyncio.run's clean-up, and lines() in a loop per job ---------


def test_asyncio_run_of_lines_leaves_no_connection(own_redis: Server, namespace: str) -> None:
    # lines() in a loop of its own (a health check) leaves no connection behind.
    backend = RedisBackend.from_url(own_redis.url, namespace=namespace, lease=LEASE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        before = len(asyncio.run(clients(own_redis.url)))
        asyncio.run(backend.lines())
        gc.collect()
        after = len(asyncio.run(clients(own_redis.url)))
        asyncio.run(backend.aclose())
        gc.collect()
    assert after <= before, f"{after - before} Redis connection(s) left by asyncio.run(lines())"
    assert [str(w.message) for w in caught] == []


@pytest.mark.parametrize("how", ["closed-without-shutdown_asyncgens", "abandoned"])
def test_a_loop_that_ends_without_asyncio_run_leaves_no_connection(
    own_redis: Server, namespace: str, how: str
) -> None:
    # A loop closed without shutdown_asyncgens(), or abandoned with its thread: its share
    # is closed at the backend's next use from another loop, or by aclose(); only the last
    # one's connections stay until then, and nothing warns.
    backend = RedisBackend.from_url(own_redis.url, namespace=namespace, lease=LEASE)
    before = len(asyncio.run(clients(own_redis.url)))

    def job() -> None:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(KeyedQueue(backend=backend).run("k", lambda: None))
        if how == "closed-without-shutdown_asyncgens":
            loop.close()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            thread = threading.Thread(target=job)
            thread.start()
            thread.join(PATIENCE)
        gc.collect()
        after_jobs = len(asyncio.run(clients(own_redis.url)))
        asyncio.run(backend.aclose())
        gc.collect()
        after_close = len(asyncio.run(clients(own_redis.url)))
    assert after_jobs <= before + 2  # the last job's link and subscription, no more
    assert after_close <= before
    # (the abandoned loops themselves warn as they are collected: they are the test's)
    assert [str(w.message) for w in caught if "unclosed event loop" not in str(w.message)] == []


# -- timeout=0 (a try-lock) takes a whole lease on a partition -----------------------------


async def test_a_try_lock_ends_within_its_timeout_on_a_partition(
    make_backend: BackendFactory, proxy: Proxy
) -> None:
    # timeout=0 on a partition: one round trip at most (a tenth of the lease), not a lease.
    lease = 6.0
    queue = KeyedQueue(backend=make_backend(url=proxy.url, lease=lease), timeout=0)
    await queue.run("warm", lambda: None)
    proxy.freeze()
    began = time.monotonic()
    try:
        with pytest.raises((TimeoutError, BackendUnavailable)):
            await within(lease, queue.run("k", lambda: None))
        took = time.monotonic() - began
    finally:
        proxy.thaw()
    assert took < SLACK, f"a try-lock took {took:.1f} s (lease {lease:g} s)"


# -- a try-lock on an event loop whose connections to Redis are slow to set up --------------


@pytest.mark.parametrize("timeout", [0, 0.2])
async def test_a_short_timeout_waits_out_a_slow_setup_and_takes_a_free_key(
    make_backend: BackendFactory, server: aioredis.Redis, timeout: float
) -> None:
    # An event loop's first call connects, subscribes and greets Redis; on a loaded
    # machine that once took over a second, the round trip a try-lock gets (a tenth of
    # the default lease), and it failed with "not reached in time" on a free key.
    queue = KeyedQueue(backend=make_backend(lease=10.0), timeout=timeout)
    await server.execute_command("CLIENT", "PAUSE", 1500, "ALL")  # (Redis ends the pause)
    began = time.monotonic()
    assert await within(1.5, queue.run("k", lambda: "ran")) == "ran"
    assert time.monotonic() - began > 1.0  # the setup was slower than a round trip's bound


async def test_a_try_lock_on_an_unreachable_redis_ends_within_seconds_and_says_why(
    make_backend: BackendFactory, proxy: Proxy
) -> None:
    # The setup's floor is a few seconds, not the lease: a partition at the first call
    # ends a try-lock that soon, with what happened (and that the work did not run).
    queue = KeyedQueue(backend=make_backend(url=proxy.url, lease=10.0), timeout=0)
    proxy.freeze()
    ran: list[str] = []
    try:
        with pytest.raises(
            TimeoutError,
            match=r"at once \(timeout=0\): it needed an answer from Redis \(connecting took over "
            r"3 s\); the work did not run",
        ):
            await within(3.0, queue.run("k", ran.append, "ran"))
    finally:
        proxy.thaw()
    assert ran == []


# -- lines() shows another namespace's lines ----------------------------------------------


async def test_lines_shows_only_the_lines_of_its_own_namespace(
    own_redis: Server, namespace: str
) -> None:
    # Namespace 'app' does not list the lines of 'app:eu'.
    mine = RedisBackend.from_url(own_redis.url, namespace=namespace, lease=LEASE)
    other = RedisBackend.from_url(own_redis.url, namespace=namespace + ":eu", lease=LEASE)
    try:
        async with KeyedQueue(backend=other).keyed("theirs"):
            assert [line.key for line in await mine.lines()] == []
    finally:
        await mine.aclose()
        await other.aclose()


@pytest.fixture(autouse=True)
def _asyncio_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Every test: nothing is logged as never retrieved, no task dies unseen."""
    yield
    gc.collect()
    problems = [r.getMessage() for r in caplog.records if r.name == "asyncio"]  # (errors)
    assert problems == []


# -- Redis Sentinel --------------------------------------------------------------------------


@pytest.fixture
async def sentinel_backends(
    sentinel_setup: SentinelSetup, namespace: str
) -> AsyncIterator[tuple[RedisBackend, RedisBackend]]:
    """Two backends on clients from redis-py's Sentinel(...).master_for(...), as users make them."""
    sentinel = Sentinel([("127.0.0.1", sentinel_setup.port)])
    made = [
        RedisBackend(
            sentinel.master_for(SentinelSetup.NAME),
            namespace=namespace,
            lease=LEASE,
            owns_client=True,
        )
        for _ in range(2)
    ]
    yield made[0], made[1]
    for backend in made:
        await asyncio.wait_for(backend.aclose(), PATIENCE)
    for client in sentinel.sentinels:
        await client.aclose()


async def test_a_sentinel_managed_client_hands_turns_over(
    sentinel_backends: tuple[RedisBackend, RedisBackend],
) -> None:
    a, b = sentinel_backends
    assert await hand_over(a, b) == "next"


async def test_a_failover_is_a_lost_lease_for_the_holder_and_never_a_hang(
    sentinel_setup: SentinelSetup, sentinel_backends: tuple[RedisBackend, RedisBackend]
) -> None:
    a, b = sentinel_backends
    gate = asyncio.Event()
    turns: list[Turn] = []

    async def hold() -> None:
        async with KeyedQueue(backend=a).keyed("k") as turn:
            turns.append(turn)
            await gate.wait()

    holder = asyncio.create_task(hold())
    await settle(lambda: len(turns) == 1)
    ran: list[str] = []
    waiter = asyncio.create_task(KeyedQueue(backend=b).run("k", ran.append, "b"))
    await waiting(a, 1)
    await asyncio.get_running_loop().run_in_executor(None, sentinel_setup.fail_over)
    # The master died: the holder learns it (it could not renew, and Redis is
    # another server now) while it still holds...
    await settle(lambda: turns[0].lease_lost)
    gate.set()
    with pytest.raises(LeaseLost):  # ... and its call says so once the work is done
        await within(LEASE, holder)
    # The waiter waits anew on the new master, or is told its place is gone: never a hang.
    (outcome,) = await within(PATIENCE / 2, asyncio.gather(waiter, return_exceptions=True))
    assert (outcome is None and ran == ["b"]) or isinstance(outcome, BackendUnavailable)
    # and the line goes on, on the new master
    assert await within(LEASE, KeyedQueue(backend=a).run("k", lambda: "after")) == "after"


# -- latest work shared across processes, killed at every step ----------------------------

#: The lease of a victim killed at every step (s): its place is freed within about this long.
KILL_LEASE = 0.5


@pytest.mark.parametrize("victim", ["newest", "older"])
async def test_a_crash_at_any_step_of_latest_work_across_processes_loses_no_update(
    redis_url: str, namespace: str, workers: list[Worker], victim: str
) -> None:
    """Latest work (across="processes") killed before and after each op of its turn (the
    worker's OpTripwire), beside a work of this process's that waits too: the newest work
    a live process waits for runs (the killed one's, if it ran), and once the victim's
    lease ran out the key is free and nothing is left in Redis.

    A newest victim judges and runs (this process's older work queues again behind it); an
    older victim queues again behind this process's newer work, then learns that it ran.
    """
    spec = f"redis:{redis_url}#{namespace}#{KILL_LEASE}"
    assert await crashes_at_every_step(spec, redis_url, namespace, workers, victim) > 8
