"""A thread's Redis turn, on a blocking connection of its own: no hop to an event loop.

The thread's driver of a turn's steps (``_steps``; a task's is in
``_loop``). A thread writes its enqueue and its leave itself, each
one round trip on one of the backend's blocking connections, and waits for
a grant on an :class:`~inturn._bridge.Answer` that the share's
subscription completes. The share, on this process's backend loop, keeps
what goes on between calls: the subscription, the heartbeat, the greeting.

The connections are redis-py's sync ``Connection`` (or its SSL or Unix
socket kind), made with the async client's settings (TLS, AUTH, HELLO,
SELECT: redis-py sets them up), written with ``send_packed_command`` and
read with ``read_response``: its public API; on a Sentinel client, made by
a sync twin of its Sentinel (which discovers the master at each connect).
A client this module cannot mirror (a cluster, a replica's, a connection
class of the user's) has none: its threads take their turns through the
backend loop (``_bridge``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Hashable
from typing import Any

import redis.asyncio as aioredis
import redis.connection
import redis.sentinel
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._bridge import Answer
from .._base import Newest
from ._errors import demoted
from ._lease import Member
from ._loop import LoopShare
from ._scripts import AGAIN as AGAIN_SCRIPT
from ._scripts import ENQUEUE as ENQUEUE_SCRIPT
from ._scripts import HEADS, SCRIPTS, Line, Script
from ._scripts import JUDGE as JUDGE_SCRIPT
from ._scripts import LEAVE as LEAVE_SCRIPT
from ._steps import (
    ENQUEUE,
    GRANT,
    JUDGE,
    LEAVE,
    QUIT,
    UNCONNECTED,
    RedisGrant,
    Steps,
    T,
    now,
    releasing,
    taking,
)

#: The async client's connection settings a sync connection takes as they are (and any
#: ``ssl_*``); the rest are the async client's own objects (its parser, retry, hooks).
_SETTINGS = frozenset(
    (
        "host",
        "port",
        "path",
        "db",
        "username",
        "password",
        "credential_provider",
        "socket_timeout",
        "socket_connect_timeout",
        "socket_keepalive",
        "socket_keepalive_options",
        "client_name",
        "lib_name",
        "lib_version",
        "driver_info",
        "protocol",
        "encoding",
        "encoding_errors",
    )
)


def sync_connector(client: Any, lease: float) -> Callable[[], Any] | None:
    """What makes a blocking connection set up as client's are, or None if none can be.

    A client of redis-py's ``Sentinel(...).master_for(...)`` gets connections
    to the master its sync twin discovers (at each connect). Reads are
    bounded by the lease (or the client's shorter socket timeout), as the
    event loop's connection is dropped after a lease without an answer.
    """
    if not isinstance(client, aioredis.Redis):
        return None
    pool = client.connection_pool
    kind = pool.connection_class
    if kind.__module__ == "redis.asyncio.sentinel":
        return _sentinel_twin(pool, lease)
    mirror = getattr(redis.connection, kind.__name__, None)
    if kind.__module__ != "redis.asyncio.connection" or not isinstance(mirror, type):
        return None  # a class of the user's: through the backend loop
    return functools.partial(mirror, **_mirrored(pool.connection_kwargs, mirror, lease))


def _sentinel_twin(pool: Any, lease: float) -> Callable[[], Any] | None:
    """A sync Sentinel's connection maker for the master pool serves (None: a replica's)."""
    if not getattr(pool, "is_master", False):
        return None
    manager = pool.sentinel_manager
    addresses = []
    for sentinel in manager.sentinels:
        settings = sentinel.connection_pool.connection_kwargs
        if "host" not in settings:
            return None
        addresses.append((settings["host"], settings.get("port", 26379)))
    make_twin: Any = redis.sentinel.Sentinel  # (untyped)
    twin = make_twin(
        addresses,
        min_other_sentinels=manager.min_other_sentinels,
        sentinel_kwargs=_mirrored(manager.sentinel_kwargs, redis.connection.Connection, lease),
        ssl="SSL" in pool.connection_class.__name__,
        **_mirrored(pool.connection_kwargs, redis.sentinel.SentinelManagedConnection, lease),
    )
    return twin.master_for(pool.service_name).connection_pool.make_connection  # type: ignore[no-any-return]


def _mirrored(given: dict[str, Any], mirror: type, lease: float) -> dict[str, Any]:
    """The settings of given (an async connection's) that mirror, a sync class, takes."""
    inits = [vars(cls)["__init__"] for cls in mirror.__mro__ if "__init__" in vars(cls)]
    accepted = {name for init in inits for name in inspect.signature(init).parameters}
    settings = {
        name: value
        for name, value in given.items()
        if (name in _SETTINGS or name.startswith("ssl_")) and name in accepted
    }
    for name in ("socket_timeout", "socket_connect_timeout"):
        value = settings.get(name)
        settings[name] = lease if value is None else min(value, lease)
    if "driver_info" in accepted and "driver_info" not in settings:
        # (redis-py 8 looks its version up in the installed metadata for every connection
        # made without it: milliseconds, which a thread's first call would pay)
        with contextlib.suppress(Exception):
            info = getattr(mirror(**settings), "driver_info", None)
            if info is not None:
                settings["driver_info"] = info
    return settings


class _Pooled:
    """One blocking connection, and how many replies it still owes (see Blocking)."""

    __slots__ = ("connection", "owed")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.owed = 0  # calls written on it whose replies its next user reads first


class _Run:
    """One thread's steps under way: the connection of their call, and what it did."""

    __slots__ = ("broken", "unread", "using", "written")

    def __init__(self) -> None:
        self.using: _Pooled | None = None  # taken for the op under way, not given back yet
        self.unread = False  # a call was written on it, and its reply is not read
        self.broken = False  # its write or read did not end cleanly: its state is unknown
        self.written = False  # a call of these steps may have reached Redis


class Blocking:
    """Threads' turns on blocking connections, each call one round trip on the thread's own.

    The thread's driver of a turn's steps (``_steps``; a task's is
    ``_loop.drive``). A thread takes an idle connection for a call and
    gives it back after (any number of threads at once: one connection
    each). Guarantees, as a task's turn:

    - The place is given up when the turn is not taken (a timeout, an
      interrupt such as ``KeyboardInterrupt``, Redis failing): the leave is
      written on the enqueue's own connection when that is whole, so Redis
      runs it after the enqueue (its reply is read by the connection's next
      user); else (an interrupt came while the enqueue was written or its
      reply read) on another, marked, so that an enqueue it overtakes does
      nothing (see ``_scripts``). A give-up never waits, nor connects.
    - Every wait is bounded by the turn's: the enqueue's answer, the grant,
      the replies a connection owes, and connecting, whose handshake gets
      the time left (a try-lock: up to a tenth of the lease). A connection
      made too late joins the idle ones, and the next thread that needs
      one waits for it, not for another.
    - A release never fails: what Redis did not take is logged, and the key
      frees itself within the lease. An interrupted release goes on: its
      leave is written again.
    """

    __slots__ = ("_closed", "_idle", "_make", "_orphans")

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._idle: list[_Pooled] = []
        #: Connections being made that no thread waits for now (it gave up): the next
        #: thread that needs one adopts one of these before it makes another.
        self._orphans: list[Answer] = []
        self._closed = False

    def acquire(
        self,
        share: LoopShare,
        key: Hashable,
        line: Line,
        timeout: float | None,
        into: list[Any] | None = None,
        newest: Newest | None = None,
    ) -> RedisGrant:
        """As ``LoopShare.acquire``, blocking this thread; share has started (``into``: see
        BlockingBackend.acquire_sync)."""
        return self._driven(share, taking(share, key, line, timeout, now(), Answer, into, newest))

    def release(self, share: LoopShare, grant: RedisGrant) -> None:
        """As ``LoopShare.release``, returning once Redis answered (or failed, logged)."""
        self._driven(share, releasing(share, grant))

    def _driven(self, share: LoopShare, steps: Steps[T]) -> T:
        """steps, driven (see drive); an interrupt that came between two of their ops
        (where the driver loops) is thrown in, so that they give the place up."""
        run = _Run()
        try:
            return self.drive(share, steps, run, None)
        except BaseException as error:
            if inspect.getgeneratorstate(steps) == inspect.GEN_SUSPENDED:
                self.drive(share, steps, run, error)  # (they re-raise it)
            raise

    def drive(self, share: LoopShare, steps: Steps[T], run: _Run, error: BaseException | None) -> T:
        """Perform steps' ops in this thread, blocking it; their return (error: thrown in first).

        An op's error, or an interrupt (a signal handler's exception) during
        it, is thrown in at that op.
        """
        answer: Any = None
        lease = share.config.lease
        while True:
            try:
                op = steps.send(answer) if error is None else steps.throw(error)
            except StopIteration as done:
                result: T = done.value
                return result
            answer = error = None
            try:
                verb = op[0]
                if verb == ENQUEUE:  # (sent, reply); None: no reply by late; or UNCONNECTED
                    late = op[3]
                    answer = pooled = self._take(share, late, lease)
                    if type(pooled) is _Pooled:
                        run.using = pooled
                        rest = share.calls.enqueue_rest(op[1], op[2])
                        sent = now()
                        reply = self._call(pooled, ENQUEUE_SCRIPT, rest, late, run)
                        answer = None if reply is _LATE else (sent, reply)
                elif verb == GRANT:
                    answer = _granted(op[1].waiting, op[2])
                elif verb == QUIT:
                    self._quit(share, op[1], op[2], op[3], run)
                else:  # LEAVE (a release: its status); JUDGE, AGAIN (latest work's, as ENQUEUE)
                    late = None if verb == LEAVE else op[3]
                    pooled = self._take(share, late, lease)
                    if type(pooled) is _Pooled:
                        run.using = pooled
                        script, rest = _script(share, verb, op[1], op[2])
                        sent = now()
                        answer = self._call(pooled, script, rest, late, run)
                        if verb != LEAVE:
                            answer = None if answer is _LATE else (sent, answer)
                    elif verb == LEAVE or late is None:
                        raise RedisTimeoutError(f"no connection within {lease:g} s (the lease)")  # noqa: TRY301 - thrown in below
                    else:
                        answer = None  # (no connection by late)
            except BaseException as problem:  # thrown in
                error = problem

    def _call(
        self, pooled: _Pooled, script: Script, rest: bytes, late: float | None, run: _Run
    ) -> Any:
        """Call script on pooled with rest (keys and arguments, packed): its reply.

        _LATE if none came by ``late`` (the connection is whole: the reply is
        on its way). Answered, pooled goes back to the idle ones; a
        ResponseError is raised (redis-py's parser), as any failure.
        """
        connection = pooled.connection
        run.written = run.unread = run.broken = True
        connection.send_packed_command((HEADS[script.index] + rest,), check_health=False)
        if late is not None and not connection.can_read(max(0.0, late - now())):
            run.broken = False
            return _LATE
        try:
            try:
                reply = connection.read_response()
            except NoScriptError:  # flushed: send it again, with its body (which loads it)
                connection.send_packed_command(
                    (HEADS[script.index + len(SCRIPTS)] + rest,), check_health=False
                )
                reply = connection.read_response()
        except ResponseError as refusal:  # (read whole: the connection is too)
            run.broken = run.unread = False
            run.using = None
            self._give(pooled, refusal)
            raise
        run.broken = run.unread = False
        run.using = None
        self._idle.append(pooled)
        return reply

    def _quit(
        self, share: LoopShare, member: Member, member_id: str, marked: bool, run: _Run
    ) -> None:
        """QUIT: write member's leave and go on (see the class's guarantees)."""
        pooled, run.using = run.using, None
        unread = run.unread
        if pooled is not None and run.broken:  # interrupted, or failed, in the middle
            pooled.connection.disconnect()
            pooled = None
        if marked and not run.written:  # nothing of the turn reached Redis
            if pooled is not None:
                self._idle.append(pooled)
            return
        if pooled is None:  # (the enqueue's connection was given back, or dropped)
            unread = False
            taken = self._take(share, now(), share.config.lease, grow=False)
            pooled = taken if isinstance(taken, _Pooled) else None
        if pooled is None:
            share.leave_soon(member, member_id, marked)
            return
        rest = share.calls.leave_rest(member, member_id, marked)
        try:  # (with the script's body: flushed or not, it runs)
            pooled.connection.send_packed_command(
                (HEADS[LEAVE_SCRIPT.index + len(SCRIPTS)] + rest,), check_health=False
            )
        except Exception:
            pooled.connection.disconnect()
            share.leave_soon(member, member_id, marked)
            return
        pooled.owed += 1 + unread
        self._idle.append(pooled)

    def _give(self, pooled: _Pooled, refusal: ResponseError) -> None:
        """Give pooled back after Redis refused a call on it, unless the refusal says the
        server is a replica now (a failover): then drop it, so that the next call connects
        to the master, wherever it is now (as the share's Link does)."""
        if demoted(refusal):
            pooled.connection.disconnect()
        else:
            self._idle.append(pooled)

    def _take(
        self, share: LoopShare, until: float | None, lease: float, grow: bool = True
    ) -> _Pooled | str | None:
        """An idle connection, its owed replies read and nothing else pending, or a new one.

        As redis-py's pool, it checks that an idle connection has nothing to
        read: one Redis closed meanwhile (its idle ``timeout``) is replaced.
        One whose owed replies are not in by ``until`` is left for later.
        None: no answer came by ``until`` (or, not to ``grow``, none is idle);
        UNCONNECTED: no new connection was made by then (a lease, if None).
        """
        idle = self._idle
        aside: list[_Pooled] = []  # owing replies still on their way
        try:
            while True:
                try:
                    pooled = idle.pop()
                except IndexError:  # none idle: one more
                    if not grow or (until is not None and now() >= until):
                        return None
                    if not self._grow(share.loop, until, lease):
                        return UNCONNECTED
                    continue
                settled = _settled(pooled, until) if pooled.owed else True
                if settled is None:
                    aside.append(pooled)
                    continue
                try:
                    if settled and not pooled.connection.can_read(0):
                        return pooled
                except Exception:  # (closed by Redis: dropped below)
                    pass
                pooled.connection.disconnect()  # closed by Redis, or stray data: another
        finally:
            if aside:
                idle[:0] = aside  # (taken last)

    def _grow(self, loop: asyncio.AbstractEventLoop, until: float | None, lease: float) -> bool:
        """Add a new connection to the idle ones; whether it is there by ``until`` (None:
        within a lease).

        A connection being made that no thread waits for is adopted first.
        Each is made in a thread of its own, which loop's thread starts: an
        exception that a signal handler raises in the caller's thread could
        leave redis-py's socket half made and open (or a thread half
        started). One made too late (or whose caller was interrupted) joins
        the idle ones all the same.

        :raises: why it could not be made (redis-py's ConnectionError...).
        """
        orphans = self._orphans
        while True:
            adopted = bool(orphans)
            made = orphans.pop() if adopted else self._start(loop)
            try:
                ready = made.wait(lease if until is None else max(0.0, until - now()))
            except BaseException:  # interrupted: the wait may have taken the answer (if done)
                if not made.done():
                    orphans.append(made)
                raise
            if not ready:
                orphans.append(made)
                return False
            try:
                made.result()
            except Exception:
                if adopted:  # (an earlier try's failure: try now)
                    continue
                raise
            return True

    def _start(self, loop: asyncio.AbstractEventLoop) -> Answer:
        """Start making a connection, which joins the idle ones; what tells when it did."""
        made = Answer()

        def make() -> None:
            try:
                connection = self._make()
                connection.connect()
            except BaseException as error:  # (handed to the caller)
                made.set_exception(error)
                return
            self._idle.append(_Pooled(connection))
            if self._closed:  # (closed meanwhile)
                self.close()
            made.set_result(None)

        loop.call_soon_threadsafe(_start, make)
        return made

    def forked(self) -> Blocking:
        """(In a forked child.) A pool of its own; the child's copies of the parent's idle
        connections are closed (their sockets only: redis-py shuts a connection down only
        in the process that made it, so the parent's go on)."""
        self.close()
        return Blocking(self._make)

    def close(self) -> None:
        """Close the idle connections (one in use is closed as it is given back: never),
        and those made from now on."""
        self._closed = True
        idle, self._idle = self._idle, []
        for pooled in idle:
            pooled.connection.disconnect()


def _script(share: LoopShare, verb: int, member: Member, member_id: str) -> tuple[Script, bytes]:
    """The script that op verb (LEAVE, JUDGE or AGAIN) calls for member, and its keys and
    arguments, packed."""
    calls = share.calls
    if verb == LEAVE:
        return LEAVE_SCRIPT, calls.leave_rest(member, member_id)
    if verb == JUDGE:
        return JUDGE_SCRIPT, calls.judge_rest(member, member_id)
    return AGAIN_SCRIPT, calls.again_rest(member, member_id)


#: What Blocking._call returns for a reply that did not come in time.
_LATE: Any = object()


def _granted(waiting: Any, deadline: float | None) -> int | None:
    """GRANT: the token handed to waiting (an Answer), or None if none came by deadline."""
    if not waiting.wait(None if deadline is None else max(0.0, deadline - now())):
        return None
    return int(waiting.result())


def _start(make: Callable[[], None]) -> None:
    """(On the share's loop.) Run make in a thread of its own, which ends with it."""
    threading.Thread(target=make, name="inturn-redis-connect", daemon=True).start()


def _settled(pooled: _Pooled, until: float | None) -> bool | None:
    """Read the replies pooled owes: whether the connection is whole (broken: dropped);
    None if they are not all in by ``until`` (None: no bound but its socket's)."""
    connection = pooled.connection
    try:
        while pooled.owed:
            if until is not None and not connection.can_read(max(0.0, until - now())):
                return None
            try:
                connection.read_response()
            except ResponseError:  # (a refusal, read whole: the connection is too)
                pass
            pooled.owed -= 1
    except Exception:
        connection.disconnect()
        return False
    return True
