"""Where a PostgresBackend keeps connections: the places of its loops and threads.

A *place* (one per event loop, :class:`LoopPlace`, and one for the threads
of a process, :class:`ThreadPlace`) holds the slots of ``max_sessions``
connections per tier (see :mod:`._connections`) and the connections kept
between turns, the last used on top. A :class:`Lease` is one turn's slot
and connection, given back once.
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Final, Protocol, final

import psycopg

from ..._tasks import retrieve
from . import _wire

_OK: Final = psycopg.pq.ConnStatus.OK
_IDLE: Final = psycopg.pq.TransactionStatus.IDLE
_OFF: Final = psycopg.pq.PipelineStatus.OFF


@final
class Lease:
    """A session's connection, and the slot it holds; given back once."""

    __slots__ = ("connection", "place", "ready", "tier", "unsure")

    def __init__(self, tier: int) -> None:
        self.tier = tier
        self.connection: Any = None
        #: A lock the session may hold without a grant for it: (lock, held before), from
        #: the moment its wait is sent until its outcome is taken (see _steps.waiting).
        self.unsure: tuple[int, bool] | None = None
        #: What readying the connection learnt (a ``_ready.Ready``), once it is readied.
        self.ready: Any = None
        #: the slot, of a loop or of the threads (None: a connection of its own, or none yet)
        self.place: LoopPlace | ThreadPlace | None = None

    def take_idle(self) -> None:
        """Take a connection kept by the place, if it has one that is still good."""
        assert self.place is not None
        self.place.take_idle(self)

    def abandon(self) -> None:
        """After a take that failed: give back the connection, or the slot alone if none yet."""
        if self.connection is not None or self.place is None:
            self.give_back()
            return
        place, self.place = self.place, None
        place.release(self.tier)

    def give_back(self) -> None:
        """Keep the connection for the next turn, or close it (a bad one, or one's own)."""
        place, self.place = self.place, None
        connection, self.connection = self.connection, None
        if place is not None:
            place.give_back(connection, self.ready, self.tier)
        elif connection is not None:
            _wire.discard(connection)


@final
class Slots:
    """A tier's slots for one event loop: FIFO, handed on directly to the next waiter."""

    __slots__ = ("free", "waiters")

    def __init__(self, size: int) -> None:
        self.free = size
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    def try_take(self) -> bool:
        if self.free and not self.waiters:
            self.free -= 1
            return True
        return False

    def give(self) -> None:
        waiters = self.waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # (the slot is the waiter's now)
                return
        self.free += 1


class Due(Protocol):
    """What a :class:`Watch` watches: told once its bound passed."""

    def expire(self) -> None: ...


@final
class Watch:
    """The bounds of one event loop's awaited answers, on one timer.

    A timer per statement would cost each turn two timer handles: instead,
    each bound is a dict entry (:meth:`add` on sending, :meth:`discard` on the
    answer), and one timer is set for the earliest; when it fires, the bounds
    that passed are expired and it is set again for the next. Most bounds are
    ``unreachable_after`` ahead and are discarded long before, so the timer
    seldom moves.
    """

    __slots__ = ("at", "due", "handle", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.due: dict[Due, float] = {}  # each awaited answer's bound (time.monotonic())
        self.handle: asyncio.TimerHandle | None = None  # set for `at`, the earliest bound
        self.at = math.inf

    def add(self, due: Due, until: float) -> None:
        """Expire due at until, unless discarded first."""
        self.due[due] = until
        if until < self.at:
            if self.handle is not None:
                self.handle.cancel()
            self.at = until
            self.handle = self.loop.call_later(until - time.monotonic(), self._fire)

    def discard(self, due: Due) -> None:
        self.due.pop(due, None)

    def _fire(self) -> None:
        now = time.monotonic()
        due = self.due
        passed = [waiting for waiting, until in due.items() if until <= now]
        for waiting in passed:
            del due[waiting]
        self.handle, self.at = None, math.inf
        if due:
            self.at = min(due.values())
            self.handle = self.loop.call_later(self.at - now, self._fire)
        for waiting in passed:
            waiting.expire()


@final
class LoopPlace:
    """What the backend keeps for one event loop: its slots per tier, idle connections,
    and the watch of its answers' bounds."""

    __slots__ = ("active", "closed", "given", "guard", "idle", "size", "tiers", "watch")

    def __init__(self, size: int, given: Any = None) -> None:
        self.size = size
        self.closed = False  # by aclose() or the loop's end: keeps no connection given back
        self.watch = Watch(asyncio.get_running_loop())
        # the connections its turns use now: closed with the idle ones if the loop ends
        # first (a turn's ending in flight then never completes)
        self.active: set[psycopg.AsyncConnection[Any]] = set()
        self.tiers: list[Slots] = []
        # the connections kept, each with what readying it learnt (a _ready.Ready)
        self.idle: list[tuple[psycopg.AsyncConnection[Any], Any]] = []
        self.given = given  # the caller's pool, whose connections these are
        # closes the idle connections when the loop shuts down (see _guard)
        self.guard: Any = None

    def slots(self, tier: int) -> Slots:
        tiers = self.tiers
        while len(tiers) <= tier:
            tiers.append(Slots(self.size))
        return tiers[tier]

    def release(self, tier: int) -> None:
        self.tiers[tier].give()

    def take_idle(self, lease: Lease) -> None:
        """Give lease the connection used last that is still good, and its readiness
        (none, if none is)."""
        idle = self.idle
        while idle:
            lease.connection, lease.ready = idle.pop()
            if not stale(lease.connection, lease.ready):
                return
            self._drop(lease.connection)
            lease.connection = lease.ready = None

    def give_back(
        self, connection: psycopg.AsyncConnection[Any] | None, ready: Any, tier: int
    ) -> None:
        if connection is not None:
            self.active.discard(connection)
            if ready is not None and not self.closed and reusable(connection):
                self.idle.append((connection, ready))
            else:
                self._drop(connection)
        self.release(tier)

    def _drop(self, connection: psycopg.AsyncConnection[Any]) -> None:
        if self.given is None:
            _wire.discard(connection)
        else:  # (the caller's pool closes or resets a connection it gets back in a bad state)
            asyncio.ensure_future(self.given.putconn(connection)).add_done_callback(retrieve)

    async def close(self, ending: bool = False) -> None:
        """Close the idle connections (or give them back to the caller's pool); ``ending``:
        the loop is ending, so those still in use too (their turns will never end them).
        Connections given back afterwards are closed (or given back) at once."""
        self.closed = True
        if ending:
            active, self.active = self.active, set()
            for connection in active:
                _wire.discard(connection)
        idle, self.idle = self.idle, []
        for connection, _ in idle:
            if self.given is None:
                _wire.discard(connection)
            else:
                await self.given.putconn(connection)


@final
class ThreadSlots:
    """A tier's slots for the threads of a process: FIFO, handed on directly to the next
    waiter (a newcomer never takes a slot a waiter was promised), under the place's lock."""

    __slots__ = ("free", "lock", "size", "waiters")

    def __init__(self, size: int, lock: threading.Lock) -> None:
        self.size = size
        self.free = size
        self.lock = lock  # the place's
        # the threads waiting, each as a lock it blocks on until it is released: handed on
        self.waiters: collections.deque[threading.Lock] = collections.deque()

    def take(self, wait: float | None) -> bool:
        """Take a slot, waiting wait seconds at most for one (None: as long as it takes).

        An exception raised while it waits (a signal handler's) leaves the
        line first, and gives on a slot handed to it meanwhile.
        """
        taken = False
        try:
            with self.lock:
                if self.free and not self.waiters:
                    self.free -= 1
                    taken = True
                elif wait == 0:
                    return False
                else:
                    waiter = threading.Lock()
                    waiter.acquire()
                    self.waiters.append(waiter)
        except BaseException:  # (a signal handler's, as the lock was let go)
            if taken:
                self.give()
            raise
        if taken:
            return True
        try:
            if waiter.acquire(True, -1 if wait is None else wait):
                return True
        except BaseException:
            if not self._left(waiter):
                self.give()
            raise
        return not self._left(waiter)

    def _left(self, waiter: threading.Lock) -> bool:
        """Take waiter out of the line; False if it was handed a slot already."""
        with self.lock:
            try:
                self.waiters.remove(waiter)
            except ValueError:
                return False
            return True

    def give(self) -> None:
        with self.lock:
            self.given()

    def given(self) -> None:
        """give(), the place's lock held."""
        if self.waiters:
            self.waiters.popleft().release()  # (the slot is the waiter's now)
        elif self.free < self.size:
            self.free += 1
        else:
            raise ValueError("inturn: a connection slot was given back twice")


@final
class ThreadPlace:
    """The same for the threads of this process (one lock for its slots and its idle
    connections)."""

    __slots__ = ("closed", "idle", "lock", "size", "tiers")

    def __init__(self, size: int) -> None:
        self.size = size
        self.tiers: list[ThreadSlots] = []
        self.lock = threading.Lock()  # held to take or give a slot, to keep a connection, to close
        self.closed = False
        self.idle: collections.deque[tuple[psycopg.Connection[Any], Any]] = collections.deque()

    def slots(self, tier: int) -> ThreadSlots:
        tiers = self.tiers
        if len(tiers) <= tier:
            with self.lock:
                while len(tiers) <= tier:
                    tiers.append(ThreadSlots(self.size, self.lock))
        return tiers[tier]

    def release(self, tier: int) -> None:
        self.tiers[tier].give()

    def take_idle(self, lease: Lease) -> None:
        """As LoopPlace's. The connection is the lease's before it leaves the idle ones: an
        exception a signal handler raises at any point leaves it to the lease, which the
        caller gives back (see Connections.kept), never to the collector: its slot is
        free only once it is kept again or closed."""
        while True:
            with self.lock:
                if not self.idle:
                    return
                lease.connection, lease.ready = self.idle[-1]
                self.idle.pop()
            if not stale(lease.connection, lease.ready):
                return
            _wire.discard(lease.connection)
            lease.connection = lease.ready = None

    def give_back(self, connection: psycopg.Connection[Any] | None, ready: Any, tier: int) -> None:
        """Keep connection (unless it is bad, or the place closed) and give its slot back.

        A connection not kept is closed before its slot is free: the threads
        never have more than max_sessions connections of a tier open.
        """
        slots = self.tiers[tier]
        if connection is not None and ready is not None and reusable(connection):
            with self.lock:
                if not self.closed:
                    self.idle.append((connection, ready))
                    slots.given()
                    return
        try:
            if connection is not None:
                _wire.discard(connection)
        finally:
            slots.give()

    def close(self) -> None:
        """Close the idle connections; those given back afterwards are closed at once."""
        with self.lock:
            self.closed = True
        while self.idle:
            _wire.discard(self.idle.pop()[0])


def stale(connection: Any, ready: Any) -> bool:
    """Whether the server ended connection's session while it sat idle (no round trip);
    ready: what readying it learnt (a ``_ready.Ready``).

    A session the server ended (a restart, ``pg_terminate_backend``,
    ``idle_session_timeout``) left its socket readable, with the server's
    goodbye or the end of the stream; reading that marks the connection
    bad. (A session cut off without a word, by a partition, is found out by
    its first statement instead.) A kept connection is idle, in good
    status (see :func:`reusable`), and nothing reads it: so a socket with
    nothing to read, the usual, is all there is to check, with one ``poll``
    on the poller readying made (callgrind: the check cost a turn 4.9k
    instructions with the status read around it and the poller looked up,
    0.8k so).
    """
    if not ready.reader.poll(0):
        return False
    pgconn = connection.pgconn
    for _ in range(3):  # (the goodbye, then the end of the stream)
        if pgconn.status != _OK or not ready.reader.poll(0):
            break
        try:
            pgconn.consume_input()
        except psycopg.OperationalError:
            break
    return bool(pgconn.status != _OK)


def alive(answer: _wire.Outcome | None) -> bool:
    """Whether the answer of PROBE counts a session."""
    return isinstance(answer, list) and bool(answer) and answer[0][0] not in (None, b"0")


def reusable(connection: Any) -> bool:
    """Whether connection may serve another turn: alive, idle, in autocommit, not in
    pipeline mode (see _wire.Ahead)."""
    pgconn = connection.pgconn
    return bool(
        pgconn.status == _OK
        and connection.autocommit
        and pgconn.transaction_status == _IDLE
        and pgconn.pipeline_status == _OFF
    )


async def guard(place: LoopPlace, dropped: Callable[[], None]) -> Any:
    """Close place's idle connections when its loop shuts down (``shutdown_asyncgens()``).

    ``asyncio.run`` closes every async generator still open after its tasks
    are done: a loop that ends leaves no connection behind.
    """
    try:
        yield
    finally:
        place.guard = None  # (it is this generator, closing)
        dropped()
        await place.close(ending=True)
