"""submit(): work queued as data in its key's line, its Handle, producers' backpressure.

A submission joins its key's line at the call and, behind a busy key, waits
there as data, its :class:`Handle` (see ``KeyedQueue.submit``): so the tasks
alive stay bounded by the running slots and backpressure.

NOTE: the hand-off (``Registry.leave``) makes a waiting Handle the line's holder
before its task exists, as it does a waiter future; the task, scheduled in the
Handle's loop, then makes itself the holder and enters the turn's steps holding
the line (see ``_run``). A Handle cancelled or timed out between the two passes
the turn on.

The work's task gives the handle its outcome itself and ends quietly: a done
callback per task measured 10% of a submission's cost (bench (g)). A task not
run yet runs no code when cancelled, so Handle.cancel() gives up its place
itself then. NOTE: so one cancelled by someone else before its first step (code
cancelling every task of a running loop) keeps its place until the loop's
shutdown, when the watch below gives it up.

Work waiting as data is no task, so asyncio.run()'s shutdown, which cancels
the loop's tasks, cannot cancel it; and a hand-off during that shutdown makes
tasks it never cancels, which would hold their key past the loop's end. So the
first work of a loop to wait as data starts a watch on the loop: an async
generator, which the loop closes at its shutdown (``shutdown_asyncgens()``),
and which then cancels that loop's submitted work still pending and waits for
it to leave its lines.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Hashable
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, final

from ._checks import Policy
from ._describe import describe
from ._errors import QueueClosed, QueueFull, Superseded, closed
from ._latest import Book, Latest, Ticket
from ._line import Deferred, Gate, held_by
from ._line import Line as _Line
from ._stats import FUNCTION, function_label
from ._tasks import call_soon_in as _call_soon_in
from ._tasks import current_task as _current_task
from ._tasks import in_context, makes_plain_tasks, running_loop
from ._turn import Turn, call_in_turn

if TYPE_CHECKING:
    if sys.version_info < (3, 11):
        from exceptiongroup import BaseExceptionGroup

    from ._registry import Registry
    from ._slots import Slots

R = TypeVar("R")


class Scope(Protocol):
    """What a Handle tells its batch (a Batch, see _batch), the scope it was submitted in."""

    #: Its submissions not finished yet.
    _handles: set[Handle[Any]]
    #: Its failed submissions nobody awaited, in the order they failed.
    _failed: list[Handle[Any]]

    def _finished(self, handle: Handle[Any], failed: bool) -> None:
        """One of its submissions finished (failed: with an error)."""


@final
class Submissions:
    """A queue's submitted work (one per queue): what submit() and its handles use of it."""

    __slots__ = (
        "__weakref__",
        "book",
        "handles",
        "max_hold",
        "policy",
        "registry",
        "timeout",
        "unclaimed",
    )

    def __init__(
        self,
        registry: Registry,
        timeout: float | None,
        max_hold: float | None,
        policy: Policy,
        book: Book,
    ) -> None:
        self.registry = registry
        self.policy = policy  # the queue's conflation
        self.book = book  # the queue's Latests
        self.timeout = timeout  # the queue's
        self.max_hold = max_hold  # the queue's
        self.handles: set[Handle[Any]] = set()  # submitted, not finished yet
        self.unclaimed: list[Handle[Any]] = []  # failed outside a batch, nobody awaited them

    def of_loop(self, loop: asyncio.AbstractEventLoop) -> list[asyncio.Future[Any]]:
        """The outcomes of loop's submitted work not finished yet (for drain())."""
        return [h._future for h in self.handles if h._future.get_loop() is loop]


# Where a Handle is (Handle._stage).
_UNPLACED = 0  # in no line: refused, or left it
_PLACED = 1  # holds its key, or waits in its line as data; its task has not run yet
_STARTED = 2  # its task runs (or ran)


@final
class Handle(Deferred, Generic[R]):
    """Work given to :meth:`~inturn.KeyedQueue.submit`: await it for its outcome, or cancel it.

    ``await handle`` returns the work's result or raises its exception, as
    often as it is awaited. Awaiting it, or cancelling the awaiter, never
    affects the work; :meth:`cancel` does, whether the work still waits in
    its key's line or runs. The error of a handle that nobody awaited is not
    lost: its batch raises it when it exits (see
    :meth:`~inturn.KeyedQueue.batch`), or, outside a batch, ``await
    queue.drain(raise_errors=True)``. It is never logged as "Task exception
    was never retrieved".

    With ``pending="latest"`` (or ``debounce``), a handle whose work newer
    work replaced lets its work go at once: it gives the outcome of the work
    that runs in its place (``on_superseded="join"``), and is cancelled if
    that work is, or if nothing runs in its place (every newer caller gave
    up first); or it raises :exc:`~inturn.Superseded` (``"raise"``). That
    error is the caller's answer, not a failure: no batch or ``drain()``
    raises it again.
    """

    __slots__ = (
        "_args",
        "_awaited",
        "_batch",
        "_callbacks",
        "_context",
        "_counted",
        "_fn",
        "_future",
        "_kwargs",
        "_line",
        "_queue",
        "_since",
        "_stage",
        "_task",
        "_ticket",
        "_timer",
        "key",
    )

    #: The key the work was submitted under.
    key: Hashable

    def __init__(
        self,
        queue: Submissions,
        key: Hashable,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        future: asyncio.Future[R],
        batch: Scope | None,
    ) -> None:
        self._queue = queue
        self.key = key
        self._fn = fn
        self._args = args
        self._kwargs = kwargs
        self._future = future  # the work's outcome: every answer of the handle reads it
        self._batch = batch
        self._task: asyncio.Task[Any] | None = None  # the work's task, from its turn on
        # the line it joined as data, until its task holds the key (None: it took a free key;
        # a Latest: it waits in the key's Latest, see _latest)
        self._line: _Line | Gate | Latest | None = None
        self._context: contextvars.Context | None = None  # submit()'s, while waiting as data
        self._timer: asyncio.TimerHandle | None = None  # the queue's timeout, while waiting
        # when it was submitted (monotonic), on a queue that times turns
        self._since = _monotonic() if queue.registry.timed else 0.0
        self._stage = _UNPLACED
        self._counted = False  # counted in the running slots' `unplaced`
        self._awaited = False  # whether someone awaited the outcome (so got its error)
        # add_done_callback's callbacks, each with what the future calls instead (made on first use)
        self._callbacks: list[tuple[Callable[[Handle[R]], object], Callable[..., object]]] | None
        self._callbacks = None
        self._ticket: Ticket | None = None  # its ticket, on a queue that conflates (see submit)
        queue.handles.add(self)
        if batch is not None:
            batch._handles.add(self)

    def __await__(self) -> Generator[Any, None, R]:
        future = self._future
        try:
            return (yield from asyncio.shield(future).__await__())
        finally:
            self._awaited |= future.done()  # (done: the outcome reached this awaiter)

    def done(self) -> bool:
        """Whether the work has finished: returned, raised, or was cancelled."""
        return self._future.done()

    def cancelled(self) -> bool:
        """Whether the work was cancelled (before its turn, or while it ran)."""
        return self._future.cancelled()

    def result(self) -> R:
        """The work's result, as :meth:`asyncio.Future.result`: raise its error if it failed.

        :raises asyncio.InvalidStateError: the work has not finished.
        :raises asyncio.CancelledError: the work was cancelled.
        """
        future = self._future
        self._awaited |= future.done() and not future.cancelled()  # its error reaches the caller
        return future.result()

    def exception(self) -> BaseException | None:
        """The work's error, or None if it returned, as :meth:`asyncio.Future.exception`.

        An error read here counts as retrieved: no batch or
        ``drain(raise_errors=True)`` raises it again.

        :raises asyncio.InvalidStateError: the work has not finished.
        :raises asyncio.CancelledError: the work was cancelled.
        """
        future = self._future
        self._awaited |= future.done() and not future.cancelled()
        return future.exception()

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
        self._future.add_done_callback(call, context=context)

    def remove_done_callback(self, fn: Callable[[Handle[R]], object]) -> int:
        """Remove every registration of ``fn`` by :meth:`add_done_callback`; return how many."""
        callbacks = self._callbacks or []
        self._callbacks = [(added, call) for added, call in callbacks if added != fn]
        return sum(self._future.remove_done_callback(c) for added, c in callbacks if added == fn)

    def cancel(self, msg: object = None) -> bool:
        """Cancel the work: it leaves its line, or is cancelled at its next ``await``.

        Work still waiting in its key's line leaves it without disturbing
        anyone behind; work handed its turn at that moment passes it on.
        Return False if it has finished already. Awaiting the handle then
        raises :exc:`asyncio.CancelledError`.
        """
        future = self._future
        if future.done():
            return False
        task = self._task
        if task is not None:
            if self._stage == _STARTED:
                return task.cancel(msg)  # its task ends it
            task.cancel(msg)  # not run yet: it never will (it runs no code when thrown at)
        # waiting as data, or holding the key with its task not run (or made) yet
        future.cancel(msg)  # first: done, so that a hand-off skips it
        self._leave_line(asyncio.CancelledError())
        return True

    def __repr__(self) -> str:
        future = self._future
        if not future.done():
            state = "pending" if self._task is not None else "waiting in line"
        elif future.cancelled():
            state = "cancelled"
        elif future.exception() is not None:
            state = f"failed: {describe(future.exception())}"
        else:
            state = "done"
        return f"<Handle key={describe(self.key)} {state}>"

    # -- its life -----------------------------------------------------------------

    def _leave_line(self, error: BaseException) -> None:
        """Leave the key's line, where it waits or holds the key (passing it on); finish.

        The outcome is set already (done: a hand-off skips it, and the line's
        ``waiter.cancel()`` is a no-op); error is what the stats count.
        """
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        registry = self._queue.registry
        if self._counted:
            with registry.mode.guard():
                _uncount(self, registry.slots)
        if self._stage == _PLACED:
            self._stage = _UNPLACED
            if self._line is None:  # it took the free key: give it back
                registry.release((self.key,), self, error, None, None)
            elif type(self._line) is Latest:  # (passes on the key if it was handed just now)
                ticket = self._ticket
                assert ticket is not None
                if ticket.book.gave_up(ticket, error):
                    registry.missed(error)
            else:  # (passes on the key if it was handed just now)
                registry.abandon(self.key, self._line, self)
                registry.missed(error)
        self._finish(not isinstance(error, asyncio.CancelledError))

    def _expire(self, timeout: float) -> None:
        """The queue's timeout ran out while the work waited in its key's line."""
        self._timer = None
        future = self._future
        if future.done():
            return
        queue = self._queue
        with queue.registry.mode.guard():
            ticket = self._ticket
            if ticket is not None and type(self._line) is Latest and not ticket.book.waits(ticket):
                return  # its Latest was handed the key (or it was answered) just now
            if held_by(queue.registry.lines.get(self.key), self):
                return  # handed the key just now: its task takes the rest of the time
            future.set_exception(queue.registry.too_late(self.key, timeout, True))
        self._leave_line(future.exception())  # type: ignore[arg-type]  # (read: retrieved)

    def handed(self, shared: bool) -> bool:
        """The line was handed to this work, under the guard: start its task, in its loop.

        Return False if its loop is closed: nothing will ever run it.
        """
        loop = self._future.get_loop()
        if not shared and makes_plain_tasks(loop):
            self._start()  # a plain task runs no step when made: it is scheduled
            return True
        # NOTE: scheduled, not made here: a task may run at once (eager), mid-hand-off
        return _call_soon_in(loop, self._start)

    def _start(self) -> None:
        """Make the task of work that was handed its key's line (once)."""
        if self._future.done() or self._task is not None:  # (done: it passed the turn on)
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        context, self._context = self._context, None
        assert context is not None
        self._task = in_context(self._future.get_loop(), _run(self), context)

    # -- as its ticket's waiter, in a key's Latest (see _latest.Data) ---------------------

    def let_go(self) -> None:
        # (its function, arguments and context go: it only follows what runs)
        self._fn, self._args, self._kwargs, self._context = _spent, (), _NO_KWARGS, None
        self._queue.handles.discard(self)  # (drain() waits for what it follows)

    def answer(self, error: BaseException | None, result: Any) -> None:
        # (in its loop, after the guard: _finish tells its batch, which may cancel handles;
        # out of the queue's handles now, as a burst of answers may wait a while for it)
        self._queue.handles.discard(self)
        _call_soon_in(self._future.get_loop(), lambda: self._answered(error, result))

    def _answered(self, error: BaseException | None, result: Any) -> None:
        """Its work did not run: newer work replaced it (and this is that work's outcome)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._stage = _UNPLACED
        if not self._future.done():  # (its own caller, or the work's, reports an error)
            self._ended(error, result, reported=True)

    def _ended(self, error: BaseException | None, result: Any, reported: bool = False) -> None:
        """Give the handle the outcome of its work, from the work's task (or its refusal);
        ``reported``: an error that is not the handle's to report (see _answered)."""
        future = self._future
        if error is None:
            future.set_result(result)
        elif isinstance(error, asyncio.CancelledError):
            future.cancel()
        else:
            future.set_exception(error)
            future.exception()  # retrieved: it reaches the handle's awaiters, or its batch
        # (Superseded is the caller's answer, not a failure: no batch raises it again)
        failed = error is not None and not future.cancelled() and not reported
        self._finish(failed and not isinstance(error, Superseded))

    def _finish(self, failed: bool) -> None:
        """Let the queue and the batch know the work has finished (failed: with an error)."""
        # let the work's function and arguments go, as a finished task does its frame
        self._fn, self._args, self._kwargs, self._line = _spent, (), _NO_KWARGS, None
        self._ticket = None
        self._queue.handles.discard(self)
        if failed and not self._awaited:  # (its error is raised by its batch, or drain())
            (self._queue.unclaimed if self._batch is None else self._batch._failed).append(self)
        if self._batch is not None:
            self._batch._finished(self, failed)


def _spent() -> None:
    """What a finished handle holds instead of its work's function."""


#: What a finished handle holds instead of its work's keyword arguments (never changed).
_NO_KWARGS: dict[str, Any] = {}


def _uncount(handle: Handle[Any], slots: Slots | None) -> None:
    """Count submitted work as placed (once), under the guard; wake a producer if a slot is free."""
    handle._counted = False
    assert slots is not None
    slots.unplaced -= 1
    if slots.producers and slots.free > slots.unplaced:
        slots.wake_producer()


async def _run(handle: Handle[Any]) -> None:
    """The task of submitted work that holds its key's line: the rest of its turn's steps
    (a backend's grant, a running slot, max_hold), the work, then the release of each."""
    handle._stage = _STARTED
    queue = handle._queue
    registry = queue.registry
    task = handle._task
    if task is None:  # an eager task runs this step inside create_task: known so, to cancel()
        task = handle._task = _current_task()
        assert task is not None
    ticket = handle._ticket
    with registry.mode.guard():
        if type(handle._line) is Latest:  # (its ticket was handed the key)
            assert ticket is not None
            ticket.book.hold(ticket, task)
        else:
            registry.start(handle.key, handle, task)
        handle._line = None
        if handle._counted:
            _uncount(handle, registry.slots)
    if registry.tally.observer is not None:  # (this task's context is its own)
        FUNCTION.set(function_label(handle._fn))
    turn = Turn(registry, (handle.key,), queue.timeout, queue.max_hold, False, ticket)
    fn, args, kwargs = handle._fn, handle._args, handle._kwargs
    try:
        result = await call_in_turn(turn, fn, args, kwargs, task, handle._since, True)
    except BaseException as error:
        handle._ended(error, None)
        if isinstance(error, Exception) or not isinstance(error, _STOPS):
            return  # it is the handle's now: the task ends quietly
        raise
    handle._ended(None, result)


#: What submitted work's task raises on, as a task does: its cancellation, and what asks the
#: loop to stop. Any other error, also a BaseException of its own, is the handle's alone.
_STOPS = (asyncio.CancelledError, KeyboardInterrupt, SystemExit)


async def submit(
    queue: Submissions,
    key: Hashable,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    batch: Scope | None,
) -> Handle[Any]:
    """queue.submit() (or batch's): a failed handle nobody awaited is its batch's to raise,
    else drain()'s (see Handle._finish)."""
    if not callable(fn):
        raise TypeError(f"inturn: submit() needs a callable, got {describe(fn)}")
    registry = queue.registry
    key = registry.ordered((key,))[0]  # (checked: hashable, or a backend's kind)
    if not registry.open:
        raise closed(registry.name, key)
    loop = running_loop("submit()")
    slots = registry.slots
    me = None
    if slots is not None:
        me = _current_task()
        if slots.free <= slots.unplaced and slots.needs(key, me):
            await slots.backpressure(key, me, loop)
    handle: Handle[Any] = Handle(queue, key, fn, args, kwargs, loop.create_future(), batch)
    policy = queue.policy
    try:
        with registry.mode.guard_for(loop):
            line: _Line | Gate | Latest | None = None
            if policy.conflates and queue.timeout != 0:
                work = (fn, args, kwargs, contextvars.copy_context())  # (see Book.start)
                label = None if registry.tally.observer is None else function_label(fn)
                handle._ticket = Ticket(queue.book, key, policy, work, label, loop, handle)
                line = queue.book.enter(handle._ticket, handle, loop.time)
            if line is None:
                line = registry.join(key, handle, handle, queue.timeout, guarded=True)  # as data
            handle._stage = _PLACED
            handle._line = line
            if line is None and slots is not None:  # it holds the key: its task starts next
                if me not in slots.holders:
                    handle._counted = True
                    slots.unplaced += 1
                if slots.producers:  # those waiting to submit for this key may go: it is busy
                    slots.wake_producers_behind()
    except (QueueFull, QueueClosed, TimeoutError) as refused:  # (the guard is let go first)
        registry.missed(refused)
        handle._ended(refused, None)
    else:
        _watch(loop, queue)  # (see the module's doc: a task cancelled before its first step)
        if line is None:
            handle._task = loop.create_task(_run(handle))
        else:
            handle._context = contextvars.copy_context()
            timeout = queue.timeout
            if timeout is not None:
                handle._timer = loop.call_later(timeout, handle._expire, timeout)
    if slots is not None and slots.producers and slots.free > slots.unplaced:
        slots.next_producer()  # a slot is still free: the next producer may go
    return handle


_Watch = tuple[weakref.WeakSet[Submissions], AsyncGenerator[None, None]]
#: Per event loop: the queues with its submitted work waiting as data (see the module's
#: doc), and its watch, which the loop holds weakly only. NOTE: a watch holds its loop
#: (the loop's finalizer hook): its entry goes when the loop shuts down, or when a new
#: loop is watched and finds that loop closed.
_WATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Watch] = weakref.WeakKeyDictionary()
#: The (loop, queue) watched last, to skip the lookups for the next work alike.
_last: tuple[weakref.ref[asyncio.AbstractEventLoop], weakref.ref[Submissions]] | None = None


def _watch(loop: asyncio.AbstractEventLoop, queue: Submissions) -> None:
    """Make sure loop's shutdown cancels queue's submitted work of loop (see the module's doc)."""
    global _last
    last = _last
    if last is not None and last[0]() is loop and last[1]() is queue:
        return
    try:
        watched = _WATCHES.get(loop)
        if watched is None:
            for closed in [other for other in _WATCHES if other.is_closed()]:
                del _WATCHES[closed]  # closed without shutdown_asyncgens()
            queues: weakref.WeakSet[Submissions] = weakref.WeakSet()
            watch = _shutdown(queues)  # (not given the loop: the map holds the loop weakly)
            try:  # its first step, in this loop: the loop's hooks track it from now on
                watch.asend(None).send(None)
            except StopIteration:
                pass
            watched = _WATCHES[loop] = (queues, watch)
        watched[0].add(queue)
        _last = (weakref.ref(loop), weakref.ref(queue))
    except TypeError:  # pragma: no cover - a loop that takes no weak reference: no watch
        return


async def _shutdown(queues: weakref.WeakSet[Submissions]) -> AsyncGenerator[None, None]:
    """Wait for the loop's shutdown; then cancel the loop's submitted work still pending."""
    try:
        yield
    finally:
        global _last
        _last = None
        loop = asyncio.get_running_loop()  # (the loop closes it, in its own run)
        _WATCHES.pop(loop, None)
        tasks = []
        for queue in list(queues):
            for handle in list(queue.handles):
                if handle._future.get_loop() is loop and handle.cancel():
                    task = handle._task
                    if task is not None and not task.done():
                        tasks.append(task)
        if tasks:  # they leave their lines as they end
            await asyncio.gather(*tasks, return_exceptions=True)


def failures(message: str, errors: list[BaseException]) -> BaseExceptionGroup[BaseException]:
    """The group that reports errors nobody awaited (an ExceptionGroup if all are Exceptions).

    Before Python 3.11 the backport is imported here, when a group is raised, not at
    ``import inturn``: it imports typing_extensions, which costs more than inturn itself.
    """
    if sys.version_info >= (3, 11):  # pragma: no branch - depends on the interpreter
        return BaseExceptionGroup(message, errors)
    from exceptiongroup import BaseExceptionGroup as backport  # pragma: no cover

    return backport(message, errors)  # pragma: no cover


def unawaited(failed: list[Handle[Any]]) -> list[BaseException]:
    """The errors of the failed handles nobody awaited."""
    errors = [handle._future.exception() for handle in failed if not handle._awaited]
    return [error for error in errors if error is not None]


def claim(failed: list[Handle[Any]]) -> None:
    """Raise the errors of failed handles nobody awaited, once (``drain(raise_errors=True)``)."""
    errors = unawaited(failed)
    failed.clear()
    if errors:
        raise failures(
            f"inturn: {len(errors)} submitted work(s) failed and nobody awaited them", errors
        )
