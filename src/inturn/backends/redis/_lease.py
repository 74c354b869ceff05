"""The lease keeper: one loop share's members of Redis's lines, and the heartbeat that renews them.

Each member (a waiter, then a holder) has a lease in Redis, which the
heartbeat renews every ``lease / 3`` seconds (sooner when kicked: a lost
subscription, another server). A renewal's reply also hands a waiter a grant
whose message was lost, and tells a holder that its lease is gone.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Protocol

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._describe import describe as show
from ..._errors import BackendUnavailable
from ..._tasks import retrieve
from ._errors import describe
from ._link import Call
from ._scripts import Line

#: What this backend logs: only what is rare (connections lost and back, leases that
#: could not be renewed or were lost), never a turn that went as it should.
logger = logging.getLogger("inturn.redis")

#: Keys a log line names at most (then how many more).
_NAMED = 5


def _named(members: Iterable[Member]) -> str:
    """The keys of members for a log line, as their users gave them: a few, then how many more."""
    keys = [show(member.key) for member in members]
    if not keys:
        return "none"
    more = len(keys) - _NAMED
    return ", ".join(keys[:_NAMED]) + (f" and {more} more" if more > 0 else "")


class Waiting(Protocol):
    """What a waiter's grant is handed to, on its share's loop: a task's Future, or what a
    thread blocks on (``_bridge.Answer``)."""

    def done(self) -> bool: ...
    def set_result(self, token: Any) -> None: ...
    def set_exception(self, error: BaseException) -> None: ...


class Member:
    """One of this share's members of a line: a waiter, then a holder.

    A thread's member (see ``_threads``) is added and removed by the
    thread; everything else about it happens on the share's loop, which
    reads ``members`` in one call (a copy) wherever it could meet a thread's change.
    """

    __slots__ = (
        "called",
        "expires",
        "given",
        "held",
        "joined",
        "key",
        "lost",
        "names",
        "packed",
        "ran",
        "token",
        "waiting",
    )

    def __init__(self, key: Hashable, line: Line, waiting: Waiting | None) -> None:
        self.key = key
        self.names = line.names  # its line's Redis keys
        self.packed = line.packed  # they, as a script call's keys, packed for the Link
        self.given = line.given  # the key as given, packed
        # time.monotonic() when its lease runs out as far as this process can
        # vouch: a lease after the call that last set it in Redis was written
        # (Redis's own expiry is no earlier)
        self.expires = math.inf
        self.waiting = waiting  # resolved with the token when granted
        self.held = False  # granted: a holder now
        # Redis may have given its turn away: it dropped it, the server changed,
        # or no renewal came in time
        self.lost = False
        # Its enqueue was answered: only then does a renewal that finds it gone
        # mean it is gone (on a cluster, a renewal may overtake the enqueue).
        self.joined = False
        # The token of the grant it was handed last (0: none yet): a grant's message or
        # a renewal's reply that comes after it joined the line again (latest work)
        # names that grant, never a new one.
        self.token = 0
        # Latest work shared across processes (see _latest): when its process's newest
        # work was called as it posted last (time.monotonic_ns()), and what ran in its
        # turn, (called, ok), for its release to record. None: not latest work.
        self.called: int | None = None
        self.ran: tuple[int, bool] | None = None

    @property
    def lapsed(self) -> bool:
        """Whether the lease ran out, or may have."""
        return self.lost or time.monotonic() >= self.expires


class Leases:
    """One loop share's members of Redis's lines, and the heartbeat that renews their leases."""

    __slots__ = ("_failing", "_kick", "_loop", "_renew", "_tend", "beat", "lease", "members")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        lease: float,
        renew: Callable[[Member, str], Call],
        tend: Callable[[], None],
    ) -> None:
        self._loop = loop
        self.lease = lease
        self._renew = renew  # calls the renew script for a member
        self._tend = tend  # drops the share's connections that went silent (each round, first)
        #: By member id ("<share id>/<n>"): every member in a line now.
        self.members: dict[str, Member] = {}
        #: The heartbeat, once started.
        self.beat: asyncio.Task[None] | None = None
        self._kick = _Kick(loop)
        self._failing: str | None = None  # why renewals fail now, once logged

    def run(self) -> None:
        """Start the heartbeat, unless it runs."""
        if self.beat is None or self.beat.done():
            self.beat = self._loop.create_task(self._heartbeat(), name="inturn-redis-heartbeat")

    def kick(self) -> None:
        """Renew at once, not at the next beat."""
        self._kick.set()

    def granted(self, member_id: str, token: int) -> None:
        """Hand a waiter its grant's token (from the grant's message, or a renewal)."""
        member = self.members.get(member_id)
        if member is None or token <= member.token:
            return  # (a grant it had before it joined again: see Member.token)
        if member.waiting is not None and not member.waiting.done():
            member.waiting.set_result(token)

    def another_server(self, server: str, was: str) -> None:
        """Redis is another server (restarted or failed over): the turns held count as lost.

        What the old server granted may be gone; server and was are the run_ids.
        """
        held = [member for member in list(self.members.values()) if member.held]
        logger.warning(
            "inturn: Redis is another server now (run_id %s, was %s); the %d turn(s) "
            "held count as having lost their lease: keys %s",
            server,
            was,
            len(held),
            _named(held),
        )
        for member in held:
            member.lost = True
        self._kick.set()  # renew at once: waiters learn whether their places survived

    async def _heartbeat(self) -> None:
        """Renew every lease every lease / 3 seconds (sooner when kicked).

        It never ends while its share is open: a renewal that fails (Redis
        unreachable, busy, refusing) is logged once, and tried again.
        """
        lease = self.lease
        interval = lease / 3
        failed = 0  # renewal rounds that failed in a row
        while True:
            # after a failed round, again soon: a pause that doubles up to the interval
            await self._kick.wait(min(interval, lease / 48 * 2**failed) if failed else interval)
            try:
                self._tend()
                if self.members:
                    await self._renew_all(interval)
            except Exception:  # pragma: no cover - a bug: say so, and keep renewing
                logger.exception("inturn: the Redis heartbeat failed; it goes on")
            failed = 0 if self._failing is None else failed + 1

    async def _renew_all(self, limit: float) -> None:
        """Renew every member's lease; hand out grants, and mark what Redis no longer has."""
        members = [(key, member) for key, member in list(self.members.items()) if member.joined]
        calls = [self._renew(member, member_id) for member_id, member in members]
        futures = [call.future for call in calls]
        if not futures:
            return
        for future in futures:  # (whatever becomes of this wait: the heartbeat may be cancelled)
            future.add_done_callback(retrieve)
        done, _ = await asyncio.wait(futures, timeout=limit)
        problem: BaseException | None = None
        now = time.monotonic()
        for (member_id, member), call in zip(members, calls, strict=True):
            if self.members.get(member_id) is not member:
                continue  # released meanwhile (a thread's leave may overtake this renewal)
            future = call.future
            error: BaseException | None
            if future not in done:
                error = RedisTimeoutError(f"no answer within {limit:.3g} s")
            elif future.cancelled():
                error = RedisConnectionError("the renewal was cancelled")
            else:
                error = future.exception()
            if error is None:
                state, value = future.result()
                if state == 0:
                    self._lose(member_id, member, _GONE)
                    continue
                assert call.sent is not None
                member.expires = call.sent + self.lease
                if state == 1:
                    self.granted(member_id, int(value))
            else:
                problem = error
                if now >= member.expires:
                    self._lose(member_id, member, f"{describe(error)}, for longer than the lease")
        self._report(problem)

    def _report(self, problem: BaseException | None) -> None:
        """Log when renewals start failing (once, with why) and when they work again."""
        if problem is None:
            if self._failing is not None:
                logger.info("inturn: leases renew in Redis again")
                self._failing = None
            return
        why = describe(problem)
        if why != self._failing:
            self._failing = why
            members = list(self.members.values())
            logger.warning(
                "inturn: could not renew leases in Redis: %s; turns held: keys %s; waiting: %d",
                why,
                _named(member for member in members if member.held),
                sum(not member.held for member in members),
            )

    def _lose(self, member_id: str, member: Member, why: str) -> None:
        """Redis no longer has this member, or could not vouch for it in time."""
        member.lost = True
        if member.held:
            logger.warning(
                "inturn: lost the lease of the turn on key %s (%s); another process may "
                "hold the key now, and the turn ends with LeaseLost",
                show(member.key),
                why,
            )
        else:
            logger.debug(
                "inturn: lost the place in Redis of a waiter for key %s (%s)", show(member.key), why
            )
        if not member.held and member.waiting is not None and not member.waiting.done():
            member.waiting.set_exception(
                BackendUnavailable(
                    f"inturn: the place in Redis of this waiter for {show(member.key)} is gone "
                    f"({why}); the work did not run"
                )
            )
        self.members.pop(member_id, None)


_GONE = "Redis no longer had it: flushed, restarted, failed over, or its lease ran out"


class _Kick:
    """Wakes the heartbeat before its time (a lost subscription, another server).

    Not ``asyncio.wait_for(event.wait(), t)``: on Python 3.11 and earlier,
    that swallows a cancellation that meets the event being set, and the
    heartbeat would outlive its share.
    """

    __slots__ = ("_kicked", "_loop", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        self._kicked = False  # kicked while nobody waited: the next wait returns at once

    def set(self) -> None:
        """Wake the wait now (or the next one, if none is under way)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        else:
            self._kicked = True

    async def wait(self, seconds: float) -> None:
        """Return after seconds, or as soon as kicked."""
        if self._kicked:
            self._kicked = False
            return
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(seconds, _settle, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
            self._kicked = False


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
