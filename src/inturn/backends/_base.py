"""The seam between the queue and the place its lines are shared: Backend and Grant."""

from __future__ import annotations

from collections.abc import Awaitable, Hashable
from typing import Protocol, runtime_checkable

__all__ = ("Backend", "Grant", "Session")


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


class Session(Protocol):
    """One turn's hold on a backend that takes all of a turn's keys on one connection.

    A backend may offer ``session(count, transaction, own, depth) -> Session``
    (no I/O): the queue then takes a turn's keys through the session rather
    than the backend, after it took every key's place in this process's
    lines, and ends the turn with :meth:`close` (no per-grant release).
    PostgreSQL does: its locks belong to a connection, so a turn on several
    keys needs one connection, not one per key, and a pool of connections can
    never deadlock turns that each wait for a second one.

    ``count`` is how many keys the turn will take; ``transaction`` asks for
    the turn's work to run in a transaction on :attr:`connection` that
    :meth:`close` commits (or rolls back); ``own`` says the caller's event
    loop is short-lived (a loop per job), so the session should not keep a
    pool for it; ``depth`` is how many sessions the turns around this one
    hold (in its context: a task made inside a turn's block has that turn
    around it), so that a bounded pool can keep connections apart for turns
    their holders wait for. Its calls run on one event loop, as the backend's do; a
    session may offer ``acquire_sync``, ``release_sync`` and
    ``close_sync(error)`` for threads, as a backend may.
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
    - Threads: a backend may offer ``acquire_sync(key, timeout) -> Grant``
      and ``release_sync(grant) -> None``, with the same contract, blocking
      the calling thread (the file backend waits in the kernel). Without
      them, a thread's calls run on one event loop that the queue keeps in
      a daemon thread of the process, or on the loop that the backend's
      optional ``thread_loop() -> AbstractEventLoop | None`` names (one it
      is bound to); the thread's work still runs in the thread itself.
    - A backend whose every event loop costs it a session (connections, a
      subscription: Redis) may set ``prefers_one_loop = True``: a queue then
      serves one loop at a time directly (the first, while it lives; at
      most two in turn) and the tasks of every other loop through the same
      backend loop as threads, so that an ``asyncio.run()`` per job opens
      no connection per job.
    - A backend whose locks belong to a connection may offer ``session()``
      (see :class:`Session`): one connection per turn, however many keys.
    - Keys cross process boundaries, so :meth:`order` accepts only keys that
      every process names alike and sorts them in one order every process
      computes identically (never by ``hash()``, which is salted per process).
    """

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
