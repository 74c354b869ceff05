"""Registry: the key -> line map of one queue, and who may change it how (the thread mode).

Invariant: a key is in ``lines`` exactly while a task or thread holds or
waits for it, mapped to its holder while nobody else asked about it (no
object is made on the uncontended path), to a :class:`~inturn._line.Line`
(or a :class:`~inturn._line.Gate`, with ``concurrency`` above 1) otherwise.
This module is the only writer of that map, except the facade's inlined
uncontended ``run()``, which inserts and pops a bare holder on the owning
loop exactly as :meth:`Registry.admit` and :meth:`Registry.release` would.

Thread mode: while one event loop uses a queue (solo), its tasks change the
lines without a lock. The first thread, or a second loop in another thread,
switches the registry for good to locking every change (shared).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager, nullcontext
from threading import get_ident
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, Final, final

from ._checks import missed
from ._describe import describe
from ._errors import QueueClosed, QueueFull
from ._line import Deferred, Drain, Gate, Line, Places, ThreadWaiter, Waiter, held_by, wake
from ._order import order_keys, unhashable
from ._stats import Observer, Tally
from ._tasks import current_task as _current_task
from ._tasks import in_loop_of as _soon

if sys.version_info < (3, 12):  # pragma: no cover - depends on the interpreter
    from ._tasks import task_of_loop

if TYPE_CHECKING:
    from .backends._base import Backend

__all__ = ("Registry", "missed_turn")


def missed_turn(key: Hashable, timeout: float | None) -> TimeoutError:
    """The error of a turn on key not reached within timeout (None: the caller's limit)."""
    return missed(f"the turn for key {describe(key)}", timeout)


def _expire(waiter: asyncio.Future[None], key: Hashable, timeout: float) -> None:
    if not waiter.done():
        waiter.set_exception(missed_turn(key, timeout))


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


#: What a solo registry's changes of its lines hold instead of the lock.
_UNLOCKED: Final = nullcontext()


#: How many event loops in turn a backend that prefers one loop serves directly (see via).
_DIRECT_LOOPS: Final = 2


def _gone(loop: asyncio.AbstractEventLoop, thread: int) -> bool:
    """Whether loop, last run in thread, can run no step any more: closed, or its thread ended."""
    if loop.is_closed():
        return True
    return not loop.is_running() and all(t.ident != thread for t in threading.enumerate())


@final
class _Settling:
    """The switch of a registry to shared mode, until its solo loop is between steps.

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
class Registry:
    """One queue's lines: the key -> line map, its thread mode, and the tally of its turns.

    Its methods take and release one key's turn for one holder (a task or a
    thread); taking several keys, slots and backend grants is the Turn's.
    """

    __slots__ = (
        "__weakref__",
        "_arrival",
        "_direct",
        "_direct_thread",
        "_directs_ended",
        "_lock",
        "_one_loop",
        "_settling",
        "_solo",
        "_solo_at",
        "_solo_thread",
        "backend",
        "concurrency",
        "lines",
        "local",
        "max_pending",
        "name",
        "open",
        "owner",
        "plain",
        "shared",
        "tally",
        "tokens",
    )

    def __init__(
        self,
        *,
        backend: Backend | None,
        concurrency: int,
        max_pending: int | None,
        plain: bool,
        name: str | None = None,
    ) -> None:
        self.name = name  # the queue's, for its log lines
        # key -> the holder (a task or a thread), while nobody else asked
        # about the key; key -> Line (or Gate) otherwise.
        self.lines: dict[Hashable, Any] = {}
        self.backend = backend  # shares the lines with other processes, or None
        self.concurrency = concurrency  # holders per key: a Gate per key above 1
        self.max_pending = max_pending
        # Whether turns are the bare lines: no backend and no flow control.
        self.plain = plain
        self.open = True
        self.tally = Tally()
        self.tokens = itertools.count(1)  # in-process fencing tokens
        # NOTE: two modes. Solo: one event loop (`_solo`, running in thread
        # `_solo_thread`) is the only user, and its tasks change the lines
        # without a lock. Shared (`shared`, for good, `_solo` None): every
        # change of the lines holds `_lock`. `_arrival` serializes the
        # decisions between them; `_settling` is the switch until the solo
        # loop is known to be between steps (see _Settling).
        self._solo: asyncio.AbstractEventLoop | None = None
        self._solo_thread = 0
        # (_solo_thread, _solo), set in one store for current_task()
        self._solo_at: tuple[int, asyncio.AbstractEventLoop | None] = (0, None)
        self.shared = False
        self._lock = threading.Lock()
        self._arrival = threading.Lock()
        self._settling: _Settling | None = None
        # Whether the backend prefers one event loop per process; the loop whose
        # tasks call it directly (and its thread), and how many such ended (see via).
        self._one_loop = backend is not None and backend.capabilities.one_loop
        self._direct: asyncio.AbstractEventLoop | None = None
        self._direct_thread = 0
        self._directs_ended = 0
        # The loop whose tasks take a free key with a bare dict insert: the
        # solo loop while the queue is open and plain, else None.
        self.owner: asyncio.AbstractEventLoop | None = None
        # The loop whose tasks may take a free key at once, without the lock
        # (Turn.enter_now): the solo loop while the queue is open and holds
        # its lines in process, one holder per key; else None.
        self.local: asyncio.AbstractEventLoop | None = None

    if sys.version_info >= (3, 12):  # in C: cheap
        current_task = staticmethod(_current_task)
    else:  # pragma: no cover - depends on the interpreter

        def current_task(self) -> asyncio.Task[Any] | None:
            """asyncio.current_task(), looked up directly in the solo loop's own thread.

            (Before 3.12, current_task() is Python and calls getpid(): most of
            an uncontended turn's cost. One loop runs in a thread at a time,
            so in the solo loop's thread, a task running a step of it is this
            caller's; else, or outside a task, ask asyncio.)

            :raises RuntimeError: no event loop runs in this thread.
            """
            thread, loop = self._solo_at  # (one read: a consistent pair)
            if get_ident() == thread:
                task = task_of_loop(loop)
                if task is not None:
                    return task
            return _current_task()

    def forked(self, places: Places | None, task: object = None) -> None:
        """In a forked child: forget the parent's other threads and tasks, and its locks.

        Only the thread that forked lives on in the child, in the step of the
        task it ran then, if any. They keep the keys they held bare or at the
        head of a line (a raw ``os.fork()`` inside a ``with keyed()`` block
        returns into it); every other holder and waiter, and every lock they
        may have held at that instant, are the parent's. places: the queue's
        running slots, reset the same way.
        """
        keep = (threading.current_thread(), task)
        lines = self.lines
        for key, line in list(lines.items()):
            if line in keep:
                continue
            if type(line) is Line and line.holder in keep:
                lines[key] = line.holder
            elif type(line) is Gate and any(holder in line.holders for holder in keep):
                line.forked(keep)  # (a Gate is always in the lines while anyone holds it)
            else:
                del lines[key]
        if places is not None:
            places.forked(keep)
        self._lock = threading.Lock()
        self._arrival = threading.Lock()
        self._settling = None
        self._direct = None
        self._directs_ended = 0
        self._solo = self.owner = self.local = None
        self._solo_thread = 0
        self._solo_at = (0, None)
        self.shared = False

    def close(self) -> None:
        """Refuse new turns (a holder may still take its keys again)."""
        self.open = False
        self.owner = self.local = None

    def observe(self, observer: Observer | None, plain: bool) -> None:
        """Tell observer of every turn from now on (None: stop); plain: the queue's own setting.

        An observed queue times every turn, so it takes none of the inlined
        plain paths (run()'s and keyed()'s on the solo loop, a thread's on a
        free key): they count a turn without timing it, and they check
        nothing for an observer, so that an unobserved queue pays nothing.
        A turn already on such a path ends on it, unreported.
        """
        with self._arrival:
            self.tally.observer = observer
            self.plain = plain and observer is None
            self._inline(self._solo)

    def _inline(self, solo: asyncio.AbstractEventLoop | None) -> None:
        """Set whose tasks take the inlined turns: the solo loop's (or None's).

        ``local``: any in-process queue's, unobserved; ``owner``: a plain one's.
        """
        quick = (
            solo is not None
            and self.open
            and self.backend is None
            and self.concurrency == 1
            and self.tally.observer is None
        )
        self.local = solo if quick else None
        self.owner = solo if quick and self.plain else None

    # -- the thread mode ------------------------------------------------------------

    def arrive(self, loop: asyncio.AbstractEventLoop | None) -> bool:
        """Decide how a caller works on the lines: True for lock-free (solo), False for locked.

        ``loop`` is the caller's running loop, ``None`` for a thread. The
        first loop to come makes the registry solo, and so does a later loop
        of the solo loop's thread (the earlier one is not running then), or
        of any thread once the solo loop is gone (see _gone); a thread, or a
        loop in another thread while the solo loop may still run, switches
        it to shared for good.
        """
        with self._arrival:
            if not self.shared:
                here = get_ident()
                solo = self._solo
                if loop is not None and (
                    solo is None or self._solo_thread == here or _gone(solo, self._solo_thread)
                ):
                    self._solo = loop
                    self._solo_thread = here
                    self._solo_at = (here, loop)
                    self._inline(loop)
                    return True
                self.owner = self.local = self._solo = None
                self._solo_at = (0, None)
                self.shared = True
                if solo is not None and self._solo_thread != here:
                    self._settling = _Settling(solo, self._solo_thread)
        return False

    def guard(self) -> AbstractContextManager[object]:
        """What to hold while changing the lines: the lock once shared, else nothing."""
        return self.locked() if self.shared else _UNLOCKED

    def guard_for(self, loop: asyncio.AbstractEventLoop) -> AbstractContextManager[object]:
        """guard() for a task of loop, which may first settle the registry's mode (arrive)."""
        return _UNLOCKED if loop is self._solo or self.arrive(loop) else self.locked()

    def via(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether loop's tasks reach the backend through the process's backend loop.

        A backend that prefers one loop per process (``Capabilities.one_loop``:
        each loop it serves costs it connections, as Redis's sessions do)
        serves one loop directly at a time: the first to come, for as long
        as it lives. Other loops at once go through the backend loop, as
        threads do. Once _DIRECT_LOOPS direct loops ended, the process runs
        a loop per job (``asyncio.run()`` per task), and every later loop
        goes through the backend loop: a job's loop is too short-lived to
        pay for a session. (So a server's loop that follows one startup
        ``asyncio.run()`` is still served directly.) Other backends serve
        every loop directly.
        """
        if not self._one_loop:
            return False
        direct = self._direct
        if direct is loop:
            return False
        with self._arrival:
            direct = self._direct
            if direct is not None and _gone(direct, self._direct_thread):
                self._directs_ended += 1
                self._direct = direct = None
            if direct is None and self._directs_ended < _DIRECT_LOOPS:
                self._direct, self._direct_thread = loop, get_ident()
                return False
        return True

    def locked(self) -> threading.Lock:
        """The lock of a shared registry's lines, once it is safe to take (see _Settling)."""
        settling = self._settling
        if settling is not None and settling.thread != get_ident():
            settling.wait()
            self._settling = None
        return self._lock

    def for_threads(self) -> threading.Lock:
        """locked(), for a thread's call: it switches a solo registry to shared first."""
        if not self.shared:
            self.arrive(None)
        return self.locked()

    # -- keys --------------------------------------------------------------------------

    def ordered(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """keys checked (hashable; a backend's kinds) and in the one global order of turns."""
        if self.backend is not None:
            return self.backend.order(keys)
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

    # -- one key's turn ----------------------------------------------------------------

    def admit(
        self, key: Hashable, holder: object, line: Any, timeout: float | None
    ) -> Line | Gate | bool:
        """Take key's turn for holder at once, or find the line it must wait in.

        Return True if holder holds the key already (a reentrant call, which
        must not release it); False if holder just took the free key; else
        the line to join. Raise if the registry is closed, the line is full,
        or the key is busy and there is no time to wait. The caller holds
        the guard.
        """
        if held_by(line, holder):
            return True
        if not self.open:
            raise QueueClosed(
                f"inturn: the queue is closed; the work for key {describe(key)} was not queued"
            )
        lines = self.lines
        if self.concurrency != 1:  # a Gate per key
            if line is None:
                line = lines[key] = Gate(self.concurrency)
            if line.enter(holder) is False:
                return False
        elif line is None:
            lines[key] = holder
            return False
        elif type(line) is not Line:
            lines[key] = line = Line(line)
        if self.max_pending is not None and line.waiting >= self.max_pending:
            refused = QueueFull(
                f"inturn: key {describe(key)} already has {line.waiting} waiting "
                f"(max_pending={self.max_pending}); the work was not queued"
            )
            self.tally.refused(refused)
            raise refused
        if timeout is not None and timeout <= 0:
            missed = missed_turn(key, 0)
            self.tally.missed(missed)
            raise missed
        return line  # type: ignore[no-any-return]

    def join(
        self, key: Hashable, task: asyncio.Task[Any] | None, line: Any, timeout: float | None
    ) -> asyncio.Future[None] | bool:
        """Take key's turn for task at once, or join its line.

        Return True if task holds the key already (a reentrant call, which
        must not release it); False if task just took the free key; else the
        future to await: it completes when the key is handed to task (or
        fails with TimeoutError); the line it joined is then ``lines[key]``.
        Whoever awaits it calls :meth:`abandon` if interrupted, and makes
        task the line's holder once it completes. The caller holds the guard.
        """
        if task is None:
            raise RuntimeError("inturn: a turn can only be taken inside an asyncio task")
        line = self.admit(key, task, line, timeout)
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

    def abandon(
        self, key: Hashable, line: Line | Gate, waiter: Waiter, error: BaseException
    ) -> None:
        """Take a waiter that error interrupted out of the line it joined (cancelled or timed out).

        ``line`` is the object the waiter joined: by now it may have left the
        lines (its holder left and no live waiter remained), and a new line
        may even stand for the same key.
        """
        with self.guard():
            self._drop(key, line, waiter)
            self.tally.missed(error)

    def _drop(self, key: Hashable, line: Line | Gate, waiter: Waiter) -> None:
        if type(line) is Gate:
            line.drop(waiter, self.shared)
            if line.idle:
                del self.lines[key]
        elif line.holder is waiter:
            # The turn was handed over just as the waiter was interrupted:
            # pass it on, or the line would stall behind a caller that left.
            self.leave(key, self.lines.pop(key), None, None)
        else:
            waiter.cancel()  # so that the hand-off skips it
            line.waiting -= 1
            line.compact()

    async def take(
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
        lines = self.lines
        try:
            with self.guard_for(task.get_loop()):
                waiter = self.join(key, task, lines.get(key), timeout)
                if type(waiter) is bool:
                    return waiter is False
                line = lines[key]
            try:
                await waiter
            except BaseException as error:
                self.abandon(key, line, waiter, error)
                raise
        except TimeoutError:
            if limit is None:
                raise
            raise missed_turn(key, limit) from None
        if type(line) is Gate:
            with self.guard():
                line.settle(waiter, task, self.shared)
        else:
            line.holder = task
        return True

    def take_sync(
        self, key: Hashable, me: object, timeout: float | None, limit: float | None
    ) -> bool:
        """Take key's turn for thread me, blocking it in line if need be (see take).

        ``timeout`` is the time left to wait, ``limit`` the caller's whole limit.
        """
        lines = self.lines
        with self.locked():
            line = self.admit(key, me, lines.get(key), timeout)
            if type(line) is bool:
                return line is False
            waiter = ThreadWaiter()
            line.waiters.append(waiter)
            line.waiting += 1
        try:
            if timeout is None:
                waiter.lock.acquire()
            else:
                waiter.lock.acquire(timeout=timeout)
        except BaseException as error:  # interrupted: KeyboardInterrupt, or a signal handler's
            self.abandon(key, line, waiter, error)
            raise
        with self.locked():
            if type(line) is Gate:
                if waiter in line.holders:
                    line.settle(waiter, me, True)
                    return True
            elif line.holder is waiter:
                line.holder = me
                return True
            self._drop(key, line, waiter)
            assert limit is not None
            missed = missed_turn(key, limit)
            self.tally.missed(missed)
        raise missed

    def release(
        self, key: Hashable, holder: object, error: BaseException | None, result: Any
    ) -> None:
        """End holder's turn on key."""
        if self.concurrency != 1:
            with self.guard():
                gate = self.lines[key]
                gate.leave(holder, self.shared)
                if gate.idle:
                    del self.lines[key]
        elif self.shared:
            with self.locked():
                if (line := self.lines.pop(key)) is not holder:
                    self.leave(key, line, error, result)
        elif (line := self.lines.pop(key)) is not holder:
            self.leave(key, line, error, result)

    def release_all(
        self,
        keys: Sequence[Hashable],
        holder: object,
        error: BaseException | None,
        result: Any,
    ) -> None:
        """End holder's turns on keys (taken in that order), newest first."""
        for key in reversed(keys):
            self.release(key, holder, error, result)

    def leave(self, key: Hashable, line: Line, error: BaseException | None, result: Any) -> None:
        """End the turn of line's holder, just popped from the lines.

        Tell its watchers, then hand the key to the next waiter and put the
        line back, or leave the key out if nobody waits. On a shared
        registry, the caller holds the lock.
        """
        if line.watchers is not None:
            watchers, line.watchers = line.watchers, None
            for watcher in watchers:
                _soon(watcher, _outcome, watcher, error, result)
        waiters = line.waiters
        shared = self.shared
        while waiters:
            waiter = waiters.popleft()
            if type(waiter) is Drain:
                waiter.reached()
            elif not waiter.done():
                line.waiting -= 1
                # NOTE: the line is the waiter's before it is woken: a task of
                # another loop may run at once and make itself the holder.
                line.holder = waiter
                self.lines[key] = line
                if shared:
                    if not wake(waiter):  # its loop is closed: its task is gone
                        del self.lines[key]
                        continue
                elif isinstance(waiter, Deferred):  # work waiting as data: its task starts
                    if not waiter.handed(False):  # its loop is closed
                        del self.lines[key]
                        continue
                else:
                    waiter.set_result(None)  # type: ignore[union-attr]
                return

    # -- counting ---------------------------------------------------------------------

    def started(self, since: float) -> float:
        """Count the wait of a timed turn that was submitted at since and starts now; return now."""
        now = _monotonic()
        with self.guard():
            self.tally.started(now - since)
        return now

    def missed(self, error: BaseException) -> None:
        """Count a turn that was never reached (see Tally.missed)."""
        with self.guard():
            self.tally.missed(error)

    def ended(self, error: BaseException | None, cut: bool, since: float) -> None:
        """Count a turn that ended (see Tally.ended); a timed one started at since."""
        with self.guard():
            self.tally.ended(error, cut, (_monotonic() - since) if since else None)

    # -- looking at the lines ----------------------------------------------------------

    def pending(self, key: Hashable) -> int:
        """How many wait for key, not counting its holder(s)."""
        line = self.lines.get(key)
        return line.waiting if type(line) is Line or type(line) is Gate else 0

    def watch(self, key: Hashable, loop: asyncio.AbstractEventLoop) -> asyncio.Future[Any] | None:
        """A future of the outcome of key's holder (see KeyedQueue.current). Under the guard."""
        line = self.lines.get(key)
        if line is None or type(line) is Gate:
            return None  # (several holders: no one outcome to watch)
        if isinstance(line, Deferred):
            return None  # submitted work holds the key, its task not started yet
        if type(line) is not Line:
            line = self.lines[key] = Line(line)
        elif not isinstance(line.holder, asyncio.Task | threading.Thread):
            return None  # handed over to a waiter that has not started yet
        watcher: asyncio.Future[Any] = loop.create_future()
        if line.watchers is None:
            line.watchers = []
        line.watchers.append(watcher)
        return watcher

    def holders(self) -> tuple[set[object], dict[Hashable, int]]:
        """Who holds a key, and how many wait for each key that has waiters. Under the guard."""
        holders: set[object] = set()
        waiting: dict[Hashable, int] = {}
        # (a copy, made without running Python code: another thread may read
        # the stats while the solo loop changes the lines without a lock)
        for key, line in tuple(self.lines.items()):
            kind = type(line)
            if kind is Line:
                holders.add(line.holder)
            elif kind is Gate:
                holders.update(line.holders)
            else:
                holders.add(line)
                continue
            if line.waiting:
                waiting[key] = line.waiting
        return holders, waiting

    def mark(self, finish: Any) -> bool:
        """Put a drain mark at the tail of every active line; False if there is none.

        ``finish`` is called once every mark is reached. Under the guard.
        """
        lines = self.lines
        if not lines:
            return False
        drain = Drain(len(lines), finish)
        for key, line in list(lines.items()):
            if type(line) is Gate and not line.waiting:
                line.mark(drain)  # nobody waits: it waits for the present holders
                continue
            if type(line) is not Line and type(line) is not Gate:
                line = lines[key] = Line(line)
            line.waiters.append(drain)
        return True

    def summary(self, most: int) -> tuple[list[str], int]:
        """The first ``most`` active keys as ``"key: held, N waiting"``, and how many are active."""
        lines = self.lines.copy()
        shown = []
        for key, line in itertools.islice(lines.items(), most):
            waiting = line.waiting if type(line) is Line or type(line) is Gate else 0
            shown.append(f"{describe(key)}: held, {waiting} waiting")
        return shown, len(lines)
