"""This process's own connections to Redis: the Link that carries its script calls, the Inbox.

Both ride connections that redis-py opens and sets up (TLS, AUTH, HELLO,
SELECT: ``pool.make_connection()``), never one of the client's pooled
connections, so a backend shares nothing with its client's other users, and
a forked child or another event loop simply opens its own.

A connection is then carried one of two ways (a *carrier*):

- taken over (:class:`_TakenOver`): this process writes the transport and
  parses the replies itself (``_resp``), in the event loop's own callbacks,
  so a reply costs one pass of the loop and no task wakes up for it;
- through redis-py's public API (:class:`_Public`): ``send_packed_command``
  and ``read_response`` in a writer and a reader task, when the takeover
  finds redis-py's internals other than it expects (``_redis_takeover``),
  with one warning logged.

Both hand each frame to their listener in the order read, and tell it once
when the connection is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .._errors import BackendUnavailable
from .._tasks import abandon_task, abandon_transport
from . import _redis_takeover as takeover
from ._redis_errors import demoted
from ._redis_scripts import HELLO, SCRIPTS, Script
from ._resp import Incomplete, Push, bulk, command, parse

__all__ = ("Call", "Frames", "Inbox", "Link")

logger = logging.getLogger("inturn.redis")


class _Listener(Protocol):
    def got(self, reply: Any) -> None: ...
    def gone(self, error: BaseException) -> None: ...


class _Carrier(Protocol):
    def write(self, data: bytes) -> None: ...
    def abort(self) -> None: ...
    async def close(self) -> None: ...
    def abandon(self) -> None: ...


#: Whether the warning that the takeover is off has been logged (once per process).
_warned = False


async def _connect(
    make: Callable[[], Any], listener: _Listener, limit: float, pushes: bool
) -> _Carrier:
    """Open a connection made by redis-py, within limit seconds; carry it for listener.

    ``pushes``: the listener wants RESP3 push frames (a subscription does).
    """
    connection = make()
    try:
        await asyncio.wait_for(connection.connect(), limit)
    except BaseException as error:
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        if isinstance(error, asyncio.TimeoutError):
            raise RedisTimeoutError(
                f"Redis did not answer within {limit:g} s while connecting"
            ) from None
        raise
    if takeover.ENABLED:
        try:
            transport = takeover.transport_of(connection)
        except RedisConnectionError:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)
            raise
        if not isinstance(transport, str):
            return _TakenOver(connection, transport, listener)
        global _warned
        if not _warned:
            _warned = True
            logger.warning(
                "inturn: cannot take over redis-py's connections (%s); using its public "
                "API, which is slower",
                transport,
            )
    return _Public(connection, listener, pushes)


def _lost(exc: BaseException | None) -> RedisConnectionError:
    return RedisConnectionError(
        f"Redis connection lost ({exc})" if exc else "Redis closed the connection"
    )


class Frames:
    """Whole RESP frames out of a stream of bytes, each handed to ``got`` as soon as it is whole."""

    __slots__ = ("_buffer", "_got")

    def __init__(self, got: Callable[[Any], None]) -> None:
        self._got = got
        self._buffer = bytearray()  # the start of a frame not yet whole

    def feed(self, data: bytes) -> None:
        """Take data; hand over every frame it completes, in order.

        :raises ValueError: the bytes are not RESP (the rest is dropped).
        """
        buffer = self._buffer
        buffer += data
        at = 0
        got = self._got
        try:
            while at < len(buffer):
                reply, at = parse(buffer, at)
                got(reply)
        except Incomplete:
            pass
        except ValueError:
            buffer.clear()
            raise
        del buffer[:at]

    def __len__(self) -> int:
        """Bytes held of a frame not yet whole."""
        return len(self._buffer)


class _TakenOver(asyncio.Protocol):
    """A connection whose transport this process reads and writes itself."""

    __slots__ = ("_closed", "_connection", "_frames", "_listener", "_transport")

    def __init__(self, connection: Any, transport: asyncio.Transport, listener: _Listener) -> None:
        self._connection = connection
        self._listener = listener
        self._frames = Frames(listener.got)
        self._closed = asyncio.get_running_loop().create_future()  # done once it is
        self._transport: asyncio.Transport | None = transport
        transport.set_protocol(self)

    def write(self, data: bytes) -> None:
        if self._transport is not None:
            self._transport.write(data)

    def data_received(self, data: bytes) -> None:
        try:
            self._frames.feed(data)
        except ValueError as error:  # not Redis: drop the connection
            logger.warning(
                "inturn: Redis sent what is not RESP (%s); dropping the connection", error
            )
            self.abort()

    def eof_received(self) -> None:
        return None  # the transport closes, and connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        takeover.forget(self._connection)
        self._transport = None
        if not self._closed.done():
            self._closed.set_result(None)
        self._listener.gone(_lost(exc))

    def abort(self) -> None:
        if self._transport is not None:
            self._transport.abort()  # connection_lost follows, in a later pass of the loop

    async def close(self) -> None:
        """Close the connection and wait (a second at most) until it is."""
        if self._transport is not None:
            self._transport.close()
        await asyncio.wait((self._closed,), timeout=1.0)

    def abandon(self) -> None:
        """Close the connection without its event loop, which will never run again."""
        transport, self._transport = self._transport, None
        abandon_transport(transport)
        takeover.forget(self._connection)


class _Public:
    """A connection carried through redis-py's public API: a writer and a reader task.

    ``pushes``: hand RESP3 push frames to the listener (a subscription's
    messages are pushes); else redis-py deals with them and they never reach it.
    """

    __slots__ = (
        "_connection",
        "_listener",
        "_outgoing",
        "_pushes",
        "_reader",
        "_stopped",
        "_wake",
        "_writer",
    )

    #: Seconds a read waits before it looks again (so no socket_timeout ends an idle connection).
    POLL = 3600.0

    def __init__(self, connection: Any, listener: _Listener, pushes: bool) -> None:
        loop = asyncio.get_running_loop()
        self._connection = connection
        self._listener = listener
        self._pushes = pushes
        self._outgoing: deque[bytes] = deque()
        self._wake = asyncio.Event()
        # NOTE: the writer ends on this, not only on cancel(): redis-py's
        # send_packed_command may swallow a cancellation (Python 3.10, 3.11)
        self._stopped = False  # the connection is gone, or going
        self._reader = loop.create_task(self._read(), name="inturn-redis-read")
        self._writer = loop.create_task(self._write(), name="inturn-redis-write")

    def write(self, data: bytes) -> None:
        self._outgoing.append(data)
        self._wake.set()

    async def _write(self) -> None:
        outgoing, wake = self._outgoing, self._wake
        try:
            while not self._stopped:
                await wake.wait()
                wake.clear()
                while outgoing and not self._stopped:
                    data = b"".join(outgoing)
                    outgoing.clear()
                    await self._connection.send_packed_command(data, check_health=False)
        except Exception as error:  # the reader sees the connection go too
            logger.debug("inturn: writing to Redis failed: %s", error)
            self._reader.cancel()

    async def _read(self) -> None:
        connection, got = self._connection, self._listener.got
        error: BaseException = _lost(None)
        try:
            while True:
                try:
                    # raw bytes, as this process's own parser gives (decode_responses aside)
                    reply = await connection.read_response(
                        disable_decoding=True,
                        timeout=self.POLL,
                        disconnect_on_error=False,
                        push_request=self._pushes,
                    )
                except ResponseError as refusal:  # an error reply: the answer to a call
                    got(refusal)
                    continue
                if reply is None and not connection.is_connected:
                    break
                got(reply)
        except asyncio.CancelledError:
            if not self._stopped:
                # not by abort() or close(): the loop is ending (asyncio.run cancels
                # every task), and the session closes with it (see close()); the
                # writer ends too, even if redis-py swallowed its own cancellation
                self._stopped = True
                self._wake.set()
                raise
        except Exception as problem:
            error = problem
        # (a GeneratorExit, when abandoned with its loop and collected, skips all this)
        self._stopped = True
        self._wake.set()
        self._writer.cancel()
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        self._listener.gone(error)

    def abort(self) -> None:
        self._stopped = True
        self._reader.cancel()

    async def close(self) -> None:
        self.abort()
        await asyncio.wait((self._reader, self._writer), timeout=1.0)
        with contextlib.suppress(Exception):  # (a reader cancelled by its loop's end did not)
            await self._connection.disconnect(nowait=True)

    def abandon(self) -> None:
        """Close the connection without its event loop, which will never run again."""
        self._stopped = True
        abandon_transport(takeover.writer_transport(self._connection))
        takeover.forget(self._connection)
        abandon_task(self._reader)
        abandon_task(self._writer)


# -- the Link --------------------------------------------------------------------------


def _heads(verb: bytes, script: Script) -> bytes:
    """A script call's command up to its keys: the verb, the SHA or body, the count of keys."""
    name = script.sha if verb == b"EVALSHA" else script.body
    return (
        b"*%d\r\n" % (3 + script.keys + script.args)
        + bulk(verb)
        + bulk(name)
        + bulk(b"%d" % script.keys)
    )


#: By script number: its call by SHA; then (number + len(SCRIPTS)) with its body.
_HEADS = tuple(_heads(b"EVALSHA", s) for s in SCRIPTS) + tuple(_heads(b"EVAL", s) for s in SCRIPTS)
#: Loads every script: sent first on every connection (its replies go to no call).
_LOADS = b"".join(command(b"SCRIPT", b"LOAD", s.body) for s in SCRIPTS)


class Call:
    """One command on a Link: its reply's future, and when it was written (monotonic)."""

    __slots__ = ("future", "rest", "script", "sent")

    def __init__(self, script: int, rest: bytes, future: asyncio.Future[Any]) -> None:
        #: The script's number (its head in _HEADS), or -1 for a plain command in rest.
        self.script = script
        self.rest = rest
        self.future = future
        #: time.monotonic() when it was written; None until then.
        self.sent: float | None = None

    def packed(self) -> bytes:
        return self.rest if self.script < 0 else _HEADS[self.script] + self.rest


class Link:
    """One connection that carries this process's calls to Redis, in the order made.

    Redis runs the commands of one connection in the order they arrive, so a
    call made after another (a re-acquire after a release, a leave after an
    enqueue) runs after it, even while the first one's reply is still on its
    way back. So each call is written the moment it is made, without waiting
    for earlier replies (pipelining), and each reply is handed to its call's
    future as it is read, in the same order. Push frames are no call's reply.

    If the connection drops, the calls in flight fail with its error (whether
    they ran is unknown), and the next call connects anew; calls made while
    it connects are written, in order, once it has. Each connection first
    loads the scripts and sends the greeting (the HELLO script), whose reply
    goes to ``greeted``; a call that finds its script gone (``SCRIPT
    FLUSH``) is sent again with the body, and since every later call on the
    connection failed the same way, the calls run again in the order made.
    """

    __slots__ = (
        "_broken",
        "_carrier",
        "_closed",
        "_connecting",
        "_dropped",
        "_greeted",
        "_greeting",
        "_limit",
        "_make",
        "_outbox",
        "_sent",
        "greeting",
        "last",
    )

    def __init__(
        self,
        make: Callable[[], Any],
        greeting: bytes,
        greeted: Callable[[asyncio.Future[Any]], None],
        limit: float,
    ) -> None:
        self._make = make
        self._greeting = greeting  # the HELLO script's packed keys and arguments
        self._greeted = greeted
        self._limit = limit  # seconds a connection may take to open
        self._carrier: _Carrier | None = None
        # NOTE: a call is in one of these two until its reply (or failure) is
        # handed over. Calls made while connecting, in the order made:
        self._outbox: deque[Call] = deque()
        # calls written on the current connection, in the order their replies
        # come (None: a reply nobody waits for, a SCRIPT LOAD's):
        self._sent: deque[Call | None] = deque()
        self._connecting: asyncio.Task[None] | None = None
        self._closed = False
        # For the log: the connection was lost, or dropped, and is not back yet
        self._broken = False
        self._dropped = False  # dropped by this process, which said why
        #: The current (or next) connection's greeting: done once it is answered.
        self.greeting: asyncio.Future[Any] | None = None
        #: The future of the latest call: once it is done, so is every earlier one.
        self.last: asyncio.Future[Any] | None = None

    def call(self, script: Script, rest: bytes) -> Call:
        """Call a script with rest (its keys and arguments, packed).

        It runs after every call made before it, whatever becomes of the caller.
        """
        return self._send(Call(script.index, rest, asyncio.get_running_loop().create_future()))

    def command(self, *parts: bytes) -> Call:
        """Send a plain command, after every call made before it."""
        return self._send(Call(-1, command(*parts), asyncio.get_running_loop().create_future()))

    def _send(self, call: Call) -> Call:
        self.last = call.future
        if self._closed:
            call.future.set_exception(BackendUnavailable("inturn: the backend was closed"))
            return call
        carrier = self._carrier
        if carrier is not None:  # (then the outbox is empty: see _connect)
            self._sent.append(call)
            call.sent = time.monotonic()
            script = call.script  # (call.packed(), inlined: this is every turn's path)
            carrier.write(call.rest if script < 0 else _HEADS[script] + call.rest)
        else:
            self._outbox.append(call)
            self.open()
        return call

    def open(self) -> asyncio.Future[Any]:
        """Connect unless connected or connecting; return the connection's greeting."""
        if self._carrier is None and self._connecting is None:
            loop = asyncio.get_running_loop()
            self.greeting = loop.create_future()
            self.greeting.add_done_callback(self._greeted)
            self._connecting = loop.create_task(self._connect(), name="inturn-redis-link")
        assert self.greeting is not None
        return self.greeting

    async def _connect(self) -> None:
        """Connect; write the greeting and the calls made meanwhile (or fail them all)."""
        greeting = self.greeting
        assert greeting is not None
        try:
            carrier = await _connect(self._make, self, self._limit, False)
        except Exception as error:
            self._connecting = None
            if self._broken:
                logger.debug("inturn: could not connect to Redis again: %s", error)
            _fail(greeting, error)
            outbox = self._outbox
            while outbox:
                _fail(outbox.popleft().future, error)
            return
        self._connecting = None
        self._carrier = carrier
        if self._broken:
            self._broken = False
            logger.info("inturn: connected to Redis again")
        hello = Call(HELLO.index, self._greeting, greeting)
        sent: deque[Call | None] = deque([None] * len(SCRIPTS))
        sent.append(hello)
        batch = [_LOADS, hello.packed()]
        now = time.monotonic()
        outbox = self._outbox
        while outbox:
            call = outbox.popleft()
            call.sent = now
            sent.append(call)
            batch.append(call.packed())
        self._sent = sent
        carrier.write(b"".join(batch))

    def got(self, reply: Any) -> None:
        if type(reply) is Push:
            return  # out of band: a notification, never a call's reply
        call = self._sent.popleft()
        if call is None:
            return
        if isinstance(reply, ResponseError):
            script = call.script
            if 0 <= script < len(SCRIPTS) and (
                isinstance(reply, NoScriptError) or str(reply).startswith("NOSCRIPT")
            ):
                # SCRIPT FLUSH: send it again, with the body (which loads the script)
                carrier = self._carrier
                assert carrier is not None
                call.script = script + len(SCRIPTS)
                self._sent.append(call)
                carrier.write(call.packed())
            else:
                _fail(call.future, reply)
                if demoted(reply) and self._carrier is not None:
                    # reconnect: to the master, wherever it is now
                    self._drop(f"Redis answered {reply} (a failover?)")
        elif not call.future.done():
            call.future.set_result(reply)

    def gone(self, error: BaseException) -> None:
        self._carrier = None
        sent, self._sent = self._sent, deque()
        if not self._closed:
            if not self._dropped:
                logger.warning(
                    "inturn: lost the connection to Redis (%s); the next call connects again",
                    error,
                )
            self._dropped = False
            self._broken = True
        for call in sent:
            if call is not None:
                _fail(call.future, error)

    def drop(self, why: str) -> None:
        """Drop the connection (the calls on it fail), logging why; the next call connects anew."""
        if self._carrier is not None:
            self._drop(why)

    def _drop(self, why: str) -> None:
        assert self._carrier is not None
        logger.warning("inturn: %s; dropping the connection to Redis, and connecting again", why)
        self._dropped = True
        self._carrier.abort()  # gone() follows

    def abandon(self) -> None:
        """Close the connection without its event loop, which will never run again."""
        self._closed = True
        abandon_task(self._connecting)
        carrier, self._carrier = self._carrier, None
        if carrier is not None:
            carrier.abandon()

    def stale(self, limit: float) -> bool:
        """Drop the connection if its oldest unanswered call was written over limit s ago.

        A connection whose peer vanished (a partition, a host that died)
        stays open for minutes; the calls after it need a new one.
        """
        for call in self._sent:
            if call is not None:
                if call.sent is not None and time.monotonic() - call.sent > limit:
                    self._drop(f"no reply from Redis within {limit:g} s")
                    return True
                break
        return False

    async def aclose(self) -> None:
        """Close the connection; calls not answered yet, and every later call, fail."""
        self._closed = True
        connecting, self._connecting = self._connecting, None
        if connecting is not None:
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
        error = BackendUnavailable("inturn: the backend was closed")
        for call in (*self._sent, *self._outbox):
            if call is not None:
                _fail(call.future, error)
        if self.greeting is not None:
            _fail(self.greeting, error)
        self._sent.clear()
        self._outbox.clear()
        carrier, self._carrier = self._carrier, None
        if carrier is not None:
            await carrier.close()


def _fail(future: asyncio.Future[Any] | None, error: BaseException) -> None:
    if future is not None and not future.done():
        future.set_exception(error)


# -- the Inbox ---------------------------------------------------------------------------


class Inbox:
    """This process's subscription: a grant published to its channel wakes its waiter at once.

    One connection of its own, subscribed to the process's channel; each
    message is handed over as it is read. When the connection drops, it is
    opened again after a pause; ``subscribed`` is called on every
    subscription Redis confirms, so that the heartbeat catches up on grants
    published while there was none. :meth:`ping` finds a connection whose
    peer vanished, which no error would ever tell.
    """

    __slots__ = (
        "_carrier",
        "_closing",
        "_command",
        "_confirmed",
        "_limit",
        "_make",
        "_opening",
        "_pause",
        "_pinged",
        "_reopening",
        "_silent",
        "_subscribed",
        "heard",
        "heard_at",
    )

    def __init__(
        self,
        make: Callable[[], Any],
        channel: str,
        heard: Callable[[bytes], None],
        subscribed: Callable[[], None],
        pause: float,
        limit: float,
    ) -> None:
        self._make = make
        self._command = command(b"SUBSCRIBE", channel.encode())
        #: Called with each message's data (tests replace it to stop hearing grants).
        self.heard = heard
        self._subscribed = subscribed
        self._pause = pause
        self._limit = limit  # seconds to connect and subscribe, and for a ping's answer
        self._carrier: _Carrier | None = None
        self._confirmed: asyncio.Future[None] | None = None
        self._reopening: asyncio.Task[None] | None = None
        self._closing = False
        self._opening = False  # open() is under way: it deals with a connection lost meanwhile
        self._pinged: float | None = None  # monotonic time of the oldest unanswered ping
        self._silent = False  # dropped by ping(): the connection said nothing for too long
        #: time.monotonic() when the connection last said anything.
        self.heard_at = 0.0

    async def open(self) -> None:
        """Connect and subscribe; return once Redis confirmed (a grant published before is lost).

        :raises ResponseError: Redis refused the subscription (a missing permission).
        :raises ConnectionError, TimeoutError: Redis did not confirm within the limit.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._limit
        self._opening = True
        try:
            carrier = await _connect(self._make, self, self._limit, True)
            confirmed = self._confirmed = loop.create_future()
            self._carrier = carrier
            self._pinged = None
            self.heard_at = time.monotonic()
            carrier.write(self._command)
            try:
                await asyncio.wait_for(confirmed, max(0.0, deadline - loop.time()))
            except BaseException as error:
                if self._carrier is carrier:  # refused, or cancelled: not dropped
                    self._carrier = None
                    await carrier.close()
                if isinstance(error, asyncio.TimeoutError):
                    raise RedisTimeoutError(
                        f"Redis did not confirm the subscription within {self._limit:g} s"
                    ) from None
                raise
        finally:
            self._opening = False

    def got(self, reply: Any) -> None:
        self.heard_at = time.monotonic()
        self._pinged = None
        if isinstance(reply, list) and len(reply) == 3:
            kind = reply[0]
            if kind == b"message":
                self.heard(reply[2])
            elif kind == b"subscribe":
                confirmed = self._confirmed
                if confirmed is not None and not confirmed.done():
                    confirmed.set_result(None)
                self._subscribed()
        elif isinstance(reply, ResponseError):
            confirmed = self._confirmed
            if confirmed is not None and not confirmed.done():
                confirmed.set_exception(reply)  # the subscription was refused
            else:
                logger.debug("inturn: the subscription's connection said %s", reply)

    def gone(self, error: BaseException) -> None:
        self._carrier = None
        _fail(self._confirmed, error)
        silent, self._silent = self._silent, False
        if self._closing or self._opening or self._reopening is not None:
            return
        logger.warning(
            "inturn: Redis subscription interrupted (%s); reconnecting",
            f"it said nothing for {self._limit:g} s" if silent else error,
        )
        self._subscribed()  # the heartbeat catches up on grants missed meanwhile
        self._reopening = asyncio.get_running_loop().create_task(
            self._reopen(), name="inturn-redis-inbox"
        )

    async def _reopen(self) -> None:
        """Subscribe again, after a pause that doubles (up to the limit) while it fails."""
        pause = self._pause
        failed = False
        try:
            while not self._closing:
                await asyncio.sleep(pause)
                try:
                    await self.open()
                except Exception as error:
                    (logger.debug if failed else logger.warning)(
                        "inturn: Redis subscription still down (%s); trying again", error
                    )
                    failed = True
                    pause = min(pause * 2, self._limit)
                else:
                    logger.info("inturn: Redis subscription back")
                    return
        finally:
            self._reopening = None

    def ping(self) -> None:
        """Ask the connection for a sign of life; drop it if the last ask went unanswered.

        Called by the heartbeat: a connection silent for longer than the
        limit since a ping is dropped, and opened again.
        """
        carrier = self._carrier
        if carrier is None:
            return
        now = time.monotonic()
        if self._pinged is None:
            self._pinged = now
            carrier.write(b"*1\r\n$4\r\nPING\r\n")
        elif now - self._pinged > self._limit:
            self._silent = True  # gone() says so
            carrier.abort()

    def abandon(self) -> None:
        """Close the connection without its event loop, which will never run again."""
        self._closing = True
        abandon_task(self._reopening)
        carrier, self._carrier = self._carrier, None
        if carrier is not None:
            carrier.abandon()

    async def aclose(self) -> None:
        """Unsubscribe for good: close the connection, stop reopening it."""
        self._closing = True
        reopening = self._reopening
        if reopening is not None:
            reopening.cancel()
            with contextlib.suppress(BaseException):
                await reopening
        carrier, self._carrier = self._carrier, None
        if carrier is not None:
            await carrier.close()
