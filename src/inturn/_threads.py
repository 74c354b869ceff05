"""The thread mode of a queue's lines: lock-free for one event loop, locked once others come.

While one event loop uses a queue (solo), its tasks change the lines
without a lock. The first thread, or a second loop in another thread,
switches the mode for good to locking every change (shared); tasks keep
their places across the switch. Loops that follow each other in one thread
(``asyncio.run()`` twice) need no switch.

``fast_loop`` is the loop whose tasks may take a free key with a bare dict
insert (``run()``'s licensed inline path): the solo loop, while the queue
allows it (open, in process, one holder per key, no flow control, no
observer), else None.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from contextlib import AbstractContextManager, nullcontext
from threading import get_ident
from typing import Any, Final, final

from ._tasks import current_task as _current_task

if sys.version_info < (3, 12):  # pragma: no cover - depends on the interpreter
    from ._tasks import task_of_loop

#: What a solo mode's changes of the lines hold instead of the lock.
UNLOCKED: Final = nullcontext()

#: How many event loops in turn a backend that prefers one loop serves directly (see via).
_DIRECT_LOOPS: Final = 2


@final
class ThreadHolder:
    """A thread, as the holder of a key or a slot: one per thread, kept in thread-local storage.

    Not ``threading.current_thread()``: a thread that ``threading`` did not
    start (``_thread.start_new_thread``, a C extension's) would get a
    ``_DummyThread`` that is never removed. This one goes with its thread.
    """

    __slots__ = ("__weakref__", "ident")

    def __init__(self, ident: int) -> None:
        self.ident = ident

    def __repr__(self) -> str:
        return f"<thread {self.ident}>"


_LOCAL = threading.local()


def thread_holder() -> ThreadHolder:
    """This thread's holder (made at its first turn)."""
    try:
        me: ThreadHolder = _LOCAL.me
    except AttributeError:
        me = _LOCAL.me = ThreadHolder(get_ident())
    return me


def _gone(loop: asyncio.AbstractEventLoop, thread: int) -> bool:
    """Whether loop, last run in thread, can run no step any more: closed, or its thread ended."""
    if loop.is_closed():
        return True
    return not loop.is_running() and all(t.ident != thread for t in threading.enumerate())


@final
class _Settling:
    """The switch to shared mode, until the solo loop is between steps.

    Before the switch, the solo loop's tasks change the lines without the
    lock; one of them may be midway through such a change in its current
    step. The lines are safe to lock once that loop has run a callback (so
    ended that step) or stopped.
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
class ThreadMode:
    """Who may change a queue's lines how: the solo loop without a lock, or all under one."""

    __slots__ = (
        "_arrival",
        "_direct",
        "_direct_thread",
        "_directs_ended",
        "_lock",
        "_one_loop",
        "_quick",
        "_settling",
        "_solo_at",
        "fast_loop",
        "lock",
        "shared",
        "solo",
    )

    def __init__(self, one_loop: bool) -> None:
        # Solo: `solo` is the only user, lock-free; `_solo_at` its thread and it, in one
        # store (read without a lock: a consistent pair). Shared (for good, `solo` None):
        # every change of the lines holds `_lock`. `_arrival` serializes the decisions.
        self.solo: asyncio.AbstractEventLoop | None = None
        self._solo_at: tuple[int, asyncio.AbstractEventLoop | None] = (0, None)
        self.shared = False
        self._lock = threading.Lock()
        # The lock, once it is safe to take without settling (None meanwhile: see locked)
        self.lock: threading.Lock | None = self._lock
        self._arrival = threading.Lock()
        self._settling: _Settling | None = None
        self._quick = True  # whether the queue allows run()'s inline path (see allow_fast)
        self.fast_loop: asyncio.AbstractEventLoop | None = None
        # A backend that prefers one loop: the loop served directly, its thread,
        # and how many such ended (see via).
        self._one_loop = one_loop
        self._direct: asyncio.AbstractEventLoop | None = None
        self._direct_thread = 0
        self._directs_ended = 0

    if sys.version_info >= (3, 12):  # in C: cheap
        current_task = staticmethod(_current_task)
    else:  # pragma: no cover - depends on the interpreter

        def current_task(self) -> asyncio.Task[Any] | None:
            """asyncio.current_task(), looked up directly in the solo loop's own thread.

            (Before 3.12 asyncio's is Python, most of an uncontended turn's cost:
            see _tasks.) One loop runs in a thread at a time: in the solo loop's
            thread, a task running a step of it is this caller's; else ask asyncio.

            :raises RuntimeError: no event loop runs in this thread.
            """
            thread, loop = self._solo_at  # (one read: a consistent pair)
            if get_ident() == thread:
                task = task_of_loop(loop)
                if task is not None:
                    return task
            return _current_task()

    def allow_fast(self, quick: bool) -> None:
        """Whether the queue allows run()'s inline path now (see the module's doc)."""
        with self._arrival:
            self._quick = quick
            self.fast_loop = self.solo if quick else None

    def forked(self) -> None:
        """In a forked child: start over, as the parent's other threads and loops, and its
        locks, are gone (the caller then tells allow_fast again)."""
        ThreadMode.__init__(self, self._one_loop)

    def arrive(self, loop: asyncio.AbstractEventLoop | None) -> bool:
        """Decide how a caller works on the lines: True for lock-free (solo), False for locked.

        ``loop`` is the caller's running loop, ``None`` for a thread. The
        first loop to come makes the mode solo, and so does a later loop of
        the solo loop's thread (the earlier one is not running then), or of
        any thread once the solo loop is gone; a thread, or a loop in another
        thread while the solo loop may still run, switches to shared for good.
        """
        with self._arrival:
            if not self.shared:
                here = get_ident()
                thread, solo = self._solo_at
                if loop is not None and (solo is None or thread == here or _gone(solo, thread)):
                    self.solo = loop
                    self._solo_at = (here, loop)
                    self.fast_loop = loop if self._quick else None
                    return True
                if solo is not None and thread != here:
                    # (first: a caller that sees shared must see the settling too)
                    self.lock = None
                    self._settling = _Settling(solo, thread)
                self.fast_loop = self.solo = None
                self._solo_at = (0, None)
                self.shared = True
        return False

    def settle(self, loop: asyncio.AbstractEventLoop) -> None:
        """Before a task of loop changes the lines: a new loop settles how it works (arrive)."""
        if loop is not self.solo and not self.shared:
            self.arrive(loop)

    def guard(self) -> AbstractContextManager[object]:
        """What to hold while changing the lines: the lock once shared, else nothing."""
        return (self.lock or self.locked()) if self.shared else UNLOCKED

    def guard_for(self, loop: asyncio.AbstractEventLoop) -> AbstractContextManager[object]:
        """guard() for a task of loop, which may first settle the mode (arrive)."""
        return UNLOCKED if loop is self.solo or self.arrive(loop) else (self.lock or self.locked())

    def locked(self) -> threading.Lock:
        """The lock of a shared mode's lines, once it is safe to take (see _Settling)."""
        settling = self._settling
        if settling is not None and settling.thread != get_ident():
            settling.wait()
            self._settling = None
            self.lock = self._lock  # (so that the next callers skip this call: see guard)
        return self._lock

    def for_threads(self) -> threading.Lock:
        """locked(), for a thread's call: it switches a solo mode to shared first."""
        if not self.shared:
            self.arrive(None)
        return self.locked()

    def via(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Whether loop's tasks reach the backend through the process's backend loop.

        A backend that prefers one loop per process (``Capabilities.one_loop``:
        each loop it serves costs it connections, as Redis's sessions do)
        serves one loop directly at a time: the first to come, for as long as
        it lives. Other loops at once go through the backend loop, as threads
        do. Once _DIRECT_LOOPS direct loops ended, the process runs a loop per
        job (``asyncio.run()`` per task), and every later loop goes through the
        backend loop: a job's loop is too short-lived to pay for a session. (So
        a server's loop that follows one startup ``asyncio.run()`` is still
        served directly.)
        """
        if not self._one_loop or self._direct is loop:
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
