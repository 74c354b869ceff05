"""A line file's lock (``flock``), as the file backend takes it: at once, soon, or after pauses.

Holders keep a line file's lock for a few system calls: shared while they
join the line or look at its tickets, exclusive while they rewrite or
delete the file. So it is tried a few times first, yielding the CPU
between tries (see flock_soon). If it is still taken, its holder was
descheduled or stopped inside them. The kernel tells nobody when a flock
is let go, and a thread blocked in flock() could be neither bounded nor
cancelled (and would keep its process from exiting), so the lock is then
tried again after each of a few pauses, on an event loop's timer (lock)
or by sleeping a thread (lock_blocking).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Iterator

if sys.platform != "win32":  # (the file backend refuses other platforms at construction)
    import fcntl

#: Tries at a line file's lock, yielding the CPU between them, before waiting on a timer.
_FLOCK_TRIES = 16
#: The first and the longest pause between two tries at a line file's lock that stays taken.
LOCK_PAUSES = (0.001, 0.05)


def flock_now(fd: int, mode: int) -> bool:
    """flock fd in mode if nobody holds it in a way that excludes that; never waits."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def flock_soon(fd: int, mode: int) -> bool:
    """flock fd in mode if that takes no longer than its holder's few system calls.

    Yields the CPU between a few tries, so that a holder on this core can
    finish; False if the lock is still held after them.
    """
    for _ in range(_FLOCK_TRIES):
        if flock_now(fd, mode):
            return True
        os.sched_yield()
    return flock_now(fd, mode)


def _pauses(
    deadline: float | None, clock: Callable[[], float], expired: Callable[[], BaseException]
) -> Iterator[float]:
    """The pauses between tries at a line file's lock that stays taken, cut short at deadline.

    A millisecond at first, then longer and longer, up to 50 ms (see
    LOCK_PAUSES). deadline is on clock.

    :raises: expired() when deadline came.
    """
    pause, longest = LOCK_PAUSES
    while True:
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                raise expired()
            yield min(pause, left)
        else:
            yield pause
        pause = min(pause * 2, longest)


async def lock(
    fd: int, mode: int, deadline: float | None, expired: Callable[[], BaseException]
) -> None:
    """flock fd in mode, tried again on the loop's timer (see _pauses); never blocks a thread."""
    loop = asyncio.get_running_loop()
    for pause in _pauses(deadline, loop.time, expired):
        await asyncio.sleep(pause)
        if flock_now(fd, mode):
            return


def lock_blocking(
    fd: int, mode: int, deadline: float | None, expired: Callable[[], BaseException]
) -> None:
    """flock fd in mode, tried again after sleeping this thread (see _pauses); never flock()s."""
    for pause in _pauses(deadline, time.monotonic, expired):
        time.sleep(pause)
        if flock_now(fd, mode):
            return
