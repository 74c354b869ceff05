"""A turn's part on a shared backend: its grants or session, tokens, and what it re-took.

The backend's half of the turn's steps (see ``_turn``). A turn nested in
another (in the same task, or a task made in its block) sees the enclosing
turn's part as ``outer``: a key it takes again keeps the enclosing grant's
token, and on a backend with sessions it takes its keys on the enclosing
turn's connection, or draws one from the next tier (see TurnSession).
"""

from __future__ import annotations

import contextvars
import logging
import sys
from collections.abc import Awaitable, Generator, Hashable
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar, cast, final

from ._describe import describe
from ._drive import CLOSE, GRANT, RELEASE
from ._errors import LeaseLost

if TYPE_CHECKING:
    from ._latest import Ticket
    from .backends._base import (
        Backend,
        Grant,
        LatestBackend,
        LatestGrant,
        LatestSession,
        SessionBackend,
        TurnSession,
    )

#: A source of grants: a backend, or a turn's session.
S = TypeVar("S")

#: The core's logger: a turn whose lease was lost (WARNING). Nothing on a turn
#: that goes well.
logger = logging.getLogger("inturn")

#: The innermost turn of the current task on a queue with a shared backend: its part.
CURRENT: contextvars.ContextVar[Shared | None] = contextvars.ContextVar(
    "inturn_current_turn", default=None
)


@final
class Shared:
    """What a turn on a shared backend holds besides its lines."""

    __slots__ = (
        "grants",
        "holders",
        "outer",
        "owner",
        "owns",
        "session",
        "taker",
        "tokens",
        "transaction",
        "turn",
        "via",
    )

    def __init__(self, turn: object, owner: object, holder: object, transaction: bool) -> None:
        self.turn = turn  # the Turn (what current_turn() gives)
        self.owner = owner  # its queue's registry: parts of other queues' turns do not lend
        self.taker = holder  # the task or thread that takes it
        self.transaction = transaction  # keyed(transaction=True)
        self.grants: list[Grant] = []  # the backend's grants this turn took, in order
        self.tokens: dict[Hashable, int] = {}  # each key's fencing token
        self.holders: list[Shared] = []  # enclosing turns holding keys this one re-took
        self.outer = CURRENT.get()  # the enclosing turn's part, restored at the end
        self.session: TurnSession | None = None  # on a SessionBackend: the turn's
        self.owns = False  # whether this turn opened the session (else an enclosing turn did)
        self.via = False  # whether a task's backend calls go through the backend loop

    @property
    def lost(self) -> bool:
        """Whether the backend can no longer vouch for a grant of this turn (see Turn)."""
        return any(grant.lost for grant in self.grants) or any(
            enclosing.lost for enclosing in self.holders
        )

    def granted(self, key: Hashable) -> None:
        """Note the token of key's grant, the newest in grants (see _drive: GRANT)."""
        self.tokens[key] = self.grants[-1].token

    def ran(self, called: int | None, ok: bool) -> None:
        """Note on the grants what a turn of latest work shared across processes ran: when
        its work was called, and whether it returned (see LatestGrant.ran); called None: its
        work never started (nothing is noted: the turns behind it judge as if it never held)."""
        if called is None:
            return
        for grant in self.grants:
            cast("LatestGrant", grant).ran(called, ok)

    def reentered(self, key: Hashable) -> None:
        """Note the enclosing turn that holds key, taken again: its token, its lease."""
        enclosing = self.outer
        while enclosing is not None:
            if enclosing.owner is self.owner and key in enclosing.tokens:
                self.holders.append(enclosing)
                self.tokens[key] = enclosing.tokens[key]
                return
            enclosing = enclosing.outer

    def on_session(
        self, backend: Backend, taken: tuple[Hashable, ...], own: bool, ticket: Ticket | None
    ) -> Generator[tuple[int, Any], Any, None]:
        """The grants of the keys taken, on one connection for the turn (steps).

        Asked for once this process's lines are taken: a turn waiting for one
        holds no connection, and one holding a connection waits for nothing
        of this process, so a pool of them cannot deadlock (see TurnSession).
        ``own``: the session should have a connection of its own; ``ticket``:
        a conflating call's (its key is taken as latest work: see latest_line).
        """
        # (a transaction's, and latest work shared across processes, which may end its
        # connection when it gives up, have a session of their own)
        shared = ticket is not None and ticket.policy.shared
        session = None if self.transaction or shared else self._lender()
        self.owns = session is None
        if session is None:
            opener = cast("SessionBackend", backend)
            session = opener.session(len(taken), self.transaction, own, self._depth())
        self.session = session
        source = session if ticket is None else latest_line(session, ticket)
        for key in taken:
            yield GRANT, (source, key, self.grants)
            self.granted(key)

    def _lender(self) -> TurnSession | None:
        """The session of the holder's innermost enclosing turn on its queue, unless a
        transaction's. Only the holder's own: a task started inside a turn sees the turn
        as its current one too, but must not send on its connection at the same time."""
        enclosing = self.outer
        while enclosing is not None:
            if enclosing.owner is self.owner and enclosing.session is not None:
                if enclosing.transaction or enclosing.taker is not self.taker:
                    return None
                return enclosing.session
            enclosing = enclosing.outer
        return None

    def _depth(self) -> int:
        """How many sessions the enclosing turns hold (see TurnSession).

        A turn started inside them (a task made in their block, say) draws its
        connection from the next tier, so that they never hold the ones it needs.
        """
        sessions: list[TurnSession] = []
        enclosing = self.outer
        while enclosing is not None:
            session = enclosing.session
            if session is not None and not any(session is seen for seen in sessions):
                sessions.append(session)
            enclosing = enclosing.outer
        return len(sessions)

    def give_back(
        self, backend: Backend, error: BaseException | None
    ) -> Generator[tuple[int, Any], Any, Exception | None]:
        """Release the grants, newest first, or close the turn's session (steps).

        Every release is made; the first that failed is returned.
        """
        failure: Exception | None = None
        session, self.session = self.session, None
        if session is not None and self.owns:
            try:
                yield CLOSE, (session, error)
            except Exception as problem:
                failure = problem
            return failure
        for grant in reversed(self.grants):
            try:
                yield RELEASE, (session or backend, grant)  # (to the session it was taken on)
            except Exception as problem:
                failure = failure or problem
        return failure

    def ended(
        self, name: str | None, error: BaseException | None, failure: Exception | None
    ) -> tuple[BaseException | None, Exception | None]:
        """Report grants whose lease ran out; the turn's error, and the failure to raise.

        A loss with no error of the work's own is a LeaseLost (or the backend's
        failure, noted); with one, the loss is noted on it. ``name``: the queue's.
        """
        lost = [grant for grant in self.grants if grant.lost]
        if not lost:
            if failure is not None and error is None:
                error = failure
            return error, failure
        what = ", ".join(f"{describe(grant.key)} (token {grant.token})" for grant in lost)
        message = (
            f"inturn: the backend could no longer vouch for the turn on {what} while "
            "the work held it (a lease ran out, or the line's files were deleted); "
            "another process may have held the key meanwhile"
        )
        logger.warning(
            "inturn: %s%s; the work ran and %s",
            "" if name is None else f"queue {name!r}: ",
            message.removeprefix("inturn: "),
            "returned" if error is None else f"raised {type(error).__name__}",
        )
        if error is None and failure is None:
            error = failure = LeaseLost(message)
        else:
            if error is None:  # the backend's own account of what happened comes first
                error = failure
            if sys.version_info >= (3, 11):  # pragma: no branch
                cast(BaseException, error).add_note(message)
        return error, failure


@final
class LatestLine:
    """A backend's line (or a turn's session's) for a turn of latest work shared across
    processes: the source its GRANT waits on (see LatestBackend), which asks the ticket's
    book for its newest work."""

    __slots__ = ("newest", "source")

    def __init__(self, source: LatestBackend | LatestSession, ticket: Ticket) -> None:
        self.source = source
        self.newest = partial(ticket.book.newest, ticket)

    async def acquire(self, key: Hashable, timeout: float | None) -> Grant:
        return await self.source.acquire_latest(key, timeout, self.newest)

    def acquire_sync(
        self, key: Hashable, timeout: float | None, into: list[Grant] | None = None
    ) -> Grant:
        return self.source.acquire_latest_sync(key, timeout, self.newest, into)

    def release(self, grant: Grant) -> Awaitable[None]:
        """The source's release (a grant the bridge took for a caller that gave up)."""
        return self.source.release(grant)


def latest_line(source: S, ticket: Ticket) -> S | LatestLine:
    """Where a turn with ticket takes its key's grant: source (a backend, or a turn's
    session), or its line of latest work (a call whose work another process's newer work
    may replace: across="processes")."""
    if ticket.policy.shared:
        return LatestLine(cast("LatestBackend | LatestSession", source), ticket)
    return source
