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
its cancellation are its caller's, as without conflation: see ``_conflate``
for the two callers, and ``_submit`` for a Handle). The others are its
followers: each ``on_superseded="join"`` caller gets its outcome, and a
``"raise"`` one was answered with :exc:`~inturn.Superseded` when it was
replaced. If the runner's work is cancelled (or interrupted) instead of
finishing, its followers' works wait again, the newest of them to run. A
replaced Handle lets its work go at once and is held weakly (``joined``): it
only follows what runs, so a burst of submissions costs the key nothing each.

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
import itertools
import weakref
from collections.abc import Callable, Hashable
from contextvars import Context
from typing import TYPE_CHECKING, Any, Final, final

from ._checks import Policy
from ._describe import describe
from ._errors import QueueClosed, QueueFull, Superseded
from ._line import Deferred, Line, held_by

if TYPE_CHECKING:
    from ._registry import Registry

#: A work: its function, arguments and keyword arguments, and the context (contextvars)
#: its caller's turn would run it in (see Book.newer).
Work = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Context | None]

# Where a ticket is (Ticket.state).
WAITING: Final = 0  # in its Latest's tickets
RUNS: Final = 1  # handed the key: its caller runs its work
_FOLLOWS: Final = 2  # waits for the runner's outcome
_LEFT: Final = 3  # gone (cancelled, timed out)
_ANSWERED: Final = 4  # answered by the book: its work did not run
_JOINED: Final = 5  # replaced, holding no work: it gets the outcome of what runs (a handle)


class Ticket:
    """One caller's work in a key's Latest: how its caller is woken and answered."""

    __slots__ = ("home", "join", "label", "latest", "seq", "state", "work")

    def __init__(self, join: bool, label: str | None, work: Work | None, home: object) -> None:
        self.join = join  # on_superseded="join"
        self.label = label  # its function, for an observer (see FUNCTION)
        self.work = work  # what it runs, while it holds it (see Book.newer)
        self.home = home  # where its work runs: its caller's event loop, None for a thread
        self.seq = 0  # when it came, in the book's order of calls (see Book.enter)
        self.latest: Latest | None = None  # the Latest it waits in
        self.state = WAITING

    def replaced(self) -> bool:
        """Newer work took this "join" caller's place: True to keep its work, which runs if
        every newer caller gives up; False to let it go and only follow what runs (a handle,
        which nothing else holds: so a burst of submissions costs the key no memory each)."""
        return True

    def run_now(self, shared: bool) -> bool:
        """The key is this caller's: wake it to run its work; False if it never can."""
        raise NotImplementedError

    def answer(self, error: BaseException | None, result: Any) -> None:
        """Give the caller its answer: its work did not run (see Book.ended, Book.supersede).

        Called under the guard: it must not wait for the queue, nor call user code.
        """
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
        "joined",
        "keeps",
        "key",
        "last",
        "line",
        "max_wait",
        "ran",
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
        self.ran: Ticket | None = None  # the follower whose work a turn runs (see Book.newer)
        # replaced callers that let their work go (see Ticket.replaced), held weakly
        self.joined: weakref.WeakSet[Ticket] | None = None
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

    __slots__ = ("calls", "open", "registry", "running")

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.open: dict[Hashable, Latest] = {}
        # The Latest whose run holds the key, from its hand-off to its end: work it
        # replaced that must wait again follows a newer run instead (see _again).
        self.running: dict[Hashable, Latest] = {}
        self.calls = itertools.count(1)  # numbers the calls in the order they come

    def callers(self, key: Hashable) -> int:
        """How many callers wait in key's open Latest beyond the one place it takes in a line."""
        latest = self.open.get(key)
        if latest is None:
            return 0
        joined = 0 if latest.joined is None else len(latest.joined)
        return len(latest.tickets) + joined - (latest.line is not None and bool(latest.tickets))

    def forked(self) -> None:
        """In a forked child: the parent's waiting callers are not this process's."""
        self.open.clear()
        self.running.clear()

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
        ticket.seq = next(self.calls)
        line = registry.lines.get(key)
        if not registry.open or (line is not None and held_by(line, holder)):
            return None
        latest = self.open.get(key)
        if latest is None:
            if policy.debounce is None and (line is None or not policy.latest):
                return None
            latest = Latest(self, key, policy, clock)
            if policy.debounce is None:
                try:
                    self._place(latest)  # (the key is busy: it waits in the line)
                except QueueFull as refused:
                    registry.tally.missed(refused)  # (counted as a turn's refusal is)
                    raise
            self.open[key] = latest
        else:
            tickets = latest.tickets
            if tickets and not tickets[-1].join:
                self.supersede(tickets.pop())
            elif tickets and not tickets[-1].replaced():
                self._join(latest, tickets.pop())
            if latest.line is None:
                latest.last = latest.clock()
                if tickets:
                    tickets[-1].arm(None)
        ticket.latest = latest
        ticket.state = WAITING
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
        error = superseded(latest.key)
        self.registry.tally.superseded(error, ticket.label)
        ticket.answer(error, None)

    def _join(self, latest: Latest, ticket: Ticket) -> None:
        """A replaced caller that let its work go follows what runs (see Ticket.replaced)."""
        ticket.state = _JOINED
        ticket.arm(None)
        if latest.joined is None:
            latest.joined = weakref.WeakSet()
        latest.joined.add(ticket)
        self.registry.tally.superseded(None, ticket.label)

    def _answer(self, latest: Latest, error: BaseException | None, result: Any) -> None:
        """Give the outcome of latest's work (or what ended it) to the callers that joined it."""
        joined, latest.joined = latest.joined, None
        for ticket in [] if joined is None else list(joined):
            ticket.state = _ANSWERED
            ticket.answer(error, result)

    def _place(self, latest: Latest, again: bool = False) -> None:
        """Put latest in its key's line (``again``: at its head, see _again); if the key is
        free, it is handed the key at once."""
        registry = self.registry
        if again:
            line = registry.requeue(latest.key, latest)
        else:  # (no Gate: concurrency is 1)
            line = registry.join(latest.key, latest, latest, None, guarded=True)  # type: ignore[assignment]
        if line is None:  # free: it holds the key, in a line of its own for abandon()
            line = latest.line = registry.lined(latest.key)
            if not self.handed(latest, registry.mode.shared):
                registry.abandon(latest.key, line, latest, guarded=True)
            return
        latest.line = line

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
            runner.state = RUNS
            if runner.run_now(shared):
                for follower in followers:
                    follower.state = _FOLLOWS
                    follower.arm(None)
                self.running[latest.key] = latest
                return True
            runner.state = _LEFT
        self._answer(latest, asyncio.CancelledError(), None)  # (their loops are closed)
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
            try:  # (closed since it came: it goes on, as waiting work does)
                self._place(latest, again=not self.registry.open)
            except QueueFull as refused:
                self._refuse(latest, refused)

    def flush(self) -> None:
        """End every quiet period now: each quiet Latest joins its line (for drain())."""
        with self.registry.mode.guard():  # (another thread may open one meanwhile)
            quiet = [latest for latest in self.open.values() if latest.line is None]
        for latest in quiet:
            self.tick(latest, now=True)

    def _refuse(self, latest: Latest, error: BaseException) -> None:
        """Answer every caller of a Latest that its line refused. Under the guard."""
        if self.open.get(latest.key) is latest:
            del self.open[latest.key]
        tickets, latest.tickets = latest.tickets, []
        for ticket in tickets:
            ticket.state = _ANSWERED
            ticket.answer(error, None)
            if not isinstance(error, QueueClosed):
                self.registry.tally.missed(error)
        self._answer(latest, error, None)

    def leave(self, ticket: Ticket, error: BaseException) -> None:
        """Take a caller that gave up (cancelled, timed out: error) out; pass on a key it was
        handed. The callers that joined a Latest nobody waits for any more get error. Under
        the guard."""
        state = ticket.state
        latest = ticket.latest
        if latest is None or state in (_LEFT, _ANSWERED):
            return
        ticket.state = _LEFT
        ticket.arm(None)
        registry = self.registry
        if state == _JOINED:
            if latest.joined is not None:
                latest.joined.discard(ticket)
        elif state == _FOLLOWS:
            latest.followers.remove(ticket)
        elif state == WAITING:
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
            self._answer(latest, error, None)
        else:  # handed the key, gone before its work started: the newest follower runs
            followers = latest.followers
            while followers:
                runner = followers.pop()
                runner.state = RUNS
                if runner.run_now(registry.mode.shared):
                    return
                runner.state = _LEFT
            assert latest.line is not None
            if self.running.get(latest.key) is latest:
                del self.running[latest.key]
            registry.abandon(latest.key, latest.line, latest, guarded=True)
            self._answer(latest, error, None)

    def waits(self, ticket: Ticket) -> bool:
        """Whether ticket's caller still waits for the key's turn (its timeout runs): its work
        waits, or it joined a Latest not handed the key yet. Under the guard."""
        latest = ticket.latest
        if ticket.state == _JOINED:
            return latest is not None and bool(latest.tickets)
        return ticket.state == WAITING

    def gave_up(self, ticket: Ticket, error: BaseException) -> None:
        """A caller's wait ended by error: unless the book answered it, it leaves (see leave),
        and a work that was still waiting counts as a missed turn."""
        with self.registry.mode.guard():
            latest = ticket.latest  # (the work a turn runs is counted as that turn)
            ran = ticket.state == _FOLLOWS and latest is not None and latest.ran is ticket
            waited = ticket.state <= _FOLLOWS and not ran  # (counted nowhere yet)
            self.leave(ticket, error)
        if waited:
            self.registry.missed(error)

    def start(self, ticket: Ticket, holder: object) -> None:
        """The runner's caller holds the key now, in its Latest's place. Under the guard."""
        latest = ticket.latest
        assert latest is not None
        self.registry.start(latest.key, latest, holder, True)

    def newer(
        self, key: Hashable, mine: Latest | None, home: object, seq: int
    ) -> tuple[Latest, Work] | None:
        """Newer work that came while a turn on key waited after taking its line (for a
        backend's grant, a running slot): it runs in that turn instead of the turn's own.

        Only work of the same home (the turn's event loop, or None: a thread's) is
        taken: a task never runs a thread's blocking work, nor a thread a task's, nor
        one loop another's. The key's open Latest leaves the line, and every caller
        of it follows the turn (its outcome is theirs: see ended), joining the
        followers of ``mine``, the Latest the turn ran from, if any. Return the
        Latest they follow and the newest work; None if no such newer work waits:
        none came after the turn's call (``seq``: see enter), or it is quiet
        (debounce). Under the guard.
        """
        latest = self.open.get(key)
        if latest is None or latest.line is None or not latest.tickets:
            return None
        newest = latest.tickets[-1]
        work = newest.work
        if work is None or newest.home is not home or newest.seq < seq:  # (older: waits again)
            return None
        del self.open[key]
        followers, latest.tickets = latest.tickets, []
        self.registry.abandon(key, latest.line, latest, guarded=True)  # (done: no ticket)
        for follower in followers:
            follower.state = _FOLLOWS
            follower.arm(None)
        if mine is None:
            latest.followers = followers
            self.running[key] = mine = latest
        else:
            self._merge(latest, mine, followers, newer=True)
        mine.ran = followers[-1]
        return mine, work

    def _merge(
        self, latest: Latest, into: Latest, followers: list[Ticket], newer: bool = False
    ) -> None:
        """Let followers and latest's joined callers go with into; followers are older than
        into's own (``newer``: newer, as the work a turn takes over and its replaced ones)."""
        for follower in followers:
            follower.latest = into
        if newer:
            into.followers += followers
        else:
            into.followers[:0] = followers
        joined, latest.joined = latest.joined, None
        if joined:
            if into.joined is None:
                into.joined = weakref.WeakSet()
            into.joined |= joined
            for ticket in joined:
                ticket.latest = into

    def ended(self, latest: Latest, error: BaseException | None, result: Any) -> None:
        """The work latest's followers follow ended: answer them with its outcome.

        If it was cancelled or interrupted rather than finished, the followers'
        works wait again (newest last), joining the key's open Latest, or a new one.
        """
        with self.registry.mode.guard():
            if self.running.get(latest.key) is latest:
                del self.running[latest.key]
            followers, latest.followers = latest.followers, []
            if followers and error is not None and not isinstance(error, Exception):
                self._again(latest, followers)
                return
            ran, latest.ran = latest.ran, None
            for follower in followers:
                follower.state = _ANSWERED
                if follower is not ran:  # (it ran in the turn: not replaced)
                    self.registry.tally.superseded(None, follower.label)
                follower.answer(error, result)
            self._answer(latest, error, result)

    def revive(self, latest: Latest) -> None:
        """The run latest's followers follow was cancelled (or interrupted) while it runs:
        they wait again now, while it still holds the key (see _again)."""
        with self.registry.mode.guard():
            followers, latest.followers = latest.followers, []
            latest.ran = None
            if followers or latest.joined:
                self._again(latest, followers)

    def _again(self, latest: Latest, followers: list[Ticket]) -> None:
        """The followers of latest, whose runner was cancelled, wait again: in the key's open
        Latest, older than the works there, or in a new one (see ended). Under the guard."""
        key = latest.key
        newer = self.running.get(key)
        if newer is not None and newer is not latest:  # a newer run: they follow it
            self._merge(latest, newer, followers)
            return
        again = self.open.get(key)
        fresh = again is None
        if again is None:
            again = Latest(self, key, Policy(latest.keeps, True, None, None), latest.clock)
        for follower in followers:
            follower.state = WAITING
        self._merge(latest, again, [])
        for follower in followers:
            follower.latest = again
        again.tickets[:0] = followers  # (older than the works waiting there)
        if fresh and again.tickets:
            self._place(again, again=True)  # (at the head: it was ahead of what came since)
            if again.keeps and again.tickets:
                self.open[key] = again
        elif fresh:
            self._answer(again, asyncio.CancelledError(), None)


def superseded(key: Hashable) -> Superseded:
    """The error of a "raise" caller whose work newer work replaced."""
    return Superseded(
        f"inturn: newer work for key {describe(key)} took this work's place "
        "(pending='latest'); this work did not run"
    )
