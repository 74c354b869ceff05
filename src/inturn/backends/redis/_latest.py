"""Latest work shared across processes in a Redis line (``across="processes"``).

The rule is the backends' (``backends/_judge.py``); here is how a Redis
line keeps what it judges (see ``_scripts``): a member of latest work
carries a post at the end of its info, and the line keeps what ran last as
its ``ran`` field. A member's post counts while it is in line: its lease
holds (every script drops the expired ones first), so a process that died,
or froze past its lease, no longer counts.

Times: see ``backends/_stamps.py`` (Redis is the server whose clock compares
calls of different hosts).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from ..._describe import describe as show
from ..._errors import BackendUnavailable
from .._stamps import CLOCK, Judged, Post, Ran, Stamp


def sent(called: int) -> bytes:
    """A call made at ``called`` (monotonic ns) as a script is sent it, now: its clock id,
    its time, and its age in µs (see ``_scripts``)."""
    return b"%s %d %d" % (CLOCK.encode(), called, (time.monotonic_ns() - called) // 1000)


def ran(called: int, ok: bool) -> bytes:
    """What ran, as a release is sent it: its call's time (see sent), and whether it returned."""
    return sent(called) + (b" 1" if ok else b" 0")


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
