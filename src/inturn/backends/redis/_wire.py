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
  run at once in the caller, and ``read_response`` in a reader task, when the takeover
  finds redis-py's internals other than it expects (``_takeover``),
  with one warning logged.

Both hand each frame to their listener in the order read, and tell it once
when the connection is gone. What rides on them: ``_link`` (the calls)
and ``_inbox`` (the subscription).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import logging
from collections import deque
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._tasks import abandon_task, abandon_transport
from . import _takeover as takeover
from ._resp import Incomplete, Push, parse

try:  # hiredis 3.2 and later mark a RESP3 push frame (redis-py's parser may hand one over)
    _HiredisPush: type[list[Any]] = getattr(
        importlib.import_module("hiredis"), "PushNotification", Push
    )
except ImportError:  # (no hiredis: redis-py's own parsers hand no push over unasked)
    _HiredisPush = Push

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
    _undecoded(connection)
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


def _undecoded(connection: Any) -> None:
    """Have a connection of the backend's own hand replies over as bytes, before it connects.

    Its client may decode them (``decode_responses=True``), and redis-py's
    hiredis parser (5.0 at least) ignores ``read_response(disable_decoding=True)``:
    the subscription's "message" would be a str, and never heard. A copy of
    the client's encoder that does not decode (public attributes, read by the
    parser as it connects) leaves the client's own as it was.
    """
    encoder = getattr(connection, "encoder", None)
    if encoder is not None and getattr(encoder, "decode_responses", False):
        undecoded = copy.copy(encoder)
        undecoded.decode_responses = False
        connection.encoder = undecoded


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
    """A connection carried through redis-py's public API: written at once, read by one task.

    A write runs redis-py's ``send_packed_command`` at once, in the caller
    (:func:`eagerly`): it blocks only on a full socket buffer (or a closing
    connection), and then a task finishes it and the writes made meanwhile
    queue behind it. So a call is written in the pass of the event loop that
    makes it, as on a taken-over connection; only the reading is a task's.

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
        "_rest",
        "_stopped",
        "_writing",
    )

    def __init__(self, connection: Any, listener: Listener, pushes: bool) -> None:
        loop = asyncio.get_running_loop()
        # NOTE: no socket_timeout on a connection of the backend's own (a public
        # setting; the handshake had it): under one, every write is a task and a
        # timer (wait_for), every read a timer, and an idle subscription would
        # time out. The backend finds a silent peer itself (Link.stale, Inbox.ping).
        connection.socket_timeout = None
        self._connection = connection
        self._listener = listener
        self._pushes = pushes
        self._outgoing: deque[bytes] = deque()  # written after the write that blocked, in order
        self._writing: asyncio.Task[None] | None = None  # finishes a write that blocked
        self._rest: Rest | None = None  # that write's rest, until it is finished
        # NOTE: writes end on this, not only on cancel(): redis-py's
        # send_packed_command may swallow a cancellation (Python 3.10, 3.11)
        self._stopped = False  # the connection is gone, or going
        self._failed: Exception | None = None  # the write that failed first, if one did
        self._reader = loop.create_task(self._read(), name="inturn-redis-read")

    def write(self, data: bytes) -> None:
        if self._stopped:
            return
        if self._writing is not None:
            self._outgoing.append(data)
            return
        try:
            rest = eagerly(self._connection.send_packed_command(data, check_health=False))
        except Exception as error:
            self._write_failed(error)
            return
        if rest is not None:
            self._rest = rest
            writing = self._writing = asyncio.get_running_loop().create_task(
                self._write(rest), name="inturn-redis-write"
            )
            # A task cancelled before its first step (its loop ending: asyncio.run cancels
            # it) never awaits rest: closed here, in the loop, where redis-py's clean-up
            # runs, not by the collector without a loop ("Exception ignored in").
            writing.add_done_callback(rest.closed)

    async def _write(self, rest: Rest) -> None:
        """Finish the write that blocked, then write what queued behind it, in order."""
        outgoing = self._outgoing
        try:
            await rest
            self._rest = None
            while outgoing and not self._stopped:
                data = b"".join(outgoing)
                outgoing.clear()
                await self._connection.send_packed_command(data, check_health=False)
        except Exception as error:
            self._write_failed(error)
        finally:
            self._writing = self._rest = None

    def _write_failed(self, error: Exception) -> None:
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
                        disable_decoding=True, disconnect_on_error=False, push_request=self._pushes
                    )
                except ResponseError as refusal:  # an error reply: the answer to a call
                    got(refusal)
                    continue
                if reply is None and not connection.is_connected:
                    break
                if type(reply) is _HiredisPush:
                    # out of band: redis-py's hiredis parser (5.0 at least) hands it over as a
                    # reply; a Push goes to no call, and to the subscription as any list
                    reply = Push(reply)
                got(reply)
        except asyncio.CancelledError:
            if not self._stopped:
                # not by abort() or close(): the loop is ending (asyncio.run cancels
                # every task), and the session closes with it (see close())
                self._stopped = True
                raise
            error = self._failed or error  # stopped by abort(), close() or a failed write
        except Exception as problem:
            error = problem
        # (a GeneratorExit, when abandoned with its loop and collected, skips all this)
        self._stopped = True
        if self._writing is not None:
            self._writing.cancel()
        with contextlib.suppress(Exception):
            await connection.disconnect(nowait=True)
        self._listener.gone(error)

    def abort(self) -> None:
        self._stopped = True
        self._reader.cancel()

    async def close(self) -> None:
        self.abort()
        writing = self._writing
        await asyncio.wait(
            (self._reader,) if writing is None else (self._reader, writing), timeout=1.0
        )
        with contextlib.suppress(Exception):  # (a reader cancelled by its loop's end did not)
            await self._connection.disconnect(nowait=True)

    def abandon(self) -> None:
        """Close the connection without its event loop, which will never run again."""
        self._stopped = True
        abandon_transport(takeover.writer_transport(self._connection))
        takeover.forget(self._connection)
        abandon_task(self._reader)
        abandon_task(self._writing)
        if self._rest is not None:
            self._rest.close()


def eagerly(coroutine: Coroutine[Any, Any, None]) -> Rest | None:
    """Run coroutine now, until it first blocks: None if it finished, else its rest to await.

    :raises: what the coroutine raised before it blocked.
    """
    try:
        blocked = coroutine.send(None)
    except StopIteration:
        return None
    return Rest(coroutine, blocked)


class Rest:
    """The rest of a coroutine that ran until it blocked on a future: await it to finish it.

    A task that awaits this passes the future on, as if it had awaited the
    coroutine from its start, and resumes the coroutine (or throws into it)
    as the future answers.
    """

    __slots__ = ("_blocked", "_coroutine")

    def __init__(self, coroutine: Coroutine[Any, Any, None], blocked: Any) -> None:
        self._coroutine = coroutine
        self._blocked = blocked  # what it yielded to its task: the future it waits for

    def __await__(self) -> Generator[Any, None, None]:
        coroutine, blocked = self._coroutine, self._blocked
        while True:
            try:
                yield blocked
            except GeneratorExit:  # (the awaiting task is closed unfinished)
                self.close()
                raise
            except BaseException as error:  # (a cancellation, thrown in by the task)
                try:
                    blocked = coroutine.throw(error)
                except StopIteration:
                    return
            else:
                try:
                    blocked = coroutine.send(None)
                except StopIteration:
                    return

    def closed(self, _: object = None) -> None:
        """close(), as a done callback (of the task that was to finish it): a no-op once the
        coroutine ended."""
        self.close()

    def close(self) -> None:
        """End the coroutine where it waits, without its event loop (gone, or going).

        redis-py cleans up after a write it never finished by awaiting a
        disconnect, which needs the loop: that fails here, and is let go (the
        carrier closes the connection itself), rather than left to the
        coroutine's collection, which would log it.
        """
        with contextlib.suppress(BaseException):
            self._coroutine.close()


def fail(future: asyncio.Future[Any] | None, error: BaseException) -> None:
    """Fail future with error, unless it is done (or None)."""
    if future is not None and not future.done():
        future.set_exception(error)
