"""The Redis backend against a real server: processes, crashes, leases, fencing, clean-up.

Several backends in one process (each with its own client, subscription and
heartbeat, as a process has) stand for several processes where a test
needs exact control of the interleaving; real processes (tests/support/worker.py),
really killed or frozen, where the guarantee is about processes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from inturn import BackendUnavailable, KeyedQueue, LeaseLost, current_turn
from inturn.__main__ import format_lines, main
from inturn.backends import Backend
from inturn.backends.redis import RedisBackend, _takeover, _wire
from inturn.backends.redis._link import Call, Link
from inturn.backends.redis._scripts import ENQUEUE, LEAVE
from inturn.backends.redis._wire import Frames

from support.helpers import PATIENCE, checkpoints, settle
from support.processes import Worker, first_to_hold
from support.redis_checks import BackendFactory, hand_over, keys_left, waiting
from support.servers import Server

#: A short lease, so that crash recovery shows within a test.
LEASE = 1.0


@pytest.fixture
async def make_backend(redis_url: str, namespace: str) -> AsyncIterator[BackendFactory]:
    """RedisBackend(url, namespace, lease=...) for this test; all closed at its end.

    Once they are closed, the namespace must hold no key.
    """
    made: list[RedisBackend] = []

    def make(*, lease: float = LEASE, url: str = redis_url, **options: Any) -> RedisBackend:
        made.append(RedisBackend.from_url(url, namespace=namespace, lease=lease, **options))
        return made[-1]

    yield make
    for backend in made:
        await backend.aclose()
    assert await keys_left(redis_url, namespace) == []


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    """A plain client, to look at the server from the side."""
    client = aioredis.Redis.from_url(redis_url)
    yield client
    await client.aclose()


def spec(url: str, namespace: str, lease: float = LEASE) -> str:
    return f"redis:{url}#{namespace}#{lease}"


# -- several backends: the line in Redis -------------------------------------------------


async def test_the_line_in_redis_shows_the_holder_and_the_waiters_in_order(
    make_backend: BackendFactory,
) -> None:
    a, b, c = make_backend(), make_backend(), make_backend()
    gate = asyncio.Event()
    holder = asyncio.create_task(KeyedQueue(backend=a).run("k", gate.wait))
    await waiting(a, 0)
    second = asyncio.create_task(KeyedQueue(backend=b).run("k", lambda: "b"))
    await waiting(a, 1)
    third = asyncio.create_task(KeyedQueue(backend=c).run("k", lambda: "c"))
    line = await waiting(a, 2)
    assert line.key == "k"
    assert line.holder is not None
    assert line.holder.pid == os.getpid()
    assert 0 < line.holder.lease_left <= LEASE
    assert [w.pid for w in line.waiters] == [os.getpid()] * 2
    assert "held by" in format_lines([line], "ns")
    gate.set()
    assert await asyncio.gather(holder, second, third) == [True, "b", "c"]
    assert await a.lines() == []


async def test_turns_go_in_the_order_submissions_reached_redis(
    make_backend: BackendFactory,
) -> None:
    backends = [make_backend() for _ in range(5)]
    gate = asyncio.Event()
    order: list[int] = []

    async def work(i: int) -> None:
        order.append(i)
        if i == 0:
            await gate.wait()

    tasks = [asyncio.create_task(KeyedQueue(backend=backends[0]).run("k", work, 0))]
    await settle(lambda: order == [0])
    for n, i in enumerate((3, 1, 4, 2), 1):
        tasks.append(asyncio.create_task(KeyedQueue(backend=backends[i]).run("k", work, i)))
        await waiting(backends[0], n)
    gate.set()
    await asyncio.gather(*tasks)
    assert order == [0, 3, 1, 4, 2]


async def test_a_release_wakes_the_next_holder_without_waiting_for_a_heartbeat(
    make_backend: BackendFactory,
) -> None:
    # With an hour-long lease the heartbeat never runs within the test: only
    # the release's own push can hand the key over.
    assert await hand_over(make_backend(lease=3600), make_backend(lease=3600)) == "next"


async def test_a_client_speaking_resp3_hands_turns_over_too(
    make_backend: BackendFactory,
) -> None:
    # RESP3 (protocol=3) sends grants as push messages, and replies in its own types.
    assert await hand_over(make_backend(protocol=3), make_backend(protocol=3)) == "next"


def test_replies_split_anywhere_across_reads_reach_their_calls_in_order() -> None:
    frames = (
        b"*2\r\n:1\r\n$16\r\n1795451826758776\r\n",  # enqueue: held, with its token
        b">3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$3\r\nabc\r\n",  # a push: nobody's reply
        b"|1\r\n+ttl\r\n:3600\r\n*2\r\n:0\r\n:3\r\n",  # an attribute, then: third in line
        b":1\r\n",  # leave
        b"-ERR something went wrong\r\n",
        b"!21\r\nSYNTAX invalid syntax\r\n",  # a blob error
        b"%1\r\n+a\r\n,1.5\r\n",  # a map
        b"$-1\r\n",
    )
    expected = [
        [1, b"1795451826758776"],
        [0, 3],
        1,
        "ERR something went wrong",
        "SYNTAX invalid syntax",
        [b"a", 1.5],
        None,
    ]

    def feed(chunks: list[bytes]) -> list[Any]:
        async def run() -> list[Any]:
            link = Link(lambda: None, b"", lambda greeting: None, LEASE)
            loop = asyncio.get_running_loop()
            calls = [Call(ENQUEUE.index, b"", loop.create_future()) for _ in expected]
            link._sent.extend(calls)
            reader = Frames(link.got)
            for chunk in chunks:
                reader.feed(chunk)
            assert not link._sent
            assert not len(reader)
            return [
                str(c.future.exception()) if c.future.exception() else c.future.result()
                for c in calls
            ]

        return asyncio.run(run())

    data = b"".join(frames)
    assert feed([data]) == expected
    assert feed([data[i : i + 1] for i in range(len(data))]) == expected
    for cut in range(1, len(data)):
        assert feed([data[:cut], data[cut:]]) == expected


class WrappedWriter:
    """A stand-in for what a future redis-py might keep in ``_writer``: not a StreamWriter."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._inner = writer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class RenamedInternals(aioredis.Connection):
    """A redis-py connection whose private internals are not what the takeover expects."""

    async def connect(self) -> None:
        await super().connect()
        if self._writer is not None and not isinstance(self._writer, WrappedWriter):
            self._writer = WrappedWriter(self._writer)  # type: ignore[assignment]


async def test_unknown_redis_py_internals_fall_back_to_its_public_api(
    make_backend: BackendFactory,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_takeover, "ENABLED", True)
    monkeypatch.setattr(_wire, "_warned", False)
    a = make_backend(connection_class=RenamedInternals)
    b = make_backend(connection_class=RenamedInternals)
    assert await hand_over(a, b) == "next"
    warned = [r.getMessage() for r in caplog.records if "cannot take over" in r.getMessage()]
    assert len(warned) == 1  # once per process, however many connections
    assert "WrappedWriter" in warned[0]


async def test_a_grant_whose_message_is_lost_still_arrives(
    make_backend: BackendFactory, client: aioredis.Redis
) -> None:
    a, b = make_backend(), make_backend()
    gate = asyncio.Event()
    holder = asyncio.create_task(KeyedQueue(backend=a).run("k", gate.wait))
    await waiting(a, 0)
    follower = asyncio.create_task(KeyedQueue(backend=b).run("k", lambda: "next"))
    await waiting(a, 1)
    # Cut every subscription: the push of the release goes nowhere.
    await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    gate.set()
    assert await asyncio.wait_for(follower, 10) == "next"
    await holder


async def test_timeout_while_another_process_holds_leaves_no_trace(
    make_backend: BackendFactory,
) -> None:
    a, b = make_backend(), make_backend()
    gate = asyncio.Event()
    holder = asyncio.create_task(KeyedQueue(backend=a).run("k", gate.wait))
    await waiting(a, 0)
    queue = KeyedQueue(backend=b)
    ran: list[str] = []
    with pytest.raises(TimeoutError, match="'k'"):
        async with queue.keyed("k", timeout=0.05):
            ran.append("ran")
    await waiting(a, 0)  # its place was given up
    gate.set()
    await holder
    assert ran == []


async def test_a_cancelled_waiter_leaves_and_the_one_behind_goes_next(
    make_backend: BackendFactory,
) -> None:
    a, b, c = make_backend(), make_backend(), make_backend()
    gate = asyncio.Event()
    order: list[str] = []
    holder = asyncio.create_task(KeyedQueue(backend=a).run("k", gate.wait))
    await waiting(a, 0)
    leaving = asyncio.create_task(KeyedQueue(backend=b).run("k", order.append, "leaving"))
    await waiting(a, 1)
    following = asyncio.create_task(KeyedQueue(backend=c).run("k", order.append, "next"))
    await waiting(a, 2)
    leaving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await leaving
    await waiting(a, 1)
    gate.set()
    await asyncio.gather(holder, following)
    assert order == ["next"]


async def test_a_waiter_cancelled_as_it_is_granted_passes_the_turn_on(
    make_backend: BackendFactory,
) -> None:
    a, b, c = make_backend(), make_backend(lease=3600), make_backend()
    order: list[str] = []
    gate = asyncio.Event()
    victim: list[asyncio.Task[Any]] = []

    async def holder() -> None:
        await KeyedQueue(backend=a).run("k", gate.wait)
        # The release's script has granted the victim in Redis; its process
        # has not heard yet. Cancel it now: it must pass the key on.
        victim[0].cancel()

    first = asyncio.create_task(holder())
    await waiting(a, 0)
    victim.append(asyncio.create_task(KeyedQueue(backend=b).run("k", order.append, "victim")))
    await waiting(a, 1)
    following = asyncio.create_task(KeyedQueue(backend=c).run("k", order.append, "next"))
    await waiting(a, 2)
    # The victim's process stops hearing grants (its heartbeat, with an hour's
    # lease, does not run within the test either).
    inbox = b._session().inbox
    assert inbox is not None
    inbox.heard = lambda data: None
    gate.set()
    await first
    await asyncio.gather(victim[0], following, return_exceptions=True)
    assert victim[0].cancelled()
    assert order == ["next"]


async def test_tokens_only_grow_and_reach_current_turn(make_backend: BackendFactory) -> None:
    a, b = make_backend(), make_backend()
    seen: list[int] = []
    first = KeyedQueue(backend=a)

    @first.queue_by_key(key="order-{n}")
    async def settle_order(n: int) -> None:
        turn = current_turn()
        assert turn is not None
        assert turn.keys == (f"order-{n}",)
        seen.append(turn.token)

    for _ in range(3):
        await settle_order(1)
        async with KeyedQueue(backend=b).keyed("order-1") as turn:
            seen.append(turn.token)
    assert seen == sorted(set(seen))


async def test_several_keys_in_opposite_orders_do_not_deadlock(
    make_backend: BackendFactory,
) -> None:
    a, b = make_backend(), make_backend()
    held: list[tuple[Any, ...]] = []

    async def both(backend: RedisBackend, *keys: Any) -> None:
        queue = KeyedQueue(backend=backend)
        for _ in range(10):
            async with queue.keyed(*keys) as turn:
                held.append(turn.keys)
                assert set(turn.tokens) == set(keys)
                await checkpoints()

    await asyncio.wait_for(asyncio.gather(both(a, "x", b"y", 7), both(b, 7, b"y", "x")), 20)
    assert len(held) == 20
    assert len(set(held)) == 1


async def test_namespaces_keep_apps_apart(redis_url: str, make_backend: BackendFactory) -> None:
    other = RedisBackend.from_url(redis_url, namespace=f"other-{uuid.uuid4().hex[:8]}")
    try:
        async with (
            KeyedQueue(backend=make_backend()).keyed("k"),
            KeyedQueue(backend=other).keyed("k", timeout=0),
        ):
            pass  # the same key in another namespace was free
    finally:
        await other.aclose()


async def test_every_key_of_a_line_carries_a_ttl(
    make_backend: BackendFactory, client: aioredis.Redis, namespace: str
) -> None:
    a, b = make_backend(), make_backend()
    gate = asyncio.Event()
    holder = asyncio.create_task(KeyedQueue(backend=a).run("k", gate.wait))
    await waiting(a, 0)
    follower = asyncio.create_task(KeyedQueue(backend=b).run("k", lambda: None))
    await waiting(a, 1)
    names = [key async for key in client.scan_iter(match=f"inturn:{{{namespace}:*")]
    assert len(names) == 4  # line, q, lease, info: one hash slot, one line
    assert len({name.split(b"}")[0] for name in names}) == 1
    for name in names:
        assert 0 < await client.pttl(name) <= 3 * LEASE * 1000
    gate.set()
    await asyncio.gather(holder, follower)


@pytest.mark.parametrize("marked", [True, False], ids=["marked", "unmarked"])
async def test_a_leave_that_overtakes_its_enqueue_leaves_no_member(
    make_backend: BackendFactory,
    client: aioredis.Redis,
    redis_url: str,
    namespace: str,
    marked: bool,
) -> None:
    """Issue 42: a thread that gives up while its enqueue's reply is unread may send its leave
    on another connection, and Redis may run the leave first. Marked (no answer to the
    enqueue was read), the leave makes the enqueue a no-op when it comes; unmarked (as
    every leave was before the fix), the enqueue makes a member that nobody renews, and it
    holds the key for a lease (the interrupt storm's ghost, in two calls)."""
    backend = make_backend(lease=10.0)
    names = backend._line_for("k").names
    config = backend._config
    mark = b"1" if marked else b"0"
    leave = (5, *names, "m/1", config.ttl_ms, config.channels)
    assert await client.eval(LEAVE.body, *leave, mark, b"") == 0  # first: in neither place
    enqueue = ("m/1", config.lease_ms, config.ttl_ms, config.channels, b"host 1 0", b"s:k", b"")
    reply = await client.eval(ENQUEUE.body, 5, *names, *enqueue)
    if marked:
        assert reply == 0  # it left before it came: nothing is held, nothing waits
        assert await backend.lines() == []
        assert await keys_left(redis_url, namespace) == []  # (the mark went with it)
    else:
        assert reply > 0  # the ghost: it holds the key (this token), and nobody renews it
        assert [line.holder is not None for line in await backend.lines()] == [True]
        assert await client.eval(LEAVE.body, *leave, b"0", b"") == 1


async def test_a_hand_off_calls_redis_only_for_what_it_does_not_know(
    own_redis: Server,
) -> None:
    """A release that hands the key on, and an enqueue behind a holder, read the holder
    once and never ask again whether the key is free; the release leaves the line's TTLs
    (its members' enqueues and renewals keep them), which still hold after it."""
    # Before: the release read the holder three times and asked whether the key was
    # free, then whether the line was empty, and set four TTLs; the enqueue read the
    # holder twice and asked twice whether the key was free.
    client = aioredis.Redis.from_url(own_redis.url)
    backend = RedisBackend.from_url(own_redis.url, namespace="calls", lease=LEASE)
    try:
        names = backend._line_for("k").names
        config = backend._config
        tail = (config.lease_ms, config.ttl_ms, config.channels, b"host 1 0", b"s:k", b"")
        for member in ("a/1", "b/1"):  # a holds, b waits
            await client.eval(ENQUEUE.body, 5, *names, member, *tail)
        await client.config_resetstat()
        assert await client.eval(ENQUEUE.body, 5, *names, "c/1", *tail) == -2  # second in line
        enqueued = await client.info("commandstats")
        await client.config_resetstat()
        leave = (5, *names, "a/1", config.ttl_ms, config.channels, b"0", b"")
        assert await client.eval(LEAVE.body, *leave) == 1  # b holds now, c waits
        left = await client.info("commandstats")
        calls = {
            name: {k[len("cmdstat_") :]: v["calls"] for k, v in stats.items()}
            for name, stats in (("enqueue", enqueued), ("leave", left))
        }
        assert calls["enqueue"].get("hget") == 1, calls
        assert "hexists" not in calls["enqueue"], calls
        assert calls["leave"].get("hget") == 2, calls  # the holder; the last token
        assert not {"hexists", "zcard", "pexpire"} & calls["leave"].keys(), calls
        assert [line.holder is not None for line in await backend.lines()] == [True]
        for name in names[:4]:
            assert 0 < await client.pttl(name) <= 3 * LEASE * 1000
    finally:
        await backend.aclose()
        await client.aclose()


async def test_keys_other_than_str_bytes_int_are_refused(make_backend: BackendFactory) -> None:
    queue = KeyedQueue(backend=make_backend())
    with pytest.raises(TypeError, match=r"\(tuple\) cannot name a line shared between processes"):
        await queue.run(("a", 1), lambda: None)
    with pytest.raises(TypeError, match="float"):
        queue.keyed("a", 2.5)
    async with queue.keyed(1), KeyedQueue(backend=make_backend()).keyed("1", timeout=0):
        pass  # 1 and "1" are different lines


async def test_scripts_are_loaded_once_and_called_by_sha(own_redis: Server) -> None:
    backend = RedisBackend.from_url(own_redis.url, namespace="sha", lease=LEASE)
    client = aioredis.Redis.from_url(own_redis.url)
    try:
        queue = KeyedQueue(backend=backend)
        for i in range(5):
            await queue.run(f"k{i}", lambda: None)
        stats = await client.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] >= 10
        assert "cmdstat_eval" not in stats
    finally:
        await backend.aclose()
        await client.aclose()


async def test_scripts_flushed_from_redis_are_sent_again_in_order(
    make_backend: BackendFactory, client: aioredis.Redis
) -> None:
    queue = KeyedQueue(backend=make_backend())
    await queue.run("k", lambda: None)
    await client.script_flush()  # the backend's connection stays open, its scripts are gone
    order: list[int] = []
    await asyncio.gather(*(queue.run("k", order.append, i) for i in range(5)))
    assert order == [0, 1, 2, 3, 4]


async def test_a_caller_supplied_client_is_left_open(redis_url: str, namespace: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    backend = RedisBackend(client, namespace=namespace)
    assert isinstance(backend, Backend)
    await KeyedQueue(backend=backend).run("k", lambda: None)
    await backend.aclose()
    assert await client.ping()
    await client.aclose()


def test_bad_settings_are_refused_at_construction(redis_url: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        RedisBackend.from_url(redis_url, namespace="a{b}")
    with pytest.raises(ValueError, match="lease"):
        RedisBackend.from_url(redis_url, lease=0)
    with pytest.raises(TypeError, match="a Redis URL must be a str, got b'redis://x'"):
        RedisBackend.from_url(b"redis://x")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("localhost:6379", "'localhost:6379' is not a Redis URL; give it with its scheme"),
        ("http://localhost:6379/0", "'http' is not a Redis URL's scheme"),
        ("postgresql://me:secret@db/0", "'postgresql' is not a Redis URL's scheme"),
        ("redis://localhost:port/0", "cannot read the Redis URL"),
        ("redis://me:secret@db:99999/0", "cannot read the Redis URL"),
        # (issue 42: redis-py reads these as localhost, silently)
        ("redis:/db.example:6379/0", "'redis:' must be followed by two slashes"),
        ("rediss:me:secret@db.example", "'rediss:' must be followed by two slashes"),
        ("REDIS:db.example", "'REDIS:' must be followed by two slashes"),
    ],
)
def test_a_wrong_url_is_refused_with_how_to_write_it(url: str, said: str) -> None:
    with pytest.raises(ValueError, match=r"^inturn: ") as refused:
        RedisBackend.from_url(url)
    message = str(refused.value)
    assert said in message
    assert "redis://" in message
    assert "rediss://" in message
    assert "unix:///" in message
    assert "secret" not in message  # (a password is never written out)
    assert refused.value.__cause__ is None  # (nor left in redis-py's error's message)


async def test_one_backend_serves_an_event_loop_in_another_thread_too(
    make_backend: BackendFactory,
) -> None:
    # One backend, two event loops at once (each thread its own queue): each
    # loop gets a session of its own, and the key is still held by one at a time.
    backend = make_backend()
    order: list[str] = []
    gate = asyncio.Event()

    async def hold() -> None:
        order.append("here")
        await gate.wait()
        order.append("here done")

    holder = asyncio.create_task(KeyedQueue(backend=backend).run("k", hold))
    await waiting(backend, 0)

    def elsewhere() -> int:
        async def job() -> int:
            async with KeyedQueue(backend=backend).keyed("k") as turn:
                order.append("there")
                return turn.token

        return asyncio.run(job())

    there = asyncio.get_running_loop().run_in_executor(None, elsewhere)
    await waiting(backend, 1)  # the other loop's waiter is in line behind the holder
    assert order == ["here"]
    gate.set()
    await holder
    assert await asyncio.wait_for(there, PATIENCE) > 0
    assert order == ["here", "here done", "there"]


# -- Redis away ---------------------------------------------------------------------------


async def test_redis_down_at_submission_is_backend_unavailable_and_nothing_runs(
    own_redis: Server,
) -> None:
    own_redis.stop()
    backend = RedisBackend.from_url(own_redis.url, namespace="down", socket_connect_timeout=1)
    queue = KeyedQueue(backend=backend)
    ran: list[str] = []
    try:
        with pytest.raises(BackendUnavailable, match="could not be reached") as caught:
            await queue.run("k", ran.append, "ran")
        assert caught.value.__cause__ is not None
        assert ran == []
        assert queue.active_count == 0
        own_redis.start()
        await queue.run("k", ran.append, "ran")  # up again: the next submission works
        assert ran == ["ran"]
    finally:
        await backend.aclose()


async def test_redis_down_after_start_is_backend_unavailable_too(own_redis: Server) -> None:
    backend = RedisBackend.from_url(own_redis.url, namespace="down", socket_connect_timeout=1)
    queue = KeyedQueue(backend=backend)
    try:
        await queue.run("k", lambda: None)
        own_redis.stop(kill=True)
        ran: list[str] = []
        with pytest.raises(BackendUnavailable):
            await queue.run("k", ran.append, "ran")
        assert ran == []
    finally:
        await backend.aclose()


async def test_a_restart_that_loses_the_line_is_a_lost_lease(own_redis: Server) -> None:
    backend = RedisBackend.from_url(own_redis.url, namespace="restart", lease=LEASE)
    queue = KeyedQueue(backend=backend)
    seen: list[bool] = []

    async def hold() -> None:
        async with queue.keyed("k") as turn:
            own_redis.stop(kill=True)
            own_redis.start()  # empty: the line, and this lease, are gone
            await settle(lambda: turn.lease_lost)
            seen.append(turn.lease_lost)

    try:
        with pytest.raises(LeaseLost, match="'k'"):
            await hold()
        assert seen == [True]
    finally:
        await backend.aclose()


async def test_a_dropped_connection_while_holding_keeps_the_turn(
    make_backend: BackendFactory, client: aioredis.Redis
) -> None:
    lease = 0.3
    a, b = make_backend(lease=lease), make_backend(lease=lease)
    order: list[str] = []
    gate = asyncio.Event()

    async def hold() -> None:
        order.append("a in")
        await gate.wait()
        order.append("a out")

    holder = asyncio.create_task(KeyedQueue(backend=a).run("k", hold))
    await settle(lambda: order == ["a in"])
    follower = asyncio.create_task(KeyedQueue(backend=b).run("k", order.append, "b"))
    await waiting(a, 1)
    await client.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    await client.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
    # Leases run out several times over while the holder holds: its
    # heartbeat reconnects and renews, so the key never moves.
    await asyncio.sleep(5 * lease)  # the span of time is the point here, not an ordering
    assert order == ["a in"]
    gate.set()
    await asyncio.gather(holder, follower)  # and no LeaseLost
    assert order == ["a in", "a out", "b"]


# -- real processes ---------------------------------------------------------------------


async def test_no_lost_update_across_four_processes(
    redis_url: str,
    namespace: str,
    make_backend: BackendFactory,
    client: aioredis.Redis,
    workers: list[Worker],
) -> None:
    counter = f"counter-{namespace}"
    workers += [
        await Worker.start(
            spec(redis_url, namespace), "increment-redis", "k", counter, "100", name=str(i)
        )
        for i in range(4)
    ]
    for worker in workers:
        await worker.expect("done")
        assert await worker.finish() == 0
    assert int(await client.get(counter)) == 400
    await client.delete(counter)


async def test_turns_go_in_arrival_order_across_processes(
    redis_url: str, namespace: str, make_backend: BackendFactory, workers: list[Worker]
) -> None:
    observer = make_backend()
    for i in range(4):
        workers.append(await Worker.start(spec(redis_url, namespace), "hold", "k", name=f"w{i}"))
        if i == 0:
            await workers[0].expect("holding")
        await waiting(observer, i)
    order = ["w0"]
    holder = workers[0]
    for _ in range(3):
        await holder.release()
        # Whoever of the rest reports holding first got the turn.
        holder = await first_to_hold([w for w in workers if w.name not in order])
        order.append(holder.name)
    assert order == ["w0", "w1", "w2", "w3"]
    await holder.release()


async def test_a_killed_holder_is_replaced_within_its_lease(
    redis_url: str, namespace: str, make_backend: BackendFactory, workers: list[Worker]
) -> None:
    holder = await Worker.start(spec(redis_url, namespace), "hold", "k")
    workers.append(holder)
    await holder.expect("holding")
    backend = make_backend()
    ran: list[str] = []
    waiter = asyncio.create_task(KeyedQueue(backend=backend).run("k", ran.append, "next"))
    await waiting(backend, 1)
    holder.kill()
    # within the lease, plus a heartbeat of the waiter, plus a generous margin
    await asyncio.wait_for(waiter, LEASE + LEASE / 3 + 5)
    assert ran == ["next"]
    assert await backend.lines() == []  # nothing of the dead process is left


async def test_a_killed_waiter_holds_nobody_up(
    redis_url: str, namespace: str, make_backend: BackendFactory, workers: list[Worker]
) -> None:
    observer = make_backend()
    holder = await Worker.start(spec(redis_url, namespace), "hold", "k", name="holder")
    await holder.expect("holding")
    doomed = await Worker.start(spec(redis_url, namespace), "hold", "k", name="doomed")
    await waiting(observer, 1)
    survivor = await Worker.start(spec(redis_url, namespace), "hold", "k", name="survivor")
    await waiting(observer, 2)
    workers += [holder, doomed, survivor]
    doomed.kill()
    await doomed.process.wait()
    await holder.release()
    words = await asyncio.wait_for(survivor.expect("holding"), LEASE + LEASE / 3 + 5)
    assert int(words[0]) > 0
    await survivor.release()


async def test_a_holder_frozen_past_its_lease_is_told_and_raises_lease_lost(
    redis_url: str, namespace: str, make_backend: BackendFactory, workers: list[Worker]
) -> None:
    frozen = await Worker.start(spec(redis_url, namespace), "hold", "k")
    workers.append(frozen)
    (token,) = await frozen.expect("holding")
    backend = make_backend()
    os.kill(frozen.pid, signal.SIGSTOP)
    try:
        # Another process gets the key once the frozen one's lease ran out...
        async with KeyedQueue(backend=backend).keyed("k", timeout=LEASE + 5) as turn:
            assert turn.token > int(token)  # ... with a larger fencing token
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    await frozen.go()
    await frozen.expect("lease-lost")  # turn.lease_lost, inside the block
    await frozen.expect("raised")  # and LeaseLost at its end


async def test_inspect_prints_the_live_lines(
    redis_url: str,
    namespace: str,
    make_backend: BackendFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = make_backend(), make_backend()
    gate = asyncio.Event()
    holder = asyncio.create_task(KeyedQueue(backend=a).run("order-17", gate.wait))
    await waiting(a, 0)
    follower = asyncio.create_task(KeyedQueue(backend=b).run("order-17", lambda: None))
    await waiting(a, 1)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(
        None, main, ["inspect", "--redis", redis_url, "--namespace", namespace]
    )
    out = capsys.readouterr().out
    assert f"namespace {namespace!r}: 1 active line" in out
    assert "'order-17'" in out
    assert f"held by {os.uname().nodename} pid {os.getpid()}" in out
    assert "    1. " in out
    gate.set()
    await asyncio.gather(holder, follower)


def test_a_client_without_pubsub_is_refused_at_construction() -> None:
    class OldClusterClient:  # redis-py's asyncio RedisCluster before 8.0
        pass

    with pytest.raises(TypeError, match=r"no pub/sub.*redis-py 8\.0"):
        RedisBackend(OldClusterClient())  # type: ignore[arg-type]


def test_the_backends_repr_names_its_server_briefly_and_no_secret() -> None:
    backend = RedisBackend.from_url("redis://app:s3cret@127.0.0.1:6390/2", namespace="shop")
    assert repr(backend) == "RedisBackend('127.0.0.1:6390/2', namespace='shop')"
    unix = RedisBackend.from_url("unix:///run/redis.sock", namespace="shop")
    assert repr(unix) == "RedisBackend('unix:///run/redis.sock', namespace='shop')"
