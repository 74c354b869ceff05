"""Fire-and-forget with backpressure: Handle, Batch, and the QueueStats snapshot."""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Awaitable, Callable, Generator, Hashable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, final, overload

from ._keys import describe
from ._tasks import current_task as _current_task
from ._tasks import outside_asyncio

if sys.version_info < (3, 11):  # pragma: no cover - depends on the interpreter
    from exceptiongroup import BaseExceptionGroup

if TYPE_CHECKING:
    from typing_extensions import ParamSpec

    from ._queue import KeyedQueue

    P = ParamSpec("P")

__all__ = ("Batch", "Handle", "QueueStats", "failures")

R = TypeVar("R")


@final
class Handle(Generic[R]):
    """Work given to :meth:`~inturn.KeyedQueue.submit`: await it for its outcome, or cancel it.

    ``await handle`` returns the work's result or raises its exception, as
    often as it is awaited. Awaiting it, or cancelling the awaiter, never
    affects the work; :meth:`cancel` does. The error of a handle that nobody
    awaited is not lost: its batch raises it when it exits (see
    :meth:`~inturn.KeyedQueue.batch`), or, outside a batch,
    ``await queue.drain(raise_errors=True)``. It is never logged as "Task
    exception was never retrieved".
    """

    __slots__ = ("_awaited", "_callbacks", "_task", "key")

    #: The key the work was submitted under.
    key: Hashable

    def __init__(self, task: asyncio.Task[R], key: Hashable, failed: list[Handle[Any]]) -> None:
        self._task = task
        self.key = key
        self._awaited = False  # whether someone awaited the outcome (so got its error)
        # add_done_callback's callbacks, each with what the task calls instead (made on first use)
        self._callbacks: list[tuple[Callable[[Handle[R]], object], Callable[..., object]]] | None
        self._callbacks = None

        def finished(task: asyncio.Task[R]) -> None:
            # task.exception() also marks the error as retrieved: never logged
            if not task.cancelled() and task.exception() is not None and not self._awaited:
                failed.append(self)

        task.add_done_callback(finished)

    def __await__(self) -> Generator[Any, None, R]:
        task = self._task
        try:
            return (yield from asyncio.shield(task).__await__())
        finally:
            if task.done():  # the outcome reached this awaiter
                self._awaited = True

    def done(self) -> bool:
        """Whether the work has finished: returned, raised, or was cancelled."""
        return self._task.done()

    def cancelled(self) -> bool:
        """Whether the work was cancelled (before its turn, or while it ran)."""
        return self._task.cancelled()

    def result(self) -> R:
        """The work's result, as :meth:`asyncio.Future.result`: raise its error if it failed.

        :raises asyncio.InvalidStateError: the work has not finished.
        :raises asyncio.CancelledError: the work was cancelled.
        """
        task = self._task
        if task.done() and not task.cancelled():
            self._awaited = True  # its error, if any, reaches this caller
        return task.result()

    def exception(self) -> BaseException | None:
        """The work's error, or None if it returned, as :meth:`asyncio.Future.exception`.

        An error read here counts as retrieved: no batch or
        ``drain(raise_errors=True)`` raises it again.

        :raises asyncio.InvalidStateError: the work has not finished.
        :raises asyncio.CancelledError: the work was cancelled.
        """
        task = self._task
        if task.done() and not task.cancelled():
            self._awaited = True
        return task.exception()

    def add_done_callback(
        self, fn: Callable[[Handle[R]], object], *, context: contextvars.Context | None = None
    ) -> None:
        """Call ``fn(handle)`` once the work has finished, in the loop it runs in.

        As :meth:`asyncio.Future.add_done_callback`: scheduled with
        ``call_soon`` (at once if it has finished already), in ``context``
        or a copy of the current one. Reading the outcome is up to ``fn``:
        an error it does not read with :meth:`result` or :meth:`exception`
        is still raised by the batch or by ``drain(raise_errors=True)``.
        """

        def call(_: object) -> None:
            fn(self)

        if self._callbacks is None:
            self._callbacks = []
        self._callbacks.append((fn, call))
        self._task.add_done_callback(call, context=context)

    def remove_done_callback(self, fn: Callable[[Handle[R]], object]) -> int:
        """Remove every registration of ``fn`` by :meth:`add_done_callback`; return how many."""
        kept = []
        removed = 0
        for added, call in self._callbacks or ():
            if added == fn:
                removed += self._task.remove_done_callback(call)
            else:
                kept.append((added, call))
        self._callbacks = kept
        return removed

    def cancel(self, msg: object = None) -> bool:
        """Cancel the work: it leaves its line, or is cancelled at its next ``await``.

        Return False if it has finished already. Awaiting the handle then
        raises :exc:`asyncio.CancelledError`.
        """
        return self._task.cancel(msg)

    def __repr__(self) -> str:
        task = self._task
        if not task.done():
            state = "pending"
        elif task.cancelled():
            state = "cancelled"
        elif task.exception() is not None:
            state = f"failed: {describe(task.exception())}"
        else:
            state = "done"
        return f"<Handle key={describe(self.key)} {state}>"


def failures(message: str, errors: list[BaseException]) -> BaseExceptionGroup[BaseException]:
    """The group that reports errors nobody awaited (an ExceptionGroup if all are Exceptions)."""
    return BaseExceptionGroup(message, errors)


def _unawaited(failed: list[Handle[Any]]) -> list[BaseException]:
    """The errors of the failed handles nobody awaited."""
    errors = [handle._task.exception() for handle in failed if not handle._awaited]
    return [error for error in errors if error is not None]


@final
class Batch:
    """A scope of submissions, like :class:`asyncio.TaskGroup` but keyed: see ``queue.batch()``."""

    __slots__ = (
        "_aborted",
        "_exiting",
        "_failed",
        "_handles",
        "_on_error",
        "_parent",
        "_queue",
        "_stopped_parent",
        "_waiter",
    )

    def __init__(self, queue: KeyedQueue, on_error: Literal["wait", "cancel"]) -> None:
        if on_error not in ("wait", "cancel"):
            raise ValueError(
                f'inturn: on_error must be "wait" or "cancel", got {describe(on_error)}'
            )
        self._queue = queue
        self._on_error = on_error
        self._parent: asyncio.Task[Any] | None = None  # the task inside the block
        # the unfinished submissions (the finished ones are let go: a long
        # batch keeps no memory per finished work, but for its errors)
        self._handles: dict[asyncio.Future[Any], Handle[Any]] = {}
        self._failed: list[Handle[Any]] = []  # failed handles, in the order they failed
        self._waiter: asyncio.Future[None] | None = None  # __aexit__ waits on it
        self._aborted = False  # the batch cancelled its work after an error
        self._exiting = False
        self._stopped_parent = False  # the batch cancelled the block (on_error="cancel")

    @property
    def unfinished(self) -> int:
        """How many of the batch's submissions have not finished yet."""
        return len(self._handles)

    @overload
    async def submit(
        self,
        key: Hashable,
        fn: Callable[P, Awaitable[R]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
    ) -> Handle[R]: ...

    @overload
    async def submit(
        self, key: Hashable, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> Handle[R]: ...

    async def submit(
        self, key: Hashable, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> Handle[Any]:
        """Submit work to the batch's queue, as :meth:`~inturn.KeyedQueue.submit` does.

        :raises RuntimeError: the batch's block is not running, or the batch
            is cancelling its work after an error (``on_error="cancel"``).
        """
        if self._parent is None or self._exiting:
            raise RuntimeError("inturn: batch.submit() is for inside its `async with` block")
        if self._aborted:
            raise RuntimeError(
                "inturn: this batch is cancelling its work after an error; nothing more is queued"
            )
        return await self._queue._submit(key, fn, args, kwargs, self._failed, self._track)

    def _track(self, handle: Handle[Any]) -> None:
        """Count a new submission of this batch (before it takes its first step)."""
        self._handles[handle._task] = handle
        handle._task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Any]) -> None:
        del self._handles[task]
        if self._on_error == "cancel" and not task.cancelled() and task.exception() is not None:
            self._abort()
        if not self._handles and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _abort(self) -> None:
        """Cancel the batch's unfinished work, and the block if it still runs."""
        if self._aborted:
            return
        self._aborted = True
        for handle in list(self._handles.values()):
            handle.cancel()
        if not self._exiting and self._parent is not None:
            self._stopped_parent = True
            self._parent.cancel()

    async def __aenter__(self) -> Batch:
        if self._parent is not None:
            raise RuntimeError("inturn: this batch was entered already; make one per block")
        try:
            task = _current_task()
        except RuntimeError:
            raise outside_asyncio("batch()") from None
        if task is None:
            raise RuntimeError("inturn: a batch is for inside an asyncio task")
        self._parent = task
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._exiting = True
        ours = self._stopped_parent and isinstance(exc, asyncio.CancelledError)
        if (
            exc is not None
            and not ours
            and (self._on_error == "cancel" or not isinstance(exc, Exception))
        ):
            self._abort()  # a failed or cancelled block: its work is cancelled too
        cancelled: BaseException | None = None
        while self._handles:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            except asyncio.CancelledError as error:  # cancelled while waiting: stop the work
                cancelled = error
                self._abort()
        assert self._parent is not None
        if self._stopped_parent and sys.version_info >= (3, 11):
            if self._parent.uncancel() > 0:  # cancelled from outside as well
                cancelled = cancelled or exc
        errors = _unawaited(self._failed)
        if exc is not None and not isinstance(exc, asyncio.CancelledError):
            errors.insert(0, exc)
        if errors:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                return False  # those go on at once
            raise failures(f"inturn: {len(errors)} error(s) in a batch", errors) from None
        if cancelled is not None and cancelled is not exc:
            raise cancelled
        return ours  # swallow the batch's own cancellation of the block


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
