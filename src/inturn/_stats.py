"""What a queue counts for stats()."""

from __future__ import annotations

from typing import final

__all__ = ("Tally",)


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
