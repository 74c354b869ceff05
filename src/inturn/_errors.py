"""The errors inturn raises where no builtin (TypeError, ValueError, TimeoutError) says it.

Each is named by its public path, ``inturn``: a traceback says
``inturn.QueueFull``, and pickle finds the class there (``inturn`` exports
every one of them).
"""

from __future__ import annotations

from collections.abc import Coroutine, Hashable
from typing import Any

from ._describe import cut, describe, function_name


class InturnError(Exception):
    """Base class of every error specific to inturn."""

    __module__ = "inturn"


class QueueFull(InturnError):
    """A key already has ``max_pending`` waiters; the new work was not queued.

    Raised at once, at submission: the work never runs and nothing else in the
    line is disturbed.
    """

    __module__ = "inturn"


class QueueClosed(InturnError):
    """The queue was closed; the new work was not queued and never runs.

    The message names the queue by its ``name=`` (or says it has none) and the key.
    """

    __module__ = "inturn"


class BackendUnavailable(InturnError):
    """The backend that shares the lines could not be reached; the work did not run.

    Raised at submission, or while waiting for a turn: the work never runs
    without its turn. The underlying error (a connection error, say) is the
    ``__cause__``.
    """

    __module__ = "inturn"


class LeaseLost(InturnError):
    """A holder's lease on its turn ran out before the work finished.

    Backends that share lines between processes cover each holder with a
    lease that a heartbeat renews. When it could not be renewed in time (the
    backend was unreachable, or the process was frozen past the lease), other
    processes may have been given the key while this work still ran. The
    work's own result is then withheld and this error raised instead, after
    the work finished; ``turn.lease_lost`` turns true as soon as the loss is
    known, so long work can check it and stop early. The file backend raises
    it when the files that kept the turn were deleted under it.
    """

    __module__ = "inturn"


class HoldTimeout(InturnError, TimeoutError):
    """Work held its turn longer than its ``max_hold`` and was cancelled.

    Unlike the plain :exc:`TimeoutError` of a turn not reached in time (the
    work never ran), this work started: it was cancelled at an ``await``
    once it had held its key(s) for ``max_hold`` seconds, and raised this
    from the cancellation once it had finished. The key passed to the next
    in line only then, so the two never overlapped.
    """

    __module__ = "inturn"


class Superseded(InturnError):
    """Newer work for the same key took this work's place; this work did not run.

    Raised to a caller of a queue or function with ``pending="latest"`` and
    ``on_superseded="raise"`` (see :class:`~inturn.KeyedQueue`), at once
    when newer work replaced its work in the key's line. With the default
    ``on_superseded="join"``, the caller gets the newer work's outcome instead.
    """

    __module__ = "inturn"


# -- messages built in one place, raised from the modules that find the fault ---------------


def blocking_in_loop(keys: tuple[Hashable, ...], function: object = None) -> RuntimeError:
    """The refusal of a blocking turn taken inside a running event loop (it would freeze it).

    ``function``: the plain function the turn was for (a decorated ``def``,
    or what ``run_sync()`` was given); ``None`` for a ``with keyed(...)`` block.
    """
    on = cut(", ".join(map(describe, keys)))
    if function is None:
        return RuntimeError(
            f"inturn: a blocking `with keyed(...)` turn on {on} was taken inside a running "
            "event loop; waiting would freeze the loop. In an async def, use "
            "`async with keyed(...)`, or run the block in a thread: "
            "`await asyncio.to_thread(...)`"
        )
    name = function_name(function)
    return RuntimeError(
        f"inturn: {name} is a plain def, so its turn on {on} blocks its thread, and it "
        "was called inside a running event loop; waiting would freeze the loop. Make it "
        "an `async def` and await it (or use `await queue.run(...)`), or call it in a "
        f"thread: `await asyncio.to_thread({name.removesuffix('()')}, ...)`"
    )


def thread_cannot_await(function: object, coroutine: Coroutine[Any, Any, Any]) -> TypeError:
    """The refusal of a coroutine that a thread's turn got from function (closed: never run)."""
    coroutine.close()
    return TypeError(
        f"inturn: {describe(function)} returned a coroutine, which a thread cannot await; "
        "for async def functions use `await queue.run(...)`"
    )


def closed(name: str | None, key: Hashable) -> QueueClosed:
    """A closed queue's refusal of work for key, naming the queue (or saying it has no name)."""
    queue = "a queue with no name" if name is None else f"queue {describe(name)}"
    return QueueClosed(
        f"inturn: {queue} is closed (by its close() or aclose()); the work for key "
        f"{describe(key)} was not queued"
        + ("" if name is not None else ". KeyedQueue(name=...) names a queue here")
    )


def superseded(key: Hashable) -> Superseded:
    """The error of a "raise" caller whose work newer work replaced."""
    return Superseded(
        f"inturn: newer work for key {describe(key)} took this work's place "
        "(pending='latest'); this work did not run"
    )


def superseded_elsewhere(key: Hashable, join: bool, ok: bool) -> Superseded | None:
    """The error of a caller whose work newer work of another process replaced
    (across="processes"); None for a "join" caller once that work returned (its result
    stays in its process). ok: whether it returned."""
    if join and ok:
        return None
    if join:
        return Superseded(
            f"inturn: newer work for key {describe(key)} in another process took this "
            "work's place (pending='latest', across='processes'), and failed there (its "
            "error stays in that process); this work did not run"
        )
    return Superseded(
        f"inturn: newer work for key {describe(key)} in another process took this work's "
        "place (pending='latest', across='processes'), and ran; this work did not run"
    )
