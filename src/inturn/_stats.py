"""What a queue counts for stats(), and the QueueStats snapshot it gives."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import final

__all__ = ("QueueStats", "Tally")


@final
class Tally:
    """What a queue counts for stats(): how its turns ended, and their times."""

    __slots__ = ("cancelled", "completed", "failed", "held", "timed_out", "waited")

    def __init__(self) -> None:
        self.completed = 0
        self.failed = 0
        self.timed_out = 0
        self.cancelled = 0
        self.waited = 0.0  # seconds from submission to start, summed
        self.held = 0.0  # seconds from start to end, summed

    def ended(self, error: BaseException | None, cut: bool) -> None:
        """Count a turn that ended: cut by its max_hold, or by error (None: completed)."""
        if error is None:
            self.completed += 1
        elif cut:
            self.timed_out += 1
        elif isinstance(error, Exception):
            self.failed += 1
        else:
            self.cancelled += 1

    def missed(self, error: BaseException) -> None:
        """Count a turn that was never reached: timed out, cancelled or failed while waiting."""
        if isinstance(error, TimeoutError):
            self.timed_out += 1
        elif isinstance(error, Exception):
            self.failed += 1
        else:
            self.cancelled += 1


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
