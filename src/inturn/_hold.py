"""max_hold's clock: cancels the holding task when the limit runs out.

The guarantee: a task's turn with ``max_hold=limit``, started at its loop's
``time()`` *t*, is cut (its task cancelled once, with the message
``inturn: max_hold=<limit> s ran out``) when the loop runs its timers at or
after *t + limit*, as a ``loop.call_later(limit, ...)`` made at *t* would be;
a turn that ends before then is never cut, and a turn's cut never touches
another turn. :meth:`Clock.stop` then says whether the limit cut the work.

How, cheaply: a turn sets no timer of its own. The clocks of one event loop
and one limit share a :class:`_Timer`: a FIFO of clocks, in deadline order
(each gets ``loop.time() + limit``, and a loop's time never goes back: no
heap), and one loop timer set for the earliest deadline of a clock that may
still run. Starting a clock appends it, and sets the timer if it is unset;
stopping one only marks it done (one store, harmless from any thread). When
the timer fires, it drops the done clocks at the head, cuts those whose
deadline came, and is set again for the new head's, or left unset once no
clock runs (and the ``_Timer`` is gone). So a run of turns that each end in
time sets the timer once per ``limit`` seconds, not once per turn; set up
to ``limit`` after the last one ended, it keeps only the ``_Timer`` and the
done clocks (not their tasks).

Nothing global keeps a loop, its tasks, or a timer: the table of timers
(``_TIMERS``) and the cache of the last one hold them weakly; a timer is
held by its loop's pending timer handle, so a loop that ends, even with
clocks running, drops it. A timer is only touched on its loop's thread (a
clock is started and stopped by its task: see ``_turn``), so each loop's
entry of the table has one writer. A forked child has copies, shared with
nobody: its parent's loops never run there, and its own loops are new.
"""

from __future__ import annotations

import asyncio
import sys
import weakref
from collections import deque
from collections.abc import Callable, Hashable
from time import monotonic as _monotonic
from typing import Any, Final, final

from ._describe import describe
from ._errors import HoldTimeout

#: Whether a task counts its cancellation requests (Task.cancelling(), uncancel()).
_COUNTS: Final = sys.version_info >= (3, 11)
#: asyncio's own loops tell time by time.monotonic(), called directly then (no frame).
_BASE_TIME = asyncio.BaseEventLoop.time


@final
class _Timer:
    """The clocks of one event loop and limit, and the one loop timer for the earliest."""

    __slots__ = ("__weakref__", "at", "clocks", "handle", "limit", "loop", "now")

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: float) -> None:
        self.loop = loop
        self.limit = limit
        self.clocks: deque[Clock] = deque()  # FIFO, so in deadline order (see the module's doc)
        # set for `at`, the head's deadline, while a clock runs; None once none does
        self.handle: asyncio.TimerHandle | None = None
        self.at = 0.0
        self.now: Callable[[], float] = _monotonic if type(loop).time is _BASE_TIME else loop.time

    def arm(self, at: float) -> None:
        self.at = at
        self.handle = self.loop.call_at(at, self._fire)

    def _fire(self) -> None:
        # NOTE: the loop runs a timer when its time is within the clock's resolution:
        # a deadline up to `at` has come, as it had for a call_later of its own.
        now = max(self.now(), self.at)
        clocks = self.clocks
        cut: list[Clock] = []
        while clocks:
            head = clocks[0]
            if head.task is not None:
                if head.deadline > now:
                    break
                cut.append(head)
            clocks.popleft()
        self.handle = None
        if clocks:
            self.arm(clocks[0].deadline)
        for clock in cut:  # (set again first: whatever cancel() does, the timer stays right)
            clock.expire()

    def __repr__(self) -> str:
        running = sum(clock.task is not None for clock in self.clocks)
        due = "unset" if self.handle is None else f"set for {self.at:.3f}"
        return f"<_Timer max_hold={self.limit:g} s, {running} running, {due}>"


#: The timer of each (id(loop), limit) some clock runs on; each timer holds its loop, so
#: its id is not reused while the entry lives.
_TIMERS: weakref.WeakValueDictionary[tuple[int, float], _Timer] = weakref.WeakValueDictionary()


def _none() -> None:
    return None


#: The timer found last (weakly): most turns start where the one before them did.
_last: Callable[[], _Timer | None] = _none


@final
class Clock:
    """A turn's max_hold: cancels the holding task when the limit runs out.

    Made by :func:`start_clock`. Once stopped, it is no longer its turn's:
    its timer may start it again for another turn.
    """

    __slots__ = ("cancelling", "deadline", "expired", "limit", "task")

    task: asyncio.Task[Any] | None  #: the holding task; None once stopped (done)
    limit: float  #: the turn's max_hold, seconds
    deadline: float  #: when it runs out, in its loop's time()
    expired: bool  #: whether it ran out (the task was cancelled)
    #: the task's cancellation requests before this one (as asyncio.timeout() counts them)
    cancelling: int

    def expire(self) -> None:
        """Cut the work: the limit ran out (see _Timer)."""
        self.expired = True
        self.task.cancel(f"inturn: max_hold={self.limit:g} s ran out")  # type: ignore[union-attr]

    def stop(self, keys: tuple[Hashable, ...], error: BaseException | None) -> HoldTimeout | None:
        """Stop the clock; the HoldTimeout (caused by error) to raise if the limit cut the work."""
        if not self.expired:
            self.task = None  # done: its timer drops it (and keeps no task)
            return None
        # (read first: once done, the clock may serve another turn, see start_clock)
        task, limit, cancelling = self.task, self.limit, self.cancelling
        self.task = None
        assert task is not None
        if sys.version_info >= (3, 11) and task.uncancel() > cancelling:
            return None  # cancelled from elsewhere too: that cancellation goes on
        if not isinstance(error, asyncio.CancelledError):
            return None  # the work caught the cancellation and ended by itself
        what = ", ".join(map(describe, keys))
        cut = HoldTimeout(
            f"inturn: the work held {what} longer than max_hold={limit:g} s "
            "and was cancelled; the next in line started after it finished"
        )
        cut.__cause__ = error
        return cut

    def __repr__(self) -> str:
        state = "stopped" if self.task is None else "cut" if self.expired else "running"
        return f"<Clock max_hold={self.limit:g} s {state}, deadline {self.deadline:.3f}>"


def start_clock(task: asyncio.Task[Any], limit: float) -> Clock:
    """Start the clock of task's turn: cut it in limit seconds, unless stopped first."""
    global _last
    loop = task.get_loop()
    timer = _last()
    if timer is None or timer.loop is not loop or timer.limit != limit:
        key = (id(loop), limit)
        timer = _TIMERS.get(key)
        if timer is None:
            timer = _TIMERS[key] = _Timer(loop, limit)
        _last = weakref.ref(timer)
    clocks = timer.clocks
    # A done clock at the head is dropped (one per clock started: the FIFO stays short
    # while turns end in time), and started again: turns one after another make none.
    clock = clocks.popleft() if clocks and clocks[0].task is None else object.__new__(Clock)
    clock.task = task
    clock.limit = limit
    clock.expired = False
    clock.cancelling = task.cancelling() if _COUNTS else 0  # type: ignore[attr-defined, unused-ignore]
    clock.deadline = deadline = timer.now() + limit
    clocks.append(clock)
    if timer.handle is None:
        timer.arm(deadline)
    return clock
