"""When calls of latest work shared across processes were made, as a server compares them.

Used by the backends whose line lives in a server (Redis, PostgreSQL; see
``_judge``). Calls are made on many hosts, and each host's clocks are its
own. A call's time is kept twice: on its host's monotonic clock, with the
host's *clock id* (its boot id), and on the server's clock (the statement
that stores it converts its age when it was sent). Two calls of one host
(same clock id) compare by the host's clock, exactly; two of different
hosts by the server's, which is right to within the time a call takes to
reach the server (its one-way latency: a fraction of a millisecond on a
LAN). So on one host "newest" is exact; across hosts, calls made closer
together than that may be taken in either order.
"""

from __future__ import annotations

import secrets
from typing import Final, NamedTuple, final


def _clock_id() -> str:
    """This host's clock id: its boot id (one monotonic clock per boot), or, where the
    system does not say it, one of this process's own (its calls then compare with other
    processes' by the server's clock)."""
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
    """When a call was made: its host's clock id and monotonic ns, and the server's µs.

    One call is newer than another by its host's clock if both were made
    on one host, else by the server's (see the module).
    """

    __slots__ = ("clock", "mono", "server")

    def __init__(self, clock: str, mono: int, server: int) -> None:
        self.clock = clock
        self.mono = mono
        self.server = server

    def __gt__(self, other: Stamp) -> bool:
        if self.clock == other.clock:
            return self.mono > other.mono
        return self.server > other.server

    def __ge__(self, other: Stamp) -> bool:
        if self.clock == other.clock:
            return self.mono >= other.mono
        return self.server >= other.server

    def local(self, now_us: int, sent: int) -> int:
        """This time on this host's monotonic clock (ns): exact if it was made on this host,
        else converted from the server's (``now_us``: the server's clock when this host's
        call written at ``sent``, monotonic ns, ran)."""
        if self.clock == CLOCK:
            return self.mono
        return sent - (now_us - self.server) * 1000

    def __repr__(self) -> str:
        return f"<Stamp {self.clock} {self.mono} {self.server}>"


class Post(NamedTuple):
    """A member's post (see ``_judge``)."""

    called: Stamp
    fresh: bool


class Ran(NamedTuple):
    """What ran last in a line (see ``_judge``)."""

    called: Stamp
    ok: bool


class Judged(NamedTuple):
    """What a turn of latest work judges by, read from its line (see the backend's judge)."""

    now_us: int  #: the server's clock when it was read
    ran: Ran | None
    behind: list[Post]  #: the posts of the members behind, in line order

    def me(self, called: int, sent: int) -> Stamp:
        """A time of this process (monotonic ns) as a stamp, its call written at ``sent``."""
        return Stamp(CLOCK, called, self.now_us - (sent - called) // 1000)
