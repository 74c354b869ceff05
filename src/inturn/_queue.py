"""KeyedQueue: a line per key, FIFO within a key, concurrent across keys."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from contextlib import AbstractContextManager, nullcontext
from inspect import isawaitable
from threading import get_ident
from time import monotonic as _monotonic
from types import CoroutineType, MappingProxyType
from typing import TYPE_CHECKING, Any, Final, Literal, NoReturn, TypeVar, final, overload

from ._batch import Batch
from ._checks import UNSET, Deadline, check_count, check_hold, check_timeout, missed
from ._checks import Unset as _Unset
from ._errors import QueueClosed, QueueFull
from ._keys import KeySpec, KeysSpec, describe, order_keys, unhashable
from ._line import Drain as _Drain
from ._line import Gate as _Gate
from ._line import Line as _Line
from ._line import ThreadWaiter as _ThreadWaiter
from ._line import Waiter as _Waiter
from ._line import held_by as _held_by
from ._line import resolve as _resolve
from ._line import wake as _wake
from ._stats import QueueStats
from ._stats import Tally as _Tally
from ._submit import Handle, failures, submit, unawaited, wake_producers_behind
from ._tasks import current_task as _current_task
from ._tasks import in_loop_of as _soon
from ._tasks import outside_asyncio, running_loop
from ._turn import Turn, call_in_turn, call_in_turn_sync
from .backends._base import Backend
from .backends._local import LocalBackend

if TYPE_CHECKING:
    from typing_extensions import ParamSpec

    from ._decorator import Decorator, QueuedFunction, SyncQueuedFunction

    P = ParamSpec("P")

__all__ = ("UNSET", "KeyedQueue")

R = TypeVar("R")
W = TypeVar("W")


def _expire(waiter: asyncio.Future[None], key: Hashable, timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(_missed(key, timeout))


def _expire_slot(waiter: asyncio.Future[None], queue: KeyedQueue, timeout: float | None) -> None:
    if not waiter.done():
        waiter.set_exception(queue._slotless(timeout))


def _missed(key: Hashable, timeout: float | None) -> TimeoutError:
    return missed(f"the turn for key {describe(key)}", timeout)


def _outcome(future: asyncio.Future[Any], error: BaseException | None, result: Any) -> None:
    """Give a current() future the holder's outcome, unless its awaiter left."""
    if future.done():  # its awaiter was cancelled
        return
    if error is None:
        future.set_result(result)
    elif isinstance(error, Exception):
        future.set_exception(error)
        future.exception()  # the holder's own caller gets the error; don't log it again
    else:  # cancelled, or interrupted
        future.cancel()


#: Submitted work waiting in a line as data, beside the waiters of _line (see _submit).
_SUBMITTED: Final[type[Any]] = Handle

#: What a solo queue's changes of its lines hold instead of the lock.
_UNLOCKED: Final = nullcontext()


def _gone(loop: asyncio.AbstractEventLoop, thread: int) -> bool:
    """Whether loop, last run in thread, can run no step any more: closed, or its thread ended."""
    if loop.is_closed():
        return True
    return not loop.is_running() and all(t.ident != thread for t in threading.enumerate())


@final
class _Settling:
    """The switch of a queue to shared mode, until its solo loop is between steps.

    Before the switch, the solo loop's tasks change the lines without the
    lock. The switch turns that off, but a task of that loop may be midway
    through such a change in its current step; the lines are safe to lock
    once that loop has run a callback (so ended that step) or stopped.
    """

    __slots__ = ("done", "loop", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: int) -> None:
        self.loop = loop
        self.thread = thread  # its thread: the only one that need not wait
        self.done = threading.Event()
        try:
            loop.call_soon_threadsafe(self.done.set)
        except RuntimeError:  # closed: it runs nothing any more
            self.done.set()

    def wait(self) -> None:
        while not self.done.wait(0.005):
            if not self.loop.is_running():  # stopped: no step in progress
                self.done.set()


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
      ``create_task()`` is the queue order; a thread submits when it calls,
      and :meth:`submit` when it is called.
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
        ``bytes`` or ``int``, and the callers tasks of one event loop at a
        time (backends are asyncio clients).
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
    :raises ValueError: ``timeout`` or ``max_pending`` is negative,
        ``max_running`` or ``concurrency`` is below 1, ``max_hold`` is not
        positive, or ``concurrency`` is above 1 with a backend.
    :raises TypeError: a setting has the wrong type, or ``backend`` is not a
        backend.
    """

    __slots__ = (
        "__weakref__",
        "_arrival",
        "_backend",
        "_concurrency",
        "_handles",
        "_lines",
        "_lock",
        "_max_hold",
        "_max_pending",
        "_open",
        "_owner",
        "_settling",
        "_shared",
        "_slots",
        "_solo",
        "_solo_thread",
        "_tally",
        "_timeout",
        "_tokens",
        "_unclaimed",
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
    ) -> None:
        # key -> the holder (a task or a thread), while nobody else asked
        # about the key; key -> _Line otherwise. A key is here exactly while
        # it is active.
        self._lines: dict[Hashable, Any] = {}
        self._timeout = check_timeout(timeout)
        self._max_pending = check_count("max_pending", max_pending, none=True, least=0)
        self._open = True
        self._tokens = itertools.count(1)
        if backend is None or isinstance(backend, LocalBackend):
            self._backend: Backend | None = None
        elif isinstance(backend, Backend):
            self._backend = backend
        else:
            raise TypeError(
                f"inturn: backend= takes a backend from inturn.backends (LocalBackend, "
                f"FileBackend, RedisBackend) or None, got {backend!r}"
            )
        max_running = check_count("max_running", max_running, none=True)
        self._concurrency: int = check_count("concurrency", concurrency, none=False)  # type: ignore[assignment]
        if self._concurrency > 1 and self._backend is not None:
            raise ValueError(
                f"inturn: concurrency={concurrency} needs the in-process lines; "
                f"{self._backend!r} grants one holder per key"
            )
        self._max_hold = check_hold(max_hold)
        # The running slots, with max_running.
        self._slots = None if max_running is None else _Gate(max_running)
        self._tally = _Tally()
        # submit()'s handles not finished yet, and the failed ones nobody awaited
        self._handles: set[Handle[Any]] = set()
        self._unclaimed: list[Handle[Any]] = []
        # NOTE: two modes. Solo: one event loop (`_solo`, running in thread
        # `_solo_thread`) is the only user, and its tasks change the lines
        # without a lock. Shared (`_shared`, for good, `_solo` None): every
        # change of the lines holds `_lock`. `_arrival` serializes the
        # decisions between them; `_settling` is the switch until the solo
        # loop is known to be between steps (see _Settling).
        self._solo: asyncio.AbstractEventLoop | None = None
        self._solo_thread = 0
        self._shared = False
        self._lock = threading.Lock()
        self._arrival = threading.Lock()
        self._settling: _Settling | None = None
        # The loop whose tasks take a free key with a bare dict insert: the
        # solo loop while the queue is open and in process, else None.
        self._owner: asyncio.AbstractEventLoop | None = None

    # -- taking turns ---------------------------------------------------------

    @overload
    async def run(
        self,
        key: Hashable,
        fn: Callable[P, Awaitable[R]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
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
        try:
            task = _current_task()
        except RuntimeError:
            raise outside_asyncio("run()") from None
        lines = self._lines
        try:
            line = lines.get(key)
        except TypeError:
            raise unhashable(key) from None
        # (task._loop: the attribute behind get_loop(), on C and Python tasks
        # alike, and half its cost here)
        if line is None and task is not None and task._loop is self._owner:
            lines[key] = task  # uncontended: a dict insert, nothing allocated
        else:
            if not callable(fn):
                raise TypeError(f"inturn: run() needs a callable, got {describe(fn)}")
            if task is None or task._loop is not self._owner:
                # not the solo loop's: the first call, a closed or shared queue, a backend
                return await self._run_keyed(
                    (key,), fn, args, kwargs, self._timeout, self._max_hold
                )
            # What _take() does, inlined: a coroutine less per contended call.
            waiter = self._join(key, task, line, self._timeout)
            if waiter is True:
                result = fn(*args, **kwargs)  # this task holds the key already
                return (await result) if isawaitable(result) else result
            if waiter is not False:
                line = lines[key]
                try:
                    await waiter
                except BaseException as error:
                    self._abandon(key, line, waiter, error)
                    raise
                line.holder = task
        try:
            # fn() and fn(*args) are cheaper than fn(*args, **kwargs) when they fit
            result = fn(*args, **kwargs) if kwargs else fn(*args) if args else fn()
            if type(result) is CoroutineType or isawaitable(result):
                result = await result
        except BaseException as error:
            if self._shared:  # switched while this task held the key
                self._release(key, task, error, None)
            elif (line := lines.pop(key)) is not task:
                self._leave(key, line, error, None)
            self._ended(error, False, 0.0)
            raise
        if self._shared:
            self._release(key, task, None, result)
            self._ended(None, False, 0.0)
        else:
            if (line := lines.pop(key)) is not task:
                self._leave(key, line, None, result)
            self._tally.completed += 1
        return result

    async def _run_keyed(
        self,
        keys: tuple[Hashable, ...],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
        hold: float | None,
    ) -> Any:
        """Take the turns of keys as keyed() does, call fn, release.

        The path of every call on a shared backend, a shared queue or one
        with flow control, and of the decorator for keys=, or for a timeout
        or max_hold of its own.
        """
        return await call_in_turn(Turn(self, self._ordered(keys), timeout, hold), fn, args, kwargs)

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
            is an ``async def`` (use :meth:`run`), or the queue has a backend.
        """
        return self._run_keyed_sync((key,), fn, args, kwargs, self._timeout)

    def _run_keyed_sync(
        self,
        keys: tuple[Hashable, ...],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
    ) -> Any:
        """Take the turns of keys for this thread, call fn, release: every sync call's path."""
        if not callable(fn):
            raise TypeError(f"inturn: run_sync() needs a callable, got {describe(fn)}")
        turn = Turn(self, self._ordered(keys), timeout, self._max_hold)
        return call_in_turn_sync(turn, fn, args, kwargs)

    def keyed(
        self,
        *keys: Hashable,
        timeout: float | _Unset | None = UNSET,
        max_hold: float | _Unset | None = UNSET,
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
        :returns: a :class:`Turn`, the (async) context manager that takes the
            turns on entry, binds itself, and releases them on exit.
        :raises TypeError: no key was given, or a key is unhashable (at once).
        :raises TimeoutError: on entry, the turn was not reached in time.
        :raises QueueFull: on entry, a key already has ``max_pending`` waiters.
        :raises QueueClosed: on entry, the queue is closed.
        :raises RuntimeError: on ``with`` entry inside a running event loop,
            unless its current task holds the keys already.
        :raises TypeError: on ``with`` entry, with a ``max_hold``.
        """
        limit = self._timeout if timeout is UNSET else check_timeout(timeout)  # type: ignore[arg-type]
        hold = self._max_hold if max_hold is UNSET else check_hold(max_hold)  # type: ignore[arg-type]
        if len(keys) == 1 and self._backend is None:
            try:
                hash(keys[0])
            except TypeError:
                raise unhashable(keys[0]) from None
            return Turn(self, keys, limit, hold)
        if not keys:
            raise TypeError("inturn: keyed() needs at least one key")
        return Turn(self, self._ordered(keys), limit, hold)

    # -- fire and forget ---------------------------------------------------------------

    @overload
    async def submit(
        self,
        key: Hashable,
        fn: Callable[P, Awaitable[R]],
        /,
        *args: P.args,
        **kwargs: P.kwargs,
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
        submissions and their errors).

        If ``submit`` is cancelled while it waits, the work was not queued.
        If the key already has ``max_pending`` waiting, the handle fails at
        once with :exc:`~inturn.QueueFull`; if the work does not reach its
        turn within the queue's ``timeout``, with :exc:`TimeoutError` (it
        never runs).

        :raises QueueClosed: the queue is closed.
        :raises TypeError: ``key`` is unhashable (or, with a backend, not
            ``str``, ``bytes`` or ``int``), or ``fn`` is not callable.
        """
        return await submit(self, key, fn, args, kwargs, self._unclaimed, None)

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
        return Batch(self, on_error)

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
            queues a run of its own. (``async def`` only.)
        :param max_hold: the longest a call may hold its turn: it is
            cancelled then and raises :exc:`~inturn.HoldTimeout` (see the
            queue's ``max_hold``); the queue's when not given, ``None`` for
            none. (``async def`` only.)
        :returns: the decorated function, with ``.queue`` (this queue) and
            ``.key_of(*args, **kwargs)`` (the key, or tuple of keys, a call
            with those arguments would use).
        :raises TypeError: at decoration, a spec has the wrong type, a key
            or anything but a ``def`` is passed by position (a key or a key
            function goes in ``key=``),
            a plain ``def`` is decorated with ``coalesce=True``, a
            ``max_hold``, or for a queue with a backend.
        :raises ValueError: at decoration, a template names a parameter the
            function does not have.
        """
        from ._decorator import decorate, is_decoratable

        if is_decoratable(fn):
            if key is not None or keys is not None:
                raise TypeError(
                    "inturn: queue_by_key() takes the function to decorate, or key=/keys=, "
                    f"not both; got {describe(fn)} by position"
                )
            return decorate(self, fn, None, None, timeout, coalesce, max_hold)
        return decorate(self, None, key, keys, timeout, coalesce, max_hold)

    # -- the lines --------------------------------------------------------------

    def _ordered(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        if self._backend is not None:
            return self._backend.order(keys)
        if len(keys) == 1:
            try:
                hash(keys[0])
            except TypeError:
                raise unhashable(keys[0]) from None
            return keys
        try:
            return order_keys(keys)
        except TypeError:
            for key in keys:
                try:
                    hash(key)
                except TypeError:
                    raise unhashable(key) from None
            raise

    def _arrive(self, loop: asyncio.AbstractEventLoop | None) -> bool:
        """Decide how a caller works on the lines: True for lock-free (solo), False for locked.

        ``loop`` is the caller's running loop, ``None`` for a thread. The
        first loop to come makes the queue solo, and so does a later loop of
        the solo loop's thread (the earlier one is not running then), or of
        any thread once the solo loop is gone (see _gone); a thread, or a
        loop in another thread while the solo loop may still run, switches
        it to shared for good.
        """
        with self._arrival:
            if not self._shared:
                here = get_ident()
                solo = self._solo
                if loop is not None and (
                    solo is None or self._solo_thread == here or _gone(solo, self._solo_thread)
                ):
                    self._solo = loop
                    self._solo_thread = here
                    self._owner = loop if self._open and self._plain else None
                    return True
                if self._backend is not None:
                    raise RuntimeError(
                        f"inturn: this queue's backend ({self._backend!r}) serves the tasks "
                        f"of one event loop at a time, and {solo!r}, which used it first, is "
                        "still open in another thread; close that loop first (asyncio.run() "
                        "does when it returns), or give each loop its own queue"
                    )
                self._owner = self._solo = None
                self._shared = True
                if solo is not None and self._solo_thread != here:
                    self._settling = _Settling(solo, self._solo_thread)
        return False

    @property
    def _plain(self) -> bool:
        """Whether turns are the bare lines: no backend and no flow control."""
        return (
            self._backend is None
            and self._slots is None
            and self._concurrency == 1
            and self._max_hold is None
        )

    def _guard(self) -> AbstractContextManager[object]:
        """What to hold while changing the lines: the lock once shared, else nothing."""
        return self._locked() if self._shared else _UNLOCKED

    def _guard_for(self, loop: asyncio.AbstractEventLoop) -> AbstractContextManager[object]:
        """_guard() for a task of loop, which may first settle the queue's mode (_arrive)."""
        return _UNLOCKED if loop is self._solo or self._arrive(loop) else self._locked()

    def _locked(self) -> threading.Lock:
        """The lock of a shared queue's lines, once it is safe to take (see _Settling)."""
        settling = self._settling
        if settling is not None and settling.thread != get_ident():
            settling.wait()
            self._settling = None
        return self._lock

    def _admit(
        self, key: Hashable, holder: object, line: Any, timeout: float | None
    ) -> _Line | _Gate | bool:
        """Take key's turn for holder at once, or find the line it must wait in.

        Return True if holder holds the key already (a reentrant call, which
        must not release it); False if holder just took the free key; else
        the line to join. Raise if the queue is closed, the line is full, or
        the key is busy and there is no time to wait.
        """
        if _held_by(line, holder):
            return True
        if not self._open:
            raise QueueClosed(
                f"inturn: the queue is closed; the work for key {describe(key)} was not queued"
            )
        lines = self._lines
        if self._concurrency != 1:  # a _Gate per key
            if line is None:
                line = lines[key] = _Gate(self._concurrency)
            if line.enter(holder) is False:
                return False
        elif line is None:
            lines[key] = holder
            return False
        elif type(line) is not _Line:
            lines[key] = line = _Line(line)
        if self._max_pending is not None and line.waiting >= self._max_pending:
            raise QueueFull(
                f"inturn: key {describe(key)} already has {line.waiting} waiting "
                f"(max_pending={self._max_pending}); the work was not queued"
            )
        if timeout is not None and timeout <= 0:
            self._tally.timed_out += 1
            raise _missed(key, 0)
        return line  # type: ignore[no-any-return]

    def _join(
        self, key: Hashable, task: asyncio.Task[Any] | None, line: Any, timeout: float | None
    ) -> asyncio.Future[None] | bool:
        """Take key's turn for task at once, or join its line.

        Return True if task holds the key already (a reentrant call, which
        must not release it); False if task just took the free key; else the
        future to await: it completes when the key is handed to task (or
        fails with TimeoutError); the line it joined is then ``lines[key]``.
        Whoever awaits it calls :meth:`_abandon` if interrupted, and makes
        task the line's holder once it completes. On a shared queue, the
        caller holds the lock.
        """
        if task is None:
            raise RuntimeError("inturn: a turn can only be taken inside an asyncio task")
        line = self._admit(key, task, line, timeout)
        if type(line) is bool:
            return line
        loop = task.get_loop()  # not get_running_loop(): no getpid() before 3.12
        waiter: asyncio.Future[None] = loop.create_future()
        line.waiters.append(waiter)
        line.waiting += 1
        if timeout is not None:
            timer = loop.call_later(timeout, _expire, waiter, key, timeout)
            waiter.add_done_callback(lambda _: timer.cancel())
        return waiter

    def _abandon(
        self, key: Hashable, line: _Line | _Gate, waiter: _Waiter, error: BaseException
    ) -> None:
        """Take a waiter that error interrupted out of the line it joined (cancelled or timed out).

        ``line`` is the object the waiter joined: by now it may have left the
        lines (its holder left and no live waiter remained), and a new line
        may even stand for the same key.
        """
        with self._guard():
            self._drop(key, line, waiter)
            self._tally.missed(error)

    def _drop(self, key: Hashable, line: _Line | _Gate, waiter: _Waiter) -> None:
        if type(line) is _Gate:
            line.drop(waiter, self._shared)
            if line.idle:
                del self._lines[key]
        elif line.holder is waiter:
            # The turn was handed over just as the waiter was interrupted:
            # pass it on, or the line would stall behind a caller that left.
            self._leave(key, self._lines.pop(key), None, None)
        else:
            waiter.cancel()  # so that the hand-off skips it
            line.waiting -= 1
            line.compact()

    async def _take(
        self,
        key: Hashable,
        task: asyncio.Task[Any] | None,
        timeout: float | None,
        limit: float | None = None,
    ) -> bool:
        """Take key's turn for task, waiting in line if need be.

        Return False if task held the key already (a reentrant call, which
        must not release it), True once task holds it. ``timeout`` is the
        time left to wait; ``limit``, if given, the caller's whole limit,
        which a TimeoutError names.
        """
        if task is None:
            raise RuntimeError("inturn: a turn can only be taken inside an asyncio task")
        lines = self._lines
        try:
            with self._guard_for(task.get_loop()):
                waiter = self._join(key, task, lines.get(key), timeout)
                if type(waiter) is bool:
                    return waiter is False
                line = lines[key]
            try:
                await waiter
            except BaseException as error:
                self._abandon(key, line, waiter, error)
                raise
        except TimeoutError:
            if limit is None:
                raise
            raise _missed(key, limit) from None
        if type(line) is _Gate:
            with self._guard():
                line.settle(waiter, task, self._shared)
        else:
            line.holder = task
        return True

    async def _take_all(
        self, keys: tuple[Hashable, ...], task: asyncio.Task[Any] | None, timeout: float | None
    ) -> tuple[Hashable, ...]:
        """Take the turns of keys (in the global order) within timeout; return those taken.

        If any turn is not reached, the ones already taken are released.
        """
        taken: list[Hashable] = []
        deadline = Deadline(timeout, asyncio.get_running_loop().time)
        try:
            for key in keys:
                if await self._take(key, task, deadline.left(), timeout):
                    taken.append(key)  # noqa: PERF401 - one at a time: the rollback needs them
        except BaseException as error:
            for key in reversed(taken):
                self._release(key, task, error, None)
            raise
        return tuple(taken)

    def _take_all_sync(
        self, keys: tuple[Hashable, ...], timeout: float | None
    ) -> tuple[object, tuple[Hashable, ...]]:
        """Take the turns of keys for this thread, blocking it; return (holder, keys taken).

        Inside a running event loop, only a reentrant call is possible: the
        loop's current task holds every key already, and is the holder.
        """
        if self._backend is not None:
            raise TypeError(
                f"inturn: this queue's backend ({self._backend!r}) serves async callers only; "
                "take its turns with `async with`, `await queue.run(...)` or an async def"
            )
        if asyncio._get_running_loop() is not None:
            task = _current_task()
            lines = self._lines
            if task is not None and all(_held_by(lines.get(key), task) for key in keys):
                return task, ()
            raise RuntimeError(
                "inturn: a blocking turn (run_sync(), `with keyed()`, a decorated plain def) "
                f"was taken inside a running event loop, for {', '.join(map(describe, keys))}; "
                "waiting would freeze the loop. Use `await queue.run(...)` or `async with`, "
                "or call it in a thread: `await asyncio.to_thread(...)`"
            )
        if not self._shared:
            self._arrive(None)
        me = threading.current_thread()
        deadline = Deadline(timeout, _monotonic)
        taken: list[Hashable] = []
        try:
            for key in keys:
                if self._take_sync(key, me, deadline.left(), timeout):
                    taken.append(key)  # noqa: PERF401 - one at a time: the rollback needs them
        except BaseException as error:
            for key in reversed(taken):
                self._release(key, me, error, None)
            raise
        return me, tuple(taken)

    def _take_sync(
        self, key: Hashable, me: object, timeout: float | None, limit: float | None
    ) -> bool:
        """Take key's turn for thread me, blocking it in line if need be (see _take).

        ``timeout`` is the time left to wait, ``limit`` the caller's whole limit.
        """
        lines = self._lines
        with self._locked():
            line = self._admit(key, me, lines.get(key), timeout)
            if type(line) is bool:
                return line is False
            waiter = _ThreadWaiter()
            line.waiters.append(waiter)
            line.waiting += 1
        try:
            if timeout is None:
                waiter.lock.acquire()
            else:
                waiter.lock.acquire(timeout=timeout)
        except BaseException as error:  # interrupted: KeyboardInterrupt, or a signal handler's
            self._abandon(key, line, waiter, error)
            raise
        with self._locked():
            if type(line) is _Gate:
                if waiter in line.holders:
                    line.settle(waiter, me, True)
                    return True
            elif line.holder is waiter:
                line.holder = me
                return True
            self._drop(key, line, waiter)
            self._tally.timed_out += 1
        assert limit is not None
        raise _missed(key, limit)

    def _release(
        self, key: Hashable, holder: object, error: BaseException | None, result: Any
    ) -> None:
        """End holder's turn on key."""
        if self._concurrency != 1:
            with self._guard():
                gate = self._lines[key]
                gate.leave(holder, self._shared)
                if gate.idle:
                    del self._lines[key]
        elif self._shared:
            with self._locked():
                if (line := self._lines.pop(key)) is not holder:
                    self._leave(key, line, error, result)
        elif (line := self._lines.pop(key)) is not holder:
            self._leave(key, line, error, result)

    # -- the running slots (max_running) ------------------------------------------------

    async def _take_slot(
        self, holder: asyncio.Task[Any], timeout: float | None, limit: float | None
    ) -> bool:
        """Take a running slot for a task that holds its keys; False if it holds one already.

        ``timeout`` is the time left to wait, ``limit`` the caller's whole limit (for its error).
        """
        slots = self._slots
        assert slots is not None
        loop = holder.get_loop()
        with self._guard():
            waiter = self._slot_or_wait(slots, holder, timeout, limit, loop.create_future)
            if type(waiter) is bool:
                return waiter
        timer = None
        if timeout is not None:
            timer = loop.call_later(timeout, _expire_slot, waiter, self, limit)
        try:
            await waiter
        except BaseException as error:
            with self._guard():
                slots.drop(waiter, self._shared)
                self._tally.missed(error)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        with self._guard():
            self._slot_taken(slots, waiter, holder)
        return True

    def _take_slot_sync(self, me: object, timeout: float | None, limit: float | None) -> bool:
        """Take a running slot for thread me, blocking it if need be (see _take_slot)."""
        slots = self._slots
        assert slots is not None
        with self._locked():
            waiter = self._slot_or_wait(slots, me, timeout, limit, _ThreadWaiter)
            if type(waiter) is bool:
                return waiter
        try:
            if timeout is None:
                waiter.lock.acquire()
            else:
                waiter.lock.acquire(timeout=timeout)
        except BaseException as error:
            with self._locked():
                slots.drop(waiter, True)
                self._tally.missed(error)
            raise
        with self._locked():
            if waiter in slots.holders:
                self._slot_taken(slots, waiter, me)
                return True
            slots.drop(waiter, True)
            self._tally.timed_out += 1
        raise self._slotless(limit)

    def _slot_or_wait(
        self,
        slots: _Gate,
        holder: object,
        timeout: float | None,
        limit: float | None,
        make: Callable[[], W],
    ) -> W | bool:
        """Take a free slot for holder, or line up a waiter made by make() for one.

        Return True if holder took a slot now, False if it holds one, else the
        waiter. Raise if there is no time to wait. The caller holds the guard.
        """
        entered = slots.enter(holder)
        if entered is not None:
            if not entered and slots.producers:
                wake_producers_behind(self, slots)
            return not entered
        if timeout is not None and timeout <= 0:
            self._tally.timed_out += 1
            raise self._slotless(limit)
        waiter = make()
        slots.waiters.append(waiter)  # type: ignore[arg-type]
        slots.waiting += 1
        return waiter

    def _slot_taken(self, slots: _Gate, waiter: _Waiter, holder: object) -> None:
        """Record holder in the slot its waiter was handed. The caller holds the guard."""
        slots.settle(waiter, holder, self._shared)
        if slots.producers:
            wake_producers_behind(self, slots)

    def _slotless(self, timeout: float | None) -> TimeoutError:
        size = self._slots.size if self._slots is not None else 0
        return missed(f"a running slot (max_running={size})", timeout)

    def _free_slot(self, holder: object) -> None:
        """End holder's running slot, handing it to the next in the slot line."""
        slots = self._slots
        assert slots is not None
        with self._guard():
            slots.leave(holder, self._shared)

    def _started(self, since: float) -> float:
        """Count the wait of a timed turn that was submitted at since and starts now; return now."""
        now = _monotonic()
        with self._guard():
            self._tally.waited += now - since
        return now

    def _missed(self, error: BaseException) -> None:
        """Count a turn that was never reached (see _Tally.missed)."""
        with self._guard():
            self._tally.missed(error)

    def _ended(self, error: BaseException | None, cut: bool, since: float) -> None:
        """Count a turn that ended (see _Tally.ended); a timed one started at since."""
        with self._guard():
            self._tally.ended(error, cut)
            if since:
                self._tally.held += _monotonic() - since

    def _leave(self, key: Hashable, line: _Line, error: BaseException | None, result: Any) -> None:
        """End the turn of line's holder, just popped from the lines.

        Tell its watchers, then hand the key to the next waiter and put the
        line back, or leave the key out if nobody waits. On a shared queue,
        the caller holds the lock.
        """
        if line.watchers is not None:
            watchers, line.watchers = line.watchers, None
            for watcher in watchers:
                _soon(watcher, _outcome, watcher, error, result)
        waiters = line.waiters
        shared = self._shared
        while waiters:
            waiter = waiters.popleft()
            if type(waiter) is _Drain:
                waiter.reached()
            elif not waiter.done():
                line.waiting -= 1
                # NOTE: the line is the waiter's before it is woken: a task of
                # another loop may run at once and make itself the holder.
                line.holder = waiter
                self._lines[key] = line
                if type(waiter) is _SUBMITTED:  # submitted work waiting as data: its task starts
                    if not waiter._handed(shared):  # type: ignore[union-attr]  # its loop is closed
                        del self._lines[key]
                        continue
                elif shared:
                    if not _wake(waiter):  # its loop is closed: its task is gone
                        del self._lines[key]
                        continue
                else:
                    waiter.set_result(None)  # type: ignore[union-attr]
                return

    # -- looking at the lines -----------------------------------------------------

    def is_active(self, key: Hashable) -> bool:
        """Whether a task or thread holds or waits for ``key``."""
        return key in self._lines

    @property
    def active_keys(self) -> frozenset[Hashable]:
        """The keys that a task or thread holds or waits for, at this moment."""
        with self._guard():
            return frozenset(self._lines)

    @property
    def active_count(self) -> int:
        """How many keys a task or thread holds or waits for."""
        return len(self._lines)

    def pending(self, key: Hashable) -> int:
        """How many tasks and threads wait for ``key``, not counting its holder(s)."""
        line = self._lines.get(key)
        return line.waiting if type(line) is _Line or type(line) is _Gate else 0

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
        with self._guard():
            return self._watch(key, loop)

    def _watch(self, key: Hashable, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any] | None:
        line = self._lines.get(key)
        if line is None or type(line) is _Gate:
            return None  # (several holders: no one outcome to watch)
        if type(line) is not _Line:
            if type(line) is _SUBMITTED:
                return None  # submitted work holds the key, its task not started yet
            line = self._lines[key] = _Line(line)
        elif not isinstance(line.holder, asyncio.Task | threading.Thread):
            return None  # handed over to a waiter that has not started yet
        watcher: asyncio.Future[Any] = loop.create_future()
        if line.watchers is None:
            line.watchers = []
        line.watchers.append(watcher)
        return watcher

    def stats(self) -> QueueStats:
        """A snapshot of the queue: running and waiting work, counts, times.

        Cheap enough for a metrics exporter to call every second: the counts
        are kept as turns end, and the rest is one pass over the active keys.
        """
        holders: set[object] = set()
        waiting: dict[Hashable, int] = {}
        with self._guard():
            for key, line in self._lines.items():
                kind = type(line)
                if kind is _Line:
                    holders.add(line.holder)
                elif kind is _Gate:
                    holders.update(line.holders)
                else:
                    holders.add(line)
                    continue
                if line.waiting:
                    waiting[key] = line.waiting
            slots = self._slots
            tally = self._tally
            timed = not self._plain
            return QueueStats(
                running=len(holders) if slots is None else len(slots.holders),
                waiting_for_slot=0 if slots is None else slots.waiting,
                waiting=MappingProxyType(waiting),
                completed=tally.completed,
                failed=tally.failed,
                timed_out=tally.timed_out,
                cancelled=tally.cancelled,
                wait_time=tally.waited if timed else None,
                hold_time=tally.held if timed else None,
            )

    # -- lifecycle ------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return not self._open

    @property
    def timeout(self) -> float | None:
        """The default limit, in seconds, for reaching a turn."""
        return self._timeout

    @property
    def max_pending(self) -> int | None:
        """The most waiters a key may have, or ``None``."""
        return self._max_pending

    @property
    def max_running(self) -> int | None:
        """The most work that may run at once across keys, or ``None``."""
        return None if self._slots is None else self._slots.size

    @property
    def concurrency(self) -> int:
        """How many may hold one key at once."""
        return self._concurrency

    @property
    def max_hold(self) -> float | None:
        """The longest work may hold its turn before it is cancelled, or ``None``."""
        return self._max_hold

    def _mark(self, finish: Callable[[], object]) -> bool:
        """Put a drain mark at the tail of every active line; False if there is none."""
        lines = self._lines
        if not lines:
            return False
        drain = _Drain(len(lines), finish)
        for key, line in list(lines.items()):
            if type(line) is _Gate and not line.waiting:
                line.mark(drain)  # nobody waits: it waits for the present holders
                continue
            if type(line) is not _Line and type(line) is not _Gate:
                line = lines[key] = _Line(line)
            line.waiters.append(drain)
        return True

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
        future = loop.create_future()
        # their tasks end just after they leave the lines: wait for that too
        submitted = [h._future for h in self._handles if h._future.get_loop() is loop]
        # the last mark may be reached in another thread, once the queue is shared
        with self._guard_for(loop):
            marked = self._mark(lambda: _soon(future, _resolve, future))
        if marked:
            await future
        if submitted:
            await asyncio.wait(submitted)
        if raise_errors and self._unclaimed:
            errors = unawaited(self._unclaimed)
            self._unclaimed.clear()
            if errors:
                raise failures(
                    f"inturn: {len(errors)} submitted work(s) failed and nobody awaited them",
                    errors,
                )

    def drain_sync(self, timeout: float | None = None) -> bool:
        """Block this thread until every caller pending or running at this call has finished.

        The thread form of :meth:`drain`. Return True once drained, False if
        ``timeout`` seconds passed first.

        :raises RuntimeError: called inside a running event loop (use :meth:`drain`).
        """
        limit = check_timeout(timeout)
        if asyncio._get_running_loop() is not None:
            raise RuntimeError(
                "inturn: drain_sync() would freeze the running event loop; "
                "use `await queue.drain()`"
            )
        if not self._shared:
            self._arrive(None)
        done = threading.Event()
        with self._locked():
            if not self._mark(done.set):
                return True
        return done.wait(limit)

    def close(self) -> None:
        """Refuse new work: every later submission raises :exc:`~inturn.QueueClosed`.

        Work already holding or waiting for a turn goes on, and a caller that
        holds a key may still take it again. Closing twice is harmless.
        """
        self._open = False
        self._owner = None

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
        lines = list(itertools.islice(self._lines.copy().items(), 6))
        shown = []
        for key, line in lines[:5]:
            waiting = line.waiting if type(line) is _Line or type(line) is _Gate else 0
            shown.append(f"{describe(key)}: held, {waiting} waiting")
        if len(lines) > 5:
            shown.append("...")
        state = "closed" if not self._open else "open"
        where = "" if self._backend is None else f" on {self._backend!r}"
        mode = ", shared by threads" if self._shared else ""
        return (
            f"<KeyedQueue {state}{where}{mode}, {len(self._lines)} active {{{', '.join(shown)}}}>"
        )
