"""What a conflating call's ticket can be, and who waits on it (see ``_latest``).

A ticket's states, and the one table of the moves between them (applied by
``Book._move`` alone: NOTE, any other move is a defect); the waiters a
ticket can have (a task's future, a thread's Parked, a handle as Data); and
the answers it can give them.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from contextvars import Context
from threading import Lock
from typing import Any, Final, Protocol, final

#: A work: its function, arguments and keyword arguments, and the context (contextvars)
#: of its call, for a turn that runs it on its caller's behalf (see Book.start).
Work = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], Context | None]
#: A ticket's answer when its work is not to run: the error or result its caller gets.
Answer = tuple[BaseException | None, Any]

#: A ticket's answer when its caller is to run: the key's line is its Latest's now.
RUN: Final = object()


class State(enum.Enum):
    """Where a ticket is (Ticket.state)."""

    NEW = "made: its turn has not asked the book yet, or took its key at once"
    WAITING = "its work waits in its Latest's tickets"
    RUNS = "its Latest was handed the key: its caller is woken to run"
    HOLDS = "its caller holds the key, and takes the rest of its turn"
    STARTED = "its turn started its work (or newer work): its caller is answered by it"
    FOLLOWS = "waits for the outcome of the work its Latest's runner runs"
    JOINED = "replaced, its work let go (a handle): follows what runs in its place"
    ANSWERED = "answered: its work did not run, or ran in another caller's turn"
    LEFT = "its caller gave up (cancelled, timed out, interrupted, or its loop closed)"


NEW, WAITING, RUNS, HOLDS, STARTED, FOLLOWS, JOINED, ANSWERED, LEFT = State

#: Every move a ticket can make (see Book._move): NOTE, any other is a defect. A turn
#: that held its key (or took it at once) is ANSWERED when newer work of another process
#: ran in its place (across="processes").
MOVES: Final = {
    NEW: frozenset({WAITING, STARTED, ANSWERED, LEFT}),
    WAITING: frozenset({RUNS, FOLLOWS, JOINED, ANSWERED, LEFT}),
    RUNS: frozenset({HOLDS, LEFT}),
    HOLDS: frozenset({STARTED, ANSWERED, LEFT}),
    FOLLOWS: frozenset({WAITING, ANSWERED, LEFT}),
    JOINED: frozenset({ANSWERED, LEFT}),
    STARTED: frozenset(),
    ANSWERED: frozenset(),
    LEFT: frozenset(),
}


class Data(Protocol):
    """A ticket that waits as data (a submission's Handle), with no caller blocked on it."""

    def handed(self, shared: bool) -> bool:
        """Its Latest was handed the key: start its turn (False: it never can)."""

    def answer(self, error: BaseException | None, result: Any) -> None:
        """Give it its answer (it did not run its own work)."""

    def let_go(self) -> None:
        """Newer work replaced it: drop its work, and follow what runs in its place."""


@final
class Parked:
    """A thread waiting on its ticket: it blocks on ``lock``, released once ``answer`` is set."""

    __slots__ = ("answer", "lock")

    def __init__(self) -> None:
        self.lock = Lock()
        self.lock.acquire()
        self.answer: object = None  # RUN, or an Answer


#: Who waits on a ticket: a task's future, a thread, or a handle.
Waiter = asyncio.Future[Any] | Parked | Data
