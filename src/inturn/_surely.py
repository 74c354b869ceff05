"""Completing an idempotent call however often an exception is thrown into the thread.

A signal handler's exception (CPython runs handlers between bytecodes of the
main thread) or one thrown into a thread (``PyThreadState_SetAsyncExc``) may
land anywhere; what must not be left half done (a line's hand-on, a ticket's
writer) is called through :func:`surely`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

#: How often surely() calls a call that keeps failing before it gives up.
_TRIES: Final = 100


def surely(call: Callable[..., object], *args: Any) -> None:
    """Call call(*args) through to its end, however often an exception is thrown into the
    thread meanwhile (a signal handler's, say): call must be idempotent. The first such
    exception is raised once it has ended. A call that fails _TRIES times in a row raises its
    last error: a defect of its own, not interrupts (none comes that often), never a hang."""
    thrown: BaseException | None = None
    tries = 0
    while True:
        try:
            call(*args)
        except BaseException as error:
            thrown = thrown or error
            tries += 1
            if tries < _TRIES:
                continue
            raise  # (a defect: see above)
        if thrown is not None:
            raise thrown
        return
