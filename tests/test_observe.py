"""A queue's name, its observer (KeyedQueue.observe), and stats() read from another thread."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import pytest

from inturn import KeyedQueue, LeaseLost, Observer, QueueFull, default_queue

from support.helpers import LosingBackend, settle


class Recorder:
    """An observer that keeps every event (an Observer)."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []

    def started(self, waited: float, function: str | None) -> None:
        assert waited >= 0
        self.events.append(("started", function))

    def ended(
        self, held: float | None, error: BaseException | None, cut: bool, function: str | None
    ) -> None:
        assert held is None or held >= 0
        self.events.append(("ended", type(error).__name__ if error else None, cut, function))

    def missed(self, error: BaseException, function: str | None) -> None:
        self.events.append(("missed", type(error).__name__, function))


def test_a_recorder_is_an_observer() -> None:
    observer: Observer = Recorder()  # mypy checks the protocol
    assert observer is not None


def test_a_queue_s_name_is_in_its_repr() -> None:
    assert KeyedQueue(name="shop").name == "shop"
    assert repr(KeyedQueue(name="shop")).startswith("<KeyedQueue 'shop' open")
    assert KeyedQueue().name is None
    assert repr(KeyedQueue()).startswith("<KeyedQueue open")
    assert default_queue.name == "default"


@pytest.mark.parametrize(
    ("name", "error"), [(3, TypeError), ("", ValueError), ("a\nb", ValueError)]
)
def test_a_bad_name_is_refused_at_once(name: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="name= takes a short printable str"):
        KeyedQueue(name=name)


async def test_the_observer_hears_each_turn_once_with_its_function() -> None:
    queue = KeyedQueue(max_pending=0)
    recorder = Recorder()
    queue.observe(recorder)
    release = asyncio.Event()
    started = asyncio.Event()

    async def hold() -> None:
        started.set()
        await release.wait()

    async def fail() -> None:
        raise KeyError("x")

    holder = asyncio.create_task(queue.run("k", hold))
    await started.wait()
    with pytest.raises(QueueFull):
        await queue.run("k", fail)
    release.set()
    await holder
    with pytest.raises(KeyError):
        await queue.run("j", fail)
    async with queue.keyed("j"):
        pass
    hold_name = f"{__name__}.{hold.__qualname__}"
    fail_name = f"{__name__}.{fail.__qualname__}"
    assert recorder.events == [
        ("started", hold_name),
        ("missed", "QueueFull", fail_name),
        ("ended", None, False, hold_name),
        ("started", fail_name),
        ("ended", "KeyError", False, fail_name),
        ("started", None),
        ("ended", None, False, None),
    ]
    queue.observe(None)
    await queue.run("k", hold)
    assert len(recorder.events) == 7


def test_stats_are_safe_from_another_thread_while_the_loop_changes_the_lines() -> None:
    """A metrics exporter's thread reads stats() while the solo loop changes its lines."""
    queue = KeyedQueue()
    stop = threading.Event()
    errors: list[BaseException] = []
    reads = 0

    def export() -> None:
        nonlocal reads
        while not stop.is_set():
            try:
                queue.stats()
            except BaseException as error:
                errors.append(error)
                return
            reads += 1

    async def churn() -> None:
        release = asyncio.Event()

        async def hold() -> None:
            await release.wait()

        for _ in range(30):
            # 2,000 keys come and go, each with a waiter: the lines grow and shrink
            tasks = [asyncio.create_task(queue.run(n, hold)) for n in range(2000)]
            tasks += [asyncio.create_task(queue.run(n, hold)) for n in range(2000)]
            await asyncio.sleep(0)
            release.set()
            await asyncio.gather(*tasks)
            release.clear()

    exporter = threading.Thread(target=export)
    exporter.start()
    try:
        asyncio.run(churn())
    finally:
        stop.set()
        exporter.join()
    assert errors == []
    assert reads > 0
    assert not queue.stats().waiting


async def test_a_lost_lease_is_logged_on_inturn_with_the_key_as_given(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = KeyedQueue(backend=LosingBackend(), name="ledger")  # type: ignore[arg-type]

    async def work() -> None:
        raise ValueError("its own")

    caplog.set_level(logging.DEBUG, logger="inturn")
    with pytest.raises(LeaseLost):
        await queue.run("acct-7", lambda: None)
    with pytest.raises(ValueError, match="its own"):
        await queue.run(b"acct-8", work)
    records = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    assert [(name, level) for name, level, _ in records] == [("inturn", logging.WARNING)] * 2
    assert records[0][2].startswith("inturn: queue 'ledger': the backend could no longer")
    assert "'acct-7' (token 1)" in records[0][2]
    assert records[0][2].endswith("the work ran and returned")
    assert "b'acct-8' (token 2)" in records[1][2]
    assert records[1][2].endswith("the work ran and raised ValueError")


class Broken(Recorder):
    def started(self, waited: float, function: str | None) -> None:
        raise RuntimeError("the observer's own bug")


async def test_an_observer_that_raises_is_logged_and_the_turns_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    queue = KeyedQueue()
    observer = Broken()
    queue.observe(observer)
    release = asyncio.Event()

    async def hold() -> None:
        await release.wait()

    tasks = [asyncio.create_task(queue.run("k", hold)) for _ in range(3)]
    await asyncio.sleep(0)
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)  # every turn ran: none was stuck
    async with queue.keyed("k"):
        pass  # and the key is free
    assert [e[0] for e in observer.events] == ["ended"] * 4
    errors = [r for r in caplog.records if r.name == "inturn" and r.levelno == logging.ERROR]
    assert len(errors) == 4
    assert "observer's started() raised" in errors[0].getMessage()


class Failing:
    """A callable object, with no ``__name__``: what an observer's method may be."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args: object) -> None:
        self.calls += 1
        raise RuntimeError("the observer's own bug")


class CallableObjects:
    """An observer whose methods are callable objects that raise (an Observer all the same)."""

    def __init__(self) -> None:
        self.started = Failing()
        self.ended = Failing()
        self.missed = Failing()


@pytest.mark.parametrize("settings", [{}, {"max_running": 2}])
async def test_an_observer_of_callable_objects_that_raise_is_logged_and_the_turns_go_on(
    caplog: pytest.LogCaptureFixture, settings: dict[str, Any]
) -> None:
    queue = KeyedQueue(max_pending=1, **settings)
    observer = CallableObjects()
    queue.observe(observer)  # type: ignore[arg-type]  # (callable objects, not methods)
    assert await queue.run("k", lambda: "ran") == "ran"
    entered, release = asyncio.Event(), asyncio.Event()

    async def hold() -> str:
        entered.set()
        await release.wait()
        return "held"

    holder = asyncio.create_task(queue.run("k", hold))
    await entered.wait()
    waiter = asyncio.create_task(queue.run("k", lambda: "waited"))
    await settle(lambda: queue.pending("k") == 1)
    with pytest.raises(QueueFull):  # a refusal is told to missed()
        await queue.run("k", lambda: "refused")
    release.set()
    assert await asyncio.gather(holder, waiter) == ["held", "waited"]
    assert queue.active_keys == frozenset()
    assert (observer.started.calls, observer.ended.calls, observer.missed.calls) == (3, 3, 1)
    errors = [r for r in caplog.records if r.name == "inturn" and r.levelno == logging.ERROR]
    told = ["started", "ended", "started", "missed", "ended", "started", "ended"]
    assert [e.getMessage() for e in errors] == [
        f"inturn: the observer's {method}() raised; the turn goes on, unreported" for method in told
    ]
    assert all(e.exc_info is not None for e in errors)


class Nameless:
    """Work whose names cannot be read: reading its ``__qualname__`` raises."""

    def __call__(self) -> str:
        return "ran"

    def __getattribute__(self, name: str) -> Any:
        if name == "__qualname__":
            raise RuntimeError("no names here")
        return object.__getattribute__(self, name)


async def test_work_whose_name_cannot_be_read_is_labelled_by_its_type() -> None:
    queue = KeyedQueue()
    recorder = Recorder()
    queue.observe(recorder)
    assert await queue.run("k", Nameless()) == "ran"
    handle = await queue.submit("k", Nameless())  # labelled inside its turn's bookkeeping
    await settle(handle.done)
    assert await handle == "ran"
    assert queue.active_keys == frozenset()
    label = f"{__name__}.Nameless"
    assert recorder.events == [("started", label), ("ended", None, False, label)] * 2


async def test_a_turn_running_when_the_observer_comes_is_never_reported_with_a_hold_time() -> None:
    queue = KeyedQueue()
    recorder = Recorder()
    held: list[float | None] = []
    recorder.ended = lambda h, e, c, f: held.append(h)  # type: ignore[method-assign]
    started = asyncio.Event()
    release = asyncio.Event()

    async def hold() -> None:
        started.set()
        await release.wait()

    await queue.run("warm", lambda: None)  # the solo loop's fast path from now on
    holder = asyncio.create_task(queue.run("k", hold))
    await started.wait()  # it holds k on the plain path, untimed
    queue.observe(recorder)
    release.set()
    await holder
    await queue.run("k", lambda: None)  # a turn taken under the observer is timed
    # the turn taken before is unreported, or reported without a hold time
    assert len(held) in (1, 2)
    assert all(h is None for h in held[:-1])
    assert held[-1] is not None
    assert held[-1] >= 0
