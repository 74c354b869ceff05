"""The errors inturn raises.

Builtins are used where they already say it: ``TypeError`` for a key or
argument of the wrong type, ``ValueError`` for a setting out of range and
``TimeoutError`` for a turn not reached in time.
"""

from __future__ import annotations

__all__ = ("InturnError", "QueueClosed", "QueueFull")


class InturnError(Exception):
    """Base class of every error specific to inturn."""


class QueueFull(InturnError):
    """A key already has ``max_pending`` waiters; the new work was not queued.

    Raised at once, at submission: the work never runs and nothing else in the
    line is disturbed.
    """


class QueueClosed(InturnError):
    """The queue was closed; the new work was not queued and never runs."""
