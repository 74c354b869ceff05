"""A thread's Redis turn, on a blocking connection of its own: no hop to an event loop.

The second driver of a turn's steps (``LoopShare.bounds``, ``join``,
``enqueued``, ``hold``, ``ending``, ``left``; the first is
``LoopShare.acquire``, for a task). A thread writes its enqueue and its
leave itself, each one round trip on one of the backend's blocking
connections, and waits for a grant on an :class:`~inturn._bridge.Answer`
that the share's subscription completes. The share, on this process's
backend loop, keeps what goes on between calls: the subscription, the
heartbeat, the greeting.

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
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import redis.asyncio as aioredis
import redis.connection
import redis.sentinel
from redis.exceptions import NoScriptError, ResponseError

from .._bridge import Answer
from .._checks import Waited
from ._redis_errors import UNREACHABLE, demoted, unavailable
from ._redis_lease import Member
from ._redis_loop import LoopShare, RedisGrant, late_for
from ._redis_scripts import ENQUEUE, HEADS, LEAVE, SCRIPTS, Script

logger = logging.getLogger("inturn.redis")

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
    """One blocking connection, and how many leaves' replies it still owes (see Blocking)."""

    __slots__ = ("connection", "owed")

    def __init__(self, connection: Any) -> None:
        self.connection = connection
        self.owed = 0


class Blocking:
    """Threads' turns on blocking connections: each call one round trip on the thread's own.

    A thread takes an idle connection for a call and gives it back after
    (any number of threads at once: one connection each). Guarantees, as a
    task's turn (``LoopShare.acquire``):

    - The place is given up when the turn is not taken (a timeout, an
      interrupt such as ``KeyboardInterrupt``, Redis failing): the leave is
      written on the enqueue's own connection, so Redis runs it after the
      enqueue (its reply is read by the connection's next user), or, when
      that connection broke, on the share's. Should that overtake an
      enqueue still on its way (Redis busy), the place lapses within the
      lease, as a crashed waiter's does.
    - A release never fails: what Redis did not take is logged, and the key
      frees itself within the lease. An interrupted release goes on: its
      leave is written again on the share's connection.
    """

    __slots__ = ("_idle", "_make")

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make
        self._idle: list[_Pooled] = []

    def acquire(
        self, share: LoopShare, key: Hashable, names: Sequence[str], timeout: float | None
    ) -> RedisGrant:
        """As ``LoopShare.acquire``, blocking this thread; share has started."""
        began = time.monotonic()
        deadline, late = share.bounds(timeout, began, began)
        waiting = Answer()
        member_id, member = share.join(key, names, waiting)
        pooled = None
        pending = False  # the enqueue was written and its reply is not read yet
        try:
            pooled = self._take(share.loop)
            rest = share.calls.enqueue_rest(member, member_id)
            sent = time.monotonic()
            pending = True
            reply = _call(pooled.connection, ENQUEUE, rest, late)
            if reply is _LATE:
                raise late_for(key, timeout, Waited.ANSWER)()  # noqa: TRY301 - given up below, as any failure
            pending = False
            token = share.enqueued(member, sent, reply)
            self._idle.append(pooled)
            pooled = None
            if token is None:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                if not waiting.wait(left):
                    raise late_for(key, timeout, Waited.LINE)()  # noqa: TRY301 - given up below, as any failure
                token = int(waiting.result())
            return share.hold(member_id, member, token)
        except BaseException as error:
            share.leases.members.pop(member_id, None)  # (no more renewals)
            self._quit(share, member, member_id, pooled, pending, error)
            if isinstance(error, (*UNREACHABLE, ResponseError)) and not isinstance(
                error, TimeoutError
            ):
                raise unavailable(error) from error
            raise

    def _quit(
        self,
        share: LoopShare,
        member: Member,
        member_id: str,
        pooled: _Pooled | None,
        pending: bool,
        error: BaseException,
    ) -> None:
        """Give up member's place after error (see the class's guarantees)."""
        if pooled is None or not pending:  # not written, or answered: a leave of its own
            if pooled is not None:
                self._idle.append(pooled)
            if member.joined or pooled is not None:
                self._leave_later(share, member, member_id)
            return
        if isinstance(error, TimeoutError):  # (the connection is whole: the answer is late)
            self._owe(pooled, share, member, member_id)
        elif isinstance(error, ResponseError):  # refused: it did not run
            self._give(pooled, error)
        else:  # interrupted, or broken: whether it ran is unknown
            pooled.connection.disconnect()
            share.leave_soon(member, member_id)

    def _leave_later(self, share: LoopShare, member: Member, member_id: str) -> None:
        """Write member's leave and go on: the connection's next user reads the reply."""
        try:
            pooled = self._take(share.loop)
        except Exception:
            share.leave_soon(member, member_id)
            return
        self._owe(pooled, share, member, member_id)

    def _owe(self, pooled: _Pooled, share: LoopShare, member: Member, member_id: str) -> None:
        """Write member's leave on pooled (with the script's body: flushed or not, it runs)."""
        rest = share.calls.leave_rest(member, member_id)
        try:
            pooled.connection.send_packed_command(
                (HEADS[LEAVE.index + len(SCRIPTS)] + rest,), check_health=False
            )
        except Exception:
            share.leave_soon(member, member_id)
            return
        pooled.owed += 1
        self._idle.append(pooled)

    def release(self, share: LoopShare, grant: RedisGrant) -> None:
        """As ``LoopShare.release``, returning once Redis answered (or failed, logged)."""
        ending = share.ending(grant)
        if ending is None:
            return
        member_id, member = ending
        pooled = None
        try:
            pooled = self._take(share.loop)
            status = _call(pooled.connection, LEAVE, share.calls.leave_rest(member, member_id))
        except Exception as error:
            if pooled is not None and isinstance(error, ResponseError):  # (refused: it is whole)
                self._give(pooled, error)
            share.left(member, None, error)
            return
        except BaseException:  # interrupted: the release goes on, on the share's connection
            share.leave_soon(member, member_id)
            raise
        self._idle.append(pooled)
        share.left(member, status, None)

    def _give(self, pooled: _Pooled, refusal: ResponseError) -> None:
        """Give pooled back after Redis refused a call on it, unless the refusal says the
        server is a replica now (a failover): then drop it, so that the next call connects
        to the master, wherever it is now (as the share's Link does)."""
        if demoted(refusal):
            pooled.connection.disconnect()
        else:
            self._idle.append(pooled)

    def _take(self, loop: asyncio.AbstractEventLoop) -> _Pooled:
        """An idle connection, its owed replies read and nothing else pending (or a new one).

        As redis-py's pool, it checks that an idle connection has nothing to
        read: one Redis closed meanwhile (its idle ``timeout``) is replaced.
        """
        idle = self._idle
        while True:
            try:
                pooled = idle.pop()
            except IndexError:  # none idle: one more
                self._grow(loop)
                continue
            if pooled.owed and not _settled(pooled):
                continue
            try:
                if not pooled.connection.can_read(0):
                    return pooled
            except Exception:
                continue
            pooled.connection.disconnect()  # closed by Redis, or stray data: another

    def _grow(self, loop: asyncio.AbstractEventLoop) -> None:
        """Add a new connection to the idle ones; return once it is there.

        It is made in a thread of its own, which loop's thread starts: an
        exception that a signal handler raises in the caller's thread could
        leave redis-py's socket half made and open (or a thread half
        started). Interrupted meanwhile, the caller leaves, and the
        connection joins the idle ones all the same.

        :raises: why it could not be made (redis-py's ConnectionError...).
        """
        made = Answer()

        def make() -> None:
            try:
                connection = self._make()
                connection.connect()
            except BaseException as error:  # (handed to the caller)
                made.set_exception(error)
                return
            self._idle.append(_Pooled(connection))
            made.set_result(None)

        loop.call_soon_threadsafe(_start, make)
        made.wait(None)  # (bounded: connecting and its handshake time out after a lease)
        made.result()

    def forked(self) -> Blocking:
        """(In a forked child.) A pool of its own; the child's copies of the parent's idle
        connections are closed (their sockets only: redis-py shuts a connection down only
        in the process that made it, so the parent's go on)."""
        self.close()
        return Blocking(self._make)

    def close(self) -> None:
        """Close the idle connections (one in use is closed as it is given back: never)."""
        idle, self._idle = self._idle, []
        for pooled in idle:
            pooled.connection.disconnect()


#: What _call returns for a reply that did not come in time.
_LATE: Any = object()


def _call(connection: Any, script: Script, rest: bytes, late: float | None = None) -> Any:
    """Call script on connection with rest (keys and arguments, packed): its reply.

    _LATE if none came by monotonic ``late`` (the connection is whole: the
    reply is on its way). A ResponseError is raised (redis-py's parser).
    """
    connection.send_packed_command((HEADS[script.index] + rest,), check_health=False)
    if late is not None and not connection.can_read(max(0.0, late - time.monotonic())):
        return _LATE
    try:
        return connection.read_response()
    except NoScriptError:  # flushed: send it again, with its body (which loads it)
        connection.send_packed_command(
            (HEADS[script.index + len(SCRIPTS)] + rest,), check_health=False
        )
        return connection.read_response()


def _start(make: Callable[[], None]) -> None:
    """(On the share's loop.) Run make in a thread of its own, which ends with it."""
    threading.Thread(target=make, name="inturn-redis-connect", daemon=True).start()


def _settled(pooled: _Pooled) -> bool:
    """Read the replies pooled owes (up to its leaves'): whether the connection is whole."""
    connection = pooled.connection
    try:
        while pooled.owed:
            if type(connection.read_response()) is int:  # a leave's (an enqueue's is a list)
                pooled.owed -= 1
    except Exception:
        connection.disconnect()
        return False
    return True
