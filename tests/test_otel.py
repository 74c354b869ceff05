"""inturn.otel: each turn recorded to OpenTelemetry, read back with the SDK's in-memory reader."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import inturn
from inturn import HoldTimeout, KeyedQueue, LeaseLost, QueueFull
from inturn.otel import instrument, uninstrument

from support.helpers import LosingBackend

QUEUE = "inturn.queue.name"
FUNCTION = "code.function.name"


@pytest.fixture
def reader() -> Iterator[tuple[InMemoryMetricReader, MeterProvider]]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield reader, provider
    provider.shutdown()


def points(reader: InMemoryMetricReader) -> dict[str, list[tuple[dict[str, Any], Any]]]:
    """Each metric's points: (attributes, count for a histogram, value otherwise)."""
    found: dict[str, list[tuple[dict[str, Any], Any]]] = {}
    data = reader.get_metrics_data()
    assert data is not None
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            assert scope.scope.name == "inturn"
            for metric in scope.metrics:
                for point in metric.data.data_points:
                    value = getattr(point, "count", None)
                    if value is None:
                        value = point.value
                    found.setdefault(metric.name, []).append((dict(point.attributes), value))
    return found


def value(found: dict[str, list[tuple[dict[str, Any], Any]]], name: str, **attributes: str) -> Any:
    """The one point of name whose attributes are exactly these."""
    want = {k.replace("__", "."): v for k, v in attributes.items()}
    matching = [v for a, v in found.get(name, []) if a == want]
    assert len(matching) == 1, (name, want, found.get(name))
    return matching[0]


async def test_a_decorated_function_s_turns_are_timed_and_labelled_by_function_not_key(
    reader: Any,
) -> None:
    memory, provider = reader
    queue = KeyedQueue(name="shop")
    instrument(queue, meter_provider=provider)
    release = asyncio.Event()

    @queue.queue_by_key(key="stock-{product_id}")
    async def take_stock(product_id: str, gate: asyncio.Event | None = None) -> str:
        if gate is not None:
            await gate.wait()
        return product_id

    holder = asyncio.create_task(take_stock("p1", release))
    await asyncio.sleep(0)
    waiter = asyncio.create_task(take_stock("p1"))
    await asyncio.sleep(0)
    release.set()
    assert await holder == "p1"
    assert await waiter == "p1"
    assert await take_stock("p2") == "p2"

    found = points(memory)
    name = f"{__name__}.{take_stock.__qualname__}"
    labels = {"inturn.queue.name": "shop", "code.function.name": name}
    assert value(found, "inturn.turn.wait.duration", **_k(labels)) == 3
    assert value(found, "inturn.turn.hold.duration", **_k(labels)) == 3
    for metric in found.values():
        for attributes, _ in metric:
            assert not any("p1" in str(v) or "p2" in str(v) for v in attributes.values())
    assert value(found, "inturn.queue.running", **_k({QUEUE: "shop"})) == 0
    assert value(found, "inturn.queue.waiting", **_k({QUEUE: "shop"})) == 0


def _k(labels: dict[str, str]) -> dict[str, str]:
    return {k.replace(".", "__"): v for k, v in labels.items()}


async def test_gauges_show_what_runs_and_waits_now(reader: Any) -> None:
    memory, provider = reader
    queue = KeyedQueue(name="gauged", max_running=1)
    instrument(queue, meter_provider=provider)
    release = asyncio.Event()
    started = asyncio.Event()

    async def hold() -> None:
        started.set()
        await release.wait()

    tasks = [asyncio.create_task(queue.run("a", hold))]
    await started.wait()
    tasks += [asyncio.create_task(queue.run(key, hold)) for key in ("a", "b")]
    await asyncio.sleep(0)
    found = points(memory)
    assert value(found, "inturn.queue.running", **_k({QUEUE: "gauged"})) == 1
    # one in a's line, one (b) holding its key and waiting for the running slot
    assert value(found, "inturn.queue.waiting", **_k({QUEUE: "gauged"})) == 2
    release.set()
    await asyncio.gather(*tasks)
    found = points(memory)
    assert value(found, "inturn.queue.running", **_k({QUEUE: "gauged"})) == 0


async def test_timeouts_refusals_errors_and_cuts_are_counted(reader: Any) -> None:
    memory, provider = reader
    queue = KeyedQueue(name="faults", max_pending=1)
    instrument(queue, meter_provider=provider)
    release = asyncio.Event()
    started = asyncio.Event()

    async def hold() -> None:
        started.set()
        await release.wait()

    async def fail() -> None:
        raise ValueError("the work's own error")

    async def slow() -> None:
        await asyncio.Event().wait()

    holder = asyncio.create_task(queue.run("k", hold))
    await started.wait()
    with pytest.raises(TimeoutError):
        async with queue.keyed("k", timeout=0.01):
            pass
    waiter = asyncio.create_task(queue.run("k", fail))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await queue.run("k", fail)  # k has its one waiter
    release.set()
    await holder
    with pytest.raises(ValueError, match="own error"):
        await waiter
    with pytest.raises(HoldTimeout):
        async with queue.keyed("cut", max_hold=0.01):
            await slow()

    found = points(memory)
    fail_labels = _k({QUEUE: "faults", FUNCTION: f"{__name__}.{fail.__qualname__}"})
    block = _k({QUEUE: "faults"})
    assert value(found, "inturn.turn.refused", **fail_labels) == 1
    assert value(found, "inturn.turn.errors", **fail_labels) == 1
    assert value(found, "inturn.turn.timeouts", **block) == 2  # the keyed() wait, and the cut
    assert "inturn.turn.lease_lost" not in found


async def test_a_lost_lease_is_counted(reader: Any) -> None:
    memory, provider = reader
    queue = KeyedQueue(name="leased", backend=LosingBackend())  # type: ignore[arg-type]
    instrument(queue, meter_provider=provider)

    async def work() -> None:
        pass

    with pytest.raises(LeaseLost):
        await queue.run("k", work)
    found = points(memory)
    labels = _k({QUEUE: "leased", FUNCTION: f"{__name__}.{work.__qualname__}"})
    assert value(found, "inturn.turn.lease_lost", **labels) == 1
    assert value(found, "inturn.turn.hold.duration", **labels) == 1
    assert "inturn.turn.errors" not in found


def test_threads_and_submitted_work_are_labelled_by_their_function(reader: Any) -> None:
    memory, provider = reader
    queue = KeyedQueue(name="mixed")
    instrument(queue, meter_provider=provider)

    def write() -> int:
        return 1

    @queue.queue_by_key(key="row-{n}")
    def update(n: int) -> int:
        return n

    async def apply(n: int) -> int:
        return n

    threads = [threading.Thread(target=queue.run_sync, args=("k", write)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert update(5) == 5
    with queue.keyed("k"):
        pass

    async def submit() -> None:
        async with queue.batch() as batch:
            for n in range(4):
                await batch.submit(f"m{n % 2}", apply, n)

    asyncio.run(submit())
    found = points(memory)
    for fn, count in ((write, 3), (update.__wrapped__, 1), (apply, 4)):
        labels = _k({QUEUE: "mixed", FUNCTION: f"{__name__}.{fn.__qualname__}"})
        assert value(found, "inturn.turn.hold.duration", **labels) == count
    assert value(found, "inturn.turn.hold.duration", **_k({QUEUE: "mixed"})) == 1


async def test_an_uninstrumented_queue_records_nothing_more_and_takes_its_fast_path_again(
    reader: Any,
) -> None:
    memory, provider = reader
    queue = KeyedQueue(name="onoff")

    async def work() -> None:
        pass

    await queue.run("k", work)  # the solo loop's fast path, before any observer
    assert queue.stats().wait_time is None
    instrument(queue, meter_provider=provider)
    await queue.run("k", work)
    assert queue.stats().wait_time is not None  # every turn timed meanwhile
    uninstrument(queue)
    await queue.run("k", work)
    await queue.run("k", work)
    labels = _k({QUEUE: "onoff", FUNCTION: f"{__name__}.{work.__qualname__}"})
    assert value(points(memory), "inturn.turn.hold.duration", **labels) == 1
    assert queue.stats().completed == 4
    assert queue.stats().wait_time is None  # untimed again: the plain path


def test_instrument_with_no_queue_instruments_the_default_queue(reader: Any) -> None:
    memory, provider = reader
    instrument(meter_provider=provider)
    try:
        inturn.run_sync("k", lambda: None)
    finally:
        uninstrument()
    inturn.run_sync("k", lambda: None)
    found = points(memory)
    holds = found["inturn.turn.hold.duration"]
    assert [(a[QUEUE], count) for a, count in holds] == [("default", 1)]


def test_instrument_refuses_what_is_not_a_queue() -> None:
    with pytest.raises(TypeError, match="takes KeyedQueue objects"):
        instrument("shop")  # type: ignore[arg-type]


def test_importing_inturn_imports_no_client_library() -> None:
    """OpenTelemetry (and redis-py) load only with inturn.otel (inturn.backends.redis)."""
    code = (
        "import sys, inturn, inturn.backends, inturn.backends.file; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'opentelemetry', 'redis'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "import sys, inturn.otel; print('opentelemetry' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"  # (the check above can fail)


def test_importing_inturn_otel_without_the_extra_says_which_to_install() -> None:
    """Without opentelemetry-api, the ImportError names the extra (and chains the original)."""
    code = (
        "import sys; sys.modules['opentelemetry'] = None  # (as if not installed)\n"
        "try:\n"
        "    import inturn.otel\n"
        "except ImportError as error:\n"
        "    print(error); print(type(error.__cause__).__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    message, cause = out.stdout.splitlines()
    assert message.startswith("inturn: ")
    assert "pip install 'inturn[otel]'" in message
    assert cause == "ModuleNotFoundError"


def test_a_queue_instrumented_while_the_gauges_are_read_breaks_no_reading(reader: Any) -> None:
    """The exporter's thread reads the gauges while instrument() runs in another thread.

    The reading is stopped midway through the instrumented queues (a trace
    function, at the second resume of the weak mapping's iteration) while
    another thread instruments one queue more; the reading then goes on.
    """
    memory, provider = reader
    queues = [KeyedQueue(name=f"read-{i}") for i in range(3)]
    instrument(*queues, meter_provider=provider)
    midway, go = threading.Event(), threading.Event()
    resumes = []

    def pause(frame: Any, event: str, arg: Any) -> Any:
        code = frame.f_code
        if event == "call" and code.co_name == "items" and code.co_filename.endswith("weakref.py"):
            resumes.append(frame)
            if len(resumes) == 2:  # iterating: one queue read, the others not yet
                midway.set()
                go.wait(10)
        return None

    found: list[dict[str, list[tuple[dict[str, Any], Any]]]] = []

    def read() -> None:
        sys.settrace(pause)
        try:
            found.append(points(memory))
        finally:
            sys.settrace(None)

    reading = threading.Thread(target=read)
    reading.start()
    try:
        assert midway.wait(10), "the reading never iterated over the queues"
        late = KeyedQueue(name="late")
        adding = threading.Thread(
            target=instrument, args=(late,), kwargs={"meter_provider": provider}
        )
        adding.start()
        adding.join(0.5)  # (time for it to change the mapping, if nothing stops it)
    finally:
        go.set()
        reading.join(10)
    adding.join(10)
    assert not reading.is_alive()
    assert not adding.is_alive()
    for queue in queues:
        assert value(found[0], "inturn.queue.waiting", **_k({QUEUE: queue.name})) == 0
    assert value(points(memory), "inturn.queue.running", **_k({QUEUE: "late"})) == 0


@pytest.mark.parametrize("on_superseded", ["join", "raise"])
async def test_replaced_work_is_counted_as_superseded_by_its_own_function(
    reader: Any, on_superseded: str
) -> None:
    memory, provider = reader
    queue = KeyedQueue(name="latest", pending="latest", on_superseded=on_superseded)  # type: ignore[arg-type]
    instrument(queue, meter_provider=provider)
    started, release = asyncio.Event(), asyncio.Event()

    async def hold() -> None:
        started.set()
        await release.wait()

    async def older() -> str:
        return "older"

    async def newer() -> str:
        return "newer"

    holder = asyncio.create_task(queue.run("k", hold))
    await started.wait()
    replaced = asyncio.create_task(queue.run("k", older))
    await asyncio.sleep(0)
    latest = asyncio.create_task(queue.run("k", newer))
    await asyncio.sleep(0)
    release.set()
    await asyncio.gather(holder, replaced, latest, return_exceptions=True)
    assert latest.result() == "newer"
    found = points(memory)
    labels = _k({QUEUE: "latest", FUNCTION: f"{__name__}.{older.__qualname__}"})
    assert value(found, "inturn.turn.superseded", **labels) == 1
    assert "inturn.turn.errors" not in found
