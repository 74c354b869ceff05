"""Random mixes of keys, hold times, errors, timeouts and cancellations, on virtual time.

Whatever hypothesis generates, these must hold:

- mutual exclusion: no two bodies hold one key at once;
- FIFO: on each key, the single-key tasks that ran started in submission order;
- timeouts: a task with a timeout either started within it, or raised
  TimeoutError no earlier than it and never ran;
- no lost work: a task that was neither cancelled nor timed out ran, and its
  own result or error reached its caller (and nobody else's);
- reentrancy: a holder taking its key again runs at once;
- nothing left: afterwards no key is active, and no task is stuck (the
  virtual-time loop raises Deadlock if every task waits for nothing).

With flow control (max_running, concurrency, max_hold), also:

- at most ``concurrency`` bodies hold a key at once, at most ``max_running``
  run at once, and FIFO still orders each key's single-key starts;
- max_hold: work is cut (HoldTimeout) exactly when it would have held
  longer, and a cut body has ended before anyone else holds its key;
- stats(): every submitted turn is counted once, in the class of its outcome.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inturn import HoldTimeout, KeyedQueue

from support.virtual_time import Deadlock, run_virtual

KEYS = ("a", "b", "c")


@dataclass(frozen=True)
class Spec:
    keys: tuple[str, ...]  # one key, or several taken with keyed()
    start: float  # virtual time of submission
    hold: float  # virtual time the body holds its keys
    fails: bool  # the body raises
    timeout: float | None  # limit for reaching the turn
    cancel_at: float | None  # virtual time the task is cancelled
    reenter: bool  # the body takes its first key again


@dataclass
class Outcome:
    submitted: float | None = None
    seq: int | None = None  # submission order
    started: float | None = None  # virtual time the body started
    order: int | None = None  # the body's place among all bodies started
    result: Any = None
    error: BaseException | None = None
    log: list[str] = field(default_factory=list)


class Boom(Exception):
    pass


times = st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0])
specs = st.builds(
    Spec,
    keys=st.one_of(
        st.tuples(st.sampled_from(KEYS)),
        st.lists(st.sampled_from(KEYS), min_size=2, max_size=3, unique=True).map(tuple),
    ),
    start=times,
    hold=times,
    fails=st.booleans(),
    timeout=st.one_of(st.none(), st.sampled_from([0.0, 0.5, 1.0, 2.5])),
    cancel_at=st.one_of(
        st.none(), st.sampled_from([0.0, 0.25, 0.5, 1.0, 1.5, 1.75, 2.0, 3.0, 4.5])
    ),
    reenter=st.booleans(),
)


@dataclass(frozen=True)
class Flow:
    max_running: int | None
    concurrency: int
    max_hold: float | None


flows = st.builds(
    Flow,
    max_running=st.sampled_from([None, 1, 2]),
    concurrency=st.sampled_from([1, 2]),
    max_hold=st.sampled_from([None, 1.25, 2.5]),
)


async def scenario(
    spec_list: list[Spec], flow: Flow = Flow(None, 1, None)
) -> tuple[list[Outcome], KeyedQueue, list[str]]:
    queue = KeyedQueue(
        max_running=flow.max_running, concurrency=flow.concurrency, max_hold=flow.max_hold
    )
    loop = asyncio.get_running_loop()
    inside: dict[str, int] = defaultdict(int)
    running = 0
    violations: list[str] = []
    outcomes = [Outcome() for _ in spec_list]
    counter = iter(range(10**9))
    starts = iter(range(10**9))

    async def body(i: int, spec: Spec) -> str:
        nonlocal running
        outcome = outcomes[i]
        outcome.started = loop.time()
        outcome.order = next(starts)
        for key in spec.keys:
            if inside[key] >= flow.concurrency:
                violations.append(f"task {i} entered {key!r} while it was full")
            inside[key] += 1
        running += 1
        if flow.max_running is not None and running > flow.max_running:
            violations.append(f"task {i} made {running} run at once")
        try:
            if spec.reenter:
                nested = await queue.run(spec.keys[0], lambda: loop.time())
                if nested != outcome.started:
                    violations.append(f"task {i}: a reentrant call waited")
            await asyncio.sleep(spec.hold)
            if spec.fails:
                raise Boom(i)
            return f"result {i}"
        finally:
            running -= 1
            for key in spec.keys:
                inside[key] -= 1

    async def submit(i: int, spec: Spec) -> str:
        await asyncio.sleep(spec.start)
        outcome = outcomes[i]
        outcome.submitted = loop.time()
        outcome.seq = next(counter)  # no await between this and the submission
        if len(spec.keys) == 1:
            if spec.timeout is None:
                return await queue.run(spec.keys[0], body, i, spec)
            limited = KeyedQueue.queue_by_key(queue, key=spec.keys[0], timeout=spec.timeout)
            return await limited(body)(i, spec)
        async with queue.keyed(*spec.keys, timeout=spec.timeout):
            return await body(i, spec)

    tasks = [loop.create_task(submit(i, spec)) for i, spec in enumerate(spec_list)]

    async def canceller(task: asyncio.Task[str], at: float) -> None:
        # A task of its own, so the cancel lands in any order relative to
        # the releases due at the same virtual time, including just after a
        # release handed the key to the task being cancelled.
        await asyncio.sleep(at)
        task.cancel()

    cancellers = [
        loop.create_task(canceller(task, spec.cancel_at))
        for task, spec in zip(tasks, spec_list, strict=True)
        if spec.cancel_at is not None
    ]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.gather(*cancellers)
    for outcome, result in zip(outcomes, results, strict=True):
        if isinstance(result, BaseException):
            outcome.error = result
        else:
            outcome.result = result
    return outcomes, queue, violations


def assert_fifo_per_key(spec_list: list[Spec], outcomes: list[Outcome]) -> None:
    """FIFO among the single-key tasks of each key that ran."""
    for key in KEYS:
        ran = [
            outcome
            for spec, outcome in zip(spec_list, outcomes, strict=True)
            if spec.keys == (key,) and outcome.started is not None
        ]
        by_start = sorted(ran, key=lambda o: o.order)
        assert [o.seq for o in by_start] == sorted(o.seq for o in ran)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.lists(specs, min_size=1, max_size=25))
def test_invariants_hold_for_any_mix(spec_list: list[Spec]) -> None:
    outcomes, queue, violations = run_virtual(scenario(spec_list))

    assert violations == []
    assert queue.active_count == 0

    for i, (spec, outcome) in enumerate(zip(spec_list, outcomes, strict=True)):
        error = outcome.error
        cancelled = isinstance(error, asyncio.CancelledError)
        if cancelled:
            assert spec.cancel_at is not None
            continue
        if isinstance(error, HoldTimeout):
            pytest.fail(f"task {i} was cut short without a max_hold")
        if isinstance(error, TimeoutError):
            assert outcome.started is None, f"task {i} ran after timing out"
            assert spec.timeout is not None
            continue
        # Neither cancelled nor timed out: it must have run, with its own outcome.
        assert outcome.started is not None, f"task {i} was lost"
        if spec.timeout is not None and outcome.submitted is not None:
            assert outcome.started <= outcome.submitted + spec.timeout
        if spec.fails:
            assert isinstance(error, Boom)
            assert error.args == (i,)
        else:
            assert error is None, f"task {i} raised {error!r}"
            assert outcome.result == f"result {i}"

    assert_fifo_per_key(spec_list, outcomes)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(flows, st.lists(specs, min_size=1, max_size=25))
def test_invariants_hold_with_flow_control(flow: Flow, spec_list: list[Spec]) -> None:
    outcomes, queue, violations = run_virtual(scenario(spec_list, flow))

    assert violations == []
    assert queue.active_count == 0
    counts = {"completed": 0, "failed": 0, "timed_out": 0, "cancelled": 0}
    for i, (spec, outcome) in enumerate(zip(spec_list, outcomes, strict=True)):
        error = outcome.error
        if outcome.submitted is None:  # cancelled before it submitted anything
            assert isinstance(error, asyncio.CancelledError)
            continue
        if isinstance(error, asyncio.CancelledError):
            assert spec.cancel_at is not None
            counts["cancelled"] += 1
        elif isinstance(error, HoldTimeout):
            assert flow.max_hold is not None
            assert outcome.started is not None
            assert spec.hold >= flow.max_hold, f"task {i} was cut before its max_hold"
            counts["timed_out"] += 1
        elif isinstance(error, TimeoutError):
            assert outcome.started is None, f"task {i} ran after timing out"
            assert spec.timeout is not None
            counts["timed_out"] += 1
        else:
            assert outcome.started is not None, f"task {i} was lost"
            if flow.max_hold is not None:
                assert spec.hold <= flow.max_hold, f"task {i} held past its max_hold"
            if spec.timeout is not None:
                assert outcome.started <= outcome.submitted + spec.timeout
            if spec.fails:
                assert isinstance(error, Boom)
                assert error.args == (i,)
                counts["failed"] += 1
            else:
                assert error is None, f"task {i} raised {error!r}"
                assert outcome.result == f"result {i}"
                counts["completed"] += 1

    assert_fifo_per_key(spec_list, outcomes)

    stats = queue.stats()
    assert (stats.running, stats.waiting_for_slot, dict(stats.waiting)) == (0, 0, {})
    assert {name: getattr(stats, name) for name in counts} == counts


def test_the_virtual_loop_reports_a_deadlock() -> None:
    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(Deadlock):
        run_virtual(stuck())
