"""How this process carries its own connections to Redis (for the Link and the Inbox).

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
  finds redis-py's internals other than it expects (``_takeover``),
  with one warning logged.

Both hand each frame to their listener in the order read, and tell it once
when the connection is gone. What rides on them: ``_link`` (the calls)
and ``_inbox`` (the subscription).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._tasks import abandon_task, abandon_transport
from . import _takeover as takeover
from ._resp import Incomplete, parse

logger = logging.getLogger("inturn.redis")


class Listener(Protocol):
    """What a carrier hands its frames to."""

    def got(self, reply: Any) -> None: ...
    def gone(self, error: BaseException) -> None: ...


class Carrier(Protocol):
    """One connection, carried: written, aborted, closed or abandoned."""

    def write(self, data: bytes) -> None: ...
    def abort(self) -> None: ...
    async def close(self) -> None: ...
    def abandon(self) -> None: ...


#: Whether the warning that the takeover is off has been logged (once per process).
_warned = False


async def connect(
    make: Callable[[], Any], listener: Listener, limit: float, pushes: bool
) -> Carrier:
    """Open a connection made by redis-py, within limit seconds; carry it for listener.

    ``pushes``: the listener wants RESP3 push frames (a subscription does).
    """
    connection = make()
    takeover.retrieve_close(connection)  # (should a stream of it end with an error: see there)
    failed: BaseException | None
    try:
        failed = await asyncio.wait_for(_opened(connection), limit)
    except BaseException as error:  # (the time ran out, or cancelled)
        failed = error
    if failed is not None:
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        if isinstance(failed, asyncio.TimeoutError):
            raise RedisTimeoutError(
                f"Redis did not answer within {limit:g} s while connecting"
            ) from None
        raise failed
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


async def _opened(connection: Any) -> Exception | None:
    """Connect; return (not raise) the error it failed with.

    On Python 3.11 and earlier, ``wait_for`` runs this in a task of its own,
    and when it is cancelled (the backend closed while connecting) it
    waits for that task but never retrieves its error: redis-py's
    connecting may turn the cancellation into a ConnectionError, which would
    be logged as never retrieved.
    """
    try:
        await connection.connect()
    except Exception as error:
        return error
    return None


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

    def __init__(self, connection: Any, transport: asyncio.Transport, listener: Listener) -> None:
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
        "_failed",
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

    def __init__(self, connection: Any, listener: Listener, pushes: bool) -> None:
        loop = asyncio.get_running_loop()
        self._connection = connection
        self._listener = listener
        self._pushes = pushes
        self._outgoing: deque[bytes] = deque()
        self._wake = asyncio.Event()
        # NOTE: the writer ends on this, not only on cancel(): redis-py's
        # send_packed_command may swallow a cancellation (Python 3.10, 3.11)
        self._stopped = False  # the connection is gone, or going
        self._failed: Exception | None = None  # the write that failed first, if one did
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
        except Exception as error:
            logger.debug("inturn: writing to Redis failed: %s", error)
            if not self._stopped:  # the reader has not seen the end yet: stop it, it tells
                self._stopped = True
                self._failed = error
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
            error = self._failed or error  # stopped by abort(), close() or a failed write
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


def fail(future: asyncio.Future[Any] | None, error: BaseException) -> None:
    """Fail future with error, unless it is done (or None)."""
    if future is not None and not future.done():
        future.set_exception(error)
