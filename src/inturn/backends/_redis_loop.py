"""One event loop's share of a RedisBackend: its members of Redis's lines, and what keeps them.

A :class:`LoopShare` is made per process and event loop, the first time
that loop uses the backend: its own id (so its own channel), its own Link
(or, on a cluster, the client's script calls: ``_redis_calls``), Inbox
(``_redis_inbox``) and heartbeat (``_redis_lease``). So forked children, a
loop per job and loops in several threads never share a member id or a
connection. A share ends with its loop (the loop's ``shutdown_asyncgens``,
which ``asyncio.run`` calls, closes it), or with the backend's ``aclose()``.
This module starts and closes a share, and takes and gives back its turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import secrets
import threading
import time
import typing
from collections.abc import AsyncGenerator, Awaitable, Callable, Hashable, Sequence
from typing import Any, Final

from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._checks import Waited, missed
from .._describe import describe as show
from .._errors import BackendUnavailable
from .._tasks import abandon_task, retrieve
from ._redis_calls import Calls, Config
from ._redis_errors import UNREACHABLE, demoted, describe, refused, unavailable
from ._redis_inbox import Inbox
from ._redis_lease import Leases, Member, Waiting
from ._redis_link import Call

#: What this backend logs: only what is rare (here: a release Redis did not take), never a
#: turn that went as it should.
logger = logging.getLogger("inturn.redis")

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


@typing.final
class RedisGrant:
    """The turn on one key granted by a :class:`~inturn.backends.redis.RedisBackend`."""

    __slots__ = ("_member", "_share", "_state", "key", "token")

    def __init__(
        self, key: Hashable, token: int, member: str, share: LoopShare, state: Member
    ) -> None:
        #: The key held.
        self.key = key
        #: The fencing token: larger than every earlier grant's on this key
        #: (Redis's clock in microseconds when the key's line starts anew).
        self.token = token
        self._member = member
        self._share = share
        self._state = state  # the lease as this process knows it

    @property
    def lost(self) -> bool:
        """Whether the lease ran out, or may have: Redis dropped it, or no renewal came in time.

        Known at once after the process was frozen past its lease, or its
        event loop blocked that long: the lease is counted on this host's
        monotonic clock from the moment the call that last set it was
        written, which is no later than Redis's own count. A failover or
        restart of Redis counts as lost too (another server may have granted
        the key meanwhile).
        """
        return self._state.lapsed

    def __repr__(self) -> str:
        lost = " lost" if self.lost else ""
        return f"<RedisGrant key={show(self.key)} token={self.token}{lost}>"


def owner(grant: RedisGrant) -> LoopShare:
    """The loop share that granted grant (and alone may release it)."""
    return grant._share


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
        self._cleanups: set[asyncio.Task[Any]] = set()

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
        run out (nothing renews them).
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
            if not member.held:  # waiting: (on a Link, the leave goes after its enqueue)
                waiting = member.waiting
                if waiting is not None and not waiting.done():
                    waiting.set_exception(closed)
                    if isinstance(waiting, asyncio.Future):  # (its acquire may fail first)
                        retrieve(waiting)
                del members[member_id]
                self.calls.leave(member, member_id).future.add_done_callback(retrieve)
        if self._cleanups:  # places given up just now: let them leave their lines
            await asyncio.wait(self._cleanups, timeout=self.config.lease)
        await self.calls.aclose()
        tasks = [task for task in (self.leases.beat, *self._cleanups) if task is not None]
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
        self, key: Hashable, names: Sequence[str], timeout: float | None
    ) -> RedisGrant:
        """Join key's line in Redis; return once this share holds the key.

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
        loop = self.loop
        began = loop.time()
        if not self.ready:
            await self._start_for(key, timeout)
        else:
            self.leases.run()  # (again, if it ended)
        deadline, late = self.bounds(timeout, began, loop.time())
        member_id, member = self.join(key, names, loop.create_future())
        enqueue = self.calls.enqueue(member, member_id)
        try:
            token = await self._granted(member, enqueue, late, deadline, timeout)
            return self.hold(member_id, member, token)
        except BaseException:
            # Cancelled, timed out, or Redis failed: give the place up. The
            # call to leave goes after the enqueue (even one still in flight);
            # if the key was just granted, leaving passes it on.
            self.leases.members.pop(member_id, None)
            self._detach(self.calls.leave_after(enqueue, member, member_id))
            raise

    # The steps of a turn, written once: its two drivers are acquire() above (a
    # task) and _redis_threads.Blocking (a thread, on a connection of its own).

    def bounds(self, timeout: float | None, began: float, now: float) -> tuple[float | None, ...]:
        """(deadline, late): by when the turn, and Redis's answer to the enqueue, must come.

        Redis answers the enqueue by the caller's deadline if that comes
        first, but gets one round trip from now (after a start), up to a
        tenth of the lease, however short the timeout (0: a try-lock); else
        (late None) within about a lease: the heartbeat drops a link that
        leaves a call unanswered longer (a cluster's calls get a timer of
        their own; a thread's connection, a socket timeout).
        """
        if timeout is None:
            return None, None
        deadline = began + timeout
        lease = self.config.lease
        return deadline, (max(deadline, now + lease / 10) if timeout < lease else None)

    def join(self, key: Hashable, names: Sequence[str], waiting: Waiting) -> tuple[str, Member]:
        """A new member of key's line, kept by the heartbeat, its grant handed to waiting."""
        member_id = f"{self.id}/{next(self.counter)}"
        member = Member(key, names, self.calls.pack(names), waiting)
        self.leases.members[member_id] = member
        return member_id, member

    def enqueued(self, member: Member, sent: float, reply: Any) -> int | None:
        """Redis answered member's enqueue (written at monotonic ``sent``): its token if the
        key was free, else None (it waits for its grant)."""
        state, value = reply
        member.joined = True
        member.expires = sent + self.config.lease
        return int(value) if state == 1 else None

    def hold(self, member_id: str, member: Member, token: int) -> RedisGrant:
        """member was granted the key with token: its grant (see _still_valid)."""
        _still_valid(member)
        member.waiting = None
        member.held = True
        return RedisGrant(member.key, token, member_id, self, member)

    async def _granted(
        self,
        member: Member,
        enqueue: Call,
        late: float | None,
        deadline: float | None,
        timeout: float | None,
    ) -> int:
        """Await the enqueue's answer (by ``late``), then the grant (by ``deadline``): its token."""
        loop = self.loop
        timer = None
        if late is not None:
            unanswered = late_for(member.key, timeout, Waited.ANSWER)
            timer = loop.call_at(late, _expire, enqueue.future, unanswered)
        elif self.calls.link is None:
            timer = loop.call_later(self.config.lease, _expire, enqueue.future, self._silent)
        try:
            reply = await enqueue.future
        except TimeoutError:  # (an OSError: not Redis unreachable, but the deadline)
            raise
        except (*UNREACHABLE, ResponseError) as error:
            raise unavailable(error) from error
        finally:
            if timer is not None:
                timer.cancel()
        token = self.enqueued(member, enqueue.sent or time.monotonic(), reply)
        if token is None:
            assert isinstance(member.waiting, asyncio.Future)
            token = await _wait(member.waiting, deadline, member.key, timeout)
        return token

    def release(self, grant: RedisGrant) -> asyncio.Future[None]:
        """End grant's turn: Redis hands the key to the next in line and wakes it.

        On one server the call to leave is written at once and the answer is
        a Future that completes by itself, whatever becomes of its awaiter.
        It never fails: a release Redis did not take is logged (the key frees
        itself within the lease), and a lease found gone marks the member lost.
        In a forked child, a turn its parent was granted ends here alone (see
        :meth:`ending`).
        """
        ending = self.ending(grant)
        if ending is None:
            return _finished(self.loop)
        member_id, member = ending
        done = self.loop.create_future()
        leave = self.calls.leave(member, member_id).future

        def answered(leave: asyncio.Future[Any]) -> None:
            error = leave.exception()
            self.left(member, None if error is not None else leave.result(), error)
            if not done.done():  # (its awaiter may have cancelled it: the release goes on)
                done.set_result(None)

        leave.add_done_callback(answered)
        return done

    def left(self, member: Member, status: Any, error: BaseException | None) -> None:
        """Redis answered member's release (the leave script's status, or an error): log what
        went wrong, and mark the member lost if Redis no longer had it."""
        if error is None:
            if status == 0:
                if not member.lost:
                    logger.warning(
                        "inturn: Redis no longer had the turn on key %s at its release: "
                        "its lease ran out, or Redis lost it; another process may have "
                        "held the key meanwhile",
                        show(member.key),
                    )
                member.lost = True
            return
        if demoted(error):  # a failover: what this server granted may be gone
            member.lost = True
        logger.warning(
            "inturn: could not release %s in Redis: %s; it frees itself within %g s",
            show(member.key),
            error if isinstance(error, BackendUnavailable) else describe(error),
            self.config.lease,
        )

    def ending(self, grant: RedisGrant) -> tuple[str, Member] | None:
        """Take grant's member off the heartbeat: (its id, it) for the leave to write, or None.

        None: released already, or Redis no longer had it (lost); or, in a
        forked child, a turn the parent was granted: the member, its lease and
        the connections are the parent's, which holds the key and renews it
        until it leaves the turn itself. The child only forgets its copy (and
        waits behind the parent, as any other process, if it takes the key again).
        """
        member_id = grant._member
        member = self.leases.members.pop(member_id, None)
        if member is None or self.forks != _forks:
            return None
        return member_id, member

    def leave_soon(self, member: Member, member_id: str) -> None:
        """(From any thread.) Write member's leave on this share's own connection, soon.

        For a thread's place whose connection broke (see _redis_threads).
        """
        with contextlib.suppress(RuntimeError):  # (its loop closed: the lease runs out)
            self.loop.call_soon_threadsafe(self._leave_now, member, member_id)

    def _leave_now(self, member: Member, member_id: str) -> None:
        self.calls.leave(member, member_id).future.add_done_callback(retrieve)

    def _detach(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

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


def _finished(loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
    """A future done already, of the running loop (in a forked child of a task: of loop,
    as asyncio disowns the child's copy of its running loop)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        pass
    done = loop.create_future()
    done.set_result(None)
    return done


def _still_valid(member: Member) -> None:
    """Check a member just granted still has its lease.

    :raises ~inturn.BackendUnavailable: this process was frozen, or its loop
        blocked, past the lease meanwhile: Redis may have given the turn to
        another since (the grant's message waited in the socket). The work
        must not run on it.
    """
    if member.lapsed:
        raise BackendUnavailable(
            f"inturn: the place in Redis of this waiter for {show(member.key)} may be gone (this "
            "process was frozen, or its event loop blocked, for longer than the lease); "
            "the work did not run"
        )


def _expire(future: asyncio.Future[Any], error: Callable[[], BaseException]) -> None:
    if not future.done():
        future.set_exception(error())


def late_for(key: Hashable, timeout: float | None, waited: Waited) -> Callable[[], BaseException]:
    """What makes the TimeoutError of a turn on key not reached within timeout: waited is its
    place in Redis's line (the grant), or an answer from Redis (the enqueue's)."""

    def error() -> BaseException:
        detail = " from Redis" if waited is Waited.ANSWER else ""
        return missed((key,), waited, timeout, detail)

    return error


def _slow_start(key: Hashable, bound: float, timeout: float) -> Callable[[], BaseException]:
    def error() -> BaseException:
        detail = f" from Redis (connecting took over {bound:g} s)"
        return missed((key,), Waited.ANSWER, timeout, detail)

    return error


async def _wait(
    waiting: asyncio.Future[int], deadline: float | None, key: Hashable, timeout: float | None
) -> int:
    """Await the grant's token, or fail with TimeoutError at deadline."""
    if deadline is None:
        return await waiting
    late = late_for(key, timeout, Waited.LINE)
    timer = asyncio.get_running_loop().call_at(deadline, _expire, waiting, late)
    try:
        return await waiting
    finally:
        timer.cancel()


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
