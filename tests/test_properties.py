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
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inturn import KeyedQueue
from virtual_time import Deadlock, run_virtual

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


async def scenario(spec_list: list[Spec]) -> tuple[list[Outcome], KeyedQueue, list[str]]:
    queue = KeyedQueue()
    loop = asyncio.get_running_loop()
    inside: dict[str, int] = defaultdict(int)
    violations: list[str] = []
    outcomes = [Outcome() for _ in spec_list]
    counter = iter(range(10**9))
    starts = iter(range(10**9))

    async def body(i: int, spec: Spec) -> str:
        outcome = outcomes[i]
        outcome.started = loop.time()
        outcome.order = next(starts)
        for key in spec.keys:
            if inside[key]:
                violations.append(f"task {i} entered {key!r} while it was held")
            inside[key] += 1
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

    # FIFO among the single-key tasks of each key that ran.
    for key in KEYS:
        ran = [
            outcome
            for spec, outcome in zip(spec_list, outcomes, strict=True)
            if spec.keys == (key,) and outcome.started is not None
        ]
        by_start = sorted(ran, key=lambda o: o.order)
        assert [o.seq for o in by_start] == sorted(o.seq for o in ran)


def test_the_virtual_loop_reports_a_deadlock() -> None:
    async def stuck() -> None:
        await asyncio.Event().wait()

    with pytest.raises(Deadlock):
        run_virtual(stuck())
