"""The primitive under every line: a FIFO of waiters with one hand-off, one drop, one drain mark.

A waiter is a task's future or a blocked thread (ThreadWaiter). A Line has
one holder, a Gate up to N. Neither knows the key -> line map, the queue or
its lock: on a shared queue, the caller of every method holds the lock, and
``shared`` tells a hand-off that the waiter may live in another thread.
Invariant: a place is given to a waiter before it is woken (the hand-off),
so no newcomer can slip in between.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Final, final

from ._tasks import in_loop_of as _soon


@final
class Held:
    """What a take answers when the caller holds the place already (a reentrant take).

    Never a bool: a take answers True when the caller just took the place,
    False when it must wait, and HELD when it held it before (and so must
    not give it back). Testing it for truth is a mistake, and raises.
    """

    __slots__ = ()

    def __bool__(self) -> bool:
        raise TypeError("inturn: HELD is neither True nor False; compare with `is HELD`")

    def __repr__(self) -> str:
        return "HELD"


HELD: Final = Held()


def resolve(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)


def held_by(line: Any, holder: object) -> bool:
    """Whether line (a bare holder, a Line, a Gate or None) is held by holder."""
    return line is not None and (
        line is holder
        or (type(line) is Line and line.holder is holder)
        or (type(line) is Gate and holder in line.holders)
    )


@final
class ThreadWaiter:
    """A thread waiting in a line: it blocks on a lock that the hand-off releases.

    Quacks like the futures of waiting tasks where a line looks at its
    waiters: ``done()`` once it left, ``cancel()`` to leave.
    """

    __slots__ = ("handed", "left", "lock")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.left = False
        # Whether it was woken. NOTE: set with the release, with no call between: an
        # interrupt finds either both done or neither (see rewake).
        self.handed = False

    def done(self) -> bool:
        return self.left

    def cancel(self) -> None:
        self.left = True


class Deferred:
    """Work waiting in a line as data (submit()'s Handle): handed the line, it starts a task.

    Quacks as a ThreadWaiter does (its ``cancel()`` a no-op once it left).
    """

    __slots__ = ()

    def done(self) -> bool:
        raise NotImplementedError

    def cancel(self) -> bool:
        raise NotImplementedError

    def handed(self, shared: bool) -> bool:
        """The line is this work's now: start its task (never here and now: it may run eagerly).

        Return False if it never can (its loop is closed). The caller holds the guard.
        Handed again, it does nothing more (see rewake).
        """
        raise NotImplementedError


#: What waits in a line: a task's future, a thread, or work waiting as data.
Waiter = asyncio.Future[None] | ThreadWaiter | Deferred


def hand(waiter: Waiter, shared: bool) -> bool:
    """Hand a place to waiter (given it already; ``shared``: see wake); False if it never can."""
    if shared:
        return wake(waiter)
    if isinstance(waiter, Deferred):  # work waiting as data: its task starts
        return waiter.handed(False)
    waiter.set_result(None)  # type: ignore[union-attr]
    return True


def wake(waiter: Waiter) -> bool:
    """Hand the turn to waiter, from any thread; False if it can never take it."""
    if type(waiter) is ThreadWaiter:
        waiter.handed = True
        waiter.lock.release()
        return True
    if isinstance(waiter, Deferred):
        return waiter.handed(True)
    return _soon(waiter, resolve, waiter)


def rewake(holder: object, shared: bool) -> None:
    """Wake holder again if it is a waiter a hand-off made the holder but an exception kept
    from waking (see Registry.settle_up): a task's wake may be scheduled twice, and work
    waiting as data is handed again (both harmless: see Deferred.handed)."""
    if type(holder) is ThreadWaiter:
        if not holder.handed:
            holder.handed = True
            holder.lock.release()
    elif type(holder) is asyncio.Future:
        if not holder.done():
            _soon(holder, resolve, holder)
    elif isinstance(holder, Deferred):
        holder.handed(shared)


@final
class Drain:
    """One drain() call: a mark at the tail of every line that was active."""

    __slots__ = ("finish", "remaining")

    def __init__(self, remaining: int, finish: Callable[[], object]) -> None:
        self.remaining = remaining  # marks not yet reached
        self.finish = finish  # called once every mark is reached

    def reached(self) -> None:
        """Count one mark as reached: everything ahead of it in its line has left."""
        self.remaining -= 1
        if not self.remaining:
            self.finish()


class Waiting:
    """What both kinds of line have: a FIFO of waiters."""

    __slots__ = ("waiters", "waiting")

    def __init__(self) -> None:
        # FIFO of waiter futures and drain marks. A done future is a waiter
        # that left (cancelled or timed out) and is skipped at hand-off.
        self.waiters: deque[Waiter | Drain] = deque()
        # How many futures in `waiters` are not done: the live waiters.
        self.waiting = 0

    def compact(self) -> None:
        """Drop waiters that left, once they outnumber the live ones."""
        if len(self.waiters) > 2 * self.waiting + 16:
            self.waiters = deque(w for w in self.waiters if type(w) is Drain or not w.done())


@final
class Line(Waiting):
    """A key's line once anyone but its holder has looked at it (until then: see _registry)."""

    __slots__ = ("holder", "watchers")

    def __init__(self, holder: object) -> None:
        # (Waiting's fields set here: a call less on the contended path)
        self.waiters: deque[Waiter | Drain] = deque()
        self.waiting = 0
        # The holding task; between a hand-off and the new holder waking up,
        # the waiter future that was handed the turn. Never None.
        self.holder = holder
        # Futures from current(), resolved with the holder's outcome.
        self.watchers: list[asyncio.Future[Any]] | None = None

    def hand_on(self) -> Waiter | None:
        """Make the next live waiter the holder, and return it for its waking; None if
        nobody waits. Drain marks on the way are reached.

        NOTE: each step leaves the line whole if an exception lands after it: a
        waiter leaves the FIFO in the same step that makes it the holder.
        """
        waiters = self.waiters
        while waiters:
            waiter = waiters[0]
            if type(waiter) is Drain:
                del waiters[0]
                waiter.reached()
            elif waiter.done():
                del waiters[0]
            else:
                self.waiting -= 1
                self.holder = waiter
                del waiters[0]
                return waiter
        return None


class Places(Waiting):
    """A FIFO line for one of a bounded number of places at once.

    The base of a key's Gate and of a queue's running slots (``_slots.Slots``).
    A holder that leaves hands its place to exactly the next live waiter.

    Interrupt-safe: each change of the places (one taken, handed, settled or
    left) is one step of bytecode with no call and no jump in it, where CPython
    never runs a signal handler: an exception from one (or one thrown into the
    thread), which lands only at a call's start or end or at a jump, finds the
    places whole, as they were before the step or after it. (Holders and
    waiters hash by identity, in C: no Python code runs in a set's step.)
    """

    __slots__ = ("free", "handed", "holders", "marks", "producers", "size", "unplaced")

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size  # how many places
        # Places nobody holds. NOTE: > 0 with live waiters only while a
        # handed place is unsettled (see `handed`); a place that frees goes
        # to the head of the line first.
        self.free = size
        # Who holds a place: tasks and threads; between a hand-off and the
        # new holder waking up, the waiter that was handed it.
        self.holders: set[object] = set()
        # Places handed to waiters that have not woken up yet. NOTE: while
        # any is, nobody takes a free place directly: a newcomer would start
        # before a waiter that was ahead of it. It waits, and is handed the
        # place when that waiter settles.
        self.handed = 0
        # Drain marks that reached the head, each with the holders it still
        # waits for (those that held a place when it got there).
        self.marks: list[tuple[Drain, set[object]]] | None = None
        # Producers blocked in submit(), with their keys, and the works
        # submitted whose tasks have not started (the slots only).
        self.producers: deque[tuple[asyncio.Future[None], Hashable]] | None = None
        self.unplaced = 0

    def forked(self, keep: tuple[object, ...]) -> None:
        """In a forked child: the places as if only those of keep (the thread that forked,
        and the task it ran then) had come."""
        held = [holder for holder in keep if holder in self.holders]
        Places.__init__(self, self.size)
        for holder in held:
            self.enter(holder)

    def enter(self, holder: object) -> bool | Held:
        """Take a free place for holder: True if taken now, HELD if it holds one, False if not."""
        if holder in self.holders:
            return HELD
        if self.free and not self.handed:
            self.free -= 1
            self.holders.add(holder)
            return True
        return False

    def seat(self, waiter: Waiter, holder: object, shared: bool) -> None:
        """Record holder in the place its waiter was handed; hand on a place that waited for it."""
        holders = self.holders
        holders ^= {waiter, holder}  # NOTE: with the next line, one step (see the class)
        self.handed -= 1
        if self.marks is not None:
            self._swap_marks(waiter, holder)
        if self.free and not self.handed:
            self._hand(shared)

    def swap(self, old: object, new: object) -> None:
        """Let new hold the place old holds (submitted work's task, for the work)."""
        holders = self.holders
        holders ^= {old, new}  # NOTE: one step (see the class)
        if self.marks is not None:
            self._swap_marks(old, new)

    def _swap_marks(self, old: object, new: object) -> None:
        for _, remaining in self.marks or ():
            if old in remaining:
                remaining ^= {old, new}

    def leave(self, holder: object, shared: bool) -> None:
        """End holder's place: hand it to the next live waiter, or free it. Idempotent."""
        holders = self.holders
        if holder not in holders:
            return
        holders -= {holder}  # NOTE: with the next line, one step (see the class)
        self.free += 1
        self._freed(holder, shared)

    def _freed(self, holder: object, shared: bool) -> None:
        """holder's place is free: a drain mark stops waiting for it, and the place goes to
        the next live waiter, or wakes a producer. Idempotent."""
        if self.marks is not None:
            self._passed(holder)
        if self.waiters and self.free:
            self._hand(shared)
        if self.free and self.producers:
            self.wake_producer()

    def settle_up(self, holder: object, shared: bool) -> None:
        """Complete holder's leave that an exception cut short (a thread's exit): its place
        is left, handed on, and the waiter it went to woken. Idempotent."""
        if holder in self.holders:
            self.leave(holder, shared)
        else:  # (left, perhaps not handed on: see leave's one step)
            self._freed(holder, shared)
        self.rewake(shared)

    def rewake(self, shared: bool) -> None:
        """Wake each holder a hand-on made but an exception kept from waking (see rewake)."""
        for holder in tuple(self.holders):
            rewake(holder, shared)

    def wake_producer(self) -> None:
        """Wake the first producer waiting in submit() for a slot, if any."""
        producers = self.producers
        while producers:
            producer, _ = producers.popleft()
            if not producer.done():
                _soon(producer, resolve, producer)
                return

    def _hand(self, shared: bool) -> bool:
        """Hand a free place to the next live waiter; False if there is none."""
        waiters = self.waiters
        while waiters:
            waiter = waiters[0]
            if type(waiter) is Drain:
                self.mark(waiter)
                del waiters[0]
            elif waiter.done():
                del waiters[0]
            else:
                # NOTE: one step, no call: the waiter leaves the line holding the place
                del waiters[0]
                self.waiting -= 1
                holders = self.holders
                holders |= {waiter}  # the waiter's before it is woken, as in Line
                self.handed += 1
                self.free -= 1
                if hand(waiter, shared):
                    return True
                holders -= {waiter}  # its loop is closed: its task is gone (one step again)
                self.handed -= 1
                self.free += 1
        return False

    def drop(self, waiter: Waiter, shared: bool) -> None:
        """Take a waiter that was interrupted out of the line, passing on a place it was handed."""
        holders = self.holders
        if waiter in holders:  # handed, never settled
            holders -= {waiter}  # NOTE: with the next two lines, one step (see the class)
            self.handed -= 1
            self.free += 1
            self._freed(waiter, shared)
        else:
            waiter.cancel()  # so that the hand-off skips it
            self.waiting -= 1
            self.compact()

    def mark(self, drain: Drain) -> None:
        """A drain mark reached the head: it waits for the present holders to leave."""
        if not self.holders:
            drain.reached()
        else:
            self.marks = [*(self.marks or ()), (drain, set(self.holders))]

    def _passed(self, holder: object) -> None:
        assert self.marks is not None
        still = []
        for drain, remaining in self.marks:
            remaining.discard(holder)
            if remaining:
                still.append((drain, remaining))
            else:
                drain.reached()
        self.marks = still or None

    @property
    def idle(self) -> bool:
        """Whether nobody holds or waits for a place (the line may go)."""
        return not self.holders and not self.waiting


@final
class Gate(Places):
    """A key's line on a queue with ``concurrency`` above 1: up to that many hold the key."""

    __slots__ = ()
