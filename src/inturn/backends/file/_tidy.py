"""Tidying a file backend's line: the tickets that left, then the line file once nobody is in it.

After releasing (or giving up), a process tidies up: if no ticket behind
its own is still in line, or the file grew long, it finds which tickets
have no writer and removes their FIFOs, under the shared lock; then,
under the exclusive lock, for a few system calls only, it deletes the
line file if nobody is left in it, or writes the tickets still in line
over the old records and cuts the file to them (``_linefile.py`` tells
why a compaction cut short reads back right).

A tidy never waits for the lock: another process that holds it is
joining (and tidies after its turn) or tidying. Only a process that left
the line last, and that a tidier may have seen still in it, tries again
shortly (retry, or retry_aside with no event loop; retry_soon after giving up waiting, which a
tidier may have seen as it released the key: each would have left the line
file to the other). Best effort: an error is logged, and the key's next
turn tidies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Hashable

from ..._describe import describe
from ..._surely import surely
from ._deaths import died_joining
from ._directory import Directory
from ._fds import OPEN_TIDY, close_tracked, is_open, new_serial, open_tracked
from ._linefile import (
    Post,
    Ran,
    line_name,
    parse,
    pipe_name,
    queued_in,
    read_records,
    record_of,
    render,
    ticket_of,
)
from ._locks import LOCK_PAUSES, flock_now, flock_soon
from ._tickets import alive

if sys.platform != "win32":  # (the file backend refuses other platforms at construction)
    import fcntl

logger = logging.getLogger("inturn.file")

#: Compact a line file with more records than this (two per turn: a busy line's
#: file grows, as the tickets that left are only dropped by a compaction).
_COMPACT_AT = 128
#: The kernel copies a write into a file page by page, and a process killed
#: meanwhile stops between two pages: a compaction writes its tickets only
#: where they fit between two page boundaries, so that they are written whole or not at all.
_PAGE = 4096 if sys.platform == "win32" else os.sysconf("SC_PAGE_SIZE")
#: How long (seconds) a release tries again to tidy a line it left last.
_RETRY_FOR = 0.5


def _finish(done: asyncio.Future[None]) -> None:
    if not done.done():  # (cancelled by its awaiter: the tidy ran all the same)
        done.set_result(None)


def _behind(records: list[str], own: str) -> bool:
    """Whether records list anyone after own: in line, or about to be (a process joining)."""
    mine = record_of(own)
    after = records[records.index(mine) + 1 :] if mine in records else records
    return any(queued_in(record) not in (None, own) for record in after)


def unlinked(fd: int) -> bool:
    """Whether the file open at fd is in the directory no more (its last user deleted it).

    The backend only ever deletes a line file or a ticket (never renames or
    replaces one), so one that still has a name has the name it was opened by.
    """
    return os.fstat(fd).st_nlink == 0


def _rewrite(
    fd: int, key: bytes | None, tickets: list[str], posts: dict[str, Post], ran: Ran | None
) -> None:
    """Write tickets over the line file's records and cut it to them, if the write is whole.

    The caller holds the exclusive lock. If the tickets would straddle a
    page boundary (see _PAGE), the file is left as it is (and is compacted
    once the line is shorter).
    """
    data = render(key, tickets, posts, ran)
    first = len(render(key, []))  # where the tickets start: the key's record stays as it was
    if first // _PAGE != (len(data) - 1) // _PAGE:
        return
    fcntl.fcntl(fd, fcntl.F_SETFL, 0)  # not O_APPEND: written from the start
    os.pwrite(fd, data, 0)
    # Cut after writing, never to zero first: ext4 flushes a file cut to zero on close.
    os.ftruncate(fd, len(data))


def unlink(directory: int, name: str) -> None:
    """Delete name in directory, if it is there."""
    try:
        os.unlink(name, dir_fd=directory)
    except FileNotFoundError:
        pass


def _remove(directory: int, name: str) -> bool:
    """Delete ticket FIFO name if it is still there (most are: their owners removed them).

    Looked up first: a lookup takes no lock of the directory, where a
    deletion, even of nothing, waits for every other process's. Returns
    whether it was there.
    """
    try:
        os.stat(name, dir_fd=directory, follow_symlinks=False)
    except FileNotFoundError:
        return False
    unlink(directory, name)
    return True


def _compact(where: Directory, digest: str, fd: int, own: str, gone: set[str], held: bool) -> None:
    """Drop gone tickets (and, if own held, those before it) from line file fd, or delete it.

    The caller holds the file's exclusive lock: no process is joining, so
    a mark without its ticket is a process that died joining (or own's).
    The file is deleted if no ticket stays in it.
    """
    records = read_records(fd)
    found = parse(records)
    if held and own in found.tickets:
        gone.update(found.tickets[: found.tickets.index(own)])
    # A process killed between two of its calls may have left its FIFO:
    # it goes before its record, so that no FIFO outlives the record of it.
    for ticket in found.unfinished:
        if _remove(where.fd, pipe_name(digest, ticket)) and ticket != own:
            died_joining(ticket, found.key, digest, where)  # made, and no record of it
    for ticket in gone:
        if ticket != own:  # (its FIFO is removed already)
            _remove(where.fd, pipe_name(digest, ticket))
    staying = [ticket for ticket in found.tickets if ticket not in gone]
    if not staying:
        os.unlink(line_name(digest), dir_fd=where.fd)  # under the lock: see the join's check
        return
    posts = {ticket: found.posts[ticket] for ticket in staying if ticket in found.posts}
    kept = len(staying) + len(posts) + (found.key is not None) + (found.ran is not None)
    if kept < len(records):
        _rewrite(fd, found.key, staying, posts, found.ran)


def _untidy(key: Hashable, where: Directory, error: Exception) -> None:
    """Log a tidy that failed: it is best effort, and the key's next turn tidies the line."""
    logger.debug(
        "inturn: could not tidy the line of key %s in %s: %s", describe(key), where.path, error
    )


def _tidy(
    where: Directory, digest: str, own: str, fd: int, serial: int, held: bool, alone: bool
) -> bool:
    """Drop the tickets that left from the line file, or delete it if nobody is in line.

    Done when no ticket behind own is in line any more, or the file grew
    long. fd is the line file as own queued in it (serial: its open's); it
    is closed here (and again by tidy_again, if an exception cuts that short).
    held: own held the key, so every ticket listed before it had left by
    then (and what left stays gone). Never waits: if another process
    holds the line file's lock, it is queueing (and will tidy after its
    turn) or tidying; only a file grown long is worth a few tries.

    Return True if the lock was taken and nobody may be left behind own:
    the other process may be a tidier that saw own still in line (so left
    the file to own), and own must try again shortly (see retry).

    alone: own, which held, read nobody but itself in the file just before it
    left (a turn on a free key): the exclusive lock is tried first, and the
    file deleted (or compacted: someone joined since) under it, with no
    ticket to look at first.
    """
    try:
        if alone and held and flock_now(fd, fcntl.LOCK_EX):
            if not unlinked(fd):
                _compact(where, digest, fd, own, {own}, held)
            return False
        if not flock_now(fd, fcntl.LOCK_SH):
            # A tidier holds it: if anyone queued behind own, that one
            # tidies after its turn; else own tries again (read unlocked:
            # records are appended whole, and this is only a hint).
            return not _behind(read_records(fd), own)
        # (If its last user deleted the file meanwhile, nobody is behind
        # own in it: that is found below, under the exclusive lock.)
        records = read_records(fd)
        mine = record_of(own)
        # Whose leaving is not known yet: if own held the key, those behind it.
        behind = records[records.index(mine) + 1 :] if held and mine in records else records
        long = len(records) > _COMPACT_AT
        gone = {own}
        # The newest first: in a busy line, the first one looked at is there.
        for record in reversed(behind):
            ticket = ticket_of(record)
            if ticket is None or ticket in gone:
                continue
            if not alive(where.fd, pipe_name(digest, ticket)):
                gone.add(ticket)
            elif not long:
                return False
        # Not atomic: the shared lock is let go first, so the file is read again.
        if not (flock_soon if long else flock_now)(fd, fcntl.LOCK_EX):
            # Taken by one queueing behind own (it tidies after its turn),
            # or by a tidier that may have seen own still in line.
            return not _behind(read_records(fd), own)
        if not unlinked(fd):
            _compact(where, digest, fd, own, gone, held)
    finally:
        close_tracked(fd, serial)
    return False


def withdraw(where: Directory, digest: str, own: str, fd: int, key: Hashable, serial: int) -> None:
    """Take the mark of own, whose join failed, out of line file fd (shared-locked); close fd.

    Needs no other descriptor (none may be left): it probes no ticket.
    If another process holds the lock, it is joining (and tidies after
    its turn) or tidying, and the mark reads as "died here" to the next
    tidy under the exclusive lock. Idempotent: fd is the file its open with
    serial opened, closed once (for surely).
    """
    if not is_open(fd, serial):
        return
    try:
        if flock_now(fd, fcntl.LOCK_EX) and not unlinked(fd):
            _compact(where, digest, fd, own, {own}, held=False)
    except OSError as error:
        _untidy(key, where, error)
    finally:
        close_tracked(fd, serial)


def retry(
    done: asyncio.Future[None],
    where: Directory,
    digest: str,
    own: str,
    key: Hashable,
    pause: float = 0.0,
    until: float | None = None,
    held: bool = True,
) -> None:
    """Tidy again after pause (the line file's lock was busy), until done or it is gone.

    At once (the loop's next round), then every millisecond, then less
    and less often, up to every 50 ms, for _RETRY_FOR (half a second) at
    most, on the loop's clock (``until``: when that ends): then it is left
    to the key's next turn, though the lock's holder (a process frozen
    mid-tidy) never lets go. done completes when it ends (also if it was
    cancelled). ``held``: as tidy_again's (False: own gave up waiting).
    """
    loop = done.get_loop()
    end = loop.time() + _RETRY_FOR if until is None else until

    def again() -> None:
        first, longest = LOCK_PAUSES
        if tidy_again(where, digest, own, key, held) and loop.time() < end:
            later = min(max(pause * 2, first), longest)
            retry(done, where, digest, own, key, later, end, held)
        else:
            _finish(done)

    loop.call_later(pause, again)


#: The threads of retry_aside that may run at once in a process: a tidy that would make one
#: more is left to its key's next turn.
_ASIDE = 8
_aside: threading.BoundedSemaphore


def _new_process() -> None:
    """None of retry_aside's threads runs (again, in a forked child: they stayed behind)."""
    global _aside
    _aside = threading.BoundedSemaphore(_ASIDE)


_new_process()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_process)


def retry_aside(
    where: Directory, digest: str, own: str, key: Hashable, held: bool = True
) -> threading.Thread | None:
    """As retry, for a release with no event loop: on a thread of its own, so the caller
    goes on at once; the thread (a daemon), or None if none was started.

    The same tries and pauses as retry's, slept by that thread: a releasing
    thread that tried again itself, yielding its CPU between tries, left
    the line for milliseconds on a busy machine, and the other processes
    took the key meanwhile (4 processes on 2 cores: 87% of turns went to
    the process that had just released). None is started, and the line
    file is left to the key's next turn, if _ASIDE run already, or if no
    thread can be started (at the interpreter's exit, at the limit of
    threads).
    """
    seats = _aside
    if not seats.acquire(blocking=False):
        return None

    def again() -> None:
        try:
            end = time.monotonic() + _RETRY_FOR
            pause, longest = LOCK_PAUSES
            while tidy_again(where, digest, own, key, held) and time.monotonic() < end:
                time.sleep(pause)
                pause = min(pause * 2, longest)
        finally:
            seats.release()

    tidier = threading.Thread(target=again, name="inturn-file-tidy", daemon=True)
    try:
        tidier.start()
    except RuntimeError as error:  # (no thread can be started now)
        seats.release()
        _untidy(key, where, error)
        return None
    return tidier


def retry_soon(where: Directory, digest: str, own: str, key: Hashable) -> None:
    """Tidy again shortly after own gave up waiting (see retry): on the running event loop's
    timer, if there is one, else on a thread of its own (see retry_aside)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        retry_aside(where, digest, own, key, held=False)
        return
    retry(loop.create_future(), where, digest, own, key, held=False)


def tidy_again(
    where: Directory,
    digest: str,
    own: str,
    key: Hashable,
    held: bool = True,
    line_fd: int = -1,
    serial: int = 0,
    alone: bool = False,
) -> bool:
    """Tidy digest's (key's) line file after own left it; whether it was busy (see _tidy).

    Opened again, unless line_fd is it (serial: its open's). It is closed
    here, whatever lands meanwhile: left open, its lock would hold up every
    tidy of the line for as long as the process lives. Best effort: an error
    is logged (see _untidy), and the key's next turn tidies. alone: see _tidy.
    """
    if line_fd < 0:
        serial = new_serial()
    try:
        if line_fd < 0:
            line_fd = open_tracked(line_name(digest), OPEN_TIDY, where.fd, serial)
        return _tidy(where, digest, own, line_fd, serial, held, alone)
    except FileNotFoundError:  # deleted: nothing is left
        return False
    except OSError as error:  # (no descriptor left, say)
        _untidy(key, where, error)
        return False
    except BaseException:  # (_tidy closes it; if it was cut short, it is closed here)
        surely(close_tracked, line_fd, serial)  # whatever lands (fd -1: found by its serial)
        raise
