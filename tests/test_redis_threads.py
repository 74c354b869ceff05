"""A thread's Redis turn on a blocking connection of its own (issue 30).

Each call of a thread's turn (the enqueue, the leave) is one round trip from
the thread itself; only what goes on between calls (the subscription that
hands a waiter its grant, the heartbeat) runs on the process's backend loop.
The Redis suites run this file with the oldest redis-py the package allows,
and with the public-API carriers (see dev.py), so the sync connections made
from an async client's settings are tried with both.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from bench.delay_proxy import delayed
from redis.asyncio.sentinel import Sentinel

from inturn import BackendUnavailable, KeyedQueue, LeaseLost, current_turn
from inturn._bridge import backend_loop
from inturn.backends.redis import RedisBackend

from support.faults import Proxy
from support.helpers import PATIENCE
from support.redis_checks import keys_left, waiting
from support.servers import SentinelSetup, Server


@pytest.fixture
def backend(redis_url: str, namespace: str) -> Iterator[RedisBackend]:
    made = RedisBackend.from_url(redis_url, namespace=namespace)
    try:
        yield made
    finally:
        asyncio.run(made.aclose())


def test_clients_with_a_sync_twin_block_threads_natively(
    redis_url: str, redis_urls: dict[str, str]
) -> None:
    assert RedisBackend.from_url(redis_url).capabilities.blocking
    unix = RedisBackend(aioredis.Redis(unix_socket_path="/nonexistent.sock"))
    assert unix.capabilities.blocking

    class Custom(aioredis.Connection):
        pass

    custom = aioredis.Redis(connection_pool=aioredis.ConnectionPool(connection_class=Custom))
    assert not RedisBackend(custom).capabilities.blocking  # (through the backend loop)
    replica = Sentinel([("127.0.0.1", 1)]).slave_for("mymaster")
    assert not RedisBackend(replica).capabilities.blocking
    if "redis-cluster" in redis_urls and redis.__version__ >= "8":
        from redis.asyncio.cluster import RedisCluster

        cluster = RedisCluster.from_url(redis_urls["redis-cluster"])
        assert not RedisBackend(cluster).capabilities.blocking


def test_a_threads_turn_makes_no_hop_to_the_backend_loop(backend: RedisBackend) -> None:
    """Once its first turn set things up, a thread's free turn is its own two round trips:
    it is taken and given back while the backend loop cannot run at all."""
    queue = KeyedQueue(backend=backend)
    assert queue.run_sync("first", lambda: 1) == 1
    loop = backend_loop()
    frozen, thaw = threading.Event(), threading.Event()
    loop.call_soon_threadsafe(lambda: (frozen.set(), thaw.wait(PATIENCE)))
    assert frozen.wait(PATIENCE)
    try:
        ran = []
        with queue.keyed("free", timeout=5):
            ran.append(1)
        assert _turn(queue, "free", 2, 5) == 2
        assert ran == [1]
    finally:
        thaw.set()


@pytest.mark.parametrize("protocol", [2, 3])
def test_a_waiting_thread_is_woken_by_the_grant(
    redis_url: str, namespace: str, protocol: int
) -> None:
    """A thread behind another process's holder gets the key when it is released (push),
    whichever protocol the client speaks (its connections' replies parse alike)."""
    backend = RedisBackend.from_url(redis_url, namespace=namespace, protocol=protocol)
    queue = KeyedQueue(backend=backend)
    other = RedisBackend.from_url(redis_url, namespace=backend.namespace)
    held, release, order = threading.Event(), threading.Event(), []

    def hold() -> None:
        with KeyedQueue(backend=other).keyed("k"):
            held.set()
            release.wait(PATIENCE)
            order.append("holder")

    holder = threading.Thread(target=hold)
    holder.start()
    assert held.wait(PATIENCE)
    waiter = threading.Thread(target=lambda: queue.run_sync("k", order.append, "waiter"))
    waiter.start()
    asyncio.run(waiting(backend, 1))  # the waiter is in Redis's line, behind the holder
    release.set()
    holder.join(PATIENCE)
    waiter.join(PATIENCE)
    assert order == ["holder", "waiter"]
    assert queue.run_sync("k", lambda: "free") == "free"
    asyncio.run(other.aclose())
    asyncio.run(backend.aclose())


@pytest.mark.parametrize("done", ["kill", "flush"])
def test_what_redis_did_to_a_threads_idle_connection_is_survived(
    backend: RedisBackend, redis_url: str, done: str
) -> None:
    """A pooled connection that Redis closed (its idle timeout, CLIENT KILL) is not used;
    scripts Redis flushed are sent again with their bodies."""
    queue = KeyedQueue(backend=backend)
    assert queue.run_sync("k", lambda: 1) == 1
    admin = redis.Redis.from_url(redis_url)
    try:
        if done == "kill":
            killed = admin.client_kill_filter(_type="normal", skipme=True)
            assert killed >= 1
        else:
            admin.script_flush()
        assert _turn(queue, "k", 2, 5) == 2
        assert _turn(queue, "k", 3, 5) == 3
    finally:
        admin.close()


@pytest.mark.server  # (faults: the newest Python runs them)
def test_a_late_answer_to_a_threads_enqueue_still_leaves_the_line(
    redis_url: str, namespace: str
) -> None:
    """A try-lock whose enqueue Redis answers late ends by its own clock (a tenth of the
    lease), and its leave is written behind the enqueue: the line empties well within
    the lease, not when the lease runs out."""
    lease = 8.0
    with delayed(redis_url, 0, calibrate=False, pings=1) as slow:
        backend = RedisBackend.from_url(slow.url, namespace=namespace, lease=lease)
        queue = KeyedQueue(backend=backend)
        assert queue.run_sync("warm", lambda: 1) == 1  # the share starts
        slow.retime(2000)  # each way 1 s: answers come after the try-lock's 0.8 s
        began = time.monotonic()
        with pytest.raises(TimeoutError):
            _turn(queue, "k", 2, 0)
        assert time.monotonic() - began < lease / 2
        assert _keys_until(redis_url, namespace, bool, began + lease / 2), "never enqueued"
        left = _keys_until(redis_url, namespace, lambda keys: not keys, began + lease / 2)
        assert left == [], f"the line was left for the lease to clear: {left}"
        asyncio.run(backend.aclose())


@pytest.mark.server  # (faults: the newest Python runs them)
@pytest.mark.parametrize("timeout", [0, 1.5])
def test_threads_on_a_frozen_network_end_within_their_timeout(
    own_redis: Server, namespace: str, timeout: float
) -> None:
    """Issue 42: with the network frozen, threads that reuse a kept connection and threads
    that must open a new one all end by their timeout (a try-lock: by a tenth of the lease)
    with TimeoutError, the latter saying they were connecting; none of their work runs
    once the network is back, and nothing of them stays in Redis."""
    # Before the fix, the threads that opened a connection waited for the whole lease
    # (its connect timeout) and raised BackendUnavailable.
    lease, kept, new = 10.0, 2, 3
    proxy = Proxy(own_redis.port).start()
    backend = RedisBackend.from_url(proxy.url, namespace=namespace, lease=lease)
    queue = KeyedQueue(backend=backend)
    ran: list[int] = []
    try:
        together = threading.Barrier(kept)  # (two turns at once: up to two connections kept)
        _at_once(kept, lambda i: queue.run_sync(f"warm{i}", together.wait, PATIENCE))
        # (one, if the second enqueue came after the first's reply: it took the same one)
        threads = backend._threads
        assert threads is not None
        idle = len(threads._idle)
        assert 1 <= idle <= kept
        proxy.freeze()
        outcomes: list[tuple[float, BaseException | None]] = []

        def turn(i: int) -> None:
            began = time.monotonic()
            try:
                with queue.keyed(f"k{i}", timeout=timeout):
                    ran.append(i)
            except BaseException as error:  # (reported below)
                outcomes.append((time.monotonic() - began, error))
            else:
                outcomes.append((time.monotonic() - began, None))

        _at_once(kept + new, turn)
        proxy.thaw()
        bound = max(timeout, lease / 10) + 1.0
        assert all(isinstance(error, TimeoutError) for _, error in outcomes), outcomes
        assert max(took for took, _ in outcomes) <= bound, outcomes
        said = [str(error) for _, error in outcomes]
        assert sum("(connecting)" in words for words in said) == kept + new - idle, said
        # Once the network is back, the enqueues held in the frozen connections reach
        # Redis, and the leaves written behind them: nothing is held, nothing waits.
        assert (
            _keys_until(
                own_redis.url, namespace, lambda keys: not keys, time.monotonic() + lease / 2
            )
            == []
        )
        other = KeyedQueue(backend=RedisBackend.from_url(own_redis.url, namespace=namespace))
        for i in range(kept + new):
            with other.keyed(f"k{i}", timeout=0):  # (a try-lock: each key is free)
                pass
        asyncio.run(other.backend.aclose())  # type: ignore[union-attr]
        assert ran == []
    finally:
        proxy.thaw()
        asyncio.run(backend.aclose())
        proxy.close()


def _at_once(count: int, call: Callable[[int], Any]) -> None:
    """call(0) ... call(count - 1), each in a thread of its own, started together; joined."""
    threads = [threading.Thread(target=call, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(PATIENCE)


def _keys_until(url: str, namespace: str, wanted: Any, deadline: float) -> list[str]:
    """Redis keys of namespace, once wanted(keys) holds or at monotonic deadline."""
    while True:
        keys = asyncio.run(keys_left(url, namespace))
        if wanted(keys) or time.monotonic() >= deadline:
            return keys
        time.sleep(0.05)  # (polls Redis for a state, not an ordering)


def _turn(queue: KeyedQueue, key: str, value: int, timeout: float) -> int:
    """value, returned from a thread's turn on key with timeout."""
    with queue.keyed(key, timeout=timeout):
        return value


def test_a_threads_turn_without_a_server_is_backend_unavailable(namespace: str) -> None:
    backend = RedisBackend.from_url("redis://127.0.0.1:1/0", namespace=namespace, lease=1)
    queue = KeyedQueue(backend=backend)
    ran: list[Any] = []
    with pytest.raises(Exception, match="could not be reached") as caught:
        queue.run_sync("k", ran.append, 1)
    assert "did not run" in str(caught.value)
    assert ran == []


@pytest.mark.server  # (faults: the newest Python runs them)
def test_a_restart_that_loses_a_threads_line_is_a_lost_lease_and_turns_go_on(
    own_redis: Server, namespace: str
) -> None:
    """Redis restarted empty while a thread holds a key: its release finds the turn gone
    (LeaseLost, after the work ran), on a new connection; the next turns go on."""
    backend = RedisBackend.from_url(own_redis.url, namespace=namespace)
    queue = KeyedQueue(backend=backend)
    try:
        assert _turn(queue, "k", 1, 5) == 1
        ran: list[int] = []

        def restart() -> None:
            own_redis.stop(kill=True)
            own_redis.start()  # empty: the line, and this lease, are gone
            ran.append(1)

        with pytest.raises(LeaseLost, match="'k'"):
            queue.run_sync("k", restart)
        assert ran == [1]
        assert _turn(queue, "k", 2, 5) == 2
    finally:
        asyncio.run(backend.aclose())


@pytest.mark.parametrize("refusal", ["permission", "memory"])
def test_a_refusal_after_the_start_reaches_a_thread_named(
    own_redis: Server, namespace: str, refusal: str
) -> None:
    """Redis refuses a thread's enqueue on the thread's own connection: the turn is not
    taken, the work does not run, and the error names the cause (as a task's does)."""
    admin = redis.Redis.from_url(own_redis.url)
    user = f"u{uuid.uuid4().hex[:8]}"
    admin.acl_setuser(
        user, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all"]
    )
    url = own_redis.url.replace("redis://", f"redis://{user}:pw@")
    backend = RedisBackend.from_url(url, namespace=namespace)
    queue = KeyedQueue(backend=backend)
    ran: list[int] = []
    try:
        assert _turn(queue, "warm", 1, 5) == 1  # started; the thread has its connection
        if refusal == "permission":
            admin.acl_setuser(user, commands=["-evalsha"])
        else:
            admin.config_set("maxmemory-policy", "noeviction")
            admin.config_set("maxmemory", 1)
        named = "lacks a permission" if refusal == "permission" else "out of memory"
        with pytest.raises(BackendUnavailable, match=named) as caught:
            queue.run_sync("k", ran.append, 1)
        assert "did not run" in str(caught.value)
        assert ran == []
    finally:
        admin.config_set("maxmemory", 0)
        admin.acl_setuser(user, commands=["+@all"])
        asyncio.run(backend.aclose())
        admin.close()


@pytest.mark.server  # (faults: the newest Python runs them)
def test_a_sentinel_clients_threads_block_natively_and_ride_a_failover(
    sentinel_setup: SentinelSetup, namespace: str
) -> None:
    """Threads' connections on a Sentinel client go to the master its sync twin discovers:
    a failover is a lost lease for the thread that held the key (LeaseLost, after the work
    ran), and the next turn goes on, on the new master."""
    sentinel = Sentinel([("127.0.0.1", sentinel_setup.port)])
    client = sentinel.master_for(SentinelSetup.NAME)
    backend = RedisBackend(client, namespace=namespace, lease=2, owns_client=True)
    # (threads' turns, so the share and its discovery of the master live on the backend loop)
    assert backend.capabilities.blocking
    queue = KeyedQueue(backend=backend)
    try:
        assert _turn(queue, "k", 1, 5) == 1
        assert _turn(queue, "k", 2, 5) == 2  # (its own connection, to the master)

        def fail_over() -> None:
            sentinel_setup.fail_over()
            turn = current_turn()
            deadline = time.monotonic() + PATIENCE
            while not turn.lease_lost and time.monotonic() < deadline:
                time.sleep(0.05)  # (polls a state: the heartbeat learns the server changed)

        with pytest.raises(LeaseLost, match="'k'"):
            queue.run_sync("k", fail_over)
        assert _turn(queue, "k", 3, PATIENCE) == 3
    finally:
        asyncio.run(backend.aclose())
        # (the sentinels' clients discovered the master on the backend loop: closed there)
        for each in sentinel.sentinels:
            asyncio.run_coroutine_threadsafe(each.aclose(), backend_loop()).result(PATIENCE)


@pytest.mark.server  # (faults: the newest Python runs them)
def test_a_threads_turn_held_past_its_lease_is_renewed_and_stays_its_own(
    redis_url: str, namespace: str
) -> None:
    """The heartbeat renews a thread's lease as a task's: held for three leases, the key is
    still the thread's (another process's try-lock fails), and the turn ends without loss."""
    lease = 0.5
    backend = RedisBackend.from_url(redis_url, namespace=namespace, lease=lease)
    other = RedisBackend.from_url(redis_url, namespace=namespace, lease=lease)
    queue, rival = KeyedQueue(backend=backend), KeyedQueue(backend=other)
    try:
        assert _turn(queue, "warm", 1, 5) == 1  # (the share and its heartbeat run)
        assert _turn(rival, "warm", 1, 5) == 1  # (so its try-lock below asks Redis)
        with queue.keyed("k") as turn:
            threading.Event().wait(3 * lease)  # outlast the lease: only renewals keep it
            with pytest.raises(TimeoutError):
                _turn(rival, "k", 2, 0)
            assert not turn.lease_lost
    finally:
        asyncio.run(backend.aclose())
        asyncio.run(other.aclose())
