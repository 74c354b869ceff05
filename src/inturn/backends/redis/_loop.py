"""One event loop's share of a RedisBackend: its members of Redis's lines, and what keeps them.

A :class:`LoopShare` is made per process and event loop, the first time
that loop uses the backend: its own id (so its own channel), its own Link
(or, on a cluster, the client's script calls: ``_calls``), Inbox
(``_inbox``) and heartbeat (``_lease``). So forked children, a
loop per job and loops in several threads never share a member id or a
connection. A share ends with its loop (the loop's ``shutdown_asyncgens``,
which ``asyncio.run`` calls, closes it), or with the backend's ``aclose()``.
This module starts and closes a share, and is a task's driver of a turn's
steps (``_steps``): :func:`drive` awaits each op's answer (taking a
turn), :func:`drive_soon` is resumed by each (a release, which goes on by
itself). A thread's driver is ``_threads.Blocking``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import os
import secrets
import threading
from collections.abc import AsyncGenerator, Callable, Hashable
from typing import Any, Final

from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._checks import Waited, missed
from ..._errors import BackendUnavailable
from ..._tasks import abandon_task, retrieve
from .._base import Newest
from ._calls import Calls, Config
from ._errors import refused, unavailable
from ._inbox import Inbox
from ._lease import Leases, Member
from ._scripts import Line
from ._steps import (
    ENQUEUE,
    GRANT,
    JUDGE,
    LEAVE,
    QUIT,
    RedisGrant,
    Steps,
    T,
    now,
    releasing,
    taking,
)

#: Seconds a turn with a shorter timeout (0: a try-lock) still waits for its event loop's
#: share to start (connected, subscribed, greeted), half the lease at most: a one-time
#: setup, not the wait for a key, which took over a second on a loaded machine (a tenth of
#: the default lease, all a try-lock had). Yet a turn with a timeout ends within seconds
#: when Redis is unreachable, and by its own clock (TimeoutError) before the start's parts
#: give up on Redis (BackendUnavailable, after a lease).
_SETTING_UP: Final = 3.0

#: Forks between the process that imported this module and this one: a share made
#: with a smaller count is an ancestor's, whose connections and members are not ours.
_forks = 0


def _count_fork() -> None:
    global _forks
    _forks += 1


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_count_fork)


class LoopShare:
    """This process's members of Redis lines, from one event loop, and what keeps them."""

    __slots__ = (
        "_cleanups",
        "_guard",
        "_starting",
        "calls",
        "channel",
        "closing",
        "config",
        "counter",
        "forks",
        "id",
        "inbox",
        "leases",
        "loop",
        "ready",
        "server",
        "thread",
    )

    def __init__(self, config: Config, loop: asyncio.AbstractEventLoop) -> None:
        self.config = config
        self.loop = loop
        #: The thread the loop runs in: once it has ended, the loop never runs again.
        self.thread = threading.current_thread()
        self.id = secrets.token_hex(8)
        self.channel = config.channels + self.id
        #: _forks when it was made: another count here means a forked child inherited it.
        self.forks = _forks
        self.counter = itertools.count(1)
        lease = config.lease
        #: Its script calls: on its own Link (one server), or through the cluster client.
        self.calls = Calls(config, self.channel, self._greeted)
        self.inbox: Inbox | None = None
        self.ready = False  # subscribed, greeted, and the heartbeat runs
        self.closing = False
        #: The server's run_id, as the greeting last said.
        self.server: str | None = None
        #: Its members of Redis's lines, and their heartbeat.
        self.leases = Leases(loop, lease, self.calls.renew, self._tend)
        self._starting: asyncio.Task[None] | None = None
        self._guard: AsyncGenerator[None, None] | None = None
        #: Leaves of places given up (QUIT), until answered: close waits for them.
        self._cleanups: set[asyncio.Future[Any]] = set()

    # -- start and stop ------------------------------------------------------------------

    async def start(self, by: float, late: Callable[[], BaseException]) -> None:
        """Subscribe, greet Redis and start the heartbeat, once; by loop.time() ``by`` at most.

        :raises ~inturn.BackendUnavailable: Redis could not be reached, or refused.
        :raises: what ``late()`` makes, when not done by then.
        """
        starting = self._starting
        if starting is None:
            starting = self._starting = self.loop.create_task(self._begin())
            starting.add_done_callback(self._started)
        done = self.loop.create_future()

        def copy(task: asyncio.Task[None]) -> None:
            if done.done():
                return
            if task.cancelled():
                done.set_exception(BackendUnavailable("inturn: the backend was closed"))
            elif (error := task.exception()) is not None:
                done.set_exception(error)
            else:
                done.set_result(None)

        starting.add_done_callback(copy)
        timer = self.loop.call_at(by, _expire, done, late)
        try:
            await done
        finally:
            timer.cancel()
            starting.remove_done_callback(copy)

    async def _start_for(self, key: Hashable, timeout: float | None) -> None:
        """Start, for a turn on key: by its timeout, or after min(_SETTING_UP, lease / 2) s."""
        lease = self.config.lease
        if timeout is None or timeout >= lease:
            await self.start(self.loop.time() + lease, self._silent)
        else:
            bound = max(timeout, min(_SETTING_UP, lease / 2))
            await self.start(self.loop.time() + bound, _slow_start(key, bound, timeout))

    def _silent(self) -> BaseException:
        return unavailable(
            RedisTimeoutError(f"no answer within {self.config.lease:g} s (the lease)")
        )

    def _started(self, task: asyncio.Task[None]) -> None:
        if (task.cancelled() or task.exception() is not None) and self._starting is task:
            self._starting = None  # the next submission tries again

    async def _begin(self) -> None:
        config = self.config
        await self.guard()
        inbox = self.inbox = Inbox(
            config.make,
            self.channel,
            self._heard,
            self.leases.kick,
            min(1.0, config.lease / 10),
            config.lease,
        )
        try:
            if config.client is not None:
                await config.client.initialize()  # a RedisCluster learns its nodes first
            await inbox.open()
            await self._greeting_answered(self.calls.greet())
        except Exception as error:
            self.inbox = None
            await inbox.aclose()
            raise unavailable(error, config.server, starting=True) from error
        self.leases.run()
        self.ready = True

    async def _greeting_answered(self, greeting: asyncio.Future[Any]) -> None:
        """Wait for the greeting's answer, a lease at most (the heartbeat, which drops a link
        that does not answer, runs only once the share started)."""
        lease = self.config.lease
        await asyncio.wait((greeting,), timeout=lease)
        if not greeting.done():
            if self.calls.link is not None:
                self.calls.link.drop(f"no answer to the greeting within {lease:g} s")
            greeting.add_done_callback(retrieve)
            raise RedisTimeoutError(f"no answer to the greeting within {lease:g} s")
        if (error := refused(greeting.result()[1:])) is not None:
            raise error

    async def guard(self) -> None:
        """Have this share closed when its event loop shuts down (once; see _guard)."""
        if self._guard is None and not self.closing:
            self._guard = _guard(self)
            await self._guard.asend(None)

    def abandon(self) -> None:
        """Close this share's connections without its event loop, which will never run again.

        For a loop closed without ``shutdown_asyncgens()``, or left behind by
        a thread that ended. Its members lose their places when their leases
        run out (nothing renews them). In a forked child, for its copy of its
        parent's share: only the child's copies of the sockets close (the
        parent's connections go on), and the parent's members are untouched.
        """
        self.closing = True
        self.ready = False
        for task in (self._starting, self.leases.beat, *self._cleanups):
            abandon_task(task)
        if self.calls.link is not None:
            self.calls.link.abandon()
        if self.inbox is not None:
            self.inbox.abandon()
        self.leases.members.clear()

    async def close(self) -> None:
        """Leave every line this share waits in, stop its heartbeat and close its connections.

        Waiters still waiting get :exc:`~inturn.BackendUnavailable`; a holder
        keeps its lease until it runs out (nothing renews it any more).
        """
        if self.closing:
            return
        self.closing = True
        self.ready = False
        starting, self._starting = self._starting, None
        if starting is not None and not starting.done():
            starting.cancel()  # so that nothing is opened after the backend closes
            await asyncio.wait((starting,), timeout=self.config.lease)
        closed = BackendUnavailable("inturn: the backend was closed; the work did not run")
        members = self.leases.members
        for member_id, member in list(members.items()):
            if not member.held:  # waiting
                waiting = member.waiting
                if waiting is not None and not waiting.done():
                    waiting.set_exception(closed)
                    if isinstance(waiting, asyncio.Future):  # (its acquire may fail first)
                        retrieve(waiting)
                del members[member_id]
                member.lost = True  # (granted, its steps not on yet: they must not hold it)
                self.quit(member, member_id, not member.joined)
        if self._cleanups:  # places given up just now: let them leave their lines
            await asyncio.wait(self._cleanups, timeout=self.config.lease)
        await self.calls.aclose()
        tasks: list[asyncio.Future[Any]] = [*self._cleanups]
        if self.leases.beat is not None:
            tasks.append(self.leases.beat)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self.config.lease)
        inbox, self.inbox = self.inbox, None
        if inbox is not None:
            await inbox.aclose()
        guard, self._guard = self._guard, None
        if guard is not None:
            await guard.aclose()

    # -- taking and giving back turns ------------------------------------------------

    async def acquire(
        self, key: Hashable, line: Line, timeout: float | None, newest: Newest | None = None
    ) -> RedisGrant:
        """Join key's line in Redis; return once this share holds the key (``newest``: for
        latest work shared across processes, see _steps.taking).

        ``timeout`` covers connecting, joining and waiting, with two floors,
        so that a short one fails for a busy key (or Redis unreachable), not
        for a slow connection: the share's start (connecting, subscribing,
        greeting: once per event loop, not the wait for a key) gets up to
        3 s (``_SETTING_UP``), half the lease at most, and then Redis's answer
        to the enqueue gets one round trip from there, up to a tenth of the
        lease (0 asks once whether the key is free). So with Redis
        unreachable, a call with a timeout ends after the larger of its
        timeout and those. With no answer from Redis within a lease (with no
        timeout, or a longer one), the call ends with BackendUnavailable.

        :raises TimeoutError: the turn was not reached within ``timeout`` (or
            the start took longer than its floor, which the message says);
            the place was given up, and the work did not run.
        :raises ~inturn.BackendUnavailable: Redis could not be reached, refused,
            or lost the place; the turn was not taken.
        """
        began = now()
        if not self.ready:
            await self._start_for(key, timeout)
        else:
            self.leases.run()  # (again, if it ended)
        waiting = self.loop.create_future
        return await drive(self, taking(self, key, line, timeout, began, waiting, None, newest))

    def release(self, grant: RedisGrant) -> asyncio.Future[None]:
        """End grant's turn: Redis hands the key to the next in line and wakes it.

        On one server the call to leave is written at once and the answer is
        a Future that completes by itself, whatever becomes of its awaiter
        (see _steps.releasing: it never fails).
        """
        return drive_soon(self, releasing(self, grant))

    def inherited(self) -> bool:
        """Whether this is a forked child's copy of its parent's share (never to be used)."""
        return self.forks != _forks

    def quit(self, member: Member, member_id: str, marked: bool) -> None:
        """Write member's leave and go on (a QUIT: see _steps); its answer is retrieved.

        On a Link it runs after the share's earlier calls (the enqueue
        among them); a cluster's may overtake the enqueue (``marked``: it
        then does nothing; see Calls.leave). The backend's close waits for it.
        """
        leave = self.calls.leave(member, member_id, marked).future
        if not leave.done():
            self._cleanups.add(leave)
            leave.add_done_callback(self._cleanups.discard)
        leave.add_done_callback(retrieve)

    def leave_soon(self, member: Member, member_id: str, marked: bool) -> None:
        """(From any thread.) Write member's leave on this share's own connection, soon.

        For a thread's place whose connection broke, or is not at hand (see
        _threads).
        """
        with contextlib.suppress(RuntimeError):  # (its loop closed: the lease runs out)
            self.loop.call_soon_threadsafe(self.quit, member, member_id, marked)

    # -- push and greeting ----------------------------------------------------------------

    def _heard(self, data: bytes) -> None:
        """A grant published to this share's channel: ``<member> <token>`` (b"": a greeting)."""
        member_id, _, token = data.partition(b" ")
        if token:
            self.leases.granted(member_id.decode(), int(token))

    def _greeted(self, greeting: asyncio.Future[Any]) -> None:
        """A connection's greeting was answered: with the server's run_id, or a refusal."""
        if greeting.cancelled() or greeting.exception() is not None:
            return  # the caller that waits for it learns why; a later call fails the same way
        server = greeting.result()[0]  # (then what the user may not do: see start)
        server = server.decode() if isinstance(server, bytes) else str(server or "")
        if not server:
            return
        if self.server is not None and server != self.server:
            self.leases.another_server(server, self.server)  # restarted or failed over
        self.server = server

    def _tend(self) -> None:
        """Drop a connection gone silent: a call unanswered for a lease, or a ping (each beat)."""
        if self.calls.link is not None:
            self.calls.link.stale(self.config.lease)
        if self.inbox is not None:
            self.inbox.ping()


# -- a task's driver of a turn's steps (see _steps) --------------------------------


async def drive(share: LoopShare, steps: Steps[T]) -> T:
    """Perform steps' ops for a task on share's loop, awaiting each answer; their return.

    A cancellation of the task is thrown in at the op it came during (the
    steps give the place up, and re-raise it).
    """
    answer: Any = None
    error: BaseException | None = None
    while True:
        try:
            op = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration as done:
            result: T = done.value
            return result
        answer = error = None
        verb = op[0]
        try:
            if verb == ENQUEUE:
                call = share.calls.enqueue(op[1], op[2])
                if op[3] is None and share.calls.link is not None:  # (no timer: most turns)
                    reply = await call.future
                else:
                    reply = await _by(share, call.future, op[3], silent=True)
                answer = None if reply is None else (call.sent or now(), reply)
            elif verb == GRANT:
                waiting = op[1].waiting
                answer = await (waiting if op[2] is None else _by(share, waiting, op[2]))
            elif verb == LEAVE:
                answer = await share.calls.leave(op[1], op[2]).future
            elif verb == QUIT:
                share.quit(op[1], op[2], op[3])
            else:  # JUDGE, AGAIN: latest work's, as ENQUEUE
                calls = share.calls
                call = calls.judge(op[1], op[2]) if verb == JUDGE else calls.again(op[1], op[2])
                reply = await (call.future if op[3] is None else _by(share, call.future, op[3]))
                answer = None if reply is None else (call.sent or now(), reply)
        except BaseException as problem:  # thrown in: the steps give the place up
            error = problem


def drive_soon(share: LoopShare, steps: Steps[None]) -> asyncio.Future[None]:
    """Perform the ops of a release's steps (LEAVE) for a task, each answer resuming them
    by callback: it goes on whatever becomes of the future returned, done at their end.

    (In a forked child of a task, the future is of share's loop, as asyncio
    disowns the child's copy of its running loop.)
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = share.loop
    done: asyncio.Future[None] = loop.create_future()
    _resume(share, steps, done, None, None)
    return done


def _resume(
    share: LoopShare,
    steps: Steps[None],
    done: asyncio.Future[None],
    answer: Any,
    error: BaseException | None,
) -> None:
    """Send answer (or throw error) into steps; perform their ops until one is waited for."""
    while True:
        try:
            op = steps.send(answer) if error is None else steps.throw(error)
        except StopIteration:
            if not done.done():  # (its awaiter may have cancelled it: the release went on)
                done.set_result(None)
            return
        answer = error = None
        if op[0] == QUIT:
            share.quit(op[1], op[2], op[3])
            continue
        assert op[0] == LEAVE  # (a release's steps)
        leave = share.calls.leave(op[1], op[2]).future
        if not leave.done():
            leave.add_done_callback(functools.partial(_answered, share, steps, done))
            return
        answer, error = _outcome(leave)


def _answered(
    share: LoopShare, steps: Steps[None], done: asyncio.Future[None], call: asyncio.Future[Any]
) -> None:
    _resume(share, steps, done, *_outcome(call))


def _outcome(call: asyncio.Future[Any]) -> tuple[Any, BaseException | None]:
    """A done call's (result, None), or (None, its error)."""
    if call.cancelled():
        return None, asyncio.CancelledError("the call was cancelled")
    error = call.exception()
    return (None, error) if error is not None else (call.result(), None)


async def _by(
    share: LoopShare, future: asyncio.Future[Any], until: float | None, silent: bool = False
) -> Any:
    """future's result, or None if it is not done by ``until`` (None: no bound; but with
    ``silent``, a cluster's call fails after a lease: see LoopShare._silent)."""
    loop = share.loop
    if until is not None:
        timer = loop.call_later(until - now(), _settle, future)
    elif silent and share.calls.link is None:
        timer = loop.call_later(share.config.lease, _expire, future, share._silent)
    else:
        return await future
    try:
        return await future
    finally:
        timer.cancel()


def _settle(future: asyncio.Future[Any]) -> None:
    if not future.done():
        future.set_result(None)


def _expire(future: asyncio.Future[Any], error: Callable[[], BaseException]) -> None:
    if not future.done():
        future.set_exception(error())


def _slow_start(key: Hashable, bound: float, timeout: float) -> Callable[[], BaseException]:
    def error() -> BaseException:
        detail = f" from Redis (connecting took over {bound:g} s)"
        return missed((key,), Waited.ANSWER, timeout, detail)

    return error


async def _guard(share: LoopShare) -> AsyncGenerator[None, None]:
    """Close share when its event loop shuts down (``loop.shutdown_asyncgens()``).

    ``asyncio.run`` closes every async generator still open after its tasks
    are done: a loop per job leaves no connection and no socket behind.
    """
    try:
        yield
    finally:
        share._guard = None  # (it is this generator, closing)
        await share.close()
