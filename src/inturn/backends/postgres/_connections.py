"""The connections of a PostgresBackend: where a turn's session gets one, and gives it back.

- Per event loop, and for the threads of a process, a *place*: slots of
  ``max_sessions`` connections per level of nesting (a *tier*), and the
  connections kept between turns (the last used on top). A turn takes a
  slot of its tier first, waiting in this process while all are taken (at
  most ``session_wait``, within its timeout), then a kept connection, or a
  new one: so a connection that cannot be made means a server that cannot
  be reached, never one busy with this process's other keys.
- Tiers: a turn started inside another turn (a task made in its block,
  ``asyncio.to_thread``, ``contextvars.copy_context().run``; or a turn of
  the same task nested in a transaction turn) takes its slot in the next
  tier, so a holder that waits for such turns never holds the slots they
  need. Waits for a slot that nothing in the context explains (a thread
  pool's threads, which do not carry it) are bounded by ``session_wait``.
- Kept connections cost a turn no connect and no pool's ``getconn`` and
  ``putconn`` (about 40 µs); one the server ended meanwhile is found
  without a round trip (:func:`stale`) and replaced. A loop's are closed
  when it shuts down (``asyncio.run()`` does), the rest by ``aclose()``.
  No background task and no thread: nothing is left running when a loop
  or the process ends.
- With a ``psycopg_pool.AsyncConnectionPool`` of the caller's, its loop's
  connections come from it (``getconn``), and go back to it at ``aclose()``.
- Readying a connection: :mod:`._ready`.
- Fork: a child leaves its parent's connections alone (closing them would
  end the parent's sessions) and makes its own; :attr:`Connections.generation`
  tells a session made before the fork from one made after.
"""

from __future__ import annotations

import asyncio
import math
import os
import threading
import time
import weakref
from collections.abc import Generator, Hashable
from functools import partial
from typing import Any, final

import psycopg

from ..._checks import Waited, missed
from ..._describe import describe as show
from ..._errors import BackendUnavailable
from ..._tasks import loop_here
from . import _handshake as handshake
from . import _sql, _wire
from ._places import Lease, LoopPlace, ThreadPlace, Watch, alive, guard
from ._ready import Readiness
from ._steps import CONNECT, SLOT, Limits, Op, now, said

#: Connections a forked child inherited: its parent's, never to be used nor closed
#: (closing one would end the parent's session), so they are kept from the collector.
_INHERITED: list[object] = []
_ALL: weakref.WeakSet[Connections] = weakref.WeakSet()

#: The fix a turn's TimeoutError names when it waited for a connection of the user's pool.
_YOUR_POOL = "Raise your pool's max_size"


def _after_fork_in_child() -> None:
    for connections in list(_ALL):
        connections.forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


@final
class Connections:
    """Where the sessions of one backend get their connections (see the module)."""

    __slots__ = (
        "__weakref__",
        "_conninfo",
        "_given",
        "_given_loop",
        "_kwargs",
        "_lock",
        "_places",
        "_size",
        "_threads",
        "generation",
        "limits",
        "owner",
        "ready",
        "spoken",
    )

    def __init__(
        self, source: Any, size: int, limits: Limits, owner: str, name: str = "inturn"
    ) -> None:
        """source: a conninfo, or a ``psycopg_pool.AsyncConnectionPool`` of the caller's;
        name: the ``application_name`` of the connections it makes (see _named)."""
        self._kwargs: dict[str, Any] = {"autocommit": True}
        if isinstance(source, str):
            self._conninfo: str | None = source
            self._given: Any = None
        else:
            # (a pool's conninfo and kwargs may be callables: then only its loop is served)
            self._conninfo = source.conninfo if isinstance(source.conninfo, str) else None
            if isinstance(source.kwargs, dict):
                self._kwargs = {**source.kwargs, "autocommit": True}
            self._given = source
        self._kwargs = _named(self._conninfo, self._kwargs, name)
        self._size = size
        self.limits = limits
        self.owner = owner  # the backend, as its logs name it
        self._places: dict[asyncio.AbstractEventLoop, LoopPlace] = {}
        self._given_loop: asyncio.AbstractEventLoop | None = None
        self._threads: ThreadPlace | None = None
        self._lock = threading.Lock()  # held to change _places and _threads
        self.ready = Readiness(limits, owner)  # which connections are readied, and how
        self.generation = 0  # forks of this process since the backend was made
        #: A connection was made: the server is PostgreSQL (see _handshake).
        self.spoken = False
        _ALL.add(self)

    def thread_loop(self) -> asyncio.AbstractEventLoop | None:
        """The loop a given pool serves (other loops' calls must run there); None otherwise."""
        loop = self._given_loop
        if self._given is not None and loop is not None and loop.is_running():
            return loop
        return None

    # -- the steps ----------------------------------------------------------------------

    def taking(
        self, key: Hashable, timeout: float | None, until: float | None, tier: int | None
    ) -> Generator[Op, Any, Lease]:
        """A slot of tier, then a connection, readied (steps); tier None: one of its own.

        :raises TimeoutError: none came by until.
        :raises ~inturn.BackendUnavailable: none came free within session_wait,
            or the server could not be reached.
        """
        lease = Lease(tier or 0)
        try:
            if tier is not None:
                if not self.try_slot(lease) and not (yield (SLOT, lease, until)):
                    raise self._no_slot(key, timeout, until, tier)  # noqa: TRY301
                lease.take_idle()
            if lease.connection is None:
                failed = yield (CONNECT, lease, self.ready.until(timeout, until))
                if failed is not None:
                    raise self._unreachable(key, timeout, until, failed)  # noqa: TRY301
            if isinstance(lease.place, LoopPlace):
                lease.place.active.add(lease.connection)
            if lease.ready is None:
                lease.ready = yield from self.ready.readying(lease.connection, key, timeout, until)
        except BaseException:  # (raised here, or thrown in: an interrupt)
            lease.abandon()
            raise
        return lease

    def kept(self, tier: int) -> Lease | None:
        """(taking()'s fast verb.) A lease at once: a free slot of tier and a connection
        kept between turns; None if either is not there now (then taking() waits for a
        slot, or connects and readies)."""
        loop = loop_here()
        lease = Lease(tier)
        try:
            place: LoopPlace | ThreadPlace
            if loop is None:
                place = self._threads or self._thread_place()
                if not place.slots(tier).take(0):
                    return None
            else:
                place = self._places.get(loop) or self._place(loop)
                if not place.slots(tier).try_take():
                    return None
            lease.place = place
            place.take_idle(lease)
            if lease.connection is None:
                lease.abandon()
                return None
            if isinstance(place, LoopPlace):
                place.active.add(lease.connection)
        except BaseException:  # (a signal handler's: what the lease has, it gives back)
            lease.abandon()
            raise
        return lease

    # -- what the drivers do for the steps ------------------------------------------------

    def try_slot(self, lease: Lease) -> bool:
        """Take a free slot of lease's tier at once, if there is one: a task's of its event
        loop's, a thread's (no loop runs in it) of the process's threads'."""
        place: LoopPlace | ThreadPlace
        loop = loop_here()
        if loop is None:
            place = self._thread_place()
            taken = place.slots(lease.tier).take(0)
        else:
            place = self._place(loop)
            taken = place.slots(lease.tier).try_take()
        if taken:
            lease.place = place
        return taken

    def watch(self, loop: asyncio.AbstractEventLoop) -> Watch:
        """(A task's.) The watch of the bounds of loop's answers (loop: the running one)."""
        return self._place(loop).watch

    def _slot_wait(self, until: float | None) -> float | None:
        """Seconds to wait for a slot: the turn's time left, at most session_wait."""
        wait = self.limits.session_wait
        left = None if until is None else max(0.0, until - time.monotonic())
        return wait if left is None else left if wait is None else min(left, wait)

    async def slot(self, lease: Lease, until: float | None) -> bool:
        """(A task's.) Wait for a slot of lease's tier (see :meth:`_slot_wait`); whether
        it came."""
        place = self._place()
        slots = place.slots(lease.tier)
        if slots.try_take():
            lease.place = place
            return True
        waiter = asyncio.get_running_loop().create_future()
        slots.waiters.append(waiter)
        left = self._slot_wait(until)
        try:
            await asyncio.wait((waiter,), timeout=left)
        finally:
            if waiter.done() and not waiter.cancelled():
                lease.place = place  # (handed on: the lease gives it back if it fails)
            else:
                waiter.cancel()
        return lease.place is not None

    def slot_sync(self, lease: Lease, until: float | None) -> bool:
        """(A thread's.) As :meth:`slot`."""
        place = self._thread_place()
        if not place.slots(lease.tier).take(self._slot_wait(until)):
            return False
        lease.place = place
        return True

    async def connect(self, lease: Lease, until: float) -> Exception | None:
        """(A task's.) A new connection for lease by until (from the caller's pool, if any).

        Until one was made, what listens there is asked first whether it is
        PostgreSQL (see _handshake): another kind of server fails it at once.
        """
        place = lease.place
        try:
            if isinstance(place, LoopPlace) and place.given is not None:
                wait = max(0.001, until - time.monotonic())
                lease.connection = await place.given.getconn(timeout=wait)
            else:
                conninfo = self._conninfo_for("another event loop than its own")
                where = None if self.spoken else handshake.target(conninfo)
                if where is not None:
                    bound = min(handshake.PROBE_FOR, max(0.001, until - time.monotonic()))
                    refused = await handshake.check(where, bound)
                    if refused is not None:
                        return refused
                wait = max(0.001, until - time.monotonic())
                connecting = psycopg.AsyncConnection.connect(
                    conninfo, connect_timeout=max(2, math.ceil(wait)), **self._kwargs
                )
                lease.connection = await asyncio.wait_for(connecting, wait)
        except (psycopg.OperationalError, asyncio.TimeoutError) as error:  # (and pool errors)
            return error
        self.spoken = True
        return None

    def connect_sync(self, lease: Lease, until: float) -> Exception | None:
        """(A thread's.) As :meth:`connect` (libpq waits 2 s at least)."""
        conninfo = self._conninfo_for("threads")
        where = None if self.spoken else handshake.target(conninfo)
        if where is not None:
            bound = min(handshake.PROBE_FOR, max(0.001, until - time.monotonic()))
            refused = handshake.check_sync(where, bound)
            if refused is not None:
                return refused
        wait = max(0.001, until - time.monotonic())
        connect = partial(
            psycopg.Connection.connect,
            conninfo,
            connect_timeout=max(2, math.ceil(wait)),
            **self._kwargs,
        )
        try:
            # NOTE: one step: the connection lands in the lease as connect returns, where its
            # clean-up finds it. FOR_ITER calls it, and no CPython (3.10 to 3.13) checks for a
            # signal before the store (3.10 does after a call returns: a plain assignment
            # could lose it there, open).
            for lease.connection in iter(connect, None):
                break
        except psycopg.OperationalError as error:
            return error
        self.spoken = True
        return None

    async def probe(self, pid: int, until: float) -> bool:
        """(A task's.) Whether the server still has session pid, asked on a new connection."""
        if self._conninfo is None:
            return True  # (a pool of the caller's with a conninfo function: cannot ask)
        wait = max(0.001, until - time.monotonic())
        try:
            return await asyncio.wait_for(self._probing(pid, wait), wait)
        except (psycopg.Error, OSError, asyncio.TimeoutError):
            return False

    async def _probing(self, pid: int, wait: float) -> bool:
        kwargs = {**self._kwargs, "connect_timeout": max(2, math.ceil(wait))}
        assert self._conninfo is not None
        checking = await psycopg.AsyncConnection.connect(self._conninfo, **kwargs)
        try:
            reply = _wire.ask(
                checking, _sql.PROBE, [str(pid).encode()], False, asyncio.get_running_loop()
            )
            return alive(await _wire.answer(reply))
        finally:
            _wire.discard(checking)

    def probe_sync(self, pid: int, until: float) -> bool:
        """(A thread's.) As :meth:`probe`."""
        if self._conninfo is None:
            return True
        wait = max(0.001, until - time.monotonic())
        kwargs = {**self._kwargs, "connect_timeout": max(2, math.ceil(wait))}
        try:
            checking = psycopg.Connection.connect(self._conninfo, **kwargs)
        except psycopg.Error:
            return False
        try:
            _wire.send(checking, _sql.PROBE, [str(pid).encode()])
            answer = _wire.answer_sync(checking.pgconn, [], until, True)
        except psycopg.Error:
            return False
        finally:
            _wire.discard(checking)
        return alive(answer)

    async def rows(self, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        """(lines()'s.) The rows of one statement, asked on a connection of its own (one of
        the caller's pool, if it has no conninfo), within unreachable_after.

        :raises psycopg.Error: as the connection or the server said.
        :raises TimeoutError: no answer within unreachable_after.
        """
        wait = self.limits.unreachable_after
        if self._conninfo is None:

            async def asking() -> list[tuple[Any, ...]]:
                async with self._given.connection(timeout=wait) as connection:
                    return await (await connection.execute(sql, params)).fetchall()  # type: ignore[no-any-return]

        else:
            conninfo = self._conninfo

            async def asking() -> list[tuple[Any, ...]]:
                kwargs = {**self._kwargs, "connect_timeout": max(2, math.ceil(wait))}
                async with await psycopg.AsyncConnection.connect(conninfo, **kwargs) as connection:
                    return await (await connection.execute(sql, params)).fetchall()

        return await asyncio.wait_for(asking(), wait)

    # -- places ---------------------------------------------------------------------------

    def _place(self, loop: asyncio.AbstractEventLoop | None = None) -> LoopPlace:
        """The slots and idle connections of the running event loop (made on its first call).

        loop: the running one, if the caller has it.
        """
        if loop is None:
            loop = asyncio.get_running_loop()
        place = self._places.get(loop)
        if place is not None:
            return place
        with self._lock:
            for other in [other for other in self._places if other.is_closed()]:
                del self._places[other]  # its loop ended without shutting down
            place = self._places.get(loop)
            if place is None:
                if self._given is not None and self._given_loop in (None, loop):
                    self._given_loop = loop
                    place = LoopPlace(self._given.max_size, self._given)
                else:
                    place = LoopPlace(self._size)
                self._places[loop] = place
        if place.guard is None:
            place.guard = guard(place, lambda: self._dropped(loop, place))
            try:  # (its first step registers it with the loop's async generator hooks)
                place.guard.asend(None).send(None)
            except StopIteration:
                pass
        return place

    def _dropped(self, loop: asyncio.AbstractEventLoop, place: LoopPlace) -> None:
        with self._lock:
            if self._places.get(loop) is place:
                del self._places[loop]

    def _thread_place(self) -> ThreadPlace:
        place = self._threads
        if place is None:
            with self._lock:
                place = self._threads
                if place is None:
                    place = self._threads = ThreadPlace(self._size)
        return place

    # -- both -------------------------------------------------------------------------------

    def _conninfo_for(self, what: str) -> str:
        if self._conninfo is None:
            raise RuntimeError(
                f"inturn: {self.owner} is on a pool of your own whose conninfo is a function: "
                f"it cannot connect for {what}; give the backend a conninfo string"
            )
        return self._conninfo

    def _no_slot(
        self, key: Hashable, timeout: float | None, until: float | None, tier: int
    ) -> Exception:
        """TimeoutError if the turn's own time ran out; else the session_wait's refusal."""
        level = f" at nesting level {tier}" if tier else ""
        fix = None  # (Waited.CONNECTION's: raise max_sessions)
        if self._given is not None and loop_here() is self._given_loop:
            size, where, fix = f"max_size={self._given.max_size}", "of your pool", _YOUR_POOL
        else:
            size, where = f"max_sessions={self._size}", "of this event loop or thread"
        if until is not None and now() >= until:
            detail = f" (all {size} {where}{level} held by turns)"
            return missed((key,), Waited.CONNECTION, timeout, detail, fix)
        return BackendUnavailable(
            f"inturn: no connection of {self.owner} came free for key {show(key)} within "
            f"session_wait={self.limits.session_wait:g} s: all {size} {where}{level} are "
            "held by turns; the work did not run. A turn that waits for other turns of its "
            "process while it holds its keys needs a connection for each at once: start "
            "those turns in its context (tasks made in its block, asyncio.to_thread, "
            "contextvars.copy_context().run), which take connections of their own, or "
            f"raise {size.split('=')[0]} or session_wait"
        )

    def _unreachable(
        self, key: Hashable, timeout: float | None, until: float | None, error: Exception
    ) -> Exception:
        """TimeoutError if the turn's own time ran out first; else BackendUnavailable."""
        pooled = type(error).__name__ == "PoolTimeout"  # (psycopg_pool's: the server is fine)
        if until is not None and now() >= self.ready.late(timeout, until) - 1e-3:
            if pooled:
                detail = f" (all max_size={self._given.max_size} of your pool in use)"
                return missed((key,), Waited.CONNECTION, timeout, detail, _YOUR_POOL)
            return missed((key,), Waited.ANSWER, timeout, " from PostgreSQL (connecting)")
        reason = said(error) if isinstance(error, psycopg.Error) else (str(error) or "timed out")
        if pooled:
            failure = BackendUnavailable(
                f"inturn: no connection of your pool (max_size={self._given.max_size}) came "
                f"free for key {show(key)} ({reason}); the work did not run. Every turn that "
                "holds or waits for a key at once needs a connection of its own, nested "
                "turns included: raise the pool's max_size"
            )
            failure.__cause__ = error
            return failure
        failure = BackendUnavailable(
            f"inturn: could not connect to PostgreSQL for key {show(key)} ({reason}) through "
            f"{self.owner}; the work did not run"
        )
        failure.__cause__ = error
        return failure

    async def aclose(self) -> None:
        """Close the connections kept (their sessions end, and their locks with them)."""
        with self._lock:
            places = list(self._places.items())
            self._places.clear()
            threads, self._threads = self._threads, None
        if threads is not None:
            threads.close()
        loop = asyncio.get_running_loop()
        for owner, place in places:
            if owner is loop:
                await place.close()
            elif owner.is_running():  # another thread's loop: close them there
                there = asyncio.run_coroutine_threadsafe(place.close(), owner)
                await asyncio.wait(
                    (asyncio.wrap_future(there),), timeout=self.limits.unreachable_after
                )
            # (else its loop ended: its connections are closed, or were left to the collector)

    def forked(self) -> None:
        """(In a forked child.) Leave the parent's connections alone; make new ones."""
        _INHERITED.append((self._places, self._threads))
        self._places = {}
        self._threads = None
        self._given_loop = None
        self._lock = threading.Lock()
        self.generation += 1


#: The longest application_name PostgreSQL keeps (NAMEDATALEN - 1 bytes; it cuts longer).
_NAME_BYTES = 63


def _named(conninfo: str | None, kwargs: dict[str, Any], name: str) -> dict[str, Any]:
    """kwargs, with ``application_name`` name (cut to what PostgreSQL keeps), unless the
    conninfo, the kwargs (a pool's) or the environment (``PGAPPNAME``) give one."""
    if "application_name" in kwargs or os.environ.get("PGAPPNAME"):
        return kwargs
    if conninfo is not None and psycopg.conninfo.conninfo_to_dict(conninfo).get("application_name"):
        return kwargs
    cut = name.encode()[:_NAME_BYTES].decode(errors="ignore")
    return {**kwargs, "application_name": cut}
