"""Tickets: named pipes whose writer end is their owner's place in a line.

While its owner waits or holds, a ticket has a writer; once the owner
releases, gives up, or dies (even by SIGKILL: the kernel closes a dead
process's files), it has none, and never gets one back. A reader of the
pipe sees end of file at that moment. A releasing holder writes its
*hand-off* (``H`` and its token, in one write, so it is read whole) into
its ticket before closing it: its work is done, and whoever waits on it
may go on at once. A waiter that gives up writes its *leaving* (``L``)
before closing its ticket: so a ticket closed without a word tells that
its owner died (killed, crashed, or exited while in line), which is worth
a line in the log.

Every ticket is opened relative to its directory's descriptor, never
through a symbolic link; a link in place of a ticket counts as a ticket
that left.
"""

from __future__ import annotations

import asyncio
import errno
import math
import os
import select
import struct
import sys
import threading
import time
from collections.abc import Callable

if sys.platform != "win32":  # (the file backend refuses other platforms at construction)
    import fcntl
    import termios

#: How a ticket is looked at: read, without waiting for a writer, never through a link.
_OPEN = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
#: Errors of opening a ticket that mean it is not there: gone, or a link in its place.
_ABSENT = (errno.ENOENT, errno.ELOOP)
_HANDED = b"H"
#: What a waiter that gives up writes into its ticket before closing it.
LEAVING = b"L"
#: The longest poll() of the main thread, in ms. Python runs signal handlers
#: there, between bytecodes; a signal that arrives after poll() let go of
#: the GIL but before the kernel sleeps interrupts nothing, so its handler
#: waits until poll() returns: this bounds that wait.
_SIGNAL_SLICE = 100


def hand_off(token: int) -> bytes:
    """What a releasing holder writes into its ticket: its work is done, at token."""
    return _HANDED + str(token).encode("ascii")


def handed(data: bytes) -> int | None:
    """The token of the hand-off that data (read from a ticket) carries, if it does."""
    return int(data[1:]) if data.startswith(_HANDED) else None


def _open(directory: int, name: str) -> int | None:
    try:
        return os.open(name, _OPEN, dir_fd=directory)
    except OSError as error:
        if error.errno in _ABSENT:
            return None
        raise


def probe(directory: int, name: str) -> tuple[int | None, bytes | None]:
    """Open ticket name for reading: (fd, data) if its owner is still in line.

    The fd is None if the ticket is gone or has no writer (its owner left or
    died); data is what the owner wrote into it, or None if the ticket is
    gone. An fd that is returned reports end of file when the owner leaves.
    Takes what it reads: the ticket's reader behind it may then miss the
    hand-off, and look further back, which is safe.
    """
    fd = _open(directory, name)
    if fd is None:
        return None, None
    data = b""
    try:
        # Read at once: with no writer this is end of file (and Linux would
        # not report a hang-up for a writer that left before the open).
        while chunk := os.read(fd, 64):
            data += chunk
    except BlockingIOError:
        return fd, data  # a writer holds it open: its owner is in line
    os.close(fd)
    return None, data


def alive(directory: int, name: str) -> bool:
    """Whether ticket name's owner is still in line."""
    fd, _ = probe(directory, name)
    if fd is None:
        return False
    os.close(fd)
    return True


def peek(directory: int, name: str) -> os.stat_result | None:
    """The stat of ticket name if its owner is still in line, else None; takes nothing.

    A ticket with something to read carries its owner's hand-off: it has
    left, or is leaving. Only one with nothing to read is read from, to
    tell a writer (in line) from none (left).
    """
    fd = _open(directory, name)
    if fd is None:
        return None
    try:
        if struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4))[0]:
            return None
        try:
            os.read(fd, 1)  # end of file: no writer
        except BlockingIOError:
            return os.fstat(fd)
        return None
    finally:
        os.close(fd)


def _took(fd: int, data: bytearray) -> bool:
    """Read what ticket fd carries into data; whether its owner left (handed off, or closed it)."""
    try:
        while chunk := os.read(fd, 64):
            data.extend(chunk)
    except BlockingIOError:
        return data.startswith(_HANDED)  # else the owner is still in line
    return True


async def until_left(
    fd: int, deadline: float | None, expired: Callable[[], BaseException]
) -> bytes:
    """Wait in the event loop until ticket fd's owner left; return what it carried.

    Done at its hand-off, or at end of file (its owner gave up or died).

    :raises: expired() at deadline (the loop's clock), if it comes first.
    """
    loop = asyncio.get_running_loop()
    if deadline is not None and loop.time() >= deadline:
        raise expired()  # (a timer due now could lose to a hand-off read first)
    done: asyncio.Future[bytes] = loop.create_future()
    data = bytearray()

    def readable() -> None:
        if _took(fd, data) and not done.done():
            done.set_result(bytes(data))

    def expire() -> None:
        if not done.done():
            done.set_exception(expired())

    loop.add_reader(fd, readable)
    timer = None if deadline is None else loop.call_at(deadline, expire)
    try:
        return await done
    finally:
        loop.remove_reader(fd)
        if timer is not None:
            timer.cancel()


def until_left_blocking(
    fd: int, deadline: float | None, expired: Callable[[], BaseException]
) -> bytes:
    """As until_left, blocking this thread in poll() instead (deadline on time.monotonic()).

    A signal that interrupts the poll runs its handler; if the handler
    returns, the poll goes on (PEP 475), and if it raises, that propagates
    (within _SIGNAL_SLICE at worst).
    """
    poller = select.poll()
    poller.register(fd, select.POLLIN)  # (and a hang-up: the owner closed it)
    longest = _SIGNAL_SLICE if threading.current_thread() is threading.main_thread() else None
    data = bytearray()
    while True:
        wait = longest
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise expired()
            wait = math.ceil(left * 1000)  # ms, never early
            if longest is not None:
                wait = min(wait, longest)
        poller.poll(wait)
        if _took(fd, data):
            return bytes(data)
