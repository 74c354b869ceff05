"""batch(): a scope of submissions, like asyncio.TaskGroup but keyed."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable, Hashable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar, final, overload

from ._describe import describe
from ._submit import Handle, failures, submit, unawaited
from ._tasks import running_loop

if TYPE_CHECKING:
    from typing_extensions import ParamSpec

    from ._submit import Submissions

    P = ParamSpec("P")

R = TypeVar("R")


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
        "_stopped_parent",
        "_submissions",
        "_waiter",
    )

    def __init__(self, submissions: Submissions, on_error: Literal["wait", "cancel"]) -> None:
        if on_error not in ("wait", "cancel"):
            raise ValueError(
                f'inturn: on_error must be "wait" or "cancel", got {describe(on_error)}'
            )
        self._submissions = submissions  # its queue's
        self._on_error = on_error
        self._parent: asyncio.Task[Any] | None = None  # the task inside the block
        # the unfinished submissions (the finished ones are let go: a long
        # batch keeps no memory per finished work, but for its errors)
        self._handles: set[Handle[Any]] = set()
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
        self, key: Hashable, fn: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs
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
        return await submit(self._submissions, key, fn, args, kwargs, self)

    def _finished(self, handle: Handle[Any], failed: bool) -> None:
        """One of the batch's submissions finished (failed: with an error)."""
        self._handles.discard(handle)
        if failed and self._on_error == "cancel":
            self._abort()
        if not self._handles and self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _abort(self) -> None:
        """Cancel the batch's unfinished work, and the block if it still runs."""
        if self._aborted:
            return
        self._aborted = True
        for handle in list(self._handles):
            handle.cancel()
        if not self._exiting and self._parent is not None:
            self._stopped_parent = True
            self._parent.cancel()

    async def __aenter__(self) -> Batch:
        if self._parent is not None:
            raise RuntimeError("inturn: this batch was entered already; make one per block")
        task = asyncio.current_task(running_loop("batch()"))
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
        stops = exc is not None and (self._on_error == "cancel" or not isinstance(exc, Exception))
        if stops and not ours:
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
        if self._stopped_parent and sys.version_info >= (3, 11) and self._parent.uncancel() > 0:
            cancelled = cancelled or exc  # cancelled from outside as well
        errors = unawaited(self._failed)
        if exc is not None and not isinstance(exc, asyncio.CancelledError):
            errors.insert(0, exc)
        if errors:
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                return False  # those go on at once
            raise failures(f"inturn: {len(errors)} error(s) in a batch", errors) from None
        if cancelled is not None and cancelled is not exc:
            raise cancelled
        return ours  # swallow the batch's own cancellation of the block
