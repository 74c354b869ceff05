"""The current task, cheaply: every turn asks for it on the hot path."""

from __future__ import annotations

import asyncio
import sys

__all__ = ("current_task",)

if sys.version_info >= (3, 12):
    from asyncio import current_task  # implemented in C: cheap
else:  # pragma: no cover - depends on the interpreter
    from asyncio.tasks import _current_tasks  # type: ignore[attr-defined]
    from collections.abc import Callable
    from typing import Any

    # Before 3.12, asyncio.current_task() is Python, with argument handling
    # around this same lookup. (Caching the loop per thread to skip
    # get_running_loop(), whose getpid() call is most of its cost, measured
    # slower here: thread identity costs as much from Python.)
    def current_task(
        _get: Callable[[object], asyncio.Task[Any] | None] = _current_tasks.get,
        _loop: Callable[[], asyncio.AbstractEventLoop] = asyncio.get_running_loop,
    ) -> asyncio.Task[Any] | None:
        """Return the task running in this thread's event loop, or None."""
        return _get(_loop())
