"""Turn: what a holder has while it holds one or more keys, its steps, and current_turn().

The protocol of a turn is written here once, as steps (generators that
yield only waits; ``_drive`` performs them for a task or a thread):
``_taking`` first waits on its ticket when the call conflates (see
``_latest``), then takes each key's line of this process in the global
order (with a backend, then its grant, or all the keys on the turn's
session: see ``_shared``), then a running slot; ``_ending`` gives them back,
newest first. A key its holder holds already is not taken again (see Held).

A turn has one way in and one way out per driver: ``_enter`` (a task's:
``async with`` and every async call) and ``_enter_sync`` (a thread's), and
``_exit``/``_exit_sync``; each is sync until a wait is needed, and runs a
driver only then. The registry's fast verb ``try_take`` is called first:
an uncontended turn on one key of an untimed in-process queue yields no
wait and makes no steps. The untimed one-key wait alone in a line is the
licensed exception to the steps (``wait_alone``, once per driver).

A thread's way in and out is interrupt-safe: an exception that a signal
handler raises (or that is thrown into the thread) wherever it lands leaves
nothing of the turn behind. What the registry did when it landed is found
from the registry itself (a key taken, a waiter in line or handed the key)
and undone (see ``Registry.withdraw``), and a turn's steps record what they
are about to take before they take it.
"""

from __future__ import annotations

import asyncio
import enum
import weakref
from collections.abc import Callable, Generator, Hashable, Mapping
from contextlib import suppress
from inspect import isawaitable
from operator import attrgetter
from time import monotonic as _monotonic
from types import CoroutineType, MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final, NoReturn, cast, final

from ._checks import no_transaction
from ._describe import describe
from ._drive import (
    GRANT,
    LINE,
    SLOT,
    TICKET,
    Steps,
    drive,
    drive_sync,
    unwind_sync,
    wait_alone,
    wait_alone_sync,
)
from ._errors import blocking_in_loop, thread_cannot_await
from ._hold import Clock, start_clock
from ._latest import Ticket
from ._line import HELD, held_by
from ._shared import CURRENT, Shared, latest_line
from ._stats import FUNCTION
from ._surely import surely
from ._tasks import loop_here, loop_of, outside_asyncio
from ._threads import thread_holder
from ._ticket import RUN
from .backends._base import Replaced

if TYPE_CHECKING:
    from ._registry import Registry

#: Steps begun, and the first wait they need.
_Begun = tuple[Steps, tuple[int, Any]]


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
    shared = CURRENT.get()
    return None if shared is None else cast("Turn", shared.turn)


_SLOT: Final = object()  # (_taking waits for a running slot: see _untaking)
_NO_KEY: Final = object()  # (_taking waits for no key or slot: see _untaking)
#: Turn._holder while the turn is being entered (a second entry is refused).
_ENTERING: Final = object()
#: Turn._net unless a thread holds the turn: a callable in C that does nothing (see __del__).
_DISARMED: Final = tuple
#: What a turn whose __exit__ never ran is ended with (see _Net).
_ABANDONED: Final = KeyboardInterrupt("inturn: the turn's block was left without its __exit__")


@final
class _Net(weakref.ref):  # type: ignore[type-arg]  # (of a Turn: see __call__)
    """A thread's turn's net: ends the turn if its block was left without its __exit__.

    Armed as the thread enters (one object: a weak reference, no cycle),
    and called as the turn is finalized (see ThreadTurn), while the turn
    is still there to be ended.
    """

    __slots__ = ()

    def __call__(self) -> None:
        turn: Turn | None = weakref.ref.__call__(self)
        if turn is not None and turn._holder is not None and turn._holder is not _ENTERING:
            with suppress(BaseException):
                turn._exit_sync(None, _ABANDONED)


class _Path(enum.Enum):
    """How a turn is taken (Turn._path), but None: its one key, by try_take alone."""

    NOTHING = "a reentrant turn on one key: it took nothing"
    ALONE = "a turn alone whose key is busy (see Turn._enter_now)"
    STEPS = "a turn taken by its steps, whose parts are the Turn's _-fields"
    KEYED = "a task's stepped turn whose key the fast verb took: its steps go on from there"


_NOTHING, _ALONE, _STEPS, _KEYED = _Path.NOTHING, _Path.ALONE, _Path.STEPS, _Path.KEYED


@final
class Turn:
    """A turn on one or more keys: what :meth:`KeyedQueue.keyed` returns and binds.

    ``async with queue.keyed("acct-1", "acct-2") as turn:`` waits for the
    turn of every key, runs the block holding them all, and releases them
    when the block ends, however it ends. A turn object may be entered again
    after its block ended, but not while it is entered or being entered: a
    second entry meanwhile raises :exc:`RuntimeError` at once.

    On a queue with a shared backend, a turn that lost its lease (see
    :attr:`lease_lost`) raises :exc:`~inturn.LeaseLost` when its block ends
    without an error of its own.

    :ivar keys: the keys, each once, in the order they are taken: the queue's
        global key order, not the order the caller gave, so that two holders
        of overlapping keys never deadlock.
    """

    __slots__ = (
        "__weakref__",  # (a thread's net: see ThreadTurn)
        "_clock",
        "_hold",
        "_holder",
        "_net",
        "_path",
        "_registry",
        "_shared",
        "_since",
        "_slot",
        "_steps",
        "_taken",
        "_ticket",
        "_timeout",
        "_transaction",
        "keys",
        "token",
    )

    keys: tuple[Hashable, ...]
    # A turn taken by its steps (_STEPS) holds, set by _start: the keys it took
    # (not held already), in order; whether it took a running slot (max_running);
    # when it was asked for (timed queues), then when it started; max_hold's clock,
    # while held; its part on a shared backend; the steps, from when they begin
    # (so that an interrupt anywhere finds them: see unwind_sync).
    _taken: tuple[Hashable, ...]
    _slot: bool
    _since: float
    _clock: Clock | None
    _shared: Shared | None
    _steps: Steps | None
    # A thread's: what finalizing the turn calls (see ThreadTurn).
    _net: Callable[[], object]
    #: A fencing token, set on entry: larger than every earlier turn's on the same key.
    #: Send it with the turn's writes to a store that keeps the largest it has seen,
    #: so a holder whose turn was lost (:attr:`lease_lost`) and writes late is refused.
    #: With several keys, the token of the first (see :attr:`tokens` for each).
    token: int

    def __init__(
        self,
        registry: Registry,
        keys: tuple[Hashable, ...],
        timeout: float | None,
        hold: float | None,
        transaction: bool = False,
        ticket: Ticket | None = None,
    ) -> None:
        self._registry = registry
        self.keys = keys
        self._timeout = timeout
        self._hold = hold  # max_hold, seconds
        self._transaction = transaction  # keyed(transaction=True): see connection
        self._ticket = ticket  # a conflating call's (see _latest), on one key
        self.token = 0
        self._holder: object = None  # the task or thread inside the block, None outside it
        self._path: _Path | None = None
        self._net: Callable[[], object] = _DISARMED  # (a thread's: see ThreadTurn)

    @property
    def tokens(self) -> Mapping[Hashable, int]:
        """Each key's fencing token (all the same in process, one per key on a shared backend)."""
        shared = self._shared if self._path is _STEPS else None
        if shared is None:
            return MappingProxyType(dict.fromkeys(self.keys, self.token))
        return MappingProxyType(shared.tokens)

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
        shared = self._shared if self._path is _STEPS else None
        if shared is None or shared.session is None or not self._transaction:
            raise RuntimeError(
                "inturn: turn.connection exists inside the block of "
                "`(async) with queue.keyed(..., transaction=True)`, on a backend that "
                "takes turns in a database (PostgresBackend)"
            )
        return shared.session.connection

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
        shared = self._shared if self._path is _STEPS else None
        return shared is not None and shared.lost

    # -- a task's way in and out -------------------------------------------------------

    async def _enter(
        self,
        task: asyncio.Task[Any] | None = None,
        since: float = 0.0,
        lined: bool = False,
        holder: asyncio.Task[Any] | None = None,
    ) -> Turn:
        """Take the turn for a task: the one way in of ``async with`` and of every async call.

        ``task``: the task this runs in, if the caller knows it (and its loop
        is settled in the thread mode), else the current task; ``lined``: it
        holds the turn's lines already, asked for at ``since`` (see _taking).
        ``holder``: the fast verb (_enter_now) was called already, and did not
        take the turn for holder: call_in_turn calls it first, and makes this
        coroutine only for a wait.
        """
        me: asyncio.Task[Any] = (
            self._enter_now(task, lined) if holder is None else holder  # type: ignore[assignment]
        )
        if self._holder is _ENTERING:
            try:
                if self._path is _ALONE:
                    await wait_alone(self._registry, self.keys[0], me, self._timeout)
                    self._held(me)
                else:
                    begun = self._start(me, since, lined)
                    if begun is not None:
                        await self._drive(me, *begun)
                    self._holder = me
            except BaseException:
                self._holder = None
                raise
        return self

    __aenter__ = _enter

    async def _exit(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None = None,
        result: Any = None,
    ) -> None:
        """Leave the turn, its work ended with error or result: a task's one way out."""
        holder = self._holder
        if self._path is None and self._ticket is None:  # (_leave's first case, one call less)
            self._holder = None
            self._registry.release_one(self.keys[0], holder, error, result)
            return
        # The fast verb first (_leave: no coroutine), then its waits: call_in_turn does so too.
        begun = self._leave(error, result)
        if begun is not None:
            await self._drive(holder, *begun)  # type: ignore[arg-type]

    __aexit__ = _exit

    if not TYPE_CHECKING:  # (to a type checker, `await queue.keyed(...)` is an error as it is)

        def __await__(self) -> NoReturn:
            """Refuse ``await queue.keyed(...)``, saying how a turn is entered instead."""
            raise TypeError(
                "inturn: keyed() gives a context manager, not an awaitable: write "
                "`async with queue.keyed(...)` in a task (`with` in a thread), not `await`"
            )

    def _drive(self, task: asyncio.Task[Any], steps: Steps, wait: tuple[int, Any]) -> Any:
        """The coroutine that performs steps' waits for task, from wait on (see _drive)."""
        shared = self._shared
        via = shared is not None and shared.via
        return drive(steps, wait, task, self._registry, self._timeout, self._since, via)

    # -- a thread's way in and out ----------------------------------------------------

    def _enter_sync(self, lined: bool = False, since: float = 0.0, fn: object = None) -> Turn:
        """Take the turn for this thread, blocking it: ``with`` and every sync call's way in.

        ``lined``, ``since``: as _enter's; ``fn``: the plain function it is for (a
        decorated ``def``, run_sync()'s), which the error of a blocking call in a
        running event loop names. Interrupt-safe (see the module).
        """
        if self._holder is not None:
            self._enter_now(None, lined)  # (raises: entered already)
        if self._hold is not None:
            raise TypeError(
                f"inturn: max_hold={self._hold:g} s cannot cut a thread's turn short "
                "(a thread cannot be cancelled); take it from a task, or without max_hold"
            )
        # Who takes it: this thread; in a running event loop, a reentrant call's task only.
        registry = self._registry
        if loop_here() is None:
            if not registry.mode.shared:
                registry.mode.arrive(None)
            me: object = thread_holder()
        else:
            me = self._task_holding(fn)
        # The keys this entry may take (not held before): an interrupt gives them back.
        keys, lines = self.keys, registry.lines
        if lined:
            fresh: tuple[Hashable, ...] = ()
        elif len(keys) == 1:
            line = lines.get(keys[0])
            fresh = keys if line is None or not held_by(line, me) else ()
        else:
            fresh = tuple(key for key in keys if not held_by(lines.get(key), me))
        self._steps = None
        if type(self) is not ThreadTurn:  # (made where no thread was known: see ThreadTurn)
            self.__class__ = ThreadTurn
        self._net = _Net(self)  # NOTE: armed before it takes anything
        try:
            self._enter_now(me, lined)
            if self._holder is _ENTERING:
                if self._path is _ALONE:
                    wait_alone_sync(registry, self.keys[0], me, self._timeout)
                    self._held(me)
                else:
                    begun = self._start(me, since, lined)
                    if begun is not None:
                        drive_sync(*begun, me, registry, self._timeout, self._since)
                    self._holder = me
        except BaseException as error:
            self._undo(me, fresh, error)
            raise
        return self

    __enter__ = _enter_sync

    def _undo(self, me: object, fresh: tuple[Hashable, ...], error: BaseException) -> None:
        """Give back what a thread's entry cut short by error took, and count it (see the
        module): the whole turn, or what its steps took, or the one key taken alone; and,
        whatever an interrupt cut short, each of ``fresh`` (not held before) me holds."""
        if self._holder is me:  # (taken whole: its steps ended, or the fast verb took it)
            self._exit_sync(None, error)
            return
        self._holder = None
        registry = self._registry
        steps = self._steps
        if steps is None:
            registry.missed(error)
        else:  # (they give back what they took, count it, and raise error again)
            with suppress(BaseException):
                unwind_sync(steps, error, me, registry, self._since)
        if fresh:
            surely(registry.settle_up, fresh, me)

    def _exit_sync(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None = None,
        result: Any = None,
    ) -> None:
        """Leave the turn for this thread, its work ended with error or result: a thread's one
        way out. Interrupt-safe: what an interrupt left of the release is completed."""
        holder = self._holder
        path = self._path
        keys = self.keys if path is None else self._taken if path is _STEPS else ()
        # NOTE: disarmed right before the try, nothing between: where an interrupt may land
        # before it (3.10 checks at every jump taken, as of this `if`), the net ends the turn.
        self._net = _DISARMED
        try:
            if path is None and self._ticket is None:  # (_leave's first case, one call less)
                self._holder = None
                self._registry.release_one(keys[0], holder, error, result)
                return
            self._steps = None
            begun = self._leave(error, result)
            if begun is not None:
                drive_sync(*begun, holder, self._registry, self._timeout, self._since)
        except BaseException as problem:
            steps: Steps | None = self._steps
            if steps is not None:  # (they end the turn, and raise problem again)
                with suppress(BaseException):
                    unwind_sync(steps, problem, holder, self._registry, self._since)
            surely(self._settle_up, keys, holder, error, result)
            raise

    __exit__ = _exit_sync

    def _settle_up(
        self, keys: tuple[Hashable, ...], holder: object, error: BaseException | None, result: Any
    ) -> None:
        """Complete a thread's exit that an interrupt cut short (idempotent)."""
        ticket = self._ticket
        if ticket is not None:
            ticket.book.ending(ticket, error)
        if self._path is _STEPS and self._slot:  # (the flag goes once the slot surely did)
            self._registry.slots.vacated(holder)  # type: ignore[union-attr]
            self._slot = False
        self._registry.settle_up(keys, holder)
        if ticket is not None:
            ticket.book.ended(ticket, error, result)

    def _task_holding(self, fn: object) -> object:
        """Inside a running event loop: the loop's current task, if it holds every key already.

        :raises RuntimeError: it does not (a blocking wait would freeze the loop).
        """
        registry = self._registry
        task = registry.mode.current_task()
        lines = registry.lines
        keys = self.keys
        if task is not None and all(held_by(lines.get(key), task) for key in keys):
            return task
        raise blocking_in_loop(keys, fn)

    # -- entering and leaving: sync until a wait is needed ---------------------------------

    def _enter_now(self, holder: object, lined: bool) -> object:
        """Who takes this turn; the turn taken at once by the registry's fast verb, if it can be.

        ``holder``: a thread's, or the task when the caller knows it; None: the
        current task, whose loop is then settled in the thread mode. A turn
        alone (untimed, one key, in process: no steps, nothing allocated) is
        taken by the fast verb if its key is free or held by holder already
        (``_holder`` is set), else it is ``_ALONE`` (the caller waits in the
        key's line alone: see wait_alone), or ``_STEPS`` if it conflates (it
        waits on its ticket: see _taking). A task's stepped turn on one key
        in process (timed, max_hold, max_running: see _seat_now) takes its
        key by the fast verb too, then a free slot, its token and clock
        (``_STEPS``, held); if no slot is free, ``_KEYED`` (its steps go on
        from the key). Any other, ``_STEPS``. Until it is held, ``_holder``
        is ``_ENTERING``.

        :raises RuntimeError: the turn is entered, or being entered, already.
        """
        if self._holder is not None:
            raise RuntimeError(
                "inturn: this keyed() turn is already entered (or being entered); "
                "make one per block"
            )
        registry = self._registry
        if holder is None:
            mode = registry.mode
            try:
                holder = mode.current_task()
            except RuntimeError:
                raise outside_asyncio("keyed()") from None
            if holder is None:
                raise RuntimeError("inturn: a turn can only be taken inside an asyncio task")
            if loop_of(holder) is not mode.solo:
                mode.settle(loop_of(holder))
        self._holder = _ENTERING
        ticket = self._ticket
        if registry.timed or self._hold is not None:  # stepped
            self._path = _STEPS
            if (
                len(self.keys) == 1
                and ticket is None
                and not lined
                and registry.backend is None
                and type(self) is Turn
                and registry.try_take(self.keys[0], holder) is True  # the fast verb first
            ):
                self._seat_now(holder)  # (HELD: reentrant; False: busy. Its steps go on)
            return holder
        if len(self.keys) != 1 or (ticket is not None and ticket.policy.debounce is not None):
            self._path = _STEPS
            return holder
        got = True if lined else registry.try_take(self.keys[0], holder)  # the fast verb first
        if got is False:
            self._path = _ALONE if ticket is None else _STEPS  # (busy: it waits)
            return holder
        self._path = None if got is True else _NOTHING  # (HELD: reentrant, took nothing)
        self.token = next(registry.tokens)
        self._holder = holder
        return holder

    def _seat_now(self, holder: object) -> None:
        """Seat a task's stepped turn, whose key the fast verb just took, if no wait is needed.

        A free slot (max_running), then _seated: the turn is held. Else
        ``_KEYED``: its steps go on from the key (see _start). What fails
        here gives the key (and slot) back, as its steps would (_untaking).
        """
        registry = self._registry
        self._fresh(0.0)
        slots = registry.slots
        waited: object = _SLOT
        try:
            if slots is not None:
                got = slots.try_take(holder)
                if got is False:
                    self._path = _KEYED
                    return
                self._slot = got is not HELD
            waited = _NO_KEY
            self._seated(holder, self.keys)
            self._holder = holder  # NOTE: last, with no call after: the turn is held
        except BaseException as error:
            next(self._untaking(holder, self.keys, waited, error), None)  # (in process: no wait)
            raise

    def _fresh(self, since: float) -> None:
        """A taking's start: nothing taken yet, asked for at since (0: now, if timed)."""
        self._since = since or (_monotonic() if self._registry.timed else 0.0)
        self._taken = ()
        self._slot = False
        self._clock = None
        self._shared = None

    def _seated(self, holder: object, taken: tuple[Hashable, ...]) -> None:
        """The end of a taking (_taking's, _seat_now's): the turn's token, its start counted
        (timed), its clock started (max_hold), its session current. The caller then
        marks it held, with no call after (see _untaking)."""
        registry = self._registry
        shared = self._shared
        self._taken = taken
        self.token = (
            shared.tokens[self.keys[0]] if shared and shared.tokens else next(registry.tokens)
        )
        if registry.timed and taken:  # (a reentrant turn is part of the outer one)
            self._since = registry.started(self._since)
        if self._hold is not None and taken:
            self._clock = start_clock(holder, self._hold)  # type: ignore[arg-type]
        if shared is not None:
            CURRENT.set(shared)

    def _held(self, holder: object) -> None:
        """The turn is holder's: its one key, waited for alone (see _enter_now), is taken."""
        self._path = None
        self.token = next(self._registry.tokens)
        self._holder = holder

    def _start(self, holder: object, since: float, lined: bool) -> _Begun | None:
        """Take the turn for holder by its steps, as far as they go without a wait.

        None once it is held; else the steps and their first wait. ``since``:
        when it was asked for (0: now); ``lined``: see _taking.
        """
        registry = self._registry
        if self._path is _KEYED:  # (its key taken by the fast verb: see _seat_now)
            self._path = _STEPS
            lined = True
        self._fresh(since)
        own = False
        if registry.backend is not None:
            shared = self._shared = Shared(self, registry, holder, self._transaction)
            if isinstance(holder, asyncio.Task):
                via = registry.mode.via(loop_of(holder))
                # A transaction's connection must be this loop's; on a loop the backend
                # does not serve directly (a loop per job), one of the turn's own.
                shared.via = via and not self._transaction
                own = via and self._transaction
        steps = self._steps = self._taking(holder, own, lined)
        wait = next(steps, None)  # (up to the first wait)
        return None if wait is None else (steps, wait)

    def _leave(self, error: BaseException | None, result: Any) -> _Begun | None:
        """End the turn (the work ended with error, or with result) as far as it goes without
        a wait; None once it ended, else the steps and their first wait."""
        path = self._path
        if path is _STEPS:
            steps = self._steps = self._ending(error, result)
            wait = next(steps, None)  # (up to the first wait)
            return None if wait is None else (steps, wait)
        holder, self._holder = self._holder, None
        ticket = self._ticket
        if ticket is not None:
            ticket.book.ending(ticket, error)
        if path is None:  # one key, taken by try_take alone
            self._registry.release_one(self.keys[0], holder, error, result)
        if ticket is not None:
            ticket.book.ended(ticket, error, result)
        return None

    # -- the steps ---------------------------------------------------------------------

    def _taking(self, holder: object, own: bool, lined: bool) -> Steps:
        """Wait on the call's ticket if it conflates, then take each key's line (and its
        grant), or all on the turn's session, then a slot (steps).

        If any is not reached, what was taken is given back, newest first,
        and the turn is counted as missed. ``own``: a backend session should
        have a connection of its own (see TurnSession); ``lined``: holder holds
        the keys' lines already (submitted work, see _submit).
        """
        registry = self._registry
        backend = registry.backend
        shared = self._shared
        each = shared is not None and not backend.capabilities.sessions  # type: ignore[union-attr]
        taken: tuple[Hashable, ...] = ()
        # The key (or _SLOT) being taken or waited for: NOTE, set before the take, so that
        # an interrupt finds it (see _untaking); a key held before is never set.
        waited: object = _NO_KEY
        slots = registry.slots
        ticket = self._ticket
        try:
            if ticket is not None and not lined:
                waited = self.keys[0]
                answer = yield from self._waiting_on(ticket, holder)
                if answer is not None and answer is not RUN:  # (its work is not to run)
                    ticket.answer = answer  # type: ignore[assignment]
                    return
                lined = answer is RUN
                waited = _NO_KEY
            for number, key in enumerate(self.keys):
                if not lined and held_by(registry.lines.get(key), holder):
                    got: object = HELD  # held already by this holder (an enclosing turn)
                else:
                    waited = key
                    # (once it took or waits for a key, a turn goes on if the queue closes)
                    got = True if lined else registry.try_take(key, holder, number > 0)
                if got is HELD:  # reentrant
                    if shared is not None:
                        shared.reentered(key)
                    continue
                if got is False:
                    yield LINE, (key, number > 0)
                taken += (key,)
                waited = _NO_KEY
                if each:
                    source = backend if ticket is None else latest_line(backend, ticket)
                    yield GRANT, (source, key, shared.grants)  # type: ignore[union-attr]
                    shared.granted(key)  # type: ignore[union-attr]
            if shared is not None and not each:
                if self._transaction and not taken:
                    raise no_transaction(self.keys)  # noqa: TRY301
                if taken or self._transaction:
                    yield from shared.on_session(backend, taken, own, ticket)  # type: ignore[arg-type]
            if slots is not None:
                waited = _SLOT
                got = slots.try_take(holder)
                if got is False:
                    yield SLOT, self.keys  # (the keys: for the error if it is not reached)
                self._slot = got is not HELD
                waited = _NO_KEY
            self._seated(holder, taken)
            self._holder = holder  # NOTE: last, with no call after: the turn is held
        except BaseException as error:
            yield from self._untaking(holder, taken, waited, error)
            if isinstance(error, Replaced) and ticket is not None and ticket.answer is not None:
                return  # (newer work of another process ran: its callers are answered)
            raise

    def _waiting_on(
        self, ticket: Ticket, holder: object
    ) -> Generator[tuple[int, Any], Any, object]:
        """Put a conflating call's work in its key's Latest and wait on its ticket (steps).

        Return RUN once holder holds the key in the Latest's place; the answer
        its caller gets instead of running its work; or None, if it takes the
        key as usual (a free key without debounce: see Book.enter).
        """
        registry = self._registry
        clock = loop_of(holder).time if isinstance(holder, asyncio.Task) else _monotonic
        with registry.mode.guard():
            latest = ticket.book.enter(ticket, holder, clock)
        if latest is None:
            return None
        answer = yield TICKET, ticket
        if answer is RUN:
            with registry.mode.guard():
                ticket.book.hold(ticket, holder)
        return answer

    def _untaking(
        self, holder: object, taken: tuple[Hashable, ...], waited: object, error: BaseException
    ) -> Steps:
        """Give back what _taking took, and count the turn as missed (steps).

        The key or slot being taken or waited for is given back too if it is
        found held: an interrupt came after the take or the wait ended. A
        conflating call's ticket leaves its Latest first (passing on a key it
        was handed, and letting its followers wait again: see Book.gave_up).
        """
        registry = self._registry
        ticket = self._ticket
        counted = False  # (a conflating call may be counted already: see Book.gave_up)
        if ticket is not None:
            counted = not ticket.book.gave_up(ticket, error)
        if waited is _SLOT:
            self._slot = holder in registry.slots.holders  # type: ignore[union-attr]
        elif waited is not _NO_KEY and held_by(registry.lines.get(waited), holder):
            taken += (waited,)
        try:
            if self._slot:
                registry.slots.vacate(holder)  # type: ignore[union-attr]
                self._slot = False  # NOTE: after (vacate is idempotent)
            shared = self._shared
            if shared is not None:
                CURRENT.set(shared.outer)  # (set as the turn was held: an interrupt came after)
                yield from shared.give_back(registry.backend, error)  # type: ignore[arg-type]
        finally:
            self._taken = ()
            registry.release(taken, holder, error, None, None, counted=counted)

    def _ending(self, error: BaseException | None, result: Any) -> Steps:
        """Stop the clock, release the slot, the grants (or session), then the keys (steps).

        A conflating call's followers wait again first if its run was cut,
        and are answered once the keys are released (see Book.ending, ended).
        Raises :exc:`~inturn.HoldTimeout` if max_hold cut the work; else, as
        Shared.ended decides, LeaseLost or the error of a failed release.
        """
        holder, self._holder = self._holder, None
        registry = self._registry
        cut = None
        clock = self._clock
        if clock is not None:
            self._clock = None
            cut = clock.stop(self.keys, error)
            error = cut or error
        ticket = self._ticket
        if ticket is not None:
            ticket.book.ending(ticket, error)
        if self._slot:  # first: the next work here may start meanwhile
            registry.slots.vacate(holder)  # type: ignore[union-attr]
            self._slot = False  # NOTE: after (vacate is idempotent: see _settle_up)
        shared = self._shared
        failure: Exception | None = None
        try:
            if shared is not None:
                CURRENT.set(shared.outer)
                if ticket is not None and ticket.policy.shared:
                    shared.ran(ticket.book.ran(ticket), error is None)  # (before the release)
                failure = yield from shared.give_back(registry.backend, error)  # type: ignore[arg-type]
                error, failure = shared.ended(registry.name, error, failure)
        finally:
            if self._taken:
                taken, self._taken = self._taken, ()
                registry.release(taken, holder, error, result, self._since, cut is not None)
            if ticket is not None:
                ticket.book.ended(ticket, error, result)
        if cut is not None:
            raise cut
        if failure is not None and failure is error:
            raise failure

    def __repr__(self) -> str:
        if self._holder is None:
            return f"<Turn keys={describe(self.keys)} not held>"
        lost = ", lease lost" if self.lease_lost else ""
        return f"<Turn keys={describe(self.keys)} held, token {self.token}{lost}>"


@final
class ThreadTurn(Turn):  # type: ignore[misc]  # (Turn is final to users; this is its thread's)
    """A turn taken by a thread (``with``, a sync call): a Turn with a net under its block.

    A signal handler's exception (or one thrown into the thread) that lands
    at the very start of ``__exit__``, before any of its code runs, leaves
    the turn held with nobody to end it. The turn object goes then (once the
    exception and its traceback go), and its net ends it (see _Net).

    ``keyed()`` makes a Turn, as it cannot tell whether a ``with`` or an
    ``async with`` will enter it (asking whether an event loop runs here
    costs a system call on CPython 3.10 and 3.11); a thread's entry makes it
    a ThreadTurn (``__class__``: the same slots, so the same layout), a sync
    call makes one at once.
    """

    __slots__ = ()

    # NOTE: finalizing a turn runs no Python code unless its net is armed: this reads the
    # _net slot (in C) and calls what it holds, _DISARMED (in C), or the net (Python, then
    # only). A __del__ written in Python would run at every turn's end, where a signal's
    # exception would be lost ("Exception ignored in __del__"). A task's turn has none.
    __del__ = property(attrgetter("_net"))


async def call_in_turn(
    turn: Turn,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    task: asyncio.Task[Any] | None = None,
    since: float = 0.0,
    lined: bool = False,
    label: str | None = None,
) -> Any:
    """Take turn, call fn (awaiting what it returns), end turn with the outcome; return it.

    The path of every async call that is not the facade's inlined one.
    ``task``, ``since``, ``lined``: as Turn._enter's; ``label``: fn's name
    for the queue's observer (see FUNCTION), around the whole turn. A
    conflating call (the turn's ticket) may be answered without running fn,
    or run newer work in its turn instead (see _latest).
    """
    token = None if label is None else FUNCTION.set(label)
    try:
        # As turn._enter and turn._exit, with no coroutine of theirs where no wait is needed.
        holder = turn._enter_now(task, lined)
        if turn._holder is _ENTERING:
            await turn._enter(task, since, lined, holder)  # type: ignore[arg-type]
        ticket = turn._ticket
        if ticket is not None and ticket.answer is not None:  # (its work is not to run)
            return ticket.answered()
        try:
            if ticket is not None:
                fn, args, kwargs = ticket.runs(fn, args, kwargs)
            result = fn(*args, **kwargs)
            if type(result) is CoroutineType or (result is not None and isawaitable(result)):
                result = await result
        except BaseException as error:
            await turn._exit(None, error)
            if ticket is None:
                raise
            return ticket.outcome(error, None)
        holder = turn._holder
        begun = turn._leave(None, result)
        if begun is not None:
            await turn._drive(holder, *begun)  # type: ignore[arg-type]
        return result if ticket is None else ticket.outcome(None, result)
    finally:
        if token is not None:
            FUNCTION.reset(token)


def call_in_turn_sync(
    turn: Turn,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    lined: bool = False,
    since: float = 0.0,
) -> Any:
    """Take turn for this thread, call fn, release turn with the outcome; return it.

    ``lined``, ``since``: as call_in_turn's, and a conflating call as there.

    :raises TypeError: fn returned a coroutine (closed, never run: a thread cannot await it).
    """
    ticket = turn._ticket
    try:  # NOTE: the entry in it: an interrupt as the entry returns ends the turn (3.10)
        turn._enter_sync(lined, since, fn)
        answer = None if ticket is None else ticket.answer
        if answer is None:
            if ticket is not None:
                fn, args, kwargs = ticket.runs(fn, args, kwargs)
            result = fn(*args, **kwargs)
            if type(result) is CoroutineType:
                raise thread_cannot_await(fn, result)  # noqa: TRY301 - its turn ends below
    except BaseException as error:
        if turn._holder is None:  # (its entry failed, and gave back what it took)
            raise
        turn._exit_sync(None, error)
        if ticket is None:
            raise
        return ticket.outcome(error, None)
    if answer is not None and ticket is not None:  # (its work was not to run)
        return ticket.answered()
    turn._exit_sync(None, None, None, result)
    return result if ticket is None else ticket.outcome(None, result)
