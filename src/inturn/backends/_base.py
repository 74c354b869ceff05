"""The seam between the queue and the place its lines are shared, declared, never probed.

:class:`Backend` (async), :class:`BlockingBackend` (threads block in it),
:class:`SessionBackend` (a turn's keys on one connection, a
:class:`TurnSession`), the :class:`Grant` a backend hands out for one key,
and :class:`Capabilities`: what a backend declares it does, which is all the
queue reads of it beyond the protocol's methods.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Capabilities:
    r"""What a backend does beyond :class:`Backend`: the queue reads this, never probes.

    :ivar blocking: it is a :class:`BlockingBackend` (and its sessions are
        :class:`BlockingTurnSession`\ s): a thread's turn blocks in its
        ``*_sync`` methods. Otherwise a thread's calls run on an event loop
        (see :meth:`Backend.thread_loop`); the thread's work still runs in the
        thread itself.
    :ivar one_loop: every event loop it serves costs it a session
        (connections, a subscription: Redis). A queue then serves one loop
        at a time directly (the first, while it lives; at most two in turn)
        and the tasks of every other loop through the same loop as threads,
        so that an ``asyncio.run()`` per job opens no connection per job.
    :ivar sessions: it is a :class:`SessionBackend`: its locks belong to a
        connection, and a turn takes all its keys on one (PostgreSQL).
    :ivar transactions: ``keyed(..., transaction=True)`` runs the block in a
        transaction on the turn's connection (needs ``sessions``).
    :ivar latest: it is a :class:`LatestBackend`: it keeps one latest work per
        key among every process (``across="processes"``); with ``sessions``, its
        sessions are :class:`LatestSession`\ s too.
    """

    blocking: bool = False
    one_loop: bool = False
    sessions: bool = False
    transactions: bool = False
    latest: bool = False

    def __post_init__(self) -> None:
        if self.transactions and not self.sessions:
            raise ValueError("inturn: Capabilities(transactions=True) needs sessions=True")


@runtime_checkable
class Grant(Protocol):
    """A backend's answer to :meth:`Backend.acquire`: the turn on one key, while it lasts."""

    @property
    def key(self) -> Hashable:
        """The key this grant holds."""
        ...

    @property
    def token(self) -> int:
        """A fencing token: larger than that of every earlier grant of the same key."""
        ...

    @property
    def lost(self) -> bool:
        """Whether the backend can no longer vouch for this grant (its lease ran out, say)."""
        ...


class TurnSession(Protocol):
    """One turn's hold on a backend that takes all of a turn's keys on one connection.

    A :class:`SessionBackend` makes one per turn
    (``session(count, transaction, own, depth)``, no I/O): the queue then
    takes a turn's keys through the session rather than the backend, after
    it took every key's place in this process's lines, and ends the turn
    with :meth:`close` (no per-grant release). PostgreSQL does: its locks
    belong to a connection, so a turn on several keys needs one connection,
    not one per key, and a pool of connections can
    never deadlock turns that each wait for a second one.

    ``count`` is how many keys the turn will take; ``transaction`` asks for
    the turn's work to run in a transaction on :attr:`connection` that
    :meth:`close` commits (or rolls back); ``own`` says the caller's event
    loop is short-lived (a loop per job), so the session should not keep a
    pool for it; ``depth`` is how many sessions the turns around this one
    hold (in its context: a task made inside a turn's block has that turn
    around it), so that a bounded pool can keep connections apart for turns
    their holders wait for. Its calls run on one event loop, as the backend's do; the
    session of a blocking backend is a :class:`BlockingTurnSession`.
    """

    @property
    def connection(self) -> object:
        """The connection the turn's keys are held on (what ``turn.connection`` gives)."""
        ...

    async def acquire(self, key: Hashable, timeout: float | None) -> Grant:
        """As :meth:`Backend.acquire`, on the session's connection (the first call gets one)."""
        ...

    def release(self, grant: Grant) -> Awaitable[None]:
        """Give back one grant early (a grant whose caller gave up); :meth:`close` does the rest."""
        ...

    def close(self, error: BaseException | None) -> Awaitable[None]:
        """End the turn: commit (error is None) or roll back, then free every key it holds.

        Completes even if the caller is cancelled meanwhile (as a release).
        Marks a grant ``lost`` whose key was no longer held.

        :raises ~inturn.BackendUnavailable: the transaction did not commit.
        """
        ...


@runtime_checkable
class Backend(Protocol):
    """Where a queue's lines are shared with other processes.

    A :class:`~inturn.KeyedQueue` keeps a line per key in its own process
    whatever its backend: that line gives same-process FIFO, reentrancy,
    ``max_pending``, drain and introspection. With a backend, the task at
    the head of its process's line then takes the key's turn from the
    backend, which orders the heads of every process using the same lines.
    So a backend sees at most one waiter per key per queue.

    A backend's contract:

    - :meth:`acquire` returns only once the caller holds the key against
      every other process, in the order the backend received the calls. If
      it raises (timeout, cancellation, backend unreachable), the key is not
      held and no trace of the call blocks anyone else.
    - :meth:`release` ends a grant; the next in line gets the key. It is
      called once per grant, and must complete even if the caller's task is
      cancelled again meanwhile: the queue runs a coroutine it returns in a
      task of its own, and awaits an :class:`asyncio.Future` as it is (a
      backend that returns one vouches that cancelling it does not stop the
      release).
    - :meth:`acquire` may be called from several event loops at once (in
      different threads): each call, and the release of its grant, on the
      loop it was made from.
    - What it does beyond this protocol it declares in :attr:`capabilities`
      (see :class:`Capabilities`): threads blocking in it
      (:class:`BlockingBackend`), one event loop per process, a turn's keys
      on one connection (:class:`SessionBackend`), transactions.
    - Threads of a backend that does not block them: their calls run on one
      event loop that the queue keeps in a daemon thread of the process, or
      on the loop :meth:`thread_loop` names (one it is bound to).
    - Keys cross process boundaries, so :meth:`order` accepts only keys that
      every process names alike and sorts them in one order every process
      computes identically (never by ``hash()``, which is salted per process).
    """

    @property
    def capabilities(self) -> Capabilities:
        """What this backend does beyond this protocol (a class attribute will do)."""
        ...

    def thread_loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop that calls from other loops and threads must run on, or None.

        None: any loop will do (the queue's own backend loop). A backend bound
        to one loop (redis-py's cluster client, a pool of the caller's) names it.
        """
        ...

    def order(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """Check keys, drop duplicates, and sort them into the global order.

        :raises TypeError: a key this backend cannot share, naming it.
        """
        ...

    async def acquire(self, key: Hashable, timeout: float | None) -> Grant:
        """Wait for key's turn among every process; return the grant.

        :param timeout: seconds to wait at most; ``None`` waits as long as it takes.
        :raises TimeoutError: the turn was not reached in time; the key is not held.
        :raises ~inturn.BackendUnavailable: the backend could not be reached.
        """
        ...

    def release(self, grant: Grant) -> Awaitable[None]:
        """End grant's turn and let the next in line have the key (``async def`` will do)."""
        ...

    async def aclose(self) -> None:
        """Release what the backend holds open (connections, files)."""
        ...


@runtime_checkable
class BlockingBackend(Backend, Protocol):
    """A backend that blocks a thread itself while it waits (``capabilities.blocking``).

    The same contract as :class:`Backend`'s async methods, for a thread: the
    file backend waits in the kernel, PostgreSQL on a sync connection. An
    interrupted call (``KeyboardInterrupt``, a signal handler's exception)
    leaves nothing held.
    """

    def acquire_sync(
        self, key: Hashable, timeout: float | None, into: list[Grant] | None = None
    ) -> Grant:
        """As :meth:`Backend.acquire`, blocking this thread while it waits.

        With ``into``, the grant is also appended to it where it is made,
        with no Python code run after (``into.extend(map(...))``): an
        exception from a signal handler, which CPython may raise after any
        call returns on the way back (3.10 does), then finds it in ``into``,
        and the caller's clean-up releases it.
        """
        ...

    def release_sync(self, grant: Grant) -> None:
        """As :meth:`Backend.release`, returning once the release is done."""
        ...


class BlockingTurnSession(TurnSession, Protocol):
    """The :class:`TurnSession` of a blocking backend, for a thread's turn."""

    def acquire_sync(
        self, key: Hashable, timeout: float | None, into: list[Grant] | None = None
    ) -> Grant:
        """As :meth:`TurnSession.acquire`, blocking this thread while it waits (``into``: see
        :meth:`BlockingBackend.acquire_sync`; a grant that does not reach it is released with
        the session's close)."""
        ...

    def release_sync(self, grant: Grant) -> None:
        """As :meth:`TurnSession.release`, returning once the release is done."""
        ...

    def close_sync(self, error: BaseException | None) -> None:
        """As :meth:`TurnSession.close`, returning once the turn has ended."""
        ...


@runtime_checkable
class SessionBackend(Backend, Protocol):
    """A backend whose locks belong to a connection (``capabilities.sessions``): PostgreSQL."""

    def session(self, count: int, transaction: bool, own: bool, depth: int) -> TurnSession:
        """A new turn's session (no I/O; see :class:`TurnSession` for the arguments)."""
        ...


class Replaced(Exception):
    """Newer work of another process took this work's place in the key's line, and ran.

    Raised by :meth:`LatestBackend.acquire_latest`: the key is not held, and
    the queue answers the callers whose work it replaced (see
    ``on_superseded``); it never reaches them as it is.
    """

    def __init__(self, key: Hashable, called: int, ok: bool) -> None:
        super().__init__(key, called, ok)
        self.key = key
        #: When the work that ran was called (``time.monotonic_ns()``, the host's clock).
        self.called = called
        #: Whether that work returned (False: it raised, or its turn was cut).
        self.ok = ok


#: When a process's newest work on a key was called (``time.monotonic_ns()``): asked by a
#: LatestBackend when the key's turn comes to that process (see acquire_latest).
Newest = Callable[[], int]


@runtime_checkable
class LatestGrant(Grant, Protocol):
    """The grant of a :class:`LatestBackend`'s latest turn."""

    def ran(self, called: int, ok: bool) -> None:
        """Note, before the release, the work that ran: when it was called, and whether it
        returned; the release tells the key's line (see :class:`LatestBackend`)."""
        ...


@runtime_checkable
class LatestBackend(BlockingBackend, Protocol):
    """A backend that keeps one latest work per key among every process (``capabilities.latest``).

    A process's turn of latest work (``pending="latest", across="processes"``)
    is taken with :meth:`acquire_latest`. The contract, among the turns so
    taken on one key:

    - When such a turn reaches the head of the key's line, the backend asks
      its process for its newest work (``newest()``): the turn runs it only
      if no newer work of another process waits in the line, or ran since it
      was called; else it gives the key on, and either waits again behind
      that newer work or raises :exc:`Replaced` once newer work has run.
    - Whatever process dies at whatever moment, the newest work a live
      process still waits for runs: a turn whose newer work's process died
      before the newer work returned runs after all.
    - :meth:`LatestGrant.ran` is called before the release: the release
      records what ran, for the turns that wait behind it.
    """

    async def acquire_latest(self, key: Hashable, timeout: float | None, newest: Newest) -> Grant:
        """As :meth:`Backend.acquire`, for latest work (see the class).

        :raises Replaced: newer work of another process ran in this work's place.
        """
        ...

    def acquire_latest_sync(
        self,
        key: Hashable,
        timeout: float | None,
        newest: Newest,
        into: list[Grant] | None = None,
    ) -> Grant:
        """As :meth:`acquire_latest`, blocking this thread (``into``: see acquire_sync)."""
        ...


class LatestSession(TurnSession, Protocol):
    """The :class:`TurnSession` of a :class:`SessionBackend` that keeps one latest work per
    key among every process (``capabilities.latest``: PostgreSQL): a turn of latest work
    takes its key through it, with the contract of :class:`LatestBackend`."""

    async def acquire_latest(self, key: Hashable, timeout: float | None, newest: Newest) -> Grant:
        """As :meth:`LatestBackend.acquire_latest`, on the session's connection."""
        ...

    def acquire_latest_sync(
        self,
        key: Hashable,
        timeout: float | None,
        newest: Newest,
        into: list[Grant] | None = None,
    ) -> Grant:
        """As :meth:`acquire_latest`, blocking this thread (``into``: see acquire_sync)."""
        ...
