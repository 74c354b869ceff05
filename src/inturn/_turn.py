"""Turn: what a holder has while it holds one or more keys, its steps, and current_turn().

The protocol of a turn is written here once, as steps (generators that
yield only waits; ``_drive`` performs them for a task or a thread):
``_taking`` takes each key's line of this process in the global order
(with a backend, then its grant, or all the keys on the turn's session:
see ``_shared``), then a running slot; ``_ending`` gives them back, newest
first. A key its holder holds already is not taken again (see Held).

The registry's fast verb ``try_take`` is called first: an uncontended turn
on one key of an untimed in-process queue yields no wait and makes no steps.
Entering and leaving are sync until a wait is needed; only then is a
driver run.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Hashable, Mapping
from inspect import isawaitable
from time import monotonic as _monotonic
from types import CoroutineType, MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, Final, NoReturn, cast, final

from ._checks import no_transaction
from ._describe import describe
from ._drive import (
    GRANT,
    LINE,
    SLOT,
    Steps,
    drive,
    drive_sync,
    give_up,
    line_up,
    seated,
    unwind_sync,
    wait_alone,
    wait_alone_sync,
)
from ._errors import blocking_in_loop
from ._hold import Clock, start_clock
from ._line import HELD, held_by
from ._shared import CURRENT, Shared
from ._stats import FUNCTION
from ._tasks import loop_here, loop_of, outside_asyncio
from ._threads import thread_holder

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


class _Path(enum.Enum):
    """How a turn is taken (Turn._path), but None: its one key, by try_take alone."""

    NOTHING = "a reentrant turn on one key: it took nothing"
    ALONE = "a turn alone whose key is busy (see Turn._enter_now)"
    STEPS = "a turn taken by its steps, whose parts are the Turn's _-fields"


_NOTHING, _ALONE, _STEPS = _Path.NOTHING, _Path.ALONE, _Path.STEPS


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

    :ivar keys: the keys, each once, in the order they are taken: the queue's
        global key order, not the order the caller gave, so that two holders
        of overlapping keys never deadlock.
    """

    __slots__ = (
        "_clock",
        "_hold",
        "_holder",
        "_path",
        "_registry",
        "_shared",
        "_since",
        "_slot",
        "_taken",
        "_timeout",
        "_transaction",
        "keys",
        "token",
    )

    keys: tuple[Hashable, ...]
    # A turn taken by its steps (_STEPS) holds, set by _start: the keys it took
    # (not held already), in order; whether it took a running slot (max_running);
    # when it was asked for (timed queues), then when it started; max_hold's clock,
    # while held; its part on a shared backend.
    _taken: tuple[Hashable, ...]
    _slot: bool
    _since: float
    _clock: Clock | None
    _shared: Shared | None
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
    ) -> None:
        self._registry = registry
        self.keys = keys
        self._timeout = timeout
        self._hold = hold  # max_hold, seconds
        self._transaction = transaction  # keyed(transaction=True): see connection
        self.token = 0
        self._holder: object = None  # the task or thread inside the block, None outside it
        self._path: _Path | None = None

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

    # -- a task's turn -----------------------------------------------------------------

    async def __aenter__(self) -> Turn:
        task: asyncio.Task[Any] = self._enter_now(None)  # type: ignore[assignment]
        if self._holder is None:
            if self._path is _ALONE:  # (awaited in this frame: see line_up)
                registry, key, timeout = self._registry, self.keys[0], self._timeout
                queued = line_up(registry, key, task, timeout, timeout, registry)
                if queued is not None:
                    try:
                        await queued[1]
                    except BaseException as error:
                        give_up(registry, key, queued, error, registry)
                        raise
                    seated(registry, key, task, queued)
                self._held_alone(task)
            else:
                begun = self._start(task, 0.0, False)
                if begun is not None:
                    await self._drive(task, *begun)
                self._holder = task
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        holder = self._holder
        if self._path is None:  # (_leave's first case, one call less: keyed()'s hot path)
            self._holder = None
            self._registry.finish(self.keys[0], holder, exc, None)
            return
        begun = self._leave(exc, None)
        if begun is not None:
            await self._drive(holder, *begun)  # type: ignore[arg-type]

    if not TYPE_CHECKING:  # (to a type checker, `await queue.keyed(...)` is an error as it is)

        def __await__(self) -> NoReturn:
            """Refuse ``await queue.keyed(...)``, saying how a turn is entered instead."""
            raise TypeError(
                "inturn: keyed() gives a context manager, not an awaitable: write "
                "`async with queue.keyed(...)` in a task (`with` in a thread), not `await`"
            )

    def _enter_now(self, holder: object, lined: bool = False) -> object:
        """Who takes this turn; the turn taken at once by the registry's fast verb, if it can be.

        ``holder``: a thread's, or the task when the caller knows it; None: the
        current task, whose loop is then settled in the thread mode; ``lined``:
        see _taking. A turn alone (untimed, one key, in process: no steps,
        nothing allocated) is taken by the fast verb if its key is free or held
        by holder already (``_holder`` is set), else it is ``_ALONE`` (the caller
        waits in the key's line alone: see wait_alone); any other, ``_STEPS``.
        """
        registry = self._registry
        if holder is None:
            if self._holder is not None:
                raise RuntimeError(
                    "inturn: this keyed() turn is already entered; make one per block"
                )
            mode = registry.mode
            try:
                holder = mode.current_task()
            except RuntimeError:
                raise outside_asyncio("keyed()") from None
            if holder is None:
                raise RuntimeError("inturn: a turn can only be taken inside an asyncio task")
            if loop_of(holder) is not mode.solo:
                mode.settle(loop_of(holder))
        if registry.timed or self._hold is not None or len(self.keys) != 1:
            self._path = _STEPS
            return holder
        got = True if lined else registry.try_take(self.keys[0], holder)  # the fast verb first
        if got is False:
            self._path = _ALONE  # (busy: the caller waits in the key's line, alone)
            return holder
        self._path = None if got is True else _NOTHING  # (HELD: reentrant, took nothing)
        self.token = next(registry.tokens)
        self._holder = holder
        return holder

    def _held_alone(self, holder: object) -> None:
        """The turn is holder's: its one key, waited for alone (see _enter_now), is taken."""
        self._path = None
        self.token = next(self._registry.tokens)
        self._holder = holder

    def _drive(self, task: asyncio.Task[Any], steps: Steps, wait: tuple[int, Any]) -> Any:
        """The coroutine that performs steps' waits for task, from wait on (see _drive)."""
        shared = self._shared
        via = shared is not None and shared.via
        return drive(steps, wait, task, self._registry, self._timeout, self._since, via)

    # -- a thread's turn ---------------------------------------------------------------

    def __enter__(self) -> Turn:
        """Take the turns for this thread, blocking it while it waits (see ``KeyedQueue.keyed``)."""
        return self._enter_sync(False, 0.0)

    def _enter_sync(self, lined: bool, since: float, fn: object = None) -> Turn:
        """__enter__; ``lined``: this thread holds the key's line already, asked for at
        ``since`` (conflated work handed the key: see _latest)."""
        if self._holder is not None:
            raise RuntimeError("inturn: this keyed() turn is already entered; make one per block")
        if self._hold is not None:
            raise TypeError(
                f"inturn: max_hold={self._hold:g} s cannot cut a thread's turn short "
                "(a thread cannot be cancelled); take it from a task, or without max_hold"
            )
        # Who takes it: this thread; in a running event loop, a reentrant call's task only.
        if loop_here() is None:
            mode = self._registry.mode
            if not mode.shared:
                mode.arrive(None)
            me = self._enter_now(thread_holder(), lined)
        else:
            me = self._enter_now(self._task_holding(fn))
        if self._holder is None:
            if self._path is _ALONE:
                wait_alone_sync(self._registry, self.keys[0], me, self._timeout)
                self._path = None  # (_held_alone, inlined: no call to be interrupted at)
                self.token = next(self._registry.tokens)
                self._holder = me
            else:
                begun = self._start(me, since, lined)
                if begun is not None:  # (in one frame with begun: see unwind_sync)
                    try:
                        drive_sync(*begun, me, self._registry, self._timeout, self._since)
                    except BaseException as error:
                        unwind_sync(begun[0], error, me, self._registry, self._since)
                        raise
                self._holder = me
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._path is None:  # (_leave's first case, two calls less: a thread's hot path)
            holder, self._holder = self._holder, None
            self._registry.finish(self.keys[0], holder, exc, None)
        else:
            self._end_sync(exc, None)

    def _end_sync(self, error: BaseException | None, result: Any) -> None:
        """End a thread's turn whose work ended with error, or with result."""
        holder = self._holder
        begun = self._leave(error, result)
        if begun is not None:  # (as in __enter__)
            try:
                drive_sync(*begun, holder, self._registry, self._timeout, self._since)
            except BaseException as problem:
                unwind_sync(begun[0], problem, holder, self._registry, self._since)
                raise

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

    def _start(self, holder: object, since: float, lined: bool) -> _Begun | None:
        """Take the turn for holder by its steps, as far as they go without a wait.

        None once it is held; else the steps and their first wait. ``since``:
        when it was asked for (0: now); ``lined``: see _taking.
        """
        registry = self._registry
        self._since = since or (_monotonic() if registry.timed else 0.0)
        self._taken = ()
        self._slot = False
        self._clock = None
        self._shared = None
        own = False
        if registry.backend is not None:
            shared = self._shared = Shared(self, registry, holder, self._transaction)
            if isinstance(holder, asyncio.Task):
                via = registry.mode.via(loop_of(holder))
                # A transaction's connection must be this loop's; on a loop the backend
                # does not serve directly (a loop per job), one of the turn's own.
                shared.via = via and not self._transaction
                own = via and self._transaction
        steps = self._taking(holder, own, lined)
        wait = next(steps, None)  # (up to the first wait)
        return None if wait is None else (steps, wait)

    def _leave(self, error: BaseException | None, result: Any) -> _Begun | None:
        """End the turn (the work ended with error, or with result) as far as it goes without
        a wait; None once it ended, else the steps and their first wait."""
        path = self._path
        if path is None:  # one key, taken by try_take alone
            holder, self._holder = self._holder, None
            self._registry.finish(self.keys[0], holder, error, result)
            return None
        if path is _NOTHING:
            self._holder = None
            return None
        steps = self._ending(error, result)
        wait = next(steps, None)  # (up to the first wait)
        return None if wait is None else (steps, wait)

    # -- the steps ---------------------------------------------------------------------

    def _taking(self, holder: object, own: bool, lined: bool) -> Steps:
        """Take each key's line (and its grant), or all on the turn's session, then a slot (steps).

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
        waited: object = _NO_KEY  # the key (or _SLOT) it waits for (see _untaking)
        slots = registry.slots
        try:
            for key in self.keys:
                got = True if lined else registry.try_take(key, holder)
                if got is HELD:  # held already by this holder (an enclosing turn): reentrant
                    if shared is not None:
                        shared.reentered(key)
                    continue
                if got is False:
                    waited = key
                    yield LINE, key
                    waited = _NO_KEY
                taken += (key,)
                if each:
                    yield GRANT, (backend, key, shared.grants)  # type: ignore[union-attr]
                    shared.granted(key)  # type: ignore[union-attr]
            if shared is not None and not each:
                if self._transaction and not taken:
                    raise no_transaction(self.keys)  # noqa: TRY301
                if taken or self._transaction:
                    yield from shared.on_session(backend, taken, own)  # type: ignore[arg-type]
            if slots is not None:
                got = slots.try_take(holder)
                if got is False:
                    waited = _SLOT
                    yield SLOT, self.keys  # (the keys: for the error if it is not reached)
                    waited = _NO_KEY
                self._slot = got is not HELD
            self._taken = taken
            self.token = (
                shared.tokens[self.keys[0]] if shared and shared.tokens else next(registry.tokens)
            )
            if registry.timed:
                self._since = registry.started(self._since)
            if self._hold is not None and taken:
                self._clock = start_clock(holder, self._hold)  # type: ignore[arg-type]
        except BaseException as error:
            yield from self._untaking(holder, taken, waited, error)
            raise
        if shared is not None:
            CURRENT.set(shared)

    def _untaking(
        self, holder: object, taken: tuple[Hashable, ...], waited: object, error: BaseException
    ) -> Steps:
        """Give back what _taking took, and count the turn as missed (steps).

        The key or slot waited for is given back too if it is found held: an
        interrupt (a signal handler's exception) came after the wait ended.
        """
        registry = self._registry
        if waited is _SLOT:
            self._slot = holder in registry.slots.holders  # type: ignore[union-attr]
        elif waited is not _NO_KEY and held_by(registry.lines.get(waited), holder):
            taken += (waited,)
        registry.missed(error)
        try:
            if self._slot:
                self._slot = False
                registry.slots.vacate(holder)  # type: ignore[union-attr]
            shared = self._shared
            if shared is not None:
                yield from shared.give_back(registry.backend, error)  # type: ignore[arg-type]
        finally:
            self._taken = ()
            registry.release_all(taken, holder, error, None)

    def _ending(self, error: BaseException | None, result: Any) -> Steps:
        """Stop the clock, release the slot, the grants (or session), then the keys (steps).

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
        if self._slot:  # first: the next work here may start meanwhile
            self._slot = False
            registry.slots.vacate(holder)  # type: ignore[union-attr]
        shared = self._shared
        failure: Exception | None = None
        try:
            if shared is not None:
                CURRENT.set(shared.outer)
                failure = yield from shared.give_back(registry.backend, error)  # type: ignore[arg-type]
                error, failure = shared.ended(registry.name, error, failure)
        finally:
            if self._taken:
                registry.end(self._taken, holder, error, result, cut is not None, self._since)
        if cut is not None:
            raise cut
        if failure is not None and failure is error:
            raise failure

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
    task: asyncio.Task[Any] | None = None,
    since: float = 0.0,
    lined: bool = False,
    label: str | None = None,
) -> Any:
    """Take turn, call fn (awaiting what it returns), end turn with the outcome; return it.

    The path of every async call that is not the facade's inlined one.
    ``task``: the task this runs in, if the caller knows it (and its loop is
    settled in the thread mode); ``lined``: it holds the turn's lines already,
    asked for at ``since`` (submitted work, see _submit); ``label``: fn's name
    for the queue's observer (see FUNCTION), around the whole turn.
    """
    token = None if label is None else FUNCTION.set(label)
    try:
        holder: asyncio.Task[Any] = turn._enter_now(task, lined)  # type: ignore[assignment]
        if turn._holder is None:
            if turn._path is _ALONE:
                await wait_alone(turn._registry, turn.keys[0], holder, turn._timeout)
                turn._held_alone(holder)
            else:
                begun = turn._start(holder, since, lined)
                if begun is not None:
                    await turn._drive(holder, *begun)
                turn._holder = holder
        try:
            result = fn(*args, **kwargs)
            if type(result) is CoroutineType or (result is not None and isawaitable(result)):
                result = await result
        except BaseException as error:
            begun = turn._leave(error, None)
            if begun is not None:
                await turn._drive(holder, *begun)
            raise
        begun = turn._leave(None, result)
        if begun is not None:
            await turn._drive(holder, *begun)
        return result
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

    ``lined``, ``since``: as call_in_turn's.

    :raises TypeError: fn returned a coroutine (closed, never run: a thread cannot await it).
    """
    turn._enter_sync(lined, since, fn)
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
