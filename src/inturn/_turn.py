"""Turn: what a holder has while it holds one or more keys, its steps, and current_turn().

The protocol of a turn is written here once, as steps (generators that
yield only waits; ``_drive`` performs them for a task or a thread):
``_taking`` takes each key's line of this process in the global order
(with a backend, then its grant, or all the keys on the turn's session),
then a running slot; ``_ending`` gives them back, newest first. A take
answers True (taken now), False (wait for it) or HELD (held by this holder
already: a reentrant turn takes nothing).

The registry's fast verb ``try_take`` is called first: an uncontended turn
on one key of an untimed in-process queue yields no wait and makes no steps.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
from collections.abc import Callable, Generator, Hashable, Mapping
from inspect import isawaitable
from time import monotonic as _monotonic
from types import CoroutineType, MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, cast, final

from ._describe import describe
from ._drive import CLOSE, GRANT, LINE, RELEASE, SLOT, Steps, drive, drive_sync
from ._errors import LeaseLost
from ._hold import Clock
from ._line import HELD, held_by
from ._stats import FUNCTION, function_label
from ._tasks import loop_here, outside_asyncio
from ._threads import thread_holder

if TYPE_CHECKING:
    from ._registry import Registry
    from .backends._base import Grant, SessionBackend, TurnSession

__all__ = ("Turn", "call_in_turn", "call_in_turn_sync", "call_labelled", "current_turn")

#: The core's logger: a turn whose lease was lost (WARNING). Nothing on a turn
#: that goes well.
logger = logging.getLogger("inturn")

#: The innermost turn of the current task on a queue with a shared backend.
_CURRENT: contextvars.ContextVar[Turn | None] = contextvars.ContextVar(
    "inturn_current_turn", default=None
)


def current_turn() -> Turn | None:
    """The innermost turn the current task holds on a queue with a shared backend.

    Inside a decorated function, :meth:`~inturn.KeyedQueue.run` or
    ``keyed()`` block on a queue whose lines a backend shares between
    processes (file, Redis, PostgreSQL), this is that call's :class:`Turn`:
    its ``token`` fences writes to a downstream store, and its ``lease_lost``
    tells long work that another process may have the key by now.

    ``None`` elsewhere, including in-process queues: their turns need no
    fencing, as nothing outlives the process, and so their hot path records
    none (``async with q.keyed(k) as turn:`` still binds one).
    """
    return _CURRENT.get()


def _outcome(error: BaseException | None) -> str:
    """How a log line says how the work ended."""
    return "returned" if error is None else f"raised {type(error).__name__}"


@final
class _Parts:
    """What a turn taken by its steps holds: its keys, grants, slot, clock, start."""

    __slots__ = (
        "clock",
        "grants",
        "holders",
        "outer",
        "owns",
        "session",
        "since",
        "slot",
        "taken",
        "tokens",
        "via",
    )

    def __init__(self, since: float) -> None:
        self.taken: list[Hashable] = []  # the keys this turn took (not held already), in order
        self.slot = False  # whether it took a running slot (max_running)
        self.since = since  # when it was asked for (timed queues), then when it started
        self.clock: Clock | None = None  # max_hold, while held
        # On a shared backend:
        self.grants: list[Grant] = []  # the backend's grants this turn took, in order
        self.tokens: dict[Hashable, int] = {}  # each key's fencing token
        self.holders: list[Turn] = []  # enclosing turns holding keys this one re-took
        self.outer: Turn | None = None  # the enclosing current_turn(), restored at the end
        self.session: TurnSession | None = None  # on a SessionBackend: this turn's
        self.owns = False  # whether this turn opened the session (else an enclosing turn did)
        self.via = False  # whether a task's backend calls go through the backend loop


#: The parts of a reentrant turn on one key: it took nothing (never changed).
_NOTHING = _Parts(0.0)


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

    __slots__ = (
        "_hold",
        "_holder",
        "_parts",
        "_registry",
        "_timeout",
        "_transaction",
        "keys",
        "token",
    )

    keys: tuple[Hashable, ...]
    #: A fencing token, set on entry: larger than the token of every turn
    #: granted earlier on the same key, so a downstream store can refuse a
    #: write that carries an older one. With several keys, the token of the
    #: first (see :attr:`tokens` for each).
    token: int

    def __init__(
        self,
        registry: Registry,
        keys: tuple[Hashable, ...],
        timeout: float | None,
        hold: float | None,
        transaction: bool = False,
    ) -> None:
        self._registry = registry
        self.keys = keys
        self._timeout = timeout
        self._hold = hold  # max_hold, seconds
        # keyed(transaction=True): the work runs in a transaction on self.connection
        self._transaction = transaction
        self.token = 0
        self._holder: object = None  # the task or thread inside the block, None outside it
        # None: the one key taken by try_take alone; else what the steps took
        self._parts: _Parts | None = None

    @property
    def tokens(self) -> Mapping[Hashable, int]:
        """Each key's fencing token (all the same in process, one per key on a shared backend)."""
        parts = self._parts
        if parts is None or not parts.tokens:
            return MappingProxyType(dict.fromkeys(self.keys, self.token))
        return MappingProxyType(parts.tokens)

    @property
    def connection(self) -> Any:
        """The database connection that holds this turn's keys (``keyed(..., transaction=True)``).

        Inside the block, the work's statements on it run in the turn's
        transaction: leaving the block commits it, an exception rolls it
        back, and the keys are free for the next in line only once that has
        finished. Do not commit or close it yourself (``async with
        turn.connection.transaction():`` makes a savepoint). On
        :class:`~inturn.backends.postgres.PostgresBackend`, a
        ``psycopg.AsyncConnection`` in ``async with``, a ``psycopg.Connection``
        in a thread's ``with``.

        :raises RuntimeError: outside the block, or the turn was not taken with
            ``transaction=True``.
        """
        parts = self._parts
        if parts is None or parts.session is None or not self._transaction or self._holder is None:
            raise RuntimeError(
                "inturn: turn.connection exists inside the block of "
                "`(async) with queue.keyed(..., transaction=True)`, on a backend that "
                "takes turns in a database (PostgresBackend)"
            )
        return parts.session.connection

    @property
    def lease_lost(self) -> bool:
        """Whether the backend could no longer vouch for this turn.

        A shared backend covers each holder with a lease that a heartbeat
        renews; if it ran out (the backend was unreachable, or the process
        was frozen past it), another process may hold a key of this turn by
        now. On the file backend, the turn is lost if the line's files were
        deleted under it. Long work can check this and stop early. Always
        ``False`` in process: an in-process turn cannot be lost.
        """
        parts = self._parts
        if parts is None:
            return False
        return any(grant.lost for grant in parts.grants) or any(
            turn.lease_lost for turn in parts.holders
        )

    # -- a task's turn -----------------------------------------------------------------

    async def __aenter__(self) -> Turn:
        if self._holder is not None:
            raise RuntimeError("inturn: this keyed() turn is already entered; make one per block")
        registry = self._registry
        mode = registry.mode
        try:
            task = mode.current_task()
        except RuntimeError:
            raise outside_asyncio("keyed()") from None
        if task is None:
            raise RuntimeError("inturn: a turn can only be taken inside an asyncio task")
        loop = task.get_loop()
        if loop is not mode.solo and not mode.shared:
            mode.arrive(loop)  # (a new loop: settle how it works on the lines)
        if not registry.timed and self._hold is None and len(self.keys) == 1:
            got = registry.try_take(self.keys[0], task)  # the fast verb first
            if got is not False:
                self._holder = task
                self._parts = None if got is True else _NOTHING
                self.token = next(registry.tokens)
                return self
        await self._enter(task, _monotonic() if registry.timed else 0.0, False)
        return self

    async def _enter(self, task: asyncio.Task[Any], since: float, lined: bool) -> None:
        """Take the turn for task by its steps (asked for at since, if timed).

        ``lined``: task holds its keys' lines already (submitted work).
        """
        registry = self._registry
        parts = _Parts(since)
        backend = registry.backend
        own = False
        if backend is not None:
            via = registry.mode.via(task.get_loop())
            # A transaction's connection must be this loop's; on a loop the backend
            # does not serve directly (a loop per job), one of the turn's own.
            parts.via = via and not self._transaction
            own = via and self._transaction
        steps = self._taking(parts, task, own, lined)
        wait = next(steps, None)
        if wait is not None:
            places = (registry, registry.slots)
            await drive(steps, wait, task, places, backend, self._timeout, since, parts.via)
        self._holder = task
        self._parts = parts

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._leave_now(exc, None):
            await self._end(exc, None)

    def _leave_now(self, error: BaseException | None, result: Any) -> bool:
        """End the turn if that needs no steps (a key taken by try_take alone, or nothing).

        False if it does (see _end, _end_sync). Watchers of the key learn the
        outcome of the work: error, or result.
        """
        parts = self._parts
        if parts is None:
            holder, self._holder = self._holder, None
            self._registry.finish(self.keys[0], holder, error, result)
            return True
        if parts is _NOTHING:
            self._holder = None
            return True
        return False

    async def _end(self, error: BaseException | None, result: Any) -> None:
        """End a turn taken by its steps, whose work ended with error, or with result."""
        steps = self._ending(error, result)
        wait = next(steps, None)
        if wait is not None:
            parts, registry = self._parts, self._registry
            assert parts is not None
            holder = cast("asyncio.Task[Any]", self._holder)
            places = (registry, registry.slots)
            await drive(steps, wait, holder, places, registry.backend, None, 0.0, parts.via)

    # -- a thread's turn ---------------------------------------------------------------

    def __enter__(self) -> Turn:
        """Take the turns for this thread, blocking it while it waits (see ``KeyedQueue.keyed``)."""
        if self._holder is not None:
            raise RuntimeError("inturn: this keyed() turn is already entered; make one per block")
        if self._hold is not None:
            raise TypeError(
                f"inturn: max_hold={self._hold:g} s cannot cut a thread's turn short "
                "(a thread cannot be cancelled); take it from a task, or without max_hold"
            )
        registry = self._registry
        holder = self._holder_sync()
        if not registry.timed and len(self.keys) == 1:
            got = registry.try_take(self.keys[0], holder)  # the fast verb first
            if got is not False:
                self._holder = holder
                self._parts = None if got is True else _NOTHING
                self.token = next(registry.tokens)
                return self
        parts = _Parts(_monotonic() if registry.timed else 0.0)
        steps = self._taking(parts, holder, False, False)
        wait = next(steps, None)
        if wait is not None:
            places = (registry, registry.slots)
            drive_sync(steps, wait, holder, places, registry.backend, self._timeout, parts.since)
        self._holder = holder
        self._parts = parts
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end_sync(exc, None)

    def _end_sync(self, error: BaseException | None, result: Any) -> None:
        """End a thread's turn whose work ended with error, or with result."""
        if self._leave_now(error, result):
            return
        steps = self._ending(error, result)
        wait = next(steps, None)
        if wait is not None:
            registry = self._registry
            places = (registry, registry.slots)
            drive_sync(steps, wait, self._holder, places, registry.backend, None, 0.0)

    def _holder_sync(self) -> object:
        """Who takes a thread's turn: this thread, or a running loop's task that holds the keys.

        Inside a running event loop, only a reentrant call is possible: the
        loop's current task holds every key already, and is the holder.
        """
        registry = self._registry
        if loop_here() is not None:
            task = registry.mode.current_task()
            lines = registry.lines
            keys = self.keys
            if task is not None and all(held_by(lines.get(key), task) for key in keys):
                return task
            raise RuntimeError(
                "inturn: a blocking turn (run_sync(), `with keyed()`, a decorated plain def) "
                f"was taken inside a running event loop, for {', '.join(map(describe, keys))}; "
                "waiting would freeze the loop. Use `await queue.run(...)` or `async with`, "
                "or call it in a thread: `await asyncio.to_thread(...)`"
            )
        registry.mode.for_threads()
        return thread_holder()

    # -- the steps ---------------------------------------------------------------------

    def _taking(self, parts: _Parts, holder: object, own: bool, lined: bool) -> Steps:
        """Take each key's line (and its grant), or all on the turn's session, then a slot (steps).

        If any is not reached, what was taken is given back, newest first,
        and the turn is counted as missed. ``own``: a backend session should
        have a connection of its own (see TurnSession); ``lined``: holder holds
        the keys' lines already (submitted work, see _submit).
        """
        registry = self._registry
        backend = registry.backend
        each = backend is not None and not backend.capabilities.sessions  # a grant per key
        if backend is not None:
            parts.outer = _CURRENT.get()
        taken, tokens = parts.taken, parts.tokens
        try:
            for key in self.keys:
                got = True if lined else registry.try_take(key, holder)
                if got is HELD:  # held already by this holder (an enclosing turn): reentrant
                    if backend is not None:
                        self._reentered(parts, key)
                    continue
                if got is False:
                    yield LINE, key
                taken.append(key)
                if each:
                    grant = yield GRANT, (backend, key)
                    parts.grants.append(grant)
                    tokens[key] = grant.token
            if backend is not None and not each:
                yield from self._on_session(parts, holder, own)
            slots = registry.slots
            if slots is not None:
                got = slots.try_take(holder)
                if got is False:
                    yield SLOT, None
                parts.slot = got is not HELD
        except BaseException as error:
            registry.missed(error)
            try:
                yield from self._give_back(parts, error)
            finally:
                registry.release_all(taken, holder, error, None)
            raise
        self.token = tokens[self.keys[0]] if tokens else next(registry.tokens)
        if registry.timed:
            parts.since = registry.started(parts.since)
        if self._hold is not None and taken:
            parts.clock = Clock(cast("asyncio.Task[Any]", holder), self._hold)
        if backend is not None:
            _CURRENT.set(self)

    def _reentered(self, parts: _Parts, key: Hashable) -> None:
        """Note the enclosing turn that holds key, taken again: its token, its lease."""
        enclosing = _enclosing(parts.outer, self._registry, key)
        if enclosing is not None:
            parts.holders.append(enclosing)
            parts.tokens[key] = enclosing.tokens[key]

    def _on_session(self, parts: _Parts, holder: object, own: bool) -> Steps:
        """_taking's grants on a backend with sessions: every key taken, on one connection."""
        taken = parts.taken
        if self._transaction and not taken:
            raise _no_transaction(self.keys)
        if not taken and not self._transaction:
            return
        # One connection for the turn, asked for once this process's lines are
        # taken: a turn waiting for one holds no connection, and one holding a
        # connection waits for nothing of this process, so a pool of them
        # cannot deadlock (see TurnSession). A turn nested in another takes its
        # keys on the enclosing turn's.
        registry = self._registry
        session = None if self._transaction else _lender(parts.outer, registry, holder)
        parts.owns = session is None
        if session is None:
            backend = cast("SessionBackend", registry.backend)
            session = backend.session(len(taken), self._transaction, own, _depth(parts.outer))
        parts.session = session
        for key in taken:
            grant = yield GRANT, (session, key)
            parts.grants.append(grant)
            parts.tokens[key] = grant.token

    def _ending(self, error: BaseException | None, result: Any) -> Steps:
        """Stop the clock, release the slot, the grants (or session), then the keys (steps).

        Raises :exc:`~inturn.HoldTimeout` if max_hold cut the work;
        :exc:`~inturn.LeaseLost` if a grant's lease ran out and the work ended
        without an error of its own (with one, the loss is noted on that
        error); or the backend's error if a release failed.
        """
        parts, holder = self._parts, self._holder
        assert parts is not None
        self._holder = None
        registry = self._registry
        cut = None
        if parts.clock is not None:
            cut = parts.clock.stop(self.keys, error)
            parts.clock = None
            error = cut or error
        if parts.slot:  # first: the next work here may start meanwhile
            parts.slot = False
            assert registry.slots is not None
            registry.slots.vacate(holder)
        failure: Exception | None = None
        try:
            if registry.backend is not None:
                _CURRENT.set(parts.outer)
                failure = yield from self._give_back(parts, error)
                error, failure = self._lost(parts, error, failure)
        finally:
            registry.release_all(parts.taken, holder, error, result)
            if parts.taken:
                registry.ended(error, cut is not None, parts.since)
        if cut is not None:
            raise cut
        if failure is not None and failure is error:
            raise failure

    def _lost(
        self, parts: _Parts, error: BaseException | None, failure: Exception | None
    ) -> tuple[BaseException | None, Exception | None]:
        """Report grants whose lease ran out; the turn's error and the failure to raise."""
        lost = [grant for grant in parts.grants if grant.lost]
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
        queue = self._registry.name
        logger.warning(
            "inturn: %s%s; the work ran and %s",
            "" if queue is None else f"queue {queue!r}: ",
            message.removeprefix("inturn: "),
            _outcome(error),
        )
        if error is None and failure is None:
            error = failure = LeaseLost(message)
        elif error is None:  # the backend's own account of what happened comes first
            error = failure
            if sys.version_info >= (3, 11):  # pragma: no branch
                failure.add_note(message)  # type: ignore[union-attr]
        elif sys.version_info >= (3, 11):  # pragma: no branch
            error.add_note(message)
        return error, failure

    def _give_back(
        self, parts: _Parts, error: BaseException | None
    ) -> Generator[tuple[int, Any], Any, Exception | None]:
        """Release the grants, newest first, or close the turn's session (steps).

        Every release is made; the first that failed is returned.
        """
        failure: Exception | None = None
        session, parts.session = parts.session, None
        if session is not None and parts.owns:
            try:
                yield CLOSE, (session, error)
            except Exception as problem:
                failure = problem
            return failure
        backend = self._registry.backend
        for grant in reversed(parts.grants):
            try:
                yield RELEASE, (session or backend, grant)  # (to the session it was taken on)
            except Exception as problem:
                failure = failure or problem
        return failure

    def __repr__(self) -> str:
        if self._holder is None:
            return f"<Turn keys={describe(self.keys)} not held>"
        lost = ", lease lost" if self.lease_lost else ""
        return f"<Turn keys={describe(self.keys)} held, token {self.token}{lost}>"


async def call_in_turn(
    turn: Turn,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lined: tuple[asyncio.Task[Any], float] | None = None,
) -> Any:
    """Take turn, call fn (awaiting what it returns), end turn with the outcome; return it.

    The path of every async call that is not the facade's inlined one.
    ``lined``: the task that holds the turn's lines already, and when it
    asked for them (submitted work, see _submit).
    """
    if lined is None:
        await turn.__aenter__()
    else:
        await turn._enter(*lined, True)
    try:
        result = fn(*args, **kwargs)
        if isawaitable(result):
            result = await result
    except BaseException as error:
        if not turn._leave_now(error, None):
            await turn._end(error, None)
        raise
    if not turn._leave_now(None, result):
        await turn._end(None, result)
    return result


async def call_labelled(
    turn: Turn, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """call_in_turn, with the turn labelled by fn's name for the queue's observer."""
    token = FUNCTION.set(function_label(fn))
    try:
        return await call_in_turn(turn, fn, args, kwargs)
    finally:
        FUNCTION.reset(token)


def call_in_turn_sync(
    turn: Turn, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Take turn for this thread, call fn, release turn with the outcome; return it.

    :raises TypeError: fn returned a coroutine (closed, never run: a thread cannot await it).
    """
    turn.__enter__()
    try:
        result = fn(*args, **kwargs)
        if type(result) is CoroutineType:
            _refuse_coroutine(fn, result)
    except BaseException as error:
        turn._end_sync(error, None)
        raise
    turn._end_sync(None, result)
    return result


def _refuse_coroutine(fn: object, result: CoroutineType[Any, Any, Any]) -> NoReturn:
    result.close()
    raise TypeError(
        f"inturn: {describe(fn)} returned a coroutine, which a thread cannot await; "
        "for async def functions use `await queue.run(...)`"
    )


def _lender(turn: Turn | None, registry: Registry, holder: object) -> TurnSession | None:
    """The session of holder's innermost enclosing turn on registry, unless a transaction's.

    Only the holder's own: a task started inside a turn sees the turn as its
    current one too, but must not send on its connection at the same time.
    """
    while turn is not None:
        parts = turn._parts
        if parts is None:
            return None
        if turn._registry is registry and parts.session is not None:
            if turn._transaction or turn._holder is not holder:
                return None
            return parts.session
        turn = parts.outer
    return None


def _no_transaction(keys: tuple[Hashable, ...]) -> RuntimeError:
    """A transaction turn with no key of its own to take: nothing to run it on."""
    return RuntimeError(
        "inturn: keyed(..., transaction=True) runs its block in a transaction on the "
        f"connection that takes its keys, and {describe(keys)} are held by the turn around "
        "it already: ask for the transaction there, or add a key of this turn's own; the "
        "work did not run"
    )


def _depth(turn: Turn | None) -> int:
    """How many sessions the enclosing turns, from turn outwards, hold (see TurnSession).

    A turn started inside them (a task made in their block, say) draws its
    connection from the next tier, so that they never hold the ones it needs.
    """
    sessions: list[TurnSession] = []
    while turn is not None:
        parts = turn._parts
        if parts is None:
            break
        session = parts.session
        if session is not None and not any(session is seen for seen in sessions):
            sessions.append(session)
        turn = parts.outer
    return len(sessions)


def _enclosing(turn: Turn | None, registry: Registry, key: Hashable) -> Turn | None:
    """The enclosing turn, from turn outwards, that holds key in registry (its queue's)."""
    while turn is not None:
        parts = turn._parts
        if parts is None:
            return None
        if turn._registry is registry and key in parts.tokens:
            return turn
        turn = parts.outer
    return None
