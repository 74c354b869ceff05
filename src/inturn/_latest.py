"""Latest wins: a key's one waiting work, replaced by newer work; and a trailing debounce.

With ``pending="latest"`` (a queue's, or a decorated function's), work that
finds its key busy does not wait in the key's line itself: the line holds
one :class:`Latest` for the key, as data (a Deferred), and each caller waits
on a :class:`Ticket` in it. A newer caller's ticket joins the same Latest,
so the line keeps one waiting work per key however many arrive. With
``debounce``, the Latest first waits outside any line until its key has
been quiet for that long (or ``max_wait`` passed), then joins the line.

When the line hands the key to the Latest, the newest ticket still waiting
runs its own work, in its own task or thread (its context, its errors and
its cancellation are its caller's, as without conflation). The others are
its followers: each ``on_superseded="join"`` caller gets its outcome, and a
``"raise"`` one was answered with :exc:`~inturn.Superseded` when it was
replaced. If the runner's work is cancelled (or interrupted) instead of
finishing, its followers' works wait again, the newest of them to run.

Invariants (every change under the registry's guard):

- ``Book.open[key]`` is the key's Latest while newer work joins it: while
  it is quiet (debounce), and while it waits in the line when it was opened
  by ``pending="latest"`` work. It is handed the key once: newer work then
  opens another.
- A Latest's ``tickets`` are its live waiting callers, oldest first: one that
  leaves (cancelled, timed out, answered) is taken out at once, so ``done()``
  (no ticket) makes a hand-off skip it. After the hand-off, ``followers`` are
  the callers that wait for the runner's outcome.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from threading import Lock
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, Final, final

from ._checks import Policy
from ._describe import describe
from ._errors import QueueClosed, QueueFull, Superseded
from ._line import Deferred, Line, held_by
from ._tasks import current_task, in_loop_of
from ._threads import thread_holder
from ._turn import Turn, call_in_turn, call_in_turn_sync

if TYPE_CHECKING:
    from ._registry import Registry

# Where a ticket is (Ticket.state).
_WAITING: Final = 0  # in its Latest's tickets
_RUNS: Final = 1  # handed the key: its caller runs its work
_FOLLOWS: Final = 2  # waits for the runner's outcome
_LEFT: Final = 3  # gone (cancelled, timed out)
_ANSWERED: Final = 4  # answered by the book: its work did not run

#: What a task's ticket future is given when its caller is to run its work.
_RUN: Final = object()


class Ticket:
    """One caller's work in a key's Latest: how its caller is woken and answered."""

    __slots__ = ("join", "latest", "state")

    def __init__(self, join: bool) -> None:
        self.join = join  # on_superseded="join"
        self.latest: Latest | None = None  # the Latest it waits in
        self.state = _WAITING

    def run_now(self, shared: bool) -> bool:
        """The key is this caller's: wake it to run its work; False if it never can."""
        raise NotImplementedError

    def answer(self, error: BaseException | None, result: Any) -> None:
        """Give the caller its answer: its work did not run (see Book.ended, Book.supersede)."""
        raise NotImplementedError

    def arm(self, delay: float | None) -> None:
        """Tick the Latest's debounce after delay seconds (None: stop ticking it)."""
        raise NotImplementedError


@final
class Latest(Deferred):
    """The one waiting work of a key: in its line as data, or quiet before (see the module)."""

    __slots__ = (
        "book",
        "clock",
        "debounce",
        "first",
        "followers",
        "keeps",
        "key",
        "last",
        "line",
        "max_wait",
        "tickets",
    )

    def __init__(self, book: Book, key: Hashable, policy: Policy, clock: Callable[[], float]):
        self.book = book
        self.key = key
        self.keeps = policy.latest  # takes newer work while in the line
        self.debounce = policy.debounce
        self.max_wait = policy.max_wait
        self.clock = clock  # the opener's (its loop's, for virtual time)
        self.first = self.last = clock()  # when it opened, when its newest work came
        self.tickets: list[Ticket] = []  # live waiting callers, oldest first
        self.followers: list[Ticket] = []  # after the hand-off
        self.line: Line | None = None  # the line it joined (None: quiet)

    def done(self) -> bool:
        return not self.tickets

    def cancel(self) -> bool:
        return False  # (its tickets leave it one by one)

    def handed(self, shared: bool) -> bool:
        return self.book.handed(self, shared)

    def quiet_left(self) -> float:
        """Seconds until its quiet period ends (max_wait bounds it)."""
        assert self.debounce is not None
        due = self.last + self.debounce
        if self.max_wait is not None:
            due = min(due, self.first + self.max_wait)
        return due - self.clock()

    def __repr__(self) -> str:
        where = "quiet" if self.line is None else "in line"
        return f"<Latest key={describe(self.key)} {where}, {len(self.tickets)} waiting>"


@final
class Book:
    """A queue's open Latests, by key: the only writer of them (see the module)."""

    __slots__ = ("open", "registry")

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.open: dict[Hashable, Latest] = {}

    def forked(self) -> None:
        """In a forked child: the parent's waiting callers are not this process's."""
        self.open.clear()

    def enter(
        self,
        key: Hashable,
        holder: object,
        ticket: Ticket,
        policy: Policy,
        clock: Callable[[], float],
    ) -> Latest | None:
        """Put ticket in key's Latest (replacing the newest there); None: take the turn as usual.

        None for a free key without debounce, a key holder holds already
        (reentrant), or a closed queue (the usual path refuses it). Under
        the guard.

        :raises QueueFull: a new Latest would exceed the line's ``max_pending``.
        """
        registry = self.registry
        line = registry.lines.get(key)
        if not registry.open or (line is not None and held_by(line, holder)):
            return None
        latest = self.open.get(key)
        if latest is None:
            if policy.debounce is None and (line is None or not policy.latest):
                return None
            latest = Latest(self, key, policy, clock)
            if policy.debounce is None:
                self._place(latest)  # (the key is busy: it waits in the line)
            self.open[key] = latest
        else:
            tickets = latest.tickets
            if tickets and not tickets[-1].join:
                self.supersede(tickets.pop())
            if latest.line is None:
                latest.last = latest.clock()
                if tickets:
                    tickets[-1].arm(None)
        ticket.latest = latest
        ticket.state = _WAITING
        latest.tickets.append(ticket)
        if latest.line is None:
            ticket.arm(latest.quiet_left())
        return latest

    def supersede(self, ticket: Ticket) -> None:
        """Answer a "raise" caller whose work newer work replaced. Under the guard."""
        ticket.state = _ANSWERED
        ticket.arm(None)
        latest = ticket.latest
        assert latest is not None
        error = Superseded(
            f"inturn: newer work for key {describe(latest.key)} took this work's place "
            "(pending='latest'); this work did not run"
        )
        self.registry.tally.superseded(1, error)
        ticket.answer(error, None)

    def _place(self, latest: Latest) -> None:
        """Put latest in its key's line; if the key is free, it is handed the key at once."""
        registry = self.registry
        line = registry.join(latest.key, latest, latest, None, guarded=True)
        if line is None:  # free: it holds the key, in a line of its own for abandon()
            line = latest.line = registry.lined(latest.key)
            if not self.handed(latest, registry.mode.shared):
                registry.abandon(latest.key, line, latest, guarded=True)
            return
        latest.line = line  # type: ignore[assignment]  # (no Gate: concurrency is 1)

    def handed(self, latest: Latest, shared: bool) -> bool:
        """The line handed latest the key: its newest caller runs, the others follow it.

        False if no caller can take it (their loops are closed). Under the guard.
        """
        if self.open.get(latest.key) is latest:
            del self.open[latest.key]
        followers, latest.tickets = latest.tickets, []
        latest.followers = followers
        while followers:
            runner = followers.pop()
            runner.state = _RUNS
            if runner.run_now(shared):
                for follower in followers:
                    follower.state = _FOLLOWS
                    follower.arm(None)
                if followers:
                    self.registry.tally.superseded(len(followers), None)
                return True
            runner.state = _LEFT
        return False

    def tick(self, latest: Latest, now: bool = False) -> None:
        """A debounce timer went off: a quiet Latest whose time is up joins its line.

        ``now``: whatever its time (drain() ends quiet periods).
        """
        with self.registry.mode.guard():
            if latest.line is not None or not latest.tickets:
                return
            if not now and latest.quiet_left() > 0:  # (newer work came: its timer is armed)
                return
            if not latest.keeps and self.open.get(latest.key) is latest:
                del self.open[latest.key]
            latest.tickets[-1].arm(None)
            try:
                self._place(latest)
            except (QueueFull, QueueClosed) as refused:
                refusal: BaseException | None = refused
            else:
                return
        self._refuse(latest, refusal)

    def flush(self) -> None:
        """End every quiet period now: each quiet Latest joins its line (for drain())."""
        for latest in [latest for latest in self.open.values() if latest.line is None]:
            self.tick(latest, now=True)

    def _refuse(self, latest: Latest, error: BaseException | None) -> None:
        """Answer every caller of a quiet latest that its line refused."""
        with self.registry.mode.guard():
            if self.open.get(latest.key) is latest:
                del self.open[latest.key]
            tickets, latest.tickets = latest.tickets, []
            for ticket in tickets:
                ticket.state = _ANSWERED
                ticket.answer(error, None)

    def leave(self, ticket: Ticket) -> None:
        """Take a caller that gave up (cancelled, timed out) out; pass on a key it was handed.

        Under the guard.
        """
        state = ticket.state
        latest = ticket.latest
        if latest is None or state >= _LEFT:
            return
        ticket.state = _LEFT
        ticket.arm(None)
        registry = self.registry
        if state == _FOLLOWS:
            latest.followers.remove(ticket)
        elif state == _WAITING:
            tickets = latest.tickets
            newest = tickets[-1] is ticket
            tickets.remove(ticket)
            if tickets:
                if newest and latest.line is None:
                    tickets[-1].arm(latest.quiet_left())
                return
            if self.open.get(latest.key) is latest:
                del self.open[latest.key]
            if latest.line is not None:  # nobody waits for it: it leaves the line
                registry.abandon(latest.key, latest.line, latest, guarded=True)
        else:  # handed the key, gone before its work started: the newest follower runs
            followers = latest.followers
            while followers:
                runner = followers.pop()
                runner.state = _RUNS
                if runner.run_now(registry.mode.shared):
                    return
                runner.state = _LEFT
            assert latest.line is not None
            registry.abandon(latest.key, latest.line, latest, guarded=True)

    def gave_up(self, ticket: Ticket, error: BaseException) -> None:
        """A caller's wait ended by error: unless the book answered it, it leaves (see leave),
        and a work that was still waiting counts as a missed turn."""
        with self.registry.mode.guard():
            waited = ticket.state <= _RUNS
            self.leave(ticket)
        if waited:
            self.registry.missed(error)

    def start(self, ticket: Ticket, holder: object) -> None:
        """The runner's caller holds the key now, in its Latest's place. Under the guard."""
        latest = ticket.latest
        assert latest is not None
        self.registry.start(latest.key, latest, holder, True)

    def ended(self, ticket: Ticket, error: BaseException | None, result: Any) -> None:
        """The runner's work ended: answer its followers with its outcome.

        If it was cancelled or interrupted rather than finished, the followers'
        works wait again (newest last), joining the key's open Latest, or a new one.
        """
        latest = ticket.latest
        assert latest is not None
        with self.registry.mode.guard():
            followers, latest.followers = latest.followers, []
            if not followers:
                return
            if error is not None and not isinstance(error, Exception):
                again = self.open.get(latest.key)
                if again is None:
                    again = Latest(
                        self, latest.key, Policy(latest.keeps, True, None, None), latest.clock
                    )
                    again.tickets = followers
                    for follower in followers:
                        follower.state = _WAITING
                        follower.latest = again
                    try:
                        self._place(again)
                    except (QueueFull, QueueClosed) as refused:
                        again.tickets = []
                        for follower in followers:
                            follower.state = _ANSWERED
                            follower.answer(refused, None)
                        return
                    if again.keeps and again.tickets:
                        self.open[latest.key] = again
                    return
                for follower in followers:
                    follower.state = _WAITING
                    follower.latest = again
                again.tickets[:0] = followers  # (older than the works waiting there)
                return
            for follower in followers:
                follower.state = _ANSWERED
                follower.answer(error, result)


# -- the callers: a task, a thread ------------------------------------------------------------


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

    def __init__(self, join: bool, future: asyncio.Future[Any]) -> None:
        super().__init__(join)
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
        if delay is not None and self.state == _WAITING and not self.future.done():
            latest = self.latest
            assert latest is not None
            self.timer = self.future.get_loop().call_later(
                max(delay, 0.0), latest.book.tick, latest
            )


@final
class ThreadTicket(Ticket):
    """A thread's ticket: it blocks on ``lock``, released once ``outcome`` is set (or to re-arm)."""

    __slots__ = ("due", "lock", "outcome")

    def __init__(self, join: bool) -> None:
        super().__init__(join)
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


def _late(registry: Registry, key: Hashable, limit: float) -> TimeoutError:
    return registry.too_late(key, limit, False)


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
    ticket = TaskTicket(policy.join, future)
    since = _monotonic() if registry.timed else 0.0
    with registry.mode.guard_for(loop):
        latest = None if timeout == 0 else book.enter(key, task, ticket, policy, loop.time)
    turn = Turn(registry, (key,), timeout, hold)
    if latest is None:
        return await call_in_turn(turn, fn, args, kwargs, task, label=label)
    timer = None if timeout is None else loop.call_later(timeout, _expire, book, ticket, timeout)
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
    error: BaseException | None = None
    try:
        result = await call_in_turn(turn, fn, args, kwargs, task, since, lined=True, label=label)
    except BaseException as problem:
        error = problem
        raise
    finally:
        book.ended(ticket, error, None if error is not None else result)
    return result


def _expire(book: Book, ticket: TaskTicket, limit: float) -> None:
    """A task's ticket not handed the key within its caller's timeout: its caller leaves."""
    with book.registry.mode.guard():
        if ticket.state != _WAITING or ticket.future.done():
            return
        latest = ticket.latest
        assert latest is not None
        ticket.future.set_exception(_late(book.registry, latest.key, limit))


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
    ticket = ThreadTicket(policy.join)
    me = thread_holder()
    since = _monotonic() if registry.timed else 0.0
    with registry.mode.for_threads():
        latest = None if timeout == 0 else book.enter(key, me, ticket, policy, _monotonic)
    turn = Turn(registry, (key,), timeout, None)
    if latest is None:
        return call_in_turn_sync(turn, fn, args, kwargs)
    try:
        answer = _wait_sync(book, ticket, key, timeout)
        if answer is not _RUN:
            return answer
        with registry.mode.guard():
            book.start(ticket, me)
    except BaseException as problem:
        book.gave_up(ticket, problem)
        raise
    error: BaseException | None = None
    result = None
    try:
        result = call_in_turn_sync(turn, fn, args, kwargs, lined=True, since=since)
    except BaseException as problem:
        error = problem
        raise
    finally:
        book.ended(ticket, error, result)
    return result


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
                if ticket.outcome is None:
                    raise _late(book.registry, key, limit)  # type: ignore[arg-type]
        elif ticket.due is not None and now >= ticket.due and ticket.latest is not None:
            book.tick(ticket.latest)
