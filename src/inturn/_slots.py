"""Slots: the running slots of a queue with ``max_running``, taken after a turn's keys.

Invariant: at most ``size`` holders (tasks or threads) run at once across
all keys; a slot is handed, FIFO, to the turn that waited for it longest,
before that turn is woken (as a line's hand-off). A turn takes its slot only
once it holds its keys, so work waiting in a key's line never holds one.
Producers blocked in ``submit()`` (backpressure) wait here too, and are woken
when a slot frees or their key's work starts running.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Hashable
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, TypeVar, final

from ._checks import missed
from ._line import Gate, Line, Places, ThreadWaiter, Waiter, resolve
from ._tasks import in_loop_of as _soon

if TYPE_CHECKING:
    from ._registry import Registry

__all__ = ("Slots", "end_turn")

W = TypeVar("W")


def _expire(waiter: asyncio.Future[None], slots: Slots, limit: float | None) -> None:
    if not waiter.done():
        waiter.set_exception(slots.missed(limit))


@final
class Slots(Places):
    """``max_running`` places (Places), with the protocol for taking and leaving one.

    Every method takes the registry's guard itself: the slots and the lines
    change under the same lock once the registry is shared.
    """

    __slots__ = ("registry",)

    def __init__(self, size: int, registry: Registry) -> None:
        super().__init__(size)
        self.registry = registry

    async def take(
        self, holder: asyncio.Task[Any], timeout: float | None, limit: float | None
    ) -> bool:
        """Take a running slot for a task that holds its keys; False if it holds one already.

        ``timeout`` is the time left to wait, ``limit`` the caller's whole limit (for its error).
        """
        registry = self.registry
        loop = holder.get_loop()
        with registry.guard():
            waiter = self._slot_or_wait(holder, timeout, limit, loop.create_future)
            if type(waiter) is bool:
                return waiter
        timer = None
        if timeout is not None:
            timer = loop.call_later(timeout, _expire, waiter, self, limit)
        try:
            await waiter
        except BaseException as error:
            with registry.guard():
                self.drop(waiter, registry.shared)
                registry.tally.missed(error)
            raise
        finally:
            if timer is not None:
                timer.cancel()
        with registry.guard():
            self._taken(waiter, holder)
        return True

    def take_sync(self, me: object, timeout: float | None, limit: float | None) -> bool:
        """Take a running slot for thread me, blocking it if need be (see take)."""
        registry = self.registry
        with registry.locked():
            waiter = self._slot_or_wait(me, timeout, limit, ThreadWaiter)
            if type(waiter) is bool:
                return waiter
        try:
            if timeout is None:
                waiter.lock.acquire()
            else:
                waiter.lock.acquire(timeout=timeout)
        except BaseException as error:
            with registry.locked():
                self.drop(waiter, True)
                registry.tally.missed(error)
            raise
        with registry.locked():
            if waiter in self.holders:
                self._taken(waiter, me)
                return True
            self.drop(waiter, True)
            missed = self.missed(limit)
            registry.tally.missed(missed)
        raise missed

    def vacate(self, holder: object) -> None:
        """End holder's running slot, handing it to the next in the slot line."""
        registry = self.registry
        with registry.guard():
            self.leave(holder, registry.shared)

    def missed(self, limit: float | None) -> TimeoutError:
        """The error of a slot not reached within limit."""
        return missed(f"a running slot (max_running={self.size})", limit)

    def enter_now(self, holder: object) -> bool | None:
        """Take a free slot for holder without waiting: True if taken, False if it holds one.

        None if it must wait. The caller holds the guard.
        """
        if holder in self.holders:
            return False
        if not self.free or self.handed:
            return None
        # (Places.enter, written out: run() takes its slot here)
        self.free -= 1
        self.holders.add(holder)
        if self.producers:
            self.wake_producers_behind()
        return True

    def _slot_or_wait(
        self, holder: object, timeout: float | None, limit: float | None, make: Callable[[], W]
    ) -> W | bool:
        """Take a free slot for holder, or line up a waiter made by make() for one.

        Return True if holder took a slot now, False if it holds one, else the
        waiter. Raise if there is no time to wait. The caller holds the guard.
        """
        entered = self.enter_now(holder)
        if entered is not None:
            return entered
        if timeout is not None and timeout <= 0:
            missed = self.missed(limit)
            self.registry.tally.missed(missed)
            raise missed
        waiter = make()
        self.waiters.append(waiter)  # type: ignore[arg-type]
        self.waiting += 1
        return waiter

    def _taken(self, waiter: Waiter, holder: object) -> None:
        """Record holder in the slot its waiter was handed. The caller holds the guard."""
        self.settle(waiter, holder, self.registry.shared)
        if self.producers:
            self.wake_producers_behind()

    # -- producers' backpressure (submit) ------------------------------------------------

    def needs(self, key: Hashable, me: object, in_line: bool) -> bool:
        """Whether work submitted now for key would take a running slot as soon as it starts.

        Not if the submitter (me) runs in a slot itself (work submitting more
        work never waits on itself), nor if the work will wait in its key's
        line: as data, behind whoever holds the key (in_line), or as a task
        behind the key's running work, which holds a slot already.
        """
        running = self.holders
        if me in running:
            return False
        line = self.registry.lines.get(key)
        if line is None:
            return True
        if in_line:
            return False
        if type(line) is Line:
            return line.holder not in running
        if type(line) is Gate:
            return bool(line.free) or line.holders.isdisjoint(running)
        return line not in running

    def wake_producers_behind(self) -> None:
        """Wake the producers whose key's work just got a running slot (they need none now).

        The caller holds the guard.
        """
        producers = self.producers
        assert producers is not None
        registry = self.registry
        in_line = registry.backend is None and registry.concurrency == 1  # (see _submit)
        still = type(producers)()
        for producer, key in producers:
            if producer.done():
                continue
            if self.needs(key, None, in_line):
                still.append((producer, key))
            else:
                _soon(producer, resolve, producer)
        self.producers = still

    async def backpressure(
        self, key: Hashable, me: object, in_line: bool, loop: asyncio.AbstractEventLoop
    ) -> None:
        """submit()'s wait while every slot is busy, or promised to work submitted but not
        started yet, and the work needs one (``me``, ``in_line``: see :meth:`needs`)."""
        again = False
        while self.free <= self.unplaced and self.needs(key, me, in_line):
            await self.vacancy(key, me, in_line, loop, again)
            again = True  # woken, but the slot may have gone to work already queued

    async def vacancy(
        self,
        key: Hashable,
        me: object,
        in_line: bool,
        loop: asyncio.AbstractEventLoop,
        again: bool,
    ) -> None:
        """Wait, FIFO among producers, until a running slot frees or key's work needs none.

        ``me``, ``in_line``: as for :meth:`needs`. Return at once if a slot is
        free, or the work needs none, by the time the guard is held: the
        caller checked without it, and a slot freed in another thread in
        between would wake nobody. ``again``: at the head of the producers
        (it was woken, but lost the slot).
        """
        producer: asyncio.Future[None] = loop.create_future()
        with self.registry.guard_for(loop):  # (a new loop's first call settles the mode here)
            if self.free > self.unplaced or not self.needs(key, me, in_line):
                return
            if self.producers is None:
                self.producers = deque()
            if again:
                self.producers.appendleft((producer, key))
            else:
                self.producers.append((producer, key))
        try:
            await producer
        except BaseException:
            if producer.done() and not producer.cancelled():  # woken, then cancelled: pass it on
                self.next_producer()
            producer.cancel()
            raise

    def next_producer(self) -> None:
        """Wake the first producer waiting in submit() for a slot, if any."""
        with self.registry.guard():
            self.wake_producer()


def end_turn(
    registry: Registry,
    slots: Slots | None,
    key: Hashable,
    task: object,
    slot: bool,
    error: BaseException | None,
    result: Any,
    cut: bool,
    since: float,
) -> None:
    """End task's turn on one key taken without a Turn (run()'s and submit()'s own paths).

    Release its running slot (``slot``: it took one), then the key (watchers
    learn the outcome); count the turn (``cut``: by its max_hold), timed from
    ``since`` if the queue times turns.
    """
    if registry.shared:
        if slots is not None and slot:
            slots.vacate(task)
        registry.release(key, task, error, result)
        registry.ended(error, cut, since)
        return
    # (solo: what those three do, without a lock)
    if slots is not None and slot:
        slots.leave(task, False)
    if (line := registry.lines.pop(key)) is not task:
        registry.leave(key, line, error, result)
    registry.tally.ended(error, cut, (_monotonic() - since) if since else None)
