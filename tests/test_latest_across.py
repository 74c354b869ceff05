"""Latest wins across processes (``across="processes"``), on the file and Redis backends.

Several queues, each with a backend of its own on one place (a directory, a
Redis namespace), share the key's line as processes do: the backend cannot
tell them from processes (each queue keeps its own lines and its own latest
work). Driven by events and the line's own state; the real processes, and
their deaths, are in test_latest_across_processes.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from inturn import KeyedQueue, Superseded
from inturn.backends import LocalBackend
from inturn.backends.file import FileBackend
from inturn.backends.file._latest import judge
from inturn.backends.file._linefile import Post, Ran, joined, parse, ran_record, render
from inturn.backends.postgres import PostgresBackend
from inturn.backends.redis import RedisBackend

from support.file_checks import line_file
from support.helpers import PATIENCE, settle, wait_until
from support.latest_across import Holder, Runs, Shared, latest, posts


@pytest.fixture(params=["file", "redis", "postgres"])
def shared(request: pytest.FixtureRequest, tmp_path: Path, namespace: str) -> Iterator[Shared]:
    """Where the test's queues share their lines: a directory, a Redis namespace, or a
    PostgreSQL one. (An async test closes the PostgreSQL backends it made: closed_after.)"""
    url = None if request.param == "file" else request.getfixturevalue(f"{request.param}_url")
    place = Shared(tmp_path, url, namespace)
    yield place
    place.close()


@pytest.fixture(autouse=True)
async def closed_after(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Close the PostgreSQL backends a test's Shared made, on the test's loop (their
    connections would be left to the collector, which warns)."""
    yield
    place = request.node.funcargs.get("shared")
    if isinstance(place, Shared) and asyncio.iscoroutinefunction(request.function):
        await place.aclose()


async def test_a_burst_spread_over_processes_runs_once_the_newest(shared: Shared) -> None:
    holder = Holder(shared)
    await holder.hold()
    modes = ("join", "raise", "join")
    queues = [latest(shared, on_superseded=mode) for mode in modes]
    ran = Runs()
    calls = []
    for n in range(9):  # process by process, each one's burst after the one before queued
        queue = queues[n // 3]
        calls.append(asyncio.create_task(queue.run("k", ran.work(f"{n}"))))
        # (the first waits at the backend; a "raise" caller replaced is answered at once)
        waiting = n % 3 if modes[n // 3] == "join" else min(n % 3, 1)
        await settle(
            lambda q=queue, w=waiting, n=n: (q.pending("k"), posts(shared)) == (w, n // 3 + 1)
        )
    await holder.release()
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    assert ran == ["8"]  # one run: the newest
    assert outcomes[:3] == [None, None, None]  # "join", in another process: None, it returned
    assert all(isinstance(outcome, Superseded) for outcome in outcomes[3:6])  # "raise"
    assert "in another process" in str(outcomes[3])
    assert outcomes[6:] == ["8", "8", "8"]  # its own process: the newest's outcome
    assert [queue.stats().superseded for queue in queues] == [3, 3, 2]
    assert [queue.stats().completed for queue in queues] == [0, 0, 1]
    assert shared.empty()  # nothing is left in line


class Missed(list[tuple[BaseException, str | None]]):
    """An observer that keeps the error of each turn that never started."""

    def started(self, waited: float, function: str | None) -> None:
        pass

    def ended(self, held: Any, error: Any, cut: bool, function: str | None) -> None:
        pass

    def missed(self, error: BaseException, function: str | None) -> None:
        self.append((error, function))


async def test_the_observer_hears_of_each_work_replaced_in_its_process(shared: Shared) -> None:
    holder = Holder(shared)
    await holder.hold()
    older, newer = latest(shared), latest(shared)
    heard = Missed()
    older.observe(heard)
    ran = Runs()

    async def sync() -> str:
        return await ran.work("older")()

    calls = [asyncio.create_task(older.run("k", sync)) for _ in range(3)]
    await settle(lambda: older.pending("k") == 2 and posts(shared) == 1)
    last = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(shared) == 2)
    await holder.release()
    assert await asyncio.gather(*calls, last) == [None, None, None, "newer"]
    assert len(heard) == 3  # the 3 replaced works: 2 in this process, 1 by the other's
    assert all(isinstance(error, Superseded) for error, _ in heard)
    assert {function for _, function in heard} == {f"{sync.__module__}.{sync.__qualname__}"}


async def test_a_join_caller_learns_that_the_newer_work_failed(shared: Shared) -> None:
    holder = Holder(shared)
    await holder.hold()
    older, newer = latest(shared), latest(shared)

    async def fails() -> None:
        raise ValueError("the sync failed")

    first = asyncio.create_task(older.run("k", Runs().work("older")))
    await settle(lambda: posts(shared) == 1)
    second = asyncio.create_task(newer.run("k", fails))
    await settle(lambda: posts(shared) == 2)
    await holder.release()
    with pytest.raises(ValueError, match="the sync failed"):
        await second
    with pytest.raises(Superseded, match="failed there"):
        await first


async def test_work_called_after_the_newest_started_runs_after_it(shared: Shared) -> None:
    """The running work is never replaced: a call that comes while it runs runs next."""
    holder = Holder(shared)
    await holder.hold()
    one, two = latest(shared), latest(shared)
    started, go_on = asyncio.Event(), asyncio.Event()
    ran = Runs()

    async def slow() -> str:
        ran.append("first")
        started.set()
        await go_on.wait()
        return "first"

    first = asyncio.create_task(one.run("k", slow))
    await settle(lambda: posts(shared) == 1)
    await holder.release()
    await started.wait()
    later = asyncio.create_task(two.run("k", ran.work("later")))
    await settle(lambda: posts(shared) == 2)
    go_on.set()
    assert await asyncio.gather(first, later) == ["first", "later"]
    assert ran == ["first", "later"]


@pytest.mark.parametrize("leaves", ["cancelled", "timed out"])
async def test_when_the_newer_caller_leaves_the_older_work_runs(
    shared: Shared, leaves: str
) -> None:
    """A newer work whose caller gives up before the key's turn is not waiting any more: the
    older work, whose caller still waits, runs (as it does when the newer one's process dies)."""
    holder = Holder(shared)
    await holder.hold()
    older = latest(shared)
    # (long enough to post first: PostgreSQL's turn connects, and readies the connection)
    patience = 2.0 if shared.kind == "postgres" else 0.05
    newer = latest(shared, timeout=patience if leaves == "timed out" else None)
    ran = Runs()
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: posts(shared) == 1)
    second = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(shared) == 2)
    if leaves == "cancelled":
        second.cancel()
    with pytest.raises(asyncio.CancelledError if leaves == "cancelled" else TimeoutError):
        await second
    await holder.release()
    assert await first == "older"
    assert ran == ["older"]


def test_threads_of_several_processes_run_the_newest_once(shared: Shared) -> None:
    async def holding() -> tuple[Holder, asyncio.AbstractEventLoop]:
        holder = Holder(shared)
        await holder.hold()
        return holder, asyncio.get_running_loop()

    loop = asyncio.new_event_loop()
    holder, _ = loop.run_until_complete(holding())
    queues = [latest(shared), latest(shared, on_superseded="raise")]
    ran: list[str] = []
    outcomes: dict[str, Any] = {}

    def call(queue: KeyedQueue, name: str) -> threading.Thread:
        def run() -> None:
            try:
                outcomes[name] = queue.run_sync("k", ran.append, name)
            except Superseded as error:
                outcomes[name] = error

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    threads = []
    for n, queue in enumerate([queues[0], queues[0], queues[1], queues[1]]):
        threads.append(call(queue, f"{n}"))
        wait_until(lambda n=n: posts(shared) == n // 2 + 1, f"call {n} is in line")
        wait_until(lambda q=queue, n=n: q.pending("k") == n % 2, f"call {n} waits")
    loop.run_until_complete(holder.release())
    loop.run_until_complete(holder.queue.aclose())
    loop.run_until_complete(loop.shutdown_asyncgens())  # (a Redis backend's share ends here)
    loop.close()
    for thread in threads:
        thread.join(PATIENCE)
    for queue in queues:  # (the threads' connections: PostgreSQL keeps them between turns)
        asyncio.run(queue.aclose())
    assert ran == ["3"]
    assert outcomes["0"] is None
    assert outcomes["1"] is None
    assert isinstance(outcomes["2"], Superseded)
    assert outcomes["3"] is None  # (ran.append's result, in its own process)


async def test_the_decorator_and_submit_conflate_across_processes(shared: Shared) -> None:
    holder = Holder(shared)
    await holder.hold()
    one, two = latest(shared), latest(shared)
    ran = Runs()

    @one.queue_by_key(key="k")
    async def sync_manifest(version: int) -> int:
        ran.append(f"decorated {version}")
        return version

    decorated = asyncio.create_task(sync_manifest(1))
    await settle(lambda: posts(shared) == 1)
    handle = await two.submit("k", ran.work("submitted"))
    await settle(lambda: posts(shared) == 2)
    await holder.release()
    assert await decorated is None  # ("join": the newer work returned, in another process)
    assert await handle == "submitted"
    assert ran == ["submitted"]


async def test_per_process_conflation_stays_the_default(shared: Shared) -> None:
    holder = Holder(shared)
    await holder.hold()
    one = KeyedQueue(backend=shared.backend(), pending="latest")
    two = KeyedQueue(backend=shared.backend(), pending="latest")
    ran = Runs()
    first = asyncio.create_task(one.run("k", ran.work("one")))
    await settle(lambda: shared.members() == 2)
    second = asyncio.create_task(two.run("k", ran.work("two")))
    await settle(lambda: shared.members() == 3)
    await holder.release()
    assert await asyncio.gather(first, second) == ["one", "two"]
    assert posts(shared) == 0


@pytest.mark.parametrize("backend", [None, LocalBackend()])
def test_across_processes_needs_a_backend_that_keeps_it(backend: Any) -> None:
    with pytest.raises(
        ValueError, match=r'across="processes" .*\(FileBackend, RedisBackend, PostgresBackend\)'
    ):
        KeyedQueue(backend=backend, pending="latest", across="processes")


def test_across_is_one_of_its_words(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='across must be "process" or "processes"'):
        KeyedQueue(backend=FileBackend(tmp_path), across="hosts")  # type: ignore[arg-type]


# -- the line file's records, and the judgement --------------------------------------------


def test_a_compaction_keeps_the_posts_in_line_and_what_ran_newest() -> None:
    post = Post("12.0000000000ab", 500, fresh=True)
    written = (
        b"Kab\n"
        + ran_record(Ran(100, True))
        + joined("11.0000000000aa")
        + joined(post.ticket, post)
        + ran_record(Ran(300, False))
    ).decode()
    found = parse(written.splitlines())
    assert found.posts == {post.ticket: post}
    assert found.ran == Ran(300, False)
    again = parse(render(found.key, [post.ticket], found.posts, found.ran).decode().splitlines())
    assert (again.tickets, again.posts, again.ran) == (
        [post.ticket],
        {post.ticket: post},
        found.ran,
    )


def posted(*posts: Post, ran: Ran | None = None) -> list[str]:
    """A line file's records: ticket t0's, then each post's, and what ran."""
    data = joined("1.000000000000") + b"".join(joined(post.ticket, post) for post in posts)
    if ran is not None:
        data += ran_record(ran)
    return data.decode().splitlines()


def test_judge_runs_the_newest_and_hands_on_to_newer_work() -> None:
    me = "1.000000000000"
    newer = Post("2.000000000000", 200, fresh=True)
    older = Post("3.000000000000", 50, fresh=True)
    stale = Post("4.000000000000", 50, fresh=False)
    alive = {newer.ticket, older.ticket, stale.ticket}.__contains__
    assert judge(posted(older), me, 100, 0, alive) is True
    assert judge(posted(newer), me, 100, 0, alive) is False  # newer waits: again, behind it
    assert judge(posted(stale), me, 100, 0, alive) is False  # first turn: learn what it holds
    assert judge(posted(stale), me, 100, 1, alive) is True  # then only newer posts count
    assert judge(posted(newer), me, 100, 0, lambda ticket: False) is True  # its process died
    assert judge(posted(newer), me, 100, 3, alive) is True  # it never waits for ever
    assert judge(posted(newer, ran=Ran(150, True)), me, 100, 0, alive) == Ran(150, True)
    assert judge(posted(ran=Ran(80, True)), me, 100, 0, alive) is True  # older work ran
    assert judge(posted(ran=Ran(time.monotonic_ns() + 10**12, True)), me, 100, 0, alive) is True


async def test_what_ran_before_the_host_restarted_is_not_newer(tmp_path: Path) -> None:
    """A line file left behind by a process killed before a restart may say that work
    called "later" than now ran (the monotonic clock starts again): new work still runs."""
    leftover = joined("1.000000000000") + ran_record(Ran(time.monotonic_ns() + 10**15, True))
    line_file(tmp_path, "k").write_bytes(b"K6b\n" + leftover)  # (its process is gone)
    ran = Runs()
    assert await latest(tmp_path).run("k", ran.work("after the restart")) == "after the restart"
    assert ran == ["after the restart"]


class Landed(BaseException):
    """Stands for an exception a signal handler raises, or one thrown into a thread."""


async def test_an_exception_as_a_turn_leaves_its_first_place_leaves_nothing_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The older work's turn joins the line again behind newer work, then leaves its first
    place; an exception that lands as it says it is leaving still closes that place's
    ticket (else the line would wait for it as long as this process lives)."""
    from inturn.backends.file import _line

    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path), latest(tmp_path, timeout=PATIENCE / 3)
    ran = Runs()
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: posts(tmp_path) == 1)
    second = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(tmp_path) == 2)
    real, landed = _line._quit, []

    def quit_once(fd: int) -> None:  # (the first leaving: the older turn's first place)
        if not landed:
            landed.append(fd)
            raise Landed
        real(fd)

    monkeypatch.setattr(_line, "_quit", quit_once)
    await holder.release()
    with pytest.raises(Landed):
        await first  # (its caller gets the exception, as an interrupt's)
    assert await second == "newer"  # not a TimeoutError: the first place did not stay
    assert ran == ["newer"]
    async with KeyedQueue(backend=FileBackend(tmp_path)).keyed("k", timeout=PATIENCE):
        pass
    assert not line_file(tmp_path, "k").exists()


# -- Redis: the clocks, a grant after joining again, what lines() shows -------------------


def test_calls_of_one_host_compare_by_its_clock_and_of_two_by_redis_s() -> None:
    from inturn.backends.redis._latest import CLOCK, Stamp

    # one host: its monotonic clock decides, whatever Redis's conversion said
    assert Stamp("a", 200, 100) > Stamp("a", 100, 200)
    assert Stamp("a", 100, 100) >= Stamp("a", 100, 999)
    assert not Stamp("a", 100, 999) > Stamp("a", 100, 100)
    # two hosts: Redis's clock decides
    assert Stamp("a", 100, 300) > Stamp("b", 900, 200)
    assert not Stamp("a", 100, 200) >= Stamp("b", 1, 201)
    # back on this host's clock: exact if made here, else converted through Redis's
    mine = Stamp(CLOCK, 123_456, 1)
    assert mine.local(now_us=10_000, sent=5_000_000) == 123_456
    other = Stamp("x" + CLOCK, 1, 9_000)  # 1 ms before Redis read the line
    assert other.local(now_us=10_000, sent=5_000_000) == 4_000_000


def test_a_grant_it_had_before_it_joined_again_never_wakes_it() -> None:
    """A member of latest work that joined its line again waits for a new grant: a renewal's
    reply or a grant's message naming its earlier token (on its way as it joined again)
    must not hand it the key."""
    from inturn.backends.redis._lease import Leases, Member
    from inturn.backends.redis._scripts import Line

    loop = asyncio.new_event_loop()
    try:
        leases = Leases(loop, 1.0, lambda member, member_id: None, lambda: None)  # type: ignore[arg-type, return-value]
        member = Member("k", Line("ns", "k"), loop.create_future())
        leases.members["m/1"] = member
        leases.granted("m/1", 5)
        assert member.waiting is not None
        assert member.waiting.result() == 5
        member.token = 5  # (held with token 5; it joins the line again)
        member.waiting = loop.create_future()
        leases.granted("m/1", 5)  # the old grant, again
        assert not member.waiting.done()
        leases.granted("m/1", 6)  # a new grant
        assert member.waiting.result() == 6
    finally:
        loop.close()


@pytest.mark.parametrize("server", ["redis", "postgres"])
async def test_lines_shows_when_the_latest_work_of_each_member_was_called(
    request: pytest.FixtureRequest, server: str, namespace: str
) -> None:
    shared = Shared(Path(), request.getfixturevalue(f"{server}_url"), namespace)
    holder = Holder(shared)
    await holder.hold()
    queue = latest(shared)
    plain = KeyedQueue(backend=shared.backend())
    called = time.monotonic()
    calls = [asyncio.create_task(queue.run("k", Runs().work("latest")))]
    await settle(lambda: shared.members() == 2)
    calls.append(asyncio.create_task(plain.run("k", Runs().work("plain"))))
    await settle(lambda: shared.members() == 3)
    backend = queue.backend
    assert isinstance(backend, RedisBackend | PostgresBackend)
    (line,) = await backend.lines()
    assert line.holder is not None
    assert line.holder.latest_called is None
    post, other = line.waiters
    assert post.latest_called is not None
    assert 0 <= post.latest_called <= time.monotonic() - called + 0.5  # (the server's clock)
    assert other.latest_called is None
    await holder.release()
    assert await asyncio.gather(*calls) == ["latest", "plain"]
    await shared.aclose()


async def test_latest_work_on_a_free_key_takes_it_in_one_round_trip_on_redis(
    redis_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Latest work that starts its key's line anew has nothing to judge (nothing ran in the
    line, nobody waits behind it): its turn costs the enqueue's round trip, as a plain
    turn's does; a turn whose line was there judges."""
    from inturn.backends.redis._calls import Calls

    judged: list[str] = []
    real = Calls.judge

    def counted(self: Calls, member: Any, member_id: str) -> Any:
        judged.append(member_id)
        return real(self, member, member_id)

    monkeypatch.setattr(Calls, "judge", counted)
    shared = Shared(Path(), redis_url, namespace)
    queue = latest(shared)
    assert await queue.run("k", Runs().work("alone")) == "alone"
    assert judged == []
    holder = Holder(shared)
    await holder.hold()
    waits = asyncio.create_task(queue.run("k", Runs().work("behind")))
    await settle(lambda: shared.posts() == 1)
    await holder.release()
    assert await waits == "behind"
    assert len(judged) == 1
    assert shared.empty()
    shared.close()
