"""max_hold's clock: cancels the holding task when the limit runs out."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Hashable
from typing import Any, final

from ._describe import describe
from ._errors import HoldTimeout

__all__ = ("Clock",)


@final
class Clock:
    """A turn's max_hold: cancels the holding task when the limit runs out."""

    __slots__ = ("cancelling", "expired", "handle", "limit", "task")

    def __init__(self, task: asyncio.Task[Any], limit: float) -> None:
        self.task = task
        self.limit = limit
        self.expired = False
        # the task's cancellation requests before this one (as asyncio.timeout() counts them)
        self.cancelling = 0
        if sys.version_info >= (3, 11):
            self.cancelling = task.cancelling()
        self.handle = task.get_loop().call_later(limit, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.task.cancel(f"inturn: max_hold={self.limit:g} s ran out")

    def stop(self, keys: tuple[Hashable, ...], error: BaseException | None) -> HoldTimeout | None:
        """Stop the clock; the HoldTimeout (caused by error) to raise if the limit cut the work."""
        self.handle.cancel()
        if not self.expired:
            return None
        if sys.version_info >= (3, 11) and self.task.uncancel() > self.cancelling:
            return None  # cancelled from elsewhere too: that cancellation goes on
        if not isinstance(error, asyncio.CancelledError):
            return None  # the work caught the cancellation and ended by itself
        what = ", ".join(map(describe, keys))
        cut = HoldTimeout(
            f"inturn: the work held {what} longer than max_hold={self.limit:g} s "
            "and was cancelled; the next in line started after it finished"
        )
        cut.__cause__ = error
        return cut
