"""Latest work shared across processes in a Redis line (``across="processes"``).

The rule is the backends' (``backends/_judge.py``); here is how a Redis
line keeps what it judges (see ``_scripts``): a member of latest work
carries a post at the end of its info, and the line keeps what ran last as
its ``ran`` field. A member's post counts while it is in line: its lease
holds (every script drops the expired ones first), so a process that died,
or froze past its lease, no longer counts.

Times. Calls are made on many hosts, and each host's clocks are its own. A
call's time is kept twice: on its host's monotonic clock, with the host's
*clock id* (its boot id), and on Redis's clock (the script that stores it
converts its age when it was sent). Two calls of one host (same clock id)
compare by the host's clock, exactly; two of different hosts by Redis's,
which is right to within the time a call takes to reach Redis (its one-way
latency: a fraction of a millisecond on a LAN). So on one host "newest" is
exact; across hosts, calls made closer together than that may be taken in
either order.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any, Final, NamedTuple, final

from ..._describe import describe as show
from ..._errors import BackendUnavailable


def _clock_id() -> str:
    """This host's clock id: its boot id (one monotonic clock per boot), or, where the
    system does not say it, one of this process's own (its calls then compare with other
    processes' by Redis's clock)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as file:
            boot = file.read().strip().replace("-", "")
    except OSError:
        boot = ""
    return boot[:16] if len(boot) >= 16 and boot.isalnum() else "p" + secrets.token_hex(8)


#: This host's clock id (see the module).
CLOCK: Final = _clock_id()


@final
class Stamp:
    """When a call was made: its host's clock id and monotonic ns, and Redis's µs.

    One call is newer than another by its host's clock if both were made
    on one host, else by Redis's (see the module).
    """

    __slots__ = ("clock", "mono", "redis")

    def __init__(self, clock: str, mono: int, redis: int) -> None:
        self.clock = clock
        self.mono = mono
        self.redis = redis

    def __gt__(self, other: Stamp) -> bool:
        if self.clock == other.clock:
            return self.mono > other.mono
        return self.redis > other.redis

    def __ge__(self, other: Stamp) -> bool:
        if self.clock == other.clock:
            return self.mono >= other.mono
        return self.redis >= other.redis

    def local(self, now_us: int, sent: int) -> int:
        """This time on this host's monotonic clock (ns): exact if it was made on this host,
        else converted from Redis's (``now_us``: Redis's clock when this host's call written
        at ``sent``, monotonic ns, ran)."""
        if self.clock == CLOCK:
            return self.mono
        return sent - (now_us - self.redis) * 1000

    def __repr__(self) -> str:
        return f"<Stamp {self.clock} {self.mono} {self.redis}>"


class Post(NamedTuple):
    """A member's post (see ``_judge``)."""

    called: Stamp
    fresh: bool


class Ran(NamedTuple):
    """What ran last in a line (see ``_judge``)."""

    called: Stamp
    ok: bool


def sent(called: int) -> bytes:
    """A call made at ``called`` (monotonic ns) as a script is sent it, now: its clock id,
    its time, and its age in µs (see ``_scripts``)."""
    return b"%s %d %d" % (CLOCK.encode(), called, (time.monotonic_ns() - called) // 1000)


def ran(called: int, ok: bool) -> bytes:
    """What ran, as a release is sent it: its call's time (see sent), and whether it returned."""
    return sent(called) + (b" 1" if ok else b" 0")


class Judged(NamedTuple):
    """What a turn of latest work judges by, read from its line (see ``_scripts._JUDGE``)."""

    now_us: int  #: Redis's clock when it was read
    ran: Ran | None
    behind: list[Post]  #: the posts of the members behind, in line order

    def me(self, called: int, sent: int) -> Stamp:
        """A time of this process (monotonic ns) as a stamp, its call written at ``sent``."""
        return Stamp(CLOCK, called, self.now_us - (sent - called) // 1000)


def judged(key: Any, reply: Sequence[Any]) -> Judged:
    """The judge script's reply, read.

    :raises ~inturn.BackendUnavailable: the member no longer held the key
        (its lease ran out): the work did not run.
    """
    if not reply:
        raise gone(key)
    now_us, ran_text, *posts = (_text(part) for part in reply)
    last = None
    if ran_text:
        *stamp, ok = ran_text.split(" ")
        last = Ran(_stamp(stamp), ok == "1")
    behind = []
    for post in posts:
        *stamp, fresh = post.split(" ")
        behind.append(Post(_stamp(stamp), fresh == "1"))
    return Judged(int(now_us), last, behind)


def gone(key: Any) -> BackendUnavailable:
    """The error of a turn of latest work on key that Redis no longer had, its turn come."""
    return BackendUnavailable(
        f"inturn: the turn in Redis of this waiter for {show(key)} was gone when it came "
        "(its lease ran out: this process was frozen, or could not reach Redis, for "
        "longer than the lease); the work did not run"
    )


def _stamp(parts: list[str]) -> Stamp:
    clock, mono, redis = parts
    return Stamp(clock, int(mono), int(redis))


def _text(value: bytes | str | int) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def seen(info: str) -> tuple[str, float | None]:
    """A member's info in a line (``inspect``): the info without its post, and, if it has
    one, when its latest work was called, in Redis µs."""
    about, _, post = info.partition(" @")
    if not post:
        return about, None
    return about, float(post.split(" ")[2])
