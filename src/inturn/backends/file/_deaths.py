"""The file backend's news of deaths in a line: told to its log, once a death is certain.

A ticket closed without a word (no hand-off, no leaving) is a process
that died in line, if that process has ended; a FIFO without its record,
found under a line file's exclusive lock, is a process that died joining.
Logged on ``inturn.file``, as the rest of the file backend's rare events.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Hashable

from ..._describe import describe
from ..._order import portable_key
from ._directory import Directory
from ._linefile import pid_of

logger = logging.getLogger("inturn.file")


def key_of(portable: bytes | None, digest: str) -> str:
    """A line's key for the log, from the portable name its line file records."""
    if portable is not None:
        try:
            return describe(portable_key(portable))
        except ValueError:
            pass
    return f"<key with digest {digest[:16]}>"


#: Linux's flag of a process that is exiting: its files are closed before it
#: becomes a zombie, so a waiter may see its ticket close while it still runs.
_PF_EXITING = 0x4


def gone(pid: int) -> bool:
    """Whether process pid has ended, or is ending (Linux: exiting, or a zombie).

    A process of another user exists. Where /proc is not there, a process
    not yet reaped by its parent counts as running.
    """
    if pid == os.getpid():
        return False
    # NOTE: /proc first, kill() only if it has no entry. Its parent may reap
    # it at any moment (asyncio's child watcher does, from a thread, as soon
    # as it is a zombie): kill() first saw it there, then /proc had no entry
    # for it, and a death was left out (1 run in 1000 of the death test).
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            # after "pid (comm)": state ppid pgrp session tty_nr tpgid flags ...
            fields = stat.read().rpartition(b")")[2].split()
    except OSError:  # reaped (also between the open and the read), or no /proc here
        return _reaped(pid)
    try:
        return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)
    except (IndexError, ValueError):
        return False


def _reaped(pid: int) -> bool:
    """Whether no process pid is left (reaped by its parent); one of another user is there."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # (another user's: it is there)
    return False


def died(key: Hashable, where: Directory, tickets: list[str], held: bool) -> None:
    """Log the owners of tickets, closed without a word, that died in key's line.

    tickets are in the order a waiter met them, its nearest first; if held,
    the last (the earliest in line) held the key, or was being handed it.
    A ticket closed without a word whose process still runs did not die: a
    third reader took its hand-off (see _tickets.probe). Such a ticket is
    not logged, nor one whose process id was reused since (rare: a death
    left out of the log, never a false one).
    """
    for n, ticket in enumerate(tickets):
        if not gone(pid_of(ticket)):
            continue
        if held and n == len(tickets) - 1:
            logger.warning(
                "inturn: process %d died holding key %s (or as it was handed the key), "
                "without releasing it; process %d takes the key over (directory %s)",
                pid_of(ticket),
                describe(key),
                os.getpid(),
                where.path,
            )
        else:
            logger.info(
                "inturn: process %d died waiting for key %s; its place in line is skipped "
                "(directory %s)",
                pid_of(ticket),
                describe(key),
                where.path,
            )


def died_joining(ticket: str, portable: bytes | None, digest: str, where: Directory) -> None:
    """Log that ticket's FIFO was removed: its process died joining the line of digest."""
    logger.info(
        "inturn: removed the ticket of process %d, which died while joining "
        "the line of key %s (directory %s)",
        pid_of(ticket),
        key_of(portable, digest),
        where.path,
    )
