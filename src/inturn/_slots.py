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
from collections.abc import Hashable
from typing import Any, Protocol, cast, final

from ._checks import Waited, missed, others
from ._line import Gate, Held, Places, Waiter, wake
from ._threads import ThreadMode


class Lines(Protocol):
    """What the slots use of their queue's lines (a Registry): its thread mode, and its
    key -> line map, to see whether a key is busy."""

    mode: ThreadMode
    lines: dict[Hashable, Any]


@final
class Slots(Places):
    """``max_running`` places (Places), with the protocol for taking and leaving one.

    Every method takes the registry's guard itself: the slots and the lines
    change under the same lock once the registry is shared.
    """

    __slots__ = ("registry",)

    def __init__(self, size: int, registry: Lines) -> None:
        super().__init__(size)
        self.registry = registry

    # -- the place of a turn (see _drive.Place; the key is not used) ---------------------

    def try_take(self, holder: object) -> bool | Held:
        """Take a free slot for holder: True; HELD if it holds one (a nested turn); else False."""
        mode = self.registry.mode
        if mode.shared:
            with mode.lock or mode.locked():
                return self._try_take(holder)
        holders = self.holders
        if self.free and not self.handed and not self.producers and holder not in holders:
            self.free -= 1  # (a free slot: enter's first case, two calls less)
            holders.add(holder)
            return True
        return self._try_take(holder)

    def _try_take(self, holder: object) -> bool | Held:
        got = self.enter(holder)
        if got is True and self.producers:
            self.wake_producers_behind()
        return got

    def join(
        self,
        key: Hashable,
        holder: object,
        waiter: Waiter,
        timeout: float | None,
        guarded: bool = False,
        admitted: bool = False,
    ) -> Slots | None:
        """Put waiter in the slots' line for holder; None if it took a slot that freed meanwhile.

        (``guarded``, ``admitted``: of a key's line, see Place.join; not used here.)
        """
        with self.registry.mode.guard():
            if self._try_take(holder) is not False:
                return None
            if timeout is not None and timeout <= 0:
                raise self.too_late(key, 0, False)
            self.waiting += 1  # NOTE: then the append: an interrupt after it finds both done
            self.waiters.append(waiter)
            return self

    def settle(self, key: Hashable, line: Slots, waiter: Waiter, holder: object) -> bool:
        """Make holder the holder of the slot handed to waiter; False if it was not handed."""
        with self.registry.mode.guard():
            if waiter not in self.holders:
                return False
            self.seat(waiter, holder, self.registry.mode.shared)
            if self.producers:
                self.wake_producers_behind()
            return True

    def abandon(self, key: Hashable, line: Slots, waiter: Waiter) -> None:
        """Take an interrupted waiter out of the slots' line, passing on a slot handed to it."""
        with self.registry.mode.guard():
            self.drop(waiter, self.registry.mode.shared)

    def withdraw(self, key: Hashable, holder: object, waiter: Waiter | None) -> None:
        """Undo a join or settle of waiter for holder that an exception cut short: a slot
        holder took is given back; waiter leaves the line (passing on a slot handed to it)."""
        with self.registry.mode.guard():
            shared = self.registry.mode.shared
            if holder in self.holders:
                self.leave(holder, shared)
            elif waiter is not None and (
                waiter in self.holders or (not waiter.done() and waiter in self.waiters)
            ):
                self.drop(waiter, shared)

    def too_late(self, key: Hashable, limit: float | None, queued: bool) -> TimeoutError:
        """The error of a slot not reached within limit for the turn on keys ``key`` (a tuple)."""
        waiting = others(self.waiting - queued)
        detail = f" (all max_running={self.size} busy, {waiting})"
        return missed(cast("tuple[Hashable, ...]", key), Waited.SLOT, limit, detail)

    def vacated(self, holder: object) -> None:
        """Complete holder's vacate that an exception cut short (a thread's exit): the slot
        is left, and a waiter it was handed to is woken. Idempotent."""
        with self.registry.mode.guard():
            self.settle_up(holder, self.registry.mode.shared)

    def vacate(self, holder: object) -> None:
        """End holder's running slot, handing it to the next in the slot line."""
        mode = self.registry.mode
        if mode.shared:
            with mode.lock or mode.locked():
                self.leave(holder, True)
        else:
            self.leave(holder, False)

    # -- producers' backpressure (submit) ------------------------------------------------

    def needs(self, key: Hashable, me: object) -> bool:
        """Whether work submitted now for key would take a running slot as soon as it starts.

        Not behind a busy key, nor if me, the submitter, runs in a slot (see KeyedQueue.submit).
        """
        if me in self.holders:
            return False
        line = self.registry.lines.get(key)
        if type(line) is Gate:  # (a free place: the work would take it, and need a slot)
            return bool(line.free) and not line.handed
        return line is None

    def wake_producers_behind(self) -> None:
        """Under the guard: wake the producers whose key's work just got a slot (they need none)."""
        producers = self.producers
        assert producers is not None
        still = type(producers)()
        for producer, key in producers:
            if producer.done():
                continue
            if self.needs(key, None):
                still.append((producer, key))
            else:
                wake(producer)
        self.producers = still

    async def backpressure(
        self, key: Hashable, me: object, loop: asyncio.AbstractEventLoop
    ) -> None:
        """submit()'s wait for a running slot, FIFO among producers (see KeyedQueue.submit).

        Each wait checks again under the guard: a slot freed in another
        thread after a check without it would wake nobody.
        """
        again = False  # woken, but the slot went to work already queued: wait at the head
        while self.free <= self.unplaced and self.needs(key, me):
            producer: asyncio.Future[None] = loop.create_future()
            with self.registry.mode.guard_for(loop):  # (a new loop's first call settles the mode)
                if self.free > self.unplaced or not self.needs(key, me):
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
                if producer.done() and not producer.cancelled():  # woken, cancelled: pass it on
                    self.next_producer()
                producer.cancel()
                raise
            again = True

    def next_producer(self) -> None:
        """Wake the first producer waiting in submit() for a slot, if any."""
        with self.registry.mode.guard():
            self.wake_producer()
