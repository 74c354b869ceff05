"""Latest wins: a key's one waiting work, replaced by newer work; and a trailing debounce.

With ``pending="latest"`` (a queue's, or a decorated function's), a call
whose key is busy does not wait in the key's line itself: the line holds one
:class:`Latest` for the key, as data (a Deferred), and each caller waits on
its :class:`Ticket` in it. A newer call's ticket joins the same Latest, so
the line keeps one waiting work per key however many arrive. With
``debounce``, a call first waits in a quiet Latest outside any line; every
newer call restarts the quiet period (``max_wait`` bounds it, from the
burst's first call), and when it ends the Latest takes its place in the
line: its own, or, with ``pending="latest"``, that of the key's Latest
already waiting there (its newest work replaced, as a newer call's is).

Waiting on a ticket is a wait of the turn's drivers (``_drive``: TICKET),
armed by their one Deadline; a submission's ticket waits as data, its
Handle. When the line hands a Latest the key, its newest ticket runs (its
caller's turn goes on holding the key), the others follow that run: each
``on_superseded="join"`` caller gets its outcome, a ``"raise"`` one was
answered with :exc:`~inturn.Superseded` when it was replaced. A turn that
holds its key but has not started its work runs newer work of its own
kind that came meanwhile instead (``start``). A work runs at most once.

Invariants (every change under the registry's guard):

- A ticket's state changes only in ``Book._move``, along ``_MOVES``.
- ``Book.waiting[key]`` lists the key's Latests not handed the key yet,
  in the order of their places (quiet ones last): each has a live ticket.
- A Latest's ``tickets`` are its callers whose work waits, oldest first;
  after the hand-off, ``followers`` wait for the run's outcome, and
  ``joined`` are replaced handles' tickets, which let their work go: held
  weakly (a ticket and its handle hold each other, and go together once
  nobody else holds the handle), so a burst of submissions costs the key
  nothing each.
- A run that is cut (its turn's caller cancelled or interrupted) answers
  the caller whose work ran with the cut; the followers whose work did not
  run wait again, at the head of the line, before the key is released. A
  run whose turn ends before its work started leaves all of them waiting
  again so (the newest of them runs).
"""

from __future__ import annotations

import asyncio
import itertools
import weakref
from collections.abc import Callable, Hashable
from contextvars import copy_context
from time import monotonic as _monotonic
from time import monotonic_ns as _monotonic_ns
from typing import TYPE_CHECKING, Any, final

from ._checks import Policy
from ._describe import describe
from ._errors import QueueFull, Superseded, superseded, superseded_elsewhere
from ._line import Deferred, Line, held_by
from ._tasks import in_caller_context, in_loop_of, loop_here
from ._ticket import (
    ANSWERED,
    FOLLOWS,
    HOLDS,
    JOINED,
    LEFT,
    MOVES,
    NEW,
    RUN,
    RUNS,
    STARTED,
    WAITING,
    Answer,
    Data,
    Parked,
    State,
    Waiter,
    Work,
)
from .backends._base import Replaced

if TYPE_CHECKING:
    from ._registry import Registry


@final
class Ticket:
    """One conflating call: its work, and how its caller waits and is answered."""

    __slots__ = (
        "__weakref__",
        "answer",
        "book",
        "called",
        "home",
        "join",
        "key",
        "label",
        "latest",
        "missed",
        "policy",
        "replaced",
        "seq",
        "state",
        "waiter",
        "work",
    )

    def __init__(
        self,
        book: Book,
        key: Hashable,
        policy: Policy,
        work: Work,
        label: str | None,
        home: asyncio.AbstractEventLoop | None,
        waiter: Waiter | None = None,
    ) -> None:
        self.book = book
        self.key = key
        self.policy = policy
        self.join = policy.join  # on_superseded="join"
        self.work: Work | None = work  # what it runs, while it holds it (see Book.start)
        self.label = label  # its function, for an observer (see FUNCTION)
        self.home = home  # where its work runs: its caller's event loop, None for a thread
        self.waiter = waiter  # (a task's or a thread's is made when it waits: see Book.enter)
        self.seq = next(book.calls)  # when it came, in the order of the book's calls
        # when it came on the host's clock, for latest work shared across processes
        self.called = _monotonic_ns() if policy.across else 0
        self.latest: Latest | None = None  # the Latest it waits in, or whose run it follows
        self.replaced = False  # its turn ran newer work instead of its own (see Book.start)
        self.answer: Answer | None = None  # its caller's, when its work is not to run
        self.missed = False  # it timed out, to be counted a missed turn (see Book.timed_out)
        self.state = NEW

    def outcome(self, error: BaseException | None, result: Any) -> Any:
        """What this ticket's caller gets from its turn's run that ended so.

        A run of newer work gives a ``"raise"`` caller Superseded, but for
        its own cancellation or interrupt.
        """
        if self.replaced and not self.join and (error is None or isinstance(error, Exception)):
            raise superseded(self.key)
        if error is not None:
            raise error
        return result

    def answered(self) -> Any:
        """What this ticket's caller gets when its work did not run (its answer: it followed
        newer work, or was replaced)."""
        error, result = self.answer  # type: ignore[misc]
        if error is not None:
            raise error
        return result

    def runs(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
        """What this ticket's turn runs, its work starting now (see Book.start): its own work
        (fn, args, kwargs), or the newest work it carries, in its caller's context."""
        newer = self.book.start(self)
        if newer is None:
            return fn, args, kwargs
        fn, args, kwargs, context = newer
        if context is None:
            return fn, args, kwargs
        return in_caller_context, (context, self.home, fn, *args), kwargs

    def __repr__(self) -> str:
        return f"<Ticket key={describe(self.key)} {self.state.name.lower()} #{self.seq}>"


@final
class Latest(Deferred):
    """The one waiting work of a key: in its line as data, or quiet before (see the module)."""

    __slots__ = (
        "book",
        "clock",
        "debounce",
        "first",
        "followers",
        "joined",
        "keeps",
        "key",
        "last",
        "line",
        "max_wait",
        "ran",
        "runner",
        "started",
        "tickets",
        "timer",
        "timer_loop",
    )

    def __init__(self, book: Book, key: Hashable, policy: Policy, clock: Callable[[], float]):
        self.book = book
        self.key = key
        self.keeps = policy.latest  # takes newer work while it waits in the line
        self.debounce = policy.debounce
        self.max_wait = policy.max_wait
        self.clock = clock  # the opener's (its loop's, for virtual time)
        self.first = self.last = clock()  # when it opened, when its newest work came
        self.tickets: list[Ticket] = []  # the callers whose work waits, oldest first
        self.followers: list[Ticket] = []  # after the hand-off
        self.runner: Ticket | None = None  # the newest caller, woken when it was handed the key
        self.ran: Ticket | None = None  # the ticket whose work the run runs, once started
        self.started = False  # the run started its work: followers' timeouts end
        # replaced callers that let their work go (see Data.let_go), held weakly
        self.joined: weakref.WeakSet[Ticket] | None = None
        self.line: Line | None = None  # the line it joined (None: quiet)
        self.timer: asyncio.TimerHandle | None = None  # its quiet period's, in timer_loop
        self.timer_loop: asyncio.AbstractEventLoop | None = None

    def done(self) -> bool:
        return not self.tickets

    def cancel(self) -> bool:
        return False  # (its tickets leave it one by one)

    def handed(self, shared: bool) -> bool:
        return self.book.handed(self, shared)

    def quiet_left(self) -> float:
        """Seconds until its quiet period ends (max_wait bounds it); <= 0 once over."""
        if self.debounce is None:
            return 0.0
        due = self.last + self.debounce
        if self.max_wait is not None:
            due = min(due, self.first + self.max_wait)
        return due - self.clock()

    def __repr__(self) -> str:
        where = "quiet" if self.line is None else "in line"
        return f"<Latest key={describe(self.key)} {where}, {len(self.tickets)} waiting>"


@final
class Book:
    """A queue's Latests, by key: the only writer of them and of their tickets."""

    __slots__ = ("calls", "registry", "waiting")

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.waiting: dict[Hashable, list[Latest]] = {}  # see the module's invariants
        self.calls = itertools.count(1)  # numbers the calls in the order they come

    # -- the one place a ticket moves ---------------------------------------------------

    def _move(self, ticket: Ticket, to: State) -> None:
        if to not in MOVES[ticket.state]:
            raise AssertionError(f"inturn: a ticket cannot move from {ticket.state} to {to}")
        ticket.state = to

    def _wake(self, ticket: Ticket, answer: object) -> bool:
        """Give ticket's waiter its answer (RUN, or an Answer); False if it never can take it."""
        waiter = ticket.waiter
        if type(waiter) is Parked:
            if waiter.answer is None:  # NOTE: set with the release, no call between: once
                waiter.answer = answer
                waiter.lock.release()
            return True
        if isinstance(waiter, asyncio.Future):
            return in_loop_of(waiter, _give, waiter, answer)
        data: Data = waiter  # type: ignore[assignment]
        if answer is RUN:
            return data.handed(self.registry.mode.shared)
        data.answer(*answer)  # type: ignore[misc]
        return True

    def _answer(self, ticket: Ticket, answer: Answer, count: bool) -> None:
        """Answer a ticket whose work did not run: ``count`` it as replaced (else it was).
        Again, it only wakes it again (see handed: restartable)."""
        if ticket.state is not ANSWERED:
            self._move(ticket, ANSWERED)
            if count:
                error = answer[0] if isinstance(answer[0], Superseded) else None
                self.registry.tally.superseded(error, ticket.label)
        self._wake(ticket, answer)

    # -- a call comes -------------------------------------------------------------------

    def enter(self, ticket: Ticket, holder: object, clock: Callable[[], float]) -> Latest | None:
        """Put ticket's work in its key's Latest, replacing the newest there; None: take the
        turn as usual (a free key without debounce, a key holder holds already, a closed
        queue: the usual path refuses it). Under the guard.

        :raises QueueFull: a new Latest would exceed the line's ``max_pending``.
        """
        registry = self.registry
        key, policy = ticket.key, ticket.policy
        line = registry.lines.get(key)
        if not registry.open or (line is not None and held_by(line, holder)):
            return None
        latests = self.waiting.get(key)
        latest = latests[-1] if latests else None
        if policy.debounce is not None:
            if latest is None or latest.line is not None:  # a new burst: a new quiet period
                latest = self._open(key, policy, clock)
            else:  # (every call restarts it)
                latest.last = latest.clock()
        elif latest is None or latest.line is None or not latest.keeps:
            if line is None:
                return None
            latest = self._open(key, policy, clock)
            try:
                self._place(latest)  # (the key is busy: it waits in the line)
            except QueueFull:  # (counted by the caller, as a turn's refusal is)
                self._close(latest)
                raise
        if ticket.waiter is None:  # (a task's or a thread's: it waits now)
            fn, args, kwargs, _ = ticket.work  # type: ignore[misc]
            ticket.work = (fn, args, kwargs, copy_context())  # (for Book.start)
            home = ticket.home
            ticket.waiter = Parked() if home is None else home.create_future()
        self._add(latest, [ticket])
        if latest.line is None and ticket.home is not None:
            self._arm(latest, ticket.home)
        return latest

    def _open(self, key: Hashable, policy: Policy, clock: Callable[[], float]) -> Latest:
        latest = Latest(self, key, policy, clock)
        latests = self.waiting.get(key)
        if latests is None:  # NOTE: no setdefault: an interrupt after it left an empty list
            self.waiting[key] = [latest]
        else:
            latests.append(latest)
        return latest

    def _close(self, latest: Latest) -> None:
        """Latest is handed the key, or nobody waits for it: it no longer takes calls."""
        _disarm(latest)
        latests = self.waiting.get(latest.key)
        if latests is not None and latest in latests:
            latests.remove(latest)
            if not latests:
                del self.waiting[latest.key]

    def _add(self, latest: Latest, tickets: list[Ticket]) -> None:
        """Let tickets (newer) wait in latest: its newest waiting work is replaced.

        NOTE: they join before the replaced one leaves, so that a Latest in a line
        is never empty (a hand-off would skip it), whatever an exception cuts short;
        and the replaced one is answered before it leaves (see _replaced).
        """
        waiting = latest.tickets
        newest = waiting[-1] if waiting and tickets else None
        for ticket in tickets:
            ticket.latest = latest
            if ticket.state is not WAITING:  # (else it comes from another Latest)
                self._move(ticket, WAITING)
        waiting += tickets
        if newest is not None and not (
            newest.join and isinstance(newest.waiter, asyncio.Future | Parked)
        ):  # (a task or thread that joins stays, and follows what runs)
            self._replaced(latest, newest)

    def _replaced(self, latest: Latest, ticket: Ticket) -> None:
        """ticket's work, replaced by newer work in latest, leaves it: its caller is answered
        Superseded, or a handle lets its work go and follows what runs.

        NOTE: restartable (see handed): the answer comes first, and the ticket
        leaves latest last, so that the caller whose call an exception cut short
        completes it (see _tidy), or, if it had not started, finds the replaced
        work back in its place.
        """
        if not ticket.join:
            self._answer(ticket, (superseded(latest.key), None), True)
        else:
            if ticket.state is WAITING:
                self._move(ticket, JOINED)
                self.registry.tally.superseded(None, ticket.label)
            ticket.work = None
            ticket.waiter.let_go()  # type: ignore[union-attr]
            if latest.joined is None:
                latest.joined = weakref.WeakSet()
            latest.joined.add(ticket)
        if ticket in latest.tickets:
            latest.tickets.remove(ticket)

    def _arm(self, latest: Latest, loop: asyncio.AbstractEventLoop) -> None:
        """Tick latest's quiet period in loop when it ends, unless a live timer does it.

        One timer per quiet Latest, whatever the calls: a newer call only moves
        the end, and the timer, when it goes off early, is set again (see tick).
        Threads tick it themselves (see due), and never set or cancel a loop's
        timer (a loop is not thread-safe: see _disarm).
        """
        timer, there = latest.timer, latest.timer_loop
        if timer is None or timer.cancelled() or there is None or there.is_closed():
            latest.timer = loop.call_later(max(latest.quiet_left(), 0.0), self.tick, latest)
            latest.timer_loop = loop

    def due(self, ticket: Ticket) -> float | None:
        """When a thread waiting on ticket should tick its Latest's quiet period (monotonic)."""
        latest = ticket.latest
        if ticket.state is not WAITING or latest is None or latest.line is not None:
            return None
        return _monotonic() + latest.quiet_left()

    def tick(self, latest: Latest, now: bool = False) -> None:
        """A quiet Latest whose quiet period is over takes its place in its key's line.

        ``now``: whatever its time (drain() and close() end quiet periods).
        """
        with self.registry.mode.guard():
            if latest.line is not None or not latest.tickets:
                return
            left = latest.quiet_left()
            if left > 0 and not now:  # (newer calls came: a timer that went off is set again)
                timer, there = latest.timer, loop_here()
                if timer is not None and there is latest.timer_loop and not timer.cancelled():
                    assert there is not None  # (a timer has its loop)
                    latest.timer = there.call_later(left, self.tick, latest)
                return
            latests = self.waiting[latest.key]
            before = latests[-2] if len(latests) > 1 else None
            if latest.keeps and before is not None and before.line is not None and before.keeps:
                self._add(before, list(latest.tickets))  # it takes the place of the key's
                latest.tickets = []  # Latest in line (then leaves: see _add's NOTE)
                self._close(latest)
                self._merge_joined(latest, before)
                return
            _disarm(latest)
            try:  # (closed since it came: it goes on, as waiting work does)
                self._place(latest, head=not self.registry.open)
            except QueueFull as refused:
                self._refuse(latest, refused)

    def flush(self) -> None:
        """End every quiet period now: each quiet Latest joins its line (drain(), close())."""
        with self.registry.mode.guard():  # (another thread may open one meanwhile)
            quiet = [
                latest
                for latests in self.waiting.values()
                for latest in latests
                if latest.line is None
            ]
        for latest in quiet:
            self.tick(latest, now=True)

    def _place(self, latest: Latest, head: bool = False) -> None:
        """Put latest in its key's line (``head``: at its head, see _again); if the key is
        free, it is handed the key at once."""
        registry = self.registry
        if head:
            line = registry.requeue(latest.key, latest)
        else:  # (no Gate: concurrency is 1)
            line = registry.join(latest.key, latest, latest, None, guarded=True)  # type: ignore[assignment]
        if line is None:  # free: it holds the key, in a line of its own for abandon()
            line = latest.line = registry.lined(latest.key)
            if not self.handed(latest, registry.mode.shared):
                registry.abandon(latest.key, line, latest, guarded=True)
            return
        latest.line = line

    def _refuse(self, latest: Latest, error: BaseException) -> None:
        """Answer every caller of a Latest that its line refused (QueueFull)."""
        self._close(latest)
        tickets = latest.tickets
        while tickets:  # (each answered, then taken off: see handed)
            ticket = tickets[-1]
            if ticket.state is WAITING:
                self._move(ticket, ANSWERED)
                self.registry.tally.missed(error)
            self._wake(ticket, (error, None))
            tickets.pop()
        self._answer_joined(latest, (error, None))

    # -- the key is handed ---------------------------------------------------------------

    def handed(self, latest: Latest, shared: bool) -> bool:
        """The line handed latest the key: its newest caller runs, the others follow it.

        False if no caller can take it (their loops are closed). Under the guard.
        NOTE: restartable, as the other answers given on other callers' behalf
        (_answer, _answer_joined, _refuse, ended): each step is found done or not
        from the tickets' states and lists, so a hand-off an exception cut short (one
        thrown into the thread that hands on) is completed by running it again (see
        Registry.settle_up); waking is idempotent.
        """
        runner = latest.runner
        if runner is None:
            self._close(latest)
            self._settle(latest)
            tickets = latest.tickets
            while tickets:
                runner = tickets[-1]
                if runner.state is WAITING:
                    self._move(runner, RUNS)
                if runner.state is RUNS and self._wake(runner, RUN):
                    break
                if runner.state is RUNS:  # (its loop is closed)
                    self._move(runner, LEFT)
                    self.registry.tally.missed(asyncio.CancelledError())
                tickets.pop()
            else:
                self._answer_joined(latest, (asyncio.CancelledError(), None))  # (loops closed)
                return False
            latest.runner = runner
            latest.followers, latest.tickets = tickets[:-1], []
        elif runner.state is RUNS:
            self._wake(runner, RUN)
        for follower in latest.followers:
            if follower.state is WAITING:
                self._move(follower, FOLLOWS)
        return True

    def hold(self, ticket: Ticket, holder: object) -> None:
        """ticket's caller holds the key now, in its Latest's place. Under the guard."""
        latest = ticket.latest
        assert latest is not None
        self.registry.start(latest.key, latest, holder)  # NOTE: first (see gave_up)
        self._move(ticket, HOLDS)

    def start(self, ticket: Ticket) -> Work | None:
        """ticket's turn starts its work now: None for its own; or the newest work of its
        own kind that came after its call and waits in the key's line, which it runs
        instead, its callers following this turn.

        Only work of the same home (the turn's event loop, or None: a thread's) is
        taken: a task never runs a thread's blocking work, nor a thread a task's,
        nor one loop another's.
        """
        with self.registry.mode.guard():
            found = self._newer(ticket) if ticket.policy.latest else None
            self._move(ticket, STARTED)
            latest = ticket.latest
            if latest is not None:
                latest.started = True
                latest.ran = ticket if found is None else found
            if found is None:
                return None
            ticket.replaced = True
            error = None if ticket.join else superseded(ticket.key)
            self.registry.tally.superseded(error, ticket.label)
            return found.work

    def _in_line(self, key: Hashable) -> Latest | None:
        """key's Latest waiting in its line that takes newer work, if any, settled (see
        _settle). Under the guard."""
        latests = self.waiting.get(key)
        latest = latests[-1] if latests else None
        if latest is None or latest.line is None or not latest.keeps:
            return None
        self._settle(latest)
        return latest if latest.tickets else None

    def _newest_for(self, ticket: Ticket) -> tuple[Latest, Ticket] | None:
        """The Latest and newest ticket whose work ticket's turn would run instead of its own,
        were it to start now (see start). Under the guard."""
        latest = self._in_line(ticket.key)
        if latest is None:
            return None
        newest = latest.tickets[-1]
        if newest.work is None or newest.home is not ticket.home or newest.seq < ticket.seq:
            return None  # (older: it waits again after a cut run, and runs in its own turn)
        return latest, newest

    def _newer(self, ticket: Ticket) -> Ticket | None:
        """Take the key's Latest waiting in line out of it, for ticket's turn to run its newest
        work (see start): its callers follow that turn. Under the guard."""
        found = self._newest_for(ticket)
        if found is None:
            return None
        latest, newest = found
        self._close(latest)
        followers = list(latest.tickets)
        for follower in followers:
            self._move(follower, FOLLOWS)
        mine = ticket.latest
        if mine is None:  # (its turn took the key at once: it has no followers of its own)
            ticket.latest = latest
            latest.followers = followers
        else:
            for follower in followers:
                follower.latest = mine
            mine.followers += followers  # (newer than its own: the newest last)
            self._merge_joined(latest, mine)
        latest.tickets = []  # (then it leaves its line: see _add's NOTE)
        line = latest.line
        assert line is not None  # (in line: see _in_line)
        self.registry.abandon(latest.key, line, latest, guarded=True)  # (done: skipped)
        return newest

    # -- a caller leaves, a run ends -----------------------------------------------------

    def waits(self, ticket: Ticket) -> bool:
        """Whether ticket's caller still waits for its turn (its timeout runs): its work
        waits, or the run it follows has not started. Under the guard."""
        state = ticket.state
        if state is WAITING:
            return True
        latest = ticket.latest
        return (state is FOLLOWS or state is JOINED) and latest is not None and not latest.started

    def timed_out(self, ticket: Ticket, limit: float | None) -> TimeoutError | None:
        """ticket's caller's time ran out: if it still waits (see waits), it leaves (see
        gave_up) in this same hold of the guard, and the error its caller raises is
        returned; None if its turn came. Under the guard.

        NOTE: in the same hold: a turn starting between the decision and the leaving
        would run the work of a caller that raises TimeoutError ("did not run").
        """
        if not self.waits(ticket):
            return None
        error = self.registry.too_late(ticket.key, limit, False)
        ticket.missed = self._leave(ticket)  # (for the caller's clean-up: gave_up)
        return error

    def gave_up(self, ticket: Ticket, error: BaseException) -> bool:
        """ticket's caller stopped waiting for it (cancelled, timed out, interrupted: error),
        or its turn ended before its work started: the key it was handed passes on, and the
        callers that followed it wait again. Idempotent.

        Return whether the caller counts its call as a missed turn: not if it was
        counted already (answered by the book, replaced, or its work ran in another
        caller's turn, which counts it). A ticket that timed_out already says so
        once, here.
        """
        with self.registry.mode.guard():
            if ticket.state is LEFT:
                missed, ticket.missed = ticket.missed, False  # (one step: counted once)
                return missed
            if isinstance(error, Replaced):
                self._elsewhere(ticket, error)
                return False
            return self._leave(ticket)

    def _leave(self, ticket: Ticket) -> bool:
        """gave_up's steps. Under the guard."""
        state = ticket.state
        latest = ticket.latest
        if state is ANSWERED or state is STARTED:
            return False
        self._move(ticket, LEFT)
        if state is NEW or state is WAITING:  # (NEW: an exception cut its entry short)
            if latest is not None and ticket in latest.tickets:
                latest.tickets.remove(ticket)
            self._tidy(ticket.key)
        elif latest is None:
            pass
        elif state is FOLLOWS:
            latest.followers.remove(ticket)
            return latest.ran is not ticket  # (its work runs in another caller's turn)
        elif state is JOINED:
            if latest.joined is not None:
                latest.joined.discard(ticket)
            return False  # (counted when it was replaced)
        else:  # RUNS or HOLDS: its turn came, and its work never started
            followers, latest.followers = latest.followers, []
            self._again(latest, followers)
            line = latest.line
            if line is not None and held_by(line, latest):  # (else its turn holds the
                self.registry.abandon(latest.key, line, latest, guarded=True)  # key)
        return True

    # -- latest work shared across processes (across="processes") -----------------------

    def newest(self, ticket: Ticket) -> int:
        """When the work ticket's turn would run, were it to start now, was called: its own,
        or newer work of this process (see start). A LatestBackend asks it (Newest)."""
        with self.registry.mode.guard():
            found = self._newest_for(ticket)
            return ticket.called if found is None else max(ticket.called, found[1].called)

    @staticmethod
    def ran(ticket: Ticket) -> int | None:
        """When the work ticket's turn ran (its own, or the newer one it took) was called;
        None if its turn ended before its work started (an interrupt between)."""
        if ticket.state is not STARTED:
            return None
        latest = ticket.latest
        ran = None if latest is None else latest.ran
        return ticket.called if ran is None else ran.called

    def _elsewhere(self, ticket: Ticket, replaced: Replaced) -> None:
        """ticket's turn held its key in this process, and newer work of another process ran
        in its place (the backend said so: Replaced). Its caller, the callers that followed
        it, and those of the key's Latest waiting in line if all of its work is older than
        what ran, are answered (see elsewhere), the key passing on. Under the guard.

        NOTE: restartable, as handed: each step is found done or not from the
        tickets' states and lists.
        """
        if ticket.state is not ANSWERED:  # (its caller is answered as its turn ends)
            ticket.answer = elsewhere(ticket, replaced)
            self._move(ticket, ANSWERED)
            self.registry.tally.superseded(ticket.answer[0], ticket.label)
        latest = ticket.latest
        if latest is not None:
            followers = latest.followers
            while followers:  # (each answered, then taken off)
                self._answer(followers[-1], elsewhere(followers[-1], replaced), True)
                followers.pop()
            self._answer_joined(latest, elsewhere(None, replaced))
            line = latest.line
            if line is not None and held_by(line, latest):
                self.registry.abandon(latest.key, line, latest, guarded=True)
        waiting = self._in_line(ticket.key)
        newest = None if waiting is None else waiting.tickets[-1]
        if newest is not None and newest.policy.shared and newest.called <= replaced.called:
            assert waiting is not None
            self._close(waiting)
            tickets = waiting.tickets
            while tickets:
                self._answer(tickets[-1], elsewhere(tickets[-1], replaced), True)
                tickets.pop()
            self._answer_joined(waiting, elsewhere(None, replaced))
            line = waiting.line
            assert line is not None  # (in line: see _in_line)
            self.registry.abandon(waiting.key, line, waiting, guarded=True)

    def _settle(self, latest: Latest) -> None:
        """Complete each replacement an exception cut short in latest (see _replaced): a
        ticket answered or joined, but not gone from its waiting tickets, leaves them (its
        caller woken again). Under the guard, before the tickets are read as waiting: an
        interrupted caller's clean-up comes after the guard was let go, and another thread
        may hand the Latest on or take its work meanwhile."""
        for ticket in [t for t in latest.tickets if t.state is ANSWERED or t.state is JOINED]:
            self._replaced(latest, ticket)

    def _tidy(self, key: Hashable) -> None:
        """What a caller that left leaves of key's Latests is tidied: one nobody waits in
        leaves (its line passes on), and a replaced ticket an exception kept from leaving
        leaves (answered again: see _replaced). Under the guard.

        An exception thrown into a thread (an interrupt) may cut a call's entry
        short anywhere: after its Latest opened or joined the line, before its
        ticket was in it; or as it replaced the newest work there.
        """
        for latest in list(self.waiting.get(key, ())):
            self._settle(latest)
            if latest.tickets:
                continue
            self._close(latest)
            line = latest.line
            if line is None:  # (cut short as it joined: found in the line, or not there)
                found = self.registry.lines.get(key)
                if type(found) is Line and (found.holder is latest or latest in found.waiters):
                    line = latest.line = found
            if line is not None:
                self.registry.abandon(key, line, latest, guarded=True)
            # (nothing runs in the place of the handles that let their work go)
            self._answer_joined(latest, (asyncio.CancelledError(), None))

    def ending(self, ticket: Ticket, error: BaseException | None) -> None:
        """ticket's turn ends with error, before it releases its key. If the run was cut
        (cancelled, interrupted), the followers whose work did not run wait again; if its
        work never started (an interrupt between), all of them do."""
        if ticket.state is not STARTED:
            self.gave_up(ticket, error or asyncio.CancelledError())  # (HOLDS: not counted)
            return
        latest = ticket.latest
        if latest is None or error is None or isinstance(error, Exception):
            return
        with self.registry.mode.guard():
            ran = latest.ran
            again = [follower for follower in latest.followers if follower is not ran]
            latest.followers = [follower for follower in latest.followers if follower is ran]
            self._again(latest, again)

    def ended(self, ticket: Ticket, error: BaseException | None, result: Any) -> None:
        """ticket's turn ended with this outcome: answer the callers that followed its run."""
        latest = ticket.latest
        if latest is None:
            return
        with self.registry.mode.guard():
            ran = latest.ran
            followers = latest.followers
            while followers:  # (each answered, then taken off: restartable, see handed)
                follower = followers[-1]
                if follower is ran:  # (its work ran: counted as the turn)
                    self._answer(follower, (error, result), False)
                elif follower.join:
                    self._answer(follower, (error, result), True)
                else:
                    self._answer(follower, (superseded(latest.key), None), True)
                followers.pop()
            latest.ran = None
            self._answer_joined(latest, (error, result))

    def _again(self, latest: Latest, followers: list[Ticket]) -> None:
        """followers, whose run was cut or never started, wait again at the head of the key's
        line (the newest of them to run), with the works of the key's Latest waiting in line
        if it takes newer work (they are newer). Under the guard."""
        if not followers and not latest.joined:
            return
        key = latest.key
        again = Latest(self, key, Policy(latest.keeps, True, None, None), latest.clock)
        for follower in followers:
            follower.latest = again
            self._move(follower, WAITING)
        again.tickets = followers
        self._merge_joined(latest, again)
        latests = self.waiting.setdefault(key, [])
        behind = next((other for other in latests if other.line is not None), None)
        if again.keeps and behind is not None and behind.keeps and behind.tickets:
            self._close(behind)  # (it comes to the head: its place is again's now)
            tickets, behind.tickets = behind.tickets, []
            self.registry.abandon(key, behind.line, behind, guarded=True)  # type: ignore[arg-type]
            self._add(again, tickets)
            self._merge_joined(behind, again)
        if not again.tickets:  # only handles that let their work go: nothing to run
            self._answer_joined(again, (asyncio.CancelledError(), None))
            if not latests:
                del self.waiting[key]
            return
        latests.insert(0, again)
        self._place(again, head=True)

    def _merge_joined(self, latest: Latest, into: Latest) -> None:
        joined, latest.joined = latest.joined, None
        if joined:
            if into.joined is None:
                into.joined = weakref.WeakSet()
            into.joined |= joined
            for ticket in joined:
                ticket.latest = into

    def _answer_joined(self, latest: Latest, answer: Answer) -> None:
        """Give the handles that let their work go for latest's run that answer."""
        joined = latest.joined
        if joined is not None:
            for ticket in list(joined):  # (restartable: see handed)
                self._answer(ticket, answer, False)
                joined.discard(ticket)
        latest.joined = None

    # -- looking at it ---------------------------------------------------------------------

    def callers(self, key: Hashable) -> int:
        """How many callers wait for key in its Latests beyond the places those take in its
        line (see KeyedQueue.pending)."""
        count = 0
        for latest in tuple(self.waiting.get(key, ())):
            count += len(latest.tickets) + (len(latest.joined) if latest.joined else 0)
            count -= latest.line is not None and bool(latest.tickets)
        return count

    def quiet_keys(self) -> list[Hashable]:
        """The keys of Latests in their quiet period (active, though in no line yet)."""
        return [key for key, latests in tuple(self.waiting.items()) if latests[-1].line is None]

    def forked(self) -> None:
        """In a forked child: the parent's waiting callers are not this process's."""
        self.waiting.clear()


def _disarm(latest: Latest) -> None:
    """Latest's quiet period needs its timer no more: cancelled, on its loop's thread.

    NOTE: from another thread (one that ended the period itself), the timer is
    left to go off and find nothing to do: a loop's timers are not thread-safe
    (a cancel there races the loop's count of cancelled timers, a call_later
    its heap of them).
    """
    timer = latest.timer
    if timer is not None:
        latest.timer = None
        if latest.timer_loop is loop_here():
            timer.cancel()


def _give(future: asyncio.Future[Any], answer: object) -> None:
    if not future.done():  # (its caller left)
        future.set_result(answer)


def elsewhere(ticket: Ticket | None, replaced: Replaced) -> Answer:
    """What a caller whose work newer work of another process replaced gets (ticket None: a
    handle that let its work go, which follows what runs as a "join" caller does)."""
    return superseded_elsewhere(replaced.key, ticket is None or ticket.join, replaced.ok), None
