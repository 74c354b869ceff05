"""A Redis turn's protocol, written once as steps for two drivers.

Taking a turn (:func:`taking`) and ending it (:func:`releasing`) are
generators that yield the I/O they need as an *op* (a tuple whose first item
is one of the verbs below) and are sent its answer; a task's driver
(``_loop``: ``drive``, ``drive_soon``) or a thread's
(``_threads``: ``Blocking``) performs it. Nothing here does I/O, and
nothing here knows which driver runs it. An op's error, or an interrupt of
the caller (a task's cancellation, a signal handler's exception in a
thread), is thrown in at the op it came during: taking then gives its place
up (QUIT) and re-raises. The steps decide what a turn decides (its bounds,
its member, what an answer means, its grant, what a release's status says);
the drivers only carry the calls.

A leave never leaves a member behind, whatever connection it goes on: one
sent while no answer to its member's enqueue was read is *marked*, and if
Redis runs it before the enqueue (another connection's call may overtake),
the enqueue does nothing (see ``_scripts``). A thread's leave goes on
the enqueue's own connection where it can, so Redis runs it after.

The ops and their answers (times are ``time.monotonic()`` seconds):

- ``(ENQUEUE, member, member_id, late)``: call the enqueue script for
  member; ``(sent, reply)``, the reply and when the call was written; None
  if no reply came by ``late``; UNCONNECTED if no connection was made by
  then (a thread's). ``late`` None: the lease bounds it (a task's link
  drops a connection silent that long; a thread's sockets time out).
- ``(GRANT, member, deadline)``: wait for member's grant (handed to
  ``member.waiting``); its token, or None if none came by ``deadline``.
- ``(LEAVE, member, member_id)``: call the leave script (a release); its status.
- ``(QUIT, member, member_id, marked)``: give member's place up: write its
  leave and go on, never waiting, never failing (``marked``: no answer to
  its enqueue was read); None. A driver that never wrote the enqueue
  writes nothing.
- ``(JUDGE, member, member_id, late)``: call the judge script (latest work
  whose turn came); ``(sent, reply)``, or None if no reply came by ``late``,
  as ENQUEUE's.
- ``(AGAIN, member, member_id, late)``: call the script by which latest
  work joins its line again; as JUDGE (``member.waiting`` is new by then,
  so that the next grant finds it).
"""

from __future__ import annotations

import logging
import time
import typing
from collections.abc import Callable, Generator, Hashable, Iterator
from typing import Any, Final, Protocol

from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ..._checks import Waited, missed
from ..._describe import describe as show
from ..._errors import BackendUnavailable
from .._base import Newest, Replaced
from .._judge import judge
from ._calls import Config
from ._errors import UNREACHABLE, demoted, describe, unavailable
from ._latest import gone, judged
from ._lease import Leases, Member, Waiting
from ._scripts import Line

#: What this backend logs: only what is rare (here: a release Redis did not take), never a
#: turn that went as it should.
logger = logging.getLogger("inturn.redis")

ENQUEUE: Final = 0
GRANT: Final = 1
LEAVE: Final = 2
QUIT: Final = 3
JUDGE: Final = 4
AGAIN: Final = 5

#: ENQUEUE's answer when no connection could be made in time (see the module's docstring).
UNCONNECTED: Final = "unconnected"

#: An op: a verb, then its arguments.
Op = tuple[Any, ...]
#: What a turn's steps return: its grant (taking), or nothing (releasing).
T = typing.TypeVar("T")
#: Steps that yield ops, are sent their answers, and return T.
Steps = Generator[Op, Any, T]

#: The clock of every bound here (an event loop's may be another: uvloop's is).
now: Final = time.monotonic


class Share(Protocol):
    """What the steps use of one event loop's share of a backend (``_loop.LoopShare``)."""

    @property
    def config(self) -> Config:
        """The backend's settings: the lease."""

    @property
    def leases(self) -> Leases:
        """Its members of Redis's lines, renewed by its heartbeat."""

    @property
    def id(self) -> str:
        """Its id: the prefix of its members' ids, and of its channel's name."""

    @property
    def counter(self) -> Iterator[int]:
        """Numbers its members."""

    @property
    def closing(self) -> bool:
        """Whether it is closed, or closing: it gave its members' places up."""

    def inherited(self) -> bool:
        """Whether this is a forked child's copy of its parent's share."""


@typing.final
class RedisGrant:
    """The turn on one key granted by a :class:`~inturn.backends.redis.RedisBackend`."""

    __slots__ = ("_member", "_share", "_state", "key", "token")

    def __init__(self, key: Hashable, token: int, member: str, share: Share, state: Member) -> None:
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

    def ran(self, called: int, ok: bool) -> None:
        """Note the latest work that ran in this turn (see LatestGrant): the release records it."""
        self._state.ran = (called, ok)

    def __repr__(self) -> str:
        lost = " lost" if self.lost else ""
        return f"<RedisGrant key={show(self.key)} token={self.token}{lost}>"


def owner(grant: RedisGrant) -> Share:
    """The loop share that granted grant (and alone may release it)."""
    return grant._share


def taking(
    share: Share,
    key: Hashable,
    line: Line,
    timeout: float | None,
    began: float,
    waiting: Callable[[], Waiting],
    into: list[Any] | None = None,
    newest: Newest | None = None,
) -> Steps[RedisGrant]:
    """Take key's turn (line: its line in Redis): join the line, wait for the grant.

    ``began``: when the call began (a share's start may have come since);
    ``waiting()``: a new thing the grant is handed to (a task's Future, a
    thread's Answer). With ``newest`` (latest work shared across processes,
    see ``_latest``), the member posts its process's newest work, and once
    its turn comes runs that work, joins the line again behind newer work,
    or raises Replaced: newer work ran.

    ``timeout`` covers joining and waiting, but Redis's answer to
    the enqueue gets one round trip from now, up to a tenth of the lease,
    however short the timeout (0: a try-lock); without a timeout, or with
    one as long as the lease, a Redis that does not answer for a lease
    fails the turn (see bounds). Whatever ends it before its grant (an op's
    error, a timeout, an interrupt thrown in), the place is given up. With
    ``into`` (a thread's), the grant goes into it as it is made (see
    BlockingBackend.acquire_sync), for its caller's clean-up to release.

    :raises TimeoutError: the turn was not reached within timeout (the
        message says what it waited for); the work did not run.
    :raises ~inturn.BackendUnavailable: Redis could not be reached, refused,
        or lost the place; the work did not run.
    :raises Replaced: (latest work) newer work of another process ran in
        this work's place; the place was given up.
    """
    lease = share.config.lease
    deadline, late = bounds(lease, timeout, began, now())
    member_id = f"{share.id}/{next(share.counter)}"
    member = Member(key, line, waiting())
    made = [] if into is None else into
    try:
        share.leases.members[member_id] = member  # (renewed by the heartbeat once joined)
        if newest is not None:
            member.called = newest()
        answer = yield (ENQUEUE, member, member_id, late)
        if answer is None or answer is UNCONNECTED:
            raise _unanswered(key, timeout, share.config, answer is UNCONNECTED)  # noqa: TRY301 - given up below, as any failure
        sent, reply = answer
        alone = type(reply) is list  # (latest work that started its line anew: nothing to judge)
        token = enqueued(member, lease, sent, reply[0] if alone else reply)
        if newest is not None and not alone:
            token = yield from _latest(
                member, member_id, token, deadline, timeout, newest, waiting, lease
            )
        elif token is None:
            token = yield from _granted(member, deadline, timeout)
        made.extend(map(hold, (share,), (member_id,), (member,), (token,)))  # NOTE: one step
    except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
        raise
    except BaseException as error:
        share.leases.members.pop(member_id, None)  # (no more renewals)
        try:
            yield (QUIT, member, member_id, not member.joined)
        except GeneratorExit:
            raise
        except BaseException:  # interrupted before its driver wrote the leave, or as it did
            yield (QUIT, member, member_id, not member.joined)  # (twice: a no-op)
            raise
        if isinstance(error, (*UNREACHABLE, ResponseError)) and not isinstance(error, TimeoutError):
            raise unavailable(error, share.config.server) from error
        raise
    else:  # (in made: an interrupt from here on leaves it to its caller to release)
        grant: RedisGrant = made[-1]
        return grant


def _granted(member: Member, deadline: float | None, timeout: float | None) -> Steps[int]:
    """Wait for member's grant: its token.

    :raises TimeoutError: none came by deadline.
    """
    token = yield (GRANT, member, deadline)
    if token is None:
        raise missed((member.key,), Waited.LINE, timeout)
    member.token = token
    return token  # type: ignore[no-any-return]


def _latest(
    member: Member,
    member_id: str,
    token: int | None,
    deadline: float | None,
    timeout: float | None,
    newest: Newest,
    waiting: Callable[[], Waiting],
    lease: float,
) -> Steps[int]:
    """Take the turn of latest work that member posted (see _latest and _judge), token its
    grant if it was handed the key as it joined: once the turn comes, judge, and join the
    line again behind newer work (at most _judge.AGAIN times) until its work is to run.
    Returns the token to hold the key with.

    :raises Replaced: newer work ran: the work is not to run (the caller gives the place up).
    :raises ~inturn.BackendUnavailable: Redis no longer had the member (its lease ran out).
    """
    key = member.key
    again = 0
    while True:
        if token is None:
            token = yield from _granted(member, deadline, timeout)
        member.token = token
        answer = yield (JUDGE, member, member_id, _late(deadline, lease))
        if answer is None:
            raise missed((key,), Waited.ANSWER, timeout, " from Redis (judging)")
        sent, reply = answer
        line = judged(key, reply)
        member.called = newest()  # (asked once the turn came: the newest is what runs)
        at = int(sent * 1e9)
        verdict = judge(line.ran, line.me(member.called, at), again, line.behind, _live)
        if verdict is True:
            return token
        if verdict is not False:
            raise Replaced(key, verdict.called.local(line.now_us, at), verdict.ok)
        again += 1  # newer work waits behind: in line again behind it, the key handed on
        member.waiting = waiting()  # (before the call: its grant may come at once after)
        answer = yield (AGAIN, member, member_id, _late(deadline, lease))
        if answer is None:
            raise missed((key,), Waited.ANSWER, timeout, " from Redis (joining again)")
        if answer[1] == 0:
            raise gone(key)
        token = enqueued(member, lease, *answer)


def _late(deadline: float | None, lease: float) -> float | None:
    """By when Redis must answer a call of a turn under way (see bounds): by the caller's
    deadline, but one round trip from now, up to a tenth of the lease, at least."""
    return None if deadline is None else max(deadline, now() + lease / 10)


def _live(post: object) -> bool:
    """Whether a post's member lives: every post in a line does (see _latest)."""
    return True


def releasing(share: Share, grant: RedisGrant) -> Steps[None]:
    """End grant's turn: Redis hands the key to the next in line and wakes it.

    It never fails: a release Redis did not take is logged (the key frees
    itself within the lease), and a lease found gone marks the member lost.
    An interrupt thrown in (a thread's) gives the member's place up as a
    QUIT, and is re-raised: the release goes on. In a forked child, a turn
    its parent was granted ends here alone (see :func:`ending`).
    """
    ended = ending(share, grant)
    if ended is None:
        return
    member_id, member = ended
    try:
        status = yield (LEAVE, member, member_id)
    except GeneratorExit:  # (abandoned: its event loop ended; no more ops)
        raise
    except Exception as error:
        left(member, None, error, share.config.lease)
        return
    except BaseException:  # (a thread's interrupt: the leave goes again, elsewhere)
        yield (QUIT, member, member_id, False)
        raise
    left(member, status, None, share.config.lease)


def bounds(
    lease: float, timeout: float | None, began: float, at: float
) -> tuple[float | None, float | None]:
    """(deadline, late): by when the turn, and Redis's answer to the enqueue, must come.

    Redis answers the enqueue by the caller's deadline if that comes first,
    but gets one round trip from ``at`` (after a start), up to a tenth of
    the lease, however short the timeout (0: a try-lock); else (late None)
    within about a lease: the heartbeat drops a link that leaves a call
    unanswered longer (a cluster's calls get a timer of their own; a
    thread's connection, a socket timeout).
    """
    if timeout is None:
        return None, None
    deadline = began + timeout
    return deadline, (max(deadline, at + lease / 10) if timeout < lease else None)


def enqueued(member: Member, lease: float, sent: float, reply: Any) -> int | None:
    """Redis answered member's enqueue (written at ``sent``): its token if the key was
    free, else None (it waits for its grant; see _scripts._ENQUEUE)."""
    member.joined = True
    member.expires = sent + lease
    return reply if reply > 0 else None


def hold(share: Share, member_id: str, member: Member, token: int) -> RedisGrant:
    """member was granted the key with token: its grant.

    :raises ~inturn.BackendUnavailable: this process was frozen, or its loop
        blocked, past the lease meanwhile: Redis may have given the turn to
        another since (the grant's message waited in the socket). The work
        must not run on it.
    """
    if share.closing:
        raise BackendUnavailable("inturn: the backend was closed; the work did not run")
    if member.lapsed:
        raise BackendUnavailable(
            f"inturn: the place in Redis of this waiter for {show(member.key)} may be gone (this "
            "process was frozen, or its event loop blocked, for longer than the lease); "
            "the work did not run"
        )
    member.waiting = None
    member.held = True
    return RedisGrant(member.key, token, member_id, share, member)


def ending(share: Share, grant: RedisGrant) -> tuple[str, Member] | None:
    """Take grant's member off the heartbeat: (its id, it) for the leave to write, or None.

    None: released already, or Redis no longer had it (lost); or, in a
    forked child, a turn the parent was granted: the member, its lease and
    the connections are the parent's, which holds the key and renews it
    until it leaves the turn itself. The child only forgets its copy (and
    waits behind the parent, as any other process, if it takes the key again).
    """
    member_id = grant._member
    member = share.leases.members.pop(member_id, None)
    if member is None or share.inherited():
        return None
    return member_id, member


def left(member: Member, status: Any, error: BaseException | None, lease: float) -> None:
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
        lease,
    )


def _unanswered(
    key: Hashable, timeout: float | None, config: Config, connecting: bool
) -> Exception:
    """The error of a turn on key whose enqueue got no answer in time (``connecting``: no
    connection was made for it): TimeoutError, or, with no timeout, BackendUnavailable."""
    if timeout is None:
        waited = RedisTimeoutError(f"no connection within {config.lease:g} s (the lease)")
        return unavailable(waited, config.server)
    detail = " from Redis (connecting)" if connecting else " from Redis"
    return missed((key,), Waited.ANSWER, timeout, detail)
