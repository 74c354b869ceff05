"""The callers of a key's Latest (see _latest): a task's ticket and a thread's, and their calls.

A caller whose work finds its key busy (or is debounced) waits on its ticket
instead of in the key's line; woken with ``_RUN`` it holds the key in its
Latest's place and takes the rest of its turn's steps (``lined``), then
tells the book the work's outcome for its followers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from contextvars import copy_context
from inspect import isawaitable, iscoroutine
from threading import Lock
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, Final, final

from ._checks import Policy
from ._latest import WAITING, Book, Latest, Ticket, Work, superseded
from ._stats import FUNCTION
from ._tasks import current_task, in_context, in_loop_of
from ._threads import thread_holder
from ._turn import Turn, call_in_turn, call_in_turn_sync

if TYPE_CHECKING:
    pass

#: What a task's ticket future is given when its caller is to run its work.
_RUN: Final = object()


def _give(future: asyncio.Future[Any], error: BaseException | None, result: Any) -> None:
    if future.done():  # its caller left
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


@final
class TaskTicket(Ticket):
    """A task's ticket: it awaits ``future`` (``_RUN``: run its work; else its answer)."""

    __slots__ = ("future", "timer")

    def __init__(
        self, join: bool, future: asyncio.Future[Any], label: str | None, work: Work
    ) -> None:
        super().__init__(join, label, work, future.get_loop())
        self.future = future
        self.timer: asyncio.TimerHandle | None = None  # the debounce's

    def run_now(self, shared: bool) -> bool:
        return in_loop_of(self.future, _give, self.future, None, _RUN)

    def answer(self, error: BaseException | None, result: Any) -> None:
        in_loop_of(self.future, _give, self.future, error, result)

    def arm(self, delay: float | None) -> None:
        in_loop_of(self.future, self._arm, delay)

    def _arm(self, delay: float | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if delay is not None and self.state == WAITING and not self.future.done():
            latest = self.latest
            assert latest is not None
            self.timer = self.future.get_loop().call_later(
                max(delay, 0.0), latest.book.tick, latest
            )


@final
class ThreadTicket(Ticket):
    """A thread's ticket: it blocks on ``lock``, released once ``outcome`` is set (or to re-arm)."""

    __slots__ = ("due", "lock", "outcome")

    def __init__(self, join: bool, label: str | None, work: Work) -> None:
        super().__init__(join, label, work, None)
        self.lock = Lock()
        self.lock.acquire()
        self.outcome: tuple[BaseException | None, Any] | None = None
        self.due: float | None = None  # when to tick the debounce (monotonic)

    def run_now(self, shared: bool) -> bool:
        self.outcome = (None, _RUN)
        self._wake()
        return True

    def answer(self, error: BaseException | None, result: Any) -> None:
        self.outcome = (error, result)
        self._wake()

    def arm(self, delay: float | None) -> None:
        was, self.due = self.due, None if delay is None else _monotonic() + delay
        if self.due is not None and (was is None or self.due < was):
            self._wake()  # (to wait with the new time)

    def _wake(self) -> None:
        if self.lock.locked():
            try:
                self.lock.release()
            except RuntimeError:  # released just now: it wakes anyway
                pass


@final
class Runs:
    """What a conflating turn calls once it holds its key: its own work, or newer work.

    A turn may wait after it took its key's line (for a backend's grant, a
    running slot) while newer work joins the key's Latest behind it: that
    work then runs in this turn instead (see Book.newer), and ``taken`` holds
    the callers who follow it. ``mine``: the Latest this turn's caller ran
    from, if any (its followers follow this turn too).
    """

    __slots__ = (
        "book",
        "home",
        "join",
        "key",
        "label",
        "mine",
        "replaced",
        "seq",
        "swaps",
        "taken",
        "work",
    )

    def __init__(
        self,
        book: Book,
        key: Hashable,
        work: Work,
        policy: Policy,
        label: str | None,
        home: asyncio.AbstractEventLoop | None,
    ) -> None:
        self.book = book
        self.key = key
        self.work = work
        self.home = home  # the turn's event loop; None: a thread's
        self.seq = 0  # its call's place in the book's order (see Book.enter)
        self.swaps = policy.latest  # (a debounce alone lets every quiet period's work run)
        self.join = policy.join
        self.label = label
        self.mine: Latest | None = None
        self.taken: Latest | None = None  # who follows this turn's outcome
        self.replaced = False  # newer work ran in this turn

    def __call__(self) -> Any:
        registry = self.book.registry
        with registry.mode.guard():
            found = (
                self.book.newer(self.key, self.mine, self.home, self.seq) if self.swaps else None
            )
            self.taken = self.mine if found is None else found[0]
            if found is not None:
                self.replaced = True
                registry.tally.superseded(None if self.join else superseded(self.key), self.label)
        fn, args, kwargs, context = self.work if found is None else found[1]
        try:
            if found is None or context is None:
                result = fn(*args, **kwargs)
            else:  # (the newer work, in its caller's context)
                result = context.run(fn, *args, **kwargs)
                if self.home is not None and iscoroutine(result):
                    result = in_context(self.home, result, context)
        except BaseException as error:
            self._revive(error)
            raise
        if self.home is not None and isawaitable(result):
            return self._watched(result)
        return result

    async def _watched(self, work: Awaitable[Any]) -> Any:
        """Await the work (see _revive)."""
        try:
            return await work
        except BaseException as error:
            self._revive(error)
            raise

    def _revive(self, error: BaseException) -> None:
        """The work was cancelled (or interrupted) while this turn holds the key: its
        followers wait again now, ahead of what came since (see Book.revive)."""
        if self.taken is not None and not isinstance(error, Exception):
            self.book.revive(self.taken)

    async def outcome(self, turn: Awaitable[Any]) -> Any:
        """Await the turn that calls this (see ended): this caller's outcome."""
        try:
            result = await turn
        except BaseException as error:
            return self.ended(error, None)
        return self.ended(None, result)

    def ended(self, error: BaseException | None, result: Any) -> Any:
        """Tell the followers the turn's outcome; return this caller's (``result``)."""
        followed = self.mine if self.taken is None else self.taken  # (mine: it never ran)
        if followed is not None:
            self.book.ended(followed, error, result)
        if error is not None:
            raise error
        if self.replaced and not self.join:
            raise superseded(self.key)
        return result


async def run_latest(
    book: Book,
    key: Hashable,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    task: asyncio.Task[Any] | None,
    timeout: float | None,
    hold: float | None,
    policy: Policy,
    label: str | None,
) -> Any:
    """A task's call of fn in key's turn, conflated by policy (see the module).

    ``task``: the caller's, if it knows it (else the current task).
    """
    registry = book.registry
    if task is None:
        task = current_task()
        assert task is not None
    loop = task.get_loop()
    future: asyncio.Future[Any] = loop.create_future()
    work = (fn, args, kwargs, copy_context())
    ticket = TaskTicket(policy.join, future, label, work)
    since = 0.0  # (when a work that waits in a Latest was asked for, on a timed queue)
    with registry.mode.guard_for(loop):
        latest = None if timeout == 0 else book.enter(key, task, ticket, policy, loop.time)
    runs = Runs(book, key, work, policy, label, loop)
    runs.seq = ticket.seq
    if latest is not None:
        since = _monotonic() if registry.timed else 0.0
        timer = (
            None if timeout is None else loop.call_later(timeout, _expire, book, ticket, timeout)
        )
        try:
            answer = await future
        except BaseException as problem:
            book.gave_up(ticket, problem)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        if answer is not _RUN:
            return answer
        with registry.mode.guard():
            book.start(ticket, task)
        runs.mine = ticket.latest  # (a new one if its Latest's runner was cancelled)
    turn = Turn(registry, (key,), timeout, hold)
    lined = latest is not None
    return await runs.outcome(call_in_turn(turn, runs, (), {}, task, since, lined, label))


def _expire(book: Book, ticket: TaskTicket, limit: float) -> None:
    """A task's ticket not handed the key within its caller's timeout: its caller leaves."""
    with book.registry.mode.guard():
        if not book.waits(ticket) or ticket.future.done():
            return
        latest = ticket.latest
        assert latest is not None
        ticket.future.set_exception(book.registry.too_late(latest.key, limit, False))


def run_latest_sync(
    book: Book,
    key: Hashable,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float | None,
    policy: Policy,
) -> Any:
    """A thread's call of fn in key's turn, conflated by policy (see run_latest)."""
    registry = book.registry
    label = FUNCTION.get()
    work = (fn, args, kwargs, copy_context())
    ticket = ThreadTicket(policy.join, label, work)
    me = thread_holder()
    since = 0.0  # (when a work that waits in a Latest was asked for, on a timed queue)
    with registry.mode.for_threads():
        latest = None if timeout == 0 else book.enter(key, me, ticket, policy, _monotonic)
    runs = Runs(book, key, work, policy, label, None)
    runs.seq = ticket.seq
    if latest is not None:
        since = _monotonic() if registry.timed else 0.0
        try:
            answer = _wait_sync(book, ticket, key, timeout)
            if answer is not _RUN:
                return answer
            with registry.mode.guard():
                book.start(ticket, me)
        except BaseException as problem:
            book.gave_up(ticket, problem)
            raise
        runs.mine = ticket.latest  # (a new one if its Latest's runner was cancelled)
    turn = Turn(registry, (key,), timeout, None)
    try:
        result = call_in_turn_sync(turn, runs, (), {}, lined=latest is not None, since=since)
    except BaseException as error:
        return runs.ended(error, None)
    return runs.ended(None, result)


def _wait_sync(book: Book, ticket: ThreadTicket, key: Hashable, limit: float | None) -> Any:
    """Block until the book answers ticket, ticking its debounce when due; _RUN: run the work.

    :raises TimeoutError: not handed the key within limit (the caller then leaves).
    """
    deadline = None if limit is None else _monotonic() + limit
    while True:
        times = [when for when in (deadline, ticket.due) if when is not None]
        left = min(times) - _monotonic() if times else None
        woken = ticket.lock.acquire(timeout=-1 if left is None else max(left, 0.0))
        outcome = ticket.outcome
        if outcome is not None:
            error, result = outcome
            if error is not None:
                raise error
            return result
        if woken:
            continue  # (re-timed: see ThreadTicket.arm)
        now = _monotonic()
        if deadline is not None and now >= deadline:
            with book.registry.mode.guard():
                if ticket.outcome is None and book.waits(ticket):
                    raise book.registry.too_late(key, limit, False)
            deadline = None  # (it follows the work that runs: its turn came)
        elif ticket.due is not None and now >= ticket.due and ticket.latest is not None:
            book.tick(ticket.latest)
