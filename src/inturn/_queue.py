"""KeyedQueue: a line per key, FIFO within a key, concurrent across keys."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Hashable
from inspect import isawaitable
from types import CoroutineType
from typing import TYPE_CHECKING, Any, Final, TypeVar, final, overload

from ._errors import QueueClosed, QueueFull
from ._keys import KeySpec, KeysSpec, order_keys, unhashable
from ._tasks import current_task as _current_task
from ._turn import Turn
from .backends._base import Backend
from .backends._local import LocalBackend

if TYPE_CHECKING:
    from typing_extensions import ParamSpec

    from ._decorator import QueuedFunction

    P = ParamSpec("P")

__all__ = ("UNSET", "KeyedQueue")

R = TypeVar("R")


@final
class _Unset:
    """The type of :data:`UNSET`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


#: The default of per-call ``timeout=`` arguments: use the queue's timeout.
#: (``None`` means no time limit.)
UNSET: Final = _Unset()


def _check_timeout(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"inturn: timeout must be a number of seconds or None, got {timeout!r}")
    if math.isnan(timeout) or timeout < 0:
        raise ValueError(f"inturn: timeout must be >= 0 seconds or None, got {timeout!r}")
    return None if math.isinf(timeout) else float(timeout)


def _check_max_pending(max_pending: int | None) -> int | None:
    if max_pending is None:
        return None
    if isinstance(max_pending, bool) or not isinstance(max_pending, int):
        raise TypeError(f"inturn: max_pending must be an int or None, got {max_pending!r}")
    if max_pending < 0:
        raise ValueError(f"inturn: max_pending must be >= 0 or None, got {max_pending!r}")
    return max_pending


def _expire(waiter: asyncio.Future[None], key: Hashable, timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(
            TimeoutError(f"inturn: the turn for key {key!r} was not reached within {timeout:g} s")
        )


def _publish(watchers: list[asyncio.Future[Any]], error: BaseException | None, result: Any) -> None:
    """Hand a holder's outcome to the futures that current() gave out."""
    for watcher in watchers:
        if watcher.done():  # its awaiter was cancelled
            continue
        if error is None:
            watcher.set_result(result)
        elif isinstance(error, Exception):
            watcher.set_exception(error)
            watcher.exception()  # the holder's own caller gets the error; don't log it again
        else:  # cancelled, or interrupted
            watcher.cancel()


@final
class _Drain:
    """One drain() call: a mark at the tail of every line that was active."""

    __slots__ = ("future", "remaining")

    def __init__(self, remaining: int, future: asyncio.Future[None]) -> None:
        self.remaining = remaining  # marks not yet reached
        self.future = future

    def reached(self) -> None:
        """Count one mark as reached: everything ahead of it in its line has left."""
        self.remaining -= 1
        if not self.remaining and not self.future.done():
            self.future.set_result(None)


@final
class _Line:
    """A key's line once anyone but its holder has looked at it.

    While one task holds a key and nobody else asked about it, the queue maps
    the key straight to that task: no object is made on the uncontended path.
    """

    __slots__ = ("holder", "waiters", "waiting", "watchers")

    def __init__(self, holder: object) -> None:
        # The holding task; between a hand-off and the new holder waking up,
        # the waiter future that was handed the turn. Never None.
        self.holder = holder
        # FIFO of waiter futures and drain marks. A done future is a waiter
        # that left (cancelled or timed out) and is skipped at hand-off.
        self.waiters: deque[asyncio.Future[None] | _Drain] = deque()
        # How many futures in `waiters` are not done: the live waiters.
        self.waiting = 0
        # Futures from current(), resolved with the holder's outcome.
        self.watchers: list[asyncio.Future[Any]] | None = None

    def compact(self) -> None:
        """Drop waiters that left, once they outnumber the live ones."""
        if len(self.waiters) > 2 * self.waiting + 16:
            self.waiters = deque(w for w in self.waiters if type(w) is _Drain or not w.done())


@final
class KeyedQueue:
    """A registry of per-key FIFO lines: one task at a time per key.

    Work submitted under a key waits in that key's line and runs when it
    reaches the front; work under different keys runs concurrently. A line
    exists only while someone holds or waits for its key.

    Guarantees, for every way of taking a turn (:meth:`run`, :meth:`keyed`,
    :meth:`queue_by_key`):

    - Mutual exclusion: two tasks never hold the same key at once.
    - FIFO: turns are granted in submission order. A submission happens when
      the call's coroutine starts running, so the order of ``gather()`` or
      ``create_task()`` is the queue order.
    - Direct hand-off: a release hands the key to exactly the next waiter; a
      newcomer can never take it in between, and no other waiter is woken.
    - Errors stay with their caller: an exception in one holder reaches its
      own caller only, and the next in line still runs.
    - Cancellation: a cancelled waiter leaves the line without disturbing
      anyone behind it; a cancelled holder releases the key; a waiter
      cancelled just as it is handed the key passes the turn on.
    - Reentrancy: the task that holds a key may take it again (a decorated
      method calling another with the same key) and runs at once. Any other
      task, including one the holder spawned, waits its turn.
    - No leaks: once a key has no holder and no waiter, the queue keeps no
      reference to it.

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
        ``bytes`` or ``int``.
    :raises ValueError: ``timeout`` or ``max_pending`` is negative.
    :raises TypeError: ``timeout`` or ``max_pending`` is not a number, or
        ``backend`` is not a backend.
    """

    __slots__ = (
        "__weakref__",
        "_backend",
        "_fast",
        "_lines",
        "_max_pending",
        "_open",
        "_timeout",
        "_tokens",
    )

    def __init__(
        self,
        *,
        timeout: float | None = None,
        max_pending: int | None = None,
        backend: Backend | LocalBackend | None = None,
    ) -> None:
        # key -> the holding task, while nobody else asked about the key;
        # key -> _Line otherwise. A key is here exactly while it is active.
        self._lines: dict[Hashable, Any] = {}
        self._timeout = _check_timeout(timeout)
        self._max_pending = _check_max_pending(max_pending)
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
        # Whether a free key is taken with a dict insert: open, and in process.
        self._fast = self._backend is None

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
        task = _current_task()
        lines = self._lines
        try:
            line = lines.get(key)
        except TypeError:
            raise unhashable(key) from None
        if line is None and self._fast and task is not None:
            lines[key] = task  # uncontended: a dict insert, nothing allocated
        else:
            if not callable(fn):
                raise TypeError(f"inturn: run() needs a callable, got {fn!r}")
            if self._backend is not None:
                return await self._run_keyed((key,), fn, args, kwargs, self._timeout)
            # What _take() does, inlined: a coroutine less per contended call.
            waiter = self._join(key, task, line, self._timeout)
            if waiter is True:
                result = fn(*args, **kwargs)  # this task holds the key already
                return (await result) if isawaitable(result) else result
            if waiter is not False:
                line = lines[key]
                try:
                    await waiter
                except BaseException:
                    self._abandon(key, line, waiter)
                    raise
                line.holder = task
        try:
            # fn() and fn(*args) are cheaper than fn(*args, **kwargs) when they fit
            result = fn(*args, **kwargs) if kwargs else fn(*args) if args else fn()
            if type(result) is CoroutineType or isawaitable(result):
                result = await result
        except BaseException as error:
            if (line := lines.pop(key)) is not task:
                self._leave(key, line, error, None)
            raise
        if (line := lines.pop(key)) is not task:
            self._leave(key, line, None, result)
        return result

    async def _run_keyed(
        self,
        keys: tuple[Hashable, ...],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float | None,
    ) -> Any:
        """Take the turns of keys as keyed() does, call fn, release.

        The path of every call on a shared backend, and of the decorator for
        keys= and for a timeout of its own.
        """
        turn = Turn(self, self._ordered(keys), timeout)
        await turn.__aenter__()
        try:
            result = fn(*args, **kwargs)
            if isawaitable(result):
                result = await result
        except BaseException as error:
            if self._backend is None:
                turn.release(error, None)
            else:
                await turn._end_shared(error, None)
            raise
        if self._backend is None:
            turn.release(None, result)
        else:
            await turn._end_shared(None, result)
        return result

    def keyed(self, *keys: Hashable, timeout: float | _Unset | None = UNSET) -> Turn:
        """Hold one or more keys for the duration of an ``async with`` block.

        ``async with queue.keyed("acct-1", "acct-2") as turn:`` waits for the
        turn of every key, then runs the block holding all of them. Several
        keys are taken one at a time in one global order, so two holders of
        overlapping key sets can never deadlock; if the turn of a later key is
        not reached (timeout, cancellation), the keys already taken are
        released and the block never runs.

        :param keys: one or more hashable keys; duplicates count once.
        :param timeout: the limit, in seconds, for reaching the turn of every
            key; the queue's ``timeout`` when not given, ``None`` for none.
        :returns: a :class:`Turn`, the async context manager that takes the
            turns on entry, binds itself, and releases them on exit.
        :raises TypeError: no key was given, or a key is unhashable (at once).
        :raises TimeoutError: on entry, the turn was not reached in time.
        :raises QueueFull: on entry, a key already has ``max_pending`` waiters.
        :raises QueueClosed: on entry, the queue is closed.
        """
        limit = self._timeout if timeout is UNSET else _check_timeout(timeout)  # type: ignore[arg-type]
        if len(keys) == 1 and self._backend is None:
            try:
                hash(keys[0])
            except TypeError:
                raise unhashable(keys[0]) from None
            return Turn(self, keys, limit)
        if not keys:
            raise TypeError("inturn: keyed() needs at least one key")
        return Turn(self, self._ordered(keys), limit)

    @overload
    def queue_by_key(  # type: ignore[overload-overlap]  # a coroutine function is decorated
        self, key: Callable[P, Coroutine[Any, Any, R]], /
    ) -> QueuedFunction[P, R]: ...

    @overload
    def queue_by_key(
        self,
        key: KeySpec = None,
        *,
        keys: KeysSpec | None = None,
        timeout: float | _Unset | None = UNSET,
        coalesce: bool = False,
    ) -> Callable[[Callable[P, Coroutine[Any, Any, R]]], QueuedFunction[P, R]]: ...

    def queue_by_key(
        self,
        key: Any = None,
        *,
        keys: KeysSpec | None = None,
        timeout: float | _Unset | None = UNSET,
        coalesce: bool = False,
    ) -> Any:
        """Decorate an ``async def`` so that its calls queue by key on this queue.

        Usable bare (``@queue.queue_by_key``) or called. Works on functions
        and methods (plain, ``classmethod``, ``staticmethod``); the decorated
        function keeps its name, docstring, signature and
        ``inspect.iscoroutinefunction()``. Each call waits for its key's
        turn, runs, and releases the key, with the guarantees of the queue.

        :param key: what a call's key is:

            - ``None``: every call shares one key, the function's
              module-qualified name;
            - a ``str`` without ``{``: that constant key;
            - a ``str`` template, formatted with the call's arguments by
              parameter name, defaults applied: ``"stock-{product_id}"``,
              ``"conv-{self.conversation_id}"``;
            - a callable, called with one argument: a read-only mapping of the
              call's arguments by parameter name, defaults applied.
        :param keys: instead of ``key``, several keys taken together (see
            :meth:`keyed`): a list of constants and templates, or a callable
            given the same mapping and returning an iterable of keys.
        :param timeout: the limit for reaching a turn; the queue's when not
            given, ``None`` for none.
        :param coalesce: when true, a call made while a call of this function
            with the same key is in flight (running, or waiting for its turn)
            returns that call's result, or raises its exception, instead of
            queueing another run. If that call is cancelled, the waiting call
            queues a run of its own.
        :returns: the decorated function, with ``.queue`` (this queue) and
            ``.key_of(*args, **kwargs)`` (the key, or tuple of keys, a call
            with those arguments would use).
        :raises TypeError: at decoration, the function is not ``async def``
            or a spec has the wrong type.
        :raises ValueError: at decoration, a template names a parameter the
            function does not have.
        """
        from ._decorator import decorate, is_decoratable

        if is_decoratable(key) and keys is None:
            return decorate(self, key, None, None, timeout, coalesce)
        return decorate(self, None, key, keys, timeout, coalesce)

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

    def _join(
        self, key: Hashable, task: asyncio.Task[Any] | None, line: Any, timeout: float | None
    ) -> asyncio.Future[None] | bool:
        """Take key's turn for task at once, or join its line.

        Return True if task holds the key already (a reentrant call, which
        must not release it); False if task just took the free key; else the
        future to await: it completes when the key is handed to task (or
        fails with TimeoutError); the line it joined is then ``lines[key]``.
        Whoever awaits it calls :meth:`_abandon` if interrupted, and makes
        task the line's holder once it completes.
        """
        if task is None:
            raise RuntimeError("inturn: a turn can only be taken inside an asyncio task")
        if line is not None and (line is task or (type(line) is _Line and line.holder is task)):
            return True
        if not self._open:
            raise QueueClosed(
                f"inturn: the queue is closed; the work for key {key!r} was not queued"
            )
        lines = self._lines
        if line is None:
            lines[key] = task
            return False
        if type(line) is not _Line:
            line = lines[key] = _Line(line)
        if self._max_pending is not None and line.waiting >= self._max_pending:
            raise QueueFull(
                f"inturn: key {key!r} already has {line.waiting} waiting "
                f"(max_pending={self._max_pending}); the work was not queued"
            )
        if timeout is not None and timeout <= 0:
            raise TimeoutError(
                f"inturn: the turn for key {key!r} was not free (timeout={timeout:g} s)"
            )
        loop = task.get_loop()  # not get_running_loop(): no getpid() before 3.12
        waiter: asyncio.Future[None] = loop.create_future()
        line.waiters.append(waiter)
        line.waiting += 1
        if timeout is not None:
            timer = loop.call_later(timeout, _expire, waiter, key, timeout)
            waiter.add_done_callback(lambda _: timer.cancel())
        return waiter

    def _abandon(self, key: Hashable, line: _Line, waiter: asyncio.Future[None]) -> None:
        """Take an interrupted waiter out of the line it joined (cancelled or timed out).

        ``line`` is the object the waiter joined: by now it may have left the
        lines (its holder left and no live waiter remained), and a new line
        may even stand for the same key.
        """
        if not waiter.cancelled() and waiter.done() and waiter.exception() is None:
            # The turn was handed over just as the waiter was interrupted:
            # pass it on, or the line would stall behind a task that left.
            self._leave(key, self._lines.pop(key), None, None)
        else:
            waiter.cancel()  # so that the hand-off skips it
            line.waiting -= 1
            line.compact()

    async def _take(
        self, key: Hashable, task: asyncio.Task[Any] | None, line: Any, timeout: float | None
    ) -> bool:
        """Take key's turn for task, waiting in line if need be.

        Return False if task held the key already (a reentrant call, which
        must not release it), True once task holds it.
        """
        waiter = self._join(key, task, line, timeout)
        if waiter is True:
            return False
        if waiter is not False:
            line = self._lines[key]
            try:
                await waiter
            except BaseException:
                self._abandon(key, line, waiter)
                raise
            line.holder = task
        return True

    async def _take_all(
        self, keys: tuple[Hashable, ...], task: asyncio.Task[Any] | None, timeout: float | None
    ) -> tuple[Hashable, ...]:
        """Take the turns of keys (in the global order) within timeout; return those taken.

        If any turn is not reached, the ones already taken are released.
        """
        taken: list[Hashable] = []
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            for key in keys:
                if deadline is not None:
                    timeout = deadline - loop.time()
                if await self._take(key, task, self._lines.get(key), timeout):
                    taken.append(key)
        except BaseException as error:
            for key in reversed(taken):
                self._release(key, task, error, None)
            raise
        return tuple(taken)

    def _release(
        self, key: Hashable, task: object, error: BaseException | None, result: Any
    ) -> None:
        """End task's turn on key."""
        if (line := self._lines.pop(key)) is not task:
            self._leave(key, line, error, result)

    def _leave(self, key: Hashable, line: _Line, error: BaseException | None, result: Any) -> None:
        """End the turn of line's holder, just popped from the lines.

        Tell its watchers, then hand the key to the next waiter and put the
        line back, or leave the key out if nobody waits.
        """
        if line.watchers is not None:
            watchers, line.watchers = line.watchers, None
            _publish(watchers, error, result)
        waiters = line.waiters
        while waiters:
            waiter = waiters.popleft()
            if type(waiter) is _Drain:
                waiter.reached()
            elif not waiter.done():
                line.holder = waiter
                line.waiting -= 1
                waiter.set_result(None)
                self._lines[key] = line
                return

    # -- looking at the lines -----------------------------------------------------

    def is_active(self, key: Hashable) -> bool:
        """Whether a task holds or waits for ``key``."""
        return key in self._lines

    @property
    def active_keys(self) -> frozenset[Hashable]:
        """The keys that a task holds or waits for, at this moment."""
        return frozenset(self._lines)

    @property
    def active_count(self) -> int:
        """How many keys a task holds or waits for."""
        return len(self._lines)

    def pending(self, key: Hashable) -> int:
        """How many tasks wait for ``key``, not counting its holder."""
        line = self._lines.get(key)
        return line.waiting if type(line) is _Line else 0

    def current(self, key: Hashable) -> asyncio.Future[Any] | None:
        """An awaitable of the outcome of ``key``'s current holder, or ``None``.

        For a :meth:`run` or decorated call it resolves to that call's result,
        or raises its exception; for a :meth:`keyed` block, to ``None`` when
        the block ends. ``None`` is returned when nothing holds the key (or
        the key was just handed over and its next holder has not started).
        Awaiting it, or cancelling the awaiter, never affects the holder; if
        the holder is cancelled, awaiting it raises ``CancelledError``.
        """
        line = self._lines.get(key)
        if line is None:
            return None
        if type(line) is not _Line:
            line = self._lines[key] = _Line(line)
        elif not isinstance(line.holder, asyncio.Task):
            return None
        watcher: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if line.watchers is None:
            line.watchers = []
        line.watchers.append(watcher)
        return watcher

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

    async def drain(self) -> None:
        """Wait until every task pending or running at this call has finished.

        A task created just before (``create_task(decorated(...))`` then
        ``await queue.drain()``) counts: drain first lets tasks that are
        scheduled to start take their first step, which submits their work.
        Work submitted later is not waited for. Errors of the drained work
        reach their own callers, not this one. Cancelling a drain only stops
        the waiting.
        """
        await asyncio.sleep(0)  # let tasks created before this call submit their work
        lines = self._lines
        if not lines:
            return
        drain = _Drain(len(lines), asyncio.get_running_loop().create_future())
        for key, line in list(lines.items()):
            if type(line) is not _Line:
                line = lines[key] = _Line(line)
            line.waiters.append(drain)
        await drain.future

    def close(self) -> None:
        """Refuse new work: every later submission raises :exc:`~inturn.QueueClosed`.

        Work already holding or waiting for a turn goes on, and a task that
        holds a key may still take it again. Closing twice is harmless.
        """
        self._open = False
        self._fast = False

    async def aclose(self) -> None:
        """Close the queue, wait for the work already in it (:meth:`drain`), close the backend."""
        self.close()
        await self.drain()
        if self._backend is not None:
            await self._backend.aclose()

    @property
    def backend(self) -> Backend | LocalBackend:
        """Where the lines live: a shared backend, or the in-process :class:`LocalBackend`."""
        return LocalBackend() if self._backend is None else self._backend

    def __repr__(self) -> str:
        shown = []
        for key, line in itertools.islice(self._lines.items(), 5):
            waiting = line.waiting if type(line) is _Line else 0
            shown.append(f"{key!r}: held, {waiting} waiting")
        if len(self._lines) > 5:
            shown.append("...")
        state = "closed" if not self._open else "open"
        where = "" if self._backend is None else f" on {self._backend!r}"
        return f"<KeyedQueue {state}{where}, {len(self._lines)} active {{{', '.join(shown)}}}>"
