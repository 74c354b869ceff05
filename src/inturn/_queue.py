"""KeyedQueue: a line per key, FIFO within a key, concurrent across keys."""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from inspect import isawaitable
from types import CoroutineType
from typing import (
    Any,
    Concatenate,
    Literal,
    NoReturn,
    ParamSpec,
    Protocol,
    TypeVar,
    final,
    overload,
)

from ._batch import Batch
from ._checks import (
    UNSET,
    Policy,
    check_across,
    check_backend,
    check_count,
    check_hold,
    check_name,
    check_policy,
    check_timeout,
    check_transaction,
)
from ._checks import Unset as _Unset
from ._describe import describe
from ._drive import give_up, line_up, seated
from ._keyspec import KeySpec, KeysSpec
from ._latest import Book, Ticket
from ._line import held_by, wake
from ._order import unhashable
from ._registry import Registry
from ._slots import Slots
from ._stats import FUNCTION, Observer, QueueStats, function_label
from ._submit import Handle, Submissions, claim, submit
from ._tasks import current_task, loop_here, loop_of, outside_asyncio, running_loop
from ._turn import ThreadTurn, Turn, call_in_turn, call_in_turn_sync
from .backends._base import Backend
from .backends._local import LocalBackend

P = ParamSpec("P")
P2 = ParamSpec("P2")
R = TypeVar("R")
R_co = TypeVar("R_co", covariant=True)
T = TypeVar("T")


# -- what queue_by_key returns (here, beside the queue its functions name) ---------------------


class QueuedFunction(Protocol[P, R_co]):
    """An ``async def`` function whose calls queue by key: what ``queue_by_key`` returns.

    Calling it returns a coroutine; the call is submitted to its key's line
    when that coroutine starts running. The key is computed by the call
    itself: arguments the key template cannot format (a missing attribute
    or item, a ``__format__`` that raises) raise there, and nothing runs.
    The exception is of the original's kind: a new one of the same builtin
    class (``AttributeError``, ``KeyError``...) naming the template, the
    field, the parameter and the function, with the original as its
    ``__cause__``; or the user's own exception itself, with those words as
    a note.
    """

    @property
    def queue(self) -> KeyedQueue:
        """The queue the calls wait in."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> Coroutine[Any, Any, R_co]: ...

    def key_of(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """The key (a tuple of keys for ``keys=``) a call with these arguments would use."""

    @overload
    def __get__(
        self, instance: None, owner: type[Any] | None = None, /
    ) -> QueuedFunction[P, R_co]: ...

    @overload
    def __get__(
        self: QueuedFunction[Concatenate[T, P2], R_co],
        instance: T,
        owner: type[Any] | None = None,
        /,
    ) -> QueuedFunction[P2, R_co]: ...


class SyncQueuedFunction(Protocol[P, R_co]):
    """A plain ``def`` function whose calls queue by key: what ``queue_by_key`` returns for it.

    Calling it blocks the calling thread until the key's turn, runs the
    function, and returns its result (see ``KeyedQueue.run_sync``). Arguments
    the key template cannot format raise before any wait, as for
    :class:`QueuedFunction`.
    """

    @property
    def queue(self) -> KeyedQueue:
        """The queue the calls wait in."""

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R_co: ...

    def key_of(self, *args: P.args, **kwargs: P.kwargs) -> Any:
        """The key (a tuple of keys for ``keys=``) a call with these arguments would use."""

    @overload
    def __get__(
        self, instance: None, owner: type[Any] | None = None, /
    ) -> SyncQueuedFunction[P, R_co]: ...

    @overload
    def __get__(
        self: SyncQueuedFunction[Concatenate[T, P2], R_co],
        instance: T,
        owner: type[Any] | None = None,
        /,
    ) -> SyncQueuedFunction[P2, R_co]: ...


class Decorator(Protocol):
    """What ``queue_by_key(...)`` called with settings returns: it decorates a function."""

    @overload
    def __call__(  # type: ignore[overload-overlap]  # a coroutine function is decorated
        self, fn: Callable[P, Coroutine[Any, Any, R]], /
    ) -> QueuedFunction[P, R]: ...

    @overload
    def __call__(self, fn: Callable[P, R], /) -> SyncQueuedFunction[P, R]: ...


#: Every queue of this process, for a forked child to reset (see _after_fork_in_child).
_QUEUES: weakref.WeakSet[KeyedQueue] = weakref.WeakSet()


#: The task whose step forked, if any (a raw ``os.fork()`` inside ``async with keyed()``).
_forking: list[object] = [None]


def _before_fork() -> None:
    _forking[0] = None if loop_here() is None else current_task()


def _after_fork_in_child() -> None:
    """Forget, in each queue, the parent's other threads, tasks and locks (see Registry.forked).

    The parent's submitted work, and its errors nobody awaited, stay the parent's.
    """
    task, _forking[0] = _forking[0], None
    for queue in list(_QUEUES):
        queue._registry.forked(task)
        queue._book.forked()
        queue._submissions.handles.clear()
        queue._submissions.unclaimed.clear()


def _after_fork_in_parent() -> None:
    _forking[0] = None


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(
        before=_before_fork,
        after_in_child=_after_fork_in_child,
        after_in_parent=_after_fork_in_parent,
    )


@final
class KeyedQueue:
    """A registry of per-key FIFO lines: one caller at a time per key.

    Work submitted under a key waits in that key's line and runs when it
    reaches the front; work under different keys runs concurrently. A line
    exists only while someone holds or waits for its key.

    The callers are asyncio tasks (:meth:`run`, ``async with``
    :meth:`keyed`, decorated ``async def``) and threads (:meth:`run_sync`,
    ``with`` :meth:`keyed`, decorated plain ``def``), in any mix: one queue
    serves the tasks of several event loops and any number of threads, with
    one line per key among all of them.

    Guarantees, for every way of taking a turn:

    - Mutual exclusion: two callers never hold the same key at once, whether
      tasks, threads, or a task and a thread.
    - FIFO: turns are granted in submission order. A task submits when the
      call's coroutine starts running, so the order of ``gather()`` or
      ``create_task()`` is the queue order; a thread submits when it calls.
    - Direct hand-off: a release hands the key to exactly the next waiter; a
      newcomer can never take it in between, and no other waiter is woken.
    - Errors stay with their caller: an exception in one holder reaches its
      own caller only, and the next in line still runs.
    - Cancellation: a cancelled waiter leaves the line without disturbing
      anyone behind it; a cancelled holder releases the key; a waiter
      cancelled just as it is handed the key passes the turn on. A thread
      interrupted while waiting (``KeyboardInterrupt``) leaves the same way.
    - Reentrancy: the task, or the thread, that holds a key may take it
      again (a decorated method calling another with the same key) and runs
      at once. Any other caller, including a task the holder spawned or a
      thread it started, waits its turn.
    - No leaks: once a key has no holder and no waiter, the queue keeps no
      reference to it.
    - No frozen loop: a thread's call made inside a running event loop,
      which would block that loop while it waits, raises
      :exc:`RuntimeError` at once instead (unless the loop's current task
      holds the keys already: that call is reentrant and runs).

    While one event loop uses a queue, its turns are taken without a lock:
    the fast path is a dict insert. The first call from a thread, or from a
    second event loop running in another thread, switches the queue for
    good to locking its lines (waiting first, once, for the first loop to
    finish the step it is in); tasks keep their FIFO places across the
    switch. Event loops that follow each other in one thread (``asyncio.run()``
    twice) need no switch.

    :param timeout: the default limit, in seconds, for reaching a turn;
        ``None`` waits as long as it takes. A turn not reached in time raises
        :exc:`TimeoutError` and the work never runs.
    :param max_pending: the most waiters a key may have in this process
        (not counting its holder); one more raises :exc:`~inturn.QueueFull`
        at once. ``None`` is unbounded.
    :param backend: where the lines are shared with other processes; see
        :mod:`inturn.backends`. ``None`` (or a
        :class:`~inturn.backends.LocalBackend`) keeps them in this process.
        With a backend, this process's line for a key still orders its own
        tasks, and the task at its head takes the key's turn from the
        backend, which orders the processes; keys must then be ``str``,
        ``bytes`` or ``int``. Every caller may use it: tasks of any event
        loop (one after another or at once, in any thread) and threads,
        blocking (the file backend waits in the kernel; an asyncio-only
        backend such as Redis is driven for threads by one small thread of
        this process). A queue made before a fork works in each child.
    :param max_running: the most work running at once across all keys, or
        ``None`` for no bound. Work first reaches its key's turn, then waits
        for a running slot: work waiting in a key's line holds no slot, so a
        key whose work runs never takes a second one (with ``concurrency``
        1), and a task already running takes none for a nested turn. Slots
        are granted in the order turns started waiting for one; a key whose
        next work is ready when its work ends waits behind the keys already
        waiting, so one hot key cannot starve the others. Waiting for a slot
        counts in ``timeout``.
    :param concurrency: how many may hold one key at once (a keyed
        semaphore): turns are still granted in FIFO order, up to this many
        at a time. 1 (a keyed lock) by default; above 1 only in process.
    :param max_hold: the longest, in seconds, work may hold its turn: work
        still holding it then is cancelled (at an ``await``: a thread, or
        a plain function run by :meth:`run`, cannot be interrupted), its
        caller gets :exc:`~inturn.HoldTimeout`, and the next in line starts
        only once the cancelled work has finished. ``None``: no limit.
        Async callers only; a blocking call on a queue with it raises
        :exc:`TypeError`.
    :param name: what to call the queue in its repr, its log lines and its
        metrics (:meth:`observe`, :mod:`inturn.otel`): a short printable
        string, or ``None``.
    :param pending: ``"all"`` (the default) runs every call in turn;
        ``"latest"``: while a key is busy, this process keeps at most one
        waiting work for it, and a newer call of :meth:`run`,
        :meth:`run_sync`, :meth:`submit` or a decorated function takes the
        waiting one's place in the line (a work that holds the key but has
        not started, as one waiting for a backend's grant or a running slot,
        runs the newest work instead of its own). The replaced work never runs, the
        running work is never interrupted, and every caller is answered
        (``on_superseded``). If the newer caller gives up (cancelled, timed
        out) before the key's turn, the work it replaced is back in its
        place (but a replaced :meth:`submit`'s handle lets its work go, and
        follows what runs, or is cancelled if nothing does). A work is
        started at most once: if its run is cut (its turn's caller cancelled
        or interrupted), its own caller gets that cancellation or interrupt,
        and the works it replaced, which did not run, wait again, the newest
        to run; a run cut by ``max_hold`` answers them all with its
        :exc:`~inturn.HoldTimeout`. A :meth:`keyed` block, a turn on several
        keys, and a call with ``timeout=0`` are never replaced: they wait as
        always. Each process conflates its own calls only, unless
        ``across="processes"`` (see "Latest wins" in the docs).
    :param on_superseded: what the caller of a replaced work gets:
        ``"join"`` (the default), the outcome of the work that runs in its
        place (its result, or its error); ``"raise"``,
        :exc:`~inturn.Superseded` at once (and a caller whose turn ran newer
        work instead of its own gets ``Superseded`` too, whatever that work's
        outcome, but its own cancellation or interrupt). A caller's
        ``timeout`` counts from its own call, up to the start of its work or
        of the one it follows.
    :param debounce: seconds: a call first waits, even for a free key,
        until no newer call for its key came for that long (each call
        restarts the key's quiet period, as a trailing debounce does), then
        its work takes its place in the key's line, or, with
        ``pending="latest"``, the place of the key's work waiting there;
        within the quiet period the latest wins (answered by
        ``on_superseded``). With ``max_pending``, a burst is refused
        (:exc:`~inturn.QueueFull`, to each of its callers) when its quiet
        period ends, if the line is full then. :meth:`drain` and
        :meth:`close` end every quiet period at once. ``None``: none.
    :param max_wait: seconds: the longest a debounced call waits for a quiet
        period, from the first call of a burst, so that a key that never
        goes quiet still runs. ``None``: as long as it takes.
    :param across: where ``pending="latest"`` keeps one waiting work per
        key: ``"process"`` (the default), in each process, which never
        waits on another process's calls to answer its own; or
        ``"processes"``, among every process that shares the key's line
        through the backend (a :class:`~inturn.backends.file.FileBackend`).
        A process's latest work then runs only if no newer work of another
        process waits for the key, or ran since it was called (newer: called
        later, on the host's monotonic clock); else its callers are
        answered once that newer work has run: a ``"raise"`` caller with
        :exc:`~inturn.Superseded`, a ``"join"`` caller with ``None`` if the
        newer work returned (its result stays in its process) or
        ``Superseded`` if it failed. A burst spread over several processes
        while the key is busy costs one run. If the process of the newer
        work dies (or gives up) before that work returned, the newest work a
        live process still waits for runs instead: the key always ends at
        the newest state a live process wants. Each caller's ``timeout``
        bounds its wait, as always. ``debounce`` stays each process's.
    :raises ValueError: ``timeout`` or ``max_pending`` is negative,
        ``max_running`` or ``concurrency`` is below 1, ``max_hold`` is not
        positive, ``concurrency`` is above 1 with a backend, ``name`` is
        empty or not printable, ``pending`` or ``on_superseded`` is not one
        of its words, ``debounce`` or ``max_wait`` is not positive,
        ``max_wait`` is given without ``debounce`` or is shorter than it,
        or ``concurrency`` is above 1 with ``pending="latest"`` or ``debounce``,
        or ``across="processes"`` with a backend that cannot keep it.
    :raises TypeError: a setting has the wrong type, or ``backend`` is not a
        backend.
    """

    __slots__ = (
        "__weakref__",
        "_backend",
        "_book",
        "_max_hold",
        "_policy",
        "_registry",
        "_submissions",
        "_timeout",
    )

    def __init__(
        self,
        *,
        timeout: float | None = None,
        max_pending: int | None = None,
        backend: Backend | LocalBackend | None = None,
        max_running: int | None = None,
        concurrency: int = 1,
        max_hold: float | None = None,
        name: str | None = None,
        pending: Literal["all", "latest"] = "all",
        on_superseded: Literal["join", "raise"] = "join",
        debounce: float | None = None,
        max_wait: float | None = None,
        across: Literal["process", "processes"] = "process",
    ) -> None:
        name = check_name(name)
        self._timeout = check_timeout(timeout)
        max_pending = check_count("max_pending", max_pending, none=True, least=0)
        max_running = check_count("max_running", max_running, none=True)
        concurrency = check_count("concurrency", concurrency, none=False)  # type: ignore[assignment]
        self._backend = check_backend(backend, concurrency)
        self._policy = check_policy(pending, on_superseded, debounce, max_wait, concurrency)
        if check_across(across, self._backend):
            self._policy = self._policy._replace(across=True)
        self._max_hold = check_hold(max_hold)
        self._registry = Registry(
            backend=self._backend,
            concurrency=concurrency,
            max_pending=max_pending,
            plain=(
                self._backend is None
                and max_running is None
                and concurrency == 1
                and self._max_hold is None
                and self._policy.debounce is None
            ),
            name=name,
        )
        self._book = Book(self._registry)
        self._registry.slots = None if max_running is None else Slots(max_running, self._registry)
        # submit()'s work (its handles not finished yet), and the failed ones nobody awaited
        self._submissions = Submissions(
            self._registry, self._timeout, self._max_hold, self._policy, self._book
        )
        _QUEUES.add(self)

    # -- taking turns ---------------------------------------------------------

    @overload
    async def run(
        self, key: Hashable, fn: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs
    ) -> R: ...

    @overload
    async def run(
        self, key: Hashable, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R: ...

    async def run(self, key: Hashable, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Wait for ``key``'s turn, then return ``fn(*args, **kwargs)``.

        The result is awaited when it is awaitable. The turn ends when ``fn``
        returns or raises; its exception propagates to this caller only.

        :raises TimeoutError: the turn was not reached within the queue's
            ``timeout``; ``fn`` was not called.
        :raises QueueFull: ``key`` already has ``max_pending`` waiters.
        :raises QueueClosed: the queue is closed.
        :raises TypeError: ``key`` is unhashable or ``fn`` is not callable.
        """
        # The hot path of the library: every line of it is measured.
        registry = self._registry
        mode = registry.mode
        try:
            task = mode.current_task()
        except RuntimeError:
            raise outside_asyncio("run()") from None
        lines = registry.lines
        try:
            line = lines.get(key)
        except TypeError:
            raise unhashable(key) from None
        if (
            task is None
            or loop_of(task) is not mode.fast_loop
            or (line is not None and (self._policy.latest or held_by(line, task)))
        ):
            keys = (key,) if self._backend is None else self._backend.order((key,))
            timeout, hold = self._timeout, self._max_hold
            return await self._run_keyed(keys, fn, args, kwargs, timeout, hold, task)
        # NOTE: the licensed inline path (see _registry): a free key on the fast
        # loop is a dict insert, and its release a pop, as try_take and finish do.
        # (A busy key: the wait in its line that a turn alone makes.)
        if line is None:
            lines[key] = task
        elif not callable(fn):
            raise TypeError(f"inturn: run() needs a callable, got {describe(fn)}")
        elif queued := line_up(registry, key, task, self._timeout, self._timeout, registry):
            try:  # (awaited in this frame: see line_up)
                await queued[1]
            except BaseException as error:
                give_up(registry, key, queued, error, registry)
                raise
            seated(registry, key, task, queued)
        try:
            # fn() and fn(*args) are cheaper than fn(*args, **kwargs) when they fit
            result = fn(*args, **kwargs) if kwargs else fn(*args) if args else fn()
            if type(result) is CoroutineType or (result is not None and isawaitable(result)):
                result = await result
        except BaseException as error:
            registry.release((key,), task, error, None, 0.0)
            raise
        if mode.shared:  # switched while this task held the key
            registry.release((key,), task, None, result, 0.0)
        else:
            if (line := lines.pop(key)) is not task:  # (waiters: it is handed on)
                registry.hand_on(key, line, result)
            registry.tally.completed += 1
        return result

    def _run_keyed(
        self,
        keys: tuple[Hashable, ...],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        hold: float | None,
        task: asyncio.Task[Any] | None = None,
        policy: Policy | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """The coroutine that takes the turns of keys as keyed() does, calls fn, releases.

        ``task``: the caller's, awaiting it at once (run(): keys are checked and ordered);
        ``policy``: a decorated function's conflation (the queue's if None), for one key.
        """
        if not callable(fn):
            raise TypeError(f"inturn: run() needs a callable, got {describe(fn)}")
        if task is None:
            keys = self._registry.ordered(keys)
        registry = self._registry
        label = None if registry.tally.observer is None else function_label(fn)
        ticket = None
        if (policy := policy or self._policy).conflates and len(keys) == 1 and timeout != 0:
            home = loop_here() if task is None else loop_of(task)
            ticket = Ticket(self._book, keys[0], policy, (fn, args, kwargs, None), label, home)
        turn = Turn(registry, keys, timeout, hold, False, ticket)
        if task is not None and loop_of(task) is not registry.mode.solo:
            registry.mode.settle(loop_of(task))  # (settle's test, one call less)
        return call_in_turn(turn, fn, args, kwargs, task, label=label)

    @overload
    def run_sync(
        self, key: Hashable, fn: Callable[P, Coroutine[Any, Any, Any]], /, *args: Any, **kwargs: Any
    ) -> NoReturn: ...

    @overload
    def run_sync(
        self, key: Hashable, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R: ...

    def run_sync(self, key: Hashable, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Block this thread until ``key``'s turn, then return ``fn(*args, **kwargs)``.

        The thread form of :meth:`run`, for plain functions, with the same
        guarantees: the key is shared with the queue's tasks and other
        threads, FIFO among all of them. The turn ends when ``fn`` returns or
        raises; its exception propagates to this caller only.

        :raises TimeoutError: the turn was not reached within the queue's
            ``timeout``; ``fn`` was not called.
        :raises QueueFull: ``key`` already has ``max_pending`` waiters.
        :raises QueueClosed: the queue is closed.
        :raises RuntimeError: called inside a running event loop (it would
            block the loop), except by the task that holds ``key`` already.
        :raises TypeError: ``key`` is unhashable, ``fn`` is not callable or
            is an ``async def`` (use :meth:`run`).
        :raises ~inturn.LeaseLost: on a shared backend, the turn was lost
            while ``fn`` ran (see :class:`Turn`); ``fn`` ran.
        :raises ~inturn.BackendUnavailable: the backend could not be
            reached; ``fn`` was not called.
        """
        return self._run_keyed_sync((key,), fn, args, kwargs, self._timeout)

    def _run_keyed_sync(
        self,
        keys: tuple[Hashable, ...],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        policy: Policy | None = None,
    ) -> Any:
        """Take the turns of keys for this thread, call fn, release: every sync call's path.

        ``policy``: as _run_keyed's.
        """
        if not callable(fn):
            raise TypeError(f"inturn: run_sync() needs a callable, got {describe(fn)}")
        keys = self._registry.ordered(keys)
        policy = policy or self._policy
        observed = self._registry.tally.observer is not None
        token = FUNCTION.set(function_label(fn)) if observed else None
        try:
            ticket = None
            if policy.conflates and len(keys) == 1 and timeout != 0 and loop_here() is None:
                label = FUNCTION.get() if observed else None
                work = (fn, args, kwargs, None)
                ticket = Ticket(self._book, keys[0], policy, work, label, None)
            turn = ThreadTurn(self._registry, keys, timeout, self._max_hold, False, ticket)
            return call_in_turn_sync(turn, fn, args, kwargs)
        finally:
            if token is not None:
                FUNCTION.reset(token)

    def keyed(
        self,
        *keys: Hashable,
        timeout: float | _Unset | None = UNSET,
        max_hold: float | _Unset | None = UNSET,
        transaction: bool = False,
    ) -> Turn:
        """Hold one or more keys for the duration of a ``with`` or ``async with`` block.

        ``async with queue.keyed("acct-1", "acct-2") as turn:`` waits (as a
        task) for the turn of every key, then runs the block holding all of
        them; ``with queue.keyed(...)`` does the same for a thread, blocking
        it while it waits. Several keys are taken one at a time in one global
        order, so two holders of overlapping key sets can never deadlock; if
        the turn of a later key is not reached (timeout, cancellation), the
        keys already taken are released and the block never runs.

        :param keys: one or more hashable keys; duplicates count once.
        :param timeout: the limit, in seconds, for reaching the turn of every
            key; the queue's ``timeout`` when not given, ``None`` for none.
        :param max_hold: the longest the block may hold the keys: it is
            cancelled then, and raises :exc:`~inturn.HoldTimeout` once it has
            ended (see the queue's ``max_hold``); the queue's when not
            given, ``None`` for none. ``async with`` only.
        :param transaction: on a database backend
            (:class:`~inturn.backends.postgres.PostgresBackend`), hold the
            keys on one connection, :attr:`Turn.connection`, and run the
            block in a transaction on it: leaving the block commits, an
            exception rolls back, and the keys are free for the next in line
            only once the commit or rollback has finished.
        :returns: a :class:`Turn`, the (async) context manager that takes the
            turns on entry, binds itself, and releases them on exit.
        :raises TypeError: no key was given, or a key is unhashable (at once);
            ``transaction=True`` on a backend without transactions (at once).
        :raises TimeoutError: on entry, the turn was not reached in time.
        :raises QueueFull: on entry, a key already has ``max_pending`` waiters.
        :raises QueueClosed: on entry, the queue is closed.
        :raises RuntimeError: on ``with`` entry inside a running event loop,
            unless its current task holds the keys already.
        :raises TypeError: on ``with`` entry, with a ``max_hold``.
        """
        limit = self._timeout if timeout is UNSET else check_timeout(timeout)  # type: ignore[arg-type]
        hold = self._max_hold if max_hold is UNSET else check_hold(max_hold)  # type: ignore[arg-type]
        if transaction is not False:
            check_transaction(transaction, self._backend)  # (then it is True)
        elif len(keys) == 1 and self._backend is None:
            try:
                hash(keys[0])
            except TypeError:
                raise unhashable(keys[0]) from None
            return Turn(self._registry, keys, limit, hold)
        if not keys:
            raise TypeError("inturn: keyed() needs at least one key")
        return Turn(self._registry, self._registry.ordered(keys), limit, hold, transaction)

    # -- fire and forget ---------------------------------------------------------------

    @overload
    async def submit(
        self, key: Hashable, fn: Callable[P, Awaitable[R]], /, *args: P.args, **kwargs: P.kwargs
    ) -> Handle[R]: ...

    @overload
    async def submit(
        self, key: Hashable, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs
    ) -> Handle[R]: ...

    async def submit(
        self, key: Hashable, fn: Callable[..., Any], /, *args: Any, **kwargs: Any
    ) -> Handle[Any]:
        """Queue ``fn(*args, **kwargs)`` in ``key``'s line; return its handle.

        The work joins the key's line at this call, in arrival order with
        every other caller of the key (:meth:`run`, :meth:`keyed`, threads,
        other submissions), and runs as :meth:`run` would run it, in a task
        of its own. While the key is busy it waits in the line as data, not
        as a task: its task is made when the line hands it the key (so a hot
        key's backlog costs no task per work). It runs in the context that
        this call had (contextvars), and its wait counts in the queue's
        ``timeout``.

        With ``max_running`` it also applies backpressure: while every
        running slot is busy, or promised to works submitted but not started
        yet, it waits until one frees, unless the work will wait in its
        key's line (the key is busy) or the caller runs in a slot itself (a
        work submitting more work never waits on itself). Without waiting it
        does not yield to the event loop.

        Await the returned :class:`~inturn.Handle` for the work's result, or
        cancel it. An error that nobody awaits is raised later by
        ``await queue.drain(raise_errors=True)`` (use :meth:`batch` to scope
        submissions and their errors). If the key already has
        ``max_pending`` waiting, the handle fails at once with
        :exc:`~inturn.QueueFull`; if the work does not reach its turn within
        the queue's ``timeout``, with :exc:`TimeoutError` (it never runs).

        If ``submit`` is cancelled while it waits, the work was not queued.

        :raises QueueClosed: the queue is closed.
        :raises TypeError: ``key`` is unhashable (or, with a backend, not
            ``str``, ``bytes`` or ``int``), or ``fn`` is not callable.
        """
        return await submit(self._submissions, key, fn, args, kwargs, None)

    def batch(self, *, on_error: Literal["wait", "cancel"] = "wait") -> Batch:
        """Scope submissions: ``async with queue.batch() as batch: await batch.submit(...)``.

        Like :class:`asyncio.TaskGroup`, but keyed: ``batch.submit(key, fn,
        ...)`` is :meth:`submit` (same lines, FIFO per key, backpressure),
        and leaving the block waits for the batch's own submissions, not the
        rest of the queue's work. It then raises an :class:`ExceptionGroup`
        of the errors nobody awaited (the block's own error first, if it
        raised one), so none is lost; with no error, everything submitted
        has finished when the block is left (acknowledge the batch then).

        :param on_error: on the first error of a submission (or of the
            block), ``"wait"`` lets the rest run to their end; ``"cancel"``
            cancels the rest, and the block (as a TaskGroup does), then waits
            until they finished. A block cancelled from outside cancels its
            submissions, waits for them, and lets the cancellation go on.
        :raises ValueError: ``on_error`` is neither ``"wait"`` nor ``"cancel"``.
        """
        return Batch(self._submissions, on_error)

    @overload
    def queue_by_key(  # type: ignore[overload-overlap]  # a coroutine function is decorated
        self, fn: Callable[P, Coroutine[Any, Any, R]], /
    ) -> QueuedFunction[P, R]: ...

    @overload
    def queue_by_key(self, fn: Callable[P, R], /) -> SyncQueuedFunction[P, R]: ...

    @overload
    def queue_by_key(
        self,
        fn: None = None,
        /,
        *,
        key: KeySpec = None,
        keys: KeysSpec | None = None,
        timeout: float | _Unset | None = UNSET,
        coalesce: bool = False,
        max_hold: float | _Unset | None = UNSET,
        pending: Literal["all", "latest"] | _Unset = UNSET,
        on_superseded: Literal["join", "raise"] | _Unset = UNSET,
        debounce: float | _Unset | None = UNSET,
        max_wait: float | _Unset | None = UNSET,
    ) -> Decorator: ...

    def queue_by_key(
        self,
        fn: Any = None,
        /,
        *,
        key: KeySpec = None,
        keys: KeysSpec | None = None,
        timeout: float | _Unset | None = UNSET,
        coalesce: bool = False,
        max_hold: float | _Unset | None = UNSET,
        pending: Literal["all", "latest"] | _Unset = UNSET,
        on_superseded: Literal["join", "raise"] | _Unset = UNSET,
        debounce: float | _Unset | None = UNSET,
        max_wait: float | _Unset | None = UNSET,
    ) -> Any:
        """Decorate a function so that its calls queue by key on this queue.

        Usable bare (``@queue.queue_by_key``) or called. Works on ``async
        def`` and plain ``def`` functions and methods (plain,
        ``classmethod``, ``staticmethod``); the decorated function keeps its
        name, docstring, signature and ``inspect.iscoroutinefunction()``.
        Each call waits for its key's turn, runs, and releases the key, with
        the guarantees of the queue: a call of an ``async def`` waits as a
        task, a call of a plain ``def`` blocks its thread (see
        :meth:`run_sync`), and both share the key's line.

        :param key: what a call's key is:

            - ``None``: every call shares one key, the function's
              module-qualified name;
            - a ``str`` without ``{``: that constant key;
            - a ``str`` template, formatted with the call's arguments by
              parameter name, defaults applied: ``"stock-{product_id}"``,
              ``"conv-{self.conversation_id}"``;
            - a callable, called with one argument: a read-only mapping of the
              call's arguments by parameter name, defaults applied. (Pass it
              as ``key=``: a function passed by position is the function to
              decorate.)
        :param keys: instead of ``key``, several keys taken together (see
            :meth:`keyed`): a list of constants and templates, or a callable
            given the same mapping and returning an iterable of keys.
        :param timeout: the limit for reaching a turn; the queue's when not
            given, ``None`` for none.
        :param coalesce: when true, a call made while a call of this function
            with the same key is in flight (running, or waiting for its turn)
            returns that call's result, or raises its exception, instead of
            queueing another run. If that call is cancelled, the waiting call
            queues a run of its own. (``async def`` only.) On a queue with
            ``pending="latest"``, coalescing decides for this function: as a
            call in flight is joined, no call of it waits to be replaced.
        :param max_hold: the longest a call may hold its turn: it is
            cancelled then and raises :exc:`~inturn.HoldTimeout` (see the
            queue's ``max_hold``); the queue's when not given, ``None`` for
            none. (``async def`` only.)
        :param pending: ``"latest"``: a call made while its key is busy
            takes the place of this function's waiting call, if any (see the
            queue's ``pending``); ``"all"``: every call runs. The queue's
            when not given.
        :param on_superseded: ``"join"`` or ``"raise"``: what the caller of
            a replaced call gets (see the queue's); the queue's when not given.
        :param debounce: seconds of quiet a call waits for before it joins
            its key's line (see the queue's); the queue's when not given,
            ``None`` for none.
        :param max_wait: the longest a debounced call waits for quiet; the
            queue's when not given, ``None`` for no bound.
        :returns: the decorated function, with ``.queue`` (this queue) and
            ``.key_of(*args, **kwargs)`` (the key, or tuple of keys, a call
            with those arguments would use).
        :raises TypeError: at decoration, a spec has the wrong type, a key
            or anything but a ``def`` is passed by position (a key or a key
            function goes in ``key=``), a plain ``def`` is decorated with
            ``coalesce=True`` or a ``max_hold``, ``coalesce=True`` is given
            with a ``pending="latest"`` or ``debounce`` of the decorator's
            own, or ``keys=`` is.
        :raises ValueError: at decoration, a template names a parameter the
            function does not have, or a conflation setting is wrong (see
            the queue's).
        """
        from ._decorator import Runner, decorate, is_decoratable

        runner = Runner(self, self._run_keyed, self._run_keyed_sync, self._policy)
        if is_decoratable(fn) and (key is not None or keys is not None):
            raise TypeError(
                "inturn: queue_by_key() takes the function to decorate, or key=/keys=, "
                f"not both; got {describe(fn)} by position"
            )
        policy = self._policy.given(pending, on_superseded, debounce, max_wait, self.concurrency)
        return decorate(runner, fn, key, keys, timeout, coalesce, max_hold, policy)

    # -- looking at the lines -----------------------------------------------------

    def is_active(self, key: Hashable) -> bool:
        """Whether a task or thread of this process holds or waits for ``key`` on this queue.

        This process's view, also on a queue with a shared backend: a key
        that only other processes hold or wait for is not active here. The
        view across processes is the backend's ``lines()``
        (:meth:`~inturn.backends.file.FileBackend.lines`,
        :meth:`~inturn.backends.redis.RedisBackend.lines`, or ``python -m
        inturn inspect``); :class:`~inturn.backends.postgres.PostgresBackend`
        has none yet.
        """
        return key in self._registry.lines or key in self._book.waiting

    @property
    def active_keys(self) -> frozenset[Hashable]:
        """The keys that a task or thread holds or waits for, at this moment (with
        ``debounce``, also a key whose callers wait out its quiet period)."""
        with self._registry.mode.guard():
            return frozenset(self._registry.lines).union(self._book.quiet_keys())

    @property
    def active_count(self) -> int:
        """How many keys a task or thread holds or waits for (see :attr:`active_keys`)."""
        lines = self._registry.lines
        return len(lines) + sum(key not in lines for key in self._book.quiet_keys())

    def pending(self, key: Hashable) -> int:
        """How many tasks and threads of this process wait for ``key``, not counting its holder(s).

        This process's view, as :meth:`is_active`'s: with a shared backend,
        the waiters of other processes are not counted (the backend's
        ``lines()`` lists every process's, where it has one). With
        ``pending="latest"`` or ``debounce``, every caller still waiting
        counts, also those whose work was replaced (they wait for the newer
        work's outcome).
        """
        return self._registry.pending(key) + self._book.callers(key)

    def current(self, key: Hashable) -> asyncio.Future[Any] | None:
        """An awaitable of the outcome of ``key``'s current holder, or ``None``.

        For a :meth:`run`, :meth:`run_sync` or decorated call it resolves to
        that call's result, or raises its exception; for a :meth:`keyed`
        block, to ``None`` when the block ends. ``None`` is returned when
        nothing holds the key (or the key was just handed over and its next
        holder has not started). Awaiting it, or cancelling the awaiter,
        never affects the holder; if the holder is cancelled, awaiting it
        raises ``CancelledError``. Call it inside a running event loop. On a
        queue with ``concurrency`` above 1, always ``None``: a key has
        several holders, and no one outcome.
        """
        loop = asyncio.get_running_loop()
        with self._registry.mode.guard():
            return self._registry.watch(key, loop)

    def stats(self) -> QueueStats:
        """A snapshot of the queue: running and waiting work, counts, times.

        Cheap enough for a metrics exporter to call every second: the counts
        are kept as turns end, and the rest is one pass over the active keys.
        Safe from any thread (a metrics exporter's, say) while the queue's
        event loop runs: the counts are then as of one moment or the next.
        """
        registry = self._registry
        slots = registry.slots
        with registry.mode.guard():
            holders, waiting = registry.holders()
            running = len(holders) if slots is None else len(slots.holders)
            in_line = 0 if slots is None else slots.waiting
            return registry.tally.snapshot(running, in_line, waiting, registry.timed)

    # -- lifecycle ------------------------------------------------------------------

    def observe(self, observer: Observer | None) -> None:
        """Report each turn of this queue to ``observer`` from now on; ``None`` stops.

        The observer hears of each turn's wait when it starts, of its hold
        and outcome when it ends, and of each turn that never started
        (timed out, refused by ``max_pending``, cancelled, the backend
        unreachable), labelled by the function the turn runs, never by its
        key: see :class:`~inturn.Observer`. :func:`inturn.otel.instrument`
        is one observer; a queue has at most one (a new one replaces it).

        An unobserved queue pays nothing for this: its uncontended turns
        take inlined paths that check for no observer. An observed queue
        takes every turn through the general, timed path instead: about
        9 µs an uncontended turn against 0.8 µs, plus the observer's own
        cost. A turn already running when the observer is set is not
        reported, or only its end, without its hold time.
        """
        self._registry.observe(observer)

    @property
    def name(self) -> str | None:
        """The queue's name (``name=``): in its repr, and in its logs and metrics."""
        return self._registry.name

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return not self._registry.open

    @property
    def timeout(self) -> float | None:
        """The default limit, in seconds, for reaching a turn."""
        return self._timeout

    @property
    def max_pending(self) -> int | None:
        """The most waiters a key may have, or ``None``."""
        return self._registry.max_pending

    @property
    def max_running(self) -> int | None:
        """The most work that may run at once across keys, or ``None``."""
        return None if self._registry.slots is None else self._registry.slots.size

    @property
    def concurrency(self) -> int:
        """How many may hold one key at once."""
        return self._registry.concurrency

    @property
    def max_hold(self) -> float | None:
        """The longest work may hold its turn before it is cancelled, or ``None``."""
        return self._max_hold

    async def drain(self, *, raise_errors: bool = False) -> None:
        """Wait until every task or thread pending or running at this call has finished.

        A task created just before (``create_task(decorated(...))`` then
        ``await queue.drain()``) counts: drain first lets tasks that are
        scheduled to start take their first step, which submits their work.
        Work submitted later is not waited for. Errors of the drained work
        reach their own callers, not this one. Cancelling a drain only stops
        the waiting.

        :param raise_errors: then raise, as an :class:`ExceptionGroup`, the
            errors of :meth:`submit`'s work that failed and that nobody
            awaited (each is raised once; a batch's are its own).
        """
        loop = running_loop("drain()")
        await asyncio.sleep(0)  # let tasks created before this call submit their work
        self._book.flush()  # (work being debounced joins its line now)
        future = loop.create_future()
        # their tasks end just after they leave the lines: wait for that too
        submitted = self._submissions.of_loop(loop)
        # the last mark may be reached in another thread, once the queue is shared
        with self._registry.mode.guard_for(loop):
            marked = self._registry.mark(lambda: wake(future))
        if marked:
            await future
        if submitted:
            await asyncio.wait(submitted)
        if raise_errors:
            claim(self._submissions.unclaimed)

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Block this thread until every caller pending or running at this call has finished.

        The thread form of :meth:`drain`. Return True once drained, False if
        ``timeout`` seconds passed first.

        :raises RuntimeError: called inside a running event loop (use :meth:`drain`).
        """
        limit = check_timeout(timeout)
        if loop_here() is not None:
            raise RuntimeError(
                "inturn: drain_sync() would freeze the running event loop; "
                "use `await queue.drain()`"
            )
        done = threading.Event()
        self._registry.mode.for_threads()
        self._book.flush()
        with self._registry.mode.for_threads():
            if not self._registry.mark(done.set):
                return True
        return done.wait(limit)

    def close(self) -> None:
        """Refuse new work: every later submission raises :exc:`~inturn.QueueClosed`.

        Work already holding or waiting for a turn goes on, and a caller that
        holds a key may still take it again; work being debounced joins its
        key's line now (its quiet period ends). Closing twice is harmless.
        """
        self._book.flush()
        self._registry.close()

    async def aclose(self) -> None:
        """Close the queue, wait for the work already in it (:meth:`drain`), close the backend."""
        running_loop("aclose()")
        self.close()
        await self.drain()
        if self._backend is not None:
            await self._backend.aclose()

    @property
    def backend(self) -> Backend | LocalBackend:
        """Where the lines live: a shared backend, or the in-process :class:`LocalBackend`."""
        return LocalBackend() if self._backend is None else self._backend

    def __repr__(self) -> str:
        shown, active = self._registry.summary(5)
        quiet = [key for key in self._book.quiet_keys() if key not in self._registry.lines]
        shown += [f"{describe(key)}: quiet (debounce)" for key in quiet[: max(0, 5 - len(shown))]]
        active += len(quiet)
        if active > 5:
            shown.append("...")
        state = "closed" if not self._registry.open else "open"
        where = "" if self._backend is None else f" on {self._backend!r}"
        mode = ", shared by threads" if self._registry.mode.shared else ""
        name = "" if self._registry.name is None else f" {self._registry.name!r}"
        return f"<KeyedQueue{name} {state}{where}{mode}, {active} active {{{', '.join(shown)}}}>"
