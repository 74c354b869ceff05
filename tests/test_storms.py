"""Storms on one in-process queue: tasks, threads, and both at once, with everything at once.

Each storm draws its queue's settings (``pending``, ``on_superseded``, ``debounce``,
``max_wait``, ``max_running``, ``max_pending``, a ``timeout``) and its callers from
``random.Random(seed)``: a few keys; tasks calling ``run``, a decorated ``async def``,
``submit()`` and ``async with keyed()``; threads calling ``run_sync``, a decorated
``def`` and ``with keyed()``; per-call timeouts (decorators' and ``keyed()``'s own);
works that fail; tasks (and handles) cancelled after a random number of loop rounds or
a random delay; exceptions thrown into threads while they take their turns
(``PyThreadState_SetAsyncExc``). After every run it checks what ``storm.Storm``
states: each caller answered once with an allowed answer, never two works of a key
at once (nor more than ``max_running``), no answer from a run that started before
its call, the newest still-wanted work runs last, ``stats()`` adds up to the calls,
and every key is free again, a new turn on each taken at once.

Task storms run on a virtual clock (tests/support/virtual_time.py): a seed replays exactly.
Storms with threads run on the real clock, with times of a few milliseconds.

Every storm is marked ``storm``. By default a few seeds run; ``INTURN_STORM_SEEDS=200``
runs 200 of each (the long run), from ``INTURN_STORM_FIRST`` (0 by default), and
``INTURN_STORM_SEED=17`` replays seed 17 alone (exactly for a task storm; for one with
threads, its choices, not its timing). Twenty long runs in a row, each on new seeds::

    for i in $(seq 20); do
        INTURN_STORM_SEEDS=200 INTURN_STORM_FIRST=$((i * 1000)) \
            python -m pytest -m storm tests/test_storms.py -x -q || break
    done
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import pytest

from inturn import Superseded

from support.helpers import PATIENCE
from support.own_thread import OwnThreadTimers
from support.storm import (
    LATE,
    STALL,
    Call,
    Interrupts,
    Settings,
    Storm,
    Thrown,
    WorkError,
    inside,
    seeds,
)
from support.virtual_time import run_virtual

pytestmark = pytest.mark.storm

#: A pause: a number of loop rounds (int) or of seconds (float).
Pause = int | float


async def pause(hold: Pause) -> None:
    if isinstance(hold, int):
        for _ in range(hold):
            await asyncio.sleep(0)
    else:
        await asyncio.sleep(hold)


class Tasks:
    """A storm's task callers on one queue, on the running loop."""

    SHAPES = ("run", "decorated", "submit", "keyed")

    def __init__(
        self, storm: Storm, queue: KeyedQueueLike, rng: random.Random, unit: float
    ) -> None:
        self.storm, self.queue, self.rng, self.unit = storm, queue, rng, unit
        self.tasks: list[asyncio.Task[None]] = []
        settings = storm.settings

        async def work(key: Hashable, seq: int, hold: Pause, fails: bool) -> tuple[int, int]:
            run = storm.begin(seq, key)
            try:
                await pause(hold)
                if fails:
                    raise WorkError(seq, run.start)
                return seq, run.start
            finally:
                storm.end(run)

        self.work = work
        self.decorated = {
            limit: queue.queue_by_key(key=lambda args: args["key"], timeout=limit)(work)
            for limit in settings.timeouts
        }

    def hold(self) -> Pause:
        rng = self.rng
        return rng.choice([0, rng.randint(1, 4), rng.uniform(0, self.unit)])

    def spawn(self, key: Hashable) -> None:
        """Start one caller of key, its shape and fate drawn from the storm's rng."""
        rng, settings = self.rng, self.storm.settings
        shape = rng.choice(self.SHAPES)
        limit = (
            rng.choice(settings.timeouts) if shape in ("decorated", "keyed") else settings.timeout
        )
        call = Call(
            key,
            shape,
            settings.conflates and shape != "keyed" and limit != 0,
            limit,
        )
        hold, fails = self.hold(), rng.random() < 0.15
        cancel: tuple[str, Pause] | None = None
        if rng.random() < 0.2:
            cancel = rng.choice([("rounds", rng.randint(0, 6)), ("later", self.hold())])
        self.tasks.append(asyncio.create_task(self.caller(call, hold, fails, cancel)))

    def _cancel_later(self, call: Call, cancel: Callable[[], Any], how: tuple[str, Pause]) -> None:
        """Cancel (cancel()) after a number of loop rounds, or seconds."""
        loop = asyncio.get_running_loop()

        def now() -> None:
            call.cancelled = True
            cancel()

        def after(rounds: int) -> None:
            if rounds <= 0:
                now()
            else:
                loop.call_soon(after, rounds - 1)

        kind, amount = how
        if kind == "rounds":
            after(int(amount))
        else:
            loop.call_later(float(amount), now)

    async def caller(
        self, call: Call, hold: Pause, fails: bool, cancel: tuple[str, Pause] | None
    ) -> None:
        storm, queue, key, work = self.storm, self.queue, call.key, self.work
        storm.called(call)
        seq = call.seq
        task = asyncio.current_task()
        assert task is not None
        if cancel is not None and call.shape != "submit":
            self._cancel_later(call, task.cancel, cancel)
        outcome: Any
        try:
            if call.shape == "run":
                outcome = await queue.run(key, work, key, seq, hold, fails)
            elif call.shape == "decorated":
                outcome = await self.decorated[call.timeout](key, seq, hold, fails)
            elif call.shape == "submit":
                handle = await queue.submit(key, work, key, seq, hold, fails)
                storm.placed(call)
                if cancel is not None:
                    self._cancel_later(call, handle.cancel, cancel)
                outcome = await handle
            else:
                async with queue.keyed(key, timeout=call.timeout):
                    run = storm.begin(seq, key)
                    try:
                        await pause(hold)
                        if fails:
                            raise WorkError(seq, run.start)
                    finally:
                        storm.end(run)
                outcome = (seq, run.start)
        except BaseException as error:  # (the answer: CancelledError too)
            outcome = error
        storm.answer(call, outcome)

    async def storm_of(self, calls: int, keys: list[Hashable]) -> None:
        """Make calls callers of keys, with random gaps between them."""
        rng = self.rng
        for _ in range(calls):
            self.spawn(rng.choice(keys))
            gap = rng.choice([0, 0, rng.randint(1, 3), rng.uniform(0, self.unit)])
            if gap:
                await pause(gap)


KeyedQueueLike = Any  # (a KeyedQueue: its decorators are typed per function)


async def answered(
    storm: Storm,
    done: Callable[[], bool],
    what: str,
    stall: float = STALL,
    queue: KeyedQueueLike | None = None,
) -> None:
    """Wait until done(), failing the storm if no caller is answered for ``stall`` seconds
    (on the loop's clock: a virtual clock's seconds cost nothing) or it takes ten times
    PATIENCE in all; the failure shows what queue holds then (see inside)."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    progress, since = -1, began
    while not done():
        now = loop.time()
        if storm.answered != progress:
            progress, since = storm.answered, now
        if now - since > stall or now - began > PATIENCE * 10:
            waiting = [call for call in storm.calls if not call.answers]
            storm.fail(
                [
                    f"hung: {what}; {len(waiting)} callers never answered",
                    *map(repr, waiting),
                    *(inside(queue) if queue is not None else ()),
                ],
                "hang",
            )
        await asyncio.sleep(0.005)


async def free_at_once(storm: Storm, queue: KeyedQueueLike, keys: list[Hashable]) -> list[str]:
    """Once every caller was answered: every key is free, and a turn on each is taken at once
    (``timeout=0``). A submission's task ends just after its handle's answer: a few loop
    rounds are allowed for that."""
    for _ in range(20):
        if not queue.active_count:
            break
        await asyncio.sleep(0)
    problems = [*storm.counted(queue), *storm.idle(queue, keys)]
    for key in keys:
        try:
            async with queue.keyed(key, timeout=0):
                pass
        except TimeoutError:
            problems.append(f"key {key!r}: a new turn was not taken at once: {queue!r}")
    return problems


# -- tasks, on a virtual clock -------------------------------------------------------------


@pytest.mark.parametrize("seed", seeds(100))
def test_a_storm_of_tasks(seed: int) -> None:
    rng = random.Random(seed)
    settings = Settings.draw(rng, unit=1.0)
    keys: list[Hashable] = [f"k{n}" for n in range(rng.randint(1, 3))]

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        storm = Storm(seed, settings, loop.time, late=1e-6)
        queue = settings.queue()
        tasks = Tasks(storm, queue, rng, unit=1.0)
        await tasks.storm_of(rng.randint(30, 120), keys)
        await answered(storm, lambda: all(t.done() for t in tasks.tasks), "tasks", PATIENCE)
        storm.fail([*storm.problems(), *await free_at_once(storm, queue, keys)], "tasks")

    run_virtual(scenario())


# -- threads, and threads with tasks, on the real clock -------------------------------------------

#: Real times: a work holds up to UNIT seconds; timeouts and debounces are a few of them.
UNIT = 0.002


class Threads:
    """A storm's thread callers on one queue, interrupted at random while they take turns."""

    SHAPES = ("run_sync", "decorated_sync", "keyed_sync")

    def __init__(self, storm: Storm, queue: KeyedQueueLike, interrupts: Interrupts) -> None:
        self.storm, self.queue, self.interrupts = storm, queue, interrupts
        self.threads: list[threading.Thread] = []
        self.crashed: list[BaseException] = []

        def work(key: Hashable, seq: int, hold: float, fails: bool) -> tuple[int, int]:
            interrupts.hold()  # (interrupts land while a turn is taken, not in its work or end)
            run = storm.begin(seq, key)
            try:
                if hold:
                    time.sleep(hold)
                if fails:
                    raise WorkError(seq, run.start)
                return seq, run.start
            finally:
                storm.end(run)

        self.work = work
        self.decorated = {
            limit: queue.queue_by_key(key=lambda args: args["key"], timeout=limit)(work)
            for limit in storm.settings.timeouts
        }

    def call(self, call: Call, hold: float, fails: bool) -> Any:
        queue, key, seq, work = self.queue, call.key, call.seq, self.work
        if call.shape == "run_sync":
            return queue.run_sync(key, work, key, seq, hold, fails)
        if call.shape == "decorated_sync":
            return self.decorated[call.timeout](key, seq, hold, fails)
        with queue.keyed(key, timeout=call.timeout):
            self.interrupts.hold()
            run = self.storm.begin(seq, key)
            try:
                if hold:
                    time.sleep(hold)
                if fails:
                    raise WorkError(seq, run.start)
            finally:
                self.storm.end(run)
        return seq, run.start

    def caller(self, rng: random.Random, calls: int, keys: list[Hashable]) -> None:
        """One thread's calls, one after another, with random gaps."""
        storm, settings, interrupts = self.storm, self.storm.settings, self.interrupts
        try:
            for _ in range(calls):
                shape = rng.choice(self.SHAPES)
                limit = settings.timeout if shape == "run_sync" else rng.choice(settings.timeouts)
                call = Call(
                    rng.choice(keys),
                    shape,
                    settings.conflates and shape != "keyed_sync" and limit != 0,
                    limit,
                )
                hold = rng.choice([0.0, rng.uniform(0, UNIT)])
                fails = rng.random() < 0.15
                if rng.random() < 0.5:
                    time.sleep(rng.uniform(0, UNIT))
                storm.called(call)
                outcome: Any
                try:
                    interrupts.arm(call)
                    try:
                        outcome = self.call(call, hold, fails)
                    except Thrown:
                        raise
                    except BaseException as error:  # (the answer)
                        outcome = error
                    interrupts.hold()
                except Thrown as thrown:
                    outcome = thrown
                storm.answer(call, outcome)
        except BaseException as error:  # reported: a thread must never die
            self.crashed.append(error)
            raise

    def start(self, rng: random.Random, keys: list[Hashable]) -> None:
        for n in range(rng.randint(4, 10)):
            thread = threading.Thread(
                target=self.caller,
                args=(random.Random(rng.random()), rng.randint(10, 30), keys),
                name=f"storm caller {n}",
                daemon=True,  # (a hung storm must not hang the test run)
            )
            self.threads.append(thread)
            thread.start()

    def done(self) -> bool:
        return not any(thread.is_alive() for thread in self.threads)


def wait_for_threads(storm: Storm, threads: Threads, queue: KeyedQueueLike) -> None:
    """Block until every thread ended; fail the storm if no caller is answered for STALL s."""
    began = since = time.monotonic()
    progress = -1
    while not threads.done():
        now = time.monotonic()
        if storm.answered != progress:
            progress, since = storm.answered, now
        if now - since > STALL or now - began > PATIENCE:
            waiting = [call for call in storm.calls if not call.answers]
            storm.fail(
                [
                    f"hung: {len(waiting)} callers never answered",
                    *map(repr, waiting),
                    *inside(queue),
                ],
                "hang",
            )
        time.sleep(0.005)


def thread_problems(storm: Storm, queue: KeyedQueueLike, keys: list[Hashable]) -> list[str]:
    """Every key free once the threads ended, and a new turn on each taken at once."""
    problems = [*storm.counted(queue), *storm.idle(queue, keys)]
    for key in keys:
        try:
            with queue.keyed(key, timeout=0):
                pass
        except TimeoutError:
            problems.append(f"key {key!r}: a new turn was not taken at once: {queue!r}")
    return problems


@pytest.mark.parametrize("seed", seeds(20))
def test_a_storm_of_threads(seed: int) -> None:
    rng = random.Random(seed)
    settings = Settings.draw(rng, unit=UNIT)
    keys: list[Hashable] = [f"k{n}" for n in range(rng.randint(1, 3))]
    storm = Storm(seed, settings, time.monotonic, LATE)
    queue = settings.queue()
    interrupts = Interrupts(random.Random(rng.random()), gap=UNIT * 3)
    threads = Threads(storm, queue, interrupts)
    with interrupts.running():
        threads.start(rng, keys)
        wait_for_threads(storm, threads, queue)
    problems = [f"a caller thread died: {error!r}" for error in threads.crashed]
    storm.fail([*problems, *storm.problems(), *thread_problems(storm, queue, keys)], "threads")


@pytest.mark.parametrize("seed", seeds(20))
def test_a_storm_of_tasks_and_threads(seed: int) -> None:
    rng = random.Random(seed)
    settings = Settings.draw(rng, unit=UNIT)
    keys: list[Hashable] = [f"k{n}" for n in range(rng.randint(1, 3))]
    storm = Storm(seed, settings, time.monotonic, LATE)
    queue = settings.queue()
    interrupts = Interrupts(random.Random(rng.random()), gap=UNIT * 3)
    threads = Threads(storm, queue, interrupts)

    async def scenario() -> None:
        tasks = Tasks(storm, queue, random.Random(rng.random()), unit=UNIT)
        threads.start(rng, keys)
        await tasks.storm_of(rng.randint(30, 100), keys)
        await answered(
            storm,
            lambda: threads.done() and all(t.done() for t in tasks.tasks),
            "tasks and threads",
            queue=queue,
        )
        problems = [f"a caller thread died: {error!r}" for error in threads.crashed]
        problems += [f"a thread touched the loop's timers: {call}" for call in loop.foreign]
        problems += storm.problems()
        problems += await free_at_once(storm, queue, keys)
        storm.fail(problems, "tasks and threads")

    loop = OwnThreadTimers()  # (asyncio's loops are not thread-safe)
    with interrupts.running():
        loop.run(scenario())


# -- the checks themselves: each catches what it claims ------------------------------------------


def recorded(settings: Settings, *events: tuple[Any, ...]) -> Storm:
    """A storm's record made by hand: ("call", name, key, shape, timeout) numbers a call,
    ("run", name) starts its work and ("end", name) ends it, ("answer", name, outcome)
    answers it; an outcome ("ran", name) is that work's last run's result."""
    storm = Storm(0, settings, time.monotonic, LATE)
    calls: dict[str, Call] = {}
    runs: dict[str, Any] = {}
    for event in events:
        kind, name = event[0], event[1]
        if kind == "call":
            key, shape, limit = event[2], event[3], event[4]
            conflates = settings.conflates and not shape.startswith("keyed") and limit != 0
            calls[name] = storm.called(Call(key, shape, conflates, limit))
        elif kind == "run":
            runs[name] = storm.begin(calls[name].seq, calls[name].key)
        elif kind == "end":
            storm.end(runs[name])
        else:
            outcome = event[2]
            if isinstance(outcome, tuple):
                run = runs[outcome[1]]
                outcome = (run.seq, run.start)
            storm.answer(calls[name], outcome)
    return storm


LATEST = Settings(pending="latest")


@pytest.mark.parametrize(
    ("settings", "events", "found"),
    [
        (  # two works of a key at once
            Settings(),
            [
                ("call", "a", "k", "run", None),
                ("call", "b", "k", "run", None),
                ("run", "a"),
                ("run", "b"),
                ("end", "a"),
                ("end", "b"),
                ("answer", "a", ("ran", "a")),
                ("answer", "b", ("ran", "b")),
            ],
            "ran at once",
        ),
        (  # answered twice
            Settings(),
            [
                ("call", "a", "k", "run", None),
                ("run", "a"),
                ("end", "a"),
                ("answer", "a", ("ran", "a")),
                ("answer", "a", ("ran", "a")),
            ],
            "answered 2 times",
        ),
        (  # answered by a run that started before the call (coalescing, not latest wins)
            LATEST,
            [
                ("call", "a", "k", "run", None),
                ("run", "a"),
                ("call", "b", "k", "run", None),
                ("end", "a"),
                ("answer", "a", ("ran", "a")),
                ("answer", "b", ("ran", "a")),
            ],
            "started before its call",
        ),
        (  # "raise" answered by the newer work's outcome
            Settings(pending="latest", on_superseded="raise"),
            [
                ("call", "a", "k", "run", None),
                ("call", "b", "k", "run", None),
                ("run", "b"),
                ("end", "b"),
                ("answer", "a", ("ran", "b")),
                ("answer", "b", ("ran", "b")),
            ],
            "not Superseded",
        ),
        (  # a timeout without one
            LATEST,
            [("call", "a", "k", "run", None), ("answer", "a", TimeoutError())],
            "without a timeout",
        ),
        (  # an older work runs last while a newer caller still wanted its own
            LATEST,
            [
                ("call", "a", "k", "run", None),
                ("call", "b", "k", "run", None),
                ("run", "b"),
                ("end", "b"),
                ("run", "a"),
                ("end", "a"),
                ("answer", "b", ("ran", "b")),
                ("answer", "a", ("ran", "a")),
            ],
            "still wanted",
        ),
        (  # a caller answered by an older work
            LATEST,
            [
                ("call", "a", "k", "run", None),
                ("call", "b", "k", "decorated", None),
                ("run", "a"),
                ("end", "a"),
                ("answer", "a", ("ran", "a")),
                ("answer", "b", ("ran", "a")),
            ],
            "an older call's work",
        ),
        (  # Superseded, with no newer call
            Settings(pending="latest", on_superseded="raise"),
            [("call", "a", "k", "run", None), ("answer", "a", Superseded("x"))],
            "no newer call",
        ),
        (  # a thrown exception nobody threw
            Settings(),
            [("call", "a", "k", "run_sync", None), ("answer", "a", Thrown())],
            "never thrown",
        ),
    ],
)
def test_the_storms_checks_catch_what_they_claim(
    settings: Settings, events: list[tuple[Any, ...]], found: str
) -> None:
    problems = recorded(settings, *events).problems()
    assert any(found in problem for problem in problems), problems


def test_the_storms_checks_pass_a_storm_that_keeps_every_promise() -> None:
    storm = recorded(
        LATEST,
        ("call", "a", "k", "run", None),
        ("run", "a"),
        ("call", "b", "k", "run", None),  # waits
        ("call", "c", "k", "submit", None),  # replaces b
        ("call", "d", "k", "keyed", None),  # a block: after the latest's place
        ("end", "a"),
        ("answer", "a", ("ran", "a")),
        ("run", "c"),
        ("end", "c"),
        ("answer", "b", ("ran", "c")),
        ("answer", "c", ("ran", "c")),
        ("run", "d"),
        ("end", "d"),
        ("answer", "d", ("ran", "d")),
    )
    assert storm.problems() == []
