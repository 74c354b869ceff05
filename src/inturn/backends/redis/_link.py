"""The Link: one connection that carries this process's script calls to Redis, in the order made.

Each call is written the moment it is made (pipelining) and its reply handed
to its future as it is read; the connection itself is carried by
``_wire`` (taken over, or through redis-py's public API).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from redis.exceptions import NoScriptError, ResponseError

from ..._errors import BackendUnavailable
from ..._tasks import abandon_task
from ._errors import demoted
from ._resp import Push, command
from ._scripts import HEADS, HELLO, SCRIPTS, Script
from ._wire import Carrier, connect, fail

logger = logging.getLogger("inturn.redis")


#: Loads every script: sent first on every connection (its replies go to no call).
_LOADS = b"".join(command(b"SCRIPT", b"LOAD", s.body) for s in SCRIPTS)


class Call:
    """One command on a Link: its reply's future, and when it was written (monotonic)."""

    __slots__ = ("future", "rest", "script", "sent")

    def __init__(self, script: int, rest: bytes, future: asyncio.Future[Any]) -> None:
        #: The script's number (its head in HEADS), or -1 for a plain command in rest.
        self.script = script
        self.rest = rest
        self.future = future
        #: time.monotonic() when it was written; None until then.
        self.sent: float | None = None

    def packed(self) -> bytes:
        return self.rest if self.script < 0 else HEADS[self.script] + self.rest


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
        self._carrier: Carrier | None = None
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
            carrier.write(call.rest if script < 0 else HEADS[script] + call.rest)
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
            carrier = await connect(self._make, self, self._limit, False)
        except Exception as error:
            self._connecting = None
            if self._broken:
                logger.debug("inturn: could not connect to Redis again: %s", error)
            fail(greeting, error)
            outbox = self._outbox
            while outbox:
                fail(outbox.popleft().future, error)
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
                fail(call.future, reply)
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
                fail(call.future, error)

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
                fail(call.future, error)
        if self.greeting is not None:
            fail(self.greeting, error)
        self._sent.clear()
        self._outbox.clear()
        carrier, self._carrier = self._carrier, None
        if carrier is not None:
            await carrier.close()
