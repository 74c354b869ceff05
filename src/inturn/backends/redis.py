"""The Redis backend: one FIFO line per key across processes and hosts.

::

    from inturn import KeyedQueue
    from inturn.backends.redis import RedisBackend

    orders = KeyedQueue(backend=RedisBackend.from_url("redis://localhost:6379/0", namespace="shop"))

Installed with ``pip install "inturn[redis]"`` (redis-py's asyncio client).
Works with Redis 6.2+, Valkey, and Redis Cluster.

How a line is kept. Each key's line is four Redis keys that share one hash
slot (the hash tag ``{namespace:digest}``, the digest a SHA-256 of the key),
so every script touches one slot and runs on a cluster:

- ``inturn:{ns:d}:line``, a hash: the holder, the last fencing token, when
  the holder got the key, the key as it was given;
- ``inturn:{ns:d}:q``, a sorted set of the waiters by arrival;
- ``inturn:{ns:d}:lease``, a sorted set of every member's lease expiry
  (holder and waiters), by Redis's own clock;
- ``inturn:{ns:d}:info``, a hash: each member's host, pid and arrival time.

Every change is one Lua script, loaded once and called by SHA: *enqueue*
(join the line, take the key if free), *leave* (release, or give up
waiting) and *renew* (extend a lease). Each first drops members whose lease
expired, and each grants a free key to the head of the line, with a token
one above the last (or Redis's clock in microseconds when a line starts
anew), then publishes the grant on the new holder's process channel. When
a line empties, its keys are deleted; all four carry a TTL besides. On one
server (not a cluster) a process makes its calls on one connection of its
own, written as they are made without waiting for earlier replies, so Redis
runs them in the order the process made them.

Each process has one subscription (on its channel) that wakes its waiters:
the release itself pushes the turn, nothing polls. The subscription and the
script calls ride connections that redis-py opens and sets up (TLS, AUTH,
protocol), whose replies this process then parses as they arrive, in the
event loop's own callbacks: no task wakes up per reply or per grant. A heartbeat renews every
lease the process has every ``lease / 3`` seconds; its reply also hands a
waiter a grant whose message was lost (a dropped connection), and tells a
holder that its lease is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import re
import secrets
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Final, final

from .._errors import BackendUnavailable
from .._keys import order_portable, portable_key, portable_name
from ._base import Grant
from ._lines import HolderInfo, LineInfo, WaiterInfo

try:
    import redis.asyncio as aioredis
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "inturn's Redis backend needs redis-py: pip install 'inturn[redis]'"
    ) from error

__all__ = ("HolderInfo", "LineInfo", "RedisBackend", "RedisGrant", "WaiterInfo")

logger = logging.getLogger("inturn.redis")

#: Errors that mean the server could not be reached (as opposed to a bug).
_UNREACHABLE: Final = (RedisConnectionError, RedisTimeoutError, OSError)

_NAMESPACE = re.compile(r"[A-Za-z0-9_.:\-]{1,100}")

# -- the scripts ------------------------------------------------------------------------

# KEYS: line, q, lease, info. Shared by every script: the clock, dropping
# expired members, granting a free key to the head, and deleting or
# refreshing the line's keys.
_PRELUDE = """
local line, q, lease, info = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function purge()
  local expired = redis.call('ZRANGEBYSCORE', lease, '-inf', now)
  for _, m in ipairs(expired) do
    redis.call('ZREM', q, m)
    redis.call('ZREM', lease, m)
    redis.call('HDEL', info, m)
    if redis.call('HGET', line, 'holder') == m then
      redis.call('HDEL', line, 'holder')
    end
  end
end

local function grant(channels, me)
  if redis.call('HEXISTS', line, 'holder') == 1 then return end
  local head = redis.call('ZRANGE', q, 0, 0)[1]
  if not head then return end
  redis.call('ZREM', q, head)
  local token = math.max(tonumber(redis.call('HGET', line, 'token') or '0') + 1, now_us)
  token = string.format('%.0f', token)
  redis.call('HSET', line, 'holder', head, 'token', token, 'since', now)
  if head ~= me then
    redis.call('PUBLISH', channels .. string.match(head, '^[^/]+'), head .. ' ' .. token)
  end
end

local function finish(ttl)
  if redis.call('HEXISTS', line, 'holder') == 0 and redis.call('ZCARD', q) == 0 then
    redis.call('DEL', line, q, lease, info)
  else
    for _, k in ipairs(KEYS) do redis.call('PEXPIRE', k, ttl) end
  end
end
"""

# ARGV: member, lease ms, ttl ms, channel prefix, info, the key as given.
# Returns {1, token} when the key was free, else {0, place in line}.
_ENQUEUE = (
    _PRELUDE
    + """
local member, lease_ms, ttl, channels = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
purge()
if redis.call('HGET', line, 'holder') ~= member then
  local seq = redis.call('HINCRBY', line, 'seq', 1)
  redis.call('ZADD', q, 'NX', seq, member)
  redis.call('ZADD', lease, now + lease_ms, member)
  redis.call('HSET', info, member, ARGV[5])
  redis.call('HSETNX', line, 'key', ARGV[6])
  grant(channels, member)
end
finish(ttl)
if redis.call('HGET', line, 'holder') == member then
  return {1, redis.call('HGET', line, 'token')}
end
return {0, redis.call('ZRANK', q, member) + 1}
"""
)

# ARGV: member, ttl ms, channel prefix. Releases the key, or leaves the line.
# Returns 1: was the holder; 2: was waiting; 3: had released already (a
# retried call); 0: was in neither place (its lease ran out).
_LEAVE = (
    _PRELUDE
    + """
local member, ttl, channels = ARGV[1], tonumber(ARGV[2]), ARGV[3]
purge()
local status = 0
if redis.call('HGET', line, 'holder') == member then
  redis.call('HDEL', line, 'holder')
  redis.call('HSET', line, 'last', member)
  status = 1
elseif redis.call('ZREM', q, member) == 1 then
  status = 2
elseif redis.call('HGET', line, 'last') == member then
  status = 3
end
redis.call('ZREM', lease, member)
redis.call('HDEL', info, member)
grant(channels, '')
finish(ttl)
return status
"""
)

# ARGV: member, lease ms, ttl ms, channel prefix. Returns {1, token}: holds
# the key; {2, 0}: waits; {0, 0}: in the line no more (its lease ran out).
_RENEW = (
    _PRELUDE
    + """
local member, lease_ms, ttl, channels = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
purge()
if redis.call('HGET', line, 'holder') ~= member and not redis.call('ZSCORE', q, member) then
  grant(channels, '')
  finish(ttl)
  return {0, 0}
end
redis.call('ZADD', lease, 'XX', now + lease_ms, member)
grant(channels, member)
finish(ttl)
if redis.call('HGET', line, 'holder') == member then
  return {1, redis.call('HGET', line, 'token')}
end
return {2, 0}
"""
)


# -- this process's connection for its scripts ---------------------------------------------

#: The scripts, as _Link numbers them, each with its count of ARGV.
_SCRIPTS: Final = ((_ENQUEUE, 6), (_LEAVE, 3), (_RENEW, 4))
_ENQUEUE_AT: Final = 0
_LEAVE_AT: Final = 1
_RENEW_AT: Final = 2


def _bulk(value: bytes) -> bytes:
    """Pack one RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


def _heads(verb: bytes, scripts: Sequence[tuple[bytes, int]]) -> tuple[bytes, ...]:
    """Pack each script's command up to its keys: the verb, the SHA or body, 4 keys."""
    return tuple(
        b"*%d\r\n" % (7 + count) + _bulk(verb) + _bulk(script) + _bulk(b"4")
        for script, count in scripts
    )


def _fail(future: asyncio.Future[Any] | None, error: BaseException) -> None:
    if future is not None and not future.done():
        future.set_exception(error)


class _Incomplete(Exception):
    """More bytes are needed before the next reply is whole."""


def _reply(buffer: bytearray, at: int) -> tuple[Any, int]:
    """Parse the RESP2/RESP3 reply that starts at buffer[at]: (value, where the next starts).

    Bulk strings come as bytes, errors as ResponseError instances (returned,
    not raised), arrays and pushes as lists, null as None.

    :raises _Incomplete: the reply is not whole yet.
    :raises ValueError: the bytes are not RESP.
    """
    end = buffer.find(b"\r\n", at)
    if end < 0:
        raise _Incomplete
    kind, line, at = buffer[at], buffer[at + 1 : end], end + 2
    if kind == 0x3A:  # ':' integer
        return int(line), at
    if kind in (0x24, 0x3D):  # '$' bulk string, '=' verbatim string
        size = int(line)
        if size < 0:
            return None, at
        if len(buffer) < at + size + 2:
            raise _Incomplete
        return bytes(buffer[at : at + size]), at + size + 2
    if kind in (0x2A, 0x3E, 0x7E, 0x25):  # '*' array, '>' push, '~' set, '%' map
        count = int(line) * (2 if kind == 0x25 else 1)
        if count < 0:
            return None, at
        items = []
        for _ in range(count):
            item, at = _reply(buffer, at)
            items.append(item)
        return items, at
    if kind == 0x2B:  # '+' simple string
        return bytes(line), at
    if kind == 0x2D:  # '-' error
        return ResponseError(line.decode("utf-8", "replace")), at
    if kind == 0x5F:  # '_' null
        return None, at
    if kind == 0x23:  # '#' boolean
        return line == b"t", at
    if kind in (0x2C, 0x28):  # ',' double, '(' big number
        return (float(line) if kind == 0x2C else int(line)), at
    raise ValueError(f"not a Redis reply: {bytes(buffer[at - len(line) - 3 : at])!r}")


async def _open(make: Callable[[], Any]) -> tuple[Any, asyncio.Transport]:
    """A connection made and set up by redis-py (TLS, AUTH, HELLO, SELECT), and its transport.

    The caller reads and writes the transport itself from then on: redis-py
    makes the connection; this process's few hot calls skip its per-command
    machinery (a task per write, a parser per reply).
    """
    connection = make()
    try:
        await connection.connect()
    except BaseException:
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        raise
    # Where redis-py's asyncio connections keep their stream (redis-py 4.2 to 8).
    writer = connection._writer
    if not isinstance(writer, asyncio.StreamWriter):
        await connection.disconnect(nowait=True)
        raise TypeError(f"inturn: cannot take over {connection!r}: unknown redis-py internals")
    return connection, writer.transport  # type: ignore[return-value]


def _forget(connection: Any) -> None:
    """Tell redis-py a taken-over connection is closed (its transport is, or is closing)."""
    with contextlib.suppress(Exception):
        connection._writer.close()
    connection._reader = connection._writer = None


class _Wire(asyncio.Protocol):
    """One connection to Redis whose replies this process parses as they arrive.

    Subclasses get each reply in :meth:`_got` and the loss of the connection
    in :meth:`_gone`, in the event loop's own callbacks: no task wakes up
    for a reply, so a reply costs one pass of the loop.
    """

    __slots__ = ("_buffer", "_connection", "_lost", "_transport")

    def __init__(self) -> None:
        self._connection: Any = None
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._lost: asyncio.Future[None] | None = None  # done once the connection is closed

    def _attach(self, connection: Any, transport: asyncio.Transport) -> None:
        self._connection, self._transport = connection, transport
        self._buffer = bytearray()
        self._lost = asyncio.get_running_loop().create_future()
        transport.set_protocol(self)

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        at = 0
        try:
            while at < len(buffer):
                reply, at = _reply(buffer, at)
                self._got(reply)
        except _Incomplete:
            pass
        except ValueError as error:  # not Redis: drop the connection
            logger.warning("inturn: %s", error)
            if self._transport is not None:
                self._transport.abort()
        del buffer[:at]

    def eof_received(self) -> None:
        return None  # the transport closes, and connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._connection is not None:
            _forget(self._connection)
        self._connection = self._transport = None
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
        self._gone(
            RedisConnectionError(
                f"Redis connection lost ({exc})" if exc else "Redis closed the connection"
            )
        )

    def _close(self) -> None:
        transport, self._transport = self._transport, None
        if transport is not None:
            transport.close()  # connection_lost follows, in a later pass of the loop

    async def _closed(self) -> None:
        """Close the connection and wait (a second at most) until it is."""
        self._close()
        if self._lost is not None:
            await asyncio.wait((self._lost,), timeout=1.0)

    def _got(self, reply: Any) -> None:
        raise NotImplementedError

    def _gone(self, error: BaseException) -> None:
        raise NotImplementedError


# A call: the script's number, its keys and arguments packed, its reply's future.
_Call = tuple[int, bytes, "asyncio.Future[Any]"]


@final
class _Link(_Wire):
    """One connection that carries this process's script calls to Redis, in the order made.

    Redis runs the commands of one connection in the order they arrive, so a
    call made after another (a re-acquire after a release, a leave after an
    enqueue) runs after it, even while the first one's reply is still on its
    way back. So each call is written the moment it is made, without waiting
    for earlier replies (pipelining), and each reply is handed to its call's
    future as it is read, in the same order.

    If the connection drops, the calls in flight fail with its error (whether
    they ran is unknown), and the next call connects anew; calls made while
    it connects are written, in order, once it has. The scripts are loaded
    first thing on every connection and called by SHA; a call that finds its
    script gone (``SCRIPT FLUSH``) is sent again with the body, and since
    every later call on the connection failed the same way, the calls run
    again in the order made.
    """

    __slots__ = ("_connecting", "_heads", "_loads", "_make", "_outbox", "_sent", "last")

    def __init__(self, make: Callable[[], Any]) -> None:
        super().__init__()
        self._make = make
        bodies = [(body.encode(), count) for body, count in _SCRIPTS]
        shas = [(hashlib.sha1(body).hexdigest().encode(), count) for body, count in bodies]
        # by script number: called by SHA, then (numbers + len(_SCRIPTS)) with the body
        self._heads = _heads(b"EVALSHA", shas) + _heads(b"EVAL", bodies)
        self._loads = b"".join(
            b"*3\r\n" + _bulk(b"SCRIPT") + _bulk(b"LOAD") + _bulk(body) for body, _ in bodies
        )
        # NOTE: a call is in one of these two until its reply (or failure) is
        # handed over. Calls made while connecting, in the order made:
        self._outbox: deque[_Call] = deque()
        # calls written on the current connection, in the order their replies
        # come (None: a reply nobody waits for, a SCRIPT LOAD's):
        self._sent: deque[_Call | None] = deque()
        self._connecting: asyncio.Task[None] | None = None
        #: The future of the latest call: once it is done, so is every earlier one.
        self.last: asyncio.Future[Any] | None = None

    def call(self, script: int, rest: bytes) -> asyncio.Future[Any]:
        """Call a script with rest (its keys and arguments, packed); return its reply's future.

        It runs after every call made before it, whatever becomes of the caller.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.last = future
        call = (script, rest, future)
        transport = self._transport
        if transport is not None:  # (then the outbox is empty: see _connect)
            self._sent.append(call)
            transport.write(self._heads[script] + rest)
        else:
            self._outbox.append(call)
            if self._connecting is None:
                self._connecting = loop.create_task(self._connect(), name="inturn-redis-link")
        return future

    async def _connect(self) -> None:
        """Open a connection, then write the calls made meanwhile (or fail them)."""
        try:
            connection, transport = await _open(self._make)
        except Exception as error:
            outbox = self._outbox
            while outbox:
                _fail(outbox.popleft()[2], error)
            return
        finally:
            self._connecting = None
        self._attach(connection, transport)
        sent: deque[_Call | None] = deque((None, None, None))
        heads, outbox = self._heads, self._outbox
        self._sent = sent
        batch = [self._loads]
        while outbox:
            call = outbox.popleft()
            sent.append(call)
            batch += (heads[call[0]], call[1])
        transport.write(b"".join(batch))

    def _got(self, reply: Any) -> None:
        call = self._sent.popleft()
        if call is None:
            return
        script, rest, future = call
        if type(reply) is ResponseError:
            if str(reply).startswith("NOSCRIPT") and script < len(_SCRIPTS):
                # SCRIPT FLUSH: send it again, with the body (which loads the script)
                if self._transport is None:  # closed meanwhile
                    _fail(future, BackendUnavailable("inturn: the backend was closed"))
                    return
                retry = (script + len(_SCRIPTS), rest, future)
                self._sent.append(retry)
                self._transport.write(self._heads[retry[0]] + rest)
            else:
                _fail(future, reply)
        elif not future.done():
            future.set_result(reply)

    def _gone(self, error: BaseException) -> None:
        sent, self._sent = self._sent, deque()
        for call in sent:
            if call is not None:
                _fail(call[2], error)

    async def aclose(self) -> None:
        """Close the connection; calls not answered yet fail."""
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
        error = BackendUnavailable("inturn: the backend was closed")
        for call in (*self._sent, *self._outbox):
            if call is not None:
                _fail(call[2], error)
        self._sent.clear()
        self._outbox.clear()
        await self._closed()


@final
class _Inbox(_Wire):
    """This process's subscription: a grant published to its channel wakes its waiter at once.

    One connection of its own, subscribed to the process's channel; each
    message is handed over as it is read. When the connection drops, it is
    opened again after a pause; ``subscribed`` is called on every
    subscription Redis confirms, so that the heartbeat catches up on grants
    published while there was none.
    """

    __slots__ = (
        "_closing",
        "_command",
        "_confirmed",
        "_make",
        "_pause",
        "_reopening",
        "_subscribed",
        "heard",
    )

    def __init__(
        self,
        make: Callable[[], Any],
        channel: str,
        heard: Callable[[bytes], None],
        subscribed: Callable[[], None],
        pause: float,
    ) -> None:
        super().__init__()
        self._make = make
        self._command = b"*2\r\n" + _bulk(b"SUBSCRIBE") + _bulk(channel.encode())
        #: Called with each message's data (tests replace it to stop hearing grants).
        self.heard = heard
        self._subscribed = subscribed
        self._pause = pause
        self._confirmed: asyncio.Future[None] | None = None
        self._reopening: asyncio.Task[None] | None = None
        self._closing = False

    async def open(self) -> None:
        """Connect and subscribe; return once Redis confirmed (a grant published before is lost)."""
        connection, transport = await _open(self._make)
        confirmed = self._confirmed = asyncio.get_running_loop().create_future()
        self._attach(connection, transport)
        transport.write(self._command)
        try:
            await confirmed
        except BaseException:
            if self._transport is not None:  # cancelled, not dropped: stop for good
                self._closing = True
                self._close()
            raise

    def _got(self, reply: Any) -> None:
        if type(reply) is not list or len(reply) != 3:
            return
        kind = reply[0]
        if kind == b"message":
            self.heard(reply[2])
        elif kind == b"subscribe":
            confirmed = self._confirmed
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)
            self._subscribed()

    def _gone(self, error: BaseException) -> None:
        _fail(self._confirmed, error)
        if self._closing or self._reopening is not None:
            return
        logger.warning("inturn: Redis subscription interrupted (%s); reconnecting", error)
        self._subscribed()  # the heartbeat catches up on grants missed meanwhile
        self._reopening = asyncio.get_running_loop().create_task(
            self._reopen(), name="inturn-redis-inbox"
        )

    async def _reopen(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._pause)
                try:
                    await self.open()
                except _UNREACHABLE as error:
                    logger.warning("inturn: Redis subscription still down (%s)", error)
                else:
                    return
        finally:
            self._reopening = None

    async def aclose(self) -> None:
        """Unsubscribe for good: close the connection, stop reopening it."""
        self._closing = True
        reopening = self._reopening
        if reopening is not None:
            reopening.cancel()
            with contextlib.suppress(BaseException):
                await reopening
        await self._closed()


# -- what the backend hands out and shows ------------------------------------------------


@final
class RedisGrant:
    """The turn on one key granted by a :class:`RedisBackend`, while its lease holds."""

    __slots__ = ("_member", "_names", "_state", "key", "token")

    def __init__(
        self, key: Hashable, token: int, member: str, names: Sequence[str], state: _Member
    ) -> None:
        #: The key held.
        self.key = key
        #: The fencing token: larger than every earlier grant's on this key
        #: (Redis's clock in microseconds when the key's line starts anew).
        self.token = token
        self._member = member
        self._names = names
        self._state = state  # the lease as this process knows it

    @property
    def lost(self) -> bool:
        """Whether the lease ran out, or may have: Redis dropped it, or no renewal came in time.

        Known at once after the process was frozen past its lease, or its
        event loop blocked that long: the lease is counted on this host's
        monotonic clock from the moment the last renewal was sent, which is
        no later than Redis's own count.
        """
        state = self._state
        return state.lost or time.monotonic() >= state.expires

    def __repr__(self) -> str:
        lost = " lost" if self.lost else ""
        return f"<RedisGrant key={self.key!r} token={self.token}{lost}>"


@dataclass
class _Member:
    """One of this process's members of a line: a waiter, then a holder."""

    names: Sequence[str]
    packed: bytes  # names as a script call's keys, packed for the _Link (b"" without one)
    # time.monotonic() when its lease runs out as far as this process can
    # vouch: a lease after the call that last set it in Redis was sent
    # (Redis's own expiry is no earlier)
    expires: float
    waiting: asyncio.Future[int] | None  # resolved with the token when granted
    grant: RedisGrant | None = None
    lost: bool = False  # Redis no longer has it
    # Its enqueue was answered: only then does a renewal that finds it gone
    # mean it is gone (on a cluster, a renewal may overtake the enqueue).
    joined: bool = False


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


# -- the backend ---------------------------------------------------------------------------


@final
class RedisBackend:
    """Lines shared by every process and host that uses the same Redis and namespace.

    Guarantees, each tested against a real server:

    - Mutual exclusion per key across every process and host.
    - Strict FIFO: turns are granted in the order submissions reached Redis
      (each queue submits, per key, its own next task in line, so a
      process's own submissions keep their local order).
    - Push, not poll: a release hands the key over in one script and wakes
      the next holder through its process's subscription.
    - Crash safety: each holder and waiter has a lease, renewed by a
      heartbeat. A process that dies holding a key loses it within the
      lease (plus one heartbeat of the waiter that notices); one that dies
      waiting is skipped. A holder whose lease could not be renewed learns
      it (``turn.lease_lost``), and its call raises
      :exc:`~inturn.LeaseLost` afterwards.
    - Fencing tokens from Redis that only grow per key.
    - No stale state: a line's keys are deleted when it empties, and all of
      them carry a TTL.
    - Redis unreachable at submission: :exc:`~inturn.BackendUnavailable`,
      and the work does not run.

    Not guaranteed: exclusion across a Redis failover or restart that loses
    the line's data (the holder learns its lease is lost at its next
    heartbeat, but another process may have been granted the key by then);
    use persistence or fencing tokens where that matters.

    :param client: a ``redis.asyncio.Redis`` or ``RedisCluster`` client,
        configured as you need (TLS, AUTH, timeouts, retries).
    :param namespace: keeps the lines of different apps apart (letters,
        digits and ``_.:-``).
    :param lease: seconds a holder or waiter stays in line without a
        heartbeat; a crashed process's place is freed after this long.
    :param owns_client: close ``client`` in :meth:`aclose`.
    :raises ValueError: a bad namespace or lease.
    """

    __slots__ = (
        "_beat",
        "_channel",
        "_channels",
        "_cleanups",
        "_client",
        "_counter",
        "_id",
        "_inbox",
        "_info",
        "_kick",
        "_lease",
        "_link",
        "_loop",
        "_members",
        "_namespace",
        "_owns_client",
        "_scripts",
        "_starting",
        "_tails",
    )

    def __init__(
        self,
        client: Any,
        *,
        namespace: str = "inturn",
        lease: float = 10.0,
        owns_client: bool = False,
    ) -> None:
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise ValueError(
                f"inturn: namespace must be 1 to 100 letters, digits or '_.:-', got {namespace!r}"
            )
        if isinstance(lease, bool) or not isinstance(lease, int | float) or not lease >= 0.1:
            raise ValueError(f"inturn: lease must be at least 0.1 seconds, got {lease!r}")
        if not hasattr(client, "pubsub"):  # redis-py's asyncio RedisCluster before 8.0
            raise TypeError(
                f"inturn: the client {client!r} has no pub/sub, which wakes the waiters; "
                "for Redis Cluster, install redis-py 8.0 or newer"
            )
        self._client = client
        self._namespace = namespace
        self._lease = float(lease)
        self._owns_client = owns_client
        self._id = secrets.token_hex(8)
        self._channels = f"inturn:{namespace}:wake:"
        self._channel = self._channels + self._id
        self._info = f"{socket.gethostname()} {os.getpid()}"
        self._counter = itertools.count(1)
        self._members: dict[str, _Member] = {}
        self._scripts = tuple(client.register_script(s) for s, _ in _SCRIPTS)
        # A single server (not a cluster) gets this process's one pipelined
        # connection for its scripts, made on each event loop; see _Link.
        self._link: _Link | None = None
        # by script: its arguments after the member's id that never change, packed
        lease_ms, ttl_ms, channels = (
            _bulk(b"%d" % self._lease_ms),
            _bulk(b"%d" % self._ttl_ms),
            _bulk(self._channels.encode()),
        )
        self._tails = (
            lease_ms + ttl_ms + channels,
            ttl_ms + channels,
            lease_ms + ttl_ms + channels,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Task[None] | None = None
        self._inbox: _Inbox | None = None
        self._beat: asyncio.Task[None] | None = None
        self._kick: asyncio.Event | None = None
        self._cleanups: set[asyncio.Task[Any]] = set()

    @classmethod
    def from_url(
        cls, url: str, *, namespace: str = "inturn", lease: float = 10.0, **options: Any
    ) -> RedisBackend:
        """A backend on a new client for ``url`` (``redis://``, ``rediss://``, ``unix://``).

        ``options`` go to ``redis.asyncio.Redis.from_url`` (``password``,
        ``ssl_ca_certs``, ``socket_timeout``, ...). The backend owns the
        client and closes it in :meth:`aclose`.
        """
        return cls(
            aioredis.Redis.from_url(url, **options),
            namespace=namespace,
            lease=lease,
            owns_client=True,
        )

    @property
    def namespace(self) -> str:
        """The namespace of this backend's lines."""
        return self._namespace

    @property
    def lease(self) -> float:
        """Seconds a member stays in line without a heartbeat."""
        return self._lease

    def order(self, keys: tuple[Hashable, ...]) -> tuple[Hashable, ...]:
        """Sort keys into the order every process computes (by their portable names).

        :raises TypeError: a key is not a ``str``, ``bytes`` or ``int``.
        """
        return order_portable(keys)

    def _names(self, key: Hashable) -> tuple[str, str, str, str]:
        digest = hashlib.sha256(portable_name(key)).hexdigest()[:40]
        prefix = f"inturn:{{{self._namespace}:{digest}}}:"
        return prefix + "line", prefix + "q", prefix + "lease", prefix + "info"

    @property
    def _lease_ms(self) -> int:
        return int(self._lease * 1000)

    @property
    def _ttl_ms(self) -> int:
        return int(self._lease * 3000)

    # -- start and stop --------------------------------------------------------------

    async def _start(self) -> None:
        """Subscribe to this process's channel and start the heartbeat, once."""
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._beat is not None:
            return
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError(
                    "inturn: this RedisBackend is in use by another event loop; "
                    "make one backend per event loop"
                )
            self._loop, self._starting, self._inbox, self._beat = loop, None, None, None
            self._link = None
        if self._starting is None:
            self._starting = loop.create_task(self._begin())
        starting = self._starting
        try:
            await asyncio.shield(starting)
        except _UNREACHABLE as error:
            if self._starting is starting:
                self._starting = None  # the next submission tries again
            raise BackendUnavailable(
                f"inturn: Redis could not be reached ({error}); the work did not run"
            ) from error

    async def _begin(self) -> None:
        client = self._client
        initialize = getattr(client, "initialize", None)
        if initialize is not None:  # a RedisCluster learns its nodes first
            await initialize()
        kick = asyncio.Event()
        inbox = _Inbox(
            self._connector(), self._channel, self._heard, kick.set, min(1.0, self._lease / 10)
        )
        await inbox.open()
        self._inbox, self._kick = inbox, kick
        if isinstance(client, aioredis.Redis):
            self._link = _Link(client.connection_pool.make_connection)
        self._beat = asyncio.get_running_loop().create_task(
            self._heartbeat(), name="inturn-redis-heartbeat"
        )

    def _connector(self) -> Callable[[], Any]:
        """What makes a connection of this process's own (a cluster's: to any node)."""
        client = self._client
        if isinstance(client, aioredis.Redis):
            return client.connection_pool.make_connection

        def make() -> Any:
            node = client.get_default_node()
            return node.connection_class(**node.connection_kwargs)

        return make

    async def aclose(self) -> None:
        """Stop the heartbeat and subscription; close the client if this backend owns it.

        Members still in line (work that was not drained) lose their places
        when their leases run out.
        """
        starting = self._starting
        if starting is not None and not starting.done():
            # Closed while still connecting (its submitter was cancelled, say):
            # stop connecting, so that nothing is opened after the client closes.
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
        if self._cleanups:  # places given up just now: let them leave their lines
            await asyncio.wait(self._cleanups, timeout=self._lease)
        link, self._link = self._link, None
        if link is not None:
            last = link.last
            if last is not None and not last.done():  # releases still on their way
                await asyncio.wait((last,), timeout=self._lease)
            await link.aclose()
        for task in (self._beat, *self._cleanups):
            if task is not None:
                task.cancel()
        for task in (self._beat, *self._cleanups):
            if task is not None:
                with contextlib.suppress(BaseException):
                    await task
        self._beat = None
        self._starting = None
        inbox, self._inbox = self._inbox, None
        if inbox is not None:
            await inbox.aclose()
        for member in self._members.values():
            if member.waiting is not None and not member.waiting.done():
                member.waiting.set_exception(BackendUnavailable("inturn: the backend was closed"))
        self._members.clear()
        if self._owns_client:
            await self._client.aclose()

    # -- taking and giving back turns ------------------------------------------------

    async def acquire(self, key: Hashable, timeout: float | None) -> RedisGrant:
        """Join key's line in Redis; return once this process holds the key.

        :raises TimeoutError: the turn was not reached within ``timeout``;
            this process's place was given up.
        :raises ~inturn.BackendUnavailable: Redis could not be reached; the
            turn was not taken.
        """
        await self._start()
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        names = self._names(key)
        member_id = f"{self._id}/{next(self._counter)}"
        link = self._link
        packed = b"" if link is None else b"".join(_bulk(name.encode()) for name in names)
        member = _Member(names, packed, time.monotonic() + self._lease, loop.create_future())
        self._members[member_id] = member
        info = f"{self._info} {int(time.time() * 1000)}"
        given = portable_name(key).decode("utf-8", "backslashreplace")
        if link is not None:
            enqueue = link.call(
                _ENQUEUE_AT,
                packed
                + _bulk(member_id.encode())
                + self._tails[_ENQUEUE_AT]
                + _bulk(info.encode())
                + _bulk(given.encode()),
            )
        else:
            enqueue = loop.create_task(
                self._call(
                    _ENQUEUE_AT,
                    names,
                    member_id,
                    self._lease_ms,
                    self._ttl_ms,
                    self._channels,
                    info,
                    given,
                )
            )
        try:
            try:
                # The link's call runs whatever becomes of its awaiter; a
                # task of the cluster's client must not be cancelled with it.
                state, value = await (enqueue if link is not None else asyncio.shield(enqueue))
            except _UNREACHABLE as error:
                raise _unavailable(error) from error
            member.joined = True
            if state == 1:
                token = int(value)
            else:
                assert member.waiting is not None
                token = await _wait(member.waiting, deadline, key)
        except BaseException:
            # Cancelled, timed out, or Redis failed: give the place up. The
            # call to leave goes after the enqueue (even one still in flight);
            # if the key was just granted, leaving passes it on.
            del self._members[member_id]
            self._detach(self._leave_after(enqueue, member, member_id))
            raise
        grant = member.grant = RedisGrant(key, token, member_id, names, member)
        member.waiting = None
        return grant

    def release(self, grant: Grant) -> Awaitable[None]:
        """End grant's turn: Redis hands the key to the next in line and wakes it.

        On one server the call to leave is written at once and the answer is
        a Future that completes by itself, whatever becomes of its awaiter.
        """
        if not isinstance(grant, RedisGrant):
            raise TypeError(f"inturn: {self!r} cannot release {grant!r}, which it did not grant")
        done = asyncio.get_running_loop().create_future()
        if self._members.pop(grant._member, None) is None:
            done.set_result(None)  # released already, or Redis no longer had it (lost)
            return done
        leave = self._leave(grant._state, grant._member)
        if not isinstance(leave, asyncio.Future):
            return self._release_after(grant, leave)

        def answered(leave: asyncio.Future[Any]) -> None:
            try:
                error = leave.exception()
                self._left(grant, None if error else leave.result(), error)
            except BaseException as error:
                _fail(done, error)
            else:
                if not done.done():
                    done.set_result(None)

        leave.add_done_callback(answered)
        return done

    async def _release_after(self, grant: RedisGrant, leave: Awaitable[Any]) -> None:
        """Release through a cluster client: await its leave call, then see what it says."""
        try:
            status = await leave
        except Exception as error:
            self._left(grant, None, error)
        else:
            self._left(grant, status, None)

    def _left(self, grant: RedisGrant, status: Any, error: BaseException | None) -> None:
        """What grant's leave call answered (status, or error) means: a lost lease, or a warning."""
        if error is None:
            if status == 0:
                grant._state.lost = True
        elif isinstance(error, _UNREACHABLE):
            # The key frees itself when the lease runs out. The work is done,
            # so it is not failed for this; a lease that could not be vouched
            # for is reported as lost.
            logger.warning(
                "inturn: could not release %r in Redis (%s); it frees itself within %g s",
                grant.key,
                error,
                self._lease,
            )
        else:
            raise error

    def _leave(self, member: _Member, member_id: str) -> Awaitable[Any]:
        """Call the leave script for member (after this process's earlier calls, on a _Link)."""
        link = self._link
        if link is not None:
            return link.call(
                _LEAVE_AT, member.packed + _bulk(member_id.encode()) + self._tails[_LEAVE_AT]
            )
        return self._call(_LEAVE_AT, member.names, member_id, self._ttl_ms, self._channels)

    async def _leave_after(
        self, enqueue: asyncio.Future[Any], member: _Member, member_id: str
    ) -> None:
        """Leave the line once the enqueue call has finished (whatever its outcome)."""
        with contextlib.suppress(BaseException):
            await enqueue
        with contextlib.suppress(*_UNREACHABLE):
            await self._leave(member, member_id)

    def _detach(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _call(self, script: int, names: Sequence[str], *args: Any) -> Any:
        """Run a script through the client (a cluster's, which routes it to the keys' node)."""
        return await self._scripts[script](keys=names, args=args)

    # -- push and heartbeat ---------------------------------------------------------------

    def _granted(self, member_id: str, token: int) -> None:
        member = self._members.get(member_id)
        if member is not None and member.waiting is not None and not member.waiting.done():
            member.waiting.set_result(token)

    def _heard(self, data: bytes) -> None:
        """A grant published to this process's channel: ``<member> <token>``."""
        member_id, _, token = data.partition(b" ")
        self._granted(member_id.decode(), int(token))

    async def _heartbeat(self) -> None:
        """Renew every lease of this process every lease / 3 seconds (sooner when kicked)."""
        kick = self._kick
        assert kick is not None
        interval = self._lease / 3
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(kick.wait(), interval)
            kick.clear()
            if self._members:
                await self._renew_all(interval)

    async def _renew_all(self, limit: float) -> None:
        """Renew every member's lease; hand out grants, and mark what Redis no longer has."""
        members = [(key, member) for key, member in self._members.items() if member.joined]
        sent = time.monotonic()
        try:
            replies = await asyncio.wait_for(self._renew(members), limit)
        except (*_UNREACHABLE, asyncio.TimeoutError) as error:
            logger.warning("inturn: could not renew leases in Redis (%s)", error)
            for member_id, member in members:
                if member.grant is None and time.monotonic() >= member.expires:
                    self._lose(member_id, member)  # its place may be gone: tell the waiter
            return
        for (member_id, member), (state, value) in zip(members, replies, strict=True):
            if state == 0:
                self._lose(member_id, member)
                continue
            member.expires = sent + self._lease
            if state == 1:
                self._granted(member_id, int(value))

    async def _renew(self, members: list[tuple[str, _Member]]) -> list[Any]:
        """Call the renew script for each member: pipelined on one server, else together."""
        link = self._link
        if link is not None:
            tail = self._tails[_RENEW_AT]
            calls = [
                link.call(_RENEW_AT, member.packed + _bulk(member_id.encode()) + tail)
                for member_id, member in members
            ]
            return [await call for call in calls]
        renew = self._scripts[_RENEW_AT]
        args = (self._lease_ms, self._ttl_ms, self._channels)
        return list(
            await asyncio.gather(
                *(
                    renew(keys=member.names, args=(member_id, *args))
                    for member_id, member in members
                )
            )
        )

    def _lose(self, member_id: str, member: _Member) -> None:
        """Redis no longer has this member, or could not vouch for it in time."""
        member.lost = True
        if member.grant is None and member.waiting is not None and not member.waiting.done():
            member.waiting.set_exception(
                BackendUnavailable(
                    "inturn: this waiter's place in Redis is gone (Redis lost it, or could not "
                    "be reached for longer than the lease); the work did not run"
                )
            )
        self._members.pop(member_id, None)

    # -- looking at the lines --------------------------------------------------------------

    async def lines(self) -> list[LineInfo]:
        """A snapshot of every line of this namespace in Redis: holder and waiters in order.

        For operators (``python -m inturn inspect``) and tests; the answer
        may be stale by the time it returns. It shows every change this
        backend sent before the call (a release still on its way is waited for).
        """
        link = self._link
        if link is not None and (last := link.last) is not None and not last.done():
            await asyncio.wait((last,))
        try:
            return await self._lines()
        except _UNREACHABLE as error:
            raise BackendUnavailable(f"inturn: Redis could not be reached ({error})") from error

    async def _lines(self) -> list[LineInfo]:
        client = self._client
        seconds, micros = await client.time()
        now = int(seconds) * 1000 + int(micros) // 1000
        found = []
        async for name in client.scan_iter(match=f"inturn:{{{self._namespace}:*}}:line"):
            prefix = _text(name)[: -len("line")]
            line = {_text(k): _text(v) for k, v in (await client.hgetall(prefix + "line")).items()}
            if not line:
                continue  # emptied meanwhile
            waiting = [_text(m) for m in await client.zrange(prefix + "q", 0, -1)]
            scores = await client.zrange(prefix + "lease", 0, -1, withscores=True)
            leases = {_text(m): score for m, score in scores}
            info = {_text(m): _text(v) for m, v in (await client.hgetall(prefix + "info")).items()}

            def about(
                member: str, info: dict[str, str] = info, leases: dict[str, float] = leases
            ) -> tuple[str, int, float, float]:
                host, pid, since = info.get(member, "? 0 0").rsplit(" ", 2)
                left = (leases.get(member, now) - now) / 1000
                return host, int(pid), (now - int(since)) / 1000, left

            holder = None
            if "holder" in line:
                host, pid, _, left = about(line["holder"])
                held_for = (now - int(line["since"])) / 1000
                holder = HolderInfo(host, pid, held_for, int(line["token"]), left)
            waiters = tuple(WaiterInfo(*about(member)) for member in waiting)
            found.append(LineInfo(portable_key(line.get("key", "s:?")), holder, waiters))
        return sorted(found, key=lambda line: line.key)

    def __repr__(self) -> str:
        return f"RedisBackend({self._client!r}, namespace={self._namespace!r})"


def _unavailable(error: BaseException) -> BackendUnavailable:
    return BackendUnavailable(
        f"inturn: Redis could not be reached ({error}); the turn was not taken"
    )


async def _wait(waiting: asyncio.Future[int], deadline: float | None, key: Hashable) -> int:
    """Await the grant's token, or fail with TimeoutError at deadline."""
    if deadline is None:
        return await waiting
    loop = asyncio.get_running_loop()

    def expire() -> None:
        if not waiting.done():
            waiting.set_exception(
                TimeoutError(f"inturn: the turn for key {key!r} was not reached in time")
            )

    timer = loop.call_at(deadline, expire)
    try:
        return await waiting
    finally:
        timer.cancel()
