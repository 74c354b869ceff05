"""The files this process holds open for its file backend turns, closed in a forked child.

They are the writer ends of its tickets, and its line files while it joins
a line or tidies one. A child forked meanwhile closes its copies at once:
otherwise a ticket would keep a writer, and its line would wait for the
child to exit (and a line file's lock could outlive its user).
"""

from __future__ import annotations

import itertools
import os
import threading

from ._directory import Directory
from ._linefile import line_name

#: How a line file is opened again (to tidy it, or to check it): never made, never a link.
OPEN_TIDY = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC

# NOTE: a file is in _OPEN from its open to its close (taken out just before
# it), both done under _OPENING, which fork() takes too: so a child forked by
# another thread never inherits a file of a turn that _OPEN does not list. By
# its descriptor: the serial number of its open (see opened).
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


def open_tracked(name: str, flags: int, directory: int, mode: int = 0o600) -> int:
    """Open name in directory and list it in _OPEN, as one step for fork()."""
    with _OPENING:
        fd = os.open(name, flags, mode, dir_fd=directory)
        _OPEN[fd] = next(_serials)
    return fd


def opened(fd: int) -> int:
    """The serial number of fd's open by open_tracked (0: it is not open so)."""
    return _OPEN.get(fd, 0)


def close_tracked(fd: int, serial: int = 0) -> None:
    """Close fd, a file that open_tracked opened, and take it out of _OPEN, as one step.

    With ``serial`` (its open's: see opened), only if it is still open from
    that open: a clean-up after an exception that a signal handler raised
    just as fd was closed leaves it, and another file that the number may
    name since, alone.
    """
    with _OPENING:
        if serial and _OPEN.get(fd) != serial:
            return
        _OPEN.pop(fd, None)
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


def line_in_place_of(fd: int, where: Directory, digest: str) -> int:
    """Close ticket fd and open digest's line file in its descriptor; -1 if it cannot be.

    One step for this process's other turns (see _OPENING): none of them
    can take the descriptor in between, so a turn that leaves with no other
    descriptor left (and its owner's other threads busy) can tidy its line.
    """
    with _OPENING:
        _OPEN.pop(fd, None)
        os.close(fd)
        try:
            line = os.open(line_name(digest), OPEN_TIDY, dir_fd=where.fd)
        except OSError:  # gone (or taken by a thread outside inturn): see tidy_again
            return -1
        _OPEN[line] = next(_serials)
    return line
