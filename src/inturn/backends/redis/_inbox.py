"""The Inbox: this process's subscription to its channel, where Redis publishes its grants.

Its connection is carried by ``_wire`` (taken over, or through
redis-py's public API), as the Link's is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._tasks import abandon_task
from ._resp import command
from ._wire import Carrier, connect, fail

logger = logging.getLogger("inturn.redis")


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
        self._carrier: Carrier | None = None
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
            carrier = await connect(self._make, self, self._limit, True)
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
        fail(self._confirmed, error)
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
