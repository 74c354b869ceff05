"""An event loop on a virtual clock: timers fire in order, at once, deterministically.

When no callback is ready, the clock jumps to the next timer instead of
sleeping. When nothing is ready and no timer is set, every task is waiting
for something that can never happen: the loop raises :class:`Deadlock`
instead of hanging.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Deadlock(AssertionError):
    """Every task waits and nothing can wake one."""


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, clock: _Clock) -> None:
        super().__init__()
        self._clock = clock

    def select(self, timeout: float | None = None) -> list[Any]:
        events: list[Any] = super().select(0)
        if events:
            return events
        if timeout is None:
            raise Deadlock("every task is waiting and no timer is set")
        self._clock.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose time() is virtual and jumps to the next timer."""

    def __init__(self) -> None:
        self._clock = _Clock()
        super().__init__(selector=_JumpingSelector(self._clock))

    def time(self) -> float:
        return self._clock.now


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """Run coro to completion on a fresh virtual-time loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()
