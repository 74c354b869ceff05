"""The two drivers of a turn's steps: a task awaits each wait, a thread blocks on it.

A turn's steps (``_turn``) are generators that yield only the waits they
need, each as ``(kind, argument)``; a driver performs the wait and resumes
them (a wait's answer is None), or throws in what interrupted it, until
the steps end. What the steps raise goes to the driver's caller.

- ``TICKET, ticket``: a conflating call's wait on its ticket (see
  ``_latest``): its answer (``RUN``, or the outcome it gets without running)
  is sent into the steps. A task awaits its future; a thread blocks, and
  ends its Latest's quiet period when it is due (a task's is ended by a
  timer of its loop). A caller's timeout runs while its work waits, and
  while the run it follows has not started.
- ``LINE, (key, admitted)``: wait in key's line of this process for the
  holder (the registry; ``admitted``: the turn goes on if the queue
  closed, see Registry.try_take); ``SLOT, keys``: wait for a running slot
  (max_running) for the turn on keys. Both end holding the place, or raise
  (a TimeoutError, or what interrupted the wait), having left the line.
- ``GRANT, (source, key, grants)``: the backend's turn on key, from the
  backend or a turn's session: the Grant goes into grants (the steps' list)
  as it is made, before anything else can run (a thread's backend appends it
  itself, deep in its acquire: see BlockingBackend.acquire_sync), so an
  interrupt at any later point finds it there, and the roll-back releases it.
- ``RELEASE, (source, grant)`` and ``CLOSE, (session, error)``: give a grant
  back, or end a turn's session; they complete even if the caller is
  cancelled again meanwhile (a task) or interrupted (a thread).
- ``INTERRUPTED, error`` (from the thread's turn, not the steps): throw error
  in, so that steps an interrupt left suspended roll back (see unwind_sync).

A wait whose time ran out raises the TimeoutError of ``_checks.missed``,
naming what it waited for; the driver words it with the caller's limit
(``restated``), as a backend is given only the time left.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Generator, Hashable
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, Final, Protocol

from ._bridge import acquire_sync, acquire_via, close_sync, close_via, release_sync, release_via
from ._checks import Deadline, restated
from ._line import ThreadWaiter
from ._surely import surely
from ._tasks import retrieve

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from ._latest import Ticket
    from ._line import Waiter
    from ._registry import Registry
    from ._ticket import Parked
    from .backends._base import Backend

LINE: Final = 0
SLOT: Final = 1
GRANT: Final = 2
RELEASE: Final = 3
CLOSE: Final = 4
INTERRUPTED: Final = 5
TICKET: Final = 6

#: A turn's steps: they yield waits, and are sent each wait's answer.
Steps = Generator[tuple[int, Any], Any, None]


class Place(Protocol):
    """Where a holder waits in line for a place: a key's line (the registry), or a slot."""

    def join(
        self,
        key: Hashable,
        holder: object,
        waiter: Waiter,
        timeout: float | None,
        guarded: bool = False,
        admitted: bool = False,
    ) -> Any:
        """Put waiter in line for holder; None if holder took the place at once instead.

        Return the line joined (for settle and abandon). Raise if it is
        refused (closed, unless ``admitted``; full; or no time to wait).
        """

    def settle(self, key: Hashable, line: Any, waiter: Waiter, holder: object) -> bool:
        """Make holder the holder of the place handed to waiter; False if it was not handed."""

    def abandon(self, key: Hashable, line: Any, waiter: Waiter) -> None:
        """Take waiter out of line (passing on a place handed to it meanwhile)."""

    def withdraw(self, key: Hashable, holder: object, waiter: Waiter | None) -> None:
        """Undo a join (or settle) of waiter for holder that an exception cut short."""

    def too_late(self, key: Hashable, limit: float | None, queued: bool) -> TimeoutError:
        """The error of a place not reached within limit (see _checks.missed); ``queued``:
        the waiter is in line still (counted among its waiters)."""


def _answer(steps: Steps, error: BaseException | None, value: object) -> tuple[int, Any] | None:
    """Send steps their last wait's answer (or throw in error); their next wait, None once done."""
    try:
        return steps.send(value) if error is None else steps.throw(error)
    except StopIteration:
        return None


def _expire(waiter: asyncio.Future[None], place: Place, key: Hashable, limit: float | None) -> None:
    if not waiter.done():
        waiter.set_exception(place.too_late(key, limit, True))


#: A task's place in a line, while it waits: the line, the waiter, its time limit's timer.
Queued = tuple[Any, "asyncio.Future[None]", "asyncio.TimerHandle | None"]


def line_up(
    place: Place,
    key: Hashable,
    task: asyncio.Task[Any],
    left: float | None,
    limit: float | None,
    alone: Registry | None = None,
    admitted: bool = False,
) -> Queued | None:
    """Join place's line for task, its time limit armed; None if task took the place at once.

    A task awaits the waiter in its own frame (a coroutine more per waiting
    task would cost it some 300 bytes), then calls seated or give_up.
    ``alone``: the registry of a turn on this key alone (no steps around
    it), which counts the turn as missed if it is not reached; ``admitted``:
    see Place.join.
    """
    loop = task.get_loop()
    waiter: asyncio.Future[None] = loop.create_future()
    try:
        line = place.join(key, task, waiter, left, False, admitted)
    except BaseException as error:
        if alone is not None:
            alone.missed(error)
        raise
    if line is None:
        return None
    timer = None if left is None else loop.call_later(left, _expire, waiter, place, key, limit)
    return line, waiter, timer


def seated(place: Place, key: Hashable, task: asyncio.Task[Any], queued: Queued) -> None:
    """After line_up's waiter completed: task holds the place."""
    line, waiter, timer = queued
    if timer is not None:
        timer.cancel()
    place.settle(key, line, waiter, task)


def give_up(
    place: Place, key: Hashable, queued: Queued, error: BaseException, alone: Registry | None = None
) -> None:
    """After line_up's wait was interrupted (cancelled, timed out): leave the line."""
    line, waiter, timer = queued
    if timer is not None:
        timer.cancel()
    place.abandon(key, line, waiter)
    if alone is not None:
        alone.missed(error)


def _wait_in_sync(
    place: Place,
    key: Hashable,
    me: object,
    left: float | None,
    limit: float | None,
    admitted: bool = False,
) -> None:
    """Block thread me in place's line; return holding the place.

    Interrupt-safe: wherever an exception lands, what the join did (the
    place taken, the waiter in line or handed the place) is undone.
    """
    waiter = ThreadWaiter()
    try:
        line = place.join(key, me, waiter, left, False, admitted)
        if line is None:
            return
        waiter.lock.acquire(timeout=-1 if left is None else left)
        if not place.settle(key, line, waiter, me):  # timed out (and not handed just then)
            raise place.too_late(key, limit, True)  # noqa: TRY301 - (in line still: see too_late)
    except BaseException:
        surely(place.withdraw, key, me, waiter)
        raise


def unwind_sync(
    steps: Steps, error: BaseException, me: object, registry: Registry, since: float
) -> None:
    """If error came between two of steps' steps (they are suspended still), roll them back.

    It is thrown into them (see INTERRUPTED), their roll-back's waits
    performed for thread me; steps that raised it themselves have rolled
    back already. The caller drives the steps in a ``try`` of the frame that
    got them and calls this from its ``except``, so that no call comes
    between: an interrupt at the start of one would find nobody to hand them to.
    """
    if inspect.getgeneratorstate(steps) == inspect.GEN_SUSPENDED:
        drive_sync(steps, (INTERRUPTED, error), me, registry, None, since)


async def wait_alone(
    registry: Registry, key: Hashable, task: asyncio.Task[Any], timeout: float | None
) -> None:
    """Wait in key's line for task's turn on it alone (no steps); unreached, it counts as missed."""
    queued = line_up(registry, key, task, timeout, timeout, registry)
    if queued is not None:
        try:
            await queued[1]
        except BaseException as error:
            give_up(registry, key, queued, error, registry)
            raise
        seated(registry, key, task, queued)


def wait_alone_sync(registry: Registry, key: Hashable, me: object, timeout: float | None) -> None:
    """wait_alone, for thread me: blocking it (its caller counts a turn not reached)."""
    _wait_in_sync(registry, key, me, timeout, timeout)


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


async def drive(
    steps: Steps,
    wait: tuple[int, Any],
    task: asyncio.Task[Any],
    registry: Registry,
    limit: float | None,
    since: float,
    via: bool,
) -> None:
    """Perform steps' waits for task, from wait on, until the steps end.

    ``registry``: the lines, with their slots and backend; ``limit``: the turn's timeout,
    spent across its waits from ``since`` (monotonic; 0: from the first
    wait); ``via``: the backend's calls go through the process's backend
    loop (see ThreadMode.via).
    """
    deadline: Deadline | None = None
    backend: Backend = registry.backend  # type: ignore[assignment]  # (None: no wait needs it)
    while True:
        kind, arg = wait
        error: BaseException | None = None
        value: object = None
        try:
            if RELEASE <= kind <= CLOSE:  # (INTERRUPTED is a thread's: see drive_sync)
                if kind == RELEASE:
                    source, grant = arg
                    release = release_via(backend, source, grant) if via else source.release(grant)
                else:
                    session, failed = arg
                    release = close_via(backend, session, failed) if via else session.close(failed)
                await _settle(release)
            else:
                left = None
                if limit is not None:  # (no Deadline for none: one object less per waiter)
                    if deadline is None:
                        clock = task.get_loop().time  # (the loop's: timers run on it)
                        start = clock() - (_monotonic() - since) if since else 0.0
                        deadline = Deadline(limit, clock, start)
                    left = deadline.left()
                if kind == TICKET:
                    future = arg.waiter
                    timer = (
                        None
                        if left is None
                        else task.get_loop().call_later(left, _late, arg, registry, limit)
                    )
                    try:
                        value = await future
                    finally:
                        if timer is not None:
                            timer.cancel()
                elif kind == GRANT:
                    source, key, grants = arg
                    if via:
                        grants.append(await acquire_via(backend, source, key, left))
                    else:
                        grants.append(await source.acquire(key, left))
                else:
                    place = registry if kind == LINE else registry.slots
                    assert place is not None
                    key, admitted = arg if kind == LINE else (arg, False)
                    queued = line_up(place, key, task, left, limit, None, admitted)
                    if queued is not None:  # (awaited here: see line_up)
                        try:
                            await queued[1]
                        except BaseException as problem:
                            give_up(place, key, queued, problem)
                            raise
                        seated(place, key, task, queued)
        except BaseException as problem:  # thrown into the steps, which roll back
            error = restated(problem, limit)  # (a backend's miss knows only the time left)
        if (next_wait := _answer(steps, error, value)) is None:
            return
        wait = next_wait


def _late(ticket: Ticket, registry: Registry, limit: float | None) -> None:
    """A task's ticket whose caller's time ran out: it gives up, unless its turn came."""
    future = ticket.waiter
    with registry.mode.guard():
        if not future.done() and (late := ticket.book.timed_out(ticket, limit)) is not None:  # type: ignore[union-attr]
            future.set_exception(late)  # type: ignore[union-attr]


def drive_sync(
    steps: Steps,
    wait: tuple[int, Any],
    me: object,
    registry: Registry,
    limit: float | None,
    since: float,
) -> None:
    """Perform steps' waits for thread me, blocking it, from wait on (see drive)."""
    deadline: Deadline | None = None
    backend: Backend = registry.backend  # type: ignore[assignment]  # (None: no wait needs it)
    while True:
        kind, arg = wait
        error: BaseException | None = None
        value: object = None
        try:
            if kind == RELEASE:
                release_sync(backend, *arg)
            elif kind == INTERRUPTED:
                raise arg  # noqa: TRY301 - (see INTERRUPTED)
            elif kind == CLOSE:
                close_sync(backend, *arg)
            else:
                left = None
                if limit is not None:
                    if deadline is None:
                        deadline = Deadline(limit, _monotonic, since)
                    left = deadline.left()
                if kind == TICKET:
                    value = _ticket_sync(arg, registry, deadline, limit)
                elif kind == GRANT:
                    source, key, grants = arg
                    acquire_sync(backend, source, key, left, grants)  # (into grants: see GRANT)
                else:
                    place = registry if kind == LINE else registry.slots
                    assert place is not None
                    key, admitted = arg if kind == LINE else (arg, False)
                    _wait_in_sync(place, key, me, left, limit, admitted)
        except BaseException as problem:  # thrown into the steps, which roll back
            error = restated(problem, limit)  # (a backend's miss knows only the time left)
        if (next_wait := _answer(steps, error, value)) is None:
            return
        wait = next_wait


def _ticket_sync(
    ticket: Ticket, registry: Registry, deadline: Deadline | None, limit: float | None
) -> object:
    """Block until ticket is answered, ending its Latest's quiet period when it is due.

    :raises TimeoutError: the caller's time ran out while it waited (see Book.waits).
    """
    parked: Parked = ticket.waiter  # type: ignore[assignment]
    book = ticket.book
    while True:
        due = book.due(ticket)
        until = [when for when in (deadline and deadline.at, due) if when is not None]
        left = max(min(until) - _monotonic(), 0.0) if until else -1
        parked.lock.acquire(timeout=left)
        if parked.answer is not None:
            return parked.answer
        now = _monotonic()
        if deadline is not None and now >= deadline.at:
            with registry.mode.guard():
                if parked.answer is None and (late := book.timed_out(ticket, limit)) is not None:
                    raise late
            deadline = None  # (its turn came: it follows a run that started)
        elif due is not None and now >= due and ticket.latest is not None:
            book.tick(ticket.latest)
