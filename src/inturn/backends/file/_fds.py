"""The files this process holds open for its file backend turns, closed in a forked child.

They are the writer ends of its tickets, and its line files while it joins
a line or tidies one. A child forked meanwhile closes its copies at once:
otherwise a ticket would keep a writer, and its line would wait for the
child to exit (and a line file's lock could outlive its user).
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
from collections.abc import Callable, Iterable

from ._directory import Directory
from ._linefile import line_name

if sys.platform != "win32":  # (the file backend refuses other platforms at construction)
    import fcntl
    import resource

#: Where this process's open descriptors are listed (see _close_unlisted).
_DESCRIPTORS = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
#: The most descriptor numbers _close_unlisted tries where they cannot be listed.
_MOST = 1 << 16
#: How a line file is opened again (to tidy it, or to check it): never made, never a link.
OPEN_TIDY = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC

# NOTE: a file is in _OPEN from its open to its close (taken out just before
# it), both done under _OPENING, which fork() takes too: so a child forked by
# another thread never inherits a file of a turn that _OPEN does not list. By
# its descriptor: the serial number of its open (see new_serial).
_OPEN: dict[int, int] = {}
_OPENING = threading.Lock()
_serials = itertools.count(1)
#: Forks between the process that imported this module and this one. A grant made
#: with another count is an ancestor's: the key is still the ancestor's, and the
#: numbers of its files (closed here at the fork) may name other files since.
_forks = 0


def forks() -> int:
    """The forks between the process that imported this module and this one (see _forks)."""
    return _forks


#: The serial number of an open to come (see open_tracked), known to its caller first:
#: a clean-up finds the file by it, also one whose descriptor it never got (close_tracked).
new_serial: Callable[[], int] = _serials.__next__


def open_tracked(name: str, flags: int, directory: int, serial: int, mode: int = 0o600) -> int:
    """Open name in directory and list it in _OPEN under serial (see new_serial).

    One step for fork() (under _OPENING), and for an exception from a
    signal handler or thrown into the thread: raised anywhere in this call,
    it finds the file not open, or open and listed under serial (see
    close_tracked), or, raised as the open returned, closes it on its way
    out (see _open_listed).
    """
    with _OPENING:
        return _open_listed(name, flags, directory, mode, serial)


def close_tracked(fd: int, serial: int) -> None:
    """Close the file that the open with serial opened, and take it out of _OPEN, as one
    step; if it is closed already, do nothing.

    fd is its descriptor, or -1 where its caller may not have it (an exception
    landed as open_tracked returned it): it is then found by serial.
    Idempotent, for surely: called again after an exception cut it short
    (at its very start, say), it completes the close; called again after the
    close, it leaves alone the other file that the number may name since.
    The unlisting and the close are one step (see _close_listed): no such
    exception lands between them.
    """
    with _OPENING:
        if fd < 0:  # (rare: see above)
            fd = next((each for each, listed in _OPEN.items() if listed == serial), -1)
        if _OPEN.get(fd) == serial:
            _close_listed(fd)


def is_open(fd: int, serial: int) -> bool:
    """Whether fd is open still from the open with serial (not closed, nor another file's)."""
    return _OPEN.get(fd) == serial


def _open_listed(name: str, flags: int, directory: int, mode: int, serial: int) -> int:
    """open_tracked's open and listing (see there). Under _OPENING."""
    # NOTE: CPython may run a signal handler right as os.open returns, before the store:
    # its exception then finds the file open and not listed, and it is found and closed
    # (_close_unlisted). An OSError is the open's own: it opened nothing. (Calling the
    # open from C, at a FOR_ITER that does not check, cost a file turn about 4% of its
    # instructions, 10k of 272k: partial() with dir_fd= is the slow way into os.open.)
    try:
        fd = os.open(name, flags, mode, dir_fd=directory)
        _OPEN[fd] = serial
    except OSError:
        raise
    except BaseException:
        _close_unlisted(name, directory)
        raise
    return fd


def _close_unlisted(name: str, directory: int) -> None:
    """Close this process's descriptors of file name in directory that _OPEN does not list.

    The clean-up of an open that an exception cut short as it returned (see
    _open_listed): under _OPENING, every file inturn opens for writing is
    listed, so such a descriptor is the one that open made (the files it
    opens only for reading, others' tickets and line files to inspect, are
    left alone). It is found by its identity: if another process removed
    the file meanwhile, it stays open, with no lock and in no line. The
    descriptors are listed by /proc/self/fd (or /dev/fd); where they cannot
    be, the numbers below the process's limit are tried (up to _MOST).
    """
    try:
        info = os.stat(name, dir_fd=directory, follow_symlinks=False)
    except OSError:
        return
    try:
        listed: Iterable[int] = map(int, os.listdir(_DESCRIPTORS))
    except OSError:  # (no descriptor left to list them with, say: each number is tried)
        listed = range(min(resource.getrlimit(resource.RLIMIT_NOFILE)[0], _MOST))
    identity = (info.st_dev, info.st_ino)
    for fd in listed:
        if fd in _OPEN:
            continue
        try:
            found = os.fstat(fd)
            if (found.st_dev, found.st_ino) == identity and _writes(fd):
                os.close(fd)
        except OSError:  # (not open: the listing's own, closed since, or a number tried)
            continue


def _writes(fd: int) -> bool:
    """Whether fd is open for reading and writing, as inturn opens its own files."""
    return fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDWR


def _close_listed(fd: int) -> None:
    """Take fd out of _OPEN, then close it, as one step (see _open_listed). Under _OPENING."""
    # NOTE: one step: no CPython (3.10 to 3.13) checks for a signal at a `del` (no call),
    # nor before a call runs: only after os.close returns.
    if fd in _OPEN:
        del _OPEN[fd]  # noqa: RUF051 - a del, not pop(): no call (see the NOTE)
    os.close(fd)


def _close_inherited() -> None:
    global _forks
    _forks += 1
    for fd in _OPEN:
        try:
            os.close(fd)
        except OSError:  # pragma: no cover - closed by the child's own code already
            pass
    _OPEN.clear()
    _OPENING.release()  # taken by the thread that forked, the child's only thread


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_OPENING.acquire,
        after_in_parent=_OPENING.release,
        after_in_child=_close_inherited,
    )


def line_in_place_of(fd: int, where: Directory, digest: str, serial: int) -> int:
    """Close ticket fd and open digest's line file in its descriptor (under serial, see
    new_serial); -1 if it cannot be.

    One step for this process's other turns (see _OPENING): none of them
    can take the descriptor in between, so a turn that leaves with no other
    descriptor left (and its owner's other threads busy) can tidy its line.
    """
    with _OPENING:
        _close_listed(fd)
        try:
            return _open_listed(line_name(digest), OPEN_TIDY, where.fd, 0o600, serial)
        except OSError:  # gone (or taken by a thread outside inturn): see tidy_again
            return -1
