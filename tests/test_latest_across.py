"""Latest wins across processes (``across="processes"``), on the file backend.

Several queues, each with a FileBackend of its own on one directory, share
the key's line as processes do: the backend cannot tell them from processes
(each queue keeps its own lines and its own latest work). Driven by events
and the line's own state; the real processes, and their deaths, are in
test_latest_across_processes.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from inturn import KeyedQueue, Superseded
from inturn.backends import LocalBackend
from inturn.backends.file import FileBackend
from inturn.backends.file._latest import judge
from inturn.backends.file._linefile import Post, Ran, joined, parse, ran_record, render

from support.file_checks import line_file
from support.helpers import PATIENCE, settle, wait_until
from support.latest_across import Holder, Runs, latest, posts


async def test_a_burst_spread_over_processes_runs_once_the_newest(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    modes = ("join", "raise", "join")
    queues = [latest(tmp_path, on_superseded=mode) for mode in modes]
    ran = Runs()
    calls = []
    for n in range(9):  # process by process, each one's burst after the one before queued
        queue = queues[n // 3]
        calls.append(asyncio.create_task(queue.run("k", ran.work(f"{n}"))))
        # (the first waits at the backend; a "raise" caller replaced is answered at once)
        waiting = n % 3 if modes[n // 3] == "join" else min(n % 3, 1)
        await settle(
            lambda q=queue, w=waiting, n=n: (q.pending("k"), posts(tmp_path)) == (w, n // 3 + 1)
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
    assert not line_file(tmp_path, "k").exists()  # nothing is left in line


class Missed(list[tuple[BaseException, str | None]]):
    """An observer that keeps the error of each turn that never started."""

    def started(self, waited: float, function: str | None) -> None:
        pass

    def ended(self, held: Any, error: Any, cut: bool, function: str | None) -> None:
        pass

    def missed(self, error: BaseException, function: str | None) -> None:
        self.append((error, function))


async def test_the_observer_hears_of_each_work_replaced_in_its_process(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path), latest(tmp_path)
    heard = Missed()
    older.observe(heard)
    ran = Runs()

    async def sync() -> str:
        return await ran.work("older")()

    calls = [asyncio.create_task(older.run("k", sync)) for _ in range(3)]
    await settle(lambda: older.pending("k") == 2 and posts(tmp_path) == 1)
    last = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    assert await asyncio.gather(*calls, last) == [None, None, None, "newer"]
    assert len(heard) == 3  # the 3 replaced works: 2 in this process, 1 by the other's
    assert all(isinstance(error, Superseded) for error, _ in heard)
    assert {function for _, function in heard} == {f"{sync.__module__}.{sync.__qualname__}"}


async def test_a_join_caller_learns_that_the_newer_work_failed(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    older, newer = latest(tmp_path), latest(tmp_path)

    async def fails() -> None:
        raise ValueError("the sync failed")

    first = asyncio.create_task(older.run("k", Runs().work("older")))
    await settle(lambda: posts(tmp_path) == 1)
    second = asyncio.create_task(newer.run("k", fails))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    with pytest.raises(ValueError, match="the sync failed"):
        await second
    with pytest.raises(Superseded, match="failed there"):
        await first


async def test_work_called_after_the_newest_started_runs_after_it(tmp_path: Path) -> None:
    """The running work is never replaced: a call that comes while it runs runs next."""
    holder = Holder(tmp_path)
    await holder.hold()
    one, two = latest(tmp_path), latest(tmp_path)
    started, go_on = asyncio.Event(), asyncio.Event()
    ran = Runs()

    async def slow() -> str:
        ran.append("first")
        started.set()
        await go_on.wait()
        return "first"

    first = asyncio.create_task(one.run("k", slow))
    await settle(lambda: posts(tmp_path) == 1)
    await holder.release()
    await started.wait()
    later = asyncio.create_task(two.run("k", ran.work("later")))
    await settle(lambda: posts(tmp_path) == 2)
    go_on.set()
    assert await asyncio.gather(first, later) == ["first", "later"]
    assert ran == ["first", "later"]


@pytest.mark.parametrize("leaves", ["cancelled", "timed out"])
async def test_when_the_newer_caller_leaves_the_older_work_runs(
    tmp_path: Path, leaves: str
) -> None:
    """A newer work whose caller gives up before the key's turn is not waiting any more: the
    older work, whose caller still waits, runs (as it does when the newer one's process dies)."""
    holder = Holder(tmp_path)
    await holder.hold()
    older = latest(tmp_path)
    newer = latest(tmp_path, timeout=0.05 if leaves == "timed out" else None)
    ran = Runs()
    first = asyncio.create_task(older.run("k", ran.work("older")))
    await settle(lambda: posts(tmp_path) == 1)
    second = asyncio.create_task(newer.run("k", ran.work("newer")))
    await settle(lambda: posts(tmp_path) == 2)
    if leaves == "cancelled":
        second.cancel()
    with pytest.raises(asyncio.CancelledError if leaves == "cancelled" else TimeoutError):
        await second
    await holder.release()
    assert await first == "older"
    assert ran == ["older"]


def test_threads_of_several_processes_run_the_newest_once(tmp_path: Path) -> None:
    async def holding() -> tuple[Holder, asyncio.AbstractEventLoop]:
        holder = Holder(tmp_path)
        await holder.hold()
        return holder, asyncio.get_running_loop()

    loop = asyncio.new_event_loop()
    holder, _ = loop.run_until_complete(holding())
    queues = [latest(tmp_path), latest(tmp_path, on_superseded="raise")]
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
        wait_until(lambda n=n: posts(tmp_path) == n // 2 + 1, f"call {n} is in line")
        wait_until(lambda q=queue, n=n: q.pending("k") == n % 2, f"call {n} waits")
    loop.run_until_complete(holder.release())
    loop.close()
    for thread in threads:
        thread.join(PATIENCE)
    assert ran == ["3"]
    assert outcomes["0"] is None
    assert outcomes["1"] is None
    assert isinstance(outcomes["2"], Superseded)
    assert outcomes["3"] is None  # (ran.append's result, in its own process)


async def test_the_decorator_and_submit_conflate_across_processes(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    one, two = latest(tmp_path), latest(tmp_path)
    ran = Runs()

    @one.queue_by_key(key="k")
    async def sync_manifest(version: int) -> int:
        ran.append(f"decorated {version}")
        return version

    decorated = asyncio.create_task(sync_manifest(1))
    await settle(lambda: posts(tmp_path) == 1)
    handle = await two.submit("k", ran.work("submitted"))
    await settle(lambda: posts(tmp_path) == 2)
    await holder.release()
    assert await decorated is None  # ("join": the newer work returned, in another process)
    assert await handle == "submitted"
    assert ran == ["submitted"]


async def test_per_process_conflation_stays_the_default(tmp_path: Path) -> None:
    holder = Holder(tmp_path)
    await holder.hold()
    one = KeyedQueue(backend=FileBackend(tmp_path), pending="latest")
    two = KeyedQueue(backend=FileBackend(tmp_path), pending="latest")
    ran = Runs()
    first = asyncio.create_task(one.run("k", ran.work("one")))
    await settle(lambda: len(FileBackend(tmp_path).line("k")) == 2)
    second = asyncio.create_task(two.run("k", ran.work("two")))
    await settle(lambda: len(FileBackend(tmp_path).line("k")) == 3)
    await holder.release()
    assert await asyncio.gather(first, second) == ["one", "two"]
    assert posts(tmp_path) == 0


@pytest.mark.parametrize("backend", [None, LocalBackend()])
def test_across_processes_needs_a_backend_that_keeps_it(backend: Any) -> None:
    with pytest.raises(ValueError, match=r'across="processes" .* FileBackend'):
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
