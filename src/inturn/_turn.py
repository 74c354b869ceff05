"""Turn: what a holder has while it holds one or more keys, and current_turn()."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import threading
from collections.abc import Awaitable, Callable, Generator, Hashable, Mapping
from inspect import isawaitable
from time import monotonic as _monotonic
from types import CoroutineType, MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, cast, final

from ._bridge import acquire_sync, acquire_via, close_sync, close_via, release_sync, release_via
from ._checks import Deadline
from ._describe import describe
from ._errors import HoldTimeout, LeaseLost
from ._line import held_by
from ._tasks import current_task as _current_task
from ._tasks import loop_here, outside_asyncio, retrieve

_current_thread = threading.current_thread

if TYPE_CHECKING:
    from ._registry import Registry
    from ._slots import Slots
    from .backends._base import Grant, SessionBackend
    from .backends._base import TurnSession as Session

__all__ = ("Clock", "Turn", "call_in_turn", "call_in_turn_sync", "current_turn")

#: The core's logger: a turn whose lease was lost (WARNING). Nothing on a turn
#: that goes well.
logger = logging.getLogger("inturn")

# The waits of the protocol on a shared backend (see Turn._take_shared).
_TAKE = 0  # key's turn in this process's line -> True, or False if the holder held it already
_GRANT = 1  # key's grant from the backend -> the Grant
_SLOT = 2  # a running slot (max_running) -> True
_RELEASE = 3  # release a grant -> None
_CLOSE = 4  # end the turn's session (see backends' Session), with the work's error -> None


def _next(
    steps: Generator[tuple[int, Any], Any, None], reply: Any, error: BaseException | None
) -> tuple[int, Any] | None:
    """Give steps the answer to its last wait (or throw in what interrupted it); its next wait.

    None once the steps are done. (What the steps raise goes to the driver's caller.)
    """
    try:
        return steps.send(reply) if error is None else steps.throw(error)
    except StopIteration:
        return None


#: The innermost turn of the current task on a queue with a shared backend.
_CURRENT: contextvars.ContextVar[Turn | None] = contextvars.ContextVar(
    "inturn_current_turn", default=None
)


def current_turn() -> Turn | None:
    """The innermost turn the current task holds on a queue with a shared backend.

    Inside a decorated function, :meth:`~inturn.KeyedQueue.run` or
    ``keyed()`` block on a queue whose lines a backend shares between
    processes (file, Redis), this is that call's :class:`Turn`: its
    ``token`` fences writes to a downstream store, and its ``lease_lost``
    tells long work that another process may have the key by now.

    ``None`` elsewhere, including in-process queues: their turns need no
    fencing, as nothing outlives the process, and so their hot path records
    none (``async with q.keyed(k) as turn:`` still binds one).
    """
    return _CURRENT.get()


async def _settle(release: Awaitable[None]) -> None:
    """Await a backend release that a second cancellation of the caller cannot interrupt.

    If the caller is cancelled meanwhile, the release goes on by itself and
    the caller gets the CancelledError at once. A Future is a release that
    goes on by itself already (see Backend.release): no task is needed.
    """
    if isinstance(release, asyncio.Future):
        await release
        return
    task = asyncio.ensure_future(release)
    task.add_done_callback(retrieve)
    await asyncio.shield(task)


@final
class Clock:
    """A turn's max_hold: cancels the holding task when the limit runs out."""

    __slots__ = ("cancelling", "expired", "handle", "limit", "task")

    def __init__(self, task: asyncio.Task[Any], limit: float) -> None:
        self.task = task
        self.limit = limit
        self.expired = False
        # the task's cancellation requests before this one (as asyncio.timeout() counts them)
        self.cancelling = 0
        if sys.version_info >= (3, 11):
            self.cancelling = task.cancelling()
        self.handle = task.get_loop().call_later(limit, self._expire)

    def _expire(self) -> None:
        self.expired = True
        self.task.cancel(f"inturn: max_hold={self.limit:g} s ran out")

    def stop(self, keys: tuple[Hashable, ...], error: BaseException | None) -> HoldTimeout | None:
        """Stop the clock; return the HoldTimeout to raise if the limit cut the work."""
        self.handle.cancel()
        if not self.expired:
            return None
        if sys.version_info >= (3, 11) and self.task.uncancel() > self.cancelling:
            return None  # cancelled from elsewhere too: that cancellation goes on
        if not isinstance(error, asyncio.CancelledError):
            return None  # the work caught the cancellation and ended by itself
        what = ", ".join(map(describe, keys))
        return HoldTimeout(
            f"inturn: the work held {what} longer than max_hold={self.limit:g} s "
            "and was cancelled; the next in line started after it finished"
        )


def _outcome(error: BaseException | None) -> str:
    """How a log line says how the work ended."""
    return "returned" if error is None else f"raised {type(error).__name__}"


@final
class _Flow:
    """What a turn has on a queue with flow control or timing: kept off plain turns."""

    __slots__ = ("clock", "since", "slot")

    def __init__(self) -> None:
        self.slot = False  # whether the turn took a running slot (max_running)
        self.since = 0.0  # when the turn started, if its queue times turns
        self.clock: Clock | None = None  # max_hold, while held


@final
class _Shared:
    """What a turn on a shared backend has besides: its grants, and where it sits."""

    __slots__ = ("grants", "holders", "outer", "tokens")

    def __init__(
        self,
        grants: list[Grant],
        tokens: dict[Hashable, int],
        holders: list[Turn],
        outer: Turn | None,
    ) -> None:
        self.grants = grants  # the backend's grants this turn took, in order
        self.tokens = tokens  # each key's fencing token
        self.holders = holders  # enclosing turns holding keys this one re-took
        self.outer = outer  # the enclosing current_turn(), restored at the end


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
        "_flow",
        "_hold",
        "_owns",
        "_registry",
        "_session",
        "_shared",
        "_slots",
        "_taken",
        "_task",
        "_timeout",
        "_transaction",
        "_via",
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
        slots: Slots | None,
        keys: tuple[Hashable, ...],
        timeout: float | None,
        hold: float | None,
        transaction: bool = False,
    ) -> None:
        self._registry = registry
        self._slots = slots  # max_running's, or None
        self.keys = keys
        self._timeout = timeout
        self._hold = hold  # max_hold, seconds
        self.token = 0
        self._task: object = None  # the task inside the block, None outside it
        self._taken: tuple[Hashable, ...] = ()  # the keys this turn took (not held already)
        self._shared: _Shared | None = None  # on a shared backend, once entered
        # On a shared backend, whether this task's calls go through the backend loop
        self._via = False
        # slot, start time and max_hold of a turn that has any, once entered
        self._flow: _Flow | None = None
        # keyed(transaction=True): the work runs in a transaction on self.connection
        self._transaction = transaction
        # On a backend with sessions (see backends' Session): this turn's, while taken
        self._session: Session | None = None
        self._owns = False  # whether this turn opened _session (else an enclosing turn did)

    @property
    def tokens(self) -> Mapping[Hashable, int]:
        """Each key's fencing token (all the same in process, one per key on a shared backend)."""
        if self._shared is None:
            return MappingProxyType(dict.fromkeys(self.keys, self.token))
        return MappingProxyType(self._shared.tokens)

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
        session = self._session
        if session is None or not self._transaction or self._task is None:
            raise RuntimeError(
                "inturn: turn.connection exists inside the block of "
                "`(async) with queue.keyed(..., transaction=True)`, on a backend that "
                "takes turns in a database (PostgresBackend)"
            )
        return session.connection

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
        shared = self._shared
        if shared is None:
            return False
        return any(grant.lost for grant in shared.grants) or any(
            turn.lease_lost for turn in shared.holders
        )

    async def __aenter__(self) -> Turn:
        if self._task is not None:
            raise RuntimeError("inturn: this keyed() turn is already entered; make one per block")
        registry = self._registry
        try:
            task = registry.current_task()
        except RuntimeError:
            raise outside_asyncio("keyed()") from None
        keys = self.keys
        if len(keys) == 1 and task is not None and task._loop is registry.owner:
            # A plain queue's turn on one key, on its solo loop: as run() takes it,
            # inlined (a coroutine less per turn, contended or not).
            key = keys[0]
            lines = registry.lines
            line = lines.get(key)
            if line is None:
                lines[key] = task  # uncontended: as in run()
                self._taken = keys
            else:
                waiter = registry.join(key, task, line, self._timeout)
                if waiter is not True:  # True: this task holds the key already
                    if waiter is not False:
                        line = lines[key]
                        try:
                            await waiter
                        except BaseException as error:
                            registry.abandon(key, line, waiter, error)
                            raise
                        line.holder = task
                    self._taken = keys
            self._task = task
            self.token = next(registry.tokens)
        elif self._enter_now(task):  # a free key and slot at once (flow control)
            return self
        else:
            await self._enter(task)
        if self._hold is not None and self._taken:
            assert task is not None  # (a turn was taken)
            if self._flow is None:
                self._flow = _Flow()
            self._flow.clock = Clock(task, self._hold)
        return self

    def _enter_now(self, task: Any) -> bool:
        """Take the turn at once if that needs no wait and no lock; False to take it by _enter.

        One free key on the queue's solo loop, in process, and a free
        running slot if the queue has slots: the uncontended turn of a queue
        with flow control, with no coroutine and no future.
        """
        registry = self._registry
        keys = self.keys
        if len(keys) != 1 or task is None or task._loop is not registry.local:
            return False
        key = keys[0]
        lines = registry.lines
        if key in lines:
            return False
        slots = self._slots
        flow = _Flow()
        if slots is not None:
            took = slots.enter_now(task)
            if took is None:
                return False
            flow.slot = took
        lines[key] = task
        flow.since = _monotonic()
        self._flow = flow
        self._task, self._taken = task, keys
        self.token = next(registry.tokens)
        if self._hold is not None:
            flow.clock = Clock(task, self._hold)
        return True

    async def _enter(self, task: Any) -> None:
        """Take the turn, waiting in each key's line (and for a backend's grant, a slot)."""
        registry = self._registry
        backend = registry.backend
        if backend is not None:
            loop = task.get_loop() if task is not None else asyncio.get_running_loop()
            deadline = Deadline(self._timeout, loop.time)
            via = registry.via(loop)
            # A transaction's connection must be this loop's; on a loop the backend
            # does not serve directly (a loop per job), one of the turn's own.
            self._via = via and not self._transaction
            steps = self._take_shared(task, _monotonic(), via and self._transaction)
            await self._drive(steps, task, deadline)
        elif registry.plain:
            loop = task.get_loop() if task is not None else asyncio.get_running_loop()
            self._taken = await self._take_all(task, Deadline(self._timeout, loop.time))
            self.token = next(registry.tokens)
        else:
            await self._enter_flow(registry, task)
            self.token = next(registry.tokens)
        self._task = task

    async def _take_all(self, task: Any, deadline: Deadline) -> tuple[Hashable, ...]:
        """Take the turns of the keys (in the global order) by deadline; return those taken.

        If any turn is not reached, the ones already taken are released, newest first.
        """
        registry = self._registry
        keys = self.keys
        limit = deadline.limit
        if len(keys) == 1:  # (nothing to roll back)
            return keys if await registry.take(keys[0], task, deadline.left(), limit) else ()
        taken: list[Hashable] = []
        try:
            for key in keys:
                if await registry.take(key, task, deadline.left(), limit):
                    taken.append(key)  # noqa: PERF401 - one at a time: the rollback needs them
        except BaseException as error:
            registry.release_all(taken, task, error, None)
            raise
        return tuple(taken)

    async def _enter_flow(self, registry: Registry, task: Any) -> None:
        """Take the keys, then a running slot (max_running); time the wait."""
        start = _monotonic()
        timeout = self._timeout
        deadline = Deadline(timeout, task.get_loop().time)
        flow = _Flow()
        taken = await self._take_all(task, deadline)
        if self._slots is not None:
            try:
                flow.slot = await self._slots.take(task, deadline.left(), timeout)
            except BaseException as error:
                registry.release_all(taken, task, error, None)
                raise
        self._taken = taken
        flow.since = registry.started(start)
        self._flow = flow

    def __enter__(self) -> Turn:
        """Take the turns for this thread, blocking it while it waits (see ``KeyedQueue.keyed``)."""
        if self._task is not None:
            raise RuntimeError("inturn: this keyed() turn is already entered; make one per block")
        if self._hold is not None:
            raise TypeError(
                f"inturn: max_hold={self._hold:g} s cannot cut a thread's turn short "
                "(a thread cannot be cancelled); take it from a task, or without max_hold"
            )
        registry = self._registry
        keys = self.keys
        if registry.plain and registry.shared and len(keys) == 1 and loop_here() is None:
            # NOTE: a plain queue's free key, taken by a thread: what _holder_sync,
            # _take_all_sync and Registry.take_sync do, inlined. Measured with the
            # end inlined as well (see _end_sync): 3.6 µs a turn before, 2.2 after.
            me = _current_thread()
            key = keys[0]
            with registry.locked():
                if registry.open and key not in registry.lines:
                    registry.lines[key] = me
                    self._task, self._taken = me, keys
                    self.token = next(registry.tokens)
                    return self
        holder = self._holder_sync()
        deadline = Deadline(self._timeout, _monotonic)
        if registry.backend is not None:
            self._drive_sync(self._take_shared(holder, _monotonic()), holder, deadline)
            self._task = holder
            return self
        flow = None if registry.plain else _Flow()
        start = 0.0 if flow is None else _monotonic()
        taken = self._take_all_sync(holder, deadline)
        if flow is not None:
            if self._slots is not None:
                try:
                    flow.slot = self._slots.take_sync(holder, deadline.left(), self._timeout)
                except BaseException as error:
                    registry.release_all(taken, holder, error, None)
                    raise
            flow.since = registry.started(start)
            self._flow = flow
        self._task, self._taken = holder, taken
        self.token = next(registry.tokens)
        return self

    def _holder_sync(self) -> object:
        """Who takes a thread's turn: this thread, or a running loop's task that holds the keys.

        Inside a running event loop, only a reentrant call is possible: the
        loop's current task holds every key already, and is the holder.
        """
        registry = self._registry
        if loop_here() is not None:
            task = _current_task()
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
        if not registry.shared:
            registry.arrive(None)
        return threading.current_thread()

    def _take_all_sync(self, holder: object, deadline: Deadline) -> tuple[Hashable, ...]:
        """Take the keys' turns for holder (see _holder_sync), blocking; return those taken."""
        registry = self._registry
        taken: list[Hashable] = []
        try:
            for key in self.keys:
                if registry.take_sync(key, holder, deadline.left(), self._timeout):
                    taken.append(key)  # noqa: PERF401 - one at a time: the rollback needs them
        except BaseException as error:
            registry.release_all(taken, holder, error, None)
            raise
        return tuple(taken)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._end_sync(exc, None)

    def _end_sync(self, error: BaseException | None, result: Any) -> None:
        """End a thread's turn whose work ended with error, or with result.

        Raises what :meth:`_end_shared` raises, on a shared backend.
        """
        registry = self._registry
        taken = self._taken
        if self._flow is None and len(taken) == 1 and registry.shared:
            # A plain queue's turn on one key (no flow: no backend either), as
            # _release and Registry.release do it, inlined (see __enter__).
            holder, self._task, self._taken = self._task, None, ()
            key = taken[0]
            with registry.locked():
                if (line := registry.lines.pop(key)) is not holder:
                    registry.leave(key, line, error, result)
                registry.tally.ended(error, False, None)
        elif registry.backend is None:
            self._release(error, result)
        else:
            self._drive_sync(self._end_shared(error, result, False), self._task, None)

    # -- the protocol on a shared backend ------------------------------------------------
    #
    # Written once, as generators of the waits it needs (_TAKE, _GRANT, _SLOT,
    # _RELEASE, each with its argument): a driver does each wait and sends the
    # answer back, or throws in what interrupted it; _drive for a task,
    # _drive_sync for a thread. (A backend's I/O dwarfs a generator's cost.)

    def _take_shared(
        self, holder: object, begun: float, own: bool = False
    ) -> Generator[tuple[int, Any], Any, None]:
        """Take each key's turn in this process's line, then from the backend, in order (steps).

        ``own``: a backend session should have a connection of its own (see Session).
        """
        registry = self._registry
        outer = _CURRENT.get()
        taken: list[Hashable] = []
        grants: list[Grant] = []
        tokens: dict[Hashable, int] = {}
        holders: list[Turn] = []
        flow = _Flow()
        backend = registry.backend
        assert backend is not None
        opener = cast("SessionBackend", backend).session if backend.capabilities.sessions else None
        try:
            for key in self.keys:
                if not (yield _TAKE, key):
                    # held already by an enclosing turn of this holder: reentrant
                    enclosing = _holder(outer, registry, key)
                    if enclosing is not None:
                        holders.append(enclosing)
                        tokens[key] = enclosing.tokens[key]
                    continue
                taken.append(key)
                if opener is None:
                    grant = yield _GRANT, key
                    grants.append(grant)
                    tokens[key] = grant.token
            if opener is not None and self._transaction and not taken:
                raise _no_transaction(self.keys)  # noqa: TRY301
            if opener is not None and (taken or self._transaction):
                # One connection for the turn, asked for once this process's lines
                # are taken: a turn waiting for one holds no connection, and one
                # holding a connection waits for nothing of this process, so a
                # pool of them cannot deadlock (see backends' Session). A turn
                # nested in another takes its keys on the enclosing turn's.
                lender = None if self._transaction else _lender(outer, registry, holder)
                self._owns = lender is None
                self._session = lender or opener(len(taken), self._transaction, own, _depth(outer))
                for key in taken:
                    grant = yield _GRANT, key
                    grants.append(grant)
                    tokens[key] = grant.token
            if self._slots is not None:
                flow.slot = yield _SLOT, None
        except BaseException as error:
            if len(grants) < len(taken):  # the backend's turn was not reached
                registry.missed(error)
            try:
                yield from self._give_back(grants, error)
            finally:
                registry.release_all(taken, holder, error, None)
            raise
        self._taken = tuple(taken)
        self._shared = _Shared(grants, tokens, holders, outer)
        self.token = tokens[self.keys[0]]
        flow.since = registry.started(begun)
        self._flow = flow
        _CURRENT.set(self)

    async def _drive(
        self, steps: Generator[tuple[int, Any], Any, None], task: Any, deadline: Deadline | None
    ) -> None:
        """Run steps for task, awaiting each wait (a release goes on if task is cancelled)."""
        registry = self._registry
        backend = registry.backend
        assert backend is not None
        slots, limit, via = self._slots, self._timeout, self._via
        reply: Any = None
        error: BaseException | None = None
        while (wait := _next(steps, reply, error)) is not None:
            step, arg = wait
            error = reply = None
            try:
                if step == _RELEASE:
                    source = self._session or backend
                    await _settle(release_via(backend, source, arg) if via else source.release(arg))
                    continue
                if step == _CLOSE:
                    session, failed = arg
                    await _settle(
                        close_via(backend, session, failed) if via else session.close(failed)
                    )
                    continue
                assert deadline is not None
                if step == _TAKE:
                    reply = await registry.take(arg, task, deadline.left(), limit)
                elif step == _GRANT:
                    left = deadline.left()
                    source = self._session or backend
                    acquire = (
                        acquire_via(backend, source, arg, left)
                        if via
                        else source.acquire(arg, left)
                    )
                    reply = await acquire
                else:
                    assert slots is not None
                    reply = await slots.take(task, deadline.left(), limit)
            except BaseException as problem:  # thrown into the steps, which roll back
                error = problem

    def _drive_sync(
        self,
        steps: Generator[tuple[int, Any], Any, None],
        holder: object,
        deadline: Deadline | None,
    ) -> None:
        """Run steps for holder (a thread, see _holder_sync), blocking it for each wait."""
        registry = self._registry
        backend = registry.backend
        assert backend is not None
        slots, limit = self._slots, self._timeout
        reply: Any = None
        error: BaseException | None = None
        while (wait := _next(steps, reply, error)) is not None:
            step, arg = wait
            error = reply = None
            try:
                if step == _RELEASE:
                    release_sync(backend, self._session or backend, arg)
                    continue
                if step == _CLOSE:
                    close_sync(backend, *arg)
                    continue
                assert deadline is not None
                if step == _TAKE:
                    reply = registry.take_sync(arg, holder, deadline.left(), limit)
                elif step == _GRANT:
                    reply = acquire_sync(backend, self._session or backend, arg, deadline.left())
                else:
                    assert slots is not None
                    reply = slots.take_sync(holder, deadline.left(), limit)
            except BaseException as problem:  # thrown into the steps, which roll back
                error = problem

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        registry = self._registry
        taken = self._taken
        # (a backend's turns are timed: they have a _flow)
        if len(taken) == 1 and self._flow is None:
            # what _end() does, inlined for a plain turn on one key
            task, self._task, self._taken = self._task, None, ()
            key = taken[0]
            if registry.shared:
                registry.release(key, task, exc, None)
                registry.ended(exc, False, 0.0)
            else:
                if (line := registry.lines.pop(key)) is not task:
                    registry.leave(key, line, exc, None)
                if exc is None:
                    registry.tally.completed += 1
                else:
                    registry.tally.ended(exc, False, None)
        else:
            await self._end(exc, None)

    async def _end(self, error: BaseException | None, result: Any) -> None:
        """End the turn whose work ended with error, or with result.

        Raises :exc:`~inturn.HoldTimeout` if its max_hold cut it, and what
        :meth:`_end_shared` raises on a shared backend.
        """
        if self._registry.backend is None:
            self._end_here(error, result)
            return
        cut = self._cut(error)
        await self._drive(self._end_shared(cut or error, result, cut is not None), self._task, None)
        if cut is not None:
            raise cut

    def _end_here(self, error: BaseException | None, result: Any) -> None:
        """_end() of a turn in process: nothing to await."""
        cut = self._cut(error)
        self._release(cut or error, result, cut is not None)
        if cut is not None:
            raise cut

    def _cut(self, error: BaseException | None) -> HoldTimeout | None:
        """Stop the max_hold clock; the HoldTimeout (caused by error) if it cut the work."""
        flow = self._flow
        if flow is None or flow.clock is None:
            return None
        cut = flow.clock.stop(self.keys, error)
        flow.clock = None
        if cut is not None:
            cut.__cause__ = error
        return cut

    def _release(self, error: BaseException | None, result: Any, cut: bool = False) -> None:
        """Release the running slot and every key this turn took, newest first; count the turn.

        Watchers learn the outcome (error, or result); ``cut``: max_hold cut the work.
        """
        registry, task, taken, flow = self._registry, self._task, self._taken, self._flow
        self._task = None
        self._taken = ()
        self._flow = None
        if flow is not None and flow.slot:
            assert self._slots is not None
            self._slots.vacate(task)
        registry.release_all(taken, task, error, result)
        if taken:
            registry.ended(error, cut, 0.0 if flow is None else flow.since)

    def _end_shared(
        self, error: BaseException | None, result: Any, cut: bool
    ) -> Generator[tuple[int, Any], Any, None]:
        """Release the running slot, the backend's grants, then this process's turns (steps).

        Raises :exc:`~inturn.LeaseLost` if a grant's lease ran out and the
        work ended without an error of its own (with one, the loss is noted
        on that error), or the backend's error if a release failed.
        """
        backend = self._registry.backend
        shared = self._shared
        assert backend is not None
        assert shared is not None
        flow = self._flow
        if flow is not None and flow.slot:  # first: the next work here may start meanwhile
            assert self._slots is not None
            flow.slot = False
            self._slots.vacate(self._task)
        grants = shared.grants
        _CURRENT.set(shared.outer)
        failure: Exception | None = None
        try:
            failure = yield from self._give_back(grants, error)
            lost = [grant for grant in grants if grant.lost]
            if lost:
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
                        failure.add_note(message)
                elif sys.version_info >= (3, 11):  # pragma: no branch
                    error.add_note(message)
            elif failure is not None and error is None:
                error = failure
        finally:
            self._release(error, result, cut)
        if failure is not None and failure is error:
            raise failure

    def _give_back(
        self, grants: list[Grant], error: BaseException | None
    ) -> Generator[tuple[int, Any], Any, Exception | None]:
        """Release grants, newest first, or close the turn's session (steps).

        Every release is made; the first that failed is returned.
        """
        failure: Exception | None = None
        session = self._session
        if session is not None and self._owns:
            self._session = None
            try:
                yield _CLOSE, (session, error)
            except Exception as problem:
                failure = problem
            return failure
        try:
            for grant in reversed(grants):
                try:
                    yield _RELEASE, grant  # (to the session it was taken on, if any)
                except Exception as problem:
                    failure = failure or problem
        finally:
            self._session = None
        return failure

    def __repr__(self) -> str:
        if self._task is None:
            return f"<Turn keys={describe(self.keys)} not held>"
        lost = ", lease lost" if self.lease_lost else ""
        return f"<Turn keys={describe(self.keys)} held, token {self.token}{lost}>"


async def call_in_turn(
    turn: Turn, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Take turn, call fn (awaiting what it returns), end turn with the outcome; return it.

    The path of every async call that is not the facade's inlined one.
    """
    await turn.__aenter__()
    try:
        result = fn(*args, **kwargs)
        if isawaitable(result):
            result = await result
    except BaseException as error:
        if turn._registry.backend is None:
            turn._end_here(error, None)
        else:
            await turn._end(error, None)
        raise
    if turn._registry.backend is None:
        turn._end_here(None, result)
    else:
        await turn._end(None, result)
    return result


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


def _lender(turn: Turn | None, registry: Registry, holder: object) -> Session | None:
    """The session of holder's innermost enclosing turn on registry, unless a transaction's.

    Only the holder's own: a task started inside a turn sees the turn as its
    current one too, but must not send on its connection at the same time.
    """
    while turn is not None:
        if turn._registry is registry and turn._session is not None:
            if turn._transaction or turn._task is not holder:
                return None
            return turn._session
        shared = turn._shared
        turn = None if shared is None else shared.outer
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
    """How many sessions the enclosing turns, from turn outwards, hold (see Session).

    A turn started inside them (a task made in their block, say) draws its
    connection from the next tier, so that they never hold the ones it needs.
    """
    sessions: list[Session] = []
    while turn is not None:
        session = turn._session
        if session is not None and not any(session is seen for seen in sessions):
            sessions.append(session)
        shared = turn._shared
        turn = None if shared is None else shared.outer
    return len(sessions)


def _holder(turn: Turn | None, registry: Registry, key: Hashable) -> Turn | None:
    """The enclosing turn, from turn outwards, that holds key in registry (its queue's)."""
    while turn is not None:
        shared = turn._shared
        if shared is None:
            return None
        if turn._registry is registry and key in shared.tokens:
            return turn
        turn = shared.outer
    return None
