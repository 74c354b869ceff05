"""How a thread takes a backend's turn: natively, or through this process's backend loop.

A backend may block a thread itself (``acquire_sync``/``release_sync``, as
the file backend does: the kernel waits on its ticket). For one that is an
asyncio client only (Redis), the thread's calls run on one event loop kept
in a daemon thread of this process, the *backend loop*, made at the first
such call. Only the backend's calls go there; the caller's work runs in
the caller's thread.

Guarantees of a bridged call:

- The waiting thread may be interrupted (KeyboardInterrupt, a signal
  handler's exception such as gunicorn's SystemExit on SIGABRT): the call
  on the backend loop is cancelled, and a grant it got all the same is
  released there. Nothing is left holding the key.
- A forked child makes a backend loop of its own at its first call (the
  parent's thread does not exist in the child).
- The backend loop costs one idle thread per process that uses it, no CPU
  while nobody calls, and lives until the process exits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Hashable
from concurrent.futures import Future, InvalidStateError
from typing import TYPE_CHECKING, Any, TypeVar, cast, final

from ._checks import Waited, missed
from ._describe import describe
from ._tasks import retrieve

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

    from .backends._base import Backend, BlockingBackend, BlockingTurnSession, Grant, TurnSession

    Source = Backend | TurnSession

#: Its own logger, under the core's "inturn": what it logs is rare (a thread per
#: process started; a grant whose caller gave up), and at DEBUG only.
logger = logging.getLogger("inturn.bridge")

#: How long past its own timeout a thread waits for the backend loop's answer
#: to a call the backend bounds itself: only a backend that broke its contract
#: (or a backend loop frozen by a callback) needs it.
_GRACE = 5.0

#: What a thread or a task waits on for an end on the backend loop (see _end_there).
_O = TypeVar("_O", "Future[None]", "Answer")


@final
class _BackendLoop:
    """This process's event loop for threads' calls to asyncio backends, in a daemon thread."""

    __slots__ = ("_lock", "_loop", "_pid")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0

    def get(self) -> asyncio.AbstractEventLoop:
        """The running backend loop of this process, started if need be."""
        loop = self._loop
        if loop is not None and self._pid == os.getpid():
            return loop
        with self._lock:
            if self._loop is None or self._pid != os.getpid():
                # (in a forked child, the parent's loop has no thread: it is left as it is)
                loop = asyncio.new_event_loop()
                started = threading.Event()
                threading.Thread(
                    target=_serve, args=(loop, started), name="inturn-backend-loop", daemon=True
                ).start()
                started.wait()
                self._loop, self._pid = loop, os.getpid()
                logger.debug(
                    "inturn: started the backend loop thread of process %d, for threads' "
                    "calls to asyncio backends",
                    self._pid,
                )
            return self._loop


def _serve(loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(started.set)
    loop.run_forever()  # (a daemon thread: it ends with the process)


_LOOP = _BackendLoop()


def backend_loop() -> asyncio.AbstractEventLoop:
    """This process's backend loop (started at the first call; a forked child makes its own).

    For a blocking backend whose threads still need a loop for what goes on
    between their calls (the Redis backend's subscription and heartbeat).
    """
    return _LOOP.get()


@final
class Answer:
    """What a thread waits for from the backend loop: an outcome, behind a plain lock.

    Not a concurrent.futures.Future: its waits take a threading.Condition,
    whose ``__enter__`` and ``__exit__`` are Python functions, so a signal
    handler's exception (raised at the start of a Python function) can
    leave its lock taken, and the backend loop would block for good the
    next time it touched the future. A thread blocks on a C lock here
    instead, which an interrupt never leaves half taken. Set once, on the
    backend loop (as much of a Future as _Call, _settle_outcome and the
    Redis backend's thread waiters use).
    """

    __slots__ = ("_done", "_error", "_set", "_value")

    def __init__(self) -> None:
        self._set = threading.Lock()
        self._set.acquire()  # (released once the outcome is set)
        self._value: Any = None
        self._error: BaseException | None = None
        self._done = False

    def cancelled(self) -> bool:
        return False  # (a thread gives up by _Call.abandon instead)

    def done(self) -> bool:
        return self._done

    def set_result(self, value: Any) -> None:
        self._value = value
        self._done = True
        self._set.release()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._done = True
        self._set.release()

    def wait(self, timeout: float | None) -> bool:
        """Block until the outcome is set (True), or timeout seconds went by (False)."""
        return self._set.acquire(timeout=-1 if timeout is None else timeout)

    def result(self) -> Any:
        """The outcome, once wait() said it is set: its value, or its error raised."""
        if self._error is not None:
            raise self._error
        return self._value


@final
class _Call:
    """One acquire on the backend loop, which its caller (a thread, a task) may give up.

    Its methods but the constructor run on the backend loop, so they never race.
    """

    __slots__ = ("abandoned", "backend", "finished", "outcome", "task")

    def __init__(self, backend: Source, outcome: Future[Grant] | Answer) -> None:
        self.backend = backend
        self.outcome = outcome  # a thread's Answer, or a Future for a task's wrap_future
        self.task: asyncio.Task[Grant] | None = None
        self.abandoned = False  # the thread gave up
        self.finished = False  # the acquire ended and _finished saw it

    def start(self, key: Hashable, timeout: float | None) -> None:
        task = self.task = asyncio.ensure_future(self.backend.acquire(key, timeout))
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[Grant]) -> None:
        """Hand the outcome to the caller, or release a grant the caller no longer waits for."""
        self.finished = True
        if self.abandoned or self.outcome.cancelled():  # (cancelled: by a task's wrap_future)
            self._drop(task)
            return
        try:
            if task.cancelled():
                self.outcome.set_exception(
                    RuntimeError("inturn: the backend's acquire was cancelled on its loop")
                )
            elif (error := task.exception()) is not None:
                self.outcome.set_exception(error)
            else:
                self.outcome.set_result(task.result())
        except InvalidStateError:  # a task's wrap_future cancelled it just now
            self._drop(task)

    def abandon(self) -> None:
        """The caller gave up (timed out, interrupted): cancel the call, or release its grant."""
        if self.abandoned:
            return
        self.abandoned = True
        task = self.task
        if task is None:
            return  # interrupted before it could start the call: nothing was asked
        if not task.done():
            task.cancel()  # _finished releases a grant it got all the same
        elif self.finished and not self.outcome.cancelled():
            self._drop(task)  # handed to the caller, which left before it took it
        # (else _finished dropped it already, or is about to run, and drops it)

    def _drop(self, task: asyncio.Task[Grant]) -> None:
        if not task.cancelled() and task.exception() is None:
            grant = task.result()
            logger.debug(
                "inturn: releasing the turn on key %s that %s granted after its caller gave up",
                describe(grant.key),
                describe(self.backend),
            )
            _end_here(lambda: self.backend.release(grant))


def _end_here(end: Callable[[], Awaitable[None]]) -> asyncio.Future[None]:
    """(On the backend loop.) Start end(); the future of it, which goes on alone."""
    ending = end()
    done = ending if isinstance(ending, asyncio.Future) else asyncio.ensure_future(ending)
    done.add_done_callback(retrieve)  # (a failed release was the backend's to log)
    return done


def _loop_for(backend: Backend) -> asyncio.AbstractEventLoop:
    """Where a thread's call to backend runs: the loop it is bound to, or the backend loop."""
    loop = backend.thread_loop()
    return _LOOP.get() if loop is None else loop


def acquire_sync(
    backend: Backend, source: Source, key: Hashable, timeout: float | None, into: list[Grant]
) -> None:
    """source.acquire(key, timeout) for this thread, blocking it while it waits; the grant
    goes into ``into`` as it is made (see BlockingBackend.acquire_sync).

    ``source`` is backend, or a turn's session of it. A blocking backend
    blocks the thread itself; another's call runs on its loop (see _loop_for).

    :raises TimeoutError: as the backend's acquire, or its loop did not answer in time.
    """
    if backend.capabilities.blocking:
        blocking: BlockingBackend | BlockingTurnSession = source  # type: ignore[assignment]
        blocking.acquire_sync(key, timeout, into)  # (typed so, not cast(): a call less a turn)
    else:
        acquire_there(backend, source, key, timeout, into)


def acquire_there(
    backend: Backend,
    source: Source,
    key: Hashable,
    timeout: float | None,
    into: list[Grant] | None = None,
) -> Grant:
    """source.acquire(key, timeout) on the backend's loop, for this thread, blocking it.

    What acquire_sync does for a backend that does not block threads; a
    blocking one may call it too, for a turn it cannot take natively (the
    Redis backend's first, which sets up its subscription on that loop).
    With ``into``, the grant goes into it as it is taken (see acquire_sync).
    """
    loop = _loop_for(backend)
    answer = Answer()
    call = _Call(source, answer)
    got = [] if into is None else into
    given = len(got)
    try:
        loop.call_soon_threadsafe(call.start, key, timeout)
        if not answer.wait(None if timeout is None else timeout + _GRACE):
            detail = f" from the backend's event loop, {_GRACE:g} s past the limit"
            raise missed((key,), Waited.ANSWER, timeout, detail, "")  # noqa: TRY301 - given up below
        got.extend(map(Answer.result, (answer,)))  # NOTE: one step: the grant, in got
    except BaseException:
        # Timed out, interrupted, or refused by the backend: nothing may stay held (a grant
        # in into, the caller releases).
        if into is None or len(got) == given:
            loop.call_soon_threadsafe(call.abandon)
        raise
    grant: Grant = got[-1]
    return grant


async def acquire_via(
    backend: Backend, source: Source, key: Hashable, timeout: float | None
) -> Grant:
    """source.acquire(key, timeout) for a task of another loop, on the backend's loop.

    (A loop the backend does not serve directly: see ThreadMode.via.) Cancelled
    or timed out, the call is given up as a thread's is.
    """
    loop = _loop_for(backend)
    outcome: Future[Grant] = Future()
    call = _Call(source, outcome)
    try:
        loop.call_soon_threadsafe(call.start, key, timeout)
        return await asyncio.wrap_future(outcome)
    except BaseException:
        loop.call_soon_threadsafe(call.abandon)
        raise


def release_via(backend: Backend, source: Source, grant: Grant) -> asyncio.Future[None]:
    """source.release(grant) on the backend's loop, for acquire_via's grant; it goes on alone."""
    return asyncio.wrap_future(_end_there(backend, lambda: source.release(grant), Future()))


def close_via(
    backend: Backend, session: TurnSession, error: BaseException | None
) -> asyncio.Future[None]:
    """session.close(error) on the backend's loop, for acquire_via's session; it goes on alone."""
    return asyncio.wrap_future(_end_there(backend, lambda: session.close(error), Future()))


def _end_there(backend: Backend, end: Callable[[], Awaitable[None]], outcome: _O) -> _O:
    """Start end() on the backend's loop; outcome (a task's Future, a thread's Answer)
    is settled once it is done."""
    _loop_for(backend).call_soon_threadsafe(_end_into, end, outcome)
    return outcome


def _end_for_thread(backend: Backend, end: Callable[[], Awaitable[None]]) -> None:
    """Run end() on the backend's loop; return once it is done (its error raised)."""
    answer = _end_there(backend, end, Answer())
    answer.wait(None)  # (the end completes by itself: see release_sync)
    answer.result()


def _end_into(end: Callable[[], Awaitable[None]], outcome: Future[None] | Answer) -> None:
    """(On the backend loop.) Start end(); settle outcome once it is done."""
    _end_here(end).add_done_callback(lambda done: _settle_outcome(done, outcome))


def release_sync(backend: Backend, source: Source, grant: Grant) -> None:
    """source.release(grant) for this thread; returns once the release is done.

    Waits as long as the release takes: a backend's release completes by
    itself (its contract; Redis's within its socket timeout). If the thread
    is interrupted meanwhile, the release goes on by itself.
    """
    if backend.capabilities.blocking:
        blocking: BlockingBackend | BlockingTurnSession = source  # type: ignore[assignment]
        blocking.release_sync(grant)
        return
    _end_for_thread(backend, lambda: source.release(grant))


def close_sync(backend: Backend, session: TurnSession, error: BaseException | None) -> None:
    """session.close(error) for this thread; returns once it is done (as release_sync)."""
    if backend.capabilities.blocking:
        cast("BlockingTurnSession", session).close_sync(error)
        return
    _end_for_thread(backend, lambda: session.close(error))


def _settle_outcome(done: asyncio.Future[None], outcome: Future[Any] | Answer) -> None:
    try:
        if not done.cancelled() and (error := done.exception()) is not None:
            outcome.set_exception(error)
        else:
            outcome.set_result(None)  # (a cancelled one too: the release went on alone)
    except InvalidStateError:
        pass  # cancelled by a task's wrap_future meanwhile: the release went on all the same
