"""The two drivers of the PostgreSQL backend's steps (:mod:`._steps`).

:class:`Run` drives steps for a task: the ops it waits on resume it from
callbacks (the socket's reader, a timer), so a turn costs no task of its
own and a statement goes out the moment its step yields it; the rare ops
that psycopg offers only as coroutines (connect, cancel, a check on a new
connection, autocommit) run in a task. :func:`drive_sync` drives steps for
a thread, blocking it for each op. Both throw an interrupt of their caller
(a task's cancellation, a signal handler's exception) into the steps at the
op it came during, and go on with the ops the steps yield then.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, final

import psycopg

from ._steps import ANSWER, ASK, AUTOCOMMIT, CANCEL, CLOSE, CONNECT, PROBE, SLOT, Steps
from ._wire import Ahead, Reply, answer_sync, ask, discard, send, settle

if TYPE_CHECKING:
    from ._connections import Connections


@final
class Run:
    """Steps driven for a task on the running event loop; :attr:`result` is their outcome.

    ``interruptible``: whether the caller may :meth:`interrupt` it (a wait);
    an ending is not, and goes on whatever becomes of :attr:`result`'s
    awaiters (as ``Backend.release`` asks).
    """

    __slots__ = (
        "_connections",
        "_ended",
        "_pending",
        "_reply",
        "_steps",
        "_task",
        "_watch",
        "_watched",
        "done",
        "interrupted",
        "loop",
        "result",
        "value",
    )

    def __init__(self, steps: Steps, connections: Connections) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        self._steps = steps
        self._connections = connections
        self._reply: Reply | None = None  # the statement sent last
        self._watch = connections.watch(loop)  # where the bound of an answer waits
        self._watched = False  # whether the answer waited for has a bound in the watch
        self._task: asyncio.Future[Any] | None = None  # the coroutine op waited for
        self._pending: BaseException | None = None  # an interrupt to throw in at the next op
        self._ended: list[Callable[[], None]] = []  # called once the steps are done
        self.interrupted = False
        self.done = False
        self.value: Any = None  # what the steps returned (kept if result was cancelled)
        self.result: asyncio.Future[Any] = loop.create_future()
        self._go(None, None)

    def interrupt(self, error: BaseException) -> None:
        """Throw error into the steps at the op they wait on (once; not if they are done)."""
        if self.done or self.interrupted:
            return
        self.interrupted = True
        reply = self._reply
        if reply is not None and reply.callback is not None:  # waiting for an answer
            reply.callback = None
            self._unwatch()
            self._go(None, error)
        else:  # waiting for a coroutine op: cancelled, it resumes the steps with error
            self._pending = error
            if self._task is not None:
                self._task.cancel()

    def on_end(self, callback: Callable[[], None]) -> None:
        """Call callback once the steps are done (at once if they are)."""
        if self.done:
            callback()
        else:
            self._ended.append(callback)

    def ended(self) -> asyncio.Future[None]:
        """A future settled once the steps are done."""
        future: asyncio.Future[None] = self.loop.create_future()
        self.on_end(lambda: settle(future))
        return future

    def _go(self, value: Any, error: BaseException | None) -> None:
        """Send value (or throw error) into the steps; do their ops until one must wait."""
        steps = self._steps
        while True:
            if error is None and self._pending is not None:
                error, self._pending = self._pending, None
            try:
                op = steps.send(value) if error is None else steps.throw(error)
            except StopIteration as stop:
                self._end(stop.value, None)
                return
            except BaseException as problem:
                self._end(None, problem)
                return
            value = error = None
            verb = op[0]
            if verb in (ASK, ANSWER):
                if verb == ASK:
                    self._reply = None
                    try:
                        ahead = op[6] if len(op) > 6 else None
                        self._reply = ask(op[1], op[2], op[3], op[4], self.loop, ahead)
                    except psycopg.OperationalError as failed:
                        value = failed
                        continue
                    until = op[5]
                else:
                    until = op[1]
                reply = self._reply
                if reply is None:
                    continue  # (value None: the statement never went out)
                if reply.outcome is not None:
                    value = reply.outcome
                    continue
                if until is not None:
                    if until <= time.monotonic():
                        continue  # (value None: no answer by until)
                    self._watch.add(self, until)
                    self._watched = True
                reply.callback = self._answered
                return
            elif verb == CLOSE:
                discard(op[1], self._reply)
                self._reply = None
            else:
                self._wait_for(self._coroutine(op))
                return

    def _coroutine(self, op: tuple[Any, ...]) -> Coroutine[Any, Any, Any]:
        verb, connections = op[0], self._connections
        if verb == SLOT:
            return connections.slot(op[1], op[2])
        if verb == CONNECT:
            return connections.connect(op[1], op[2])
        if verb == PROBE:
            return connections.probe(op[1], op[2])
        if verb == CANCEL:
            return _cancel(op[1], op[2])
        assert verb == AUTOCOMMIT
        return op[1].set_autocommit(op[2])  # type: ignore[no-any-return]

    def _wait_for(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        task = self._task = asyncio.ensure_future(coroutine)
        task.add_done_callback(self._resumed)

    def _resumed(self, task: asyncio.Future[Any]) -> None:
        self._task = None
        if task.cancelled():
            error, self._pending = self._pending or asyncio.CancelledError(), None
            self._go(None, error)
        elif (problem := task.exception()) is not None:
            self._go(None, problem)
        else:
            self._go(task.result(), None)

    def _answered(self) -> None:
        if self._watched:
            self._unwatch()
        reply = self._reply
        assert reply is not None
        self._go(reply.outcome, None)

    def expire(self) -> None:
        """(The watch's.) The bound of the answer waited for passed: resume without it."""
        self._watched = False
        reply = self._reply
        if reply is not None and reply.callback is not None:
            reply.callback = None
            self._go(None, None)

    def _unwatch(self) -> None:
        self._watched = False
        self._watch.discard(self)

    def _end(self, value: Any, error: BaseException | None) -> None:
        self.done = True
        self.value = value
        result = self.result
        if not result.done():
            if error is None:
                result.set_result(value)
            elif isinstance(error, asyncio.CancelledError):
                result.cancel()
            else:
                result.set_exception(error)
        ended, self._ended = self._ended, []
        for callback in ended:
            callback()


async def _cancel(connection: psycopg.AsyncConnection[Any], until: float) -> None:
    """Ask the server to cancel connection's statement, by until (a lost request is fine:
    the steps then end the session)."""
    left = until - time.monotonic()
    if left > 0:
        try:
            await connection.cancel_safe(timeout=left)
        except (psycopg.Error, OSError):
            pass


def drive_sync(steps: Steps, connections: Connections) -> Any:
    """Drive steps in this thread, blocking it for each op; their return value.

    An exception that a signal handler raises between two ops (where the
    driver loops, not in an op) is thrown in as well: the steps give back
    what they took at once, not when the garbage collector finalizes them
    (by then a turn may have opened another connection in its place).
    """
    asked = _Asked()
    error: BaseException | None = None
    while True:
        try:
            return _driving(steps, connections, asked, error)
        except BaseException as problem:
            if inspect.getgeneratorstate(steps) != inspect.GEN_SUSPENDED:
                raise  # (the steps' own exception)
            error = problem


@final
class _Asked:
    """The statement a thread asked last: where it runs (None: it never went out), and what
    of its answer was read."""

    __slots__ = ("ahead", "pgconn", "results")

    def __init__(self) -> None:
        self.pgconn: Any = None
        self.results: list[Any] = []
        self.ahead: Ahead | None = None  # (the statements sent ahead of it, if any)


def _driving(
    steps: Steps, connections: Connections, asked: _Asked, error: BaseException | None
) -> Any:
    """drive_sync's loop, from error thrown in (None: from the steps' next op)."""
    value: Any = None
    while True:
        try:
            op = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            return stop.value
        value = error = None
        verb = op[0]
        try:
            if verb == ASK:
                asked.pgconn = None
                ahead = op[6] if len(op) > 6 else None
                try:
                    send(op[1], op[2], op[3], prepared=op[4], ahead=ahead)
                except psycopg.OperationalError as failed:
                    value = failed
                else:
                    asked.pgconn, asked.results, asked.ahead = op[1].pgconn, [], ahead
                    value = answer_sync(asked.pgconn, asked.results, op[5], True, ahead)
            elif verb == ANSWER:
                pgconn = asked.pgconn
                value = (
                    None
                    if pgconn is None
                    else answer_sync(pgconn, asked.results, op[1], False, asked.ahead)
                )
            elif verb == CLOSE:
                discard(op[1])
                asked.pgconn = None
            elif verb == SLOT:
                value = connections.slot_sync(op[1], op[2])
            elif verb == CONNECT:
                value = connections.connect_sync(op[1], op[2])
            elif verb == PROBE:
                value = connections.probe_sync(op[1], op[2])
            elif verb == CANCEL:
                left = op[2] - time.monotonic()
                if left > 0:
                    try:
                        op[1].cancel_safe(timeout=left)
                    except (psycopg.Error, OSError):
                        pass
            else:
                assert verb == AUTOCOMMIT
                op[1].autocommit = op[2]
        except BaseException as problem:  # interrupted (a signal handler's exception)
            error = problem
