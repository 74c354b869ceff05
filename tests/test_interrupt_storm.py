"""Interrupt storms: exceptions thrown into threads while they take in-process turns.

Issue 41's defect 9: CPython runs a signal handler not only at the start of a Python
function but also right after a built-in call returns, so a handler's exception can
land just after the registry took a key or appended a waiter. Wherever it lands while
a thread takes its turn, nothing of the turn may stay (README, Deploying).

Threads take turns on a handful of keys (``with q.keyed(k)``, timed and untimed,
``keyed(k1, k2)``, ``q.run_sync``) while :class:`storm.Thrown` is thrown into them:
by a ``SIGALRM`` handler in the main thread (which takes turns too), and by
``PyThreadState_SetAsyncExc`` into the others, at random moments. Each thread catches
it around its turn and goes on. At the end every thread is done, no key is active,
and one more turn on every key is taken at once; never were two works of a key in
their block at once.

Where the exception may land: ``taking`` (while the turn is taken, up to the first
line of its work: what the README promises today) or ``anywhere`` (also in the work
and in the turn's end, after it: what the issue's "done when" storm throws; the
README says an interrupt there "may leave the key held by this process").

Sizes: small by default (still enough to catch defect 9 on the current code);
``INTURN_STORM=full`` runs the issue's: 64 threads and the main thread taking 10,000
turns each, and the 8-thread SIGALRM storm at 10,000 turns each. Run the full storm
10 times in a row: ``for i in $(seq 10); do INTURN_STORM=full pytest -m storm
tests/test_interrupt_storm.py -x || break; done``.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from inturn import KeyedQueue

from support.helpers import PATIENCE
from support.storm import FULL, Alarm, Interrupts, Stalled, Thrown, inside, seeds

pytestmark = [
    pytest.mark.storm,
    pytest.mark.usefixtures("collector_paused"),  # (no finalizer runs where one lands)
    pytest.mark.timeout(3600 if FULL else 300),
    pytest.mark.skipif(sys.platform == "win32", reason="POSIX: SIGALRM and setitimer"),
]

KEYS: tuple[Hashable, ...] = ("k0", "k1", "k2", "k3", "k4")
#: The most seconds between two exceptions thrown (the alarm, and into the threads).
GAP = 0.002
#: A storm in which no turn ended for this long has hung (a turn takes microseconds).
STALL = 5.0

Arming = Interrupts | Alarm


class Tally:
    """What the storm's takers did: turns taken, exceptions caught, overlaps seen."""

    def __init__(self, takers: int) -> None:
        self.turns = [0] * takers
        self.caught = [0] * takers
        self.crashed: list[BaseException | None] = [None] * takers
        self.overlaps: list[str] = []
        self.guard = threading.Lock()
        self.inside = dict.fromkeys(KEYS, 0)  # key -> works inside their turn on it now

    @property
    def progress(self) -> int:
        return sum(self.turns)


class Taker:
    """One thread's turns: a key or two, ``keyed()`` (timed or not) or ``run_sync``."""

    def __init__(
        self,
        queue: KeyedQueue,
        arming: Arming | None,
        rng: random.Random,
        tally: Tally,
        index: int,
        where: str,
    ) -> None:
        self.queue, self.arming, self.rng = queue, arming, rng
        self.tally, self.index, self.where = tally, index, where

    def work(self, *keys: Hashable) -> None:
        """The turn's work: disarmed while it checks that no other work of its keys is in."""
        arming, tally = self.arming, self.tally
        if arming is not None:
            arming.hold()  # (may raise one that landed just now: the work raised it)
        with tally.guard:
            for key in keys:
                tally.inside[key] += 1
                if tally.inside[key] > 1:
                    tally.overlaps.append(f"two works of {key!r} at once")
        if self.rng.random() < 0.1:
            time.sleep(0)  # (let another thread run inside a turn now and then)
        with tally.guard:
            for key in keys:
                tally.inside[key] -= 1
        if arming is not None and self.where == "anywhere":
            arming.arm()  # (from here to the end of the turn, after it)

    def turn(self) -> None:
        rng, queue = self.rng, self.queue
        shape = rng.random()
        key = rng.choice(KEYS)
        if shape < 0.35:
            with queue.keyed(key):
                self.work(key)
        elif shape < 0.5:
            with queue.keyed(key, timeout=PATIENCE):
                self.work(key)
        elif shape < 0.7:
            other = rng.choice([k for k in KEYS if k != key])
            with queue.keyed(key, other):
                self.work(key, other)
        else:
            queue.run_sync(key, self.work, key)

    def take(self, turns: int) -> None:
        """Take turns one after another, catching each exception thrown in (see storm)."""
        arming, tally, index = self.arming, self.tally, self.index
        for _ in range(turns):
            try:
                if arming is not None:
                    arming.arm()
                self.turn()
                if arming is not None:
                    arming.hold()
            except Thrown:
                tally.caught[index] += 1
            tally.turns[index] += 1

    def run(self, turns: int) -> None:
        """A thread's target: take turns; note how it ended."""
        try:
            self.take(turns)
        except BaseException as error:  # reported
            self.tally.crashed[self.index] = error


@contextmanager
def watched(tally: Tally, alarm: Alarm) -> Iterator[list[bool]]:
    """Watch the storm's progress; once no turn ended for STALL seconds, have the alarm raise
    Stalled in the main thread (it may wait for ever in a turn) and note it."""
    stalled = [False]
    stop = threading.Event()

    def watch() -> None:
        progress, since = -1, time.monotonic()
        while not stop.wait(0.2):
            if tally.progress != progress:
                progress, since = tally.progress, time.monotonic()
            elif time.monotonic() - since > STALL and not stalled[0]:
                stalled[0] = True
                alarm.stalled = True

    watcher = threading.Thread(target=watch, name="storm watchdog", daemon=True)
    watcher.start()
    try:
        yield stalled
    finally:
        stop.set()
        watcher.join(PATIENCE)


def interrupt_storm(seed: int, threads: int, turns: int, where: str, into_threads: bool) -> None:
    """threads threads and the main thread take turns each; the main thread under SIGALRM,
    the others (into_threads) under PyThreadState_SetAsyncExc. Fails naming the seed."""
    rng = random.Random(seed)
    queue = KeyedQueue()
    tally = Tally(threads + 1)
    interrupts = Interrupts(random.Random(rng.random()), GAP) if into_threads else None
    alarm = Alarm(random.Random(rng.random()), GAP)
    takers = [
        Taker(queue, interrupts, random.Random(rng.random()), tally, n, where)
        for n in range(threads)
    ]
    main = Taker(queue, alarm, random.Random(rng.random()), tally, threads, where)
    workers = [
        threading.Thread(target=taker.run, args=(turns,), name=f"taker {n}", daemon=True)
        for n, taker in enumerate(takers)
    ]
    problems: list[str] = []
    began = time.monotonic()
    with (
        alarm.running(),
        interrupts.running() if interrupts is not None else _nothing(),
        watched(tally, alarm) as stalled,
    ):
        for worker in workers:
            worker.start()
        try:
            main.take(turns)
        except Stalled:
            problems.append("the main thread waited for ever in a turn")
        for worker in workers:
            try:
                worker.join(max(0.1, began + PATIENCE * 10 - time.monotonic()))
            except Stalled:
                break
    seconds = time.monotonic() - began
    if stalled[0]:
        problems.append(f"no turn ended for {STALL} s: the storm hung")
    alive = [worker.name for worker in workers if worker.is_alive()]
    if alive:
        problems.append(f"{len(alive)} threads never finished: {', '.join(alive[:8])}")
    problems += [f"taker {n} died: {error!r}" for n, error in enumerate(tally.crashed) if error]
    problems += tally.overlaps[:5]
    if queue.active_count:
        problems.append(f"{queue.active_count} keys still active: {queue!r}")
        problems += inside(queue)
    for key in KEYS:
        if queue.pending(key):
            problems.append(f"key {key!r}: {queue.pending(key)} pending")
        try:
            with queue.keyed(key, timeout=0):
                pass
        except TimeoutError:
            problems.append(f"key {key!r}: one more turn was not taken at once")
    thrown = alarm.thrown + (0 if interrupts is None else interrupts.thrown)
    summary = (
        f"interrupt storm seed {seed} ({where}; replay: INTURN_STORM_SEED={seed}): "
        f"{threads} threads and the main thread, {tally.progress:,} of "
        f"{(threads + 1) * turns:,} turns in {seconds:.1f} s, {thrown:,} exceptions thrown "
        f"({alarm.thrown:,} by SIGALRM), {sum(tally.caught):,} caught"
    )
    print(summary)
    if problems:
        pytest.fail(summary + ":\n  " + "\n  ".join(problems), pytrace=False)


@contextmanager
def _nothing() -> Iterator[Any]:
    yield None


@pytest.fixture(autouse=True)
def _switching_often() -> Iterator[None]:
    """Switch threads often, so that exceptions land at many more points of a turn."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.parametrize("where", ["taking", "anywhere"])
@pytest.mark.parametrize("seed", seeds(1))
def test_64_threads_and_the_main_thread_interrupted_in_their_turns(seed: int, where: str) -> None:
    """The issue's storm: 64 threads, and the main thread under SIGALRM, taking 10,000
    turns each (INTURN_STORM=full; 2,500 each by default)."""
    interrupt_storm(seed, 64, 10_000 if FULL else 2_500, where, into_threads=True)


@pytest.mark.parametrize("where", ["taking", "anywhere"])
@pytest.mark.parametrize("seed", seeds(2))
def test_8_threads_and_the_main_thread_under_sigalrm(seed: int, where: str) -> None:
    """The issue's first reproduction: a SIGALRM handler raises while the main thread takes
    in-process turns, 8 threads contending on the same keys (not interrupted themselves).
    10,000 turns each with INTURN_STORM=full; 2,000 by default."""
    interrupt_storm(seed, 8, 10_000 if FULL else 2_000, where, into_threads=False)
