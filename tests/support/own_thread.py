"""An event loop that notes the calls on its timers made from another thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class OwnThreadTimers(asyncio.SelectorEventLoop):
    """A loop that notes each timer of its own set or cancelled from another thread.

    asyncio's loops are not thread-safe: such a call races the loop's heap of
    timers (a storm of tasks and threads once broke it: "list changed size
    during iteration").
    """

    def __init__(self) -> None:
        super().__init__()
        self.owner: int | None = None
        self.foreign: list[str] = []

    def _note(self, what: str) -> None:
        if self.owner is not None and threading.get_ident() != self.owner:
            self.foreign.append(what)

    def call_at(self, when: float, callback: Any, *args: Any, context: Any = None) -> Any:
        self._note(f"call_at({callback!r})")
        return super().call_at(when, callback, *args, context=context)

    def _timer_handle_cancelled(self, handle: asyncio.TimerHandle) -> None:
        self._note(f"cancel({handle!r})")
        super()._timer_handle_cancelled(handle)  # type: ignore[misc]

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run coroutine to its end in this thread, then close, as asyncio.run() does."""
        self.owner = threading.get_ident()
        try:
            return self.run_until_complete(coroutine)
        finally:
            try:
                self.run_until_complete(self.shutdown_asyncgens())
                self.run_until_complete(self.shutdown_default_executor())
            finally:
                self.close()
