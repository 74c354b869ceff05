"""Turn: what a holder has while it holds one or more keys, and current_turn()."""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Awaitable, Hashable, Mapping
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, final

from ._errors import LeaseLost
from ._tasks import current_task as _current_task

if TYPE_CHECKING:
    from ._queue import KeyedQueue
    from .backends._base import Backend, Grant

__all__ = ("Turn", "current_turn")

#: The innermost turn of the current task on a queue with a shared backend.
_CURRENT: contextvars.ContextVar[Turn | None] = contextvars.ContextVar(
    "inturn_current_turn", default=None
)


def current_turn() -> Turn | None:
    """The innermost turn the current task holds on a queue with a shared backend.

    Inside a decorated function, :meth:`~inturn.KeyedQueue.run` or
    ``keyed()`` block on a queue whose lines a backend shares between
    processes (file, Redis), this is that call's :class:`Turn`: its
    ``token`` fences writes to a downstream store, and its ``lease_lost``
    tells long work that another process may have the key by now.

    ``None`` elsewhere, including in-process queues: their turns need no
    fencing, as nothing outlives the process, and so their hot path records
    none (``async with q.keyed(k) as turn:`` still binds one).
    """
    return _CURRENT.get()


def _consume(task: asyncio.Future[Any]) -> None:
    """Retrieve a detached release's outcome, so an error is not logged as never retrieved."""
    if not task.cancelled():
        task.exception()


async def _settle(release: Awaitable[None]) -> None:
    """Await a backend release that a second cancellation of the caller cannot interrupt.

    If the caller is cancelled meanwhile, the release goes on by itself and
    the caller gets the CancelledError at once.
    """
    task = asyncio.ensure_future(release)
    task.add_done_callback(_consume)
    await asyncio.shield(task)


@final
class _Shared:
    """What a turn on a shared backend has besides: its grants, and where it sits."""

    __slots__ = ("grants", "holders", "outer", "tokens")

    def __init__(
        self,
        grants: list[Grant],
        tokens: dict[Hashable, int],
        holders: list[Turn],
        outer: Turn | None,
    ) -> None:
        self.grants = grants  # the backend's grants this turn took, in order
        self.tokens = tokens  # each key's fencing token
        self.holders = holders  # enclosing turns holding keys this one re-took
        self.outer = outer  # the enclosing current_turn(), restored at the end


@final
class Turn:
    """A turn on one or more keys: what :meth:`KeyedQueue.keyed` returns and binds.

    ``async with queue.keyed("acct-1", "acct-2") as turn:`` waits for the
    turn of every key, runs the block holding them all, and releases them
    when the block ends, however it ends. A turn object may be entered again
    after its block ended, but not while it is entered.

    On a queue with a shared backend, a turn that lost its lease (see
    :attr:`lease_lost`) raises :exc:`~inturn.LeaseLost` when its block ends
    without an error of its own.

    :ivar keys: the keys, in the order they are taken: the queue's global key
        order, so that two holders of overlapping keys never deadlock.
    """

    __slots__ = ("_queue", "_shared", "_taken", "_task", "_timeout", "keys", "token")

    keys: tuple[Hashable, ...]
    #: A fencing token, set on entry: larger than the token of every turn
    #: granted earlier on the same key, so a downstream store can refuse a
    #: write that carries an older one. With several keys, the token of the
    #: first (see :attr:`tokens` for each).
    token: int

    def __init__(
        self, queue: KeyedQueue, keys: tuple[Hashable, ...], timeout: float | None
    ) -> None:
        self._queue = queue
        self.keys = keys
        self._timeout = timeout
        self.token = 0
        self._task: object = None  # the task inside the block, None outside it
        self._taken: tuple[Hashable, ...] = ()  # the keys this turn took (not held already)
        self._shared: _Shared | None = None  # on a shared backend, once entered

    @property
    def tokens(self) -> Mapping[Hashable, int]:
        """Each key's fencing token (all the same in process, one per key on a shared backend)."""
        if self._shared is None:
            return MappingProxyType(dict.fromkeys(self.keys, self.token))
        return MappingProxyType(self._shared.tokens)

    @property
    def lease_lost(self) -> bool:
        """Whether the backend could no longer vouch for this turn.

        A shared backend covers each holder with a lease that a heartbeat
        renews; if it ran out (the backend was unreachable, or the process
        was frozen past it), another process may hold a key of this turn by
        now. Long work can check this and stop early. Always ``False`` in
        process: an in-process turn cannot be lost.
        """
        shared = self._shared
        if shared is None:
            return False
        return any(grant.lost for grant in shared.grants) or any(
            turn.lease_lost for turn in shared.holders
        )

    async def __aenter__(self) -> Turn:
        if self._task is not None:
            raise RuntimeError("inturn: this keyed() turn is already entered; make one per block")
        queue = self._queue
        task = _current_task()
        keys = self.keys
        backend = queue._backend
        if backend is not None:
            await self._enter_shared(queue, backend, task)
        elif len(keys) == 1 and task is not None and task._loop is queue._owner:
            key = keys[0]
            lines = queue._lines
            line = lines.get(key)
            if line is None:
                lines[key] = task  # uncontended: as in run()
                self._taken = keys
            else:
                # What queue._take() does, inlined: a coroutine less per contended turn.
                waiter = queue._join(key, task, line, self._timeout)
                if waiter is not True:  # True: this task holds the key already
                    if waiter is not False:
                        line = lines[key]
                        try:
                            await waiter
                        except BaseException:
                            queue._abandon(key, line, waiter)
                            raise
                        line.holder = task
                    self._taken = keys
            self.token = next(queue._tokens)
        else:
            self._taken = await queue._take_all(keys, task, self._timeout)
            self.token = next(queue._tokens)
        self._task = task
        return self

    def __enter__(self) -> Turn:
        """Take the turns for this thread, blocking it while it waits (see ``KeyedQueue.keyed``)."""
        if self._task is not None:
            raise RuntimeError("inturn: this keyed() turn is already entered; make one per block")
        queue = self._queue
        self._task, self._taken = queue._take_all_sync(self.keys, self._timeout)
        self.token = next(queue._tokens)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release(exc, None)

    async def _enter_shared(self, queue: KeyedQueue, backend: Backend, task: Any) -> None:
        """Take each key's turn in this process's line, then from the backend, in order."""
        loop = asyncio.get_running_loop()
        deadline = None if self._timeout is None else loop.time() + self._timeout
        outer = _CURRENT.get()
        taken: list[Hashable] = []
        grants: list[Grant] = []
        tokens: dict[Hashable, int] = {}
        holders: list[Turn] = []
        try:
            for key in self.keys:
                left = None if deadline is None else max(0.0, deadline - loop.time())
                if not await queue._take(key, task, left):
                    # held already by an enclosing turn of this task: reentrant
                    holder = _holder(outer, queue, key)
                    if holder is not None:
                        holders.append(holder)
                        tokens[key] = holder.tokens[key]
                    continue
                taken.append(key)
                left = None if deadline is None else max(0.0, deadline - loop.time())
                grant = await backend.acquire(key, left)
                grants.append(grant)
                tokens[key] = grant.token
        except BaseException as error:
            try:
                for grant in reversed(grants):
                    await _settle(backend.release(grant))
            finally:
                for key in reversed(taken):
                    queue._release(key, task, error, None)
            raise
        self._taken = tuple(taken)
        self._shared = _Shared(grants, tokens, holders, outer)
        self.token = tokens[self.keys[0]]
        _CURRENT.set(self)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        queue = self._queue
        if queue._backend is not None:
            await self._end_shared(exc, None)
            return
        taken = self._taken
        if len(taken) == 1:  # what release() does, inlined for the common single key
            task, self._task, self._taken = self._task, None, ()
            key = taken[0]
            if queue._shared:
                queue._release(key, task, exc, None)
            elif (line := queue._lines.pop(key)) is not task:
                queue._leave(key, line, exc, None)
        else:
            self.release(exc, None)

    def release(self, error: BaseException | None, result: Any) -> None:
        """Release every key this turn took, newest first, telling watchers the outcome."""
        queue, task, taken = self._queue, self._task, self._taken
        self._task = None
        self._taken = ()
        for key in reversed(taken):
            queue._release(key, task, error, result)

    async def _end_shared(self, error: BaseException | None, result: Any) -> None:
        """Release the backend's grants, then this process's turns; report a lost lease.

        Raises :exc:`~inturn.LeaseLost` if a grant's lease ran out and the
        work ended without an error of its own (with one, the loss is noted
        on that error), or the backend's error if a release failed.
        """
        backend = self._queue._backend
        shared = self._shared
        assert backend is not None
        assert shared is not None
        grants = shared.grants
        _CURRENT.set(shared.outer)
        failure: Exception | None = None
        try:
            for grant in reversed(grants):
                try:
                    await _settle(backend.release(grant))
                except Exception as problem:
                    failure = failure or problem
            lost = [grant for grant in grants if grant.lost]
            if lost:
                what = ", ".join(f"{grant.key!r} (token {grant.token})" for grant in lost)
                message = (
                    f"inturn: the lease on {what} ran out while the work held it; "
                    "another process may have held the key meanwhile"
                )
                if error is None:
                    error = failure = LeaseLost(message)
                elif sys.version_info >= (3, 11):  # pragma: no branch
                    error.add_note(message)
            elif failure is not None and error is None:
                error = failure
        finally:
            self.release(error, result)
        if failure is not None and failure is error:
            raise failure

    def __repr__(self) -> str:
        if self._task is None:
            return f"<Turn keys={self.keys!r} not held>"
        lost = ", lease lost" if self.lease_lost else ""
        return f"<Turn keys={self.keys!r} held, token {self.token}{lost}>"


def _holder(turn: Turn | None, queue: KeyedQueue, key: Hashable) -> Turn | None:
    """The enclosing turn, from turn outwards, that holds key on queue."""
    while turn is not None:
        shared = turn._shared
        if shared is None:
            return None
        if turn._queue is queue and key in shared.tokens:
            return turn
        turn = shared.outer
    return None
