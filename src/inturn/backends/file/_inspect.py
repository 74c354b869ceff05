"""A file backend's lines read from the side, for people: who is in each, in turn order.

What ``FileBackend.line()`` and ``lines()`` (and so ``python -m inturn
inspect``) show. A line file is read without its lock, and a ticket only
looked at (see ``_tickets.peek``): reading never waits, and never disturbs
a line. The answer may be stale by the time it is returned.
"""

from __future__ import annotations

import errno
import os
import time

from ..._order import portable_key, portable_name
from .._lines import HolderInfo, LineInfo, WaiterInfo
from ._linefile import Records, line_name, parse, pid_of, pipe_name, read_records
from ._tickets import peek

#: How a line file is read by whoever is not in its line: never through a link.
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC


def pids_in_line(directory: int, digest: str) -> tuple[int, ...]:
    """The process ids in digest's line, in turn order."""
    found = _read_line(directory, digest)
    if found is None:
        return ()
    return tuple(pid_of(ticket) for ticket, _ in _in_line(directory, digest, found.tickets))


def snapshots(directory: int) -> list[LineInfo]:
    """Every line in directory that someone is in and that records its key, sorted by key."""
    now = time.time()
    found = []
    for name in os.listdir(directory):
        digest = name.partition(".")[0]
        if name == line_name(digest) and (line := _snapshot(directory, digest, now)):
            found.append(line)
    return sorted(found, key=lambda line: portable_name(line.key))


def _read_line(directory: int, digest: str) -> Records | None:
    """The records of digest's line file, read without its lock; None if there is none."""
    try:
        fd = os.open(line_name(digest), _OPEN_READ, dir_fd=directory)
    except OSError as error:
        if error.errno in (errno.ENOENT, errno.ELOOP):
            return None
        raise
    try:
        return parse(read_records(fd))
    finally:
        os.close(fd)


def _in_line(directory: int, digest: str, tickets: list[str]) -> list[tuple[str, os.stat_result]]:
    """The tickets still in line, with the stat of each one's FIFO, in turn order."""
    return [
        (ticket, info)
        for ticket in tickets
        if (info := peek(directory, pipe_name(digest, ticket))) is not None
    ]


def _snapshot(directory: int, digest: str, now: float) -> LineInfo | None:
    """Digest's line as it is: None if nobody is in it, or it does not record its key."""
    found = _read_line(directory, digest)
    if found is None or found.key is None:
        return None
    here = _in_line(directory, digest, found.tickets)
    if not here:
        return None
    try:
        key = portable_key(found.key)
    except ValueError:
        return None  # (not a key this backend wrote)
    (first, since), *rest = here
    clock = time.monotonic_ns()

    def latest(ticket: str) -> float | None:
        """Seconds since ticket's latest work was called, if it posted any."""
        post = found.posts.get(ticket)
        return None if post is None else max(0.0, (clock - post.called) / 1e9)

    return LineInfo(
        key,
        HolderInfo(
            None, pid_of(first), max(0.0, now - since.st_mtime), latest_called=latest(first)
        ),
        tuple(
            WaiterInfo(None, pid_of(t), max(0.0, now - info.st_mtime), latest_called=latest(t))
            for t, info in rest
        ),
    )
