"""What a queue counts for stats(), the QueueStats snapshot it gives, and its observer."""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol, final

from ._errors import QueueFull, Superseded

#: The function whose turn is being taken, on an observed queue: set around
#: the turn by run(), run_sync(), a decorated function and submitted work, so
#: that an observer can label what it reports (never with the key).
FUNCTION: ContextVar[str | None] = ContextVar("inturn.function", default=None)

logger = logging.getLogger("inturn")


def function_label(fn: object) -> str:
    """How an observer names the function a turn runs: ``module.qualname``.

    Never raises: submitted work is labelled inside its turn's bookkeeping.
    """
    try:
        name = getattr(fn, "__qualname__", None)
        module = getattr(fn, "__module__", None)
    except Exception:  # a callable whose names cannot be read: named by its type
        name, module = None, type(fn).__module__
    if not isinstance(name, str):  # a partial, a callable object
        name = type(fn).__qualname__
    return f"{module}.{name}" if isinstance(module, str) else name


class Observer(Protocol):
    """What :meth:`~inturn.KeyedQueue.observe` reports each turn of a queue to.

    ``function`` is the qualified name of the function the turn runs (a
    decorated function, or what :meth:`~inturn.KeyedQueue.run`,
    :meth:`~inturn.KeyedQueue.run_sync` or ``submit()`` was given), or
    ``None`` for a ``keyed()`` block outside any of those. Keys are never
    reported: they are unbounded. The methods are called in the thread
    (and task) that takes the turn, once per event, while the queue's lock
    may be held: they must be quick, and must not wait for the queue. An
    exception they raise is logged on the ``inturn`` logger (ERROR) and
    dropped: the turn goes on. :mod:`inturn.otel` records to OpenTelemetry
    instruments.
    """

    def started(self, waited: float, function: str | None) -> None:
        """A turn started after ``waited`` seconds in line (its keys, a grant, a slot)."""

    def ended(
        self, held: float | None, error: BaseException | None, cut: bool, function: str | None
    ) -> None:
        """A started turn ended after ``held`` seconds, with ``error`` (``None``: it returned).

        ``cut``: its ``max_hold`` cut it. ``error`` is a
        :exc:`~inturn.LeaseLost` when the work returned but the backend
        could no longer vouch for its turn. ``held`` is ``None`` for a turn
        that started before the queue was observed.
        """

    def missed(self, error: BaseException, function: str | None) -> None:
        """A turn never started: ``error`` is what its caller got.

        :exc:`TimeoutError` (not reached in time), :exc:`~inturn.QueueFull`
        (refused at once), :exc:`~inturn.BackendUnavailable`, or a
        cancellation or interrupt while waiting.
        """


@final
class Tally:
    """What a queue counts for stats(): how its turns ended, and their times."""

    __slots__ = (
        "cancelled",
        "completed",
        "failed",
        "held",
        "observer",
        "replaced",
        "timed_out",
        "waited",
    )

    def __init__(self) -> None:
        self.completed = 0
        self.failed = 0
        self.timed_out = 0
        self.cancelled = 0
        self.replaced = 0  # works newer work took the place of (pending="latest")
        self.waited = 0.0  # seconds from submission to start, summed
        self.held = 0.0  # seconds from start to end, summed
        # told of each turn; while set, no turn takes the plain paths (see Registry.observe)
        self.observer: Observer | None = None

    def started(self, waited: float) -> None:
        """Count the wait of a timed turn that starts now, after waited seconds."""
        self.waited += waited
        if self.observer is not None:
            _tell(self.observer, "started", waited, FUNCTION.get())

    def ended(self, error: BaseException | None, cut: bool, held: float | None) -> None:
        """Count a turn that ended: cut by its max_hold, or by error (None: completed), after
        ``held`` seconds (None: it was not timed)."""
        if error is None:
            self.completed += 1
        elif cut:
            self.timed_out += 1
        elif isinstance(error, Exception):
            self.failed += 1
        else:
            self.cancelled += 1
        if held is not None:
            self.held += held
        if self.observer is not None:
            _tell(self.observer, "ended", held, error, cut, FUNCTION.get())

    def missed(self, error: BaseException) -> None:
        """Count a turn that was never reached: timed out, cancelled or failed while waiting."""
        if isinstance(error, TimeoutError):
            self.timed_out += 1
        elif isinstance(error, QueueFull):
            pass  # refused at once, never queued: uncounted (see QueueStats), but reported
        elif isinstance(error, Exception):
            self.failed += 1
        else:
            self.cancelled += 1
        if self.observer is not None:
            _tell(self.observer, "missed", error, FUNCTION.get())

    def superseded(self, error: BaseException | None, function: str | None) -> None:
        """Count a work that newer work replaced (``function``: its own); ``error``: the
        Superseded its caller got (None: it follows the newer work's outcome). Under the guard."""
        self.replaced += 1
        if self.observer is not None:
            told = error or Superseded("inturn: newer work took this work's place; it did not run")
            _tell(self.observer, "missed", told, function)

    def snapshot(
        self, running: int, in_line: int, waiting: dict[Hashable, int], timed: bool
    ) -> QueueStats:
        """The QueueStats of a queue with these counts now (``in_line``: waiting for a slot)."""
        return QueueStats(
            running=running,
            waiting_for_slot=in_line,
            waiting=MappingProxyType(waiting),
            completed=self.completed,
            failed=self.failed,
            timed_out=self.timed_out,
            cancelled=self.cancelled,
            wait_time=self.waited if timed else None,
            hold_time=self.held if timed else None,
            superseded=self.replaced,
        )


def _tell(observer: Observer, method: str, *args: object) -> None:
    """Call observer's method; what it raises is logged, and the turn goes on.

    NOTE: called inside the registry's bookkeeping, so nothing here may raise:
    the log names the method by the protocol's name, never by an attribute
    of what the observer holds there (a callable object has no ``__name__``).
    """
    try:
        getattr(observer, method)(*args)
    except Exception:
        logger.exception("inturn: the observer's %s() raised; the turn goes on, unreported", method)


@final
@dataclass(frozen=True, slots=True)
class QueueStats:
    """A snapshot of a queue's state and counts: what :meth:`~inturn.KeyedQueue.stats` returns.

    The counts cover the turns that ended since the queue was made: each
    call of :meth:`~inturn.KeyedQueue.run` or a decorated function, each
    ``keyed()`` block, each submitted work (a reentrant call, made while its
    caller holds the keys already, is part of the outer turn and not counted
    by itself; work refused at once, by ``max_pending`` or a closed queue,
    never queued and is not counted).
    """

    #: Tasks and threads running their work: with ``max_running``, those
    #: holding a running slot; otherwise those holding a turn on some key.
    running: int
    #: Turns that reached their keys and wait for a running slot.
    waiting_for_slot: int
    #: For each key with waiters, how many wait in its line (not counting
    #: its holders).
    waiting: Mapping[Hashable, int]
    #: Turns whose work returned.
    completed: int
    #: Turns whose work raised (or that failed to reach the turn for an
    #: error of the backend).
    failed: int
    #: Turns not reached within their ``timeout``, and work cut by ``max_hold``.
    timed_out: int
    #: Turns cancelled (or interrupted) while waiting, or while running.
    cancelled: int
    #: Seconds from submission to start, summed over started turns. ``None``
    #: on an in-process queue without ``max_running``, ``concurrency`` or
    #: ``max_hold``: timing each turn would cost a fifth of its uncontended
    #: path, so such queues count without timing.
    wait_time: float | None
    #: Seconds from start to end, summed over ended turns (``None`` as for
    #: ``wait_time``).
    hold_time: float | None
    #: Works that never ran because newer work for their key took their
    #: place (``pending="latest"``, or ``debounce``): not counted as turns.
    superseded: int = 0
