"""A file backend's turn in a key's line: its steps, written once, and their two drivers.

Taking a turn (taking) is a sans-IO generator of steps: every system call
of FileBackend.acquire and acquire_sync. Where a step would block, it
yields what it waits for (_Locked, _Left); drive (a task, in its event
loop) or drive_blocking (a thread) waits and sends the answer. Leaving
(leave) never waits: it hands the key on and tidies the line up
(``_tidy.py``). ``__init__.py`` tells how a line is kept, and why it is safe.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Generator, Hashable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, final

from ..._checks import Waited, missed
from ..._describe import describe
from ..._order import portable_name
from ..._surely import surely
from .._base import Newest, Replaced
from ._deaths import died
from ._directory import Directory
from ._fds import (
    OPEN_TIDY,
    close_tracked,
    is_open,
    line_in_place_of,
    new_serial,
    open_tracked,
)
from ._latest import judge
from ._linefile import (
    Post,
    Ran,
    alone_in,
    joined,
    joining,
    line_name,
    new_ticket,
    pipe_name,
    ran_record,
    read_records,
    record_of,
    ticket_of,
)
from ._locks import flock_now, flock_soon, lock, lock_blocking
from ._tickets import (
    LEAVING,
    alive,
    hand_off,
    handed,
    probe,
    until_left,
    until_left_blocking,
)
from ._tidy import retry_soon, tidy_again, unlink, unlinked, withdraw

if sys.platform != "win32":  # (the file backend refuses other platforms at construction)
    import fcntl

logger = logging.getLogger("inturn.file")

#: A ticket's time (inspect's "held for") is when it queued, unless its turn
#: came later than this (seconds): then it is set to when the turn began.
#: So the holder's time is right to 0.05 s, at no cost to a turn that came soon.
_LATE = 0.05
#: How a line file is opened: for appending, made if missing, never through a link.
_OPEN_LINE = os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
#: How a ticket's owner opens it: as its writer (O_RDWR: without waiting for a reader).
_OPEN_TICKET = os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC

#: The longest a release of latest work waits to record what ran (see _record_ran): a
#: tidier holds the line file's lock for a few system calls.
_RAN_WAIT = 1.0
#: A line file's identity: its device and inode numbers.
_Identity = tuple[int, int]


@final
class Home:
    """The directory a backend keeps its lines in: made and checked at its first use, and
    again if it is removed."""

    __slots__ = ("_finding", "_where", "given")

    def __init__(self, given: Path) -> None:
        #: The directory as the user named it (absolute): found again, with the same checks.
        self.given = given
        self._where: Directory | None = None  # as last found (see _directory.Directory)
        self._finding = threading.Lock()  # held while a thread finds the directory

    @property
    def where(self) -> Directory:
        """The directory as it was last found: made, checked and opened at the first use.

        :raises OSError: as _directory.Directory.open (naming the directory and the fix).
        """
        where = self._where
        if where is None:
            with self._finding:
                where = self._where
                if where is None:
                    where = self._where = Directory.open(self.given)
        return where

    def again(self, lost: Directory, key: Hashable) -> Directory:
        """The directory, made and checked again: lost was removed (found by a turn on key).

        Once for every thread and loop that found lost removed: the first
        makes it again, the others take that one.
        """
        with self._finding:
            found = self._where
            if found is lost or found is None:
                logger.warning(
                    "inturn: the directory %s was removed while in use (by a cleaner of "
                    "temporary files?); a turn on key %s makes it again. A turn held "
                    "meanwhile may have lost its exclusion",
                    lost.path,
                    describe(key),
                )
                found = self._where = Directory.open(self.given)
            return found

    @property
    def found(self) -> bool:
        """Whether the directory was found (made and checked) by a first use."""
        return self._where is not None

    @property
    def shown(self) -> Path:
        """Where the lines are, for a repr: as found, or as given while not yet used."""
        where = self._where
        return self.given if where is None else where.path

    def __repr__(self) -> str:
        return f"Home({str(self.shown)!r})"


@final
class Place:
    """A turn's place in its key's line: its ticket, kept open for writing while it holds."""

    __slots__ = ("digest", "fd", "line", "lost", "ran", "serial", "ticket", "where")

    def __init__(
        self, where: Directory, digest: str, ticket: str, fd: int, line: _Identity, serial: int
    ) -> None:
        self.where = where  # the directory of its ticket and its line file
        self.digest = digest  # of its key's portable name: names the line file
        self.ticket = ticket
        self.fd = (
            fd  # the writer end of its ticket: open while it holds, its one file; -1 once left
        )
        self.line = line  # the identity of its line file, as it queued in it
        self.serial = serial  # its ticket's open's (see _fds): closed once, whatever comes
        self.lost = False  # (once left) whether its files were gone when it left
        self.ran: Ran | None = None  # latest work that ran in its turn: recorded as it leaves

    def __repr__(self) -> str:
        state = "left" if self.fd < 0 else "in line"
        return f"<Place ticket={self.ticket} line={self.digest[:16]} {state}>"


class _Locked(NamedTuple):
    """A wait of taking: until fd's flock in mode is taken (answer: b"")."""

    fd: int
    mode: int


class _Left(NamedTuple):
    """A wait of taking: until ticket fd's owner has left (answer: what it carried)."""

    fd: int


#: What a turn's steps return: its grant, made of its token and its place (see taking).
G = TypeVar("G")
#: The steps of a turn (see taking): they yield waits, and return its grant.
Taking = Generator[_Locked | _Left, bytes, G]


async def drive(steps: Taking[G], key: Hashable, timeout: float | None) -> G:
    """Run the steps of key's turn to their end in the event loop, within timeout.

    An error (a missed deadline, a cancellation) leaves steps to the caller
    to close: the ticket then leaves the line.
    """
    deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout

    def expired() -> TimeoutError:
        return missed((key,), Waited.LINE, timeout)

    try:
        wait = next(steps)
        while True:
            if isinstance(wait, _Locked):
                await lock(wait.fd, wait.mode, deadline, expired)
                wait = steps.send(b"")
            else:
                wait = steps.send(await until_left(wait.fd, deadline, expired))
    except StopIteration as taken:
        took: G = taken.value
        return took


def drive_blocking(steps: Taking[G], key: Hashable, timeout: float | None) -> G:
    """As drive, blocking this thread while it waits."""
    deadline = None if timeout is None else time.monotonic() + timeout

    def expired() -> TimeoutError:
        return missed((key,), Waited.LINE, timeout)

    try:
        wait = next(steps)
        while True:
            if isinstance(wait, _Locked):
                lock_blocking(wait.fd, wait.mode, deadline, expired)
                wait = steps.send(b"")
            else:
                wait = steps.send(until_left_blocking(wait.fd, deadline, expired))
    except StopIteration as taken:
        took: G = taken.value
        return took


def taking(
    home: Home,
    key: Hashable,
    grant: Callable[[Hashable, int, Place], G],
    into: list[Any] | None = None,
    newest: Newest | None = None,
) -> Taking[G]:
    """Take key's turn: every system call of acquire and acquire_sync, written once.

    Where a step would block, it yields what it waits for (see _Locked,
    _Left); its driver waits, in an event loop or in a thread, and
    sends the answer. A driver whose wait fails (timeout, cancellation,
    an exception from a signal handler) closes it: GeneratorExit at the
    wait runs the same clean-up as any error, so the ticket leaves the line.
    Returns grant(key, token, place): the token to hold with and its place
    in line, made into a grant here, in the steps, so that an interrupt at
    any call before the grant exists (a signal handler's exception at the
    start of a Python function) leaves the line too: nothing of a turn that
    its caller never got stays held. With ``into`` (a thread's), the grant
    goes into it as it is made (see BlockingBackend.acquire_sync): on its way
    up from here, CPython may raise a signal handler's exception after any
    call returns (3.10 does), and the caller's clean-up then finds it there.

    With ``newest`` (a turn of latest work shared across processes, see
    ``_latest.py``), its ticket carries a post of its process's newest work,
    and once its turn comes it runs that work, joins the line again behind
    newer work, or raises Replaced: newer work ran.
    """
    begun = time.monotonic()
    name = portable_name(key)
    digest = hashlib.sha256(name).hexdigest()
    ticket = new_ticket()
    post = None if newest is None else Post(ticket, newest(), fresh=False)
    places: list[Place] = []  # every place it joined, its own the last (see _join)
    try:
        records = yield from _join(home, key, name, digest, ticket, post, places)
        again = 0
        while True:
            place = places[-1]
            before = records[: records.index(record_of(place.ticket))]
            token = yield from _wait_behind(key, place.where, digest, before)
            if newest is None:
                break
            me = newest()
            judged = yield from _judged(place.where, digest, place.ticket, me, again)
            if judged is True:
                break
            if judged is not False:
                raise Replaced(key, judged.called, judged.ok)  # noqa: TRY301 - it leaves below
            again += 1  # newer work waits behind: in line behind it, then the key goes on
            ticket = new_ticket()
            post = Post(ticket, me, fresh=True)
            records = yield from _join(home, key, name, digest, ticket, post, places)
            _give_up([place], key)
        if time.monotonic() - begun > _LATE:
            os.utime(place.fd)  # the ticket's time is when its turn began: for inspect
        made = [] if into is None else into
        made.extend(map(grant, (key,), (token,), (place,)))  # NOTE: one step (see into)
        taken: G = made[-1]
    except BaseException:
        _give_up(places, key)  # (a grant in into is left already when its caller releases it)
        raise
    return taken


def _give_up(places: list[Place], key: Hashable) -> None:
    """Leave the lines places joined: with no writer, the tickets behind skip their tickets.

    Each place is left then (its fd -1): a grant of it that went to its caller
    nevertheless (see taking's into) is released as a no-op (see leave). The
    leaving completes however often an exception is thrown into the thread
    meanwhile (see _leave); the tidy after it is best effort.
    """
    staying = [place for place in places if place.fd >= 0]
    if not staying:
        return
    surely(_leave, staying)
    for place in staying:
        where, digest, ticket = place.where, place.digest, place.ticket
        if tidy_again(where, digest, ticket, key, held=False):
            retry_soon(where, digest, ticket, key)  # (a tidier that saw it in line holds it)


def _leave(places: list[Place]) -> None:
    """Close each place's ticket, said to be leaving (see _quit), and remove its FIFO; then
    mark the place left. Idempotent (a ticket is closed by its open's serial), for surely:
    a writer left open would hold up the line behind it for as long as the process lives."""
    for place in places:
        fd = place.fd
        if fd >= 0 and is_open(fd, place.serial):
            _quit(fd)  # (twice, if an exception came between: it reads the same)
            close_tracked(fd, place.serial)
        unlink(place.where.fd, pipe_name(place.digest, place.ticket))
        place.fd = -1


def _join(
    home: Home,
    key: Hashable,
    name: bytes,
    digest: str,
    ticket: str,
    post: Post | None,
    places: list[Place],
) -> Generator[_Locked | _Left, bytes, list[str]]:
    """Queue ticket in key's line file (name: the key's portable name), in home's directory;
    with post, its post of latest work beside it (in the same append).

    Its place goes into places as it is made (the ticket's writer fd is the
    one descriptor a turn keeps: the line file is closed once ticket is in
    it): an exception from here on, even one thrown into the thread as this
    returns, finds it there, for the caller to give up. Returns the line
    file's records as they were once ticket was in. If it fails, nothing it
    made stays: its FIFO is removed, and its mark withdrawn (see
    _tidy.withdraw).
    """
    where = home.where
    line = line_name(digest)
    pipe = pipe_name(digest, ticket)
    while True:
        # Its opens' serials, known before them: a clean-up finds a file by its serial,
        # also one whose descriptor it never got; once closed, never closed again.
        serial, ticket_serial = new_serial(), new_serial()
        line_fd = fd = -1
        marked = False
        try:
            line_fd = _open_line(where, line, serial)
            if not flock_soon(line_fd, fcntl.LOCK_SH):
                yield _Locked(line_fd, fcntl.LOCK_SH)
            info = os.fstat(line_fd)
            if info.st_nlink == 0:  # deleted by its last user meanwhile: open it again
                close_tracked(line_fd, serial)
                continue
            _check_regular(where, line, info)
            # The mark first, then the FIFO: a crash between leaves a mark, not a stray FIFO.
            os.write(line_fd, joining(ticket, name if info.st_size == 0 else None))
            marked = True
            os.mkfifo(pipe, 0o600, dir_fd=where.fd)
            fd = open_tracked(pipe, _OPEN_TICKET, where.fd, serial=ticket_serial)
            os.write(line_fd, joined(ticket, post))  # one append: atomic
            records = read_records(line_fd)
            fcntl.flock(line_fd, fcntl.LOCK_UN)
            identity = (info.st_dev, info.st_ino)
            places.append(Place(where, digest, ticket, fd, identity, ticket_serial))  # NOTE
        except BaseException as error:
            if places and places[-1].ticket == ticket:  # (its files go below: left already)
                places[-1].fd = -1
            opened = (line_fd, serial, fd, ticket_serial)
            surely(_unjoin, where, digest, ticket, key, opened, marked)
            if isinstance(error, FileNotFoundError) and (line_fd < 0 or where.gone()):
                where = home.again(where, key)  # the directory was removed
                continue
            raise
        try:  # (opened again to tidy: a turn keeps one descriptor, its ticket)
            close_tracked(line_fd, serial)
        except BaseException:  # interrupted: in line, it leaves as any turn that gives up
            surely(close_tracked, line_fd, serial)  # (a no-op if it was closed just before)
            _give_up(places[-1:], key)
            raise
        return records


def _unjoin(
    where: Directory,
    digest: str,
    ticket: str,
    key: Hashable,
    opened: tuple[int, int, int, int],
    marked: bool,
) -> None:
    """Undo a join that failed (or was interrupted): close its ticket, remove its FIFO (if
    it made one), and withdraw its mark (if it wrote one), closing its line file.
    Idempotent (files closed by their opens' serials), for surely: a descriptor left open
    would hold the line file's lock, or the ticket's writer, for as long as the process lives.

    opened: its line file's descriptor and its open's serial, then its ticket's (a
    descriptor -1 where the join never got it: see _fds.close_tracked).
    """
    line_fd, serial, fd, ticket_serial = opened
    close_tracked(fd, ticket_serial)
    unlink(where.fd, pipe_name(digest, ticket))  # (a FIFO it never made is not there)
    if marked and line_fd >= 0 and is_open(line_fd, serial):
        withdraw(
            where, digest, ticket, line_fd, key, serial
        )  # (no descriptor left for its FIFO, say)
    else:
        close_tracked(line_fd, serial)


def _judged(
    where: Directory, digest: str, ticket: str, me: int, again: int
) -> Generator[_Locked | _Left, bytes, Ran | bool]:
    """Judge ticket's turn of latest work, come (see _latest.judge): its line file read under
    the shared lock (a compaction may be rewriting it), its posts' tickets looked at after."""
    serial, fd = new_serial(), -1
    try:
        fd = open_tracked(line_name(digest), OPEN_TIDY, where.fd, serial)
        if not flock_soon(fd, fcntl.LOCK_SH):
            yield _Locked(fd, fcntl.LOCK_SH)
        records = read_records(fd)
        close_tracked(fd, serial)  # (the lock goes with it)
    except BaseException:
        surely(close_tracked, fd, serial)  # whatever lands (fd -1: found by its serial)
        raise
    directory = where.fd
    return judge(
        records, ticket, me, again, lambda other: alive(directory, pipe_name(digest, other))
    )


def _wait_behind(
    key: Hashable, where: Directory, digest: str, before: list[str]
) -> Generator[_Locked | _Left, bytes, int]:
    """Wait until no ticket listed in before has a writer; return the token to hold with.

    A ticket closed without a word (no hand-off, no leaving) tells that
    its owner died in line: logged once this process knows whether it
    was holding (see _deaths.died).
    """
    directory = where.fd
    dead: list[str] | None = None  # such tickets met, nearest first (rare: made then)
    for record in reversed(before):
        ticket = ticket_of(record)
        if ticket is None:
            continue  # the key, a mark, or a piece that a crash left
        fd, data = probe(directory, pipe_name(digest, ticket))
        if data is None:
            continue  # gone: its owner left, and removed it
        if fd is not None:
            if dead:  # they were behind one still in line: they were waiting
                died(key, where, dead, held=False)
                dead = None
            try:
                if handed(data) is None:  # (else it is handing the key on already)
                    data += yield _Left(fd)
            finally:
                os.close(fd)
        token = handed(data)
        if token is not None:
            # It held the key, so every ticket before it has left too.
            if dead:  # (they never read its hand-off: they were waiting)
                died(key, where, dead, held=False)
            return max(token + 1, time.time_ns())
        if not data:
            if dead is None:
                dead = []
            dead.append(ticket)
    if dead:
        died(key, where, dead, held=True)
    return time.time_ns()


def leave(place: Place, key: Hashable, token: int) -> tuple[Directory, str, str, Hashable] | None:
    """Hand key on (token: the holder's) and tidy place's line file: a release's system calls.

    Returns where, digest, ticket and key of a line whose tidy must be
    tried again shortly (see _tidy.retry), else None (also for a place
    left already). place.lost tells whether its files were gone meanwhile.
    Its ticket and its line file are closed whatever lands meanwhile (by
    their opens' serials): left open, the one would hold up the line, the
    other every tidy of it, for as long as the process lives.
    """
    serial, line_fd = new_serial(), -1  # its line file's open, to come (see _fds)
    fd, place.fd = place.fd, -1  # NOTE: the try at once (no point where an exception lands)
    try:
        if fd < 0:
            return None
        where, digest, ticket = place.where, place.digest, place.ticket
        # Before the hand-off: once it is written, the next holder may tidy both away.
        line_fd, records = _own_line(where, digest, ticket, place.line, serial)
        replaced = records is None
        place.lost = replaced or unlinked(fd)
        if place.ran is not None and not replaced:  # (latest work: before anyone may hold)
            _record_ran(line_fd, place.ran, key, where)
        os.write(fd, hand_off(token))  # whoever waits on this ticket goes on
        if line_fd < 0 and not replaced:  # no descriptor was left for it: the ticket's is
            line_fd = line_in_place_of(fd, where, digest, serial)
        else:
            close_tracked(fd, place.serial)
        unlink(where.fd, pipe_name(digest, ticket))
        if place.lost:
            logger.warning(
                "inturn: the files of the turn on key %s in %s were deleted while it held "
                "(by another process of this user, or a cleaner of the directory): another "
                "process may have held the key meanwhile; the turn ends with LeaseLost",
                describe(key),
                where.path,
            )
        # Whether anyone queued behind this turn, as its line file was read (see _own_line).
        behind = bool(records and records[-1] != record_of(ticket))
        if behind:
            # Someone queued behind this turn, and was most likely just
            # handed the key: let it have this CPU first. Its work holds
            # up the whole line; this process's tidy and next turn do
            # not. (A no-op on an idle CPU; on a busy one, 8 processes
            # on 2 cores, it is worth 10% of a line's turns per second.)
            os.sched_yield()
        if replaced:  # not the file it queued in: left to whoever is in it
            if line_fd >= 0:
                close_tracked(line_fd, serial)
            return None
        alone = records is not None and alone_in(records, ticket)
        busy = tidy_again(where, digest, ticket, key, line_fd=line_fd, serial=serial, alone=alone)
    except BaseException:
        surely(close_tracked, fd, place.serial)  # (each a no-op if it was closed already)
        surely(close_tracked, line_fd, serial)  # (fd -1: found by its serial)
        unlink(place.where.fd, pipe_name(place.digest, place.ticket))
        raise
    return (where, digest, ticket, key) if busy else None


def _record_ran(fd: int, ran: Ran, key: Hashable, where: Directory) -> None:
    """Append what ran to line file fd (-1: none), under the shared lock (a compaction
    meanwhile would cut it off), waiting for a tidier's few system calls _RAN_WAIT at most.

    Not recorded (logged), the turns of older work behind it would run theirs after it.
    """
    if fd >= 0:
        try:
            if not flock_soon(fd, fcntl.LOCK_SH):
                lock_blocking(fd, fcntl.LOCK_SH, time.monotonic() + _RAN_WAIT, TimeoutError)
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, os.O_APPEND)  # (opened to tidy: see _rewrite)
                os.write(fd, ran_record(ran))
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError:  # (TimeoutError included)
            pass
        else:
            return
    logger.warning(
        "inturn: the turn of latest work on key %s in %s could not record that its work "
        "ran (no file descriptor left, or its line file was locked for %g s): older work "
        "waiting in another process may run after it",
        describe(key),
        where.path,
        _RAN_WAIT,
    )


def deleted(place: Place) -> bool:
    """Whether the ticket or the line file of place, still in line, was deleted or replaced."""
    if unlinked(place.fd):
        return True
    serial, fd = new_serial(), -1
    try:
        fd, records = _own_line(place.where, place.digest, place.ticket, place.line, serial)
        if fd >= 0:
            close_tracked(fd, serial)
    except BaseException:
        surely(close_tracked, fd, serial)  # whatever lands (fd -1: found by its serial)
        raise
    return records is None


def _own_line(
    where: Directory, digest: str, ticket: str, line: _Identity, serial: int
) -> tuple[int, list[str] | None]:
    """Open digest's line file, which ticket is in, under serial (see _fds.new_serial): (fd,
    its records), records None if replaced.

    Replaced: the file at its name is not the one ticket queued in (the
    identity line), or does not list ticket (a file made anew may get the
    inode number of the one deleted, and ext4 gives it at once). fd is -1
    if there is none (deleted: replaced), or no descriptor is left (then
    only its identity is compared, by its name, and its records are []).
    """
    try:
        fd = open_tracked(line_name(digest), OPEN_TIDY, where.fd, serial)
    except FileNotFoundError:
        return -1, None
    except OSError:
        try:
            info = os.stat(line_name(digest), dir_fd=where.fd, follow_symlinks=False)
        except FileNotFoundError:
            return -1, None
        return -1, [] if (info.st_dev, info.st_ino) == line else None
    try:
        info = os.fstat(fd)
        return fd, None if (info.st_dev, info.st_ino) != line else _listing(fd, ticket)
    except BaseException:
        close_tracked(fd, serial)
        raise


def _listing(fd: int, ticket: str) -> list[str] | None:
    """Line file fd's records if they list ticket (read again under the shared lock if they
    seem not to), else None.

    Read without the lock, a compaction that writes meanwhile may tear the
    record; if a tidier holds the lock, it cannot be read again: the file,
    the one ticket queued in, is trusted to list it still.
    """
    record = record_of(ticket)
    records = read_records(fd)
    if record in records or not flock_now(fd, fcntl.LOCK_SH):
        return records
    try:
        records = read_records(fd)
        return records if record in records else None
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _open_line(directory: Directory, name: str, serial: int) -> int:
    """Open (making it if missing) the line file name in directory; it is tracked (_fds)."""
    try:
        return open_tracked(name, _OPEN_LINE, directory.fd, serial=serial)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise PermissionError(
                f"inturn: the line file {directory.path / name} is a symbolic link, which "
                "inturn never follows: another process of this user put it there. Remove it"
            ) from None
        raise


def _check_regular(directory: Directory, name: str, info: os.stat_result) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise PermissionError(
            f"inturn: the line file {directory.path / name} is not a regular file: another "
            "process of this user put it there. Remove it"
        )


def _quit(fd: int) -> None:
    """Say, in ticket fd, that its waiter gives up (see _tickets: LEAVING); it is closed next."""
    try:
        os.write(fd, LEAVING)
    except OSError:
        pass  # then it reads as a death in the log: nothing else depends on it
