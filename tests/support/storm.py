"""Storms: many callers of one queue at once, chosen by a seeded ``random.Random``, and the
invariants every run must keep (see :meth:`Storm.problems`).

A storm records, for each call, a sequence number taken at the call (``Call.seq``) and
its answer; for each work that runs, the call whose work it is and when it started and
ended, all on one global counter (``Storm.tick``). The checks then need no timing
luck: "started after its call" is ``run.start > call.seq``, "never two at once" is
two intervals of the counter that do not overlap.

Interrupts: :class:`Interrupts` throws :class:`Thrown` into threads with
``PyThreadState_SetAsyncExc`` at random moments, and :class:`Alarm` raises it from a
``SIGALRM`` handler in the main thread. Either only while the thread is *armed*
(``arm()``, around a turn), at most once per arming, and ``hold()`` disarms (clearing
an exception thrown but not landed yet): so one lands only where the test means it
to, never in the test's own bookkeeping, and a thread that catches it around its
turn goes on.
"""

from __future__ import annotations

import bisect
import ctypes
import gc
import itertools
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import pytest

from inturn import KeyedQueue, QueueClosed, QueueFull, Superseded

from .helpers import PATIENCE

#: A storm that makes no progress (no caller answered) for this long has hung.
STALL = 10.0
#: How late a work may start after its caller's timeout ran out, on a real clock: the
#: turn was reached in time, and its thread woke after (0.59 s seen on a 2-core machine
#: under a parallel suite; a timeout not applied shows as a wait the length of the storm).
LATE = 2.0
#: How early a task's TimeoutError may come on a virtual clock: its deadline counts from
#: the real time of its call, put on the loop's clock at its first wait, so the real time
#: between (0.08 s seen under a loaded parallel run) is virtual time it loses.
EARLY = 1.0

# -- which seeds run ------------------------------------------------------------------------

#: ``INTURN_STORM_SEED=s``: run only seed s (a failure names its seed: replay it so).
#: ``INTURN_STORM_SEEDS=n``: run n seeds per storm instead of the default few (the long run),
#: from ``INTURN_STORM_FIRST`` (default 0: give each of several runs new seeds).
#: ``INTURN_STORM=full``: the interrupt storms at full size (64 threads, 10,000 turns each).
FULL = os.environ.get("INTURN_STORM", "") == "full"


def seeds(default: int) -> list[int]:
    """The seeds a storm test runs: INTURN_STORM_SEED's alone, or INTURN_STORM_SEEDS (or
    ``default``) of them from INTURN_STORM_FIRST."""
    one = os.environ.get("INTURN_STORM_SEED")
    if one:
        return [int(one)]
    first = int(os.environ.get("INTURN_STORM_FIRST", 0))
    return list(range(first, first + int(os.environ.get("INTURN_STORM_SEEDS", default))))


# -- the exceptions -----------------------------------------------------------------------------


class Thrown(BaseException):
    """The exception thrown into a thread (an interrupt: as KeyboardInterrupt, SystemExit)."""


class Stalled(BaseException):
    """Raised in the main thread by the alarm once a storm stopped making progress."""


class WorkError(Exception):
    """What a failing work raises: the call whose work it is, and its run's start."""

    def __init__(self, seq: int, start: int) -> None:
        super().__init__(seq, start)
        self.seq, self.start = seq, start


# -- what a storm records -----------------------------------------------------------------------


@dataclass(eq=False)
class Call:
    """One caller: its call, and what it was answered."""

    key: Hashable
    shape: str  # how it called: run, decorated, submit, keyed; run_sync, decorated_sync, keyed_sync
    conflates: bool  # its work may be replaced (not a keyed() block) on a conflating queue
    timeout: float | None  # its limit for reaching its turn
    seq: int = 0  # the counter at its call: its work's name
    at: int = 0  # a submission's: the counter once placed (see Storm.placed); else seq
    thread: int = 0  # the thread that called
    span: tuple[int, float] = (0, 0)  # where the queue took its place (see Storm)
    called: float = 0.0  # the clock at its call
    cancelled: bool = False  # the test cancelled it (its task, or its handle)
    interrupted: bool = False  # an exception was thrown into its thread while it was armed
    answers: list[Any] = field(default_factory=list)  # what it got: a value or an exception
    answered_at: int = 0  # the counter at its (last) answer
    answered_time: float = 0.0  # the clock then

    def __repr__(self) -> str:
        answer = self.answers[0] if len(self.answers) == 1 else self.answers
        notes = "".join(
            f" {note}"
            for note, on in (("cancelled", self.cancelled), ("interrupted", self.interrupted))
            if on
        )
        limit = "" if self.timeout is None else f" timeout={self.timeout:g}"
        return f"<call {self.seq} {self.shape}({self.key!r}){limit}{notes} -> {answer!r}>"


@dataclass(eq=False)
class Run:
    """One run of a work: the call whose work it is, and when it started and ended."""

    seq: int
    key: Hashable
    start: int  # the counter
    started: float  # the clock
    end: int = 0  # the counter; 0 while it runs

    def __repr__(self) -> str:
        return f"<run of {self.seq} on {self.key!r} [{self.start}, {self.end or '...'}]>"


@dataclass(frozen=True)
class Settings:
    """A queue's settings in a storm, and the per-call timeouts its callers draw from."""

    pending: str = "all"
    on_superseded: str = "join"
    debounce: float | None = None
    max_wait: float | None = None
    max_running: int | None = None
    max_pending: int | None = None
    timeout: float | None = None  # the queue's: run, run_sync and submit use it
    timeouts: tuple[float | None, ...] = (None,)  # decorators' and keyed()'s own, to pick from

    @classmethod
    def draw(cls, rng: random.Random, unit: float) -> Settings:
        """Settings at random; times in units of ``unit`` seconds (a work holds ~1 unit)."""
        debounce = rng.choice([None, None, unit * rng.uniform(0.5, 4)])
        return cls(
            pending=rng.choice(["all", "latest"]),
            on_superseded=rng.choice(["join", "raise"]),
            debounce=debounce,
            max_wait=None if debounce is None else rng.choice([None, debounce * 2]),
            max_running=rng.choice([None, None, 1, 2]),
            max_pending=rng.choice([None, None, None, 1, 3]),
            timeout=rng.choice([None, None, unit * rng.uniform(2, 20)]),
            timeouts=(None, 0.0, unit * rng.uniform(1, 5), unit * rng.uniform(5, 30)),
        )

    @property
    def conflates(self) -> bool:
        return self.pending == "latest" or self.debounce is not None

    def queue(self) -> KeyedQueue:
        return KeyedQueue(
            pending=self.pending,  # type: ignore[arg-type]
            on_superseded=self.on_superseded,  # type: ignore[arg-type]
            debounce=self.debounce,
            max_wait=self.max_wait,
            max_running=self.max_running,
            max_pending=self.max_pending,
            timeout=self.timeout,
        )


#: The end of the span of a call whose thread never took another number.
_NEVER = float("inf")


def _a_work(call: Call) -> bool:
    """Whether call's work takes a place in its key's line as a work (see Storm)."""
    return not call.shape.startswith("keyed") and call.timeout != 0


def _ticker() -> Callable[[], int]:
    return itertools.count(1).__next__  # (atomic in CPython: threads may share it)


class Storm:
    """The record of one storm on one queue, and its checks.

    Every event (a call, a submission placed, a work's start and end, an answer) takes
    the next number of one counter, noting the thread it happened in. A call's place in
    its key's line is taken somewhere between its number (``seq``, read just before it
    calls the queue) and the next number its own thread takes (the queue has taken it
    by then): for a task that is at once, for a thread waiting in a line, not until it
    is woken. So two calls of different threads can come in either order when their
    spans overlap: the checks that depend on which came first count only pairs where
    it is certain (``surely_before``). Tasks of one loop never overlap: task storms
    check every pair.
    """

    def __init__(
        self, seed: int, settings: Settings, clock: Callable[[], float], late: float
    ) -> None:
        self.seed = seed
        self.settings = settings
        self.clock = clock
        self.late = late  # see LATE
        # A virtual clock (task storms): a submission's timeout counts from the real time
        # of its call, put on the loop's clock once its task waits (see _drive.drive): the
        # virtual time it waited in line as a handle is not counted, so how late its work
        # may start is not bounded there (its TimeoutError, never early, still is checked).
        self.virtual = clock is not time.monotonic
        self._next = _ticker()
        self.marks: list[tuple[int, int]] = []  # (number, thread), each event's
        self.calls: list[Call] = []
        self.runs: list[Run] = []

    def tick(self) -> int:
        """The next number, for an event of this thread."""
        number = self._next()
        self.marks.append((number, threading.get_ident()))
        return number

    def called(self, call: Call) -> Call:
        """Number call now: it is about to call the queue."""
        call.thread = threading.get_ident()
        call.seq = call.at = self.tick()
        call.called = self.clock()
        self.calls.append(call)
        return call

    def placed(self, call: Call) -> None:
        """call (a submission) took its place just now: ``submit()`` returned. (With
        ``max_running`` it may first wait for a slot, unless its key is busy: its place
        is then later than its call, and so its order among its key's works.)"""
        call.at = self.tick()
        call.called = self.clock()  # (its timeout counts from its place: see Handle)

    def begin(self, seq: int, key: Hashable) -> Run:
        """A work (call seq's) starts."""
        run = Run(seq, key, self.tick(), self.clock())
        self.runs.append(run)
        return run

    def end(self, run: Run) -> None:
        run.end = self.tick()

    def answer(self, call: Call, outcome: Any) -> None:
        call.answered_at = self.tick()
        call.answered_time = self.clock()
        call.answers.append(outcome)

    @property
    def answered(self) -> int:
        return sum(1 for call in self.calls if call.answers)

    # -- the checks -----------------------------------------------------------------------

    def problems(self) -> list[str]:
        """Every broken invariant of the storm (see each check)."""
        self._spans()
        return [
            *self._answers(),
            *self._one_at_a_time(),
            *self._newest_still_wanted_runs(),
        ]

    def _spans(self) -> None:
        """Set each call's span: where between two numbers the queue took its place."""
        mine: dict[int, list[int]] = defaultdict(list)
        for number, thread in sorted(self.marks):
            mine[thread].append(number)
        for call in self.calls:
            numbers = mine[call.thread]
            if call.at == call.seq:  # placed at its call: by its thread's next event
                after = bisect.bisect_right(numbers, call.seq)
                call.span = (call.seq, numbers[after] if after < len(numbers) else _NEVER)
            else:  # a submission, placed just before submit() returned (at)
                before = bisect.bisect_left(numbers, call.at) - 1
                call.span = (numbers[before] if before >= 0 else call.seq, call.at)

    @staticmethod
    def surely_before(one: Call, other: Call) -> bool:
        """Whether one took its place in the line before other, for certain."""
        return one.span[1] <= other.span[0]

    def _newer(self, call: Call, keyed: dict[Hashable, list[Call]]) -> list[Call]:
        """The calls of call's key that may replace its work and may be newer than it,
        made before its answer."""
        return [
            other
            for other in keyed[call.key]
            if other is not call
            and not self.surely_before(other, call)
            and other.span[0] < call.answered_at
        ]

    def _replaced_handle(self, call: Call, keyed: dict[Hashable, list[Call]]) -> bool:
        """Whether call is a ``submit()`` handle that newer work may have replaced before its
        answer, on a "join" queue: then it let its work go, and follows what runs in its
        place."""
        return (
            call.shape == "submit"
            and call.conflates
            and self.settings.on_superseded == "join"
            and bool(self._newer(call, keyed))
        )

    def _cut(self, call: Call, keyed: dict[Hashable, list[Call]]) -> bool:
        """Whether call may be answered by a cut run (a cancellation, or the thrown exception)
        it did not cause: it conflates (its work may run in another caller's turn, a turn
        that runs newer work, or, a replaced handle, it follows what runs in its place),
        and another caller of its key was cancelled or interrupted. A run that is cut
        answers the caller whose work it started with the cut (its function was called:
        its body may not have begun), and the handles that follow it: a work is started
        at most once."""
        if self._replaced_handle(call, keyed):
            return True  # (nothing may run in its place: the newer callers gave up)
        others = [other for other in keyed[call.key] if other is not call]
        return call.conflates and any(other.cancelled or other.interrupted for other in others)

    def _answers(self) -> Iterator[str]:
        """Every caller answered exactly once, with an allowed answer.

        "Newer" is later in its key's line (see the class: a call may be newer than
        another only if that one was not surely before it). Allowed: its own work's
        outcome; on a conflating queue with "join", that of a newer work of the same key
        (for a replaced ``submit()`` handle, which lets its work go and "gets the
        outcome of whatever runs in its place", that of any work of its key that may be
        replaced); with "raise", Superseded (a newer call of its key came before the
        answer); TimeoutError only with a timeout, not before it ran out, and its work
        never ran; CancelledError, or Thrown, only if cancelled, or interrupted, or if its
        work ran in another caller's turn or it follows what runs in its place, and that
        turn may have been cut (see _cut); QueueFull only with max_pending. A work's
        outcome must come from a run that started after the call; with a timeout, that
        work (its first run) started within the timeout.
        """
        settings = self.settings
        runs_by_start = {run.start: run for run in self.runs}
        first_run: dict[int, Run] = {}
        for each in sorted(self.runs, key=lambda each: each.start):
            first_run.setdefault(each.seq, each)
        calls = {call.seq: call for call in self.calls}
        keyed: dict[Hashable, list[Call]] = defaultdict(list)
        for call in self.calls:
            if call.conflates:
                keyed[call.key].append(call)
        for call in self.calls:
            if len(call.answers) != 1:
                yield f"{call!r}: answered {len(call.answers)} times"
                continue
            (answer,) = call.answers
            if isinstance(answer, tuple | WorkError):
                seq, start = answer if isinstance(answer, tuple) else (answer.seq, answer.start)
                run = runs_by_start.get(start)
                if run is None or run.seq != seq:
                    yield f"{call!r}: answered from no run of work {seq} started at {start}"
                    continue
                if run.key != call.key:
                    yield f"{call!r}: answered by {run!r}, of another key"
                if start < call.span[0]:
                    yield f"{call!r}: answered by {run!r}, which started before its call"
                if seq != call.seq:
                    other = calls[seq]
                    if not (call.conflates and other.conflates):
                        yield f"{call!r}: answered by {run!r}, another call's work"
                    elif settings.on_superseded == "raise":
                        yield f"{call!r}: with 'raise', answered by {run!r}, not Superseded"
                    elif self.surely_before(other, call) and not self._replaced_handle(call, keyed):
                        yield f"{call!r}: answered by {run!r}, an older call's work"
                if call.timeout is not None and not (self.virtual and call.shape == "submit"):
                    began = first_run[seq].started - call.called
                    if began > call.timeout + self.late:
                        yield (
                            f"{call!r}: its answer's work started {began:.3f} s after its "
                            f"call, past its timeout"
                        )
            elif isinstance(answer, Superseded):
                raised = call.conflates and settings.on_superseded == "raise"
                if not (raised and self._newer(call, keyed)):
                    yield f"{call!r}: Superseded, but no newer call of its key replaced it"
            elif isinstance(answer, TimeoutError):
                waited = call.answered_time - call.called
                if call.timeout is None:
                    yield f"{call!r}: TimeoutError, without a timeout"
                elif waited < call.timeout - (EARLY if self.virtual else 0.01):
                    yield f"{call!r}: TimeoutError after {waited:.3f} s, before its timeout"
                if call.seq in first_run:
                    yield f"{call!r}: TimeoutError, yet its work ran ({first_run[call.seq]!r})"
            elif isinstance(answer, QueueFull):
                if settings.max_pending is None:
                    yield f"{call!r}: QueueFull without max_pending"
            elif isinstance(answer, Thrown):
                if not (call.interrupted or self._cut(call, keyed)):
                    yield f"{call!r}: the thrown exception, never thrown at it"
            elif isinstance(answer, BaseException) and type(answer).__name__ == "CancelledError":
                if not (call.cancelled or self._cut(call, keyed)):
                    yield f"{call!r}: CancelledError, never cancelled"
            else:
                yield f"{call!r}: an answer no caller may get"

    def _one_at_a_time(self) -> Iterator[str]:
        """Never two works of a key at once, never more than max_running works at once, and
        every work that started ended."""
        by_key: dict[Hashable, list[Run]] = defaultdict(list)
        for run in self.runs:
            if not run.end:
                yield f"{run!r} never ended"
            by_key[run.key].append(run)
        for runs in by_key.values():
            runs.sort(key=lambda run: run.start)
            for before, after in itertools.pairwise(runs):
                if before.end and after.start < before.end:
                    yield f"{before!r} and {after!r} ran at once"
        limit = self.settings.max_running
        if limit is not None:
            events = sorted(
                [(run.start, 1) for run in self.runs] + [(run.end, -1) for run in self.runs]
            )
            running = 0
            for at, change in events:
                running += change
                if running > limit:
                    yield f"{running} works ran at once at {at}, max_running={limit}"
                    break

    def _newest_still_wanted_runs(self) -> Iterator[str]:
        """The newest still-wanted work of each key is the last to run.

        Precisely: among the works that take a place in a key's line as works (every
        call but ``keyed()`` blocks and ``timeout=0`` calls, which a newer work never
        replaces), take for each key the last to start; every such call of the key
        surely placed after it gave up or was refused: it was answered CancelledError,
        TimeoutError, Thrown, QueueFull, or Superseded (then a newer call replaced it,
        and is checked in turn), or it is a replaced ``submit()`` handle on a "join"
        queue (it let its work go when newer work replaced it). So no work newer than
        the last one run was still wanted, and no older work ran after a newer one that
        was. On a queue that does not conflate, this is FIFO's "the newest call runs
        last". (It does not say when a newer caller gave up: a caller may give up while
        an older work runs that had taken its place already.)
        """
        calls = {call.seq: call for call in self.calls}
        last: dict[Hashable, Run] = {}
        for each in self.runs:
            if _a_work(calls[each.seq]) and (
                each.key not in last or each.start > last[each.key].start
            ):
                last[each.key] = each
        keyed: dict[Hashable, list[Call]] = defaultdict(list)
        for call in self.calls:
            if call.conflates:
                keyed[call.key].append(call)
        gave_up = (TimeoutError, QueueFull, Superseded, Thrown)
        for call in self.calls:
            if not _a_work(call) or len(call.answers) != 1:
                continue
            run = last.get(call.key)
            if run is not None and not self.surely_before(calls[run.seq], call):
                continue
            (answer,) = call.answers
            cancelled = type(answer).__name__ == "CancelledError"
            let_go = self._replaced_handle(call, keyed)
            if not (isinstance(answer, gave_up) or cancelled or let_go):
                after = "no work of its key ran" if run is None else f"the last was {run!r}"
                yield f"{call!r}: still wanted, but {after}"

    def counted(self, queue: KeyedQueue) -> Iterator[str]:
        """``stats()`` adds up to the calls queued: completed + failed + timed_out +
        cancelled + superseded is each call once, but those refused (QueueFull,
        QueueClosed). An interrupt may land before its call reached the queue or after
        it returned: such a call counts once or not at all."""
        stats = queue.stats()
        counted = (
            stats.completed + stats.failed + stats.timed_out + stats.cancelled + stats.superseded
        )
        refused = (QueueFull, QueueClosed)
        queued = [c for c in self.calls if not (c.answers and isinstance(c.answers[0], refused))]
        unsure = sum(1 for c in queued if c.answers and isinstance(c.answers[0], Thrown))
        # A debounced burst is refused (QueueFull) when its quiet period ends: a handle it
        # replaced before then was counted as replaced already.
        settings = self.settings
        replaced = settings.debounce is not None and settings.on_superseded == "join"
        maybe = sum(
            1
            for c in self.calls
            if replaced
            and c.shape == "submit"
            and c.conflates
            and c.answers
            and isinstance(c.answers[0], QueueFull)
        )
        low, high = len(queued) - unsure, len(queued) + maybe
        if not low <= counted <= high:
            span = f"{low} to {high}" if low != high else f"{low}"
            yield f"stats() counts {counted} turns for {span} calls queued: {stats}"
        if stats.running or stats.waiting_for_slot or stats.waiting:
            yield f"stats() once every caller was answered: {stats}"

    def idle(self, queue: KeyedQueue, keys: list[Hashable]) -> Iterator[str]:
        """Every key is free: nothing active, nothing pending."""
        if queue.active_count:
            yield f"{queue.active_count} keys still active: {queue!r}"
        for key in keys:
            if queue.pending(key):
                yield f"key {key!r}: pending() is {queue.pending(key)}"

    def fail(self, problems: list[str], what: str = "") -> None:
        """Fail the test with the problems found, naming the seed to replay it."""
        if not problems:
            return
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        pytest.fail(
            f"storm seed {self.seed} ({what}; replay: INTURN_STORM_SEED={self.seed}), "
            f"{self.settings}, {len(self.calls)} calls, {len(self.runs)} runs:"
            f"\n  {shown}{more}",
            pytrace=False,
        )


# -- interrupts -------------------------------------------------------------------------------


@contextmanager
def losing_thrown() -> Iterator[list[str]]:
    """Drop (and note) a Thrown that landed in a finalizer or a weakref callback, which the
    thread ran while armed (a collection, a last reference dropped in the library): Python
    only reports it as unraisable, so that interrupt is lost, as a real signal's would
    be. Any other unraisable exception goes to the hook there was."""
    lost: list[str] = []
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, Thrown):
            lost.append(repr(unraisable.object))
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield lost
    finally:
        sys.unraisablehook = previous


_set_async_exc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)


class Interrupts:
    """Throws Thrown into armed threads at random moments (``PyThreadState_SetAsyncExc``).

    A thread arms itself (``arm(call)``) before its turn and disarms (``hold()``) when
    the exception may no longer land (see the module). The thrower disarms a thread as
    it throws, so at most one lands per arming; ``hold()`` clears one thrown but not yet
    landed, so none lands after it returns. ``hold()`` raises the one that lands while
    it disarms: call it inside the ``try`` that catches Thrown.
    """

    def __init__(self, rng: random.Random, gap: float) -> None:
        self.rng = rng
        self.gap = gap  # the most seconds between two throws
        self.guard = threading.Lock()
        self.armed: dict[int, Call | bool] = {}  # thread -> its call (or True), while armed
        self.thrown = 0
        self.lost: list[str] = []  # thrown, and landed where Python could only report it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._throw, name="interrupter", daemon=True)

    def arm(self, call: Call | bool = True) -> None:
        with self.guard:
            self.armed[threading.get_ident()] = call

    def hold(self) -> None:
        me = threading.get_ident()
        with self.guard:
            self.armed.pop(me, None)
            _set_async_exc(me, ctypes.py_object())  # (NULL: clears one thrown, not landed yet)

    def _throw(self) -> None:
        while not self._stop.wait(self.rng.uniform(0, self.gap)):
            with self.guard:
                if not self.armed:
                    continue
                thread = self.rng.choice(sorted(self.armed))
                call = self.armed.pop(thread)
                if isinstance(call, Call):
                    call.interrupted = True
                _set_async_exc(thread, Thrown)
                self.thrown += 1

    @contextmanager
    def running(self) -> Iterator[Interrupts]:
        """Throw while the block runs; stop (and disarm every thread) when it ends."""
        self._thread.start()
        try:
            with losing_thrown() as self.lost, self._starting_unarmed():
                yield self
        finally:
            self._stop.set()
            self._thread.join(PATIENCE)
            with self.guard:
                for thread in self.armed:
                    _set_async_exc(thread, ctypes.py_object())
                self.armed.clear()
            _land_one()

    @contextmanager
    def _starting_unarmed(self) -> Iterator[None]:
        """Disarm a thread while it starts another (``Thread.start``), on CPython before 3.12.

        There, the new thread's state carries the id of the thread that starts it until
        it runs: an exception thrown at the starter meanwhile goes to the new thread,
        which dies before it starts, and ``Thread.start`` waits for it for ever (a storm
        saw a caller hang so, starting a file backend's tidy as its turn gave up). A
        signal's exception never goes there (it is raised in the main thread): this is
        ``PyThreadState_SetAsyncExc``'s alone, and 3.12 mends it.
        """
        if sys.version_info >= (3, 12):
            yield
            return
        start = threading.Thread.start

        def unarmed(thread: threading.Thread) -> None:
            me = threading.get_ident()
            with self.guard:
                call = self.armed.pop(me, None)
            try:
                start(thread)
            finally:
                if call is not None:  # (not thrown meanwhile: armed again, as it was)
                    with self.guard:
                        self.armed[me] = call

        threading.Thread.start = unarmed  # type: ignore[method-assign]
        try:
            yield
        finally:
            threading.Thread.start = start  # type: ignore[method-assign]


class _Landed(Exception):
    """The harmless exception _land_one throws."""


def _land_one() -> None:
    """Throw one exception into a thread of its own, and let it land there.

    Before Python 3.12, clearing a thrown exception that has not landed
    (``PyThreadState_SetAsyncExc`` with NULL, as ``hold()`` does) leaves the
    interpreter's "an exception is pending" flag set until one lands; and while
    it is set, an exception a trace function raises at a call sends the main
    thread into an endless loop (the interrupt sweeps that ran after a storm in
    the same process hung so). One that lands clears it.
    """
    started, landed = threading.Event(), threading.Event()

    def spin() -> None:
        started.set()
        try:
            while not landed.is_set():
                time.sleep(0)
        except _Landed:
            landed.set()

    thread = threading.Thread(target=spin, name="lands one", daemon=True)
    thread.start()
    started.wait(PATIENCE)
    assert thread.ident is not None
    _set_async_exc(thread.ident, _Landed)
    thread.join(PATIENCE)


class Alarm:
    """Raises Thrown from a SIGALRM handler in the main thread while it is armed.

    ``setitimer(ITIMER_REAL)`` fires every few hundred microseconds (re-armed at random
    by the handler); the handler raises only while the main thread is armed, and at
    most once per arming. Once ``stalled`` is set it raises Stalled instead, whatever
    the arming, so that a main thread waiting for ever is woken with the news.
    """

    def __init__(self, rng: random.Random, gap: float) -> None:
        self.rng = rng
        self.gap = gap
        self.armed = False
        self.stalled = False
        self.thrown = 0
        self.lost: list[str] = []  # (see Interrupts.lost)
        self.fired = 0

    def arm(self, call: Call | bool = True) -> None:
        self.armed = True

    def hold(self) -> None:
        self.armed = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self.fired += 1
        signal.setitimer(signal.ITIMER_REAL, self.rng.uniform(self.gap / 10, self.gap))
        if self.stalled:
            self.stalled = False
            raise Stalled("the storm stopped making progress")
        if self.armed:
            self.armed = False
            self.thrown += 1
            raise Thrown("from a SIGALRM handler")

    @contextmanager
    def running(self) -> Iterator[Alarm]:
        """Install the handler and the timer; restore the previous ones whatever happens."""
        assert threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGALRM, self._handler)
        timer = signal.setitimer(signal.ITIMER_REAL, self.gap)
        try:
            with losing_thrown() as self.lost:
                yield self
        finally:
            self.armed = False
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if timer[0] > 0:
                signal.setitimer(signal.ITIMER_REAL, *timer)


def inside(queue: Any) -> list[str]:
    """What a hung storm's queue holds, for its report: every conflating call's ticket still
    waiting, following or holding (found by the collector), with its Latest; each key's
    line; and where each thread in inturn's code is."""
    from inturn._latest import Ticket

    found = []
    for thing in gc.get_objects():
        if type(thing) is Ticket and thing.state.name not in ("ANSWERED", "LEFT", "STARTED"):
            latest = thing.latest
            found.append(
                f"{thing!r} ({type(thing.waiter).__name__}) in {latest!r}"
                + (
                    f": tickets {latest.tickets}, runner {latest.runner}, followers "
                    f"{latest.followers}, started {latest.started}"
                    if latest is not None
                    else ""
                )
            )
    for key, line in list(queue._registry.lines.items()):
        waiters = list(getattr(line, "waiters", ()))
        found.append(f"line {key!r}: held by {getattr(line, 'holder', line)!r}, {waiters}")
    for ident, frame in sys._current_frames().items():
        stack = traceback.format_stack(frame)
        if any("inturn" in step for step in stack):
            found.append(
                f"thread {ident}: " + " < ".join(s.split(",")[2].strip() for s in stack[-6:])
            )
    return found


__all__ = [
    "FULL",
    "LATE",
    "STALL",
    "Alarm",
    "Call",
    "Interrupts",
    "Run",
    "Settings",
    "Stalled",
    "Storm",
    "Thrown",
    "WorkError",
    "seeds",
]
